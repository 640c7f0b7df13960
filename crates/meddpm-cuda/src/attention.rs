//! The attention core of Med-DDPM's AttentionBlock (QKVAttentionLegacy): per sample and head,
//! att = softmax_keys(scale²·qᵀk) with scale = c^(−1/4), out = v·attᵀ; and its backward.
//! Semantics: `Backend::attention_*`; CPU twin cpu/attention.rs. GEMMs are cuBLAS strided-batched
//! over heads; the row softmax and its backward are ours (kernels/attention.cu).
//!
//! Each head's q, k, v, out are logical (c × T) matrices (channel rows, token columns). In NCDHW
//! they are row-major with row stride T; in NDHWC token t of channel j sits at t·ld + j, i.e. a
//! column-major (c × T) matrix with ld = 3C (qkv) or C (out). att is row-major (T × T) per head.
//!
//! The element type follows `att` (the U-Net allocates it with `alloc_act`):
//! - bf16 (`Precision::Bf16`): every operand is bf16 and the GEMMs are bf16 with f32 accumulation,
//!   as PyTorch autocast runs the reference's einsums: the logits and dP are stored in bf16, the
//!   softmax and its backward compute in f32 and store bf16 (the CPU's bf16 mode rounds at the
//!   same four places);
//! - f32: the GEMMs are f32 (TF32 when the precision says so); bf16 qkv, out, dout and dqkv (only
//!   in tests) are converted to and from f32 temporaries around the core.

use meddpm::{DType, Dims, Layout};

use crate::buf::GpuBuf;
use crate::device::{Arg::*, Device};
use crate::linear::{gemm_typed, Mat};

struct Views {
    q: Mat,
    k: Mat,
    v: Mat,
    o: Mat,
    att: Mat,
}

/// Matrix views of sample n's heads (batch over heads).
fn views(qkv: u64, out: u64, att: u64, x: Dims, heads: usize, n: usize, layout: Layout, dt: DType) -> Views {
    let cl = layout == Layout::Ndhwc;
    let (cc, t) = (x.c, x.s());
    let c = cc / heads;
    let f = dt.bytes() as u64; // bytes per element
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

/// Vectors of four a thread of `softmax_rows4` / `softmax_bwd_rows4` keeps (SM_R in attention.cu).
const SM_R: usize = 8;

/// Launch the row softmax (or, with `bwd = Some(att)`, its backward in place on `p`) over `rows`
/// rows of `t`: the register kernels where T % 4 == 0 and a row fits 512 threads' registers, else
/// the general ones (caching each row in shared memory when it fits).
fn softmax(dev: &Device, p: u64, bwd: Option<u64>, rows: usize, t: usize, dt: DType) {
    let bf = I((dt == DType::Bf16) as i32);
    let grid = (rows as u32, 1, 1);
    if t.is_multiple_of(4) && t / 4 <= SM_R * 512 {
        let threads = if t / 4 <= SM_R * 256 { 256 } else { 512 };
        return match bwd {
            None => dev.launch("softmax_rows4", grid, (threads, 1, 1), &[P(p), I(t as i32), bf]),
            Some(a) => dev.launch("softmax_bwd_rows4", grid, (threads, 1, 1), &[P(p), P(a), I(t as i32), bf]),
        };
    }
    let cache = t * 4 <= 48 * 1024;
    let smem = if cache { (t * 4) as u32 } else { 0 };
    let c = I(cache as i32);
    match bwd {
        None => dev.launch_shared("softmax_rows", grid, (256, 1, 1), smem, &[P(p), I(t as i32), bf, c]),
        Some(a) => dev.launch_shared("softmax_bwd_rows", grid, (256, 1, 1), smem, &[P(p), P(a), I(t as i32), bf, c]),
    }
}

/// The bf16 core's operands must all be bf16 (the U-Net's activation buffers under Bf16).
fn require_bf16(what: &str, bufs: &[&GpuBuf]) {
    let bad: Vec<DType> = bufs.iter().map(|b| b.dtype()).filter(|&d| d != DType::Bf16).collect();
    assert!(
        bad.is_empty(),
        "{what}: bf16 attention probabilities need bf16 qkv, out and gradients (found {bad:?}); allocate them with alloc_act"
    );
}

pub(crate) fn forward(
    dev: &Device,
    out: &mut GpuBuf,
    att: &mut GpuBuf,
    qkv: &GpuBuf,
    x: Dims,
    heads: usize,
    layout: Layout,
) {
    check(x, heads, out.len(), att.len(), qkv.len());
    let (c, t) = (x.c / heads, x.s());
    let scale2 = 1.0 / (c as f32).sqrt();
    let dt = att.dtype();
    let (op_, ap, qp) = if dt == DType::Bf16 {
        require_bf16("attention forward", &[out, qkv]);
        (dev.ptr_mut(out), dev.ptr_mut(att), dev.ptr(qkv))
    } else {
        (f32_out(dev, out, 1), dev.ptr_mut(att), f32_in(dev, qkv, 0))
    };
    for n in 0..x.n {
        let m = views(qp, op_, ap, x, heads, n, layout, dt);
        gemm_typed(dev, (t, t, c), scale2, m.q.tr(), m.k, 0.0, m.att, heads, dt);
    }
    softmax(dev, ap, None, x.n * heads * t, t, dt);
    for n in 0..x.n {
        let m = views(qp, op_, ap, x, heads, n, layout, dt);
        gemm_typed(dev, (c, t, t), 1.0, m.v, m.att.tr(), 0.0, m.o, heads, dt);
    }
    if dt != DType::Bf16 {
        f32_out_done(dev, out, op_);
    }
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
    layout: Layout,
) {
    check(x, heads, dout.len(), att.len(), qkv.len());
    assert!(dqkv.len() == qkv.len() && datt.len() == att.len(), "attention backward {x}: dqkv/datt lengths");
    let (c, t) = (x.c / heads, x.s());
    let scale2 = 1.0 / (c as f32).sqrt();
    let dt = att.dtype();
    assert!(datt.dtype() == dt, "attention backward {x}: datt is {:?}, att {dt:?}", datt.dtype());
    let (dq, dap, ap, dop, qp) = if dt == DType::Bf16 {
        require_bf16("attention backward", &[dqkv, dout, qkv]);
        (dev.ptr_mut(dqkv), dev.ptr_mut(datt), dev.ptr(att), dev.ptr(dout), dev.ptr(qkv))
    } else {
        (f32_out(dev, dqkv, 2), dev.ptr_mut(datt), dev.ptr(att), f32_in(dev, dout, 1), f32_in(dev, qkv, 0))
    };
    for n in 0..x.n {
        let f = views(qp, dop, ap, x, heads, n, layout, dt); // q, k, v, dout, att
        let g = views(dq, dop, dap, x, heads, n, layout, dt); // dq, dk, dv, -, datt
        gemm_typed(dev, (c, t, t), 1.0, f.o, f.att, 0.0, g.v, heads, dt); // dV = dOut·att
        gemm_typed(dev, (t, t, c), 1.0, f.o.tr(), f.v, 0.0, g.att, heads, dt); // datt = dOutᵀ·V
    }
    softmax(dev, dap, Some(ap), x.n * heads * t, t, dt);
    for n in 0..x.n {
        let f = views(qp, dop, ap, x, heads, n, layout, dt);
        let g = views(dq, dop, dap, x, heads, n, layout, dt);
        gemm_typed(dev, (c, t, t), scale2, f.k, g.att.tr(), 0.0, g.q, heads, dt); // dQ = s²·K·dSᵀ
        gemm_typed(dev, (c, t, t), scale2, f.q, g.att, 0.0, g.k, heads, dt); // dK = s²·Q·dS
    }
    if dt != DType::Bf16 {
        f32_out_done(dev, dqkv, dq);
    }
}
