//! Test helpers shared by this crate's tests, the gradient checks and the CUDA parity tests:
//! tolerance comparison with an llm.c-style report, deterministic random inputs from Philox, and
//! central finite differences; fresh scratch folders for file-writing tests.
//!
//! A pair (got, want) is within tolerance when |got − want| ≤ abs + rel·|want| (numpy `allclose`).
//! [`compare`] prints, per tensor: its name, the first 5 pairs, OK / NOT OK, the largest absolute
//! difference, the relative difference at that element, and the share of the tolerance used by
//! the worst element (100 % = exactly at the limit).

use crate::rng::Philox;
use std::path::PathBuf;

/// Allowed difference: |got − want| ≤ abs + rel·|want|.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    pub abs: f64,
    pub rel: f64,
}

impl Tolerance {
    pub const fn new(abs: f64, rel: f64) -> Self {
        Tolerance { abs, rel }
    }
    fn limit(&self, want: f64) -> f64 {
        self.abs + self.rel * want.abs()
    }
}

/// Outcome of a successful [`compare`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Report {
    /// Largest |got − want| and its element index.
    pub max_abs: f64,
    pub max_abs_at: usize,
    /// |got − want| / |want| at `max_abs_at` (∞ if want is 0 there and got is not).
    pub rel_at_max: f64,
    /// max over elements of |got − want| / (abs + rel·|want|), in percent.
    pub tol_used_pct: f64,
}

/// Compare `got` with `want` element by element; print a report; `Err` describes the failure
/// (length mismatch, non-finite value, or any element outside `tol`).
pub fn compare<A: Copy + Into<f64>, B: Copy + Into<f64>>(
    name: &str,
    got: &[A],
    want: &[B],
    tol: Tolerance,
) -> Result<Report, String> {
    if got.len() != want.len() {
        let msg = format!("{name}: length {} vs expected {}", got.len(), want.len());
        println!("{msg}");
        return Err(msg);
    }
    let pairs: Vec<String> =
        got.iter().zip(want).take(5).map(|(&g, &w)| format!("{:+.6e} {:+.6e}", g.into(), w.into())).collect();
    let mut r = Report { max_abs: 0.0, max_abs_at: 0, rel_at_max: 0.0, tol_used_pct: 0.0 };
    let (mut bad, mut first_bad, mut nonfinite) = (0usize, None, false);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (g, w): (f64, f64) = (g.into(), w.into());
        if !g.is_finite() || !w.is_finite() {
            nonfinite = true;
            first_bad.get_or_insert(i);
            bad += 1;
            continue;
        }
        let d = (g - w).abs();
        let used = d / tol.limit(w);
        if d > r.max_abs || i == 0 {
            r.max_abs = d;
            r.max_abs_at = i;
            r.rel_at_max = if w != 0.0 {
                d / w.abs()
            } else if d == 0.0 {
                0.0
            } else {
                f64::INFINITY
            };
        }
        r.tol_used_pct = r.tol_used_pct.max(100.0 * used);
        if used > 1.0 {
            bad += 1;
            first_bad.get_or_insert(i);
        }
    }
    let ok = bad == 0;
    println!("{name} ({} elements): first pairs (got, want): {}", got.len(), pairs.join(" | "));
    println!(
        "  {} max abs diff {:.3e} at [{}] (rel {:.3e}), tolerance used {:.1}% (abs {:.1e}, rel {:.1e})",
        if ok { "OK" } else { "NOT OK" },
        r.max_abs,
        r.max_abs_at,
        r.rel_at_max,
        r.tol_used_pct,
        tol.abs,
        tol.rel
    );
    if ok {
        Ok(r)
    } else {
        let i = first_bad.unwrap_or(0);
        let (g, w): (f64, f64) = (got[i].into(), want[i].into());
        Err(format!(
            "{name}: {bad} of {} elements out of tolerance{}; first at [{i}]: got {g:e}, want {w:e}; \
             max abs diff {:.3e}, tolerance used {:.1}%",
            got.len(),
            if nonfinite { " (non-finite values)" } else { "" },
            r.max_abs,
            r.tol_used_pct
        ))
    }
}

/// `len` standard normals × `scale`, draws `0..len` of Philox stream (seed, stream), as f64.
pub fn randn_f64(seed: u64, stream: u64, len: usize, scale: f64) -> Vec<f64> {
    let r = Philox::new(seed, stream);
    (0..len).map(|i| r.normal(i as u64) as f64 * scale).collect()
}

/// Like [`randn_f64`], as f32.
pub fn randn_f32(seed: u64, stream: u64, len: usize, scale: f32) -> Vec<f32> {
    let r = Philox::new(seed, stream);
    (0..len).map(|i| r.normal(i as u64) * scale).collect()
}

/// `len` uniforms in [lo, hi) from Philox stream (seed, stream), as f64.
pub fn uniform_f64(seed: u64, stream: u64, len: usize, lo: f64, hi: f64) -> Vec<f64> {
    let r = Philox::new(seed, stream);
    (0..len).map(|i| lo + (hi - lo) * (r.block(i as u64)[0] as f64 / 4294967296.0)).collect()
}

/// Central differences of a scalar function: g[i] ≈ (f(x + h·eᵢ) − f(x − h·eᵢ)) / 2h.
/// `x` is restored exactly on return.
pub fn central_diff(x: &mut [f64], h: f64, mut f: impl FnMut(&[f64]) -> f64) -> Vec<f64> {
    (0..x.len())
        .map(|i| {
            let x0 = x[i];
            x[i] = x0 + h;
            let fp = f(x);
            x[i] = x0 - h;
            let fm = f(x);
            x[i] = x0;
            (fp - fm) / (2.0 * h)
        })
        .collect()
}

/// Σ r·y: the scalar loss whose gradient with respect to y is r.
pub fn dot(r: &[f64], y: &[f64]) -> f64 {
    assert_eq!(r.len(), y.len(), "dot: lengths differ");
    r.iter().zip(y).map(|(a, b)| a * b).sum()
}

/// A fresh, empty, absolute (symbolic links resolved) folder for a test that writes files:
/// `meddpm-{tag}-{pid}` under the system's temporary folder, emptied first.
pub fn scratch_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meddpm-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("creating {}: {e}", d.display()));
    d.canonicalize().unwrap_or_else(|e| panic!("resolving {}: {e}", d.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn compare_detects_differences() {
        let t = Tolerance::new(1e-3, 1e-2);
        let r = compare("same", &[1.0f32, 2.0, 0.0], &[1.0f64, 2.01, 0.0005], t).unwrap();
        assert!((r.max_abs - 0.01).abs() < 1e-6 && r.max_abs_at == 1, "{r:?}");
        assert!(compare("off", &[1.0f32, 2.0], &[1.0f32, 2.1], t).is_err());
        assert!(compare("len", &[1.0f32], &[1.0f32, 2.0], t).is_err());
        assert!(compare("nan", &[f32::NAN], &[1.0f32], t).is_err());
    }
    #[test]
    fn central_diff_of_cubic() {
        let mut x = vec![0.5, -1.0];
        let g = central_diff(&mut x, 1e-4, |x| x[0].powi(3) + 2.0 * x[1]);
        assert!((g[0] - 0.75).abs() < 1e-7 && (g[1] - 2.0).abs() < 1e-9, "{g:?}");
        assert_eq!(x, vec![0.5, -1.0]);
    }
}
