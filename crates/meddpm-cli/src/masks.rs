//! `meddpm masks`: new conditioning masks by tumour scaling and shifting, as the reference's
//! `mask_generator.ipynb` makes them for its segmentation study (spec §5.3). The algorithms live
//! in `meddpm::data::masks`; this module lists inputs, runs the grid and writes uint8 masks.
//!
//! Outputs: `<out>/scaled/<stem>_scale<s>.nii.gz` (the scale with as many decimals as tell the
//! scales apart, at least two: `demo_0_scale1.05.nii.gz`) and
//! `<out>/shifted/<stem>_shift<dx>_<dy>_<dz>.nii.gz` (the shift in NIfTI voxel axes x, y, z).

use crate::args::{number, whole, whole_usize};
use anyhow::{bail, Context, Result};
use meddpm::data::dataset::list_nifti;
use meddpm::data::masks::{linspace, scale_tumour, shift_grid, shift_tumour, Labels};
use meddpm::data::nifti::{read_volume, write_labels};
use meddpm::data::output::nifti_stem;
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
    /// First tumour scale, in (0, 100] (the notebook: linspace(2.0, 0.5, 20)).
    #[arg(long, default_value_t = 2.0, allow_negative_numbers = true, value_parser = number(0.0, false, 100.0))]
    pub scale_start: f64,
    /// Last tumour scale, in (0, 100].
    #[arg(long, default_value_t = 0.5, allow_negative_numbers = true, value_parser = number(0.0, false, 100.0))]
    pub scale_end: f64,
    /// Number of scales, 1 to 1000.
    #[arg(long, default_value_t = 20, allow_negative_numbers = true, value_parser = whole_usize(1, 1000))]
    pub num_scales: usize,
    /// Keep a scaled mask only with at least this many tumour voxels.
    #[arg(long, default_value_t = 30, allow_negative_numbers = true, value_parser = whole_usize(0, usize::MAX))]
    pub min_voxels: usize,
    /// Shifts run from -range to +range voxels on each axis, 0 to 1000.
    #[arg(long, default_value_t = 40, allow_negative_numbers = true, value_parser = whole(0, 1000))]
    pub shift_range: u64,
    /// Shift step in voxels, 1 to 1000.
    #[arg(long, default_value_t = 10, allow_negative_numbers = true, value_parser = whole(1, 1000))]
    pub shift_step: u64,
    /// Label of the head/brain region, 0 to 255.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = whole(0, 255))]
    pub head_label: u64,
    /// Label of the tumour, 0 to 255.
    #[arg(long, default_value_t = 2, allow_negative_numbers = true, value_parser = whole(0, 255))]
    pub tumour_label: u64,
}

/// `.nii.gz` or `.nii`, as the input is named.
fn nifti_ext(p: &Path) -> &'static str {
    if p.to_string_lossy().ends_with(".nii") {
        ".nii"
    } else {
        ".nii.gz"
    }
}

/// Decimals that print every scale of `scales` apart: ≥ 2, and enough for the step between them.
fn scale_decimals(scales: &[f64]) -> usize {
    let step = scales.windows(2).map(|w| (w[0] - w[1]).abs()).fold(f64::INFINITY, f64::min);
    (2..=12).find(|&d| step * 10f64.powi(d as i32) >= 1.0).unwrap_or(12)
}

pub fn run(a: &MasksArgs) -> Result<()> {
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
        let (stem, ext) = (nifti_stem(path), nifti_ext(path));
        let tumour = mask.data.iter().filter(|&&v| v == labels.tumour).count();
        if tumour == 0 {
            println!("{}: no voxel has the tumour label {}; skipped", path.display(), a.tumour_label);
            continue;
        }
        let mut line = format!("{}: tumour {tumour} voxels", path.display());
        if a.mode != Mode::Shift {
            std::fs::create_dir_all(&scaled_dir).with_context(|| scaled_dir.display().to_string())?;
            let scales = linspace(a.scale_start, a.scale_end, a.num_scales);
            let d = scale_decimals(&scales);
            let mut kept = 0;
            for &s in &scales {
                if let Some(v) = scale_tumour(&mask, s, labels, a.min_voxels) {
                    write_labels(scaled_dir.join(format!("{stem}_scale{s:.d$}{ext}")), &v)?;
                    kept += 1;
                }
            }
            line += &format!(", {kept}/{} scales kept", scales.len());
        }
        if a.mode != Mode::Scale {
            std::fs::create_dir_all(&shifted_dir).with_context(|| shifted_dir.display().to_string())?;
            let grid = shift_grid(a.shift_range as i64, a.shift_step as i64);
            let chunk = grid.len().div_ceil(threads).max(1);
            let results: Vec<meddpm::Result<usize>> = std::thread::scope(|sc| {
                let handles: Vec<_> = grid
                    .chunks(chunk)
                    .map(|shifts| {
                        let (mask, stem, dir) = (&mask, &stem, &shifted_dir);
                        sc.spawn(move || {
                            let mut kept = 0;
                            for sh in shifts {
                                if let Some(v) = shift_tumour(mask, *sh, labels) {
                                    let name = format!("{stem}_shift{}_{}_{}{ext}", sh[0], sh[1], sh[2]);
                                    write_labels(dir.join(name), &v)?;
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
