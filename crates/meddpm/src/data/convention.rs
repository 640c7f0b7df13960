//! Med-DDPM's data conventions (spec §5): how a mask and its image(s) become the model's
//! condition and image tensors, and how generated tensors become NIfTI volumes again.
//!
//! **Whole-head** (`dataset.py`, `NiftiPairImageGenerator(full_channel_mask=True)`, `train.py`):
//! - mask: labels 0..L−1 (L = `num_labels`, 3 in the reference: 0 background, 1 head/brain,
//!   2 tumour) become L−1 one-hot channels for labels 1..L−1 (background dropped, channels
//!   mutually exclusive), resized linearly if needed (fractional edges), then v → 2v−1: {−1, +1}.
//! - image: scaled to [0, 1], resized trilinearly if needed, then v → 2v−1: [−1, 1].
//!   [`ImageScaling::Global`] (our default) is one min-max over the volume.
//!   [`ImageScaling::PerSlice`] is the reference's exact behaviour: sklearn `MinMaxScaler` fitted
//!   on the array reshaped to (X·Y, Z) scales *each slice along the last NIfTI axis* (z)
//!   independently, and a constant slice becomes 0 (sklearn treats a zero range as 1), i.e. −1.
//!   This discards the relative brightness of slices; it is kept selectable for fidelity.
//! - layout: NIfTI (X, Y, Z) → tensor (C, D, H, W) = (C, Z, Y, X). Because a [`Volume`] stores
//!   X fastest, its buffer *is* the C-order (Z, Y, X) array: the transpose costs nothing, and
//!   the inverse on output is the same identity.
//!
//! **BraTS** (`preprocess_brats_data.py`, `dataset_brats.py`, `sample_brats.py`):
//! - preprocessing: torchio `CropOrPad` to 192×192×144 (centred; the odd voxel is taken from the
//!   start: ini = ⌈n/2⌉), per-volume `RescaleIntensity` to [−1, 1] of T1, T1ce, T2, FLAIR; seg
//!   label 4 (enhancing tumour) → 3; label 4 = brain where seg is 0 and the rescaled T1 > −1.
//!   Applied on load when [`Convention::brats_preprocess`] is set, otherwise inputs are taken
//!   as already preprocessed (like the reference's loader).
//! - tensors: image = the 4 modalities stacked [T1, T1ce, T2, FLAIR] as they are; condition =
//!   one-hot of labels 1..4 → 4 channels in {0, 1} (no 2v−1).
//! - output ([`brats_postprocess_image`]): each generated modality rescaled to [0, 1] and
//!   crop/padded back to 240×240×155; the exported mask drops the brain label (4 → 0) and swaps
//!   labels 1 ↔ 2 ([`brats_export_mask`]).
//!
//! Masks are resized with the reference's linear interpolation of one-hot channels
//! ([`MaskResize::Linear`]) or, as an option, nearest-neighbour on the label map (exact {lo, hi}).

use super::nifti::Volume;
use super::resize;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Which reference pipeline a dataset follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Preset {
    /// One image, masks {0..L−1} → L−1 channels in {−1, +1}.
    WholeHead,
    /// Four modalities [T1, T1ce, T2, FLAIR], masks {0..4} → 4 channels in {0, 1}.
    Brats,
}

/// How an intensity image is brought to [−1, 1].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ImageScaling {
    /// One min-max over the whole volume (constant volume → −1).
    Global,
    /// The reference's per-slice min-max along the last NIfTI axis (constant slice → −1).
    PerSlice,
    /// Used as stored (BraTS after preprocessing is already in [−1, 1]).
    AsIs,
}

/// How condition channels are resized when the mask is not at the model size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MaskResize {
    /// The reference: linear interpolation of each one-hot channel (fractional edges).
    Linear,
    /// Nearest-neighbour on the label map, then one-hot: values stay exactly {lo, hi}.
    Nearest,
}

/// A complete, selectable data convention.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Convention {
    pub preset: Preset,
    /// Label classes including background 0: condition channels = `num_labels − 1`.
    pub num_labels: usize,
    pub image_scaling: ImageScaling,
    pub mask_resize: MaskResize,
    /// BraTS only: run `preprocess_brats_data.py`'s crop/rescale/relabel on load.
    pub brats_preprocess: bool,
}

/// BraTS model grid (X, Y, Z) and the original BraTS grid that samples are padded back to.
pub const BRATS_MODEL_XYZ: [usize; 3] = [192, 192, 144];
pub const BRATS_ORIGINAL_XYZ: [usize; 3] = [240, 240, 155];

impl Convention {
    /// Whole-head with 3 labels (background, head, tumour) and global image min-max.
    pub fn whole_head() -> Self {
        Convention {
            preset: Preset::WholeHead,
            num_labels: 3,
            image_scaling: ImageScaling::Global,
            mask_resize: MaskResize::Linear,
            brats_preprocess: false,
        }
    }
    /// Whole-head exactly as the reference trains: per-slice image min-max.
    pub fn whole_head_reference() -> Self {
        Convention { image_scaling: ImageScaling::PerSlice, ..Self::whole_head() }
    }
    /// BraTS 4-modality, inputs already preprocessed (as `dataset_brats.py` expects).
    pub fn brats() -> Self {
        Convention {
            preset: Preset::Brats,
            num_labels: 5,
            image_scaling: ImageScaling::AsIs,
            mask_resize: MaskResize::Linear,
            brats_preprocess: false,
        }
    }
    /// Image channels: 1 whole-head, 4 BraTS.
    pub fn image_channels(&self) -> usize {
        match self.preset {
            Preset::WholeHead => 1,
            Preset::Brats => 4,
        }
    }
    /// Condition channels: one per non-background label.
    pub fn cond_channels(&self) -> usize {
        self.num_labels - 1
    }
    /// Values of (label absent, label present) in the condition channels.
    pub fn cond_values(&self) -> (f32, f32) {
        match self.preset {
            Preset::WholeHead => (-1.0, 1.0),
            Preset::Brats => (0.0, 1.0),
        }
    }
    /// Check the convention itself.
    pub fn validate(&self) -> Result<()> {
        if self.num_labels < 2 {
            return Err(Error::Config(format!(
                "num_labels = {}: need at least 2 (background and one label)",
                self.num_labels
            )));
        }
        if self.preset == Preset::Brats && self.num_labels != 5 {
            return Err(Error::Config(format!(
                "BraTS uses 5 labels (0 background, 1 NCR, 2 ED, 3 ET, 4 brain), got num_labels = {}",
                self.num_labels
            )));
        }
        if self.brats_preprocess && self.preset != Preset::Brats {
            return Err(Error::Config("brats_preprocess is only meaningful with the BraTS preset".into()));
        }
        Ok(())
    }

    /// Check that every mask voxel is an integer label in 0..num_labels.
    pub fn check_labels(&self, mask: &Volume, name: &Path) -> Result<()> {
        check_labels(mask, self.num_labels, name)
    }

    /// Mask volume → condition tensor (C = L−1, D, H, W) at `size_dhw`.
    pub fn cond_tensor(&self, mask: &Volume, size_dhw: [usize; 3], name: &Path) -> Result<Vec<f32>> {
        self.check_labels(mask, name)?;
        let (lo, hi) = self.cond_values();
        let dst = dhw_to_xyz(size_dhw);
        let c = self.cond_channels();
        let s = dst[0] * dst[1] * dst[2];
        let mut out = Vec::with_capacity(c * s);
        match self.mask_resize {
            MaskResize::Linear if mask.dims == dst => {
                // labels were checked: one pass writes every channel
                out.resize(c * s, lo);
                for (i, &v) in mask.data.iter().enumerate() {
                    if v >= 1.0 {
                        out[(v as usize - 1) * s + i] = hi;
                    }
                }
            }
            MaskResize::Linear => {
                for label in 1..=c {
                    let l = label as f32;
                    let onehot: Vec<f32> = mask.data.iter().map(|&v| if v == l { hi } else { lo }).collect();
                    out.extend(resize::trilinear(&onehot, mask.dims, dst));
                }
            }
            MaskResize::Nearest => {
                let labels = resize::nearest(&mask.data, mask.dims, dst);
                for label in 1..=c {
                    out.extend(labels.iter().map(|&v| if v == label as f32 { hi } else { lo }));
                }
            }
        }
        Ok(out)
    }

    /// Image volume(s) → image tensor (C, D, H, W) in [−1, 1] at `size_dhw`.
    pub fn image_tensor(&self, images: &[Volume], size_dhw: [usize; 3], name: &Path) -> Result<Vec<f32>> {
        if images.len() != self.image_channels() {
            return Err(Error::data(
                name,
                format!("{} image volume(s) given, the convention needs {}", images.len(), self.image_channels()),
            ));
        }
        let dst = dhw_to_xyz(size_dhw);
        let mut out = Vec::with_capacity(images.len() * dst[0] * dst[1] * dst[2]);
        for img in images {
            let scaled = match self.image_scaling {
                ImageScaling::Global => minmax_pm1(&img.data),
                ImageScaling::PerSlice => per_slice_minmax_pm1(&img.data, img.dims),
                ImageScaling::AsIs => img.data.clone(),
            };
            let mut resized = if img.dims == dst { scaled } else { resize::trilinear(&scaled, img.dims, dst) };
            out.append(&mut resized);
        }
        Ok(out)
    }

    /// Generated tensor (C, D, H, W) → one volume per channel, resized back to `like`'s grid
    /// and carrying its header/affine (the mask the sample was conditioned on).
    pub fn output_volumes(&self, tensor: &[f32], channels: usize, size_dhw: [usize; 3], like: &Volume) -> Vec<Volume> {
        let src = dhw_to_xyz(size_dhw);
        let s = src[0] * src[1] * src[2];
        assert_eq!(tensor.len(), channels * s, "output_volumes: tensor length vs {channels}×{size_dhw:?}");
        tensor.chunks_exact(s).map(|ch| like.like(resize::trilinear(ch, src, like.dims))).collect()
    }
}

/// Tensor (D, H, W) → NIfTI (X, Y, Z) sizes.
pub fn dhw_to_xyz(d: [usize; 3]) -> [usize; 3] {
    [d[2], d[1], d[0]]
}

/// NIfTI (X, Y, Z) → tensor (D, H, W) sizes.
pub fn xyz_to_dhw(x: [usize; 3]) -> [usize; 3] {
    [x[2], x[1], x[0]]
}

/// Every voxel must be an integer in 0..num_labels.
pub fn check_labels(mask: &Volume, num_labels: usize, name: &Path) -> Result<()> {
    // `v as usize` saturates (negatives, NaN → 0) so the round trip only holds for labels.
    let is_label = |v: f32| {
        let l = v as usize;
        l as f32 == v && l < num_labels
    };
    if mask.data.iter().all(|&v| is_label(v)) {
        return Ok(());
    }
    let nbad = mask.data.iter().filter(|&&v| !is_label(v)).count();
    let bad = mask.data.iter().position(|&v| !is_label(v)).map(|i| (i, mask.data[i]));
    if let Some((i, v)) = bad {
        let d = mask.dims;
        let (x, y, z) = (i % d[0], (i / d[0]) % d[1], i / (d[0] * d[1]));
        return Err(Error::data(
            name,
            format!(
                "mask has {nbad} voxel(s) outside the labels 0..={} (first: value {v} at voxel ({x}, {y}, {z})); \
                 is this an image rather than a label mask? (`meddpm preview --mask FILE -o p.png` shows it)",
                num_labels - 1
            ),
        ));
    }
    Ok(())
}

/// sklearn `MinMaxScaler` on one column: v·scale − min·scale with scale = 1/range, a zero
/// range counting as 1; then 2v−1. Computed in f64 like the reference.
fn minmax_column(vals: impl Iterator<Item = f32> + Clone) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in vals {
        lo = lo.min(v as f64);
        hi = hi.max(v as f64);
    }
    let range = if hi - lo == 0.0 { 1.0 } else { hi - lo };
    let scale = 1.0 / range;
    (scale, -lo * scale)
}

/// Global min-max to [0, 1], then 2v−1.
pub fn minmax_pm1(data: &[f32]) -> Vec<f32> {
    let (scale, offset) = minmax_column(data.iter().copied());
    data.iter().map(|&v| ((v as f64 * scale + offset) * 2.0 - 1.0) as f32).collect()
}

/// The reference's per-slice min-max (each z slice of an x-fastest volume), then 2v−1.
pub fn per_slice_minmax_pm1(data: &[f32], dims: [usize; 3]) -> Vec<f32> {
    let plane = dims[0] * dims[1];
    assert_eq!(data.len(), plane * dims[2], "per_slice_minmax: length vs dims {dims:?}");
    let mut out = Vec::with_capacity(data.len());
    for slice in data.chunks_exact(plane) {
        let (scale, offset) = minmax_column(slice.iter().copied());
        out.extend(slice.iter().map(|&v| ((v as f64 * scale + offset) * 2.0 - 1.0) as f32));
    }
    out
}

/// torchio `RescaleIntensity((lo, hi))` with default percentiles (0, 100): min-max to
/// [lo, hi]; a constant volume is returned unchanged (torchio warns and skips).
pub fn rescale_intensity(data: &[f32], lo: f32, hi: f32) -> Vec<f32> {
    let (mut a, mut b) = (f64::INFINITY, f64::NEG_INFINITY);
    for &v in data {
        a = a.min(v as f64);
        b = b.max(v as f64);
    }
    if b - a == 0.0 {
        return data.to_vec();
    }
    let (lo, hi) = (lo as f64, hi as f64);
    data.iter().map(|&v| ((v as f64 - a) / (b - a) * (hi - lo) + lo) as f32).collect()
}

/// torchio `CropOrPad(target)`: centred crop and/or constant pad per axis (ini = ⌈n/2⌉,
/// fin = ⌊n/2⌋), the affine's origin moved so world positions of kept voxels do not change.
pub fn crop_or_pad(v: &Volume, target: [usize; 3], pad_value: f32) -> Volume {
    // offset[a]: input index of output index 0 along axis a (crop ini − pad ini).
    let mut offset = [0i64; 3];
    for a in 0..3 {
        let diff = target[a] as i64 - v.dims[a] as i64;
        offset[a] = if diff < 0 { (-diff + 1) / 2 } else { -((diff + 1) / 2) };
    }
    let mut data = Vec::with_capacity(target[0] * target[1] * target[2]);
    for z in 0..target[2] as i64 {
        for y in 0..target[1] as i64 {
            for x in 0..target[0] as i64 {
                let (sx, sy, sz) = (x + offset[0], y + offset[1], z + offset[2]);
                let inside = [sx, sy, sz].iter().zip(v.dims).all(|(&s, n)| s >= 0 && s < n as i64);
                data.push(if inside { v.at(sx as usize, sy as usize, sz as usize) } else { pad_value });
            }
        }
    }
    let mut out = Volume { dims: target, data, ..v.clone_meta() };
    for i in 0..3 {
        out.affine[i][3] += (0..3).map(|j| v.affine[i][j] * offset[j] as f32).sum::<f32>();
    }
    out
}

/// `preprocess_brats_data.py`: crop/pad the four modalities and the seg to 192×192×144,
/// rescale each modality to [−1, 1], relabel seg 4 → 3 and mark brain (4) where the rescaled
/// T1 > −1 and seg is 0. `images` = [T1, T1ce, T2, FLAIR].
pub fn brats_preprocess(images: &[Volume], seg: &Volume, name: &Path) -> Result<(Vec<Volume>, Volume)> {
    if images.len() != 4 {
        return Err(Error::data(name, format!("BraTS needs 4 modalities [T1, T1ce, T2, FLAIR], got {}", images.len())));
    }
    let prepared: Vec<Volume> = images.iter().map(brats_prepare_image).collect();
    let seg = brats_prepare_seg(&prepared[0], seg, name)?;
    Ok((prepared, seg))
}

/// One modality: `CropOrPad` to 192×192×144 (pad 0), then `RescaleIntensity((−1, 1))`.
pub fn brats_prepare_image(v: &Volume) -> Volume {
    let c = crop_or_pad(v, BRATS_MODEL_XYZ, 0.0);
    let data = rescale_intensity(&c.data, -1.0, 1.0);
    Volume { data, ..c }
}

/// The seg: `CropOrPad`, labels checked to be 0..=4, 4 → 3, then 4 (brain) where seg is 0 and
/// the prepared T1 (see [`brats_prepare_image`]) is > −1.
pub fn brats_prepare_seg(t1: &Volume, seg: &Volume, name: &Path) -> Result<Volume> {
    let s = crop_or_pad(seg, BRATS_MODEL_XYZ, 0.0);
    check_labels(&s, 5, name)?;
    assert_eq!(t1.dims, s.dims, "brats_prepare_seg: T1 {:?} vs seg {:?}", t1.dims, s.dims);
    let data = s
        .data
        .iter()
        .zip(&t1.data)
        .map(|(&l, &t)| {
            let l = if l == 4.0 { 3.0 } else { l };
            if l == 0.0 && t > -1.0 {
                4.0
            } else {
                l
            }
        })
        .collect();
    Ok(Volume { data, ..s })
}

/// `sample_brats.py`'s `processImg`: rescale to [0, 1], crop/pad back to 240×240×155.
pub fn brats_postprocess_image(v: &Volume) -> Volume {
    let r = Volume { data: rescale_intensity(&v.data, 0.0, 1.0), ..v.clone_meta() };
    crop_or_pad(&r, BRATS_ORIGINAL_XYZ, 0.0)
}

/// `sample_brats.py`'s mask export: brain 4 → 0, labels 1 ↔ 2, crop/pad to 240×240×155.
pub fn brats_export_mask(mask: &Volume) -> Volume {
    let data = mask
        .data
        .iter()
        .map(|&l| match l as i64 {
            4 => 0.0,
            1 => 2.0,
            2 => 1.0,
            _ => l,
        })
        .collect();
    crop_or_pad(&mask.like(data), BRATS_ORIGINAL_XYZ, 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crop_or_pad_matches_torchio_bounds_and_keeps_world_positions() {
        // 5 → 2 crops 3: ini 2, fin 1; 2 → 5 pads 3: ini 2, fin 1.
        let v = Volume::new([5, 1, 1], [2.0, 1.0, 1.0], vec![0.0, 1.0, 2.0, 3.0, 4.0]);
        let c = crop_or_pad(&v, [2, 1, 1], 0.0);
        assert_eq!(c.data, vec![2.0, 3.0]);
        assert_eq!(c.affine[0][3], 4.0); // voxel 0 of c is voxel 2 of v at x = 2·2
        let p = crop_or_pad(&c, [5, 1, 1], -9.0);
        assert_eq!(p.data, vec![-9.0, -9.0, 2.0, 3.0, -9.0]);
        assert_eq!(p.affine[0][3], 0.0);
    }

    #[test]
    fn per_slice_scaler_is_per_z_slice() {
        // 2×1×2: slice z=0 = [1, 3], slice z=1 = [5, 5] (constant → 0 → −1).
        let out = per_slice_minmax_pm1(&[1.0, 3.0, 5.0, 5.0], [2, 1, 2]);
        assert_eq!(out, vec![-1.0, 1.0, -1.0, -1.0]);
        assert_eq!(minmax_pm1(&[1.0, 3.0, 5.0, 5.0]), vec![-1.0, 0.0, 1.0, 1.0]);
    }
}
