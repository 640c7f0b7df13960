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

/// ‖got − want‖₂ / ‖want‖₂ (the absolute norm when `want` is all zeros): the whole-tensor error
/// measure of reduced-precision network checks, where single elements move by more than the
/// tensor's RMS while the tensor as a whole stays close.
pub fn rel_l2<A: Copy + Into<f64>, B: Copy + Into<f64>>(got: &[A], want: &[B]) -> f64 {
    assert_eq!(got.len(), want.len(), "rel_l2: lengths differ");
    let num: f64 = got.iter().zip(want).map(|(&a, &b)| (a.into() - b.into()).powi(2)).sum::<f64>().sqrt();
    let den: f64 = want.iter().map(|&b| b.into().powi(2)).sum::<f64>().sqrt();
    if den > 0.0 {
        num / den
    } else {
        num
    }
}

/// Bounds for a set of tensors checked by [`rel_l2`]: each tensor within `each`, their median
/// within `median`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct L2Bounds {
    pub each: f64,
    pub median: f64,
}

/// bf16 networks against the float64 PyTorch golden files (output, and every parameter gradient
/// from the golden output's loss gradient): the CPU's bf16 emulation and the GPU's bf16 backend.
/// The emulation measured a median 1.9e-2 / 2.2e-2 and worst 3.5e-2 / 5.3e-2 (tiny / tiny_heads2);
/// the H200's bf16 a median 1.7e-2 … 2.2e-2 and worst 5.6e-2 / 6.0e-2 over the two models and
/// layouts in two runs (`docs/perf/results/golden-summary.txt`, `golden-final.log.gz`). A
/// layout, index or weight bug moves whole tensors by O(1).
pub const GOLDEN_BF16: L2Bounds = L2Bounds { each: 0.2, median: 0.05 };

/// The CPU's fp8 emulation (`CpuBackend::fp8`: E4M3 operands in the wide convs' forward, bf16
/// elsewhere) against the same golden files, every tensor as for bf16: measured a median 1.1e-1 /
/// 7.3e-2 and worst 3.2e-1 / 2.2e-1 (tiny / tiny_heads2). The gradients move more than the
/// output: the backward runs in bf16 from activations the fp8 forward produced.
pub const GOLDEN_FP8: L2Bounds = L2Bounds { each: 0.5, median: 0.15 };

/// The fp8 emulation's output against the golden output (relative L2): measured 3.3e-2 / 2.0e-2
/// (tiny / tiny_heads2), about 3 times bf16's 8.6e-3 / 9.8e-3; a wrong scale moves it by O(1).
pub const GOLDEN_FP8_OUT: f64 = 0.06;

/// TF32 (10-bit mantissa conv and GEMM operands, f32 storage) against the same golden files, on
/// the GPU: measured on the H200 a median 0.8e-3 … 1.7e-3 and worst 4.4e-3 over the two models
/// and layouts in two runs (`docs/perf/results/golden-summary.txt`, `golden-final.log.gz`),
/// about a tenth of bf16's.
pub const GOLDEN_TF32: L2Bounds = L2Bounds { each: 0.03, median: 0.01 };

/// Check named (got, want) tensors against [`L2Bounds`]; prints every tensor's relative L2 error
/// and the median; `Err` lists the tensors over `each` and a median over `median`. Returns the
/// (median, max) on success.
pub fn check_rel_l2_set(
    what: &str,
    tensors: &[(String, Vec<f32>, Vec<f32>)],
    b: L2Bounds,
) -> Result<(f64, f64), String> {
    assert!(!tensors.is_empty(), "check_rel_l2_set: no tensors");
    let mut errs = Vec::new();
    let mut rels = Vec::new();
    for (name, got, want) in tensors {
        if got.iter().any(|v| !v.is_finite()) {
            errs.push(format!("{what} {name}: non-finite values"));
            rels.push(f64::INFINITY);
            continue;
        }
        let r = rel_l2(got, want);
        println!("  {what} {name}: rel L2 {r:.2e}");
        if r > b.each {
            errs.push(format!("{what} {name}: relative L2 error {r:.3e} > {:.0e}", b.each));
        }
        rels.push(r);
    }
    rels.sort_by(f64::total_cmp);
    let (med, max) = (rels[rels.len() / 2], rels[rels.len() - 1]);
    println!(
        "{what}: rel L2 median {med:.2e}, max {max:.2e} over {} tensors (limits {:.0e} each, {:.0e} median)",
        rels.len(),
        b.each,
        b.median
    );
    if med > b.median {
        errs.push(format!("{what}: median relative L2 error {med:.3e} > {:.0e}", b.median));
    }
    if errs.is_empty() {
        Ok((med, max))
    } else {
        Err(errs.join("\n"))
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
    fn rel_l2_set_catches_one_bad_tensor_and_a_high_median() {
        assert_eq!(rel_l2(&[3.0f32, 4.0], &[3.0f32, 4.0]), 0.0);
        assert!((rel_l2(&[3.0f32, 4.0], &[0.0f32, 0.0]) - 5.0).abs() < 1e-12);
        assert!((rel_l2(&[1.1f32, 0.0], &[1.0f64, 0.0]) - 0.1).abs() < 1e-6);
        let t = |n: &str, got: Vec<f32>| (n.to_string(), got, vec![1.0f32; 4]);
        let b = L2Bounds { each: 0.2, median: 0.02 };
        let good = [t("a", vec![1.0; 4]), t("b", vec![1.01; 4]), t("c", vec![1.1; 4])];
        let (med, max) = check_rel_l2_set("good", &good, b).unwrap();
        assert!((med - 0.01).abs() < 1e-6 && (max - 0.1).abs() < 1e-6, "{med} {max}");
        let one_bad = [t("a", vec![1.0; 4]), t("b", vec![1.0; 4]), t("c", vec![2.0; 4])];
        assert!(check_rel_l2_set("one bad", &one_bad, b).unwrap_err().contains("one bad c"));
        let high_median = [t("a", vec![1.05; 4]), t("b", vec![1.05; 4]), t("c", vec![1.0; 4])];
        assert!(check_rel_l2_set("median", &high_median, b).unwrap_err().contains("median"));
        let nan = [t("a", vec![f32::NAN; 4])];
        assert!(check_rel_l2_set("nan", &nan, b).unwrap_err().contains("non-finite"));
    }

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
