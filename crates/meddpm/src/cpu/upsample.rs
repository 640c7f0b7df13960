//! Trilinear ×2 upsampling in D, H and W with `align_corners=False` (PyTorch
//! `F.interpolate(mode="trilinear")`), forward and its exact adjoint.
//!
//! Along each axis of input length `n`, output index o reads source coordinate
//! src = max((o + ½)/2 − ½, 0), i0 = ⌊src⌋, i1 = min(i0 + 1, n − 1), λ = src − i0, with weights
//! (1 − λ, λ). The 3-D weight of a corner is the product of the three axis weights. Backward
//! scatters each output gradient to the same 8 corners with the same weights. Parallel over
//! (n, c) channels, which own disjoint input and output blocks.

use rayon::prelude::*;

use super::float::{put, Float};
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

/// out (N, C, 2D, 2H, 2W) from inp of shape `x`.
pub fn upsample_forward<T: Float>(out: &mut [T], inp: &[T], x: Dims) {
    assert_eq!(inp.len(), x.numel(), "upsample: input length vs {x}");
    assert_eq!(out.len(), x.up2().numel(), "upsample: output length vs {}", x.up2());
    let (td, th, tw) = (axis_taps(x.d), axis_taps(x.h), axis_taps(x.w));
    let (s, so) = (x.s(), x.up2().s());
    out.par_chunks_mut(so).zip(inp.par_chunks(s)).for_each(|(o, xi)| {
        let at = |d: usize, h: usize, w: usize| xi[(d * x.h + h) * x.w + w].to_f64();
        let mut j = 0;
        for &(d0, d1, a0, a1) in &td {
            for &(h0, h1, b0, b1) in &th {
                for &(w0, w1, c0, c1) in &tw {
                    let v = a0
                        * (b0 * (c0 * at(d0, h0, w0) + c1 * at(d0, h0, w1))
                            + b1 * (c0 * at(d0, h1, w0) + c1 * at(d0, h1, w1)))
                        + a1 * (b0 * (c0 * at(d1, h0, w0) + c1 * at(d1, h0, w1))
                            + b1 * (c0 * at(d1, h1, w0) + c1 * at(d1, h1, w1)));
                    o[j] = T::from_f64(v);
                    j += 1;
                }
            }
        }
    });
}

/// dinp (per `Accum`, shape `x`) from dout (N, C, 2D, 2H, 2W).
pub fn upsample_backward<T: Float>(dinp: (&mut [T], Accum), dout: &[T], x: Dims) {
    let (dx, acc) = dinp;
    assert_eq!(dx.len(), x.numel(), "upsample: dinp length vs {x}");
    assert_eq!(dout.len(), x.up2().numel(), "upsample: dout length vs {}", x.up2());
    let (td, th, tw) = (axis_taps(x.d), axis_taps(x.h), axis_taps(x.w));
    let (s, so) = (x.s(), x.up2().s());
    dx.par_chunks_mut(s).zip(dout.par_chunks(so)).for_each(|(d, g)| {
        let mut sum = vec![0f64; s];
        let mut j = 0;
        for &(d0, d1, a0, a1) in &td {
            for &(h0, h1, b0, b1) in &th {
                for &(w0, w1, c0, c1) in &tw {
                    let gv = g[j].to_f64();
                    j += 1;
                    for (id, wd) in [(d0, a0), (d1, a1)] {
                        for (ih, wh) in [(h0, b0), (h1, b1)] {
                            let base = (id * x.h + ih) * x.w;
                            sum[base + w0] += gv * wd * wh * c0;
                            sum[base + w1] += gv * wd * wh * c1;
                        }
                    }
                }
            }
        }
        for (dv, sv) in d.iter_mut().zip(sum) {
            put(dv, T::from_f64(sv), acc);
        }
    });
}
