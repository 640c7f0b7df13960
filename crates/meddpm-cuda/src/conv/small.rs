//! Host side of `kernels/conv3d.cu`: our few-channel direct 3×3×3 stride-1 convs, where cuDNN is
//! slow (a generic 12 TFLOP/s kernel for 3 → 64 in bf16, layout conversions around the last
//! conv): the forward of Cin ≤ 4 (the first conv, 3 → 64), the forward and data gradient of
//! Cout ≤ 4 (the last, 64 → 1 or 4), and the weight gradient of Cout ≤ 4 (always ours,
//! [`small_cout_wgrad`]). f32 FMA sums, operands read in their own types, no conversions; in bf16
//! NDHWC their tensor-core (`mma`) forms. The forward and data gradient are timed against cuDNN
//! on first use of a shape and direction unless `MEDDPM_SMALL_CONV=1` forces ours or `=0` forbids
//! them; on the H200 the timing keeps ours for all three in bf16, and cuDNN for the TF32 forward
//! of 3 → 64 (0.76 vs 1.34 ms). Also the fused output head GN → SiLU → Conv3 ([`gn_head_forward`])
//! and the Cout = 1 forward as a cuBLAS GEMM plus tap sum ([`small_cout_gemm`]).

use meddpm::{Accum, ConvShape, DType, Dims, Layout};

use super::cudnn::{operand, T_P, T_W, T_WF};
use super::desc::check_lens;
use crate::buf::{require_f32, GpuBuf, Mode};
use crate::device::{Arg, Device};

/// Whether the weight gradient goes to our kernel (kernels/conv3d.cu) instead of cuDNN: 3×3×3,
/// stride 1, at most 4 output channels — cuDNN 9.19 runs these on a slow sm80 kernel (13.2 of
/// 185 ms in a whole-head TF32 training step on the H200).
/// In bf16 the kernel exists for Cout 1 and 4 only (kernels/conv3d.cu).
pub(crate) fn small_cout_wgrad(cs: ConvShape, cdt: DType) -> bool {
    cs.k == 3 && cs.stride == 1 && (cs.cout <= 4 && (cdt == DType::F32 || cs.cout == 1 || cs.cout == 4))
}

/// dW += the weight gradient of a few-output-channel conv (kernels/conv3d.cu), fp32 in every
/// precision mode. `(mode, mma)`: the layout and compute type of x and dy, and the tensor-core
/// stage 1 asked for (bf16 precision and `KernelChoices::small_mma`): it runs in NDHWC bf16 where
/// Cout is 1 or 4 and Cin is a multiple of 16.
pub(super) fn wgrad_small(dev: &Device, dw: &mut GpuBuf, xp: u64, dyp: u64, cs: ConvShape, (mode, mma): (Mode, bool)) {
    use Arg::{I, P};
    let (cl, bf) = (mode.cl(), mode.bf_flag());
    let x = cs.x;
    if cl && mma && bf == 1 && (cs.cout == 1 || cs.cout == 4) && x.c.is_multiple_of(16) {
        // 8-channel chunks of x a block (kernels/conv3d.cu wgrad_small_mma's NT), and the
        // channel groups they make (grid.y)
        let (name, nt) = if cs.cout == 1 { ("conv3d_wgrad_small1_mma", 8) } else { ("conv3d_wgrad_small4_mma", 2) };
        let groups = x.c.div_ceil(nt * 8);
        let tiles = x.n * x.d * x.h.div_ceil(8) * x.w.div_ceil(32);
        // persistent blocks, two per SM over all groups; a chunk of partial sums per warp (8 a block)
        let blocks = tiles.min((dev.info.sms as usize * 2).div_ceil(groups)).max(1);
        let nchunks = blocks * 8;
        let part = dev.scratch(nchunks * x.c * cs.cout * 27);
        let pp = dev.ptr(&*part);
        let dims = [x.n, x.c, x.d, x.h, x.w].map(|v| I(v as i32));
        let args = [P(xp), P(dyp), P(pp), dims[0], dims[1], dims[2], dims[3], dims[4]];
        dev.launch(name, (blocks as u32, groups as u32, 1), (256, 1, 1), &args);
        dev.launch(
            "conv3d_wgrad_small_finalize",
            ((cs.cout * 27 * x.c) as u32, 1, 1),
            (256, 1, 1),
            &[P(pp), P(dev.ptr_mut(dw)), I(x.c as i32), I(cs.cout as i32), I(nchunks as i32), I(1)],
        );
        return;
    }
    // channels per block and line slots per block (kernels/conv3d.cu); NDHWC threads take 4 lines each
    let cg = if cl { x.c.min(64) } else { 1 };
    let rows = 256 / cg;
    let lines_per_block = if cl { rows * 4 } else { rows };
    let nchunks = (x.n * x.d * x.h).div_ceil(lines_per_block).max(1);
    let groups = x.c.div_ceil(cg);
    let per = cs.cout * 27;
    let part = dev.scratch(nchunks * x.c * per);
    let pp = dev.ptr(&*part);
    let args = [
        P(xp),
        P(dyp),
        P(pp),
        I(x.n as i32),
        I(x.c as i32),
        I(x.d as i32),
        I(x.h as i32),
        I(x.w as i32),
        I(lines_per_block as i32),
        I(cl as i32),
        I(bf),
    ];
    let name =
        ["conv3d_wgrad_small1", "conv3d_wgrad_small2", "conv3d_wgrad_small3", "conv3d_wgrad_small4"][cs.cout - 1];
    dev.launch(name, (nchunks as u32, groups as u32, 1), (256, 1, 1), &args);
    dev.launch(
        "conv3d_wgrad_small_finalize",
        ((per * x.c) as u32, 1, 1),
        (256, 1, 1),
        &[P(pp), P(dev.ptr_mut(dw)), I(x.c as i32), I(cs.cout as i32), I(nchunks as i32), I(cl as i32)],
    );
}

/// Whether the weight gradient of a few-input-channel conv (the U-Net's first: 3 → 64
/// whole-head, 8 → 64 BraTS) goes to our tensor-core kernel instead of cuDNN (which pads the
/// input to 8 channels and runs an sm80 kernel): 3×3×3, stride 1, Cin ≤ 8, Cout 16, 32 or 64
/// (a power-of-two count of 16-byte chunks a voxel: the kernel's swizzle), bf16 NDHWC with the
/// tensor-core few-channel kernels on (`KernelChoices::small_mma`).
pub(crate) fn small_cin_wgrad(cs: ConvShape, cdt: DType, (layout, mma): (Layout, bool)) -> bool {
    let cl = layout == Layout::Ndhwc;
    cl && mma && cdt == DType::Bf16 && cs.k == 3 && cs.stride == 1 && cs.x.c <= 8 && matches!(cs.cout, 16 | 32 | 64)
}

/// dW += the weight gradient of a few-input-channel conv on the tensor cores
/// (`conv3d_wgrad_small_cin_mma`, then `conv3d_wgrad_small_finalize`; kernels/conv3d.cu).
pub(super) fn wgrad_small_cin(dev: &Device, dw: &mut GpuBuf, xp: u64, dyp: u64, cs: ConvShape) {
    use Arg::{I, P};
    let x = cs.x;
    let tiles = x.n * x.d * x.h.div_ceil(8) * x.w.div_ceil(32);
    // persistent blocks, two per SM (161 registers a thread); warps: 3 tap planes per pair of
    // 16-channel output tiles; a chunk of partial sums per block
    let warps = 3 * cs.cout.div_ceil(32);
    let blocks = tiles.min(dev.info.sms as usize * 2).max(1);
    let part = dev.scratch(blocks * x.c * cs.cout * 27);
    let pp = dev.ptr(&*part);
    let dims = [x.n, x.c, cs.cout, x.d, x.h, x.w].map(|v| I(v as i32));
    let args = [P(xp), P(dyp), P(pp), dims[0], dims[1], dims[2], dims[3], dims[4], dims[5]];
    dev.launch("conv3d_wgrad_small_cin_mma", (blocks as u32, 1, 1), ((32 * warps) as u32, 1, 1), &args);
    dev.launch(
        "conv3d_wgrad_small_finalize",
        ((cs.cout * 27 * x.c) as u32, 1, 1),
        (256, 1, 1),
        &[P(pp), P(dev.ptr_mut(dw)), I(x.c as i32), I(cs.cout as i32), I(blocks as i32), I(1)],
    );
}

// ---- few-channel direct convolutions (kernels/conv3d.cu) ------------------------------------------

/// Voxels per thread, output channels per thread of conv3d_small_cin's body, and input channels
/// per shared-memory chunk of conv3d_fwd_small_cout* (kernels/conv3d.cu SC_V, SC_COT, SC_CC).
const SC_V: usize = 4;
const SC_COT: usize = 8;
const SC_CC: usize = 64;
/// The most channels on the wide side of our few-channel kernels.
const SMALL_MAX_C: usize = 1024;

/// Which of our direct forward kernels applies to a conv.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SmallFwd {
    /// Cin ≤ 4: conv3d_fwd_small_cin (a thread: 4 voxels × 8 output channels).
    Cin,
    /// Cout ≤ 4: conv3d_fwd_small_cout1 (Cout 1) or conv3d_fwd_small_cout4 (Cout 2 to 4).
    Cout,
}

/// The direct forward kernel that can run `cs`, if any: 3×3×3, stride 1, Cin ≤ 4 (then Cout ≤ 1024)
/// or else Cout ≤ 4 (then Cin ≤ 1024).
pub(crate) fn small_fwd_kind(cs: ConvShape) -> Option<SmallFwd> {
    if cs.k != 3 || cs.stride != 1 || cs.x.c == 0 || cs.cout == 0 {
        return None;
    }
    if cs.x.c <= 4 && cs.cout <= SMALL_MAX_C {
        Some(SmallFwd::Cin)
    } else if cs.cout <= 4 && cs.x.c <= SMALL_MAX_C {
        Some(SmallFwd::Cout)
    } else {
        None
    }
}

/// Whether our direct kernel can compute the data gradient of `cs`: 3×3×3, stride 1, Cout ≤ 4,
/// Cin ≤ 1024 (conv3d_dgrad_small_cout: the small-Cin forward body on the transposed, flipped
/// weights).
pub(crate) fn small_dgrad(cs: ConvShape) -> bool {
    cs.k == 3 && cs.stride == 1 && (1..=4).contains(&cs.cout) && (1..=SMALL_MAX_C).contains(&cs.x.c)
}

/// The kernels' per-pointer type mask: bit 0 the input (x or dy), bit 1 the weights, bit 2 the
/// output (y or dx); a bit is set for bf16.
fn small_dt(input: DType, w: DType, out: DType) -> i32 {
    let b = |d: DType| (d == DType::Bf16) as i32;
    b(input) | (b(w) << 1) | (b(out) << 2)
}

/// Voxel groups of a volume (kernels/conv3d.cu `vgroup`): SC_V consecutive voxels of a line.
fn voxel_groups(x: Dims) -> usize {
    x.n * x.d * x.h * x.w.div_ceil(SC_V)
}

/// Grid and block of conv3d_fwd_small_cin / conv3d_dgrad_small_cout for a direct conv with
/// `cout` outputs over volume `x`: one warp per SC_COT output channels (up to 8 warps), grid y
/// over blocks of channels, grid x over 32 voxel groups a block (grid-stride, about 8 blocks per SM).
fn small_cin_launch(x: Dims, cout: usize, sms: u32) -> ((u32, u32, u32), (u32, u32, u32)) {
    let warps = cout.div_ceil(SC_COT).clamp(1, 8);
    let gy = cout.div_ceil(warps * SC_COT).max(1);
    let gx = voxel_groups(x).div_ceil(32).min((sms as usize * 8 / gy).max(1)).max(1);
    ((gx as u32, gy as u32, 1), ((32 * warps) as u32, 1, 1))
}

/// Grid and block of conv3d_fwd_small_cout*: 256 threads; a voxel group is one thread (NCDHW) or
/// SC_CC / VEC lanes (NDHWC, VEC = 8 bf16 / 4 f32 input channels a lane).
fn small_cout_launch(x: Dims, layout: Layout, xdt: DType, sms: u32) -> ((u32, u32, u32), (u32, u32, u32)) {
    let cl = layout == Layout::Ndhwc;
    let vec = if xdt == DType::Bf16 { 8 } else { 4 };
    let per_block = if cl { 256 / (SC_CC / vec) } else { 256 };
    let gx = voxel_groups(x).div_ceil(per_block).min(sms as usize * 8).max(1);
    ((gx as u32, 1, 1), (256, 1, 1))
}

/// Whether the tensor-core kernels (`conv3d_fwd_small_cin_mma`, `conv3d_dgrad_small_cout_mma`)
/// compute a few-channel conv of `ci` ≤ 8 inputs and `co` outputs (the forward's, or the data
/// gradient's with the roles swapped): NDHWC, `co` a multiple of 8 up to 64, asked for (`mma`:
/// bf16 precision and `KernelChoices::small_mma`). Cin 5 to 8 (BraTS' first conv, 8 → 64) has no
/// FMA twin: there the choice is these kernels or cuDNN.
fn mma_fits(layout: Layout, mma: bool, ci: usize, co: usize) -> bool {
    let cl = layout == Layout::Ndhwc;
    cl && mma && (1..=8).contains(&ci) && co.is_multiple_of(8) && co <= 64
}

/// Dynamic shared memory of [`small_mma_run`]'s kernels for `ci` input channels (kernels/conv3d.cu
/// `small_mma_smem`): the bias (64 f32), the staging (8 warps × 16 rows × 36 f32), the ring of
/// four 180-voxel halo planes (4 or 8 bf16 channels a voxel), the B fragments (7 or 14 k steps ×
/// 8 n tiles × 32 lanes × 8 bytes).
fn small_mma_smem(ci: usize) -> u32 {
    let cip: usize = if ci <= 4 { 4 } else { 8 };
    let ksteps = (27 * cip).div_ceil(16);
    (64 * 4 + 8 * 16 * 36 * 4 + 4 * 180 * (cip / 2) * 4 + ksteps * 8 * 32 * 8) as u32
}

/// The few-channel forward that runs `cs` in a backend with NDHWC `cl` and tensor-core kernels
/// `mma`: [`small_fwd_kind`]'s, or the tensor-core Cin kernel for Cin 5 to 8 where it fits.
pub(super) fn small_fwd_kind_in(cs: ConvShape, (layout, mma): (Layout, bool)) -> Option<SmallFwd> {
    small_fwd_kind(cs)
        .or_else(|| (cs.k == 3 && cs.stride == 1 && mma_fits(layout, mma, cs.x.c, cs.cout)).then_some(SmallFwd::Cin))
}

/// `conv3d_fwd_small_cin_mma` (`tw` false) / `conv3d_dgrad_small_cout_mma` (`tw` true): y (= or +=
/// per `acc`) = conv of `ci`-channel x to `co` channels (+ b where `bp` ≠ 0) over volume `x`; the
/// data gradient's w are the weights of the conv with `ci` outputs. Persistent blocks,
/// [`SMALL_MMA_BLOCKS`] per SM, over work items of 8 (h) × 16 (w) voxels × `dc` planes
/// ([`small_mma_items`]).
#[allow(clippy::too_many_arguments)]
fn small_mma_run(
    dev: &Device,
    (xp, wp, bp, yp): (u64, u64, u64, u64),
    x: Dims,
    ci: usize,
    co: usize,
    dt: i32,
    acc: Accum,
    tw: bool,
) {
    use Arg::{I, P};
    let (dc, grid) = small_mma_items(x, dev.info.sms as usize * SMALL_MMA_BLOCKS);
    let args = [
        P(xp),
        P(wp),
        P(bp),
        P(yp),
        I(x.n as i32),
        I(ci as i32),
        I(co as i32),
        I(x.d as i32),
        I(x.h as i32),
        I(x.w as i32),
        I(dc as i32),
        I(dt),
        I((acc == Accum::Add) as i32),
    ];
    let name = if tw { "conv3d_dgrad_small_cout_mma" } else { "conv3d_fwd_small_cin_mma" };
    dev.launch_shared(name, (grid as u32, 1, 1), (256, 1, 1), small_mma_smem(ci), &args);
}

/// Dynamic shared memory of `conv3d_fwd_gn_small_cout` for `co` outputs (kernels/conv3d.cu):
/// silu(GN(x)) of a 192-row halo plane (bf16, rows of 72), the tap products of 180 rows (f32,
/// rows of nk·8 + 4), the weights' B fragments (kg groups × 4 k steps × nk n tiles × 32 lanes × 8
/// bytes), the per-channel (scale, shift); the 27 taps in kg = 1 group for co ≤ 2, else 3, and
/// nk = ⌈taps a group · co / 8⌉.
fn gn_head_smem(co: usize) -> u32 {
    let kg = if co <= 2 { 1 } else { 3 };
    let nk = (27 / kg * co).div_ceil(8);
    (192 * 72 * 2 + 180 * (nk * 8 + 4) * 4 + kg * 4 * nk * 32 * 8 + 64 * 8) as u32
}

/// The output head's GN → SiLU → Conv3 after its statistics (mean/rstd, N·G): `out` =
/// conv3d(silu(GN(inp)), w) + b in one pass over `inp` (`conv3d_fwd_gn_small_cout`; shapes per
/// [`ConvCache::gn_head_fits`]). Work items as [`small_mma_run`]'s, two blocks per SM.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gn_head_forward(
    dev: &Device,
    out: &mut GpuBuf,
    inp: &GpuBuf,
    (mean, rstd): (&GpuBuf, &GpuBuf),
    (gamma, beta): (&GpuBuf, &GpuBuf),
    (w, b): (&GpuBuf, &GpuBuf),
    cs: ConvShape,
    groups: usize,
) {
    use Arg::{I, P};
    check_lens(cs, inp.len(), w.len(), out.len(), b.len());
    require_f32("conv3d bias", &[b]);
    assert!(inp.dtype() == DType::Bf16 && cs.x.c == 64 && (1..=4).contains(&cs.cout), "gn_head_forward {cs:?}");
    let ng = cs.x.n * groups;
    assert!(
        gamma.len() == 64 && beta.len() == 64 && mean.len() == ng && rstd.len() == ng,
        "gn_head_forward {cs:?} groups {groups}: lengths gamma {} beta {} mean {} rstd {}",
        gamma.len(),
        beta.len(),
        mean.len(),
        rstd.len()
    );
    let x = cs.x;
    let (dc, grid) = small_mma_items(x, dev.info.sms as usize * 2);
    let dt = ((w.dtype() == DType::Bf16) as i32) << 1 | ((out.dtype() == DType::Bf16) as i32) << 2;
    let args = [
        P(dev.ptr(inp)),
        P(dev.ptr(mean)),
        P(dev.ptr(rstd)),
        P(dev.ptr(gamma)),
        P(dev.ptr(beta)),
        I(groups as i32),
        P(dev.ptr(w)),
        P(dev.ptr(b)),
        P(dev.ptr_mut(out)),
        I(x.n as i32),
        I(cs.cout as i32),
        I(x.d as i32),
        I(x.h as i32),
        I(x.w as i32),
        I(dc as i32),
        I(dt),
    ];
    dev.launch_shared("conv3d_fwd_gn_small_cout", (grid as u32, 1, 1), (256, 1, 1), gn_head_smem(cs.cout), &args);
}

/// Resident blocks per SM of the two kernels of [`small_mma_run`]: their `__launch_bounds__`.
const SMALL_MMA_BLOCKS: usize = 3;

/// Planes of d a work item of [`small_mma_run`] walks, and its grid (at most `slots` persistent
/// blocks): the item is a column of 8 × 16 voxels cut into chunks of `dc` planes, each chunk
/// loading two halo planes beyond its own. `dc` minimises the planes the busiest block walks,
/// rounds of items × (`dc` + 1), with at least 4 planes (fewer only where D is smaller), so the
/// ring of halo planes is exercised even on the tests' small volumes.
fn small_mma_items(x: Dims, slots: usize) -> (usize, usize) {
    col_items(x, slots, (8, 16))
}

/// [`small_mma_items`] for columns of `th` × `tw` voxels (kernels/conv3d.cu `col_grid`; the
/// warpgroup-MMA conv's are 32 × 8).
pub(crate) fn col_items(x: Dims, slots: usize, (th, tw): (usize, usize)) -> (usize, usize) {
    let cols = x.n * x.h.div_ceil(th) * x.w.div_ceil(tw);
    let items = |dc: usize| cols * x.d.div_ceil(dc);
    let cost = |dc: usize| items(dc).div_ceil(slots.min(items(dc)).max(1)) * (dc + 1);
    let dc = (x.d.min(4)..=x.d).min_by_key(|&dc| (cost(dc), dc)).unwrap_or(1).max(1);
    (dc, items(dc).min(slots).max(1))
}

/// Planes per slab of [`small_cout_gemm`]: its tap products (27·Cout f32 per voxel, two halo
/// planes included) stay within `budget` bytes (`KernelChoices::small_gemm_budget`, 64 MiB), but a
/// slab has at least 8 planes (the halo planes are read twice).
fn gemm_slab(x: Dims, co: usize, budget: usize) -> usize {
    let plane = 27 * co * x.h * x.w * 4;
    (budget / plane).saturating_sub(2).max(8).min(x.d)
}

/// out = conv(inp, w) + b of a Cout ≤ 4, 3×3×3, stride-1 conv in NDHWC as a GEMM and a tap sum
/// (used for Cout = 1, see `KernelChoices::small_gemm`):
/// per slab of planes (one halo plane each side) cuBLAS forms every voxel's 27·Cout tap products
/// P[co·27 + t][u] = Σ_ci w[co, t, ci]·x[u, ci] (f32, in the input's type: bf16 tensor cores, or
/// f32 with TF32 as the precision allows), then `conv3d_small_cout_taps` adds the 27 products that
/// land on each output, plus the bias. Reads x about once (the direct kernel reads each input row
/// 13.5 times through the caches) at the price of P written and read once.
fn small_cout_gemm(dev: &Device, out: &mut GpuBuf, inp: &GpuBuf, w: &GpuBuf, b: &GpuBuf, cs: ConvShape, budget: usize) {
    use Arg::{I, L, P};
    let (x, co) = (cs.x, cs.cout);
    let dt = inp.dtype();
    let (xp, wp) = (dev.ptr(inp), operand(dev, w, dt, T_W));
    let hw = x.h * x.w;
    let pd = gemm_slab(x, co, budget);
    let pp = dev.temp(27 * co * (pd + 2).min(x.d) * hw, DType::F32, T_P);
    let (bp, yp, ybf) = (dev.ptr(b), dev.ptr_mut(out), (out.dtype() == DType::Bf16) as i32);
    for n in 0..x.n {
        let mut d0 = 0;
        while d0 < x.d {
            let d1 = (d0 + pd).min(x.d);
            let (h0, h1) = (d0.saturating_sub(1), (d1 + 1).min(x.d));
            let m = (h1 - h0) * hw;
            let a = xp + ((n * x.s() + h0 * hw) * x.c * dt.bytes()) as u64;
            crate::linear::gemm_ex(dev, (m, 27 * co, x.c), (a, true, x.c), (wp, false, x.c), dt, pp, m, 0.0);
            let vox = (d1 - d0) * hw;
            dev.launch(
                "conv3d_small_cout_taps",
                (vox.div_ceil(256) as u32, 1, 1),
                (256, 1, 1),
                &[
                    P(pp),
                    P(bp),
                    P(yp),
                    I(ybf),
                    I(co as i32),
                    I(x.d as i32),
                    I(x.h as i32),
                    I(x.w as i32),
                    I(n as i32),
                    I(d0 as i32),
                    I(d1 as i32),
                    I(h0 as i32),
                    L(m as i64),
                ],
            );
            d0 = d1;
        }
    }
}

/// out = conv(inp, w) + b through our direct kernel `kind` (the tensor-core one where
/// [`mma_fits`]; for Cout = 1 in NDHWC the GEMM and tap sum of [`small_cout_gemm`] where `gemm`,
/// its slab budget in bytes, is not 0);
/// every operand in its own type.
#[allow(clippy::too_many_arguments)]
pub(super) fn small_forward(
    dev: &Device,
    kind: SmallFwd,
    out: &mut GpuBuf,
    inp: &GpuBuf,
    w: &GpuBuf,
    b: &GpuBuf,
    cs: ConvShape,
    (layout, mma, gemm): (Layout, bool, usize),
) {
    use Arg::{I, P};
    let x = cs.x;
    let cl = layout == Layout::Ndhwc;
    if kind == SmallFwd::Cout && cl && gemm > 0 && cs.cout == 1 {
        small_cout_gemm(dev, out, inp, w, b, cs, gemm);
        return;
    }
    if kind == SmallFwd::Cout && cout_mma_fits(layout, mma, inp.dtype(), x.c, cs.cout) {
        small_cout_mma(dev, out, inp, w, b, cs);
        return;
    }
    let dt = small_dt(inp.dtype(), w.dtype(), out.dtype());
    if kind == SmallFwd::Cin && mma_fits(layout, mma, x.c, cs.cout) {
        let ptrs = (dev.ptr(inp), dev.ptr(w), dev.ptr(b), dev.ptr_mut(out));
        small_mma_run(dev, ptrs, x, x.c, cs.cout, dt, Accum::Overwrite, false);
        return;
    }
    let args = [
        P(dev.ptr(inp)),
        P(dev.ptr(w)),
        P(dev.ptr(b)),
        P(dev.ptr_mut(out)),
        I(x.n as i32),
        I(x.c as i32),
        I(cs.cout as i32),
        I(x.d as i32),
        I(x.h as i32),
        I(x.w as i32),
        I(cl as i32),
        I(dt),
    ];
    let sms = dev.info.sms;
    match kind {
        SmallFwd::Cin => {
            let (grid, block) = small_cin_launch(x, cs.cout, sms);
            dev.launch("conv3d_fwd_small_cin", grid, block, &args);
        }
        SmallFwd::Cout => {
            let (grid, block) = small_cout_launch(x, layout, inp.dtype(), sms);
            let name = if cs.cout == 1 { "conv3d_fwd_small_cout1" } else { "conv3d_fwd_small_cout4" };
            dev.launch(name, grid, block, &args);
        }
    }
}

/// Whether `conv3d_fwd_small_cout_mma` computes a few-output conv's forward: NDHWC, bf16 input,
/// Cin a multiple of 16, Cout ≤ 8, the tensor-core kernels asked for (`mma`).
fn cout_mma_fits(layout: Layout, mma: bool, xdt: DType, ci: usize, co: usize) -> bool {
    let cl = layout == Layout::Ndhwc;
    cl && mma && xdt == DType::Bf16 && ci.is_multiple_of(16) && co <= 8
}

/// out = conv(inp, w) + b of a Cout ≤ 8 conv on the tensor cores (kernels/conv3d.cu
/// `conv3d_fwd_small_cout_mma`, after `conv3d_small_cout_wfrag` arranges the weights as B
/// fragments). Persistent blocks, four per SM, over 1 × 8 × 32-voxel tiles.
fn small_cout_mma(dev: &Device, out: &mut GpuBuf, inp: &GpuBuf, w: &GpuBuf, b: &GpuBuf, cs: ConvShape) {
    use Arg::{I, P};
    let x = cs.x;
    let frags = 27 * (x.c / 16) * 32;
    let wf = dev.temp(2 * frags, DType::F32, T_WF);
    let wbf = (w.dtype() == DType::Bf16) as i32;
    let args = [P(dev.ptr(w)), I(wbf), I(x.c as i32), I(cs.cout as i32), P(wf)];
    dev.launch("conv3d_small_cout_wfrag", (frags.div_ceil(256) as u32, 1, 1), (256, 1, 1), &args);
    let tiles = x.n * x.d * x.h.div_ceil(8) * x.w.div_ceil(32);
    let blocks = tiles.min(dev.info.sms as usize * 4).max(1);
    let ybf = (out.dtype() == DType::Bf16) as i32;
    let dims = [x.n, x.c, cs.cout, x.d, x.h, x.w].map(|v| I(v as i32));
    let args = [
        P(dev.ptr(inp)),
        P(wf),
        P(dev.ptr(b)),
        P(dev.ptr_mut(out)),
        dims[0],
        dims[1],
        dims[2],
        dims[3],
        dims[4],
        dims[5],
        I(ybf),
    ];
    dev.launch("conv3d_fwd_small_cout_mma", (blocks as u32, 1, 1), (256, 1, 1), &args);
}

/// dx (type `dxdt`, = or += per `acc`) = the data gradient of a Cout ≤ 4 conv through our direct
/// kernel (the tensor-core one where [`mma_fits`]), from dy (type `dydt`) and the weights in their
/// own type.
#[allow(clippy::too_many_arguments)]
pub(super) fn small_dgrad_run(
    dev: &Device,
    dxp: u64,
    dxdt: DType,
    acc: Accum,
    w: &GpuBuf,
    dyp: u64,
    dydt: DType,
    cs: ConvShape,
    (layout, mma): (Layout, bool),
) {
    use Arg::{I, P};
    let cl = layout == Layout::Ndhwc;
    let x = cs.x;
    if mma_fits(layout, mma, cs.cout, x.c) {
        let dt = small_dt(dydt, w.dtype(), dxdt);
        small_mma_run(dev, (dyp, dev.ptr(w), 0, dxp), x, cs.cout, x.c, dt, acc, true);
        return;
    }
    let (grid, block) = small_cin_launch(x, x.c, dev.info.sms);
    let args = [
        P(dyp),
        P(dev.ptr(w)),
        P(dxp),
        I(x.n as i32),
        I(cs.cout as i32),
        I(x.c as i32),
        I(x.d as i32),
        I(x.h as i32),
        I(x.w as i32),
        I(cl as i32),
        I(small_dt(dydt, w.dtype(), dxdt)),
        I((acc == Accum::Add) as i32),
    ];
    dev.launch("conv3d_dgrad_small_cout", grid, block, &args);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cs(n: usize, cin: usize, d: usize, h: usize, w: usize, cout: usize, k: usize, stride: usize) -> ConvShape {
        ConvShape::new(Dims::new(n, cin, d, h, w), cout, k, stride)
    }

    #[test]
    fn few_channel_kernels_take_only_their_shapes() {
        // the network's first conv (3 -> 64) and last (64 -> 1 whole-head, 64 -> 4 BraTS)
        assert_eq!(small_fwd_kind(cs(1, 3, 128, 128, 128, 64, 3, 1)), Some(SmallFwd::Cin));
        assert_eq!(small_fwd_kind(cs(1, 64, 128, 128, 128, 1, 3, 1)), Some(SmallFwd::Cout));
        assert_eq!(small_fwd_kind(cs(2, 64, 96, 96, 96, 4, 3, 1)), Some(SmallFwd::Cout));
        assert!(small_dgrad(cs(1, 64, 128, 128, 128, 1, 3, 1)));
        assert!(small_dgrad(cs(2, 70, 7, 9, 6, 4, 3, 1)));
        // few on both sides: the small-Cin kernel
        assert_eq!(small_fwd_kind(cs(1, 4, 5, 5, 5, 4, 3, 1)), Some(SmallFwd::Cin));
        assert_eq!(small_fwd_kind(cs(1, 1, 5, 5, 5, 1024, 3, 1)), Some(SmallFwd::Cin));
        assert_eq!(small_fwd_kind(cs(1, 1024, 5, 5, 5, 3, 3, 1)), Some(SmallFwd::Cout));
        // not theirs: wide on both sides, too wide, stride 2, 1x1x1, empty channels
        assert_eq!(small_fwd_kind(cs(1, 5, 5, 5, 5, 5, 3, 1)), None);
        assert_eq!(small_fwd_kind(cs(1, 64, 12, 12, 12, 64, 3, 1)), None);
        assert_eq!(small_fwd_kind(cs(1, 3, 5, 5, 5, 1025, 3, 1)), None);
        assert_eq!(small_fwd_kind(cs(1, 1025, 5, 5, 5, 1, 3, 1)), None);
        assert_eq!(small_fwd_kind(cs(1, 3, 8, 8, 8, 64, 3, 2)), None);
        assert_eq!(small_fwd_kind(cs(1, 64, 8, 8, 8, 1, 3, 2)), None);
        assert_eq!(small_fwd_kind(cs(1, 3, 8, 8, 8, 64, 1, 1)), None);
        assert_eq!(small_fwd_kind(cs(1, 0, 8, 8, 8, 1, 3, 1)), None);
        // Cin 5 to 8 only on the tensor cores: NDHWC, mma on, Cout a multiple of 8 up to 64
        let brats = cs(1, 8, 144, 192, 192, 64, 3, 1);
        assert_eq!(small_fwd_kind(brats), None);
        assert_eq!(small_fwd_kind_in(brats, (Layout::Ndhwc, true)), Some(SmallFwd::Cin));
        assert_eq!(small_fwd_kind_in(brats, (Layout::Ncdhw, true)), None);
        assert_eq!(small_fwd_kind_in(brats, (Layout::Ndhwc, false)), None);
        assert_eq!(small_fwd_kind_in(cs(1, 5, 5, 5, 5, 24, 3, 1), (Layout::Ndhwc, true)), Some(SmallFwd::Cin));
        assert_eq!(small_fwd_kind_in(cs(1, 8, 5, 5, 5, 20, 3, 1), (Layout::Ndhwc, true)), None);
        assert_eq!(small_fwd_kind_in(cs(1, 8, 5, 5, 5, 72, 3, 1), (Layout::Ndhwc, true)), None);
        assert_eq!(small_fwd_kind_in(cs(1, 9, 5, 5, 5, 64, 3, 1), (Layout::Ndhwc, true)), None);
        assert_eq!(small_fwd_kind_in(cs(1, 8, 8, 8, 8, 64, 3, 2), (Layout::Ndhwc, true)), None);
        // the kernels' shared memory (kernels/conv3d.cu small_mma_smem): 38784 and 58880 bytes
        assert_eq!((small_mma_smem(3), small_mma_smem(8)), (38784, 58880));
        assert!(!small_dgrad(cs(1, 3, 8, 8, 8, 64, 3, 1)), "the first conv's dgrad is cuDNN's");
        assert!(!small_dgrad(cs(1, 64, 8, 8, 8, 5, 3, 1)));
        assert!(!small_dgrad(cs(1, 64, 8, 8, 8, 1, 3, 2)));
        assert!(!small_dgrad(cs(1, 1025, 8, 8, 8, 1, 3, 1)));
    }

    #[test]
    fn small_mma_items_cover_the_volume_in_chunks_of_four_planes_or_more() {
        // 128³ on 132 SMs × 3: one item of 43 planes a block (384 blocks); BraTS: three rounds of
        // 36 planes; every chunking covers D, and small volumes get ragged chunks of 4 (the tests')
        assert_eq!(small_mma_items(Dims::new(1, 2, 128, 128, 128), 396), (43, 384));
        assert_eq!(small_mma_items(Dims::new(1, 4, 144, 192, 192), 396), (36, 396));
        assert_eq!(small_mma_items(Dims::new(2, 3, 5, 9, 35), 396), (4, 24));
        assert_eq!(small_mma_items(Dims::new(1, 1, 3, 9, 35), 396), (3, 6));
        for (d, slots) in [(1, 1), (7, 2), (9, 396), (128, 396), (200, 17)] {
            let x = Dims::new(2, 1, d, 17, 33);
            let (dc, grid) = small_mma_items(x, slots);
            assert!(dc >= d.min(4) && dc <= d && grid >= 1 && grid <= slots, "D {d}: {dc} planes, {grid} blocks");
        }
    }

    #[test]
    fn wgmma_work_items_are_columns_of_32_by_8() {
        // conv3d_wgmma's tiles (32 h × 8 w): 128³ has 4 × 16 columns; one item of 64 planes a
        // block fills 128 of 132 SMs in one round; BraTS (144 × 192 × 192: 6 × 24 columns) in
        // ten rounds of 16 planes on all 132; odd sizes round their columns up
        assert_eq!(col_items(Dims::new(1, 64, 128, 128, 128), 132, (32, 8)), (64, 128));
        assert_eq!(col_items(Dims::new(1, 64, 144, 192, 192), 132, (32, 8)), (16, 132));
        let x = Dims::new(2, 64, 5, 35, 9);
        let (dc, grid) = col_items(x, 132, (32, 8));
        assert_eq!((dc, grid), (4, 2 * 2 * 2 * 2));
    }

    #[test]
    fn type_mask_has_one_bit_per_pointer() {
        use DType::{Bf16, F32};
        assert_eq!(small_dt(F32, F32, F32), 0);
        assert_eq!(small_dt(Bf16, F32, F32), 1);
        assert_eq!(small_dt(F32, Bf16, F32), 2);
        assert_eq!(small_dt(F32, F32, Bf16), 4);
        assert_eq!(small_dt(F32, Bf16, Bf16), 6);
        assert_eq!(small_dt(Bf16, Bf16, Bf16), 7);
    }

    #[test]
    fn few_channel_launches_cover_every_channel_and_voxel_group() {
        let sms = 132;
        for (x, cout) in [
            (Dims::new(1, 3, 128, 128, 128), 64),
            (Dims::new(1, 3, 9, 10, 11), 40),
            (Dims::new(2, 1, 3, 4, 8), 5),
            (Dims::new(1, 2, 3, 3, 4), 130),
            (Dims::new(1, 4, 2, 2, 1), 1024),
        ] {
            let ((gx, gy, gz), (bx, by, bz)) = small_cin_launch(x, cout, sms);
            let warps = bx as usize / 32;
            assert!(bx % 32 == 0 && (1..=8).contains(&warps) && (by, bz, gz) == (1, 1, 1), "{x} -> {cout}");
            // the block's channels: warps * SC_COT; the y blocks cover all output channels, none idle
            let per = warps * SC_COT;
            assert!(gy as usize * per >= cout && (gy as usize - 1) * per < cout, "{x} -> {cout}: {gy} x {per}");
            assert!(per <= 64, "the kernel's shared weights hold 64 output channels");
            // grid x: at least one block, none without a voxel group (the kernel strides over the rest)
            let groups = voxel_groups(x);
            assert!(gx >= 1 && (gx as usize - 1) * 32 < groups, "{x}: {gx} blocks for {groups} groups");
            assert!(gx as usize * gy as usize <= (sms as usize * 8).max(gy as usize), "{x}: grid {gx} x {gy}");
        }
        assert_eq!(voxel_groups(Dims::new(2, 3, 5, 6, 7)), 2 * 5 * 6 * 2);
        assert_eq!(voxel_groups(Dims::new(1, 3, 128, 128, 128)), 128 * 128 * 32);
        for (x, cl, dt, per_block) in [
            (Dims::new(1, 64, 128, 128, 128), Layout::Ndhwc, DType::Bf16, 32),
            (Dims::new(1, 64, 128, 128, 128), Layout::Ndhwc, DType::F32, 16),
            (Dims::new(1, 64, 128, 128, 128), Layout::Ncdhw, DType::Bf16, 256),
            (Dims::new(2, 70, 7, 9, 6), Layout::Ndhwc, DType::Bf16, 32),
            (Dims::new(1, 5, 1, 1, 1), Layout::Ncdhw, DType::F32, 256),
        ] {
            let ((gx, gy, _), (bx, _, _)) = small_cout_launch(x, cl, dt, sms);
            assert_eq!((gy, bx), (1, 256));
            let groups = voxel_groups(x);
            assert!(gx >= 1 && (gx as usize - 1) * per_block < groups && gx <= sms * 8, "{x} {cl:?} {dt:?}: {gx}");
            if groups <= per_block * sms as usize * 8 {
                assert!(gx as usize * per_block >= groups, "{x}: one pass covers all groups");
            }
        }
    }
}
