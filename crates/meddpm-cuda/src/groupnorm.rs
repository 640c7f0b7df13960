//! GroupNorm (eps 1e-5, affine) forward and backward, plain or fused with SiLU, for both layouts.
//! Semantics: `Backend::groupnorm_*` (torch.nn.GroupNorm, biased variance); CPU twin cpu/groupnorm.rs.
//!
//! PyTorch spends 41 % of a Med-DDPM sampling forward in a statistics kernel that launches one
//! block per (n, group) — 32 blocks on a 132-SM GPU. Here every pass is parallel over the whole
//! volume: stage 1 (kernels/reduce.cu) reduces chunks of voxels per channel with thousands of
//! blocks, stage 2 (one small block per group) combines the chunk partials in double, stage 3 is
//! elementwise (kernels/common.cu's channel-constant traversal, 16-byte accesses). Two passes over
//! the data forward (read x; read x, write out or, fused with SiLU, only act) and two backward
//! (read dout, x; again, write dx). The fused GroupNorm+SiLU never stores the GroupNorm output:
//! the backward recomputes it from x and the saved statistics where SiLU's derivative needs it.
//! An optional per-(n, c) f32 input offset (`off`) makes the GroupNorm's input x + off without
//! a pass that adds it (kernels/groupnorm.cu). `backward` can also give the channel sums of dx
//! from the backward's own stage-1 sums (the ResBlock's time-embedding bias gradient, no pass).

use meddpm::{Accum, DType, Dims, Layout};

use crate::buf::{require_f32, GpuBuf, Mode};
use crate::device::{Arg::*, Device};
use crate::elementwise::{check_concat, chunking, launch_partial, ndhwc_vec, row_launch, row_vec, same_bf, Partial};

pub(crate) const EPS: f32 = 1e-5;

/// Forward: `out` = GN(inp + off) and/or `act` = silu(GN(inp + off)); mean/rstd [N·G] saved.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    dev: &Device,
    out: Option<&mut GpuBuf>,
    act: Option<&mut GpuBuf>,
    mean: &mut GpuBuf,
    rstd: &mut GpuBuf,
    inp: &GpuBuf,
    off: Option<&GpuBuf>,
    gamma: &GpuBuf,
    beta: &GpuBuf,
    x: Dims,
    groups: usize,
    layout: Layout,
) {
    let cl = layout == Layout::Ndhwc;
    check(x, groups, inp.len(), gamma.len(), mean.len());
    let outs: Vec<&GpuBuf> = out.iter().map(|b| &**b).chain(act.iter().map(|b| &**b)).collect();
    assert!(!outs.is_empty() && outs.iter().all(|b| b.len() == x.numel()), "groupnorm {x}: output lengths");
    let bf = same_bf("groupnorm", &[&[inp][..], &outs[..]].concat());
    let xp = dev.ptr(inp);
    let op_ = out.map(|o| dev.ptr_mut(o)).unwrap_or(0);
    let ap = act.map(|a| dev.ptr_mut(a)).unwrap_or(0);
    let offp = off_ptr(dev, off, x);
    forward_ptrs(dev, xp, offp, op_, ap, mean, rstd, gamma, beta, x, groups, Mode::from_flags(cl, bf));
}

/// [`forward`] with SiLU, in place: `x` := silu(GN(x)) (the statistics pass reads x before the
/// elementwise pass rewrites each element in the thread that read it).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_inplace(
    dev: &Device,
    x: &mut GpuBuf,
    mean: &mut GpuBuf,
    rstd: &mut GpuBuf,
    gamma: &GpuBuf,
    beta: &GpuBuf,
    xd: Dims,
    groups: usize,
    layout: Layout,
) {
    let cl = layout == Layout::Ndhwc;
    check(xd, groups, x.len(), gamma.len(), mean.len());
    let bf = x.bf();
    let xp = dev.ptr_mut(x);
    forward_ptrs(dev, xp, 0, 0, xp, mean, rstd, gamma, beta, xd, groups, Mode::from_flags(cl, bf));
}

/// The device pointer of an input offset (0: none), its length checked: f32, N·C.
fn off_ptr(dev: &Device, off: Option<&GpuBuf>, x: Dims) -> u64 {
    off.map(|o| {
        assert!(o.len() == x.n * x.c && o.bf() == 0, "groupnorm {x}: the input offset is f32 [N·C], got {}", o.len());
        dev.ptr(o)
    })
    .unwrap_or(0)
}

/// Statistics (stage 1 and 2), then the elementwise stage, on raw pointers (`offp` 0: no input
/// offset; `op_`/`ap` 0: not written; either may be `xp` itself).
#[allow(clippy::too_many_arguments)]
fn forward_ptrs(
    dev: &Device,
    xp: u64,
    offp: u64,
    op_: u64,
    ap: u64,
    mean: &mut GpuBuf,
    rstd: &mut GpuBuf,
    gamma: &GpuBuf,
    beta: &GpuBuf,
    x: Dims,
    groups: usize,
    mode: Mode,
) {
    stats_ptrs(dev, xp, offp, mean, rstd, x, groups, mode);
    apply(dev, xp, offp, dev.ptr(mean), dev.ptr(rstd), gamma, beta, op_, ap, x, groups, mode);
}

/// The statistics alone (mean/rstd [N·G]) of `inp` + `off`: for a consumer that applies
/// GroupNorm+SiLU itself (the fused output head, `conv::small::gn_head_forward`; the ResBlocks' convs,
/// `conv::paths::gn_wgmma_forward`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn stats(
    dev: &Device,
    inp: &GpuBuf,
    off: Option<&GpuBuf>,
    mean: &mut GpuBuf,
    rstd: &mut GpuBuf,
    x: Dims,
    groups: usize,
    layout: Layout,
) {
    let cl = layout == Layout::Ndhwc;
    check(x, groups, inp.len(), x.c, mean.len());
    stats_ptrs(dev, dev.ptr(inp), off_ptr(dev, off, x), mean, rstd, x, groups, Mode::from_flags(cl, inp.bf()));
}

/// Stages 1 and 2 of the statistics of x at `xp` (+ the offset at `offp`, 0: none) into mean/rstd.
#[allow(clippy::too_many_arguments)]
fn stats_ptrs(
    dev: &Device,
    xp: u64,
    offp: u64,
    mean: &mut GpuBuf,
    rstd: &mut GpuBuf,
    x: Dims,
    groups: usize,
    mode: Mode,
) {
    let (_, nchunks) = chunking(x, mode.layout);
    let part = dev.scratch(x.n * nchunks * x.c * 2);
    let pp = dev.ptr(&*part);
    launch_partial(dev, Partial::Stats, x, groups, mode, &[xp], pp);
    finalize_stats(dev, pp, offp, mean, rstd, x, groups, mode.layout);
}

/// Stage 2 of the statistics of `x` + off from partials that carry their counts, (mean, M2,
/// count) per (n, chunk, c) with `nchunks` chunks a sample (a conv epilogue's:
/// `conv3d_wgmma_fwd_gn` with output statistics): gn_stats_finalize with chunk_len 0.
#[allow(clippy::too_many_arguments)]
pub(crate) fn finalize_stats_counted(
    dev: &Device,
    pp: u64,
    off: Option<&GpuBuf>,
    (mean, rstd): (&mut GpuBuf, &mut GpuBuf),
    x: Dims,
    groups: usize,
    nchunks: usize,
) {
    assert!(
        groups > 0
            && x.c.is_multiple_of(groups)
            && mean.len() == x.n * groups
            && rstd.len() == mean.len()
            && off.is_none_or(|o| o.len() == x.n * x.c && o.dtype() == meddpm::DType::F32),
        "GroupNorm statistics of {x}, {groups} groups: mean/rstd lengths {} {} or the offset",
        mean.len(),
        rstd.len()
    );
    finalize_launch(dev, pp, off.map_or(0, |o| dev.ptr(o)), (mean, rstd), x, groups, (0, nchunks));
}

/// Stage 2 of the statistics: mean/rstd [N·G] from the chunk partials at `pp` (kernel
/// gn_stats_finalize).
#[allow(clippy::too_many_arguments)]
fn finalize_stats(
    dev: &Device,
    pp: u64,
    offp: u64,
    mean: &mut GpuBuf,
    rstd: &mut GpuBuf,
    x: Dims,
    groups: usize,
    layout: Layout,
) {
    finalize_launch(dev, pp, offp, (mean, rstd), x, groups, chunking(x, layout));
}

/// gn_stats_finalize over the partials at `pp` (+ the offset at `offp`, 0: none): `nchunks`
/// chunks a sample of `chunk_len` voxels, or chunk_len 0: the partials carry their counts.
fn finalize_launch(
    dev: &Device,
    pp: u64,
    offp: u64,
    (mean, rstd): (&mut GpuBuf, &mut GpuBuf),
    x: Dims,
    groups: usize,
    (chunk_len, nchunks): (usize, usize),
) {
    let (mp, rp) = (dev.ptr_mut(mean), dev.ptr_mut(rstd));
    let q = fin_split(nchunks, x.c / groups, groups);
    let fin = dev.fin_ws(x.n * groups * q * 2);
    let args = [
        P(pp),
        P(offp),
        P(mp),
        P(rp),
        I(x.n as i32),
        I(x.c as i32),
        L(x.s() as i64),
        I(groups as i32),
        I(chunk_len as i32),
        I(nchunks as i32),
        F(EPS),
        P(dev.ptr(&fin.ws)),
        P(dev.ptr(&fin.cnt)),
    ];
    dev.launch("gn_stats_finalize", (groups as u32, q as u32, 1), (FIN_T, 1, 1), &args);
}

/// Threads of a finalizer block (kernels/groupnorm.cu FIN_T).
const FIN_T: u32 = 256;

/// Blocks per group of a finalizer over `nchunks` chunk partials of `cpg` channels a group
/// (kernels/groupnorm.cu): about eight chunks a thread (one unrolled batch of loads), thread rows of
/// FIN_T / cpg channels, at most 64 blocks a group. `groups` is checked against the arrival
/// counters' count.
pub(crate) fn fin_split(nchunks: usize, cpg: usize, groups: usize) -> usize {
    assert!(
        groups <= crate::device::FIN_MAX_GROUPS,
        "GroupNorm with {groups} groups: the finalizers take at most {}",
        crate::device::FIN_MAX_GROUPS
    );
    // the kernel's thread rows: FIN_T / cpg, with cpg <= 32 padded to a power of two
    let nc = cpg.clamp(1, FIN_T as usize);
    let rows = FIN_T as usize / if nc <= 32 { nc.next_power_of_two() } else { nc };
    nchunks.div_ceil(8 * rows).clamp(1, 64)
}

/// `out` = cat([a (+ a_bias), b]) along channels (as `elementwise::concat`) and the GroupNorm
/// statistics of `out` (as [`forward`] saves them), in one pass over the data where the layout
/// allows (NDHWC, both parts' channels a multiple of the vector width: kernel
/// concat_stats_ndhwc), else the concatenation and then the statistics pass.
#[allow(clippy::too_many_arguments)]
pub(crate) fn concat_stats(
    dev: &Device,
    out: &mut GpuBuf,
    a: &GpuBuf,
    a_bias: Option<&GpuBuf>,
    b: &GpuBuf,
    (mean, rstd): (&mut GpuBuf, &mut GpuBuf),
    x: Dims,
    (ca, cb): (usize, usize),
    groups: usize,
    layout: Layout,
) {
    let cl = layout == Layout::Ndhwc;
    let od = x.with_c(ca + cb);
    assert!(
        groups > 0 && od.c.is_multiple_of(groups) && mean.len() == od.n * groups && rstd.len() == mean.len(),
        "concat statistics {od} groups {groups}: mean/rstd lengths {} {}",
        mean.len(),
        rstd.len()
    );
    let bf = check_concat("concat statistics", out, a, a_bias, b, x, ca, cb);
    let v = if cl { ndhwc_vec(od.c, bf) } else { 0 };
    if v < 4 || !ca.is_multiple_of(v) || !cb.is_multiple_of(v) {
        crate::elementwise::concat(dev, out, a, a_bias, b, x, ca, cb, layout);
        return stats_ptrs(dev, dev.ptr(out), 0, mean, rstd, od, groups, Mode::from_flags(cl, bf));
    }
    let (len, nchunks) = chunking(od, layout);
    let part = dev.scratch(od.n * nchunks * od.c * 2);
    let pp = dev.ptr(&*part);
    let args = [
        P(dev.ptr_mut(out)),
        P(dev.ptr(a)),
        P(dev.ptr(b)),
        P(a_bias.map_or(0, |v| dev.ptr(v))),
        P(pp),
        I(ca as i32),
        I(cb as i32),
        L(od.s() as i64),
        I(len as i32),
        I(nchunks as i32),
        I(bf),
        I(v as i32),
    ];
    dev.launch("concat_stats_ndhwc", (nchunks as u32, od.n as u32, 1), (256, 1, 1), &args);
    finalize_stats(dev, pp, 0, mean, rstd, od, groups, layout);
}

/// `cat_skip_stats_ndhwc`'s tile for C concatenated channels and CO outputs: T voxels, a
/// multiple of the m16 tiles and of the statistics rows (256 / (C / 8)), at least 64 where that
/// fits, so that two blocks share an SM where they can (None: not even the smallest tile fits).
fn cat_skip_tile(c: usize, co: usize) -> Option<usize> {
    let rows = 256 / (c / 8);
    let (mut a, mut b) = (16, rows);
    while b != 0 {
        (a, b) = (b, a % b);
    }
    let l = 16 * rows / a;
    let t = 64usize.div_ceil(l) * l;
    let fits = |t: usize| cat_skip_bytes(c, co, t) <= SMEM_MAX;
    [t, l].into_iter().find(|&t| fits(t))
}

/// The shared memory a block may have (227 KB), of which `cat_skip_stats_ndhwc`'s row sums take
/// 16 KB statically.
const SMEM_MAX: usize = 227 * 1024;

/// Tiles in `cat_skip_stats_ndhwc`'s ring (CS_NS).
const CAT_SKIP_NS: usize = 3;

/// Bytes of shared memory `cat_skip_stats_ndhwc` takes with tiles of `t` voxels: W, the ring of
/// tiles, the warps' output rows and the bias (dynamic), and the 16 KB of row sums (static).
fn cat_skip_bytes(c: usize, co: usize, t: usize) -> usize {
    let xr = c + 32;
    (co * xr + CAT_SKIP_NS * t * xr + 8 * 16 * 40) * 2 + co * 4 + 16384
}

/// Whether `cat_skip_stats_ndhwc` runs for C concatenated channels and CO outputs: its shared
/// memory fits (W (CO × C bf16) and a tile of 16 voxels at least).
pub(crate) fn cat_skip_fits(c: usize, co: usize) -> bool {
    c.is_multiple_of(64) && c / 8 <= 256 && cat_skip_tile(c, co).is_some()
}

/// A decoder ResBlock's skip conv and GroupNorm statistics from its concatenation's parts, the
/// concatenation never stored (bf16 NDHWC; kernel `cat_skip_stats_ndhwc`): `out` (N, S, co) =
/// w · cat(a (ca channels), b) + bias (w: the 1×1×1 conv's (co, ca + cb) bf16 weight, bias f32
/// [co]), and mean/rstd of the concatenation as [`concat_stats`] saves them (bit for bit: the
/// same partials in the same order). `x` is the concatenation's dims.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cat_skip_stats(
    dev: &Device,
    out: &mut GpuBuf,
    (a, b): (&GpuBuf, &GpuBuf),
    (mean, rstd): (&mut GpuBuf, &mut GpuBuf),
    (w, bias): (&GpuBuf, &GpuBuf),
    x: Dims,
    ca: usize,
    co: usize,
    groups: usize,
) {
    let (c, vox) = (x.c, x.n * x.s());
    let cb = c - ca;
    assert!(
        ca.is_multiple_of(32)
            && cb.is_multiple_of(32)
            && c.is_multiple_of(64)
            && co.is_multiple_of(64)
            && [out, a, b, w].iter().all(|t| t.dtype() == meddpm::DType::Bf16)
            && bias.dtype() == meddpm::DType::F32
            && a.len() == vox * ca
            && b.len() == vox * cb
            && out.len() == vox * co
            && w.len() == co * c
            && bias.len() == co
            && groups > 0
            && c.is_multiple_of(groups)
            && mean.len() == x.n * groups
            && rstd.len() == mean.len(),
        "cat_skip_stats_ndhwc {x} at channel {ca} → {co}: operands (out {}, a {}, b {}, w {}, bias {}, mean {}; \
         bf16 activations and weight, f32 bias, parts of 32-channel multiples, C and co of 64)",
        out.len(),
        a.len(),
        b.len(),
        w.len(),
        bias.len(),
        mean.len()
    );
    let (len, nchunks) = chunking(x, Layout::Ndhwc);
    let part = dev.scratch(x.n * nchunks * c * 2);
    let pp = dev.ptr(&*part);
    let t = cat_skip_tile(c, co).unwrap_or_else(|| panic!("cat_skip_stats_ndhwc {x} → {co}: shared memory"));
    let args = [
        P(dev.ptr_mut(out)),
        P(dev.ptr(a)),
        P(dev.ptr(b)),
        P(dev.ptr(w)),
        P(dev.ptr(bias)),
        P(pp),
        I(ca as i32),
        I(cb as i32),
        I(co as i32),
        L(x.s() as i64),
        I(len as i32),
        I(nchunks as i32),
        I(t as i32),
    ];
    let smem = (cat_skip_bytes(c, co, t) - 16384) as u32;
    dev.launch_shared("cat_skip_stats_ndhwc", (nchunks as u32, x.n as u32, 1), (256, 1, 1), smem, &args);
    finalize_stats(dev, pp, 0, mean, rstd, x, groups, Layout::Ndhwc);
}

/// `act` = silu(GN(inp + off)) from statistics saved by [`forward`] (the backward's recomputation of a
/// convolution's input): only the elementwise pass, bit for bit what the forward wrote.
#[allow(clippy::too_many_arguments)]
pub(crate) fn recompute(
    dev: &Device,
    act: &mut GpuBuf,
    mean: &GpuBuf,
    rstd: &GpuBuf,
    inp: &GpuBuf,
    off: Option<&GpuBuf>,
    gamma: &GpuBuf,
    beta: &GpuBuf,
    x: Dims,
    groups: usize,
    layout: Layout,
) {
    let cl = layout == Layout::Ndhwc;
    check(x, groups, inp.len(), gamma.len(), mean.len());
    assert!(act.len() == x.numel() && rstd.len() == mean.len(), "groupnorm recompute {x}: lengths");
    let bf = same_bf("groupnorm recompute", &[inp, act]);
    let (xp, mp, rp, ap) = (dev.ptr(inp), dev.ptr(mean), dev.ptr(rstd), dev.ptr_mut(act));
    let offp = off_ptr(dev, off, x);
    apply(dev, xp, offp, mp, rp, gamma, beta, 0, ap, x, groups, Mode::from_flags(cl, bf));
}

/// [`recompute`] in place: `x` := silu(GN(x)) (one gn_apply pass reading and writing `x`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn recompute_inplace(
    dev: &Device,
    x: &mut GpuBuf,
    mean: &GpuBuf,
    rstd: &GpuBuf,
    gamma: &GpuBuf,
    beta: &GpuBuf,
    xd: Dims,
    groups: usize,
    layout: Layout,
) {
    let cl = layout == Layout::Ndhwc;
    check(xd, groups, x.len(), gamma.len(), mean.len());
    assert!(rstd.len() == mean.len(), "groupnorm recompute in place {xd}: lengths");
    let bf = x.bf();
    let (mp, rp, xp) = (dev.ptr(mean), dev.ptr(rstd), dev.ptr_mut(x));
    apply(dev, xp, 0, mp, rp, gamma, beta, 0, xp, xd, groups, Mode::from_flags(cl, bf));
}

/// The elementwise stage (kernel gn_apply): out = GN(x + off) and/or act = silu(GN(x + off)) (0:
/// not written, no offset).
#[allow(clippy::too_many_arguments)]
fn apply(
    dev: &Device,
    xp: u64,
    offp: u64,
    mp: u64,
    rp: u64,
    gamma: &GpuBuf,
    beta: &GpuBuf,
    op_: u64,
    ap: u64,
    x: Dims,
    groups: usize,
    mode: Mode,
) {
    let (cl, bf) = (mode.cl(), mode.bf_flag());
    let v = row_vec(x, mode);
    let (grid, block) = row_launch(dev, x, v, mode.layout);
    let args = [
        P(xp),
        P(mp),
        P(rp),
        P(dev.ptr(gamma)),
        P(dev.ptr(beta)),
        P(offp),
        P(op_),
        P(ap),
        I(x.c as i32),
        L(x.s() as i64),
        I(groups as i32),
        I(cl as i32),
        I(bf),
        I(v as i32),
    ];
    dev.launch("gn_apply", grid, block, &args);
}

fn check(x: Dims, groups: usize, inp: usize, gamma: usize, stats: usize) {
    assert!(
        groups > 0 && x.c.is_multiple_of(groups) && inp == x.numel() && gamma == x.c && stats == x.n * groups,
        "groupnorm {x} groups {groups}: lengths inp {inp} gamma {gamma} mean/rstd {stats}"
    );
}

/// Backward: dinp (per Accum), dgamma += , dbeta += . With `silu_beta` (the GroupNorm's beta) the
/// incoming gradient is first multiplied by silu'(y), y = GN(inp + off) recomputed on the fly from
/// the statistics (fused GroupNorm+SiLU backward). dinp is also ∂loss/∂off per voxel. With `dsum`
/// (only where [`can_sum`], dinp overwritten): dsum[n, c] (f32 [N·C]) = Σ over the voxels of
/// dinp[n, c], from the backward's own channel sums (a third partial, Σ (x − μ), in
/// `chan_gnbwd3_*`; gn_bwd_finalize forms r·(γ_c·Σg − S·m1 − m2·r·Σ(x − μ))), so no pass reads
/// dinp again. With `act` (only with SiLU): act = silu(GN(inp + off)) too, written by the
/// elementwise pass (`Backend::groupnorm_silu_backward_act`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    dev: &Device,
    dinp: (&mut GpuBuf, Accum),
    dsum: Option<&mut GpuBuf>,
    act: Option<&mut GpuBuf>,
    dgamma: &mut GpuBuf,
    dbeta: &mut GpuBuf,
    dout: &GpuBuf,
    silu_beta: Option<&GpuBuf>,
    inp: &GpuBuf,
    off: Option<&GpuBuf>,
    mean: &GpuBuf,
    rstd: &GpuBuf,
    gamma: &GpuBuf,
    x: Dims,
    groups: usize,
    (layout, res, pre): (Layout, Option<&GpuBuf>, Option<Partials>),
) {
    let cl = layout == Layout::Ndhwc;
    check(x, groups, inp.len(), gamma.len(), mean.len());
    assert!(dout.len() == x.numel() && dinp.0.len() == x.numel(), "groupnorm backward {x}: dout/dinp lengths");
    let bf = same_bf("groupnorm backward", &[dinp.0, dout, inp]);
    let dp = dev.ptr(dout);
    let acc = dinp.1;
    let offp = off_ptr(dev, off, x);
    let dxp = dev.ptr_mut(dinp.0);
    let sp = match dsum {
        None => 0,
        Some(s) => {
            assert!(
                can_sum(x, groups, layout) && acc == Accum::Overwrite,
                "groupnorm backward with channel sums {x} G{groups}: NDHWC, N·C/G ≤ 256, dinp overwritten only"
            );
            assert!(s.len() == x.n * x.c && s.bf() == 0, "groupnorm backward {x}: dsum is f32 [N·C], got {}", s.len());
            dev.ptr_mut(s)
        }
    };
    let ap = match act {
        None => 0,
        Some(a) => {
            assert!(silu_beta.is_some(), "groupnorm backward {x}: act is the SiLU output, SiLU backward only");
            assert!(a.len() == x.numel() && a.bf() == bf, "groupnorm backward {x}: act length/type vs inp");
            dev.ptr_mut(a)
        }
    };
    let rp = match res {
        None => 0,
        Some(r) => {
            assert!(r.len() == x.numel() && r.bf() == bf, "groupnorm backward {x}: res length/type vs dinp");
            assert!(sp == 0, "groupnorm backward {x}: res and dsum together");
            dev.ptr(r)
        }
    };
    let inp = (inp, offp);
    backward_ptrs(
        dev,
        (dxp, acc),
        dgamma,
        dbeta,
        dp,
        silu_beta,
        inp,
        mean,
        rstd,
        gamma,
        x,
        groups,
        Mode::from_flags(cl, bf),
        (sp, ap, rp),
        None,
        pre,
    );
}

/// The channel partials of a GroupNorm backward taken before [`backward`] (by the conv data
/// gradient's epilogue, `conv::paths::backward_data_gn`): `part` (device pointer) holds `nchunks`
/// chunks a sample, three floats a (n, chunk, c) where the backward gives dsum, else two; `coef`
/// has room for N·G pairs. The caller holds the storage (the scratch buffer) until the backward
/// is queued.
#[derive(Clone, Copy)]
pub(crate) struct Partials {
    pub part: u64,
    pub coef: u64,
    pub nchunks: usize,
}

/// Whether [`backward`] can also give the channel sums of dinp (`dsum`): NDHWC, and the
/// finaliser's shared arrays hold N·C/G sums (kernels/groupnorm.cu GNB_MAXNC); elsewhere the
/// backward, then a `channel_sum` pass.
pub(crate) fn can_sum(x: Dims, groups: usize, layout: Layout) -> bool {
    let cl = layout == Layout::Ndhwc;
    cl && x.n * (x.c / groups.max(1)) <= 256
}

/// [`backward`] with SiLU, in place: `d` holds ∂loss/∂silu(GN(inp)) and gets ∂loss/∂inp
/// (overwritten): the partial sums read all of `d` before the elementwise pass rewrites it, each
/// element in the thread that read it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_inplace(
    dev: &Device,
    d: &mut GpuBuf,
    (dgamma, dbeta): (&mut GpuBuf, &mut GpuBuf),
    beta: &GpuBuf,
    inp: &GpuBuf,
    mean: &GpuBuf,
    rstd: &GpuBuf,
    gamma: &GpuBuf,
    x: Dims,
    groups: usize,
    layout: Layout,
) {
    inplace(dev, d, (dgamma, dbeta), beta, (inp, 0), (mean, rstd), gamma, x, groups, layout);
}

/// [`backward_inplace`] that also replaces `x` (the GroupNorm's input) by silu(GN(x)) in the
/// same elementwise pass, each element after its thread read it
/// (`Backend::groupnorm_silu_backward_inplace_act`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_inplace_act(
    dev: &Device,
    d: &mut GpuBuf,
    x: &mut GpuBuf,
    dgb: (&mut GpuBuf, &mut GpuBuf),
    beta: &GpuBuf,
    (mean, rstd): (&GpuBuf, &GpuBuf),
    gamma: &GpuBuf,
    xd: Dims,
    groups: usize,
    layout: Layout,
) {
    let ap = dev.ptr_mut(x);
    inplace(dev, d, dgb, beta, (&*x, ap), (mean, rstd), gamma, xd, groups, layout);
}

#[allow(clippy::too_many_arguments)]
fn inplace(
    dev: &Device,
    d: &mut GpuBuf,
    (dgamma, dbeta): (&mut GpuBuf, &mut GpuBuf),
    beta: &GpuBuf,
    (inp, ap): (&GpuBuf, u64),
    (mean, rstd): (&GpuBuf, &GpuBuf),
    gamma: &GpuBuf,
    x: Dims,
    groups: usize,
    layout: Layout,
) {
    let cl = layout == Layout::Ndhwc;
    check(x, groups, inp.len(), gamma.len(), mean.len());
    assert!(d.len() == x.numel(), "groupnorm backward in place {x}: gradient length");
    let bf = same_bf("groupnorm backward in place", &[d, inp]);
    let dp = dev.ptr_mut(d);
    let dx = (dp, Accum::Overwrite);
    let (b, ip) = (Some(beta), (inp, 0));
    backward_ptrs(
        dev,
        dx,
        dgamma,
        dbeta,
        dp,
        b,
        ip,
        mean,
        rstd,
        gamma,
        x,
        groups,
        Mode::from_flags(cl, bf),
        (0, ap, 0),
        None,
        None,
    );
}

/// [`backward_inplace_act`] that delivers the gradient to the two parts of the concatenation
/// `x` (channels [0, ca) and [ca, C)), each per its `Accum`, instead of writing it into `d`
/// (`Backend::groupnorm_silu_backward_cat_in`'s first half). Only where [`split_ok`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_inplace_act_split(
    dev: &Device,
    d: &GpuBuf,
    x: &mut GpuBuf,
    ((ph, mh), (ps, ms_)): ((&mut GpuBuf, Accum), (&mut GpuBuf, Accum)),
    ca: usize,
    (dgamma, dbeta): (&mut GpuBuf, &mut GpuBuf),
    beta: &GpuBuf,
    (mean, rstd): (&GpuBuf, &GpuBuf),
    gamma: &GpuBuf,
    xd: Dims,
    groups: usize,
    layout: Layout,
) {
    let cl = layout == Layout::Ndhwc;
    check(xd, groups, x.len(), gamma.len(), mean.len());
    let cb = xd.c - ca;
    assert!(
        d.len() == xd.numel() && ph.len() == xd.n * ca * xd.s() && ps.len() == xd.n * cb * xd.s(),
        "groupnorm backward into the parts of {xd} at channel {ca}: lengths d {} parts {} {}",
        d.len(),
        ph.len(),
        ps.len()
    );
    let bf = same_bf("groupnorm backward into parts", &[d, &*x, &*ph, &*ps]);
    assert!(
        split_ok(xd, ca, Mode::from_flags(cl, bf)),
        "groupnorm backward into parts of {xd} at channel {ca}: a vector straddles them"
    );
    let ap = dev.ptr_mut(x);
    let (dp, hp, sp) = (dev.ptr(d), dev.ptr_mut(ph), dev.ptr_mut(ps));
    let ip = (&*x, 0);
    let split = Some((sp, ms_, ca, [0; 3], None));
    backward_ptrs(
        dev,
        (hp, mh),
        dgamma,
        dbeta,
        dp,
        Some(beta),
        ip,
        mean,
        rstd,
        gamma,
        xd,
        groups,
        Mode::from_flags(cl, bf),
        (0, ap, 0),
        split,
        None,
    );
}

/// [`backward_inplace_act_split`] with x, the concatenation cat([h + h_bias, s]), read from its
/// parts rather than from a built concatenation: the sums (`chan_gnbwd_cat_ndhwc*`) and the
/// elementwise pass read each value from its part and round it as the concatenation would store
/// it, so dγ, dβ, `act` (= silu(GN(x)), a separate buffer here) and the parts' gradients are bit
/// for bit those of the built concatenation. Only where [`parts_ok`]. With `skip` = (dout, w, Cout)
/// the pass also adds the decoder ResBlock's skip conv data gradient, Σ_o dout[o]·w[o, c] (w the
/// 1×1×1 conv's (Cout, C) bf16 weight) to the parts, rounded once (`gn_bwd_apply_split_skip`:
/// where [`skip_apply_fits`]); act, dγ and dβ stay bit for bit.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_act_split_from_parts(
    dev: &Device,
    d: &GpuBuf,
    act: &mut GpuBuf,
    (h, h_bias, s): (&GpuBuf, Option<&GpuBuf>, &GpuBuf),
    ((ph, mh), (ps, ms_)): ((&mut GpuBuf, Accum), (&mut GpuBuf, Accum)),
    ca: usize,
    (dgamma, dbeta): (&mut GpuBuf, &mut GpuBuf),
    beta: &GpuBuf,
    (mean, rstd): (&GpuBuf, &GpuBuf),
    gamma: &GpuBuf,
    xd: Dims,
    groups: usize,
    skip: Option<(&GpuBuf, &GpuBuf, usize)>,
) {
    check(xd, groups, act.len(), gamma.len(), mean.len());
    let (sa, sb) = (xd.n * ca * xd.s(), xd.n * (xd.c - ca) * xd.s());
    if let Some((dout, w, co)) = skip {
        assert!(
            skip_apply_fits(xd.c, co, ca)
                && [dout.dtype(), w.dtype(), d.dtype()].iter().all(|&t| t == meddpm::DType::Bf16)
                && dout.len() == xd.n * xd.s() * co
                && w.len() == co * xd.c,
            "gn_bwd_apply_split_skip {xd} at channel {ca} → {co}: bf16 operands of matching lengths (dout {}, w {}), \
             C and Cout multiples of 64",
            dout.len(),
            w.len()
        );
    }
    assert!(
        d.len() == xd.numel() && [ph.len(), h.len()] == [sa; 2] && [ps.len(), s.len()] == [sb; 2],
        "groupnorm backward from and into the parts of {xd} at channel {ca}: lengths d {} parts {} {} grads {} {}",
        d.len(),
        h.len(),
        s.len(),
        ph.len(),
        ps.len()
    );
    if let Some(b) = h_bias {
        require_f32("groupnorm backward from parts: the first part's bias", &[b]);
        assert!(b.len() == ca, "groupnorm backward from parts of {xd}: bias length {} (expected {ca})", b.len());
    }
    let bf = same_bf("groupnorm backward from parts", &[d, &*act, h, s, &*ph, &*ps]);
    assert!(
        parts_ok(xd, ca, Mode::from_flags(true, bf).dtype),
        "groupnorm backward from parts of {xd} at channel {ca}: a vector straddles them"
    );
    let ap = dev.ptr_mut(act);
    let (dp, hp, sp) = (dev.ptr(d), dev.ptr_mut(ph), dev.ptr_mut(ps));
    let xs = [dev.ptr(h), dev.ptr(s), h_bias.map_or(0, |b| dev.ptr(b))];
    let skip = skip.map(|(dout, w, co)| (dev.ptr(dout), dev.ptr(w), co));
    let split = Some((sp, ms_, ca, xs, skip));
    let (b, ip) = (Some(beta), (&*act, 0));
    let (d, g) = ((hp, mh), (dgamma, dbeta));
    backward_ptrs(
        dev,
        d,
        g.0,
        g.1,
        dp,
        b,
        ip,
        mean,
        rstd,
        gamma,
        xd,
        groups,
        Mode::from_flags(true, bf),
        (0, ap, 0),
        split,
        None,
    );
}

/// `gn_bwd_apply_split_skip`'s warps for C concatenated channels: one a 32-channel group, times the
/// most that keeps a block within 8 warps (C ≤ 256).
fn skip_apply_warps(c: usize) -> usize {
    let ng = c / 32;
    ng * (8 / ng).max(1)
}

/// Bytes of shared memory `gn_bwd_apply_split_skip` takes: W^T (C rows of co + 32 bf16), the
/// (A, B, K, sh) table (a float4 a channel), a 16 × 32 float tile a warp.
fn skip_apply_bytes(c: usize, co: usize) -> usize {
    c * (co + 32) * 2 + c * 16 + skip_apply_warps(c) * 16 * 32 * 4
}

/// Whether [`backward_act_split_from_parts`] can add a decoder ResBlock's skip conv data gradient
/// in its pass (`gn_bwd_apply_split_skip`): C and Cout multiples of 64, C at most 256 (a warp per
/// 32 channels in a block of at most 8), the parts of 8-channel multiples, the shared memory within
/// two blocks an SM (100 KB).
pub(crate) fn skip_apply_fits(c: usize, co: usize, ca: usize) -> bool {
    c.is_multiple_of(64)
        && co.is_multiple_of(64)
        && ca.is_multiple_of(8)
        && ca > 0
        && ca < c
        && c <= 256
        && skip_apply_bytes(c, co) <= 100 * 1024
}

/// Whether [`backward_act_split_from_parts`] takes a concatenation of `x` at channel `ca` with
/// activations of type `dtype`: NDHWC, the sums' 4 or 8 channels a thread and the elementwise
/// pass's vectors each within one part.
pub(crate) fn parts_ok(x: Dims, ca: usize, dtype: DType) -> bool {
    let mode = Mode::new(Layout::Ndhwc, dtype);
    let v = ndhwc_vec(x.c, mode.bf_flag());
    v >= 4 && ca.is_multiple_of(v) && (x.c - ca).is_multiple_of(v) && split_ok(x, ca, mode)
}

/// Whether the elementwise pass can write the parts of a concatenation of `x` at channel `ca`:
/// in NDHWC no vector of the pass may straddle them.
pub(crate) fn split_ok(x: Dims, ca: usize, mode: Mode) -> bool {
    if ca == 0 || ca >= x.c {
        return false;
    }
    let v = row_vec(x, mode);
    !mode.cl() || (ca.is_multiple_of(v) && (x.c - ca).is_multiple_of(v))
}

/// [`backward_ptrs`]'s concatenation split: (dx2, its Accum, ca, [xh, xs, xbias], and where the
/// skip conv's data gradient is added in the pass (dout, w, Cout)).
type Split = (u64, Accum, usize, [u64; 3], Option<(u64, u64, usize)>);

/// The three backward stages on raw gradient pointers (`dx.0` may be `dp`); `inp` with its input
/// offset's pointer (0: none); `dsum` ≠ 0: dx's channel sums too; `act` ≠ 0: silu(GN(inp)) too
/// (may be `inp`'s own pointer); `split` = Some((dx2, its Accum, ca, [xh, xs, xbias])): dx holds
/// channels [0, ca) only and dx2 the rest (`gn_bwd_apply_split`); with xh ≠ 0 x is read from the
/// parts xh (+ xbias where ≠ 0) and xs, not from `inp` (NDHWC).
#[allow(clippy::too_many_arguments)]
fn backward_ptrs(
    dev: &Device,
    dx: (u64, Accum),
    dgamma: &mut GpuBuf,
    dbeta: &mut GpuBuf,
    dp: u64,
    silu_beta: Option<&GpuBuf>,
    (inp, offp): (&GpuBuf, u64),
    mean: &GpuBuf,
    rstd: &GpuBuf,
    gamma: &GpuBuf,
    x: Dims,
    groups: usize,
    mode: Mode,
    (dsum, act, res): (u64, u64, u64),
    split: Option<Split>,
    pre: Option<Partials>,
) {
    let (cl, bf) = (mode.cl(), mode.bf_flag());
    assert!(res == 0 || split.is_none(), "groupnorm backward: res with a split gradient");
    assert!(pre.is_none() || split.is_none(), "groupnorm backward: partials given with a split gradient");
    let stride = if dsum != 0 { 3 } else { 2 };
    // the partials' storage: the scratch buffer, or the caller's (pre)
    let (nchunks, pp, coef, _scratch) = match pre {
        Some(p) => (p.nchunks, p.part, p.coef, None),
        None => {
            let (_, nchunks) = chunking(x, mode.layout);
            let npart = x.n * nchunks * x.c * stride;
            let scratch = dev.scratch(npart + x.n * groups * 2);
            let pp = dev.ptr(&*scratch);
            (nchunks, pp, pp + (npart * 4) as u64, Some(scratch))
        }
    };
    let (xp, mp, rp, gp) = (dev.ptr(inp), dev.ptr(mean), dev.ptr(rstd), dev.ptr(gamma));
    let bp = silu_beta.map(|b| dev.ptr(b)).unwrap_or(0);
    let from_parts = split.map_or([0; 3], |s| s.3);
    if pre.is_some() {
        // taken already
    } else if from_parts[0] != 0 {
        assert!(dsum == 0 && cl, "groupnorm backward from parts: NDHWC, no dx channel sums");
        let ca = split.map_or(0, |s| s.2);
        let [xh, xs, xb] = from_parts;
        launch_partial(dev, Partial::GnBwdCat(ca), x, groups, mode, &[dp, xh, xs, xb, mp, rp, gp, bp, offp], pp);
    } else {
        let kind = if dsum != 0 { Partial::GnBwd3 } else { Partial::GnBwd };
        launch_partial(dev, kind, x, groups, mode, &[dp, xp, mp, rp, gp, bp, offp], pp);
    }
    let q = fin_split(nchunks, x.c / groups, groups);
    let fin = dev.fin_ws(x.n * x.c * q * 3);
    dev.launch(
        "gn_bwd_finalize",
        (groups as u32, q as u32, 1),
        (FIN_T, 1, 1),
        &[
            P(pp),
            P(rp),
            P(gp),
            P(dev.ptr_mut(dgamma)),
            P(dev.ptr_mut(dbeta)),
            P(coef),
            I(x.n as i32),
            I(x.c as i32),
            L(x.s() as i64),
            I(groups as i32),
            I(nchunks as i32),
            I(stride as i32),
            P(dsum),
            P(dev.ptr(&fin.ws)),
            P(dev.ptr(&fin.cnt)),
        ],
    );
    drop(fin);
    let v = row_vec(x, mode);
    let (grid, block) = row_launch(dev, x, v, mode.layout);
    let args = [
        P(dp),
        P(xp),
        P(mp),
        P(rp),
        P(gp),
        P(bp),
        P(offp),
        P(coef),
        P(dx.0),
        P(act),
        I(x.c as i32),
        L(x.s() as i64),
        I(groups as i32),
        I(cl as i32),
        I((dx.1 == Accum::Add) as i32 | split.map_or(0, |s| ((s.1 == Accum::Add) as i32) << 1)),
        I(bf),
        I(v as i32),
    ];
    // the per-channel coefficient table (a float4 per channel of the block: all C in NDHWC)
    let smem = 16 * if cl { x.c as u32 } else { 1 };
    match split {
        None => {
            let mut a = args.to_vec();
            a.push(P(res));
            dev.launch_shared("gn_bwd_apply", grid, block, smem, &a)
        }
        Some((dx2, _, ca, [xh, xs, xb], Some((doutp, wp, co)))) => {
            // from the parts, with the skip conv's data gradient added (gn_bwd_apply_split_skip)
            assert!(xh != 0 && bp != 0 && offp == 0 && bf == 1, "gn_bwd_apply_split_skip: bf16, from the parts, SiLU");
            // chunks of 16-voxel items, two blocks an SM
            let want = (2 * dev.info.sms as usize).div_ceil(x.n).max(1);
            let len = x.s().div_ceil(want).div_ceil(16) * 16;
            let nchunks = x.s().div_ceil(len);
            let acc = args[14];
            let a = [
                P(dp),
                P(mp),
                P(rp),
                P(gp),
                P(bp),
                P(coef),
                P(dx.0),
                P(dx2),
                P(act),
                I(x.c as i32),
                L(x.s() as i64),
                I(groups as i32),
                acc,
                I(ca as i32),
                P(xh),
                P(xs),
                P(xb),
                P(doutp),
                P(wp),
                I(co as i32),
                I(len as i32),
            ];
            let smem = skip_apply_bytes(x.c, co) as u32;
            let threads = 32 * skip_apply_warps(x.c) as u32;
            dev.launch_shared("gn_bwd_apply_split_skip", (nchunks as u32, x.n as u32, 1), (threads, 1, 1), smem, &a)
        }
        Some((dx2, _, ca, [xh, xs, xb], None)) => {
            let mut a = args.to_vec();
            a.extend([P(dx2), I(ca as i32), P(xh), P(xs), P(xb)]);
            dev.launch_shared("gn_bwd_apply_split", grid, block, smem, &a)
        }
    }
}
