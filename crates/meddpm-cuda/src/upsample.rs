//! Trilinear ×2 upsampling, align_corners=False, forward and backward (kernels/upsample.cu).
//! Semantics: `Backend::upsample_*` (PyTorch F.interpolate); CPU twin cpu/upsample.rs.

use meddpm::{Accum, Dims};

use crate::buf::GpuBuf;
use crate::device::{Arg::*, Device};
use crate::elementwise::{row_launch, row_vec, same_bf};

pub(crate) fn forward(dev: &Device, out: &mut GpuBuf, inp: &GpuBuf, x: Dims, cl: bool) {
    assert!(
        inp.len() == x.numel() && out.len() == x.up2().numel(),
        "upsample {x}: lengths inp {} out {}",
        inp.len(),
        out.len()
    );
    let total = x.up2().numel();
    let bf = same_bf("upsample_forward", &[out, inp]);
    if cl {
        // channels-last: each thread interpolates V channels of one voxel (16-byte accesses)
        let v = row_vec(x, true, bf);
        let (grid, block) = row_launch(dev, x.up2(), v, true);
        let (op_, ip) = (dev.ptr_mut(out), dev.ptr(inp));
        let args = [P(op_), P(ip), I(x.c as i32), I(x.d as i32), I(x.h as i32), I(x.w as i32), I(bf), I(v as i32)];
        return dev.launch("upsample_fwd_cl", grid, block, &args);
    }
    dev.launch1(
        "upsample_fwd",
        total,
        &[
            P(dev.ptr_mut(out)),
            P(dev.ptr(inp)),
            I(x.c as i32),
            I(x.d as i32),
            I(x.h as i32),
            I(x.w as i32),
            L(total as i64),
            I(cl as i32),
            I(bf),
        ],
    );
}

pub(crate) fn backward(dev: &Device, dinp: (&mut GpuBuf, Accum), dout: &GpuBuf, x: Dims, cl: bool) {
    assert!(dinp.0.len() == x.numel() && dout.len() == x.up2().numel(), "upsample backward {x}: lengths");
    let bf = same_bf("upsample_backward", &[dinp.0, dout]);
    if cl {
        let v = row_vec(x, true, bf);
        let (grid, block) = row_launch(dev, x, v, true);
        let acc = (dinp.1 == Accum::Add) as i32;
        let (dp, op_) = (dev.ptr_mut(dinp.0), dev.ptr(dout));
        let args =
            [P(dp), P(op_), I(x.c as i32), I(x.d as i32), I(x.h as i32), I(x.w as i32), I(acc), I(bf), I(v as i32)];
        return dev.launch("upsample_bwd_cl", grid, block, &args);
    }
    dev.launch1(
        "upsample_bwd",
        x.numel(),
        &[
            P(dev.ptr_mut(dinp.0)),
            P(dev.ptr(dout)),
            I(x.c as i32),
            I(x.d as i32),
            I(x.h as i32),
            I(x.w as i32),
            L(x.numel() as i64),
            I(cl as i32),
            I((dinp.1 == Accum::Add) as i32),
            I(bf),
        ],
    );
}
