//! Elementwise and channel plumbing: add_assign, scale, add_channel_bias, channel_sum,
//! concat/split along channels (kernels/elementwise.cu), and the per-channel partial sums over the
//! whole volume (kernels/reduce.cu) that channel_sum and the conv bias gradient share.
//! Semantics: `Backend` docs in crates/meddpm/src/backend.rs; CPU twin cpu/elementwise.rs.

use meddpm::{Accum, Dims};

use crate::buf::GpuBuf;
use crate::device::{Arg::*, Device};

/// NDHWC partial kernels give each of 256 threads 4 channels (or 1 when C is not a multiple of 4).
pub(crate) const MAX_CHANNELS_NDHWC: usize = 1024;

/// Channels per thread of the NDHWC partial kernels for C channels.
fn ndhwc_vec(c: usize) -> usize {
    if c.is_multiple_of(4) && c / 4 <= 256 {
        4
    } else {
        assert!(
            c <= 256,
            "NDHWC channel reductions support C <= {MAX_CHANNELS_NDHWC} (a multiple of 4) or C <= 256, got {c}"
        );
        1
    }
}

/// How the voxels of one (n, c) are cut into chunks for the stage-1 reductions:
/// (voxels per chunk, number of chunks).
pub(crate) fn chunking(x: Dims, cl: bool) -> (usize, usize) {
    let s = x.s();
    let len = if cl {
        // about 16K elements per block
        (16384 / x.c.max(1)).max(8)
    } else {
        4096
    };
    (len, s.div_ceil(len).max(1))
}

/// The three stage-1 per-channel reductions of kernels/reduce.cu.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Partial {
    /// (mean, M2) of x; leading args [x].
    Stats,
    /// (Σ g, Σ g·(x − μ)); leading args [dout, x, y or 0, mean].
    GnBwd,
    /// (Σ x, 0); leading args [x].
    Sum,
}

/// Launch the stage-1 per-channel reduction for activation `x` (shape `x`, `groups` groups);
/// `lead` are the kernel's leading pointer arguments (activations of the type `bf` says);
/// partials go to `part`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_partial(
    dev: &Device,
    kind: Partial,
    x: Dims,
    groups: usize,
    cl: bool,
    lead: &[u64],
    part: u64,
    bf: i32,
) {
    let (len, nchunks) = chunking(x, cl);
    let mut a = [P(0); 12];
    let mut k = 0;
    for &p in lead {
        a[k] = P(p);
        k += 1;
    }
    let mut push = |v| {
        a[k] = v;
        k += 1;
    };
    push(P(part));
    push(I(x.c as i32));
    push(L(x.s() as i64));
    if kind != Partial::Sum {
        push(I(groups as i32)); // chan_sum_* take no group count
    }
    push(I(len as i32));
    push(I(nchunks as i32));
    push(I(bf));
    let vec4 = cl && ndhwc_vec(x.c) == 4;
    let name = match (kind, cl, vec4) {
        (Partial::Stats, false, _) => "chan_stats_ncdhw",
        (Partial::Stats, true, false) => "chan_stats_ndhwc1",
        (Partial::Stats, true, true) => "chan_stats_ndhwc4",
        (Partial::GnBwd, false, _) => "chan_gnbwd_ncdhw",
        (Partial::GnBwd, true, false) => "chan_gnbwd_ndhwc1",
        (Partial::GnBwd, true, true) => "chan_gnbwd_ndhwc4",
        (Partial::Sum, false, _) => "chan_sum_ncdhw",
        (Partial::Sum, true, false) => "chan_sum_ndhwc1",
        (Partial::Sum, true, true) => "chan_sum_ndhwc4",
    };
    if cl {
        dev.launch(name, (nchunks as u32, x.n as u32, 1), (256, 1, 1), &a[..k]);
    } else {
        dev.launch(name, (nchunks as u32, (x.n * x.c) as u32, 1), (256, 1, 1), &a[..k]);
    }
}

/// Where per-channel sums go.
pub(crate) enum SumTo {
    /// out[n*C + c] = Σ over voxels (channel_sum).
    PerSample(u64),
    /// out[c] += Σ over n and voxels (bias gradients).
    AccumOverN(u64),
}

/// Per-channel sums of `src` (shape x) over the voxels, parallel over the whole volume.
pub(crate) fn channel_sums(dev: &Device, src: &GpuBuf, x: Dims, cl: bool, to: SumTo) {
    assert_eq!(src.len(), x.numel(), "channel sums over {x}: buffer length");
    let (_, nchunks) = chunking(x, cl);
    let part = dev.scratch(x.n * nchunks * x.c * 2);
    let pp = dev.ptr(&*part);
    launch_partial(dev, Partial::Sum, x, 1, cl, &[dev.ptr(src)], pp, src.bf());
    let (out, over_n, accum) = match to {
        SumTo::PerSample(p) => (p, 0, 0),
        SumTo::AccumOverN(p) => (p, 1, 1),
    };
    let nout = if over_n == 1 { x.c } else { x.n * x.c };
    dev.launch(
        "chan_sum_finalize",
        (nout as u32, 1, 1),
        (256, 1, 1),
        &[P(pp), P(out), I(x.n as i32), I(x.c as i32), I(nchunks as i32), I(over_n), I(accum)],
    );
}

/// The shared type flag of buffers a kernel requires to have one type.
pub(crate) fn same_bf(what: &str, bufs: &[&GpuBuf]) -> i32 {
    let bf = bufs[0].bf();
    assert!(
        bufs.iter().all(|b| b.bf() == bf),
        "{what}: buffers of different types {:?}",
        bufs.iter().map(|b| b.dtype()).collect::<Vec<_>>()
    );
    bf
}

pub(crate) fn add_assign(dev: &Device, dst: &mut GpuBuf, src: &GpuBuf) {
    assert_eq!(dst.len(), src.len(), "add_assign: lengths differ");
    let n = dst.len();
    let bf = same_bf("add_assign", &[dst, src]);
    dev.launch1("add_assign", n, &[P(dev.ptr_mut(dst)), P(dev.ptr(src)), L(n as i64), I(bf)]);
}

pub(crate) fn scale(dev: &Device, buf: &mut GpuBuf, s: f32) {
    let n = buf.len();
    let bf = buf.bf();
    dev.launch1("scale_buf", n, &[P(dev.ptr_mut(buf)), F(s), L(n as i64), I(bf)]);
}

/// x[n, c, ...] += bias[n, c] (per_n) or bias[c]; x of the type `bf` says, bias f32.
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_channel_bias(dev: &Device, x: u64, bias: u64, xd: Dims, cl: bool, per_n: bool, bf: i32) {
    dev.launch1(
        "add_channel_bias",
        xd.numel(),
        &[P(x), P(bias), I(xd.c as i32), L(xd.s() as i64), L(xd.numel() as i64), I(cl as i32), I(per_n as i32), I(bf)],
    );
}

pub(crate) fn concat(dev: &Device, out: &mut GpuBuf, a: &GpuBuf, b: &GpuBuf, x: Dims, ca: usize, cb: usize, cl: bool) {
    let od = x.with_c(ca + cb);
    assert!(
        out.len() == od.numel() && a.len() == x.with_c(ca).numel() && b.len() == x.with_c(cb).numel(),
        "concat_channels {x} ca {ca} cb {cb}: lengths out {} a {} b {}",
        out.len(),
        a.len(),
        b.len()
    );
    let bf = same_bf("concat_channels", &[out, a, b]);
    dev.launch1(
        "concat_channels",
        od.numel(),
        &[
            P(dev.ptr_mut(out)),
            P(dev.ptr(a)),
            P(dev.ptr(b)),
            I(ca as i32),
            I(cb as i32),
            L(x.s() as i64),
            L(od.numel() as i64),
            I(cl as i32),
            I(bf),
        ],
    );
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn split(
    dev: &Device,
    da: (&mut GpuBuf, Accum),
    db: (&mut GpuBuf, Accum),
    dout: &GpuBuf,
    x: Dims,
    ca: usize,
    cb: usize,
    cl: bool,
) {
    let od = x.with_c(ca + cb);
    assert!(
        dout.len() == od.numel() && da.0.len() == x.with_c(ca).numel() && db.0.len() == x.with_c(cb).numel(),
        "split_channels {x} ca {ca} cb {cb}: lengths"
    );
    let bf = same_bf("split_channels", &[da.0, db.0, dout]);
    dev.launch1(
        "split_channels",
        od.numel(),
        &[
            P(dev.ptr_mut(da.0)),
            P(dev.ptr_mut(db.0)),
            P(dev.ptr(dout)),
            I(ca as i32),
            I(cb as i32),
            L(x.s() as i64),
            L(od.numel() as i64),
            I(cl as i32),
            I((da.1 == Accum::Add) as i32),
            I((db.1 == Accum::Add) as i32),
            I(bf),
        ],
    );
}
