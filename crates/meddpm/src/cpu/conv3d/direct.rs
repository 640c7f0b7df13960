//! Direct 3×3×3 stride-1 convolution — forward, data gradient and filter gradient — for the small
//! channel counts of demo-sized models, where im2col + GEMM spends most of its time writing and
//! reading a column matrix 27·Cin rows tall for a product only Cout rows high.
//!
//! The input (for the data gradient: dout) is first copied into a zero-padded buffer laid out by
//! [`Padded`]: every channel gets a one-voxel halo in D, H and W, and its rows are padded with
//! zeros up to a whole number of [`TW`]-voxel tiles, so every kernel tap reads in bounds.
//!
//! - Forward: one task per (block of [`CB`] output channels, output depth plane); for each row
//!   and each TW-voxel tile along W, CB × TW accumulators stay in registers while
//!   `acc[c][l] += w[co0 + c, ci, kd, kh, kw] · xp[ci, d + kd, h + kh, w0 + l + kw]`
//!   runs over ci and the 27 taps.
//! - Data gradient: the same correlation, of padded dout with the kernel flipped in D, H, W and
//!   with its two channel axes swapped: `dx[ci] = Σ_co Σ_t w[co, ci, 26 − t] · doutp[co, · + t]`.
//! - Filter gradient: one task per (ci, kd); `dW[co, ci, kd, kh, kw] = Σ_{d,h,w} dout[co, d, h, w]
//!   · xp[ci, d + kd, h + kh, w + kw]`, with CB × 3 (kw) × [`TWG`] accumulators per (kh, block).
//!
//! The loops are plain generic Rust over [`Float`] (the f64 gradient checks run this very code).
//! Each task body runs under `pulp`'s runtime CPU dispatch, which compiles it a second time with
//! AVX2 + FMA enabled; LLVM vectorises the fixed-size tile loops and `mul_add` becomes one FMA.

use rayon::prelude::*;

use crate::cpu::float::{vectorized, Float};
use crate::shape::Dims;

/// Output channels per register block.
pub const CB: usize = 4;
/// Output voxels along W per forward tile.
pub const TW: usize = 16;
/// Voxels along W per filter-gradient tile (TW is a multiple of it).
pub const TWG: usize = 8;

/// Geometry of a zero-padded copy of one batch element's activation (C × D × H × W): channel
/// ci, voxel (d, h, w) lives at `ci·chan + (d + 1)·plane + (h + 1)·row + w + 1`.
#[derive(Clone, Copy, Debug)]
pub struct Padded {
    /// Channels allocated (the real ones, then zero channels up to a multiple of CB if asked).
    pub c: usize,
    pub d: usize,
    pub h: usize,
    pub w: usize,
    /// Row length: W rounded up to whole tiles, plus the two halo voxels.
    pub row: usize,
    pub plane: usize,
    pub chan: usize,
}

impl Padded {
    /// `x`'s spatial size with `c` channels allocated.
    pub fn new(x: Dims, c: usize) -> Self {
        let row = x.w.div_ceil(TW) * TW + 2;
        let plane = (x.h + 2) * row;
        Padded { c, d: x.d, h: x.h, w: x.w, row, plane, chan: (x.d + 2) * plane }
    }
    pub fn len(&self) -> usize {
        self.c * self.chan
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Copy `src` (C × D × H × W, C ≤ p.c) into `dst` (p.len()), zeros everywhere else.
pub fn pad<T: Float>(dst: &mut [T], src: &[T], p: &Padded) {
    let (s, hw) = (p.d * p.h * p.w, p.h * p.w);
    assert_eq!(dst.len(), p.len(), "direct conv: padded buffer length");
    assert!(src.len().is_multiple_of(s.max(1)) && src.len() / s.max(1) <= p.c, "direct conv: source length");
    dst.par_chunks_mut(p.chan).enumerate().for_each(|(c, dc)| {
        dc.fill(T::zero());
        let Some(sc) = src.get(c * s..(c + 1) * s) else { return };
        for d in 0..p.d {
            for h in 0..p.h {
                let at = (d + 1) * p.plane + (h + 1) * p.row + 1;
                dc[at..at + p.w].copy_from_slice(&sc[d * hw + h * p.w..][..p.w]);
            }
        }
    });
}

/// Rearrange PyTorch weights (Cout, Cin, 3, 3, 3) for the forward kernel as
/// `[kin][tap][kout]`, kout padded with zeros to a multiple of CB. Forward: kin = ci, kout = co.
/// `for_data_grad`: kin = co, kout = ci and tap t reads w[.., 26 − t] (the flipped kernel).
pub fn arrange_weights<T: Float>(w: &[T], cout: usize, cin: usize, for_data_grad: bool) -> Vec<T> {
    assert_eq!(w.len(), cout * cin * 27, "direct conv: weight length");
    let (kin, kout) = if for_data_grad { (cout, cin) } else { (cin, cout) };
    let koutp = kout.div_ceil(CB) * CB;
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
    /// out += Σ … (an `Accum::Add` input gradient)
    Add,
}

/// out (kout × D × H × W of one batch element) per `init` from the padded input `xp` (geometry
/// `p`, kin = p.c channels used) and arranged weights `wt` (see [`arrange_weights`]).
pub fn correlate<T: Float>(out: &mut [T], kout: usize, xp: &[T], p: &Padded, kin: usize, wt: &[T], init: Init<'_, T>) {
    let (s, hw) = (p.d * p.h * p.w, p.h * p.w);
    let koutp = kout.div_ceil(CB) * CB;
    assert_eq!(out.len(), kout * s, "direct conv: output length");
    assert!(kin <= p.c && xp.len() == p.len(), "direct conv: padded input");
    assert_eq!(wt.len(), kin * 27 * koutp, "direct conv: arranged weights");
    if let Init::Bias(b) = init {
        assert_eq!(b.len(), kout, "direct conv: bias length");
    }
    if s == 0 {
        return;
    }
    // One task per (channel block, depth plane): the block's planes at that depth.
    let mut tasks: Vec<(usize, usize, Vec<&mut [T]>)> = Vec::new();
    for (blk, chans) in out.chunks_mut(CB * s).enumerate() {
        let mut by_depth: Vec<Vec<&mut [T]>> = (0..p.d).map(|_| Vec::with_capacity(CB)).collect();
        for chan in chans.chunks_mut(s) {
            for (d, plane) in chan.chunks_mut(hw).enumerate() {
                by_depth[d].push(plane);
            }
        }
        tasks.extend(by_depth.into_iter().enumerate().map(|(d, planes)| (blk * CB, d, planes)));
    }
    tasks.into_par_iter().for_each(|(co0, d, mut planes)| {
        vectorized(
            #[inline(always)]
            || correlate_plane(&mut planes, co0, d, xp, p, kin, koutp, wt, init),
        )
    });
}

/// One output depth plane `d` of channels co0 .. co0 + planes.len().
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn correlate_plane<T: Float>(
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
    for h in 0..p.h {
        for w0 in (0..p.w).step_by(TW) {
            let n = TW.min(p.w - w0);
            let at = h * p.w + w0;
            let mut acc = [[T::zero(); TW]; CB];
            for (c, plane) in planes.iter().enumerate() {
                match init {
                    Init::Bias(b) => acc[c] = [b[co0 + c]; TW],
                    Init::Zero => {}
                    Init::Add => acc[c][..n].copy_from_slice(&plane[at..at + n]),
                }
            }
            for ci in 0..kin {
                let xc = &xp[ci * p.chan..(ci + 1) * p.chan];
                let wc = &wt[ci * 27 * koutp..(ci + 1) * 27 * koutp];
                for kd in 0..3 {
                    for kh in 0..3 {
                        let row = &xc[(d + kd) * p.plane + (h + kh) * p.row + w0..][..TW + 2];
                        for kw in 0..3 {
                            let x: &[T; TW] = row[kw..kw + TW].try_into().expect("TW voxels");
                            let tap = (kd * 3 + kh) * 3 + kw;
                            let wv: &[T; CB] = wc[tap * koutp + co0..][..CB].try_into().expect("CB weights");
                            fma_tile(&mut acc, wv, x);
                        }
                    }
                }
            }
            for (c, plane) in planes.iter_mut().enumerate() {
                plane[at..at + n].copy_from_slice(&acc[c][..n]);
            }
        }
    }
}

/// acc[c][l] += wv[c] · x[l]. (Index loops over fixed-size arrays, no bounds checks inside: the
/// form LLVM reliably turns into CB × TW/8 vector FMAs with the accumulators in registers.)
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn fma_tile<T: Float>(acc: &mut [[T; TW]; CB], wv: &[T; CB], x: &[T; TW]) {
    for c in 0..CB {
        for l in 0..TW {
            acc[c][l] = wv[c].mul_add(x[l], acc[c][l]);
        }
    }
}

/// acc[c][kw][l] += g[c][l] · x[kw][l] (same form as [`fma_tile`]).
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn fma_outer<T: Float>(acc: &mut [[[T; TWG]; 3]; CB], g: &[&[T; TWG]; CB], x: &[&[T; TWG]; 3]) {
    for c in 0..CB {
        for kw in 0..3 {
            for l in 0..TWG {
                acc[c][kw][l] = g[c][l].mul_add(x[kw][l], acc[c][kw][l]);
            }
        }
    }
}

/// dw (Cout × Cin × 27) += the filter gradient of one batch element, from padded dout `gp`
/// (geometry `pg`, channels padded to a multiple of CB) and padded input `xp` (geometry `px`).
pub fn filter_grad<T: Float>(dw: &mut [T], cout: usize, gp: &[T], pg: &Padded, xp: &[T], px: &Padded, cin: usize) {
    assert!(pg.c >= cout && pg.c.is_multiple_of(CB) && gp.len() == pg.len(), "direct conv: padded dout");
    assert!(px.c >= cin && xp.len() == px.len(), "direct conv: padded input");
    assert!((pg.d, pg.h, pg.w, pg.row) == (px.d, px.h, px.w, px.row), "direct conv: dout vs input geometry");
    assert_eq!(dw.len(), cout * cin * 27, "direct conv: dw length");
    // One task per (ci, kd): its 9·Cout weights, added into dw afterwards.
    let parts: Vec<(usize, usize, Vec<T>)> = (0..cin * 3)
        .into_par_iter()
        .map(|task| {
            let (ci, kd) = (task / 3, task % 3);
            let mut part = vec![T::zero(); pg.c * 9];
            vectorized(
                #[inline(always)]
                || filter_grad_task(&mut part, gp, pg, &xp[ci * px.chan..(ci + 1) * px.chan], kd),
            );
            (ci, kd, part)
        })
        .collect();
    for (ci, kd, part) in parts {
        for co in 0..cout {
            for k in 0..9 {
                dw[(co * cin + ci) * 27 + kd * 9 + k] += part[co * 9 + k];
            }
        }
    }
}

/// part[co·9 + kh·3 + kw] = Σ_{d,h,w} dout[co, d, h, w] · xc[d + kd, h + kh, w + kw] for every co.
#[inline(always)]
fn filter_grad_task<T: Float>(part: &mut [T], gp: &[T], p: &Padded, xc: &[T], kd: usize) {
    for kh in 0..3 {
        for co0 in (0..p.c).step_by(CB) {
            let mut acc = [[[T::zero(); TWG]; 3]; CB];
            for d in 0..p.d {
                for h in 0..p.h {
                    let xrow = &xc[(d + kd) * p.plane + (h + kh) * p.row..][..p.row];
                    // dout row (d, h) of channel co0 + c, without its halo.
                    let grow = |c: usize| &gp[(co0 + c) * p.chan + (d + 1) * p.plane + (h + 1) * p.row + 1..];
                    let grows: [&[T]; CB] = std::array::from_fn(grow);
                    for w0 in (0..p.w).step_by(TWG) {
                        let x: [&[T; TWG]; 3] =
                            std::array::from_fn(|kw| xrow[w0 + kw..w0 + kw + TWG].try_into().expect("TWG voxels"));
                        let g: [&[T; TWG]; CB] =
                            std::array::from_fn(|c| grows[c][w0..w0 + TWG].try_into().expect("TWG voxels"));
                        fma_outer(&mut acc, &g, &x);
                    }
                }
            }
            for (c, ac) in acc.iter().enumerate() {
                for (kw, a) in ac.iter().enumerate() {
                    part[(co0 + c) * 9 + kh * 3 + kw] = a.iter().copied().sum();
                }
            }
        }
    }
}
