//! Voxel-statistics metrics: MAE, MSE, PSNR (optionally restricted to a mask), MONAI's
//! linear-kernel MMD, and the Wasserstein-1 distance between two intensity samples.
//!
//! References: MONAI 1.6.1 `monai/metrics/regression.py` (`compute_mean_error_metrics`,
//! `PSNRMetric`: PSNR = 20·log10(max_val) − 10·log10(MSE)) and `monai/metrics/mmd.py`
//! (`compute_mmd`, the unbiased MMD² estimate of Gretton et al. 2012 with the linear kernel
//! k(a,b) = ⟨a,b⟩ on flattened voxels — a sum over voxels, so it grows with the volume size).
//! Wasserstein-1 is `scipy.stats.wasserstein_distance`: ∫|F_u(t) − F_v(t)| dt over the
//! empirical CDFs (exact, no binning). All sums are f64.

use rayon::prelude::*;

use super::{check_same_dims, Vol};
use crate::{Error, Result};

fn pair_checks(what: &str, x: Vol, y: Vol, mask: Option<&[bool]>) -> Result<usize> {
    check_same_dims(what, x.dims, y.dims)?;
    x.check_finite(&format!("{what}: first volume"))?;
    y.check_finite(&format!("{what}: second volume"))?;
    match mask {
        None => Ok(x.len()),
        Some(m) if m.len() != x.len() => {
            Err(Error::data(what, format!("mask has {} voxels, the volumes {:?} have {}", m.len(), x.dims, x.len())))
        }
        Some(m) => match m.iter().filter(|&&b| b).count() {
            0 => Err(Error::data(what, "the mask selects no voxels")),
            n => Ok(n),
        },
    }
}

fn mean_of(x: Vol, y: Vol, mask: Option<&[bool]>, n: usize, f: impl Fn(f64) -> f64) -> f64 {
    let s: f64 = match mask {
        None => x.data.iter().zip(y.data).map(|(&a, &b)| f(b as f64 - a as f64)).sum(),
        Some(m) => {
            x.data.iter().zip(y.data).zip(m).filter(|(_, &k)| k).map(|((&a, &b), _)| f(b as f64 - a as f64)).sum()
        }
    };
    s / n as f64
}

/// Mean absolute error over all voxels, or over the voxels where `mask` is true (MONAI `MAEMetric`).
pub fn mae(x: Vol, y: Vol, mask: Option<&[bool]>) -> Result<f64> {
    let n = pair_checks("mae", x, y, mask)?;
    Ok(mean_of(x, y, mask, n, f64::abs))
}

/// Mean squared error over all voxels or inside `mask` (MONAI `MSEMetric`).
pub fn mse(x: Vol, y: Vol, mask: Option<&[bool]>) -> Result<f64> {
    let n = pair_checks("mse", x, y, mask)?;
    Ok(mean_of(x, y, mask, n, |d| d * d))
}

/// PSNR in dB (MONAI `PSNRMetric(max_val)`): 20·log10(max_val) − 10·log10(MSE).
/// Identical volumes (MSE = 0) give `f64::INFINITY` (documented; the report writes "inf").
pub fn psnr(x: Vol, y: Vol, max_val: f64, mask: Option<&[bool]>) -> Result<f64> {
    if !(max_val.is_finite() && max_val > 0.0) {
        return Err(Error::Config(format!("PSNR max_val must be finite and > 0, got {max_val}")));
    }
    let m = mse(x, y, mask)?;
    Ok(if m == 0.0 { f64::INFINITY } else { 20.0 * max_val.log10() - 10.0 * m.log10() })
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&p, &q)| p as f64 * q as f64).sum()
}

/// MONAI's `MMDMetric()(y=real, y_pred=generated)` with no mapping:
/// `Σ_{i≠j}⟨yᵢ,yⱼ⟩/(m(m−1)) + Σ_{i≠j}⟨pᵢ,pⱼ⟩/(n(n−1)) − 2·Σ_{i,j}⟨pᵢ,yⱼ⟩/(mn)`.
/// Needs ≥ 2 volumes on each side, all with the same dims. MONAI also demands m = n (it
/// compares batch shapes); this function accepts m ≠ n, where the formula is still the
/// unbiased estimate. The value can be slightly negative (it is an unbiased estimate).
pub fn mmd_linear(real: &[Vol], generated: &[Vol]) -> Result<f64> {
    let (m, n) = (real.len(), generated.len());
    if m < 2 || n < 2 {
        return Err(Error::data("mmd", format!("needs ≥ 2 real and ≥ 2 generated volumes, got {m} and {n}")));
    }
    let dims = real[0].dims;
    for (i, v) in real.iter().chain(generated).enumerate() {
        check_same_dims("mmd", dims, v.dims)?;
        v.check_finite(&format!("mmd: volume {i}"))?;
    }
    let all: Vec<&[f32]> = real.iter().chain(generated).map(|v| v.data).collect();
    let pairs: Vec<(usize, usize)> = (0..m + n).flat_map(|i| (i + 1..m + n).map(move |j| (i, j))).collect();
    let dots: Vec<f64> = pairs.par_iter().map(|&(i, j)| dot(all[i], all[j])).collect();
    let (mut a, mut b, mut c) = (0.0, 0.0, 0.0);
    for (&(i, j), &d) in pairs.iter().zip(&dots) {
        match (i < m, j < m) {
            (true, true) => a += 2.0 * d,
            (false, false) => b += 2.0 * d,
            _ => c += d,
        }
    }
    let (mf, nf) = (m as f64, n as f64);
    Ok(a / (mf * (mf - 1.0)) + b / (nf * (nf - 1.0)) - 2.0 * c / (mf * nf))
}

/// Wasserstein-1 distance between the empirical distributions of two samples (any sizes):
/// ∫|F_u − F_v| over the merged sorted values (= `scipy.stats.wasserstein_distance(u, v)`).
pub fn wasserstein1(u: &[f32], v: &[f32]) -> Result<f64> {
    if u.is_empty() || v.is_empty() {
        return Err(Error::data("wasserstein1", format!("empty sample ({} and {} values)", u.len(), v.len())));
    }
    if u.iter().chain(v).any(|x| !x.is_finite()) {
        return Err(Error::data("wasserstein1", "sample holds NaN or infinite values"));
    }
    Ok(wasserstein1_sorted(&sorted_f64(u), &sorted_f64(v)))
}

/// The values of a sample as f64, sorted ascending (input for [`wasserstein1_sorted`]).
pub fn sorted_f64(s: &[f32]) -> Vec<f64> {
    let mut s: Vec<f64> = s.iter().map(|&x| x as f64).collect();
    s.par_sort_unstable_by(f64::total_cmp);
    s
}

/// Wasserstein-1 of two non-empty, finite, ascending samples (see [`wasserstein1`]): between
/// consecutive merged values t < t', the CDFs are constant, so the integral is a sum of
/// |i/n_a − j/n_b|·(t' − t).
pub fn wasserstein1_sorted(a: &[f64], b: &[f64]) -> f64 {
    assert!(!a.is_empty() && !b.is_empty(), "wasserstein1_sorted: empty sample");
    let (na, nb) = (a.len() as f64, b.len() as f64);
    let (mut i, mut j, mut total) = (0usize, 0usize, 0.0f64);
    let mut prev = a[0].min(b[0]);
    while i < a.len() || j < b.len() {
        let take_a = j == b.len() || (i < a.len() && a[i] <= b[j]);
        let t = if take_a { a[i] } else { b[j] };
        total += (i as f64 / na - j as f64 / nb).abs() * (t - prev);
        prev = t;
        if take_a {
            i += 1;
        } else {
            j += 1;
        }
    }
    total
}
