//! SiLU (x·σ(x), PyTorch `nn.SiLU`): forward and backward, elementwise over a whole buffer.
//!
//! Backward: d/dx [x·σ(x)] = σ(x)·(1 + x·(1 − σ(x))).

use rayon::prelude::*;

use super::float::{put, Float};
use crate::backend::Accum;

/// Elements per parallel task.
const CHUNK: usize = 1 << 14;

fn sigmoid<T: Float>(x: T) -> T {
    T::one() / (T::one() + (-x).exp())
}

/// out = x·σ(x).
pub fn silu_forward<T: Float>(out: &mut [T], inp: &[T]) {
    assert_eq!(out.len(), inp.len(), "silu: out vs inp length");
    out.par_chunks_mut(CHUNK).zip(inp.par_chunks(CHUNK)).for_each(|(o, x)| {
        for (ov, &xv) in o.iter_mut().zip(x) {
            *ov = xv * sigmoid(xv);
        }
    });
}

/// dinp (per `Accum`) = dout·σ(x)·(1 + x·(1 − σ(x))).
pub fn silu_backward<T: Float>(dinp: (&mut [T], Accum), dout: &[T], inp: &[T]) {
    let (dx, acc) = dinp;
    assert!(dx.len() == inp.len() && dout.len() == inp.len(), "silu: dinp/dout vs inp length");
    dx.par_chunks_mut(CHUNK).zip(dout.par_chunks(CHUNK).zip(inp.par_chunks(CHUNK))).for_each(|(d, (g, x))| {
        for (dv, (&gv, &xv)) in d.iter_mut().zip(g.iter().zip(x)) {
            let sg = sigmoid(xv);
            put(dv, gv * sg * (T::one() + xv * (T::one() - sg)), acc);
        }
    });
}
