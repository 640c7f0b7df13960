//! Elementwise and channel plumbing: residual add, scaling, the per-(n, c) broadcast add of the
//! time embedding and its adjoint (a per-channel sum), and channel concat / split (the U-Net's
//! skip connections, `th.cat([h, hs.pop()], dim=1)`).
//!
//! All in NCDHW: channel c of batch element n is the contiguous block
//! [(n·C + c)·S, (n·C + c + 1)·S) with S = D·H·W.

use rayon::prelude::*;

use super::float::{put, Float};
use crate::backend::Accum;
use crate::shape::Dims;

const CHUNK: usize = 1 << 14;

/// dst += src.
pub fn add_assign<T: Float>(dst: &mut [T], src: &[T]) {
    assert_eq!(dst.len(), src.len(), "add_assign: dst vs src length");
    dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| {
        for (dv, &sv) in d.iter_mut().zip(s) {
            *dv += sv;
        }
    });
}

/// buf *= s.
pub fn scale<T: Float>(buf: &mut [T], s: T) {
    buf.par_chunks_mut(CHUNK).for_each(|b| b.iter_mut().for_each(|v| *v *= s));
}

/// x[n, c, :] += bias[n·C + c].
pub fn add_channel_bias<T: Float>(x: &mut [T], bias: &[T], xd: Dims) {
    assert_eq!(x.len(), xd.numel(), "add_channel_bias: x length vs {xd}");
    assert_eq!(bias.len(), xd.n * xd.c, "add_channel_bias: bias length vs N·C for {xd}");
    x.par_chunks_mut(xd.s()).zip(bias.par_iter()).for_each(|(xc, &b)| xc.iter_mut().for_each(|v| *v += b));
}

/// out[n, c, ...] = x[n, c, ...] + bias[c].
pub fn add_channel_bias_to<T: Float>(out: &mut [T], x: &[T], bias: &[T], xd: Dims) {
    assert!(out.len() == xd.numel() && x.len() == xd.numel(), "add_channel_bias_to: out/x length vs {xd}");
    assert_eq!(bias.len(), xd.c, "add_channel_bias_to: bias length vs C for {xd}");
    let s = xd.s().max(1);
    out.par_chunks_mut(s).zip(x.par_chunks(s)).enumerate().for_each(|(i, (oc, xc))| {
        let b = bias[i % xd.c];
        oc.iter_mut().zip(xc).for_each(|(o, &v)| *o = v + b);
    });
}

/// dbias[n·C + c] = Σ_s dx[n, c, s] (overwritten; f64 accumulation).
pub fn channel_sum<T: Float>(dbias: &mut [T], dx: &[T], xd: Dims) {
    assert_eq!(dx.len(), xd.numel(), "channel_sum: dx length vs {xd}");
    assert_eq!(dbias.len(), xd.n * xd.c, "channel_sum: dbias length vs N·C for {xd}");
    dbias.par_iter_mut().zip(dx.par_chunks(xd.s())).for_each(|(b, xc)| {
        *b = T::from_f64(xc.iter().map(|v| v.to_f64()).sum());
    });
}

/// out = cat([a, b], channel axis); a has `ca` channels, b `cb`; `x` gives N, D, H, W.
pub fn concat_channels<T: Float>(out: &mut [T], a: &[T], b: &[T], x: Dims, ca: usize, cb: usize) {
    concat_channels_bias(out, a, None, b, x, ca, cb);
}

/// out = cat([a + a_bias[c], b]) along channels (`Backend::concat_channels_bias`).
pub fn concat_channels_bias<T: Float>(
    out: &mut [T],
    a: &[T],
    a_bias: Option<&[f32]>,
    b: &[T],
    x: Dims,
    ca: usize,
    cb: usize,
) {
    let s = x.s();
    assert!(a.len() == x.n * ca * s && b.len() == x.n * cb * s, "concat: a/b length vs ca={ca}, cb={cb}, {x}");
    assert_eq!(out.len(), x.n * (ca + cb) * s, "concat: out length vs ca+cb={}, {x}", ca + cb);
    if let Some(bias) = a_bias {
        assert_eq!(bias.len(), ca, "concat: a_bias length vs ca={ca}");
    }
    out.par_chunks_mut((ca + cb) * s).enumerate().for_each(|(n, o)| {
        let an = &a[n * ca * s..(n + 1) * ca * s];
        match a_bias {
            None => o[..ca * s].copy_from_slice(an),
            Some(bias) => {
                for ((oc, ac), &bc) in o[..ca * s].chunks_mut(s).zip(an.chunks(s)).zip(bias) {
                    let bc = T::from_f64(bc as f64);
                    oc.iter_mut().zip(ac).for_each(|(o, &v)| *o = v + bc);
                }
            }
        }
        o[ca * s..].copy_from_slice(&b[n * cb * s..(n + 1) * cb * s]);
    });
}

/// Backward of concat: da and db (each per its `Accum`) from dout.
pub fn split_channels<T: Float>(
    da: (&mut [T], Accum),
    db: (&mut [T], Accum),
    dout: &[T],
    x: Dims,
    ca: usize,
    cb: usize,
) {
    let s = x.s();
    let ((da, acc_a), (db, acc_b)) = (da, db);
    assert!(da.len() == x.n * ca * s && db.len() == x.n * cb * s, "split: da/db length vs ca={ca}, cb={cb}, {x}");
    assert_eq!(dout.len(), x.n * (ca + cb) * s, "split: dout length vs ca+cb={}, {x}", ca + cb);
    let parts = dout.par_chunks((ca + cb) * s).zip(da.par_chunks_mut(ca * s).zip(db.par_chunks_mut(cb * s)));
    parts.for_each(|(g, (a, b))| {
        a.iter_mut().zip(&g[..ca * s]).for_each(|(d, &v)| put(d, v, acc_a));
        b.iter_mut().zip(&g[ca * s..]).for_each(|(d, &v)| put(d, v, acc_b));
    });
}
