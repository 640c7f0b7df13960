//! `meddpm view`: one self-contained HTML file to look through volumes — three orthogonal slices
//! with sliders, window/level, a mask as coloured overlay, volumes side by side with --compare.
//! The page is made by `meddpm::data::view`; this file only reads the files and wires.

use anyhow::Result;
use meddpm::data::nifti::{read_volume, Volume};
use meddpm::data::view::{write_html, Layer};
use std::path::{Path, PathBuf};

/// Write an HTML viewer of a volume (and others to compare with, and a mask overlay).
#[derive(clap::Args, Debug, Clone)]
pub struct ViewArgs {
    /// The volume (NIfTI).
    pub volume: PathBuf,
    /// A label mask drawn as a coloured overlay (same grid as the volume).
    #[arg(long)]
    pub mask: Option<PathBuf>,
    /// More volumes shown side by side (repeat the option for several).
    #[arg(long)]
    pub compare: Vec<PathBuf>,
    /// Output HTML file.
    #[arg(short, long)]
    pub output: PathBuf,
}

fn name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| p.display().to_string())
}

pub fn run(a: &ViewArgs) -> Result<()> {
    let paths: Vec<&PathBuf> = std::iter::once(&a.volume).chain(&a.compare).collect();
    let vols: Vec<Volume> = paths.iter().map(read_volume).collect::<meddpm::Result<_>>()?;
    let mask = a.mask.as_ref().map(|p| read_volume(p).map(|v| (name(p), v))).transpose()?;
    let layers: Vec<Layer> = paths.iter().zip(&vols).map(|(p, v)| Layer { name: name(p), volume: v }).collect();
    write_html(&a.output, &name(&a.volume), &layers, mask.as_ref().map(|(n, v)| (n.as_str(), v)))?;
    println!(
        "wrote {} ({} volume(s){})",
        a.output.display(),
        layers.len(),
        if mask.is_some() { ", mask overlay" } else { "" }
    );
    Ok(())
}
