//! SiLU forward and backward (kernels/silu.cu). Semantics: `Backend::silu_*` (torch.nn.SiLU);
//! CPU twin cpu/silu.rs. Layout-free: elementwise over the whole buffer.

use cudarc::driver::CudaSlice;
use meddpm::Accum;

use crate::device::{Arg::*, Device};

pub(crate) fn forward(dev: &Device, out: &mut CudaSlice<f32>, inp: &CudaSlice<f32>) {
    assert_eq!(out.len(), inp.len(), "silu_forward: lengths differ");
    let n = inp.len();
    dev.launch1("silu_fwd", n, &[P(dev.ptr_mut(out)), P(dev.ptr(inp)), L(n as i64)]);
}

pub(crate) fn backward(dev: &Device, dinp: (&mut CudaSlice<f32>, Accum), dout: &CudaSlice<f32>, inp: &CudaSlice<f32>) {
    assert!(dinp.0.len() == inp.len() && dout.len() == inp.len(), "silu_backward: lengths differ");
    let n = inp.len();
    dev.launch1(
        "silu_bwd",
        n,
        &[P(dev.ptr_mut(dinp.0)), P(dev.ptr(dout)), P(dev.ptr(inp)), L(n as i64), I((dinp.1 == Accum::Add) as i32)],
    );
}
