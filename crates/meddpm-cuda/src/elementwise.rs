//! Elementwise and channel plumbing: add_assign, scale, add_channel_bias, channel_sum,
//! concat/split along channels (kernels/elementwise.cu), and the per-channel partial sums over the
//! whole volume (kernels/reduce.cu) that channel_sum and the conv bias gradient share.
//! Semantics: `Backend` docs in crates/meddpm/src/backend.rs; CPU twin cpu/elementwise.rs.

use meddpm::{Accum, Dims, Layout};

use crate::buf::{require_f32, GpuBuf, Mode};
use crate::device::{Arg::*, Device};

/// NDHWC partial kernels give each of 256 threads 4 (f32) or 8 (bf16) channels, or 1 when C is not
/// a multiple of that.
pub(crate) const MAX_CHANNELS_NDHWC: usize = 1024;

/// Channels per thread of the NDHWC partial kernels for C channels of the given type.
pub(crate) fn ndhwc_vec(c: usize, bf: i32) -> usize {
    if bf == 1 && c.is_multiple_of(8) && c / 8 <= 256 {
        8
    } else if c.is_multiple_of(4) && c / 4 <= 256 {
        4
    } else {
        assert!(
            c <= 256,
            "NDHWC channel reductions support C <= {MAX_CHANNELS_NDHWC} (a multiple of 4) or C <= 256, got {c}"
        );
        1
    }
}

/// Elements per access of the vectorised kernels: 16 bytes (4 f32, 8 bf16) when `fits(v)`, else
/// 4 bf16 (8 bytes), else 1.
pub(crate) fn vec_width(bf: i32, fits: impl Fn(usize) -> bool) -> usize {
    let full = if bf == 1 { 8 } else { 4 };
    if fits(full) {
        full
    } else if bf == 1 && fits(4) {
        4
    } else {
        1
    }
}

/// Vector width of a channel-constant traversal (kernels/common.cu `Row`) of an activation:
/// NDHWC needs C % V == 0 (at most 1024 lanes), NCDHW S % V == 0.
pub(crate) fn row_vec(x: Dims, mode: Mode) -> usize {
    let cl = mode.cl();
    vec_width(mode.bf_flag(), |v| if cl { x.c.is_multiple_of(v) && x.c / v <= 1024 } else { x.s().is_multiple_of(v) })
}

/// Grid and block of a channel-constant traversal (kernels/common.cu `Row`) of an activation with
/// V elements per access: NDHWC grid (gx, N) with a block that is a multiple of lanes = C / V;
/// NCDHW grid (gx, N·C) of 256-thread blocks. gx fills the GPU about 8 blocks per SM deep.
pub(crate) fn row_launch(dev: &Device, x: Dims, v: usize, layout: Layout) -> ((u32, u32, u32), (u32, u32, u32)) {
    let cl = layout == Layout::Ndhwc;
    let target = dev.info.sms as usize * 8;
    if cl {
        let lanes = x.c / v;
        assert!(lanes * v == x.c && lanes <= 1024, "row launch: {} channels, {v} per access", x.c);
        let bs = if lanes <= 256 { (256 / lanes) * lanes } else { lanes };
        let nvec = x.s() * lanes;
        let gx = nvec.div_ceil(bs).min(target.div_ceil(x.n)).max(1);
        ((gx as u32, x.n as u32, 1), (bs as u32, 1, 1))
    } else {
        assert!(x.s().is_multiple_of(v), "row launch: {} voxels, {v} per access", x.s());
        let nvec = x.s() / v;
        let gx = nvec.div_ceil(256).min(target.div_ceil(x.n * x.c)).max(1);
        ((gx as u32, (x.n * x.c) as u32, 1), (256, 1, 1))
    }
}

/// How the voxels of one (n, c) are cut into chunks for the stage-1 reductions:
/// (voxels per chunk, number of chunks).
pub(crate) fn chunking(x: Dims, layout: Layout) -> (usize, usize) {
    let cl = layout == Layout::Ndhwc;
    // At most ~1024 chunks per sample (NDHWC; 256 per channel in NCDHW): one or two waves of
    // blocks on a large GPU with long enough loops, and few partials, so the one-block-per-group
    // finalisers stay short (with 16K-element chunks a 128³ × 128-channel finaliser combined 16K
    // partials per channel: 190 µs, as long as the statistics pass itself).
    let s = x.s();
    let len = if cl { s.div_ceil(1024).max((4096 / x.c.max(1)).max(8)) } else { s.div_ceil(256).max(4096) };
    (len, s.div_ceil(len).max(1))
}

/// The three stage-1 per-channel reductions of kernels/reduce.cu.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Partial {
    /// (mean, M2) of x; leading args [x].
    Stats,
    /// (Σ g, Σ g·(x − μ)); leading args [dout, x, mean, rstd, gamma, beta or 0 (beta: SiLU)].
    GnBwd,
    /// (Σ g, Σ g·(x − μ), Σ (x − μ)), NDHWC only; leading args as `GnBwd`.
    GnBwd3,
    /// `GnBwd` with x the concatenation cat([xh + xbias, xs]) at channel `ca`, read from its
    /// parts (NDHWC, 4 or 8 channels a thread, both parts a multiple of that); leading args
    /// [dout, xh, xs, xbias or 0, mean, rstd, gamma, beta or 0, off or 0].
    GnBwdCat(usize),
    /// (Σ x, 0); leading args [x].
    Sum,
}

/// Launch the stage-1 per-channel reduction for activation `x` (shape `x`, `groups` groups);
/// `lead` are the kernel's leading pointer arguments (activations of the type `bf` says);
/// partials go to `part`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_partial(dev: &Device, kind: Partial, x: Dims, groups: usize, mode: Mode, lead: &[u64], part: u64) {
    let (cl, bf) = (mode.cl(), mode.bf_flag());
    let (len, nchunks) = chunking(x, mode.layout);
    let mut a = [P(0); 20];
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
    if matches!(kind, Partial::GnBwd | Partial::GnBwd3 | Partial::GnBwdCat(_)) {
        push(I(groups as i32)); // only the GroupNorm backward needs the groups
    }
    push(I(len as i32));
    push(I(nchunks as i32));
    push(I(bf));
    if let Partial::GnBwdCat(ca) = kind {
        push(I(ca as i32));
    }
    let v = if cl { ndhwc_vec(x.c, bf) } else { 0 };
    let name = match (kind, v) {
        (Partial::Stats, 0) => "chan_stats_ncdhw",
        (Partial::Stats, 1) => "chan_stats_ndhwc1",
        (Partial::Stats, 4) => "chan_stats_ndhwc4",
        (Partial::Stats, _) => "chan_stats_ndhwc8",
        (Partial::GnBwd, 0) => "chan_gnbwd_ncdhw",
        (Partial::GnBwd, 1) => "chan_gnbwd_ndhwc1",
        (Partial::GnBwd, 4) => "chan_gnbwd_ndhwc4",
        (Partial::GnBwd, _) => "chan_gnbwd_ndhwc8",
        (Partial::GnBwd3, 0) => panic!("chan_gnbwd3 is NDHWC only (groupnorm::can_sum)"),
        (Partial::GnBwd3, 1) => "chan_gnbwd3_ndhwc1",
        (Partial::GnBwd3, 4) => "chan_gnbwd3_ndhwc4",
        (Partial::GnBwd3, _) => "chan_gnbwd3_ndhwc8",
        (Partial::GnBwdCat(_), 4) => "chan_gnbwd_cat_ndhwc4",
        (Partial::GnBwdCat(_), 8) => "chan_gnbwd_cat_ndhwc8",
        (Partial::GnBwdCat(_), _) => panic!("chan_gnbwd_cat takes 4 or 8 channels a thread (groupnorm::parts_ok)"),
        (Partial::Sum, 0) => "chan_sum_ncdhw",
        (Partial::Sum, 1) => "chan_sum_ndhwc1",
        (Partial::Sum, 4) => "chan_sum_ndhwc4",
        (Partial::Sum, _) => "chan_sum_ndhwc8",
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
pub(crate) fn channel_sums(dev: &Device, src: &GpuBuf, x: Dims, layout: Layout, to: SumTo) {
    let cl = layout == Layout::Ndhwc;
    assert_eq!(src.len(), x.numel(), "channel sums over {x}: buffer length");
    let (_, nchunks) = chunking(x, layout);
    let part = dev.scratch(x.n * nchunks * x.c * 2);
    let pp = dev.ptr(&*part);
    launch_partial(dev, Partial::Sum, x, 1, Mode::from_flags(cl, src.bf()), &[dev.ptr(src)], pp);
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
    let v = vec_width(bf, |v| n.is_multiple_of(v));
    dev.launch1("add_assign", n / v, &[P(dev.ptr_mut(dst)), P(dev.ptr(src)), L(n as i64), I(bf), I(v as i32)]);
}

pub(crate) fn scale(dev: &Device, buf: &mut GpuBuf, s: f32) {
    let n = buf.len();
    let bf = buf.bf();
    dev.launch1("scale_buf", n, &[P(dev.ptr_mut(buf)), F(s), L(n as i64), I(bf)]);
}

/// x[n, c, ...] += bias[n, c] (per_n) or bias[c]; x in `mode`, bias f32.
pub(crate) fn add_channel_bias(dev: &Device, x: u64, bias: u64, xd: Dims, mode: Mode, per_n: bool) {
    add_channel_bias_to(dev, x, x, bias, xd, mode, per_n);
}

/// y[n, c, ...] = x[n, c, ...] + bias[n, c] (per_n) or bias[c]; y may be x; x and y in `mode`,
/// bias f32.
pub(crate) fn add_channel_bias_to(dev: &Device, y: u64, x: u64, bias: u64, xd: Dims, mode: Mode, per_n: bool) {
    if xd.numel() == 0 {
        return;
    }
    let (cl, bf) = (mode.cl(), mode.bf_flag());
    let v = row_vec(xd, mode);
    let (grid, block) = row_launch(dev, xd, v, mode.layout);
    let args =
        [P(y), P(x), P(bias), I(xd.c as i32), L(xd.s() as i64), I(cl as i32), I(per_n as i32), I(bf), I(v as i32)];
    dev.launch("add_channel_bias", grid, block, &args);
}

/// Vector width for concat/split: NDHWC needs both parts' channel counts divisible.
fn cat_vec(x: Dims, ca: usize, cb: usize, mode: Mode) -> usize {
    vec_width(mode.bf_flag(), |v| {
        if mode.cl() {
            ca.is_multiple_of(v) && cb.is_multiple_of(v) && (ca + cb) / v <= 1024
        } else {
            x.s().is_multiple_of(v)
        }
    })
}

/// The operands of a concatenation out = cat([a (+ a_bias), b]) checked (`what` names it):
/// lengths, the bias f32 [ca], one activation type (returned as the kernels' `bf` flag).
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_concat(
    what: &str,
    out: &GpuBuf,
    a: &GpuBuf,
    a_bias: Option<&GpuBuf>,
    b: &GpuBuf,
    x: Dims,
    ca: usize,
    cb: usize,
) -> i32 {
    if let Some(bias) = a_bias {
        assert_eq!(bias.len(), ca, "{what}: a_bias length vs ca {ca}");
        require_f32(&format!("{what}: a_bias"), &[bias]);
    }
    assert!(
        out.len() == x.with_c(ca + cb).numel() && a.len() == x.with_c(ca).numel() && b.len() == x.with_c(cb).numel(),
        "{what} {x} ca {ca} cb {cb}: lengths out {} a {} b {}",
        out.len(),
        a.len(),
        b.len()
    );
    same_bf(what, &[out, a, b])
}

/// out = cat([a (+ a_bias[c], f32, where given), b]) along channels.
#[allow(clippy::too_many_arguments)]
pub(crate) fn concat(
    dev: &Device,
    out: &mut GpuBuf,
    a: &GpuBuf,
    a_bias: Option<&GpuBuf>,
    b: &GpuBuf,
    x: Dims,
    ca: usize,
    cb: usize,
    layout: Layout,
) {
    let cl = layout == Layout::Ndhwc;
    let od = x.with_c(ca + cb);
    let bf = check_concat("concat_channels", out, a, a_bias, b, x, ca, cb);
    let v = cat_vec(x, ca, cb, Mode::from_flags(cl, bf));
    let (grid, block) = row_launch(dev, od, v, layout);
    let args = [
        P(dev.ptr_mut(out)),
        P(dev.ptr(a)),
        P(dev.ptr(b)),
        P(a_bias.map_or(0, |v| dev.ptr(v))),
        I(ca as i32),
        I(cb as i32),
        L(x.s() as i64),
        I(cl as i32),
        I(bf),
        I(v as i32),
    ];
    dev.launch("concat_channels", grid, block, &args);
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
    layout: Layout,
) {
    let cl = layout == Layout::Ndhwc;
    let od = x.with_c(ca + cb);
    assert!(
        dout.len() == od.numel() && da.0.len() == x.with_c(ca).numel() && db.0.len() == x.with_c(cb).numel(),
        "split_channels {x} ca {ca} cb {cb}: lengths"
    );
    let bf = same_bf("split_channels", &[da.0, db.0, dout]);
    let v = cat_vec(x, ca, cb, Mode::from_flags(cl, bf));
    let (grid, block) = row_launch(dev, od, v, layout);
    let args = [
        P(dev.ptr_mut(da.0)),
        P(dev.ptr_mut(db.0)),
        P(dev.ptr(dout)),
        I(ca as i32),
        I(cb as i32),
        L(x.s() as i64),
        I(cl as i32),
        I((da.1 == Accum::Add) as i32),
        I((db.1 == Accum::Add) as i32),
        I(bf),
        I(v as i32),
    ];
    dev.launch("split_channels", grid, block, &args);
}
