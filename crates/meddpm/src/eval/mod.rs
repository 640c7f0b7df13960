//! Synthesis-quality metrics for generated 3D volumes, computed without any network weights:
//! SSIM and MS-SSIM (3D), PSNR and MAE (whole volume and inside a mask), linear-kernel MMD on
//! voxels, Wasserstein-1 between voxel-intensity distributions per tissue label, mean intensity per
//! label, and diversity (mean pairwise MS-SSIM among samples drawn for the same mask).
//!
//! Semantics are MONAI's (`monai/metrics/regression.py` and `mmd.py`, MONAI 1.6.1; the MS-SSIM is
//! the MONAI-core `compute_ms_ssim`, see [`ssim`] for how it differs from the older
//! GenerativeModels copy). `tools/eval_reference/make_reference.py` computes MONAI's values on
//! fixed volumes; `tests/eval_reference.rs` checks this code against them. Everything here
//! accumulates in f64 (MONAI runs SSIM in f32, so agreement with MONAI is ~1e-6, not exact).
//!
//! Inputs are plain volumes: `&[f32]` in (D,H,W) order, W fastest (the model's layout). Labels
//! are `u8` per voxel. Bad input (empty, size mismatch, NaN/∞, too small for the window) is a
//! [`crate::Error`]; nothing here panics on user data.
//!
//! - [`ssim`]    Gaussian-window SSIM / contrast-structure and multi-scale SSIM
//! - [`stats`]   PSNR, MAE, MMD, Wasserstein-1, masked means
//! - [`configs`] the verdict and report of `meddpm eval-configs` (configurations vs a baseline)
//! - [`config_runs`] its running side: which configurations run, sampling them, the report
//!   assembled, the panels
//! - [`report`]  the evaluation of a set of generated volumes against real ones → JSON + Markdown
//! - [`samplers`] the sampler study: `meddpm sample` timings + eval reports → table, CSV, SVG

pub mod config_runs;
pub mod configs;
pub mod report;
pub mod samplers;
pub mod ssim;
pub mod stats;

pub use report::{evaluate, EvalReport, EvalSettings, NamedVolume};
pub use ssim::{ms_ssim, ms_ssim_detail, ms_ssim_kernel_for, ssim, ssim_and_cs, MsSsimParams, SsimParams};
pub use stats::{mae, mmd_linear, psnr, wasserstein1};

use crate::{Error, Result};

/// A borrowed 3D volume: `data.len() == D·H·W`, index `(z·H + y)·W + x`.
#[derive(Clone, Copy, Debug)]
pub struct Vol<'a> {
    pub dims: [usize; 3],
    pub data: &'a [f32],
}

impl<'a> Vol<'a> {
    /// Checks that the dims are non-zero and match the data length. `what` names the volume in
    /// the error (a file name, "generated[3]", ...).
    pub fn new(what: &str, dims: [usize; 3], data: &'a [f32]) -> Result<Self> {
        let n = dims.iter().product::<usize>();
        if n == 0 {
            return Err(Error::data(what, format!("empty volume (dims {dims:?})")));
        }
        if data.len() != n {
            return Err(Error::data(what, format!("dims {dims:?} need {n} voxels but the data holds {}", data.len())));
        }
        Ok(Vol { dims, data })
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Error if any voxel is NaN or infinite (names the first one as (z,y,x)).
    pub fn check_finite(&self, what: &str) -> Result<()> {
        if let Some(i) = self.data.iter().position(|v| !v.is_finite()) {
            let [_, h, w] = self.dims;
            let (z, y, x) = (i / (h * w), (i / w) % h, i % w);
            return Err(Error::data(
                what,
                format!("voxel (z={z}, y={y}, x={x}) is {}; metrics need finite values", self.data[i]),
            ));
        }
        Ok(())
    }
}

/// Error unless two volumes have the same dims.
pub fn check_same_dims(what: &str, a: [usize; 3], b: [usize; 3]) -> Result<()> {
    if a != b {
        return Err(Error::data(what, format!("size mismatch: {a:?} vs {b:?} (D,H,W)")));
    }
    Ok(())
}

/// Converts a label volume stored as floats (as NIfTI readers return it) into `u8` labels.
/// Each value must be within 1e-3 of an integer in 0..=255.
pub fn labels_from_f32(what: &str, data: &[f32]) -> Result<Vec<u8>> {
    data.iter()
        .enumerate()
        .map(|(i, &v)| {
            let r = v.round();
            if !v.is_finite() || (v - r).abs() > 1e-3 || !(0.0..=255.0).contains(&r) {
                Err(Error::data(what, format!("voxel {i} = {v} is not a label (an integer in 0..=255)")))
            } else {
                Ok(r as u8)
            }
        })
        .collect()
}
