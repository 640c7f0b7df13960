//! Optimiser primitives: one Adam step (PyTorch `torch.optim.Adam`, no weight decay, no amsgrad)
//! and the EMA update of the sampling weights.
//!
//! Adam, step t (1-based), bias corrections bc1 = 1 − β₁ᵗ and bc2 = 1 − β₂ᵗ computed in f64 as
//! PyTorch does on the host:
//!   m ← β₁m + (1 − β₁)g;  v ← β₂v + (1 − β₂)g²;  p ← p − (lr/bc1)·m / (√v/√bc2 + eps).
//! EMA: ema ← decay·ema + (1 − decay)·p.

use rayon::prelude::*;

use super::float::Float;
use crate::backend::AdamStep;

const CHUNK: usize = 1 << 14;

/// One Adam update of p with gradient g and moments m, v.
pub fn adam_step<T: Float>(p: &mut [T], g: &[T], m: &mut [T], v: &mut [T], h: AdamStep) {
    assert!(g.len() == p.len() && m.len() == p.len() && v.len() == p.len(), "adam: p/g/m/v lengths differ");
    assert!(h.t >= 1, "adam: step count t is 1-based, got 0");
    let (b1, b2) = (h.beta1 as f64, h.beta2 as f64);
    let bc1 = 1.0 - b1.powf(h.t as f64);
    let bc2_sqrt = (1.0 - b2.powf(h.t as f64)).sqrt();
    let step = T::from_f64(h.lr as f64 / bc1);
    let bc2_sqrt = T::from_f64(bc2_sqrt);
    let (b1, b2, eps) = (T::from_f64(b1), T::from_f64(b2), T::from_f64(h.eps as f64));
    let (one_b1, one_b2) = (T::one() - b1, T::one() - b2);
    let moments = m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK));
    p.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).zip(moments).for_each(|((p, g), (m, v))| {
        for i in 0..p.len() {
            m[i] = b1 * m[i] + one_b1 * g[i];
            v[i] = b2 * v[i] + one_b2 * g[i] * g[i];
            let denom = v[i].sqrt() / bc2_sqrt + eps;
            p[i] -= step * m[i] / denom;
        }
    });
}

/// ema ← decay·ema + (1 − decay)·p.
pub fn ema_update<T: Float>(ema: &mut [T], p: &[T], decay: T) {
    assert_eq!(ema.len(), p.len(), "ema: ema vs p length");
    let one_d = T::one() - decay;
    ema.par_chunks_mut(CHUNK).zip(p.par_chunks(CHUNK)).for_each(|(e, p)| {
        for (ev, &pv) in e.iter_mut().zip(p) {
            *ev = decay * *ev + one_d * pv;
        }
    });
}
