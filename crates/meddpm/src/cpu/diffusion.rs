//! Diffusion primitives: Philox normals, the forward-process sample `q_sample`, and one ancestral
//! DDPM update (guided-diffusion `q_sample` / `p_sample` with clipped x̂₀).
//!
//! randn: element i of the buffer in logical NCDHW order gets `rng.normal(offset + i)`, so the CPU
//! and CUDA backends draw identical noise (see `rng.rs`).
//! ddpm_step, per batch element with coefficients c:
//!   x̂₀ = clamp(c.recip·x − c.recipm1·ε̂, −1, 1);  x ← c.coef1·x̂₀ + c.coef2·x + c.sigma·z.

use rayon::prelude::*;

use super::float::Float;
use crate::backend::DdpmCoefs;
use crate::rng::Philox;
use crate::shape::Dims;

const CHUNK: usize = 1 << 14;

/// out[i] = rng.normal(offset + i) for i in logical NCDHW order of shape `x`.
pub fn randn<T: Float>(out: &mut [T], rng: Philox, offset: u64, x: Dims) {
    assert_eq!(out.len(), x.numel(), "randn: buffer length vs {x}");
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(ci, o)| {
        let base = offset + (ci * CHUNK) as u64;
        for (i, v) in o.iter_mut().enumerate() {
            *v = T::from_f64(rng.normal(base + i as u64) as f64);
        }
    });
}

/// x_t[n] = a[n]·x0[n] + b[n]·eps[n].
pub fn q_sample<T: Float>(xt: &mut [T], x0: &[T], eps: &[T], a: &[T], b: &[T], x: Dims) {
    assert!(xt.len() == x.numel() && x0.len() == x.numel() && eps.len() == x.numel(), "q_sample: lengths vs {x}");
    assert!(a.len() == x.n && b.len() == x.n, "q_sample: coefficient count vs N = {}", x.n);
    let per = x.c * x.s();
    xt.par_chunks_mut(per).zip(x0.par_chunks(per).zip(eps.par_chunks(per))).enumerate().for_each(
        |(n, (o, (x0, e)))| {
            for (ov, (&xv, &ev)) in o.iter_mut().zip(x0.iter().zip(e)) {
                *ov = a[n] * xv + b[n] * ev;
            }
        },
    );
}

/// One ancestral step in place on x (shape `xd`), per-sample coefficients.
pub fn ddpm_step<T: Float>(x: &mut [T], eps: &[T], z: &[T], coefs: &[DdpmCoefs], xd: Dims) {
    assert!(x.len() == xd.numel() && eps.len() == xd.numel() && z.len() == xd.numel(), "ddpm_step: lengths vs {xd}");
    assert_eq!(coefs.len(), xd.n, "ddpm_step: coefficient count vs N = {}", xd.n);
    let per = xd.c * xd.s();
    x.par_chunks_mut(per).zip(eps.par_chunks(per).zip(z.par_chunks(per))).enumerate().for_each(|(n, (xs, (e, zs)))| {
        let c = coefs[n];
        let f = |v: f32| T::from_f64(v as f64);
        let (recip, recipm1, c1, c2, sg) = (f(c.recip), f(c.recipm1), f(c.coef1), f(c.coef2), f(c.sigma));
        let (lo, hi) = (-T::one(), T::one());
        for (xv, (&ev, &zv)) in xs.iter_mut().zip(e.iter().zip(zs)) {
            let x0 = (recip * *xv - recipm1 * ev).max(lo).min(hi);
            *xv = c1 * x0 + c2 * *xv + sg * zv;
        }
    });
}
