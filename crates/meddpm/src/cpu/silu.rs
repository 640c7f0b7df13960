//! SiLU (x·σ(x), PyTorch `nn.SiLU`): forward and backward, elementwise over a whole buffer.
//!
//! Backward: d/dx [x·σ(x)] = σ(x)·(1 + x·(1 − σ(x))).
//! Each chunk runs under [`vectorized`] (σ's `exp` stays the library call). The elementwise
//! functions are public for the fused GroupNorm+SiLU kernels (`groupnorm.rs`).

use rayon::prelude::*;

use super::float::{put, vectorized, Float};
use crate::backend::Accum;

/// Elements per parallel task.
const CHUNK: usize = 1 << 14;

/// σ(x) = 1 / (1 + e⁻ˣ).
#[inline(always)]
pub fn sigmoid<T: Float>(x: T) -> T {
    T::one() / (T::one() + (-x).exp())
}

/// x·σ(x).
#[inline(always)]
pub fn silu<T: Float>(x: T) -> T {
    x * sigmoid(x)
}

/// g · d/dx silu(x).
#[inline(always)]
pub fn silu_grad<T: Float>(g: T, x: T) -> T {
    let sg = sigmoid(x);
    g * sg * (T::one() + x * (T::one() - sg))
}

/// out = x·σ(x).
pub fn silu_forward<T: Float>(out: &mut [T], inp: &[T]) {
    assert_eq!(out.len(), inp.len(), "silu: out vs inp length");
    out.par_chunks_mut(CHUNK).zip(inp.par_chunks(CHUNK)).for_each(|(o, x)| {
        vectorized(
            #[inline(always)]
            || o.iter_mut().zip(x).for_each(|(ov, &xv)| *ov = silu(xv)),
        )
    });
}

/// dinp (per `Accum`) = dout·σ(x)·(1 + x·(1 − σ(x))).
pub fn silu_backward<T: Float>(dinp: (&mut [T], Accum), dout: &[T], inp: &[T]) {
    let (dx, acc) = dinp;
    assert!(dx.len() == inp.len() && dout.len() == inp.len(), "silu: dinp/dout vs inp length");
    dx.par_chunks_mut(CHUNK).zip(dout.par_chunks(CHUNK).zip(inp.par_chunks(CHUNK))).for_each(|(d, (g, x))| {
        vectorized(
            #[inline(always)]
            || d.iter_mut().zip(g.iter().zip(x)).for_each(|(dv, (&gv, &xv))| put(dv, silu_grad(gv, xv), acc)),
        )
    });
}
