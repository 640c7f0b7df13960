//! Trilinear ×2 upsampling, align_corners=False, forward and backward (kernels/upsample.cu).
//! Semantics: `Backend::upsample_*` (PyTorch F.interpolate); CPU twin cpu/upsample.rs. NDHWC runs
//! the kernels that are separable through shared memory where their rows fit (the forward: 2 × 2
//! output rows a block, four rows of f32 in 227 KB, a thread per channel vector of a voxel; the
//! backward: one input row a block, 48 KB), else per voxel.

use meddpm::{Accum, Dims, Layout};

use crate::buf::{GpuBuf, Mode};
use crate::device::{Arg::*, Device};
use crate::elementwise::{row_launch, row_vec, same_bf};

/// Threads of an `upsample_fwd_quad` / `upsample_bwd_rows` block.
const ROWS_BLOCK: u32 = 256;

/// Shared memory of an `upsample_bwd_rows` block holding `floats` f32 (one row of all channels), or
/// None where that exceeds the 48 KB a launch gets without opting in (the per-voxel kernels run).
fn rows_smem(floats: usize) -> Option<u32> {
    let bytes = floats * 4;
    (bytes <= 48 * 1024).then_some(bytes as u32)
}

/// Shared memory of an `upsample_fwd_quad` block with `v` channels a vector: four rows of W·C f32;
/// None past 227 KB or where a block has fewer threads than a voxel has vectors.
fn quad_smem(x: Dims, v: usize) -> Option<u32> {
    let bytes = 4 * x.w * x.c * 4;
    (bytes <= 227 * 1024 && x.c / v <= ROWS_BLOCK as usize).then_some(bytes as u32)
}

pub(crate) fn forward(dev: &Device, out: &mut GpuBuf, inp: &GpuBuf, x: Dims, layout: Layout) {
    let cl = layout == Layout::Ndhwc;
    assert!(
        inp.len() == x.numel() && out.len() == x.up2().numel(),
        "upsample {x}: lengths inp {} out {}",
        inp.len(),
        out.len()
    );
    let bf = same_bf("upsample_forward", &[out, inp]);
    forward_ptrs(dev, (dev.ptr_mut(out), dev.ptr(inp)), x, Mode::from_flags(cl, bf));
}

/// [`forward`] on device addresses (out of `x.up2()`'s, inp of `x`'s elements, both bf16 or both
/// f32 per `mode`): the Upsample conv's first-use timing runs it on its scratch.
pub(crate) fn forward_ptrs(dev: &Device, (op_, ip): (u64, u64), x: Dims, mode: Mode) {
    let total = x.up2().numel();
    let (cl, bf) = (mode.cl(), mode.bf_flag());
    if cl {
        let v = row_vec(x, Mode::from_flags(true, bf));
        if let Some(smem) = quad_smem(x, v) {
            // one block per 2 × 2 output rows (a source row's), separable through shared memory
            let dims = [x.c, x.d, x.h, x.w].map(|d| I(d as i32));
            let args = [P(op_), P(ip), dims[0], dims[1], dims[2], dims[3], I(bf), I(v as i32)];
            let grid = ((x.n * x.d * x.h) as u32, 1, 1);
            return dev.launch_shared("upsample_fwd_quad", grid, (ROWS_BLOCK, 1, 1), smem, &args);
        }
        // channels-last: each thread interpolates V channels of one voxel (16-byte accesses)
        let (grid, block) = row_launch(dev, x.up2(), v, Layout::Ndhwc);
        let args = [P(op_), P(ip), I(x.c as i32), I(x.d as i32), I(x.h as i32), I(x.w as i32), I(bf), I(v as i32)];
        return dev.launch("upsample_fwd_cl", grid, block, &args);
    }
    dev.launch1(
        "upsample_fwd",
        total,
        &[
            P(op_),
            P(ip),
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

pub(crate) fn backward(dev: &Device, dinp: (&mut GpuBuf, Accum), dout: &GpuBuf, x: Dims, layout: Layout) {
    let cl = layout == Layout::Ndhwc;
    assert!(dinp.0.len() == x.numel() && dout.len() == x.up2().numel(), "upsample backward {x}: lengths");
    let bf = same_bf("upsample_backward", &[dinp.0, dout]);
    if cl {
        let v = row_vec(x, Mode::from_flags(true, bf));
        let acc = (dinp.1 == Accum::Add) as i32;
        if let Some(smem) = rows_smem(2 * x.w * x.c) {
            // one block per input row, separable through shared memory
            let (dp, op_) = (dev.ptr_mut(dinp.0), dev.ptr(dout));
            let dims = [x.c, x.d, x.h, x.w].map(|d| I(d as i32));
            let args = [P(dp), P(op_), dims[0], dims[1], dims[2], dims[3], I(acc), I(bf), I(v as i32)];
            let grid = ((x.n * x.d * x.h) as u32, 1, 1);
            return dev.launch_shared("upsample_bwd_rows", grid, (ROWS_BLOCK, 1, 1), smem, &args);
        }
        let (grid, block) = row_launch(dev, x, v, Layout::Ndhwc);
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
