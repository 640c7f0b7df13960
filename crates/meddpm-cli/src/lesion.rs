//! `meddpm lesion-pairs`: training pairs for conditioning masks — each mask with an image made
//! from a lesion-free T1 darkened on its tumour (`meddpm::data::lesion`; this only wires).

use crate::args::{number, whole};
use anyhow::Result;
use meddpm::data::dataset::list_nifti;
use meddpm::data::lesion::write_pairs;
use meddpm::data::nifti::read_volume;
use std::path::PathBuf;

/// Make (mask, image) training pairs from masks and a lesion-free T1.
#[derive(clap::Args, Debug, Clone)]
pub struct LesionPairsArgs {
    /// The lesion-free T1 on the masks' grid (e.g. testdata/mni64/t1.nii.gz).
    #[arg(long)]
    pub t1: PathBuf,
    /// Mask files and/or folders of .nii/.nii.gz masks (e.g. the scaled/ and shifted/ folders
    /// of `meddpm masks`).
    #[arg(long, num_args = 1.., required = true)]
    pub masks: Vec<PathBuf>,
    /// Output folder: masks/ and images/ (pair_NNNN.nii.gz, for `train --masks --images`) and
    /// pairs.csv (which input each pair came from).
    #[arg(short, long)]
    pub out: PathBuf,
    /// Rim width in voxels around the tumour (darkened × 0.725; the tumour × 0.45). 2 = the demo's
    /// 6 mm at 3 mm voxels.
    #[arg(long, default_value_t = 2.0, allow_negative_numbers = true, value_parser = number(0.0, true, 100.0))]
    pub rim: f64,
    /// Also write real/: each image min-max scaled to [-1, 1] as the whole-head convention feeds
    /// it to the model (the real volume for `meddpm eval` against samples).
    #[arg(long)]
    pub real: bool,
    /// Label of the tumour, 0 to 255.
    #[arg(long, default_value_t = 2, allow_negative_numbers = true, value_parser = whole(0, 255))]
    pub tumour_label: u64,
}

pub fn run(a: &LesionPairsArgs) -> Result<()> {
    let t1 = read_volume(&a.t1)?;
    let mut masks = Vec::new();
    for p in &a.masks {
        if p.is_dir() {
            masks.extend(list_nifti(p)?);
        } else {
            masks.push(p.clone());
        }
    }
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let n = write_pairs(&t1, &masks, &a.out, a.tumour_label as f32, a.rim, a.real, threads)?;
    println!("{n} pairs in {} (masks/, images/, pairs.csv)", a.out.display());
    Ok(())
}
