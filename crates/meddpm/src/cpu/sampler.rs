//! One sampler update (`Backend::sampler_step`): the single primitive every sampler of
//! `diffusion::sampler` (ancestral DDPM, DDIM, DPM-Solver++(2M), iPNDM) runs once per step.
//!
//! Per sample n with coefficients c (see `backend::SamplerCoefs`):
//!   x̂₀ᵘ = c.recip·x − c.recipm1·ε̂;  x̂₀ = clamp(x̂₀ᵘ, −1, 1) when clipping;
//!   d = x̂₀ (data prediction) or ε̂ + (x̂₀ᵘ − x̂₀)/c.recipm1 (noise prediction);
//!   x ← c.cd·d + c.cx·x + Σₖ c.ch[k]·hist[k] + c.cz·z,  z[j] = c.noise.normal(c.offset + j);
//! then d is written into the last history buffer. Terms with a zero coefficient are skipped, so
//! with cd = coef1, cx = coef2, cz = sigma this is `ddpm_step` operation for operation.

use rayon::prelude::*;

use super::float::Float;
use crate::backend::{Prediction, SamplerCoefs};
use crate::shape::Dims;

const CHUNK: usize = 1 << 14;

/// One step in place on x (shape `xd`); `hist` holds at most 3 buffers of x's size.
pub fn sampler_step<T: Float>(
    x: &mut [T],
    eps: &[T],
    hist: &mut [Vec<T>],
    pred: Prediction,
    clip: bool,
    coefs: &[SamplerCoefs],
    xd: Dims,
) {
    let total = xd.numel();
    assert!(x.len() == total && eps.len() == total, "sampler_step: x {} / eps {} vs {xd}", x.len(), eps.len());
    assert!(hist.len() <= 3, "sampler_step: {} history buffers, at most 3", hist.len());
    assert!(hist.iter().all(|h| h.len() == total), "sampler_step: history length vs {xd}");
    assert_eq!(coefs.len(), xd.n, "sampler_step: coefficient count vs N = {}", xd.n);
    let per = xd.c * xd.s();
    let nh = hist.len();
    let (read, last) = match hist.split_last_mut() {
        Some((l, r)) => (&*r, Some(l)),
        None => (&[][..], None),
    };
    let mut last = last;
    for (n, c) in coefs.iter().enumerate() {
        let f = |v: f32| T::from_f64(v as f64);
        let (recip, recipm1, cx, cd, cz) = (f(c.recip), f(c.recipm1), f(c.cx), f(c.cd), f(c.cz));
        let ch: Vec<T> = c.ch.iter().map(|&v| f(v)).collect();
        let (lo, hi) = (-T::one(), T::one());
        let off = n * per;
        let e = &eps[off..off + per];
        let reads: Vec<&[T]> = read.iter().map(|h| &h[off..off + per]).collect();
        // Element `j` of this sample (j in logical NCDHW order: the CPU layout is NCDHW).
        let body = |j0: usize, xs: &mut [T], ls: Option<&mut [T]>| {
            let mut ls = ls;
            for (k, xv) in xs.iter_mut().enumerate() {
                let j = j0 + k;
                let x0u = recip * *xv - recipm1 * e[j];
                let x0 = if clip { x0u.max(lo).min(hi) } else { x0u };
                let d = match pred {
                    Prediction::Data => x0,
                    Prediction::Noise => e[j] + (x0u - x0) / recipm1,
                };
                // Σ in the documented order, zero-coefficient terms skipped.
                let mut acc: Option<T> = None;
                let mut add = |t: T| acc = Some(acc.map_or(t, |a| a + t));
                if c.cd != 0.0 {
                    add(cd * d);
                }
                if c.cx != 0.0 {
                    add(cx * *xv);
                }
                for (h, r) in reads.iter().enumerate() {
                    if c.ch[h] != 0.0 {
                        add(ch[h] * r[j]);
                    }
                }
                if let Some(ls) = ls.as_deref_mut() {
                    if c.ch[nh - 1] != 0.0 {
                        add(ch[nh - 1] * ls[k]);
                    }
                    ls[k] = d;
                }
                if c.cz != 0.0 {
                    add(cz * T::from_f64(c.noise.normal(c.offset + j as u64) as f64));
                }
                *xv = acc.unwrap_or(T::zero());
            }
        };
        let xs = &mut x[off..off + per];
        match last.as_deref_mut() {
            Some(l) => xs
                .par_chunks_mut(CHUNK)
                .zip(l[off..off + per].par_chunks_mut(CHUNK))
                .enumerate()
                .for_each(|(ci, (xc, lc))| body(ci * CHUNK, xc, Some(lc))),
            None => xs.par_chunks_mut(CHUNK).enumerate().for_each(|(ci, xc)| body(ci * CHUNK, xc, None)),
        }
    }
}
