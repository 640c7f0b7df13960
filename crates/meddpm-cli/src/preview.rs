//! `meddpm preview`: a PNG of the middle slices (axial, coronal, sagittal) of a mask, image(s)
//! and samples side by side, to eyeball data and results. Drawing is `meddpm::data::preview`.

use anyhow::{bail, Context, Result};
use meddpm::data::nifti::{read_volume, Volume};
use meddpm::data::preview::{label_position, write_png_at, Kind};
use std::path::PathBuf;

/// Write a PNG of mid-slices of a mask, image(s) and samples side by side.
#[derive(clap::Args, Debug, Clone)]
pub struct PreviewArgs {
    /// A label mask (drawn in label colours, first column).
    #[arg(long)]
    pub mask: Option<PathBuf>,
    /// Intensity volumes (images, then samples), one column each.
    pub volumes: Vec<PathBuf>,
    /// Cut all columns through the centroid of this label of the mask (e.g. 2, the tumour)
    /// instead of the middle.
    #[arg(long, allow_negative_numbers = true, value_parser = crate::args::whole(0, 255))]
    pub through_label: Option<u64>,
    /// Show the built-in demo pairs (masks and images) instead of files.
    #[arg(long)]
    pub demo: bool,
    /// Output PNG.
    #[arg(short, long)]
    pub output: PathBuf,
}

pub fn run(a: &PreviewArgs) -> Result<()> {
    let mut vols: Vec<(Volume, Kind)> = Vec::new();
    if a.demo {
        for (m, i) in meddpm::data::demo::volumes()? {
            vols.push((m, Kind::Labels));
            vols.push((i, Kind::Intensity));
        }
    }
    if let Some(m) = &a.mask {
        vols.push((read_volume(m)?, Kind::Labels));
    }
    for p in &a.volumes {
        vols.push((read_volume(p)?, Kind::Intensity));
    }
    if vols.is_empty() {
        bail!("nothing to draw: give --mask, volume files or --demo");
    }
    let mut pos = [0.5; 3];
    if let Some(l) = a.through_label {
        let Some((mask, _)) = vols.iter().find(|(_, k)| *k == Kind::Labels) else {
            bail!("--through-label needs a mask (--mask or --demo)");
        };
        pos = label_position(mask, l as f32).with_context(|| format!("the mask has no voxel with label {l}"))?;
    }
    let refs: Vec<(&Volume, Kind)> = vols.iter().map(|(v, k)| (v, *k)).collect();
    write_png_at(&a.output, &refs, pos)?;
    println!("wrote {} ({} column(s))", a.output.display(), refs.len());
    Ok(())
}
