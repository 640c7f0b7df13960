//! SiLU forward and backward (kernels/silu.cu). Semantics: `Backend::silu_*` (torch.nn.SiLU);
//! CPU twin cpu/silu.rs. Layout-free: elementwise over the whole buffer.

use meddpm::Accum;

use crate::buf::GpuBuf;
use crate::device::{Arg::*, Device};
use crate::elementwise::same_bf;

pub(crate) fn forward(dev: &Device, out: &mut GpuBuf, inp: &GpuBuf) {
    assert_eq!(out.len(), inp.len(), "silu_forward: lengths differ");
    let n = inp.len();
    let bf = same_bf("silu_forward", &[out, inp]);
    dev.launch1("silu_fwd", n, &[P(dev.ptr_mut(out)), P(dev.ptr(inp)), L(n as i64), I(bf)]);
}

pub(crate) fn backward(dev: &Device, dinp: (&mut GpuBuf, Accum), dout: &GpuBuf, inp: &GpuBuf) {
    assert!(dinp.0.len() == inp.len() && dout.len() == inp.len(), "silu_backward: lengths differ");
    let n = inp.len();
    let bf = same_bf("silu_backward", &[dinp.0, dout, inp]);
    let acc = (dinp.1 == Accum::Add) as i32;
    dev.launch1(
        "silu_bwd",
        n,
        &[P(dev.ptr_mut(dinp.0)), P(dev.ptr(dout)), P(dev.ptr(inp)), L(n as i64), I(acc), I(bf)],
    );
}
