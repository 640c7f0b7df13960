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

use super::convention::{brats_export_mask, brats_postprocess_image, Convention, Preset};
use super::nifti::{write_labels, write_volume, Volume};
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
