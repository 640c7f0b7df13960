//! Data: NIfTI in and out, Med-DDPM's data conventions, datasets, the loader, mask augmentation,
//! previews and the built-in demo data (spec §5, `dataset.py`, `dataset_brats.py`,
//! `preprocess_brats_data.py`, `sample*.py`, `mask_generator.ipynb` of the reference).
//!
//! - `nifti`       [`Volume`], [`read_volume`], [`write_volume`] over the `nifti` crate
//! - `convention`  whole-head / BraTS conventions: masks → condition, images → [−1, 1], layouts
//! - `resize`      torchio-style trilinear and nearest resizing
//! - `dataset`     mask/image pairing (folders or CSV), [`Dataset::get`], [`Dataset::validate`]
//! - `loader`      [`Loader`]: seeded endless shuffling with background decoding threads
//! - `masks`       tumour scaling and shifting (new conditioning masks)
//! - `lesion`      images for masks: a lesion-free T1 darkened on the tumour (training pairs)
//! - `preview`     PNG mid-slice previews
//! - `output`      generated tensors → the NIfTI files of a sample (whole-head or BraTS), its
//!   PNG preview and viewer page, and the file stems of a mask × seed job list
//! - `view`        the self-contained HTML volume viewer (slices, window/level, mask overlay)
//! - `demo`        the embedded MNI152-derived demo pairs
//! - `synth`       synthetic datasets from masks: nnU-Net, MONAI or plain layouts, manifest, resume
//!
//! Tensor layout everywhere: (C, D, H, W) with (D, H, W) = NIfTI (Z, Y, X), C-order, which is
//! exactly a NIfTI volume's own x-fastest voxel order, channel after channel.

pub mod convention;
pub mod dataset;
pub mod demo;
pub mod lesion;
pub mod loader;
pub mod masks;
pub mod nifti;
pub mod output;
pub mod preview;
pub mod resize;
pub mod synth;
pub mod view;

pub use convention::{Convention, ImageScaling, MaskResize, Preset};
pub use dataset::{Dataset, Pair, Source};
pub use loader::{Loader, Shard};
pub use nifti::{read_volume, write_labels, write_volume, Volume};
pub use output::{sample_outputs, write_sample, OutputVolume};

/// One training example as model tensors, ready to upload as a batch of one.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// (image_channels, D, H, W), values in [−1, 1].
    pub image: Vec<f32>,
    /// (cond_channels, D, H, W): {−1, +1} whole-head, {0, 1} BraTS (fractional at resized edges).
    pub cond: Vec<f32>,
    pub image_channels: usize,
    pub cond_channels: usize,
    /// (D, H, W).
    pub dims: [usize; 3],
    /// Index of the pair in its dataset.
    pub index: usize,
}

/// Read a mask file and build its condition tensor at `size_dhw` (for sampling); returns the
/// mask too, whose grid and header the generated volumes are written back on
/// ([`Convention::output_volumes`], then [`write_volume`]). BraTS masks must already be
/// preprocessed (labels 0..4 including the brain label).
pub fn load_condition(
    path: &std::path::Path,
    convention: &Convention,
    size_dhw: [usize; 3],
) -> crate::Result<(Vec<f32>, Volume)> {
    convention.validate()?;
    let mask = read_volume(path)?;
    let cond = convention.cond_tensor(&mask, size_dhw, path)?;
    Ok((cond, mask))
}

/// [`load_condition`] for a model of volume `size_dhw`: a mask of another size is an error that
/// states both sizes, unless `resize` (the user asked for the mask to be resampled; the samples
/// are then written on the mask's grid).
pub fn load_condition_checked(
    path: &std::path::Path,
    convention: &Convention,
    size_dhw: [usize; 3],
    resize: bool,
) -> crate::Result<(Vec<f32>, Volume)> {
    let mask = read_volume(path)?;
    check_mask_size(path, &mask, convention, size_dhw, resize)?;
    convention.validate()?;
    let cond = convention.cond_tensor(&mask, size_dhw, path)?;
    Ok((cond, mask))
}

/// A conditioning mask of another size than the model's volumes `size_dhw` is an error that
/// states both sizes, unless `resize` (the user asked for it to be resampled) or the convention
/// crops and pads it itself (BraTS).
pub fn check_mask_size(
    path: &std::path::Path,
    mask: &Volume,
    convention: &Convention,
    size_dhw: [usize; 3],
    resize: bool,
) -> crate::Result<()> {
    let [x, y, z] = mask.dims;
    if [z, y, x] == size_dhw || resize || convention.brats_preprocess {
        return Ok(());
    }
    let dhw = |d: [usize; 3]| format!("{}×{}×{}", d[0], d[1], d[2]);
    Err(crate::Error::Data {
        path: path.to_path_buf(),
        msg: format!(
            "the mask is {} (D×H×W) but the model makes {} volumes; give a mask of the model's size, or \
             --resize to resample this one (the samples are then written at the mask's size)",
            dhw([z, y, x]),
            dhw(size_dhw)
        ),
    })
}

impl Sample {
    /// Voxels per channel D·H·W.
    pub fn voxels(&self) -> usize {
        self.dims[0] * self.dims[1] * self.dims[2]
    }
}
