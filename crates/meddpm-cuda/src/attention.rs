//! The attention core of Med-DDPM's AttentionBlock (QKVAttentionLegacy): per sample and head,
//! att = softmax_keys(scale²·qᵀk) with scale = c^(−1/4), out = v·attᵀ; and its backward.
//! Semantics: `Backend::attention_*`; CPU twin cpu/attention.rs. GEMMs are cuBLAS strided-batched
//! over heads (TF32 when the precision says so); softmax is fp32 (kernels/attention.cu).
//!
//! Each head's q, k, v, out are logical (c × T) matrices (channel rows, token columns). In NCDHW
//! they are row-major with row stride T; in NDHWC token t of channel j sits at t·ld + j, i.e. a
//! column-major (c × T) matrix with ld = 3C (qkv) or C (out). att is row-major (T × T) per head.
//!
//! The core is f32 in every precision (as PyTorch autocast's softmax): bf16 qkv, out, dout and
//! dqkv are converted to and from f32 temporaries around it (the attention levels are 16³ and 8³,
//! a few MB); att and datt are f32 buffers.

use meddpm::{DType, Dims};

use crate::buf::{require_f32, GpuBuf};
use crate::device::{Arg::*, Device};
use crate::linear::{gemm, Mat};

struct Views {
    q: Mat,
    k: Mat,
    v: Mat,
    o: Mat,
    att: Mat,
}

/// Matrix views of sample n's heads (batch over heads).
fn views(qkv: u64, out: u64, att: u64, x: Dims, heads: usize, n: usize, cl: bool) -> Views {
    let (cc, t) = (x.c, x.s());
    let c = cc / heads;
    let f = 4u64; // bytes per element
    let qkv_n = qkv + (n * 3 * cc * t) as u64 * f;
    let out_n = out + (n * cc * t) as u64 * f;
    let att_n = att + (n * heads * t * t) as u64 * f;
    let tt = (t * t) as i64;
    let mk = |base: u64, ch: usize, ld_cl: usize, head_ch: usize| -> Mat {
        if cl {
            Mat { ptr: base + ch as u64 * f, ld: ld_cl as i32, t: false, stride: head_ch as i64 }
        } else {
            Mat { ptr: base + (ch * t) as u64 * f, ld: t as i32, t: true, stride: (head_ch * t) as i64 }
        }
    };
    Views {
        q: mk(qkv_n, 0, 3 * cc, 3 * c),
        k: mk(qkv_n, c, 3 * cc, 3 * c),
        v: mk(qkv_n, 2 * c, 3 * cc, 3 * c),
        o: mk(out_n, 0, cc, c),
        att: Mat { ptr: att_n, ld: t as i32, t: true, stride: tt },
    }
}

fn check(x: Dims, heads: usize, out: usize, att: usize, qkv: usize) {
    assert!(
        heads > 0
            && x.c.is_multiple_of(heads)
            && out == x.numel()
            && qkv == 3 * x.numel()
            && att == x.n * heads * x.s() * x.s(),
        "attention {x} heads {heads}: lengths out {out} att {att} qkv {qkv}"
    );
}

/// Address of `b`'s data as f32: the buffer itself, or a temporary (slot) holding its conversion.
fn f32_in(dev: &Device, b: &GpuBuf, slot: u8) -> u64 {
    if b.dtype() == DType::F32 {
        return dev.ptr(b);
    }
    let t = dev.temp(b.len(), DType::F32, slot);
    dev.cast(t, DType::F32, dev.ptr(b), b.dtype(), b.len(), false);
    t
}

/// Where to write `b`'s f32 result: the buffer itself, or a temporary that [`f32_out_done`] converts.
fn f32_out(dev: &Device, b: &mut GpuBuf, slot: u8) -> u64 {
    if b.dtype() == DType::F32 {
        dev.ptr_mut(b)
    } else {
        dev.temp(b.len(), DType::F32, slot)
    }
}

fn f32_out_done(dev: &Device, b: &mut GpuBuf, tmp: u64) {
    if b.dtype() != DType::F32 {
        dev.cast(dev.ptr_mut(b), b.dtype(), tmp, DType::F32, b.len(), false);
    }
}

pub(crate) fn forward(dev: &Device, out: &mut GpuBuf, att: &mut GpuBuf, qkv: &GpuBuf, x: Dims, heads: usize, cl: bool) {
    check(x, heads, out.len(), att.len(), qkv.len());
    require_f32("attention probabilities", &[att]);
    let (c, t) = (x.c / heads, x.s());
    let scale2 = 1.0 / (c as f32).sqrt();
    let (op_, ap, qp) = (f32_out(dev, out, 1), dev.ptr_mut(att), f32_in(dev, qkv, 0));
    for n in 0..x.n {
        let m = views(qp, op_, ap, x, heads, n, cl);
        gemm(dev, t, t, c, scale2, m.q.tr(), m.k, 0.0, m.att, heads);
    }
    dev.launch("softmax_rows", ((x.n * heads * t) as u32, 1, 1), (256, 1, 1), &[P(ap), I(t as i32)]);
    for n in 0..x.n {
        let m = views(qp, op_, ap, x, heads, n, cl);
        gemm(dev, c, t, t, 1.0, m.v, m.att.tr(), 0.0, m.o, heads);
    }
    f32_out_done(dev, out, op_);
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    dev: &Device,
    dqkv: &mut GpuBuf,
    datt: &mut GpuBuf,
    dout: &GpuBuf,
    qkv: &GpuBuf,
    att: &GpuBuf,
    x: Dims,
    heads: usize,
    cl: bool,
) {
    check(x, heads, dout.len(), att.len(), qkv.len());
    assert!(dqkv.len() == qkv.len() && datt.len() == att.len(), "attention backward {x}: dqkv/datt lengths");
    let (c, t) = (x.c / heads, x.s());
    let scale2 = 1.0 / (c as f32).sqrt();
    require_f32("attention probabilities", &[att, datt]);
    let (dq, dap, ap) = (f32_out(dev, dqkv, 2), dev.ptr_mut(datt), dev.ptr(att));
    let (dop, qp) = (f32_in(dev, dout, 1), f32_in(dev, qkv, 0));
    for n in 0..x.n {
        let f = views(qp, dop, ap, x, heads, n, cl); // q, k, v, dout, att
        let g = views(dq, dop, dap, x, heads, n, cl); // dq, dk, dv, -, datt
        gemm(dev, c, t, t, 1.0, f.o, f.att, 0.0, g.v, heads); // dV = dOut·att
        gemm(dev, t, t, c, 1.0, f.o.tr(), f.v, 0.0, g.att, heads); // datt = dOutᵀ·V
    }
    dev.launch("softmax_bwd_rows", ((x.n * heads * t) as u32, 1, 1), (256, 1, 1), &[P(dap), P(ap), I(t as i32)]);
    for n in 0..x.n {
        let f = views(qp, dop, ap, x, heads, n, cl);
        let g = views(dq, dop, dap, x, heads, n, cl);
        gemm(dev, c, t, t, scale2, f.k, g.att.tr(), 0.0, g.q, heads); // dQ = s²·K·dSᵀ
        gemm(dev, c, t, t, scale2, f.q, g.att, 0.0, g.k, heads); // dK = s²·Q·dS
    }
    f32_out_done(dev, dqkv, dq);
}
