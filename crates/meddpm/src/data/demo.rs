//! The built-in demo data: two small whole-head pairs at 32³ derived from the MNI152 template,
//! compiled into the binary so `meddpm` can train and sample on real anatomy with no files.
//!
//! Derivation ([`derive_from_mni152`], reproducible with `tools/make_demo/make_demo.sh`; a test
//! checks the committed files equal a fresh derivation):
//! 1. Read the ICBM 2009a nonlinear symmetric T1 and white-matter map (197×233×189, 1 mm,
//!    uint8; the T1 is brain-extracted: 0 outside the brain).
//! 2. Take the 192 mm cube centred on the bounding box of T1 > 0 (zero outside the template)
//!    and average 6×6×6 blocks: 32³ at 6 mm. The affine follows (block centres).
//! 3. Mask: label 1 (head/brain) where at least half of a block is brain (T1 > 0); label 2
//!    (a synthetic "lesion") in a ball of radius 2.5 voxels (15 mm) inside label 1, centred
//!    in white matter — pair 0 at voxel (10, 18, 20), pair 1 at (21, 12, 17). Label 0 elsewhere.
//! 4. Image: the block-averaged T1 (float32, template units 0..255), darkened ×0.45 inside the
//!    lesion ball and ×0.725 in the one-voxel shell around it (a hypointense lesion with a
//!    soft rim), so the image depends on the mask as Med-DDPM's data does.
//!
//! The labels follow the reference's whole-head convention (0 background, 1 head, 2 tumour), so
//! the demo trains the reference's 3-channel model layout.
//!
//! MNI152 notice (must travel with the data): see [`NOTICE`].

use super::convention::Convention;
use super::dataset::{Dataset, Pair, Source};
use super::nifti::{read_volume, read_volume_bytes, Volume};
use crate::error::{Error, Result};
use std::path::Path;

/// Copyright notice of the MNI152 template, reproduced as its licence requires.
pub const NOTICE: &str = "The demo data are derived from the ICBM 2009a Nonlinear Symmetric MNI152 template \
(as shipped in nilearn 0.14.1). Copyright (C) 1993-2009 Louis Collins, McConnell Brain Imaging Centre, \
Montreal Neurological Institute, McGill University. Permission to use, copy, modify, and distribute this \
software and its documentation for any purpose and without fee is hereby granted, provided that the above \
copyright notice appear in all copies. The authors and McGill University make no representations about the \
suitability of this software for any purpose. It is provided \"as is\" without express or implied warranty. \
References: Fonov et al., NeuroImage 54(1), 2011; Fonov et al., NeuroImage 47, S102, 2009.";

/// Side of the demo volumes.
pub const SIDE: usize = 32;
/// Block size (mm = voxels of the 1 mm template) averaged into one demo voxel.
const BLOCK: usize = 6;
/// Lesion centres (x, y, z) of the demo pairs, in demo voxels.
pub const LESION_CENTRES: [[usize; 3]; 2] = [[10, 18, 20], [21, 12, 17]];
/// Lesion radius in demo voxels.
pub const LESION_RADIUS: f64 = 2.5;

/// Intensity factor of the synthetic lesion (hypointense) and of its rim.
pub const LESION_FACTOR: f64 = 0.45;
pub const RIM_FACTOR: f64 = 0.725;

/// The 64³ material (`testdata/mni64/`, issue 13's sampler study at 64³): the same 192 mm cube
/// in 3 mm blocks — the lesion-free block-mean T1 ([`MNI64_T1`]) and two masks whose lesions sit
/// where the demo's do (centre 2·c + 0.5, radius 2·2.5 voxels). Images for any mask on this grid
/// are rendered with [`super::lesion::render`] (rim [`MNI64_RIM`] voxels = the demo's 6 mm).
pub const MNI64_SIDE: usize = 64;
pub const MNI64_BLOCK: usize = 3;
pub const MNI64_T1: &str = "t1.nii.gz";
pub const MNI64_MASKS: [&str; 2] = ["mask_0.nii.gz", "mask_1.nii.gz"];
pub const MNI64_RIM: f64 = 2.0;

/// The 64³ material derived from the MNI152 folder: (lesion-free T1 rounded to integers, the
/// two masks). The T1 is rounded so that it is stored as uint8 like the template (≤ 0.5 of 255).
pub fn derive_mni64(mni_dir: &Path) -> Result<(Volume, Vec<Volume>)> {
    let g = template_grid(mni_dir, MNI64_SIDE, MNI64_BLOCK)?;
    let t1 = g.volume(g.t1.iter().map(|&v| v.round() as f32).collect());
    let mut masks = Vec::new();
    for c in LESION_CENTRES {
        let centre = c.map(|v| 2.0 * v as f64 + 0.5);
        masks.push(g.lesion_mask(centre, 2.0 * LESION_RADIUS, mni_dir)?);
    }
    Ok((t1, masks))
}

/// File names of the template volumes under `mni_dir`.
pub const MNI_T1: &str = "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz";
pub const MNI_WM: &str = "mni_icbm152_wm_tal_nlin_sym_09a_converted.nii.gz";

/// (mask file name, image file name) of each demo pair, as committed under `testdata/demo/`.
pub const FILES: [(&str, &str); 2] =
    [("mask/demo_0.nii.gz", "image/demo_0.nii.gz"), ("mask/demo_1.nii.gz", "image/demo_1.nii.gz")];

static EMBEDDED: [(&[u8], &[u8]); 2] = [
    (
        include_bytes!("../../../../testdata/demo/mask/demo_0.nii.gz"),
        include_bytes!("../../../../testdata/demo/image/demo_0.nii.gz"),
    ),
    (
        include_bytes!("../../../../testdata/demo/mask/demo_1.nii.gz"),
        include_bytes!("../../../../testdata/demo/image/demo_1.nii.gz"),
    ),
];

/// The demo pairs as dataset entries (bytes embedded in the binary).
pub fn pairs() -> Vec<Pair> {
    EMBEDDED
        .iter()
        .zip(FILES)
        .map(|(&(m, i), (mn, inm))| Pair {
            mask: Source::Embedded { name: mn, bytes: m },
            images: vec![Source::Embedded { name: inm, bytes: i }],
        })
        .collect()
}

/// The demo as a dataset with the whole-head convention at its native size, 32³.
pub fn dataset() -> Dataset {
    dataset_at([SIDE; 3]).expect("the embedded demo pairs form a valid dataset")
}

/// The demo at model size `size_dhw` (resized like any dataset whose volumes differ from the
/// model size).
pub fn dataset_at(size_dhw: [usize; 3]) -> Result<Dataset> {
    Dataset::from_pairs(pairs(), Convention::whole_head(), size_dhw)
}

/// Decoded demo pairs (mask, image).
pub fn volumes() -> Result<Vec<(Volume, Volume)>> {
    pairs().iter().map(|p| Ok((p.mask.read()?, p.images[0].read()?))).collect()
}

/// Decode one embedded file by its `FILES` name (for tests and tools).
pub fn embedded(name: &str) -> Option<Result<Volume>> {
    EMBEDDED.iter().zip(FILES).find_map(|(&(m, i), (mn, inm))| {
        if name == mn {
            Some(read_volume_bytes(m, Path::new(mn)))
        } else if name == inm {
            Some(read_volume_bytes(i, Path::new(inm)))
        } else {
            None
        }
    })
}

/// Block-average the `side·block` cube starting at voxel `start` (zero outside the volume).
fn block_mean(v: &Volume, start: [i64; 3], side: usize, block: usize, f: impl Fn(f32) -> f64) -> Vec<f64> {
    let mut out = vec![0f64; side * side * side];
    let n = (block * block * block) as f64;
    for k in 0..side {
        for j in 0..side {
            for i in 0..side {
                let mut s = 0f64;
                for dz in 0..block {
                    let z = start[2] + (k * block + dz) as i64;
                    for dy in 0..block {
                        let y = start[1] + (j * block + dy) as i64;
                        for dx in 0..block {
                            let x = start[0] + (i * block + dx) as i64;
                            let inside = x >= 0
                                && y >= 0
                                && z >= 0
                                && (x as usize) < v.dims[0]
                                && (y as usize) < v.dims[1]
                                && (z as usize) < v.dims[2];
                            if inside {
                                s += f(v.at(x as usize, y as usize, z as usize));
                            }
                        }
                    }
                }
                out[i + side * (j + side * k)] = s / n;
            }
        }
    }
    out
}

/// The template block-averaged onto a `side`³ grid of `block` mm voxels (steps 1–2 of the
/// module docs with another block size; `side·block` = 192 keeps the demo's cube).
pub struct TemplateGrid {
    pub side: usize,
    /// Block mean of the T1 (template units 0..255), x fastest.
    pub t1: Vec<f64>,
    /// Fraction of each block that is brain (T1 > 0).
    pub brain: Vec<f64>,
    /// Block mean of the white-matter probability (0..1).
    pub wm: Vec<f64>,
    pub affine: [[f32; 4]; 4],
    pub spacing: [f32; 3],
    pub header: ::nifti::NiftiHeader,
}

impl TemplateGrid {
    /// A volume of this grid's geometry holding `data`.
    pub fn volume(&self, data: Vec<f32>) -> Volume {
        Volume { dims: [self.side; 3], spacing: self.spacing, affine: self.affine, data, header: self.header.clone() }
    }

    /// Labels 0 (background) / 1 (head: at least half the block is brain) / 2 (a ball of
    /// `radius` voxels about `centre` (x, y, z, voxel units, may be fractional), inside the head).
    /// Errors if the centre's nearest voxel is not in white matter.
    pub fn lesion_mask(&self, centre: [f64; 3], radius: f64, name: &Path) -> Result<Volume> {
        let n = self.side;
        let c = centre.map(|v| (v.round() as usize).min(n - 1));
        let ci = c[0] + n * (c[1] + n * c[2]);
        if self.brain[ci] < 0.5 || self.wm[ci] < 0.5 {
            return Err(Error::data(name, format!("lesion centre {centre:?} is not in white matter")));
        }
        let mut mask = vec![0f32; n * n * n];
        for k in 0..n {
            for j in 0..n {
                for i in 0..n {
                    let idx = i + n * (j + n * k);
                    let d2 = [i, j, k].iter().zip(centre).map(|(&a, c)| (a as f64 - c).powi(2)).sum::<f64>();
                    mask[idx] = if self.brain[idx] < 0.5 {
                        0.0
                    } else if d2.sqrt() <= radius {
                        2.0
                    } else {
                        1.0
                    };
                }
            }
        }
        Ok(self.volume(mask))
    }
}

/// Block-average the template onto a `side`³ grid of `block`-voxel blocks, centred on the
/// bounding box of the brain (T1 > 0).
#[allow(clippy::needless_range_loop)] // affine algebra reads best with explicit indices
pub fn template_grid(mni_dir: &Path, side: usize, block: usize) -> Result<TemplateGrid> {
    let t1 = read_volume(mni_dir.join(MNI_T1))?;
    let wm = read_volume(mni_dir.join(MNI_WM))?;
    if wm.dims != t1.dims {
        return Err(Error::data(
            mni_dir.join(MNI_WM),
            format!("dims {:?} differ from the T1's {:?}", wm.dims, t1.dims),
        ));
    }
    // bounding box of the brain
    let (mut lo, mut hi) = ([usize::MAX; 3], [0usize; 3]);
    for z in 0..t1.dims[2] {
        for y in 0..t1.dims[1] {
            for x in 0..t1.dims[0] {
                if t1.at(x, y, z) > 0.0 {
                    for (a, p) in [x, y, z].into_iter().enumerate() {
                        lo[a] = lo[a].min(p);
                        hi[a] = hi[a].max(p);
                    }
                }
            }
        }
    }
    if lo[0] == usize::MAX {
        return Err(Error::data(mni_dir.join(MNI_T1), "T1 has no voxel > 0"));
    }
    let half = (side * block / 2) as i64;
    let start = [0, 1, 2].map(|a| ((lo[a] + hi[a]) / 2) as i64 - half);
    let t1m = block_mean(&t1, start, side, block, |v| v as f64);
    let brain = block_mean(&t1, start, side, block, |v| if v > 0.0 { 1.0 } else { 0.0 });
    let wmm = block_mean(&wm, start, side, block, |v| v as f64 / 255.0);

    // geometry: voxel i has its centre at template index start + block·i + (block−1)/2
    let mut affine = [[0f32; 4]; 4];
    for r in 0..3 {
        for c in 0..3 {
            affine[r][c] = t1.affine[r][c] * block as f32;
        }
        let centre = [0, 1, 2].map(|a| start[a] as f64 + (block as f64 - 1.0) / 2.0);
        affine[r][3] =
            (t1.affine[r][3] as f64 + (0..3).map(|c| t1.affine[r][c] as f64 * centre[c]).sum::<f64>()) as f32;
    }
    affine[3][3] = 1.0;
    let spacing = t1.spacing.map(|s| s * block as f32);
    let mut header = t1.header.clone();
    header.set_description_str("meddpm demo, derived from MNI152 ICBM 2009a nlin sym").ok();
    Ok(TemplateGrid { side, t1: t1m, brain, wm: wmm, affine, spacing, header })
}

/// Derive the demo pairs (mask, image) from the MNI152 folder (see the module docs).
pub fn derive_from_mni152(mni_dir: &Path) -> Result<Vec<(Volume, Volume)>> {
    let g = template_grid(mni_dir, SIDE, BLOCK)?;
    let (t1m, brain, wmm) = (&g.t1, &g.brain, &g.wm);
    let (affine, spacing, header) = (g.affine, g.spacing, &g.header);
    let dims = [SIDE; 3];

    let mut out = Vec::new();
    for (p, centre) in LESION_CENTRES.iter().enumerate() {
        let ci = centre[0] + SIDE * (centre[1] + SIDE * centre[2]);
        if brain[ci] < 0.5 || wmm[ci] < 0.5 {
            return Err(Error::data(
                mni_dir,
                format!("demo pair {p}: lesion centre {centre:?} is not in white matter"),
            ));
        }
        let mut mask = vec![0f32; SIDE * SIDE * SIDE];
        let mut image = vec![0f32; SIDE * SIDE * SIDE];
        for k in 0..SIDE {
            for j in 0..SIDE {
                for i in 0..SIDE {
                    let idx = i + SIDE * (j + SIDE * k);
                    let d2 = [i, j, k].iter().zip(centre).map(|(&a, &c)| (a as f64 - c as f64).powi(2)).sum::<f64>();
                    let d = d2.sqrt();
                    let in_brain = brain[idx] >= 0.5;
                    let lesion = in_brain && d <= LESION_RADIUS;
                    mask[idx] = if lesion {
                        2.0
                    } else if in_brain {
                        1.0
                    } else {
                        0.0
                    };
                    let factor = if lesion {
                        LESION_FACTOR
                    } else if in_brain && d <= LESION_RADIUS + 1.0 {
                        RIM_FACTOR
                    } else {
                        1.0
                    };
                    image[idx] = (t1m[idx] * factor) as f32;
                }
            }
        }
        let m = Volume { dims, spacing, affine, data: mask, header: header.clone() };
        let im = Volume { dims, spacing, affine, data: image, header: header.clone() };
        out.push((m, im));
    }
    Ok(out)
}
