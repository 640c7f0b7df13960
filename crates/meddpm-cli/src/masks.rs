//! `meddpm masks`: new conditioning masks by tumour scaling and shifting, as the reference's
//! `mask_generator.ipynb` makes them for its segmentation study (spec §5.3). The algorithms live
//! in `meddpm::data::masks`; this module lists inputs, runs the grid and writes uint8 masks.
//!
//! Outputs follow the notebook's names: `<out>/scaled/<scale>_<name>` (scale printed like
//! numpy, e.g. `2.0`, `1.9210526315789473`) and `<out>/shifted/<dx>_<dy>_<dz>__<name>` (shift
//! in NIfTI voxel axes x, y, z).

use anyhow::{bail, Context, Result};
use meddpm::data::dataset::list_nifti;
use meddpm::data::masks::{linspace, scale_tumour, shift_grid, shift_tumour, Labels};
use meddpm::data::nifti::{read_volume, write_labels};
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Scale,
    Shift,
    Both,
}

/// Make new masks by scaling and/or shifting the tumour of existing ones.
#[derive(clap::Args, Debug, Clone)]
pub struct MasksArgs {
    /// A mask file, or a folder of .nii/.nii.gz masks.
    #[arg(short, long)]
    pub input: PathBuf,
    /// Output folder (gets scaled/ and shifted/ subfolders).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Which augmentation to run.
    #[arg(long, value_enum, default_value = "both")]
    pub mode: Mode,
    /// First tumour scale (the notebook: linspace(2.0, 0.5, 20)).
    #[arg(long, default_value_t = 2.0)]
    pub scale_start: f64,
    /// Last tumour scale.
    #[arg(long, default_value_t = 0.5)]
    pub scale_end: f64,
    /// Number of scales.
    #[arg(long, default_value_t = 20)]
    pub num_scales: usize,
    /// Keep a scaled mask only with at least this many tumour voxels.
    #[arg(long, default_value_t = 30)]
    pub min_voxels: usize,
    /// Shifts run from -range to +range voxels on each axis.
    #[arg(long, default_value_t = 40)]
    pub shift_range: i64,
    /// Shift step in voxels.
    #[arg(long, default_value_t = 10)]
    pub shift_step: i64,
    /// Label of the head/brain region.
    #[arg(long, default_value_t = 1)]
    pub head_label: u8,
    /// Label of the tumour.
    #[arg(long, default_value_t = 2)]
    pub tumour_label: u8,
}

fn file_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

pub fn run(a: &MasksArgs) -> Result<()> {
    if a.shift_step <= 0 || a.shift_range < 0 {
        bail!("--shift-step must be > 0 and --shift-range >= 0 (got {} and {})", a.shift_step, a.shift_range);
    }
    if a.head_label == a.tumour_label {
        bail!("--head-label and --tumour-label are both {}", a.head_label);
    }
    let inputs = if a.input.is_dir() { list_nifti(&a.input)? } else { vec![a.input.clone()] };
    let labels = Labels { head: a.head_label as f32, tumour: a.tumour_label as f32 };
    let scaled_dir = a.output.join("scaled");
    let shifted_dir = a.output.join("shifted");
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    for path in &inputs {
        let mask = read_volume(path)?;
        let name = file_name(path);
        let tumour = mask.data.iter().filter(|&&v| v == labels.tumour).count();
        if tumour == 0 {
            println!("{}: no voxel has the tumour label {}; skipped", path.display(), a.tumour_label);
            continue;
        }
        let mut line = format!("{}: tumour {tumour} voxels", path.display());
        if a.mode != Mode::Shift {
            std::fs::create_dir_all(&scaled_dir).with_context(|| scaled_dir.display().to_string())?;
            let scales = linspace(a.scale_start, a.scale_end, a.num_scales);
            let mut kept = 0;
            for &s in &scales {
                if let Some(v) = scale_tumour(&mask, s, labels, a.min_voxels) {
                    write_labels(scaled_dir.join(format!("{s:?}_{name}")), &v)?;
                    kept += 1;
                }
            }
            line += &format!(", {kept}/{} scales kept", scales.len());
        }
        if a.mode != Mode::Scale {
            std::fs::create_dir_all(&shifted_dir).with_context(|| shifted_dir.display().to_string())?;
            let grid = shift_grid(a.shift_range, a.shift_step);
            let chunk = grid.len().div_ceil(threads).max(1);
            let results: Vec<meddpm::Result<usize>> = std::thread::scope(|sc| {
                let handles: Vec<_> = grid
                    .chunks(chunk)
                    .map(|shifts| {
                        let (mask, name, dir) = (&mask, &name, &shifted_dir);
                        sc.spawn(move || {
                            let mut kept = 0;
                            for sh in shifts {
                                if let Some(v) = shift_tumour(mask, *sh, labels) {
                                    write_labels(dir.join(format!("{}_{}_{}__{name}", sh[0], sh[1], sh[2])), &v)?;
                                    kept += 1;
                                }
                            }
                            Ok(kept)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().expect("shift worker panicked")).collect()
            });
            let mut kept = 0;
            for r in results {
                kept += r?;
            }
            line += &format!(", {kept}/{} shifts kept", grid.len());
        }
        println!("{line}");
    }
    Ok(())
}
