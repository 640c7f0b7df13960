//! Host side of `kernels/conv3d_wgmma.cu`: the wide 3×3×3 stride-1 convolutions (Cin and Cout
//! multiples of 64, bf16 NDHWC) on Hopper's warpgroup MMA, forward and data gradient (the same
//! kernel on the flipped, transposed weights). cuDNN's implicit GEMM runs these at 520–560 TFLOP/s
//! on the H200; this kernel puts the voxels on the MMA's N side and
//! the weights in registers (the .cu file says why). `choose.rs` decides per shape, direction and
//! accumulation whether it runs (timed against cuDNN on first use where [`worth`] says the volume
//! fills the GPU; `MEDDPM_WGMMA=0/1` forbids/forces it).
//! `conv3d_wgmma_fwd_gn` is the forward with the input's GroupNorm+SiLU as its prologue (the
//! ResBlocks' convs: `Backend::groupnorm_silu_conv3d_fused`), no pass that stores silu(GN(x)).
//! `conv3d_wgmma_wgrad` is the weight gradient of the same convs ([`wgrad`]), timed against
//! cuDNN's in the same way; `conv3d_wgmma_wgrad_tf32` is its TF32 form (f32 NDHWC operands rounded
//! to TF32), the only kernel here that is not bf16.
//! Twin: the CPU reference convolution (`meddpm::cpu::conv3d`), through the parity tests (after
//! the CPU GroupNorm+SiLU for the prologue).

use meddpm::{Accum, ConvShape, Dims, Layout};

use crate::device::{Arg, Device};

/// Output tile of a work item, (h, w): the kernel's WM_TH × WM_TW.
const TILE: (usize, usize) = (32, 8);
/// One input stage of the wgmma convs (WM_STAGE): 64 channels of a halo plane, 44 032 bytes.
const STAGE: u32 = 44_032;
/// An MMA warpgroup's epilogue staging rows (WM_TH · WM_TW · WM_YR): 36 864 bytes.
const STAGING: u32 = 32 * 8 * 144;
/// Dynamic shared memory of `conv3d_wgmma` (WM_SMEM: four stages and the epilogue staging).
const SMEM: u32 = 4 * STAGE + STAGING;

/// Whether `conv3d_wgmma` can compute a conv over the volume `x` (`x.c` input channels) with `co`
/// outputs, 3×3×3, stride 1, here: an sm_90 device (the kernel is compiled for sm_90a), NDHWC
/// (`cl`), bf16 operands (`bf16`: the input, the output and the compute type), channel counts
/// multiples of 64.
pub(crate) fn fits(dev: &Device, x: Dims, k: usize, stride: usize, co: usize, layout: Layout, bf16: bool) -> bool {
    let cl = layout == Layout::Ndhwc;
    let ci = x.c;
    dev.info.cc == (9, 0)
        && cl
        && bf16
        && k == 3
        && stride == 1
        && ci > 0
        && co > 0
        && ci.is_multiple_of(64)
        && co.is_multiple_of(64)
}

/// Whether such a conv is worth timing against cuDNN: output tiles (256 voxels a 64-channel
/// slice) for four per SM. Smaller volumes (16³, 8³, 32³ with few slices) leave most SMs idle:
/// on the H200 the 16³ shapes took 140–190 µs here against cuDNN's 80–90 µs, and the first-use
/// timing, a few runs each, sometimes picked ours all the same.
pub(crate) fn worth(dev: &Device, x: Dims, co: usize) -> bool {
    let tiles = x.n * x.d * x.h.div_ceil(TILE.0) * x.w.div_ceil(TILE.1) * co.div_ceil(64);
    tiles >= 4 * dev.info.sms as usize
}

/// y (overwritten, or added to per `acc`) = conv(x, w') + b over the volume `x` (its channels the
/// conv's inputs) with `co` outputs; with `zp` ≠ 0 and `Accum::Add`, y = conv(x, w') + b + z
/// instead (z a tensor of y's shape, y's old values unread). w' = w, a (co, 27, x.c) weight (f32 or bf16, `wbf`), for the
/// forward (`tw` false); for the data gradient (`tw` true, x = the output gradient) w is the
/// forward conv's (x.c, 27, co) weight and w'[o, t, i] = w[i, 26 − t, o]. `bp` = 0: no bias.
/// The weights are packed into `conv3d_wgmma`'s fragment order first (a kept temporary of
/// co · x.c · 27 bf16). `reuse`: with 64 input channels each input plane is loaded (and
/// transformed) once for the three output planes that read it, a window of planes in the
/// kernel's ring, instead of once per output plane (`KernelChoices::wgmma_reuse`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    dev: &Device,
    (xp, wp, bp, yp, zp): (u64, u64, u64, u64, u64),
    wbf: bool,
    x: Dims,
    co: usize,
    acc: Accum,
    tw: bool,
    reuse: bool,
    slot: u8,
) {
    run_gn(dev, (xp, wp, bp, yp, zp), wbf, x, co, acc, tw, None, (reuse, false, Up::No), slot);
}

/// The Upsample conv's side of [`run_gn`]: none, the forward over the doubling of its input
/// ([`run_up`]), or the data gradient that also writes the doubling ([`run_dgrad_up`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Up {
    No,
    Fwd,
    /// (x, u): the half-resolution input and the doubled volume written
    Dgrad(u64, u64),
}

/// [`run`]'s forward over the trilinear doubling of the volume at `xp` (`conv3d_wgmma_fwd_up`, the
/// U-Net's Upsample conv: its producer computes each input stage from x, so the doubled volume is
/// never stored): `x` is the conv's input volume, the doubled one (even extents), and `xp` holds
/// (x.n, x.d / 2, x.h / 2, x.w / 2, x.c); overwrites y.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_up(
    dev: &Device,
    (xp, wp, bp, yp): (u64, u64, u64, u64),
    wbf: bool,
    x: Dims,
    co: usize,
    reuse: bool,
    slot: u8,
) {
    assert!([x.d, x.h, x.w].iter().all(|v| v.is_multiple_of(2)), "conv3d_wgmma_fwd_up: {x} is not a doubled volume");
    run_gn(dev, (xp, wp, bp, yp, 0), wbf, x, co, Accum::Overwrite, false, None, (reuse, false, Up::Fwd), slot);
}

/// [`run_dgrad`] of the Upsample's conv (`conv3d_wgmma_dgrad_up`): dx (at `dxp`, overwritten, the
/// doubled volume's `co` channels) from dy (at `dyp`, volume `y` of 64 channels: the window of
/// planes), whose producer also writes u (at `up`; (y.n, y.d, y.h, y.w, co)), the trilinear
/// doubling of x (at `xp`; (y.n, y.d / 2, y.h / 2, y.w / 2, co)), the conv's input that its weight
/// gradient reads next.
pub(crate) fn run_dgrad_up(
    dev: &Device,
    (dyp, wp, dxp): (u64, u64, u64),
    wbf: bool,
    y: Dims,
    co: usize,
    (xp, up): (u64, u64),
    slot: u8,
) {
    assert!(y.c == 64 && [y.d, y.h, y.w].iter().all(|v| v.is_multiple_of(2)), "conv3d_wgmma_dgrad_up: dy {y}");
    let ptrs = (dyp, wp, 0, dxp, 0);
    run_gn(dev, ptrs, wbf, y, co, Accum::Overwrite, true, None, (true, false, Up::Dgrad(xp, up)), slot);
}

/// [`run`] for the data gradient (`tw`); with `dual` and a result of 128k channels (`co`) on
/// `conv3d_wgmma_dgrad2` (both 64-channel slices in one block; `KernelChoices::wgmma_dual`). Returns
/// whether it ran there.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_dgrad(
    dev: &Device,
    ptrs: (u64, u64, u64, u64, u64),
    wbf: bool,
    x: Dims,
    co: usize,
    acc: Accum,
    (reuse, dual): (bool, bool),
    slot: u8,
) -> bool {
    run_gn(dev, ptrs, wbf, x, co, acc, true, None, (reuse, dual, Up::No), slot)
}

/// [`run`], and with `gn` the forward of silu(GN(x + off)) (`conv3d_wgmma_fwd_gn`: the
/// GroupNorm+SiLU applied to each staged input plane in shared memory, never stored); with `dual`
/// [`run_dgrad`]'s choice of `conv3d_wgmma_dgrad2`; with `up` the Upsample conv's kernels
/// ([`run_up`], [`run_dgrad_up`]). Returns whether `conv3d_wgmma_dgrad2` ran.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_gn(
    dev: &Device,
    (xp, wp, bp, yp, zp): (u64, u64, u64, u64, u64),
    wbf: bool,
    x: Dims,
    co: usize,
    acc: Accum,
    tw: bool,
    gn: Option<GnPro>,
    (reuse, dual, up): (bool, bool, Up),
    slot: u8,
) -> bool {
    use Arg::{I, P};
    assert!(!(tw && gn.is_some()), "conv3d_wgmma: the GroupNorm prologue is a forward's");
    assert!(up == Up::No || gn.is_none(), "conv3d_wgmma: the Upsample's kernels have no GroupNorm prologue");
    assert!(
        matches!((up, tw), (Up::No, _) | (Up::Fwd, false) | (Up::Dgrad(..), true)),
        "conv3d_wgmma: Upsample kernel"
    );
    let ci = x.c;
    let packed = pack(dev, wp, wbf, ci, co, tw, slot);
    let (dc, grid) = super::small::col_items(x, dev.info.sms as usize, TILE);
    let mut args = vec![
        P(xp),
        P(packed),
        P(bp),
        P(yp),
        P(zp),
        I(x.n as i32),
        I(ci as i32),
        I(co as i32),
        I(x.d as i32),
        I(x.h as i32),
        I(x.w as i32),
        I(dc as i32),
        I((acc == Accum::Add) as i32),
    ];
    let (name, smem) = match gn {
        Some(g) => {
            assert!(gn_fits(x, g.groups), "conv3d_wgmma_fwd_gn {x} groups {}: table does not fit", g.groups);
            assert!(g.x2 == 0 || (g.ca.is_multiple_of(64) && g.ca < ci), "conv3d_wgmma_fwd_gn: parts at {}", g.ca);
            args.extend([P(g.mean), P(g.rstd), P(g.gamma), P(g.beta), P(g.off), I(g.groups as i32)]);
            args.extend([P(g.x2), I(g.ca as i32), P(g.ys), I(reuse as i32)]);
            ("conv3d_wgmma_fwd_gn", SMEM + gn_table(x) + YSUMS)
        }
        None => {
            args.push(I(reuse as i32));
            if let Up::Dgrad(xs, u) = up {
                args.extend([P(xs), P(u)]);
                let grid = (grid as u32, (co / 64) as u32, 1);
                dev.launch_shared("conv3d_wgmma_dgrad_up", grid, (256, 1, 1), SMEM, &args);
                return false;
            }
            if tw && dual_fits(co, dual) {
                // two MMA warpgroups, one a 64-channel slice, on the same staged planes
                let grid = (grid as u32, (co / 128) as u32, 1);
                dev.launch_shared("conv3d_wgmma_dgrad2", grid, (384, 1, 1), DUAL_SMEM, &args);
                return true;
            }
            (
                if tw {
                    "conv3d_wgmma_dgrad"
                } else if up == Up::Fwd {
                    "conv3d_wgmma_fwd_up"
                } else {
                    "conv3d_wgmma_fwd"
                },
                SMEM,
            )
        }
    };
    // a producer warpgroup beside the MMA warpgroup
    dev.launch_shared(name, (grid as u32, (co / 64) as u32, 1), (256, 1, 1), smem, &args);
    false
}

/// Whether a data gradient with `co` result channels runs on `conv3d_wgmma_dgrad2` where the
/// switch (`KernelChoices::wgmma_dual`) is `on`: both 64-channel slices of a block, co a multiple of
/// 128.
pub(crate) fn dual_fits(co: usize, on: bool) -> bool {
    on && co.is_multiple_of(128)
}

/// Dynamic shared memory of `conv3d_wgmma_dgrad2` (WM_DUAL_SMEM: three stages, two warpgroups'
/// staging rows).
const DUAL_SMEM: u32 = 3 * STAGE + 2 * STAGING;

/// The weights packed into the kernels' fragment order (`conv3d_wgmma_pack`, a kept temporary of
/// co · ci · 27 bf16 in `slot`); `tw`: the data gradient's flipped, transposed weights.
fn pack(dev: &Device, wp: u64, wbf: bool, ci: usize, co: usize, tw: bool, slot: u8) -> u64 {
    use Arg::{I, P};
    let packed = dev.temp(co * ci * 27, meddpm::DType::Bf16, slot);
    let n16 = co * ci * 27 / 8;
    let pgrid = n16.div_ceil(256).min(dev.info.sms as usize * 8).max(1);
    let pargs = [P(wp), I(wbf as i32), I(ci as i32), I(co as i32), I(tw as i32), P(packed)];
    dev.launch("conv3d_wgmma_pack", (pgrid as u32, 1, 1), (256, 1, 1), &pargs);
    packed
}

/// The GroupNorm+SiLU backward's channel sums that `conv3d_wgmma_dgrad_gnb` takes in its
/// epilogue (device pointers): `x` the GroupNorm's input (the data gradient's shape, bf16
/// NDHWC), its statistics mean/rstd [N·G], γ/β [C], the input offset [N·C] (0: none) and G;
/// `part` receives the chunk partials of `chan_gnbwd_ndhwc*` (`x3`: of `chan_gnbwd3_ndhwc*`),
/// [`items`] × C × (2 or 3) floats, one chunk a column item. `dys` (0: none) receives the channel
/// sums of dy (the conv's output gradient, 64 channels), `chan_sum_finalize`'s chunks, [`items`]
/// × 64 × 2 floats: only with the window of planes (`reuse`) over 64 channels of dy.
#[derive(Clone, Copy)]
pub(crate) struct GnSums {
    pub x: u64,
    pub mean: u64,
    pub rstd: u64,
    pub gamma: u64,
    pub beta: u64,
    pub off: u64,
    pub groups: usize,
    pub part: u64,
    pub x3: bool,
    pub dys: u64,
}

/// Shared memory of `conv3d_wgmma_dgrad_gnb`'s plane sums (WM_GBSUMS: the producer's four warps,
/// 8 lanes × 8 channels × 3 floats each, and 64 running dy sums each).
const GBSUMS: usize = 4 * 8 * 24 * 4 + 4 * 64 * 4;

/// Whether `conv3d_wgmma_dgrad_gnb` takes the sums of a GroupNorm over `c` channels, `groups`
/// groups, batch `n`: its (mu, sc, sh) table (16 bytes an (n, c)) fits beside the stages.
pub(crate) fn gnb_fits(n: usize, c: usize, groups: usize) -> bool {
    groups > 0 && c.is_multiple_of(groups) && SMEM as usize + n * c * 16 + GBSUMS <= 232_448
}

/// The data gradient as [`run`] computes it (`tw`, overwriting dx, no bias: dy over the volume
/// `yd`, `co` = dx's channels) with the GroupNorm+SiLU backward's channel sums of dx ([`GnSums`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_dgrad_gnb(
    dev: &Device,
    (dyp, wp, dxp): (u64, u64, u64),
    wbf: bool,
    yd: Dims,
    co: usize,
    reuse: bool,
    slot: u8,
    s: GnSums,
) {
    use Arg::{I, P};
    assert!(gnb_fits(yd.n, co, s.groups), "conv3d_wgmma_dgrad_gnb {yd} → {co} groups {}: table does not fit", s.groups);
    assert!(
        s.dys == 0 || (reuse && yd.c == 64),
        "conv3d_wgmma_dgrad_gnb {yd}: dy's sums need the window over 64 channels"
    );
    let packed = pack(dev, wp, wbf, yd.c, co, true, slot);
    let (dc, grid) = super::small::col_items(yd, dev.info.sms as usize, TILE);
    let args = [
        P(dyp),
        P(packed),
        P(dxp),
        I(yd.n as i32),
        I(yd.c as i32),
        I(co as i32),
        I(yd.d as i32),
        I(yd.h as i32),
        I(yd.w as i32),
        I(dc as i32),
        I(reuse as i32),
        P(s.x),
        P(s.mean),
        P(s.rstd),
        P(s.gamma),
        P(s.beta),
        P(s.off),
        I(s.groups as i32),
        P(s.part),
        I(s.x3 as i32),
        P(s.dys),
    ];
    let smem = SMEM + (yd.n * co * 16 + GBSUMS) as u32;
    dev.launch_shared("conv3d_wgmma_dgrad_gnb", (grid as u32, (co / 64) as u32, 1), (256, 1, 1), smem, &args);
}

/// The GroupNorm+SiLU prologue of `conv3d_wgmma_fwd_gn` (device pointers): the statistics
/// mean/rstd [N·G], γ/β [Cin], the input offset [N·Cin] (0: none) and G; and where the input is a
/// concatenation read from its parts, the second part `x2` (0: none) from channel `ca` (a multiple
/// of 64) on, the first being the conv's x.
#[derive(Clone, Copy)]
pub(crate) struct GnPro {
    pub mean: u64,
    pub rstd: u64,
    pub gamma: u64,
    pub beta: u64,
    pub off: u64,
    pub groups: usize,
    pub x2: u64,
    pub ca: usize,
    /// Stage-1 GroupNorm statistics of the output as stored (0: none): (mean, M2, count) per
    /// column item and output channel, [`items`] × Cout × 3 floats.
    pub ys: u64,
}

/// Shared memory of `conv3d_wgmma_fwd_gn`'s output statistics (WM_YSUMS): the four MMA warps'
/// channel sums of a tile.
const YSUMS: u32 = 4 * 8 * 16 * 4;

/// The column items of `conv3d_wgmma_*` over volume `x` (planes d0 .. d1 of a 32 × 8 tile; the
/// chunks of the output statistics, items / N a sample).
pub(crate) fn items(dev: &Device, x: Dims) -> usize {
    let (dc, _) = super::small::col_items(x, dev.info.sms as usize, TILE);
    x.n * x.d.div_ceil(dc) * x.h.div_ceil(TILE.0) * x.w.div_ceil(TILE.1)
}

/// Shared memory of `conv3d_wgmma_fwd_gn`'s (sc, sh) table: 8 bytes an (n, ci).
fn gn_table(x: Dims) -> u32 {
    (x.n * x.c * 8) as u32
}

/// Whether the GroupNorm+SiLU prologue fits beside [`fits`]: its table (N·Cin pairs) within the
/// 227 KB of shared memory a block may have, groups dividing Cin.
pub(crate) fn gn_fits(x: Dims, groups: usize) -> bool {
    groups > 0 && x.c.is_multiple_of(groups) && (SMEM + YSUMS) as usize + x.n * x.c * 8 <= 232_448
}

/// Dynamic shared memory of `conv3d_wgmma_wgrad` (WW_NS · WW_STAGE): three stages of a 32 × 8
/// tile of dy (256 voxel rows of 128 bytes) and x's halo plane (a `STAGE`).
const WGRAD_SMEM: u32 = 3 * (256 * 128 + STAGE);
/// Output tile of `conv3d_wgmma_wgrad_tf32` (WT_TH × WT_TW): f32 operands take twice the bytes.
const TILE_TF32: (usize, usize) = (16, 8);
/// Dynamic shared memory of `conv3d_wgmma_wgrad_tf32` (WT_SMEM): two transposed 16 × 8 dy tiles
/// (32 768 bytes each) and two stages of the dy tile as stored and the 18 × 10 halo plane of x
/// (46 080 bytes).
const WGRAD_TF32_SMEM: u32 = 2 * 32_768 + 2 * (32_768 + 180 * 256);

/// Whether the weight gradient of a conv over `x` with `co` outputs (3×3×3 when `k` is 3, stride
/// `stride`) can run on `conv3d_wgmma_wgrad` (`tf32` false: bf16 operands) or
/// `conv3d_wgmma_wgrad_tf32` (`tf32`: f32 operands rounded to TF32): [`fits`]'s conditions, the
/// operand type aside.
pub(crate) fn wgrad_fits(dev: &Device, x: Dims, (k, stride): (usize, usize), co: usize, layout: Layout) -> bool {
    fits(dev, x, k, stride, co, layout, true)
}

/// dW (f32 at `dwp`, (co, 27, x.c) as NDHWC weights are) += the weight gradient of the conv over
/// the volume `x` (NDHWC at `xp`, its channels the conv's inputs) with `co` outputs, from the
/// output gradient (NDHWC at `dyp`); both bf16 (`tf32` false: `conv3d_wgmma_wgrad`) or both f32
/// (`tf32`: `conv3d_wgmma_wgrad_tf32`, the operands rounded to TF32). The kernel (a block per SM
/// over the (kd, 64-input-channel group, 64-output slice) triples, each summing a run of tiles
/// into f32 registers) writes one partial dW per chunk of tiles into the scratch, then
/// `conv3d_wgmma_wgrad_sum` adds the chunks onto dW in order. [`wgrad_fits`] must hold for
/// (x, (3, 1), co).
pub(crate) fn wgrad(dev: &Device, (xp, dyp, dwp): (u64, u64, u64), x: Dims, co: usize, tf32: bool) {
    use Arg::{I, L, P};
    let ci = x.c;
    let (tile, name, smem) = if tf32 {
        (TILE_TF32, "conv3d_wgmma_wgrad_tf32", WGRAD_TF32_SMEM)
    } else {
        (TILE, "conv3d_wgmma_wgrad", WGRAD_SMEM)
    };
    let tiles = x.n * x.d * x.h.div_ceil(tile.0) * x.w.div_ceil(tile.1);
    let triples = 3 * (ci / 64) * (co / 64);
    // every block gets at least one tile (the kernel's first MMA sets its sums)
    let chunks = (dev.info.sms as usize / triples).clamp(1, tiles);
    let len = co * 27 * ci;
    let part = dev.scratch(chunks * len);
    let pp = dev.ptr(&*part);
    let dims = [x.n, ci, co, x.d, x.h, x.w].map(|v| I(v as i32));
    let args = [P(xp), P(dyp), P(pp), dims[0], dims[1], dims[2], dims[3], dims[4], dims[5]];
    let grid = (chunks as u32, (3 * ci / 64) as u32, (co / 64) as u32);
    dev.launch_shared(name, grid, (384, 1, 1), smem, &args);
    let blocks = (len / 4).div_ceil(256).min(dev.info.sms as usize * 8).max(1);
    let sum_args = [P(pp), P(dwp), L(len as i64), I(chunks as i32)];
    dev.launch("conv3d_wgmma_wgrad_sum", (blocks as u32, 1, 1), (256, 1, 1), &sum_args);
}

/// [`fits`] for the forward of `cs` (its input volume and output channels).
pub(crate) fn fwd_fits(dev: &Device, cs: ConvShape, layout: Layout, bf16: bool) -> bool {
    fits(dev, cs.x, cs.k, cs.stride, cs.cout, layout, bf16)
}
