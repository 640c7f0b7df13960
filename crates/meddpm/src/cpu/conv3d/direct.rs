//! Direct 3×3×3 stride-1 convolution — forward, data gradient and filter gradient — for the small
//! channel counts of demo-sized models, where im2col + GEMM spends most of its time writing and
//! reading a column matrix 27·Cin rows tall for a product only Cout rows high.
//!
//! The input (for the data gradient: dout) is first copied into a zero-padded buffer laid out by
//! [`Padded`]: every channel gets a one-voxel halo in D, H and W (rows of W + 2 voxels), and the
//! buffer ends in [`SLACK`] zeros, so every kernel tap reads in bounds.
//!
//! Within one depth plane, output voxel (h, w) and its input window are addressed by the flat
//! index q = h·row + w of the padded plane: tap (kd, kh, kw) of output voxel q reads padded input
//! element (d + kd)·plane + kh·row + kw + q. A plane is one run of q = 0 .. (H − 1)·row + W, cut
//! into tiles of V consecutive q; the two halo columns between rows ride along in the tiles (their
//! lanes are computed and dropped, or multiply zeros), so every load is one contiguous vector and
//! no tile is wasted on rounding W up — the small planes of a U-Net's deep levels (W = 8, 4) cost
//! 25 % or 50 % extra lanes instead of 2× or 4×.
//!
//! - Forward: one task per (block of CB output channels, output depth plane); per tile, CB × V
//!   accumulators stay in registers while
//!   `acc[c][l] += w[co0 + c, ci, kd, kh, kw] · xp[ci, (d + kd)·plane + kh·row + kw + q0 + l]`
//!   runs over ci and the 27 taps; then the lanes of real voxels are stored (+ bias, or added).
//! - Data gradient: the same correlation, of padded dout with the kernel flipped in D, H, W and
//!   with its two channel axes swapped: `dx[ci] = Σ_co Σ_t w[co, ci, 26 − t] · doutp[co, · + t]`.
//! - Filter gradient, Cout ≥ 8: dout transposed so the 8 channels of a voxel are one vector
//!   (`gt[block][d][q][c]`); one task per (block of 8 output channels, group of 7 taps (ci, t)),
//!   `acc[k][c] += gt[d][q][c] · xp[off_k + d·plane + q]` over every voxel: 7 FMAs of a dout
//!   vector with a broadcast input value per voxel, no horizontal sums, no tile rounding.
//!   Cout < 8 (the one-channel output conv): one task per (ci, kd, kh); `dW[co, ci, kd, kh, kw] =
//!   Σ_{d,q} doutp[co, d, q] · xp[ci, (d + kd)·plane + kh·row + kw + q]` with CB × 3 (kw) × V
//!   accumulators along the voxels, plane by plane; the padded dout is zero in the halo columns,
//!   so the lanes there add nothing.
//!
//! The tap offsets are made opaque to the optimiser (`tap_offsets`), and accumulators are only
//! ever indexed by constants, so LLVM keeps them in registers and emits one plain load per tap.
//! Forward tile sizes are const parameters chosen per channel count (4 channels × 24 voxels for
//! the usual multiples of 4; 1 × 64 for the one-channel output conv, …): 12 AVX2 accumulators
//! for f32.
//! The loops are plain generic Rust over [`Float`] (the f64 gradient checks run this very code).
//! Each task body runs under `pulp`'s runtime CPU dispatch, which compiles it a second time with
//! AVX2 + FMA enabled; LLVM vectorises the fixed-size tile loops and `mul_add` becomes one FMA.

use rayon::prelude::*;

use crate::cpu::float::{vectorized, Float};
use crate::shape::Dims;

/// Largest output-channel block of the forward and data-gradient kernels.
pub const CB: usize = 4;
/// Zeros after the last channel of a padded buffer: a tile's loads may run up to this far past
/// the last real voxel (at least the largest tile length).
pub const SLACK: usize = 64;

/// Output channels per register block for `kout` channels (the padded channel count is a
/// multiple of it).
///
/// Written as a clamp on purpose: rustc 1.95.0 (LLVM) compiled the equivalent
/// `if kout < CB { kout.max(1) } else { CB }` to plain `kout.max(1)` in some inlining contexts,
/// so the forward picked a block the weight arrangement did not use (`block_is_a_clamp` pins it).
pub fn block(kout: usize) -> usize {
    kout.clamp(1, CB)
}

/// Geometry of a zero-padded copy of one batch element's activation (C × D × H × W): channel
/// ci, voxel (d, h, w) lives at `ci·chan + (d + 1)·plane + (h + 1)·row + w + 1`.
#[derive(Clone, Copy, Debug)]
pub struct Padded {
    /// Channels allocated (the real ones, then zero channels up to a block multiple if asked).
    pub c: usize,
    pub d: usize,
    pub h: usize,
    pub w: usize,
    /// Row length: W plus the two halo voxels.
    pub row: usize,
    pub plane: usize,
    pub chan: usize,
}

impl Padded {
    /// `x`'s spatial size with `c` channels allocated.
    pub fn new(x: Dims, c: usize) -> Self {
        let row = x.w + 2;
        let plane = (x.h + 2) * row;
        Padded { c, d: x.d, h: x.h, w: x.w, row, plane, chan: (x.d + 2) * plane }
    }
    /// Elements of the buffer: the channels, then [`SLACK`] zeros.
    pub fn len(&self) -> usize {
        self.c * self.chan + SLACK
    }
    pub fn is_empty(&self) -> bool {
        self.c * self.chan == 0
    }
    /// Flat positions q of one plane's run: (H − 1)·row + W (0 for an empty plane).
    fn run(&self) -> usize {
        if self.h == 0 || self.w == 0 {
            0
        } else {
            (self.h - 1) * self.row + self.w
        }
    }
}

/// Copy `src` (C × D × H × W, C ≤ p.c) into `dst` (p.len()), zeros everywhere else.
pub fn pad<T: Float>(dst: &mut [T], src: &[T], p: &Padded) {
    let (s, hw) = (p.d * p.h * p.w, p.h * p.w);
    assert_eq!(dst.len(), p.len(), "direct conv: padded buffer length");
    assert!(src.len().is_multiple_of(s.max(1)) && src.len() / s.max(1) <= p.c, "direct conv: source length");
    let (chans, slack) = dst.split_at_mut(p.c * p.chan);
    slack.fill(T::zero());
    if p.chan == 0 {
        return;
    }
    chans.par_chunks_mut(p.chan).enumerate().for_each(|(c, dc)| {
        let Some(sc) = src.get(c * s..(c + 1) * s) else {
            dc.fill(T::zero());
            return;
        };
        // Halo planes whole; inside, the halo rows and the two halo voxels around each row.
        dc[..p.plane].fill(T::zero());
        dc[(p.d + 1) * p.plane..].fill(T::zero());
        for d in 0..p.d {
            let pl = &mut dc[(d + 1) * p.plane..(d + 2) * p.plane];
            pl[..p.row].fill(T::zero());
            pl[(p.h + 1) * p.row..].fill(T::zero());
            for h in 0..p.h {
                let r = &mut pl[(h + 1) * p.row..(h + 2) * p.row];
                r[0] = T::zero();
                r[p.w + 1] = T::zero();
                r[1..=p.w].copy_from_slice(&sc[d * hw + h * p.w..][..p.w]);
            }
        }
    });
}

/// Rearrange PyTorch weights (Cout, Cin, 3, 3, 3) for the correlation kernel as
/// `[kin][tap][kout]`, kout padded with zeros to a multiple of [`block`]`(kout)`. Forward: kin = ci,
/// kout = co. `for_data_grad`: kin = co, kout = ci and tap t reads w[.., 26 − t] (the flipped
/// kernel).
pub fn arrange_weights<T: Float>(w: &[T], cout: usize, cin: usize, for_data_grad: bool) -> Vec<T> {
    assert_eq!(w.len(), cout * cin * 27, "direct conv: weight length");
    let (kin, kout) = if for_data_grad { (cout, cin) } else { (cin, cout) };
    let koutp = kout.div_ceil(block(kout)) * block(kout);
    let mut wt = vec![T::zero(); kin * 27 * koutp];
    for co in 0..cout {
        for ci in 0..cin {
            for t in 0..27 {
                let v = w[(co * cin + ci) * 27 + t];
                let (i, tap, o) = if for_data_grad { (co, 26 - t, ci) } else { (ci, t, co) };
                wt[(i * 27 + tap) * koutp + o] = v;
            }
        }
    }
    wt
}

/// How the forward kernel starts each output value.
#[derive(Clone, Copy)]
pub enum Init<'a, T> {
    /// out = bias[c] + Σ …
    Bias(&'a [T]),
    /// out = Σ …
    Zero,
    /// out += Σ … (an `Accum::Add` input gradient or forward)
    Add,
    /// out += bias[c] + Σ … (an `Accum::Add` forward with a bias)
    AddBias(&'a [T]),
}

/// out (kout × D × H × W of one batch element) per `init` from the padded input `xp` (geometry
/// `p`, kin ≤ p.c channels used) and arranged weights `wt` (see [`arrange_weights`]).
pub fn correlate<T: Float>(out: &mut [T], kout: usize, xp: &[T], p: &Padded, kin: usize, wt: &[T], init: Init<'_, T>) {
    match block(kout) {
        1 => correlate_with::<T, 1, 64>(out, kout, xp, p, kin, wt, init),
        2 => correlate_with::<T, 2, 48>(out, kout, xp, p, kin, wt, init),
        3 => correlate_with::<T, 3, 32>(out, kout, xp, p, kin, wt, init),
        _ => correlate_with::<T, CB, 24>(out, kout, xp, p, kin, wt, init),
    }
}

/// [`correlate`] with blocks of `B` output channels and tiles of `V` flat positions.
fn correlate_with<T: Float, const B: usize, const V: usize>(
    out: &mut [T],
    kout: usize,
    xp: &[T],
    p: &Padded,
    kin: usize,
    wt: &[T],
    init: Init<'_, T>,
) {
    let (s, hw) = (p.d * p.h * p.w, p.h * p.w);
    let koutp = kout.div_ceil(B) * B;
    assert!(V <= SLACK, "direct conv: tile longer than the slack");
    assert_eq!(out.len(), kout * s, "direct conv: output length");
    assert!(kin <= p.c && xp.len() == p.len(), "direct conv: padded input");
    assert_eq!(wt.len(), kin * 27 * koutp, "direct conv: arranged weights");
    if let Init::Bias(b) | Init::AddBias(b) = init {
        assert_eq!(b.len(), kout, "direct conv: bias length");
    }
    if s == 0 {
        return;
    }
    // One task per (channel block, depth plane): the block's planes at that depth.
    let mut tasks: Vec<(usize, usize, Vec<&mut [T]>)> = Vec::with_capacity(koutp / B * p.d);
    for (blk, chans) in out.chunks_mut(B * s).enumerate() {
        let mut by_depth: Vec<Vec<&mut [T]>> = (0..p.d).map(|_| Vec::with_capacity(B)).collect();
        for chan in chans.chunks_mut(s) {
            for (d, plane) in chan.chunks_mut(hw).enumerate() {
                by_depth[d].push(plane);
            }
        }
        tasks.extend(by_depth.into_iter().enumerate().map(|(d, planes)| (blk * B, d, planes)));
    }
    tasks.into_par_iter().for_each(|(co0, d, mut planes)| {
        vectorized(
            #[inline(always)]
            || correlate_plane::<T, B, V>(&mut planes, co0, d, xp, p, kin, koutp, wt, init),
        )
    });
}

/// The 27 tap offsets kd·plane + kh·row + kw of geometry `p`, made opaque to the optimiser
/// (`black_box`): LLVM then emits one plain vector load per tap instead of rebuilding the
/// overlapping loads of neighbouring kw from fewer loads with shuffles, which costs more than it
/// saves and wrecks the register allocation of the accumulators.
fn tap_offsets(p: &Padded) -> [usize; 27] {
    std::hint::black_box(std::array::from_fn(|t| (t / 9) * p.plane + (t / 3 % 3) * p.row + t % 3))
}

/// One output depth plane `d` of channels co0 .. co0 + planes.len().
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn correlate_plane<T: Float, const B: usize, const V: usize>(
    planes: &mut [&mut [T]],
    co0: usize,
    d: usize,
    xp: &[T],
    p: &Padded,
    kin: usize,
    koutp: usize,
    wt: &[T],
    init: Init<'_, T>,
) {
    let run = p.run();
    let offs = tap_offsets(p);
    // Reach of one tile's loads past its first voxel.
    let reach = 2 * p.plane + 2 * p.row + 2 + V;
    let mut tile = [[T::zero(); V]; B];
    for q0 in (0..run).step_by(V) {
        // The accumulators are only ever indexed by constants (so they live in registers);
        // `tile` takes them for the stores below, which index by runtime offsets.
        let mut acc = [[T::zero(); V]; B];
        for ci in 0..kin {
            let xc = &xp[ci * p.chan + d * p.plane + q0..][..reach];
            let wc = &wt[ci * 27 * koutp + co0..][..26 * koutp + B];
            for (t, &off) in offs.iter().enumerate() {
                let x: &[T; V] = xc[off..off + V].try_into().expect("V voxels");
                let wv: &[T; B] = wc[t * koutp..t * koutp + B].try_into().expect("B weights");
                fma_tile(&mut acc, wv, x);
            }
        }
        copy_tile(&mut tile, &acc);
        // Store the lanes of real voxels: row segments of the tile, skipping halo columns.
        let end = (q0 + V).min(run);
        let (mut h, mut w) = (q0 / p.row, q0 % p.row);
        let mut q = q0;
        while q < end {
            if w >= p.w {
                q += p.row - w;
                (h, w) = (h + 1, 0);
                continue;
            }
            let n = (p.w - w).min(end - q);
            let at = h * p.w + w;
            for (c, plane) in planes.iter_mut().enumerate() {
                let (dst, src) = (&mut plane[at..at + n], &tile[c][q - q0..q - q0 + n]);
                match init {
                    Init::Bias(b) => dst.iter_mut().zip(src).for_each(|(o, &a)| *o = b[co0 + c] + a),
                    Init::Zero => dst.copy_from_slice(src),
                    Init::Add => dst.iter_mut().zip(src).for_each(|(o, &a)| *o += a),
                    Init::AddBias(b) => dst.iter_mut().zip(src).for_each(|(o, &a)| *o += b[co0 + c] + a),
                }
            }
            (q, w) = (q + n, w + n);
        }
    }
}

/// dst = src, element by element with constant indices (keeps `src` promotable to registers).
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn copy_tile<T: Float, const B: usize, const V: usize>(dst: &mut [[T; V]; B], src: &[[T; V]; B]) {
    for c in 0..B {
        for l in 0..V {
            dst[c][l] = src[c][l];
        }
    }
}

/// acc[c][l] += wv[c] · x[l]. (Index loops over fixed-size arrays, no bounds checks inside: the
/// form LLVM reliably turns into B × V/8 vector FMAs with the accumulators in registers.)
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn fma_tile<T: Float, const B: usize, const V: usize>(acc: &mut [[T; V]; B], wv: &[T; B], x: &[T; V]) {
    for c in 0..B {
        for l in 0..V {
            acc[c][l] = wv[c].mul_add(x[l], acc[c][l]);
        }
    }
}

/// acc[c][kw][l] += g[c][l] · x[kw][l] (same form as [`fma_tile`]).
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn fma_outer<T: Float, const B: usize, const V: usize>(acc: &mut [[[T; V]; 3]; B], g: &[&[T; V]; B], x: &[&[T; V]; 3]) {
    for c in 0..B {
        for kw in 0..3 {
            for l in 0..V {
                acc[c][kw][l] = g[c][l].mul_add(x[kw][l], acc[c][kw][l]);
            }
        }
    }
}

/// Output channels per block of the wide filter gradient ([`filter_grad`] for Cout ≥ GB): one
/// f32 AVX2 vector.
pub const GB: usize = 8;

/// Channels the padded dout of [`filter_grad`] needs for `cout` output channels (a multiple of
/// its block).
pub fn grad_channels(cout: usize) -> usize {
    let b = if cout >= GB { GB } else { block(cout) };
    cout.div_ceil(b) * b
}

/// Length of the transposed-dout scratch [`filter_grad`] needs (0 for Cout < GB).
pub fn transposed_len(pg: &Padded, cout: usize) -> usize {
    if cout >= GB {
        cout.div_ceil(GB) * GB * pg.d * pg.run()
    } else {
        0
    }
}

/// dw (Cout × Cin × 27) += the filter gradient of one batch element, from padded dout `gp`
/// (geometry `pg`, [`grad_channels`] channels) and padded input `xp` (geometry `px`); `gt` is
/// scratch of [`transposed_len`] elements.
///
/// Cout ≥ GB: dout is first transposed to `gt[block][d][q][c]` (GB channels of one voxel
/// adjacent; q over the plane's run, halo columns zero), then one task per (block, ci, kd) keeps
/// 9 vectors `acc[kh·3 + kw][c]` and, for every voxel, adds dout's GB-channel vector times the
/// 9 input values of its window row (broadcast): 9 FMAs per voxel, no horizontal sums, no tile
/// rounding. Smaller Cout (the one-channel output conv): [`filter_grad_with`], vectors along the
/// voxels.
#[allow(clippy::too_many_arguments)]
pub fn filter_grad<T: Float>(
    dw: &mut [T],
    cout: usize,
    gp: &[T],
    pg: &Padded,
    xp: &[T],
    px: &Padded,
    cin: usize,
    gt: &mut [T],
) {
    assert!(pg.c >= cout && pg.c == grad_channels(cout) && gp.len() == pg.len(), "direct conv: padded dout");
    assert_eq!(gt.len(), transposed_len(pg, cout), "direct conv: transposed dout scratch");
    match block(cout) {
        _ if cout >= GB => filter_grad_wide(dw, cout, gp, pg, xp, px, cin, gt),
        1 => filter_grad_with::<T, 1, 32>(dw, cout, gp, pg, xp, px, cin),
        2 => filter_grad_with::<T, 2, 16>(dw, cout, gp, pg, xp, px, cin),
        3 => filter_grad_with::<T, 3, 8>(dw, cout, gp, pg, xp, px, cin),
        _ => filter_grad_with::<T, CB, 8>(dw, cout, gp, pg, xp, px, cin),
    }
}

#[allow(clippy::too_many_arguments)]
fn filter_grad_wide<T: Float>(
    dw: &mut [T],
    cout: usize,
    gp: &[T],
    pg: &Padded,
    xp: &[T],
    px: &Padded,
    cin: usize,
    gt: &mut [T],
) {
    assert!(px.c >= cin && xp.len() == px.len(), "direct conv: padded input");
    assert!((pg.d, pg.h, pg.w, pg.row) == (px.d, px.h, px.w, px.row), "direct conv: dout vs input geometry");
    assert_eq!(dw.len(), cout * cin * 27, "direct conv: dw length");
    let (run, blocks) = (pg.run(), cout.div_ceil(GB));
    if run == 0 || pg.d == 0 {
        return;
    }
    // gt[b][d][q][c] = doutp[b·GB + c, d, q] (the padded dout from its first real voxel).
    gt.par_chunks_mut(run * GB).enumerate().for_each(|(bd, dst)| {
        let (b, d) = (bd / pg.d, bd % pg.d);
        for c in 0..GB {
            let src = &gp[(b * GB + c) * pg.chan + (d + 1) * pg.plane + pg.row + 1..][..run];
            for (q, &v) in src.iter().enumerate() {
                dst[q * GB + c] = v;
            }
        }
    });
    let gt = &*gt;
    let slab = pg.d * run * GB;
    // Taps n = ci·27 + t in groups of GT; a short last group repeats its last tap (ignored).
    let offs = tap_offsets(px);
    let taps = cin * 27;
    let groups = taps.div_ceil(GT);
    let parts: Vec<[[T; GB]; GT]> = (0..blocks * groups)
        .into_par_iter()
        .map(|task| {
            let (b, n0) = (task / groups, task % groups * GT);
            let off: [usize; GT] = std::array::from_fn(|k| {
                let n = (n0 + k).min(taps - 1);
                (n / 27) * px.chan + offs[n % 27]
            });
            let g = &gt[b * slab..(b + 1) * slab];
            vectorized(
                #[inline(always)]
                || filter_grad_wide_task(g, xp, px, run, std::hint::black_box(off)),
            )
        })
        .collect();
    for (task, acc) in parts.iter().enumerate() {
        let (b, n0) = (task / groups, task % groups * GT);
        for (k, a) in acc.iter().enumerate().take(taps - n0) {
            let (ci, t) = ((n0 + k) / 27, (n0 + k) % 27);
            for (c, &v) in a.iter().enumerate().take(cout - b * GB) {
                dw[((b * GB + c) * cin + ci) * 27 + t] += v;
            }
        }
    }
}

/// Taps per task of the wide filter gradient: GT accumulators + GT broadcasts + one dout vector
/// fit the 16 AVX2 registers.
const GT: usize = 7;

/// acc[k][c] += gd[q][c] · rows[k][q].
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn wide_step<T: Float>(acc: &mut [[T; GB]; GT], gd: &[T], rows: &[&[T]; GT], q: usize) {
    let gv: &[T; GB] = gd[q * GB..q * GB + GB].try_into().expect("GB channels");
    for k in 0..GT {
        let xv = rows[k][q];
        for c in 0..GB {
            acc[k][c] = gv[c].mul_add(xv, acc[k][c]);
        }
    }
}

/// acc[k][c] = Σ_{d,q} gt[d][q][c] · xp[off[k] + d·plane + q]; the sums run per plane, then add
/// into the total (shorter f32 chains).
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn filter_grad_wide_task<T: Float>(g: &[T], xp: &[T], p: &Padded, run: usize, off: [usize; GT]) -> [[T; GB]; GT] {
    let mut total = [[T::zero(); GB]; GT];
    for d in 0..p.d {
        let gd = &g[d * run * GB..(d + 1) * run * GB];
        let rows: [&[T]; GT] = std::array::from_fn(|k| &xp[off[k] + d * p.plane..][..run]);
        let mut acc = [[T::zero(); GB]; GT];
        // Two voxels per iteration (the odd last one alone): the accumulators' register copies
        // that LLVM adds at the loop's back edge then cost half as much.
        for q in (0..run - run % 2).step_by(2) {
            wide_step(&mut acc, gd, &rows, q);
            wide_step(&mut acc, gd, &rows, q + 1);
        }
        if run % 2 == 1 {
            wide_step(&mut acc, gd, &rows, run - 1);
        }
        for k in 0..GT {
            for c in 0..GB {
                total[k][c] += acc[k][c];
            }
        }
    }
    total
}

fn filter_grad_with<T: Float, const B: usize, const V: usize>(
    dw: &mut [T],
    cout: usize,
    gp: &[T],
    pg: &Padded,
    xp: &[T],
    px: &Padded,
    cin: usize,
) {
    assert!(pg.c >= cout && pg.c.is_multiple_of(B) && gp.len() == pg.len(), "direct conv: padded dout");
    assert!(px.c >= cin && xp.len() == px.len(), "direct conv: padded input");
    assert!((pg.d, pg.h, pg.w, pg.row) == (px.d, px.h, px.w, px.row), "direct conv: dout vs input geometry");
    assert!(V <= SLACK, "direct conv: tile longer than the slack");
    assert_eq!(dw.len(), cout * cin * 27, "direct conv: dw length");
    // One task per (ci, kd, kh): its 3·Cout weights, added into dw afterwards.
    let parts: Vec<(usize, usize, Vec<T>)> = (0..cin * 9)
        .into_par_iter()
        .map(|task| {
            let (ci, k) = (task / 9, task % 9);
            let mut part = vec![T::zero(); pg.c * 3];
            vectorized(
                #[inline(always)]
                || filter_grad_task::<T, B, V>(&mut part, gp, pg, &xp[ci * px.chan..], k / 3, k % 3),
            );
            (ci, k, part)
        })
        .collect();
    for (ci, k, part) in parts {
        for co in 0..cout {
            for kw in 0..3 {
                dw[(co * cin + ci) * 27 + k * 3 + kw] += part[co * 3 + kw];
            }
        }
    }
}

/// part[co·3 + kw] = Σ_{d,q} doutp[co, d, q] · xc[(d + kd)·plane + kh·row + kw + q] for every co.
#[inline(always)]
fn filter_grad_task<T: Float, const B: usize, const V: usize>(
    part: &mut [T],
    gp: &[T],
    p: &Padded,
    xc: &[T],
    kd: usize,
    kh: usize,
) {
    let (run, blocks) = (p.run(), p.c / B);
    let full = run / V * V;
    let offs = tap_offsets(p);
    let offs: [usize; 3] = std::array::from_fn(|kw| offs[(kd * 3 + kh) * 3 + kw]);
    // Vector partial sums per block, kept across planes.
    let mut accs = vec![[[[T::zero(); V]; 3]; B]; blocks];
    let mut tail = [[T::zero(); V]; B];
    for d in 0..p.d {
        let xd = &xc[d * p.plane..][..offs[2] + run.div_ceil(V) * V];
        for (blk, acc) in accs.iter_mut().enumerate() {
            let mut a = [[[T::zero(); V]; 3]; B];
            copy_acc(&mut a, acc);
            // dout plane d of channel blk·B + c, from its first real voxel (h = 0, w = 0).
            let gd: [&[T]; B] =
                std::array::from_fn(|c| &gp[(blk * B + c) * p.chan + (d + 1) * p.plane + p.row + 1..][..run]);
            for q0 in (0..full).step_by(V) {
                let x: [&[T; V]; 3] =
                    std::array::from_fn(|k| xd[offs[k] + q0..offs[k] + q0 + V].try_into().expect("V voxels"));
                let g: [&[T; V]; B] = std::array::from_fn(|c| gd[c][q0..q0 + V].try_into().expect("V voxels"));
                fma_outer(&mut a, &g, &x);
            }
            if full < run {
                // The last, partial tile: dout lanes past the run read as zeros.
                for (t, g) in tail.iter_mut().zip(&gd) {
                    t.fill(T::zero());
                    t[..run - full].copy_from_slice(&g[full..]);
                }
                let x: [&[T; V]; 3] =
                    std::array::from_fn(|k| xd[offs[k] + full..offs[k] + full + V].try_into().expect("V voxels"));
                let g: [&[T; V]; B] = std::array::from_fn(|c| &tail[c]);
                fma_outer(&mut a, &g, &x);
            }
            copy_acc(acc, &a);
        }
    }
    for (blk, acc) in accs.iter().enumerate() {
        for (c, ac) in acc.iter().enumerate() {
            for (kw, a) in ac.iter().enumerate() {
                part[(blk * B + c) * 3 + kw] = a.iter().copied().sum();
            }
        }
    }
}

/// dst = src with constant indices (see [`copy_tile`]).
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn copy_acc<T: Float, const B: usize, const V: usize>(dst: &mut [[[T; V]; 3]; B], src: &[[[T; V]; 3]; B]) {
    for c in 0..B {
        for k in 0..3 {
            for l in 0..V {
                dst[c][k][l] = src[c][k][l];
            }
        }
    }
}
