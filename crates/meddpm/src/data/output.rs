//! Generated tensors → the NIfTI files a user gets, for either convention, in one call
//! ([`write_sample`]), so that `meddpm sample` and `meddpm train` write the same files.
//!
//! - **Whole-head** (`sample.py` of the reference): one volume, values as generated in [−1, 1],
//!   resized back to the conditioning mask's grid and written with its header/affine:
//!   `<stem>.nii.gz`.
//! - **BraTS** (`sample_brats.py`): four volumes [T1, T1ce, T2, FLAIR] on the mask's grid, each
//!   post-processed as the reference's `processImg` ([`brats_postprocess_image`]: rescale to
//!   [0, 1], then torchio `CropOrPad` back to the original 240×240×155 BraTS grid):
//!   `<stem>_t1.nii.gz`, `<stem>_t1ce.nii.gz`, `<stem>_t2.nii.gz`, `<stem>_flair.nii.gz`; and the
//!   conditioning mask as the reference exports it ([`brats_export_mask`]: brain label dropped,
//!   labels 1 ↔ 2, same crop/pad) as uint8 `<stem>_mask.nii.gz`.
//!
//! [`write_sample_with_views`] adds the PNG preview and the HTML viewer page beside those files
//! (what `meddpm sample` and the end of `meddpm train` write); [`sample_stems`] names the files of
//! a mask × seed sampling job list, with [`image_volumes`] and [`nifti_stem`], so that every
//! command names its files the same way.

use super::convention::{brats_export_mask, brats_postprocess_image, Convention, Preset};
use super::nifti::{write_labels, write_volume, Volume};
use super::{preview, view};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// BraTS modality names in channel order (file suffixes).
pub const BRATS_MODALITIES: [&str; 4] = ["t1", "t1ce", "t2", "flair"];

/// One output file: its suffix (`""` whole-head, `"_t1"`, ..., `"_mask"`), the volume, and
/// whether it is a label map (written as uint8).
#[derive(Clone, Debug)]
pub struct OutputVolume {
    pub suffix: String,
    pub volume: Volume,
    pub labels: bool,
}

/// The volumes a generated tensor (C, D, H, W) at `size_dhw` becomes under `conv`, conditioned
/// on `mask` (see the module doc). Errors when C is not the convention's image channel count.
pub fn sample_outputs(
    conv: &Convention,
    tensor: &[f32],
    channels: usize,
    size_dhw: [usize; 3],
    mask: &Volume,
) -> Result<Vec<OutputVolume>> {
    if channels != conv.image_channels() || tensor.len() != channels * size_dhw.iter().product::<usize>() {
        return Err(Error::Config(format!(
            "generated tensor of {} values for {channels} channel(s) at {size_dhw:?}; the {:?} convention writes {} image channel(s)",
            tensor.len(),
            conv.preset,
            conv.image_channels()
        )));
    }
    let vols = conv.output_volumes(tensor, channels, size_dhw, mask);
    Ok(match conv.preset {
        Preset::WholeHead => {
            vols.into_iter().map(|volume| OutputVolume { suffix: String::new(), volume, labels: false }).collect()
        }
        Preset::Brats => {
            let mut out: Vec<OutputVolume> = vols
                .iter()
                .zip(BRATS_MODALITIES)
                .map(|(v, m)| OutputVolume {
                    suffix: format!("_{m}"),
                    volume: brats_postprocess_image(v),
                    labels: false,
                })
                .collect();
            out.push(OutputVolume { suffix: "_mask".into(), volume: brats_export_mask(mask), labels: true });
            out
        }
    })
}

/// `<stem><suffix>.nii.gz` (a `.nii.gz`/`.nii` extension on `stem` is dropped first).
pub fn output_path(stem: &Path, suffix: &str) -> PathBuf {
    let s = stem.display().to_string();
    let base = s.strip_suffix(".nii.gz").or_else(|| s.strip_suffix(".nii")).unwrap_or(&s);
    PathBuf::from(format!("{base}{suffix}.nii.gz"))
}

/// Every file [`write_sample_with_views`] writes for `stem` (without writing): the NIfTI files
/// of the convention, the PNG preview and the HTML page — what a run must not overwrite unasked.
pub fn sample_paths(stem: &Path, preset: Preset) -> Vec<PathBuf> {
    let suffixes: Vec<String> = match preset {
        Preset::WholeHead => vec![String::new()],
        Preset::Brats => BRATS_MODALITIES.iter().map(|m| format!("_{m}")).chain(["_mask".to_string()]).collect(),
    };
    let mut paths: Vec<PathBuf> = suffixes.iter().map(|s| output_path(stem, s)).collect();
    paths.push(stem.with_extension("png"));
    paths.push(stem.with_extension("html"));
    paths
}

/// [`sample_outputs`], written next to `stem` (atomic writes). Returns each file with its volume
/// (for previews).
pub fn write_sample(
    stem: &Path,
    conv: &Convention,
    tensor: &[f32],
    channels: usize,
    size_dhw: [usize; 3],
    mask: &Volume,
) -> Result<Vec<(PathBuf, OutputVolume)>> {
    let mut written = Vec::new();
    for o in sample_outputs(conv, tensor, channels, size_dhw, mask)? {
        let path = output_path(stem, &o.suffix);
        if o.labels {
            write_labels(&path, &o.volume)?;
        } else {
            write_volume(&path, &o.volume)?;
        }
        written.push((path, o));
    }
    Ok(written)
}

/// The intensity volumes of [`sample_outputs`] (BraTS's exported label map left out), on the
/// mask's grid: the generated columns of a preview.
pub fn image_volumes(
    conv: &Convention,
    tensor: &[f32],
    channels: usize,
    size_dhw: [usize; 3],
    mask: &Volume,
) -> Result<Vec<Volume>> {
    let outs = sample_outputs(conv, tensor, channels, size_dhw, mask)?;
    Ok(outs.into_iter().filter(|o| !o.labels).map(|o| o.volume).collect())
}

/// Further volumes a preview shows beside a sample: `others` (the bundled model's sample of the
/// same mask and seed: the preview titles them "bundled model"), then `real` (the pair's real
/// images, titled "real"), both as intensity columns.
#[derive(Clone, Copy, Debug, Default)]
pub struct Beside<'a> {
    pub others: &'a [Volume],
    /// What `others` are, as the viewer labels them (e.g. "bundled demo model").
    pub others_name: &'a str,
    pub real: &'a [Volume],
}

/// [`write_sample`], plus a PNG preview `<stem>.png` (mask | generated | `beside.others` |
/// `beside.real`, each column titled: mask | sample, or this run beside others | bundled model
/// | real) and `<stem>.html`, the same columns in the viewer (labelled) with the mask
/// as overlay (when a volume is on its grid). Returns the files written: the NIfTI files in
/// [`write_sample`]'s order, then the PNG, then the HTML page.
pub fn write_sample_with_views(
    stem: &Path,
    conv: &Convention,
    tensor: &[f32],
    channels: usize,
    size_dhw: [usize; 3],
    mask: &Volume,
    beside: Beside<'_>,
) -> Result<Vec<PathBuf>> {
    let outs = write_sample(stem, conv, tensor, channels, size_dhw, mask)?;
    let mut written: Vec<PathBuf> = outs.iter().map(|(p, _)| p.clone()).collect();
    let png = stem.with_extension("png");
    let mut panel: Vec<(&Volume, preview::Kind)> = vec![(mask, preview::Kind::Labels)];
    let mut titles = vec!["mask".to_string()];
    for (_, o) in outs.iter().filter(|(_, o)| !o.labels) {
        panel.push((&o.volume, preview::Kind::Intensity));
        let run = if beside.others.is_empty() { "sample" } else { "this run" };
        titles.push(match o.suffix.strip_prefix('_') {
            Some(m) => format!("{run} {m}"),
            None => run.to_string(),
        });
    }
    let others_name = if beside.others_name.is_empty() { "comparison" } else { beside.others_name };
    panel.extend(beside.others.iter().map(|v| (v, preview::Kind::Intensity)));
    titles.extend(beside.others.iter().map(|_| others_name.to_string()));
    panel.extend(beside.real.iter().map(|v| (v, preview::Kind::Intensity)));
    titles.extend(beside.real.iter().map(|_| "real".to_string()));
    let titles: Vec<&str> = titles.iter().map(String::as_str).collect();
    preview::write_png_titled(&png, &panel, &titles)?;
    written.push(png);
    // The same volumes in the HTML viewer (data::view), the mask as overlay.
    let html = stem.with_extension("html");
    let file_name = |p: &Path| p.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned());
    let mut layers: Vec<view::Layer> = outs
        .iter()
        .filter(|(_, o)| !o.labels)
        .map(|(p, o)| view::Layer { name: file_name(p), volume: &o.volume })
        .collect();
    let numbered = |name: &str, i: usize, n: usize| if n > 1 { format!("{name} {}", i + 1) } else { name.to_string() };
    let n = beside.others.len();
    layers.extend(
        beside.others.iter().enumerate().map(|(i, v)| view::Layer { name: numbered(others_name, i, n), volume: v }),
    );
    let n = beside.real.len();
    layers.extend(beside.real.iter().enumerate().map(|(i, v)| view::Layer { name: numbered("real", i, n), volume: v }));
    let overlay = layers.iter().any(|l| l.volume.dims == mask.dims).then_some(("conditioning", mask));
    view::write_html(&html, &file_name(stem), &layers, overlay)?;
    written.push(html);
    Ok(written)
}

/// A NIfTI file's name without its directory and `.nii` / `.nii.gz` (`"mask"` when the path has
/// no UTF-8 file name).
pub fn nifti_stem(p: &Path) -> String {
    let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("mask");
    n.strip_suffix(".nii.gz").or_else(|| n.strip_suffix(".nii")).unwrap_or(n).to_string()
}

/// The volumes of a sampling run, `num_samples` per mask with seeds `seed, seed + 1, …`, as
/// (mask index, seed, output stem), mask by mask. `masks` are the mask files; none stands for one
/// built-in mask. The stem is `out` for a single volume, `<out>_<k>` for several of one mask, and
/// `<out>_<mask stem>_<k>` with several masks.
pub fn sample_stems(out: &Path, masks: &[PathBuf], num_samples: u64, seed: u64) -> Vec<(usize, u64, PathBuf)> {
    let mut jobs = Vec::new();
    for m in 0..masks.len().max(1) {
        for k in 0..num_samples {
            let stem = if masks.len() > 1 {
                format!("{}_{}_{k}", out.display(), nifti_stem(&masks[m]))
            } else if num_samples == 1 {
                out.display().to_string()
            } else {
                format!("{}_{k}", out.display())
            };
            jobs.push((m, seed + k, PathBuf::from(stem)));
        }
    }
    jobs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nifti_stems_drop_the_folder_and_the_extension() {
        assert_eq!(nifti_stem(Path::new("a/b/case_01.nii.gz")), "case_01");
        assert_eq!(nifti_stem(Path::new("case_02.nii")), "case_02");
        assert_eq!(nifti_stem(Path::new("dir/plain")), "plain");
        assert_eq!(nifti_stem(Path::new("x.nii.gz.bak")), "x.nii.gz.bak");
        assert_eq!(nifti_stem(Path::new("/")), "mask");
    }

    #[test]
    fn sample_stems_name_one_several_and_per_mask_volumes() {
        let out = Path::new("o/s");
        let stems = |masks: &[PathBuf], n, seed| -> Vec<(usize, u64, String)> {
            sample_stems(out, masks, n, seed).into_iter().map(|(m, s, p)| (m, s, p.display().to_string())).collect()
        };
        // the built-in mask: one volume is `out` itself, several are numbered
        assert_eq!(stems(&[], 1, 7), vec![(0, 7, "o/s".to_string())]);
        assert_eq!(stems(&[], 2, 7), vec![(0, 7, "o/s_0".to_string()), (0, 8, "o/s_1".to_string())]);
        // one mask file: as the built-in mask
        assert_eq!(stems(&[PathBuf::from("m/a.nii.gz")], 1, 0), vec![(0, 0, "o/s".to_string())]);
        // several masks: the mask's stem in every name, mask by mask, seeds restarting per mask
        let two = [PathBuf::from("m/a.nii.gz"), PathBuf::from("b.nii")];
        assert_eq!(
            stems(&two, 2, 3),
            vec![
                (0, 3, "o/s_a_0".to_string()),
                (0, 4, "o/s_a_1".to_string()),
                (1, 3, "o/s_b_0".to_string()),
                (1, 4, "o/s_b_1".to_string()),
            ]
        );
        assert!(sample_stems(out, &two, 0, 0).is_empty());
    }
}
