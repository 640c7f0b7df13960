//! Attention core of guided-diffusion's `QKVAttentionLegacy` (Med-DDPM's `AttentionBlock`):
//! forward and backward for qkv of logical shape (N, 3C, T), T = D·H·W tokens.
//!
//! Legacy head order: head h owns channels [h·3c, (h+1)·3c) of qkv, split as q | k | v blocks of
//! c = C/heads channels each; in NCDHW each block is a contiguous (c × T) matrix. With
//! s = c^(−1/4) applied to q and k (so the logits carry s² = 1/√c):
//!   att = softmax over keys of s²·qᵀk            (T × T per (n, h), row t = query)
//!   out[h·c + j, t] = Σ_s v[j, s]·att[t, s]       i.e. out_h = v·attᵀ
//! Backward (P = att, G = dout_h):
//!   dv = G·P,  dP = Gᵀ·v,  dZ = P ⊙ (dP − rowsum(P ⊙ dP)),  dq = s²·k·dZᵀ,  dk = s²·q·dZ.
//! Every product is one GEMM per (n, h); the softmax is parallel over query rows.
//! `round` is the rounding the bf16 GPU path applies where it stores att's element type (the
//! logits, P, dP and dZ): `|_| {}` in f32 and f64, bf16 rounding in the CPU's bf16 emulation.

use rayon::prelude::*;

use super::float::{gemm, Float, Mat, MatMut};
use crate::shape::Dims;

fn check(qkv: usize, att: usize, out: usize, x: &Dims, heads: usize) {
    assert!(heads > 0 && x.c.is_multiple_of(heads), "attention: {} channels not divisible into {heads} heads", x.c);
    assert_eq!(qkv, 3 * x.numel(), "attention: qkv length vs 3 × {x}");
    assert_eq!(out, x.numel(), "attention: out length vs {x}");
    assert_eq!(att, x.n * heads * x.s() * x.s(), "attention: att length vs N·heads·T² for {x}");
}

/// Softmax of each row of a (rows × t) matrix, in place.
fn softmax_rows<T: Float>(a: &mut [T], t: usize) {
    a.par_chunks_mut(t).for_each(|row| {
        let mx = row.iter().fold(row[0], |m, &v| m.max(v));
        let mut sum = T::zero();
        for v in row.iter_mut() {
            *v = (*v - mx).exp();
            sum += *v;
        }
        let inv = T::one() / sum;
        for v in row.iter_mut() {
            *v *= inv;
        }
    });
}

/// out (N, C, T) and att (N, heads, T, T) from qkv (N, 3C, T); `x` is out's shape. `round` is
/// applied to the logits and to P as they are stored (a no-op but in the bf16 emulation).
pub fn attention_forward<T: Float>(
    out: &mut [T],
    att: &mut [T],
    qkv: &[T],
    x: Dims,
    heads: usize,
    round: impl Fn(&mut [T]),
) {
    check(qkv.len(), att.len(), out.len(), &x, heads);
    let (c, t) = (x.c / heads, x.s());
    let s2 = T::from_f64(1.0 / (c as f64).sqrt());
    let blocks = qkv.chunks(3 * c * t).zip(out.chunks_mut(c * t)).zip(att.chunks_mut(t * t));
    for ((hq, ho), ha) in blocks {
        let (q, kv) = hq.split_at(c * t);
        let (k, v) = kv.split_at(c * t);
        // logits (T × T) = s²·qᵀk
        gemm(MatMut::dense(&mut *ha, t, t), false, s2, Mat::dense(q, c, t).t(), Mat::dense(k, c, t));
        round(&mut *ha);
        softmax_rows(ha, t);
        round(&mut *ha);
        // out_h (c × T) = v·attᵀ
        gemm(MatMut::dense(ho, c, t), false, T::one(), Mat::dense(v, c, t), Mat::dense(ha, t, t).t());
    }
}

/// dqkv (overwritten) from dout (N, C, T); `datt` is scratch of att's size. `round` is applied to
/// dP and to dZ as they are stored (a no-op but in the bf16 emulation).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Float>(
    dqkv: &mut [T],
    datt: &mut [T],
    dout: &[T],
    qkv: &[T],
    att: &[T],
    x: Dims,
    heads: usize,
    round: impl Fn(&mut [T]),
) {
    check(qkv.len(), att.len(), dout.len(), &x, heads);
    assert!(dqkv.len() == qkv.len() && datt.len() == att.len(), "attention: dqkv/datt length vs qkv/att");
    let (c, t) = (x.c / heads, x.s());
    let s2 = T::from_f64(1.0 / (c as f64).sqrt());
    let blocks = qkv.chunks(3 * c * t).zip(dqkv.chunks_mut(3 * c * t)).zip(dout.chunks(c * t));
    for (((hq, hdq), g), (p, dp)) in blocks.zip(att.chunks(t * t).zip(datt.chunks_mut(t * t))) {
        let (q, kv) = hq.split_at(c * t);
        let (k, v) = kv.split_at(c * t);
        let (dq, dkv) = hdq.split_at_mut(c * t);
        let (dk, dv) = dkv.split_at_mut(c * t);
        let (gm, pm) = (Mat::dense(g, c, t), Mat::dense(p, t, t));
        // dv = G·P
        gemm(MatMut::dense(dv, c, t), false, T::one(), gm, pm);
        // dP = Gᵀ·v, then dZ = P ⊙ (dP − rowsum(P ⊙ dP)) in place
        gemm(MatMut::dense(&mut *dp, t, t), false, T::one(), gm.t(), Mat::dense(v, c, t));
        round(&mut *dp);
        dp.par_chunks_mut(t).zip(p.par_chunks(t)).for_each(|(dr, pr)| {
            let dot: T = dr.iter().zip(pr).map(|(&a, &b)| a * b).sum();
            for (d, &pv) in dr.iter_mut().zip(pr) {
                *d = pv * (*d - dot);
            }
        });
        round(&mut *dp);
        let dz = Mat::dense(&*dp, t, t);
        // dq = s²·k·dZᵀ, dk = s²·q·dZ
        gemm(MatMut::dense(dq, c, t), false, s2, Mat::dense(k, c, t), dz.t());
        gemm(MatMut::dense(dk, c, t), false, s2, Mat::dense(q, c, t), dz);
    }
}
