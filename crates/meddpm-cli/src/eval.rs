//! `meddpm eval`: synthesis-quality report for generated volumes against real ones.
//!
//! Reads NIfTI files (or folders of them) with `meddpm::data::read_volume`, runs
//! `meddpm::eval::evaluate` (MONAI-definition SSIM/MS-SSIM, PSNR/MAE whole and inside the mask,
//! linear MMD, per-label Wasserstein-1 and means, diversity; conventions in
//! `crates/meddpm/src/eval/report.rs`) and writes `<out>/eval.json`, `<out>/eval.md` and a PNG
//! panel `<out>/eval_panel.png` (mask | real | up to 4 samples; mid-slices in three planes, each
//! intensity column windowed to its own min..max, see `meddpm::data::preview`).
//!
//! NIfTI volumes are (X,Y,Z) with X fastest, which is the (D,H,W) = (Z,Y,X) C-order array the
//! metrics expect; the report lists dims as D×H×W.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use meddpm::data::preview::{write_png, Kind};
use meddpm::data::{read_volume, Volume};
use meddpm::eval::labels_from_f32;
use meddpm::eval::report::{evaluate, pair_index, range_fit, EvalSettings, NamedLabels, NamedVolume};

#[derive(clap::Args, Debug, Clone)]
pub struct EvalArgs {
    /// Real volume(s): .nii/.nii.gz files and/or folders holding them.
    #[arg(long, required = true, num_args = 1..)]
    pub real: Vec<PathBuf>,
    /// Generated volume(s): .nii/.nii.gz files and/or folders holding them. With several real
    /// volumes, a generated file pairs with the real file whose name is its prefix
    /// (`sample_3.nii.gz` ← `sample_3_s0.nii.gz`).
    #[arg(long, required = true, num_args = 1..)]
    pub generated: Vec<PathBuf>,
    /// Label mask shared by all volumes (0 background; Med-DDPM: 1 head/brain, 2 tumour).
    #[arg(long)]
    pub mask: Option<PathBuf>,
    /// Output folder (created): eval.json, eval.md, eval_panel.png.
    #[arg(long)]
    pub out: PathBuf,
    /// Intensity range mapped to [0,1] before every metric: "LO,HI" (Med-DDPM images: -1,1)
    /// or "auto" (min..max over the real volumes); refused when most real voxels fall outside it.
    #[arg(long, default_value = "-1,1", allow_hyphen_values = true)]
    pub range: String,
    /// SSIM and MS-SSIM window size, 1 to 99 [default: SSIM 11 (or the largest odd size the volume
    /// holds), MS-SSIM the largest odd k ≤ 11 that fits its 5 scales (7 at 128³); the report says which].
    #[arg(long, allow_negative_numbers = true, value_parser = crate::args::whole_usize(1, 99))]
    pub kernel_size: Option<usize>,
    /// Do not write the PNG panel.
    #[arg(long)]
    pub no_panel: bool,
}

fn is_nifti(p: &Path) -> bool {
    let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
    n.ends_with(".nii") || n.ends_with(".nii.gz")
}

/// Files named by `args`: files as given, folders expanded to their NIfTI files (sorted).
fn expand(what: &str, args: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for a in args {
        if a.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(a)
                .with_context(|| format!("--{what}: reading folder {}", a.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && is_nifti(p))
                .collect();
            files.sort();
            if files.is_empty() {
                bail!("--{what}: folder {} holds no .nii/.nii.gz files", a.display());
            }
            out.extend(files);
        } else if a.is_file() {
            out.push(a.clone());
        } else {
            bail!("--{what}: {} is neither a file nor a folder", a.display());
        }
    }
    Ok(out)
}

fn load(path: &Path) -> anyhow::Result<(NamedVolume, Volume)> {
    let v = read_volume(path)?;
    let [x, y, z] = v.dims;
    let name = path.display().to_string();
    Ok((NamedVolume { name, dims: [z, y, x], data: v.data.clone() }, v))
}

fn parse_range(s: &str, real: &[NamedVolume]) -> anyhow::Result<[f64; 2]> {
    if s == "auto" {
        let (lo, hi) = real
            .iter()
            .flat_map(|v| v.data.iter())
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
        if hi <= lo {
            bail!("--range auto: the real volumes are constant ({lo}); give --range LO,HI");
        }
        return Ok([lo as f64, hi as f64]);
    }
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    let parsed: Vec<f64> = parts.iter().filter_map(|p| p.parse::<f64>().ok()).collect();
    match parsed[..] {
        [lo, hi] if parts.len() == 2 && lo.is_finite() && hi.is_finite() && hi > lo => Ok([lo, hi]),
        _ => bail!("--range must be \"LO,HI\" with LO < HI, or \"auto\"; got {s:?}"),
    }
}

pub fn run(a: &EvalArgs) -> anyhow::Result<()> {
    let real_files = expand("real", &a.real)?;
    let gen_files = expand("generated", &a.generated)?;
    eprintln!("eval: {} real, {} generated volume(s)", real_files.len(), gen_files.len());
    let (real, real_vols): (Vec<_>, Vec<_>) =
        real_files.iter().map(|p| load(p)).collect::<anyhow::Result<Vec<_>>>()?.into_iter().unzip();
    let range = parse_range(&a.range, &real)?;
    let (outside, [lo, hi]) = range_fit(&real, range);
    if outside > 0.5 {
        bail!(
            "--range {},{}: {:.0} % of the real voxels fall outside it (they span {lo}..{hi}); give --range auto or \
             --range {lo},{hi} for these intensities",
            range[0],
            range[1],
            100.0 * outside
        );
    } else if outside > 0.01 {
        eprintln!(
            "warning: --range {},{}: {:.1} % of the real voxels fall outside it (they span {lo}..{hi}); they are clipped",
            range[0],
            range[1],
            100.0 * outside
        );
    }
    let settings = EvalSettings { intensity_range: range, kernel_size: a.kernel_size };
    let (gens, gen_vols): (Vec<_>, Vec<_>) =
        gen_files.iter().map(|p| load(p)).collect::<anyhow::Result<Vec<_>>>()?.into_iter().unzip();
    let mask_vol = a.mask.as_ref().map(read_volume).transpose()?;
    let mask = match (&a.mask, &mask_vol) {
        (Some(p), Some(m)) => {
            let name = p.display().to_string();
            let [x, y, z] = m.dims;
            Some(NamedLabels { labels: labels_from_f32(&name, &m.data)?, name, dims: [z, y, x] })
        }
        _ => None,
    };

    let t0 = std::time::Instant::now();
    let mut report = evaluate(&real, &gens, mask.as_ref(), &settings)?;
    eprintln!("eval: metrics in {:.1} s", t0.elapsed().as_secs_f64());

    // Geometry differences are not errors (the metrics only need equal grids) but worth a note.
    let r0 = &real_vols[0];
    for (v, n) in real_vols.iter().chain(&gen_vols).zip(real.iter().chain(&gens)) {
        if v.spacing.iter().zip(&r0.spacing).any(|(a, b)| (a - b).abs() > 1e-4 * b.abs().max(1.0)) {
            report.notes.push(format!(
                "{}: voxel spacing {:?} differs from {:?} of {}",
                n.name, v.spacing, r0.spacing, real[0].name
            ));
        }
    }

    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let json = a.out.join("eval.json");
    let md = a.out.join("eval.md");
    std::fs::write(&json, report.to_json()).with_context(|| format!("writing {}", json.display()))?;
    let markdown = report.to_markdown();
    std::fs::write(&md, &markdown).with_context(|| format!("writing {}", md.display()))?;

    if !a.no_panel {
        // mask | first real | up to 4 generated volumes paired with it (else the first 4)
        let names: Vec<&str> = real.iter().map(|v| v.name.as_str()).collect();
        let mut picked: Vec<usize> =
            (0..gens.len()).filter(|&i| pair_index(&gens[i].name, &names) == Some(0)).collect();
        if picked.is_empty() {
            picked = (0..gens.len()).collect();
        }
        let mut cols: Vec<(&Volume, Kind)> = Vec::new();
        if let Some(m) = &mask_vol {
            cols.push((m, Kind::Labels));
        }
        cols.push((&real_vols[0], Kind::Intensity));
        cols.extend(picked.iter().take(4).map(|&i| (&gen_vols[i], Kind::Intensity)));
        let png = a.out.join("eval_panel.png");
        write_png(&png, &cols)?;
        eprintln!("eval: wrote {}", png.display());
    }
    println!("{markdown}");
    eprintln!("eval: wrote {} and {}", json.display(), md.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_parsing() {
        let r = vec![NamedVolume { name: "r".into(), dims: [1, 1, 2], data: vec![-3.0, 5.0] }];
        assert_eq!(parse_range("-1,1", &r).unwrap(), [-1.0, 1.0]);
        assert_eq!(parse_range(" 0 , 255 ", &r).unwrap(), [0.0, 255.0]);
        assert_eq!(parse_range("auto", &r).unwrap(), [-3.0, 5.0]);
        for bad in ["1,1", "2,1", "x,1", "1", "1,2,3", "nan,1"] {
            assert!(parse_range(bad, &r).is_err(), "{bad}");
        }
        let c = vec![NamedVolume { name: "c".into(), dims: [1, 1, 2], data: vec![2.0, 2.0] }];
        assert!(parse_range("auto", &c).is_err());
    }
}
