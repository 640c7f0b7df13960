//! Trilinear ×2 upsampling in D, H and W with `align_corners=False` (PyTorch
//! `F.interpolate(mode="trilinear")`), forward and its exact adjoint.
//!
//! Along each axis of input length `n`, output index o reads source coordinate
//! src = max((o + ½)/2 − ½, 0), i0 = ⌊src⌋, i1 = min(i0 + 1, n − 1), λ = src − i0, with weights
//! (1 − λ, λ). The 3-D weight of a corner is the product of the three axis weights. Backward
//! scatters each output gradient to the same 8 corners with the same weights. The weights are a
//! product, so both directions run as three 1-D passes (forward W, H, D; backward D, H, W), in
//! f64. Parallel over (n, c) channels, which own disjoint input and output blocks.

use rayon::prelude::*;

use super::float::{put, vectorized, Float};
use crate::backend::Accum;
use crate::shape::Dims;

/// Per output index of one axis: (i0, i1, 1 − λ, λ).
pub fn axis_taps(n: usize) -> Vec<(usize, usize, f64, f64)> {
    (0..2 * n)
        .map(|o| {
            let src = ((o as f64 + 0.5) / 2.0 - 0.5).max(0.0);
            let i0 = src.floor() as usize;
            let i1 = (i0 + 1).min(n - 1);
            let l = src - i0 as f64;
            (i0, i1, 1.0 - l, l)
        })
        .collect()
}

/// out (N, C, 2D, 2H, 2W) from inp of shape `x`: separably, W then H then D (each pass a 2-tap
/// interpolation along one axis, in f64; the H and D passes are whole-row vector operations).
pub fn upsample_forward<T: Float>(out: &mut [T], inp: &[T], x: Dims) {
    assert_eq!(inp.len(), x.numel(), "upsample: input length vs {x}");
    assert_eq!(out.len(), x.up2().numel(), "upsample: output length vs {}", x.up2());
    let (td, th, tw) = (axis_taps(x.d), axis_taps(x.h), axis_taps(x.w));
    let (s, so) = (x.s(), x.up2().s());
    let (w2, h2) = (2 * x.w, 2 * x.h);
    out.par_chunks_mut(so).zip(inp.par_chunks(s)).for_each(|(o, xi)| {
        vectorized(
            #[inline(always)]
            || {
                // W: t1[d][h][ow]; H: t2[d][oh][ow]; D: o[od][oh][ow].
                let mut t1 = vec![0f64; x.d * x.h * w2];
                for (r, row) in t1.chunks_exact_mut(w2).enumerate() {
                    let src = &xi[r * x.w..(r + 1) * x.w];
                    for (v, &(w0, w1, c0, c1)) in row.iter_mut().zip(&tw) {
                        *v = c0 * src[w0].to_f64() + c1 * src[w1].to_f64();
                    }
                }
                let mut t2 = vec![0f64; x.d * h2 * w2];
                for (d, plane) in t2.chunks_exact_mut(h2 * w2).enumerate() {
                    for (row, &(h0, h1, b0, b1)) in plane.chunks_exact_mut(w2).zip(&th) {
                        let (r0, r1) = (&t1[(d * x.h + h0) * w2..][..w2], &t1[(d * x.h + h1) * w2..][..w2]);
                        for ((v, &p), &q) in row.iter_mut().zip(r0).zip(r1) {
                            *v = b0 * p + b1 * q;
                        }
                    }
                }
                for (plane, &(d0, d1, a0, a1)) in o.chunks_exact_mut(h2 * w2).zip(&td) {
                    let (p0, p1) = (&t2[d0 * h2 * w2..][..h2 * w2], &t2[d1 * h2 * w2..][..h2 * w2]);
                    for ((v, &p), &q) in plane.iter_mut().zip(p0).zip(p1) {
                        *v = T::from_f64(a0 * p + a1 * q);
                    }
                }
            },
        )
    });
}

/// dinp (per `Accum`, shape `x`) from dout (N, C, 2D, 2H, 2W): the forward's passes transposed,
/// in reverse order (D, then H, then W).
pub fn upsample_backward<T: Float>(dinp: (&mut [T], Accum), dout: &[T], x: Dims) {
    let (dx, acc) = dinp;
    assert_eq!(dx.len(), x.numel(), "upsample: dinp length vs {x}");
    assert_eq!(dout.len(), x.up2().numel(), "upsample: dout length vs {}", x.up2());
    let (td, th, tw) = (axis_taps(x.d), axis_taps(x.h), axis_taps(x.w));
    let (s, so) = (x.s(), x.up2().s());
    let (w2, h2) = (2 * x.w, 2 * x.h);
    dx.par_chunks_mut(s).zip(dout.par_chunks(so)).for_each(|(d, g)| {
        vectorized(
            #[inline(always)]
            || {
                let mut s2 = vec![0f64; x.d * h2 * w2];
                for (plane, &(d0, d1, a0, a1)) in g.chunks_exact(h2 * w2).zip(&td) {
                    for (k, &v) in plane.iter().enumerate() {
                        s2[d0 * h2 * w2 + k] += a0 * v.to_f64();
                    }
                    for (k, &v) in plane.iter().enumerate() {
                        s2[d1 * h2 * w2 + k] += a1 * v.to_f64();
                    }
                }
                let mut s1 = vec![0f64; x.d * x.h * w2];
                for (dd, plane) in s2.chunks_exact(h2 * w2).enumerate() {
                    for (row, &(h0, h1, b0, b1)) in plane.chunks_exact(w2).zip(&th) {
                        for (k, &v) in row.iter().enumerate() {
                            s1[(dd * x.h + h0) * w2 + k] += b0 * v;
                        }
                        for (k, &v) in row.iter().enumerate() {
                            s1[(dd * x.h + h1) * w2 + k] += b1 * v;
                        }
                    }
                }
                for (dst, row) in d.chunks_exact_mut(x.w).zip(s1.chunks_exact(w2)) {
                    let mut sum = vec![0f64; x.w];
                    for (&v, &(w0, w1, c0, c1)) in row.iter().zip(&tw) {
                        sum[w0] += c0 * v;
                        sum[w1] += c1 * v;
                    }
                    for (dv, sv) in dst.iter_mut().zip(sum) {
                        put(dv, T::from_f64(sv), acc);
                    }
                }
            },
        )
    });
}
