//! 3D SSIM and multi-scale SSIM with MONAI's exact definitions (`monai/metrics/regression.py`:
//! `compute_ssim_and_cs`, `compute_ms_ssim`, `_gaussian_kernel`; MONAI 1.6.1).
//!
//! SSIM (Wang et al. 2004) with a Gaussian window:
//! - window = outer product of three 1D Gaussians `g_i ∝ exp(-((i - (k-1)/2)/σ)²/2)`, each
//!   normalised to sum 1 (σ = 1.5, k = 11 by default); applied as a "valid" 3D correlation (no
//!   padding: the maps are (D-k+1)×(H-k+1)×(W-k+1));
//! - μx, μy, E[x²], E[y²], E[xy] are window averages; σx² = E[x²]-μx², σy² = E[y²]-μy²,
//!   σxy = E[xy]-μxμy; C1 = (K1·L)², C2 = (K2·L)² with L = data_range, K1 = 0.01, K2 = 0.03;
//! - cs = (2σxy + C2)/(σx² + σy² + C2), ssim = (2μxμy + C1)/(μx² + μy² + C1) · cs;
//! - SSIM and CS are the means of those maps over all valid positions.
//!
//! MS-SSIM (Wang et al. 2003) as MONAI core computes it: for each of the n = len(weights) scales
//! compute the mean cs and mean ssim, then 2×2×2 average-pool both volumes (stride 2, odd
//! sizes floored). Scales 1..n-1 contribute relu(mean cs), the last contributes relu(mean ssim);
//! the result is Π termᵢ^weightᵢ, weights (0.0448, 0.2856, 0.3001, 0.2363, 0.1333).
//! MONAI's size check: for every axis, `dim // max(1, n-1)² > k - 1` (dim ≥ 16k for 5 weights:
//! ≥ 112 for k = 7, ≥ 176 for the default k = 11; so 128³ needs k ≤ 7). This code applies that
//! check and, in addition, requires the last scale to be at least k wide (only stricter for
//! unusual weight counts, where MONAI would fail inside torch's conv).
//!
//! Differences from the older GenerativeModels `MSSSIM` (generative/metrics/ms_ssim.py): that
//! one required every dim divisible by 2^(n-1) and ≥ (k+2)·2^(n-1), padded odd sizes before
//! pooling and defaulted to k = 7; for sizes it accepts, the values are the same.
//!
//! Everything is computed in f64 (MONAI casts to f32); the window is separable, so it is applied
//! as three 1D passes (W, then H, then D), which is the same sum in a different order.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::{check_same_dims, Vol};
use crate::{Error, Result};

/// MS-SSIM scale weights of Wang et al. 2003 (MONAI's default).
pub const MS_SSIM_WEIGHTS: [f64; 5] = [0.0448, 0.2856, 0.3001, 0.2363, 0.1333];

/// SSIM settings (MONAI names in brackets).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SsimParams {
    /// Window size per axis [win_size / kernel_size], default 11.
    pub kernel_size: usize,
    /// Gaussian σ in voxels [kernel_sigma], default 1.5.
    pub sigma: f64,
    /// Luminance constant [k1], default 0.01.
    pub k1: f64,
    /// Contrast constant [k2], default 0.03.
    pub k2: f64,
    /// Value range of the inputs [data_range], default 1.
    pub data_range: f64,
}

impl Default for SsimParams {
    fn default() -> Self {
        SsimParams { kernel_size: 11, sigma: 1.5, k1: 0.01, k2: 0.03, data_range: 1.0 }
    }
}

impl SsimParams {
    /// Rejects settings that could make the result NaN: C1 and C2 must be > 0, so K1, K2 and
    /// data_range must be positive (MONAI would accept zeros and return NaN on flat regions).
    pub fn validate(&self) -> Result<()> {
        let pos = |v: f64| v.is_finite() && v > 0.0;
        if self.kernel_size == 0 {
            return Err(Error::Config("SSIM kernel_size must be ≥ 1".into()));
        }
        if !pos(self.sigma) || !pos(self.k1) || !pos(self.k2) || !pos(self.data_range) {
            return Err(Error::Config(format!(
                "SSIM needs finite positive sigma, k1, k2 and data_range, got {self:?}"
            )));
        }
        Ok(())
    }

    pub fn c1(&self) -> f64 {
        (self.k1 * self.data_range).powi(2)
    }

    pub fn c2(&self) -> f64 {
        (self.k2 * self.data_range).powi(2)
    }
}

/// MONAI's 1D Gaussian window: offsets (1-k)/2, (1-k)/2 + 1, ..., (k-1)/2, normalised to sum 1.
pub fn gaussian_1d(kernel_size: usize, sigma: f64) -> Vec<f64> {
    let start = (1.0 - kernel_size as f64) / 2.0;
    let g: Vec<f64> = (0..kernel_size).map(|i| (-((start + i as f64) / sigma).powi(2) / 2.0).exp()).collect();
    let s: f64 = g.iter().sum();
    g.into_iter().map(|v| v / s).collect()
}

/// Mean SSIM and mean contrast-structure over the valid positions of one scale.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SsimCs {
    pub ssim: f64,
    pub cs: f64,
}

/// Mean SSIM and CS of two volumes (MONAI `compute_ssim_and_cs`, then the mean of each map).
/// `x` plays MONAI's `y_pred`, `y` its `y` (the formula is symmetric).
pub fn ssim_and_cs(x: Vol, y: Vol, p: &SsimParams) -> Result<SsimCs> {
    p.validate()?;
    check_same_dims("ssim", x.dims, y.dims)?;
    x.check_finite("ssim: first volume")?;
    y.check_finite("ssim: second volume")?;
    check_fits("ssim", x.dims, p.kernel_size)?;
    let g = gaussian_1d(p.kernel_size, p.sigma);
    Ok(ssim_cs_f64(x.dims, &widen(x.data), &widen(y.data), &g, p.c1(), p.c2()))
}

/// Mean SSIM of two volumes (MONAI `SSIMMetric(spatial_dims=3)`).
pub fn ssim(x: Vol, y: Vol, p: &SsimParams) -> Result<f64> {
    Ok(ssim_and_cs(x, y, p)?.ssim)
}

/// MS-SSIM settings: the per-scale SSIM settings and one weight per scale.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MsSsimParams {
    pub ssim: SsimParams,
    pub weights: Vec<f64>,
}

impl Default for MsSsimParams {
    fn default() -> Self {
        MsSsimParams { ssim: SsimParams::default(), weights: MS_SSIM_WEIGHTS.to_vec() }
    }
}

impl MsSsimParams {
    /// Default settings with a given window size (e.g. 7 for 128³ volumes).
    pub fn with_kernel(kernel_size: usize) -> Self {
        let mut p = Self::default();
        p.ssim.kernel_size = kernel_size;
        p
    }

    pub fn validate(&self) -> Result<()> {
        self.ssim.validate()?;
        if self.weights.is_empty() || self.weights.iter().any(|w| !w.is_finite() || *w < 0.0) {
            return Err(Error::Config(format!(
                "MS-SSIM needs at least one finite non-negative weight, got {:?}",
                self.weights
            )));
        }
        Ok(())
    }
}

/// Smallest size an axis may have for MS-SSIM with `n_weights` scales and window `kernel_size`:
/// MONAI's check (`dim // max(1, n-1)² > k-1`) and "the last scale is at least k wide".
pub fn ms_ssim_min_dim(kernel_size: usize, n_weights: usize) -> usize {
    let wd = n_weights.saturating_sub(1).max(1).pow(2);
    let halvings = n_weights.saturating_sub(1) as u32;
    (kernel_size * wd).max(kernel_size << halvings)
}

/// The largest odd window ≤ `max_kernel` that MS-SSIM accepts for these dims (7 at 128³ with 5
/// scales, 11 from 176³ on). Error if not even k = 1 fits.
pub fn ms_ssim_kernel_for(dims: [usize; 3], n_weights: usize, max_kernel: usize) -> Result<usize> {
    let smallest = *dims.iter().min().unwrap_or(&0);
    (1..=max_kernel).rev().filter(|k| k % 2 == 1).find(|&k| ms_ssim_min_dim(k, n_weights) <= smallest).ok_or_else(
        || {
            Error::Config(format!(
                "volume {dims:?} is too small for MS-SSIM with {n_weights} scales: every axis needs ≥ {}",
                ms_ssim_min_dim(1, n_weights)
            ))
        },
    )
}

/// MS-SSIM value with the per-scale means it was built from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MsSsimDetail {
    pub value: f64,
    /// Mean SSIM and CS at each scale (scale 0 = full resolution).
    pub scales: Vec<SsimCs>,
    /// Volume dims at each scale.
    pub dims: Vec<[usize; 3]>,
}

/// MS-SSIM of two volumes (MONAI `MultiScaleSSIMMetric(spatial_dims=3)`).
pub fn ms_ssim(x: Vol, y: Vol, p: &MsSsimParams) -> Result<f64> {
    Ok(ms_ssim_detail(x, y, p)?.value)
}

/// MS-SSIM with per-scale details; see the module docs for the definition.
pub fn ms_ssim_detail(x: Vol, y: Vol, p: &MsSsimParams) -> Result<MsSsimDetail> {
    p.validate()?;
    check_same_dims("ms_ssim", x.dims, y.dims)?;
    x.check_finite("ms_ssim: first volume")?;
    y.check_finite("ms_ssim: second volume")?;
    let (k, n) = (p.ssim.kernel_size, p.weights.len());
    let need = ms_ssim_min_dim(k, n);
    if x.dims.iter().any(|&d| d < need) {
        return Err(Error::data(
            "ms_ssim",
            format!(
                "volume {:?} is too small for {n} scales with window {k}: every axis needs ≥ {need} \
                 (MONAI: dim // {} > {}); use a smaller kernel_size",
                x.dims,
                n.saturating_sub(1).max(1).pow(2),
                k - 1
            ),
        ));
    }
    let g = gaussian_1d(k, p.ssim.sigma);
    let (c1, c2) = (p.ssim.c1(), p.ssim.c2());
    let (mut dims, mut a, mut b) = (x.dims, widen(x.data), widen(y.data));
    let mut scales = Vec::with_capacity(n);
    let mut all_dims = Vec::with_capacity(n);
    for s in 0..n {
        scales.push(ssim_cs_f64(dims, &a, &b, &g, c1, c2));
        all_dims.push(dims);
        if s + 1 < n {
            let (d2, a2) = avg_pool2(dims, &a);
            let (_, b2) = avg_pool2(dims, &b);
            (dims, a, b) = (d2, a2, b2);
        }
    }
    let value = scales
        .iter()
        .zip(&p.weights)
        .enumerate()
        .map(|(i, (sc, &w))| {
            let term = if i + 1 < n { sc.cs } else { sc.ssim };
            term.max(0.0).powf(w)
        })
        .product();
    Ok(MsSsimDetail { value, scales, dims: all_dims })
}

/// 2×2×2 average pooling with stride 2; odd sizes are floored (torch `avg_pool3d(kernel_size=2)`).
pub fn avg_pool2(dims: [usize; 3], v: &[f64]) -> ([usize; 3], Vec<f64>) {
    let [d, h, w] = dims;
    let (od, oh, ow) = (d / 2, h / 2, w / 2);
    let mut out = vec![0.0; od * oh * ow];
    out.par_chunks_mut((oh * ow).max(1)).enumerate().for_each(|(z, plane)| {
        for y in 0..oh {
            for x in 0..ow {
                let mut s = 0.0;
                for dz in 0..2 {
                    for dy in 0..2 {
                        let row = ((2 * z + dz) * h + 2 * y + dy) * w + 2 * x;
                        s += v[row] + v[row + 1];
                    }
                }
                plane[y * ow + x] = s / 8.0;
            }
        }
    });
    ([od, oh, ow], out)
}

fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn check_fits(what: &str, dims: [usize; 3], k: usize) -> Result<()> {
    if dims.iter().any(|&d| d < k) {
        return Err(Error::data(what, format!("volume {dims:?} is smaller than the {k}³ window")));
    }
    Ok(())
}

/// The SSIM and CS map means for f64 volumes of `dims` (each axis ≥ g.len()).
/// Passes: W and H per input plane (5 moments → [plane][5]), then D per output plane.
fn ssim_cs_f64(dims: [usize; 3], x: &[f64], y: &[f64], g: &[f64], c1: f64, c2: f64) -> SsimCs {
    let [d, h, w] = dims;
    let k = g.len();
    assert!(d >= k && h >= k && w >= k, "ssim: dims {dims:?} smaller than window {k}");
    assert_eq!(x.len(), d * h * w, "ssim: x has {} voxels for dims {dims:?}", x.len());
    assert_eq!(y.len(), d * h * w, "ssim: y has {} voxels for dims {dims:?}", y.len());
    let (od, oh, ow) = (d - k + 1, h - k + 1, w - k + 1);
    let plane = oh * ow;

    // W then H: moments (x, y, x², y², xy) of every input plane, filtered in-plane.
    let mut hw = vec![0.0f64; d * plane * 5];
    hw.par_chunks_mut(plane * 5).enumerate().for_each(|(z, out)| {
        let mut rows = vec![0.0f64; h * ow * 5];
        for yy in 0..h {
            let base = (z * h + yy) * w;
            let (xr, yr) = (&x[base..base + w], &y[base..base + w]);
            for ox in 0..ow {
                let mut m = [0.0f64; 5];
                for (t, &gt) in g.iter().enumerate() {
                    let (a, b) = (xr[ox + t], yr[ox + t]);
                    m[0] += gt * a;
                    m[1] += gt * b;
                    m[2] += gt * (a * a);
                    m[3] += gt * (b * b);
                    m[4] += gt * (a * b);
                }
                rows[(yy * ow + ox) * 5..][..5].copy_from_slice(&m);
            }
        }
        for oy in 0..oh {
            for ox in 0..ow {
                let mut m = [0.0f64; 5];
                for (t, &gt) in g.iter().enumerate() {
                    let r = &rows[((oy + t) * ow + ox) * 5..][..5];
                    for q in 0..5 {
                        m[q] += gt * r[q];
                    }
                }
                out[(oy * ow + ox) * 5..][..5].copy_from_slice(&m);
            }
        }
    });

    // D, then the SSIM formula; per-plane sums collected in order (deterministic).
    let sums: Vec<(f64, f64)> = (0..od)
        .into_par_iter()
        .map(|oz| {
            let mut acc = vec![0.0f64; plane * 5];
            for (t, &gt) in g.iter().enumerate() {
                let src = &hw[(oz + t) * plane * 5..][..plane * 5];
                for (a, s) in acc.iter_mut().zip(src) {
                    *a += gt * s;
                }
            }
            let (mut ss, mut cs) = (0.0, 0.0);
            for m in acc.chunks_exact(5) {
                let (mx, my) = (m[0], m[1]);
                let sx = m[2] - mx * mx;
                let sy = m[3] - my * my;
                let sxy = m[4] - mx * my;
                let c = (2.0 * sxy + c2) / (sx + sy + c2);
                ss += (2.0 * mx * my + c1) / (mx * mx + my * my + c1) * c;
                cs += c;
            }
            (ss, cs)
        })
        .collect();
    let n = (od * plane) as f64;
    let (ss, cs) = sums.iter().fold((0.0, 0.0), |(a, b), &(s, c)| (a + s, b + c));
    SsimCs { ssim: ss / n, cs: cs / n }
}
