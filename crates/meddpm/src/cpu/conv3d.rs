//! 3-D convolution (PyTorch `nn.Conv3d` semantics): forward, backward-data, backward-filter and
//! bias gradient, by im2col + GEMM, or by the direct kernels of [`direct`] for 3×3×3 stride-1
//! convolutions of moderate size (the demo model's; see [`uses_direct`]). Both paths compute the
//! same sums in different orders; `tests/conv_direct.rs` checks one against the other.
//!
//! Geometry comes from [`ConvShape`]: cubic kernel k ∈ {1, 3}, stride 1 or 2, zero padding
//! (k−1)/2. Layouts are PyTorch's: activations (N, C, D, H, W), weights (Cout, Cin, k, k, k).
//!
//! For batch element n the convolution is one matrix product:
//! `out[n]` (Cout × So) = `W` (Cout × Cin·k³) · `col` (Cin·k³ × So) + b, where row
//! r = ((ci·k + kd)·k + kh)·k + kw of `col` holds, for every output voxel, the input voxel that
//! kernel tap (kd, kh, kw) of channel ci reads (0 in the padding). Backward is the transposed
//! products: `dW += dout[n]·colᵀ`, `dcol = Wᵀ·dout[n]` scattered back by col2im (the exact adjoint
//! of im2col). A 1×1×1 stride-1 conv needs no im2col: `col` is the input itself.
//!
//! Scratch: `col` (and `dcol`) — or, on the direct path, the padded input (and padded dout, and
//! dout transposed for the filter gradient) —
//! live in a [`ConvScratch`] and cover a slab of whole output depth
//! planes, sized so a slab holds at most `budget` elements ([`COL_BUDGET`] by default); large
//! volumes are done slab by slab. [`conv3d_forward`] / [`conv3d_backward`] allocate a fresh
//! scratch per call; `CpuBackend` keeps one per thread, because first-touching a fresh 64 MiB
//! buffer costs about as much as the convolution itself.

pub mod direct;

use rayon::prelude::*;

use super::float::{gemm, sum_f64, vectorized, Float, Mat, MatMut};
use crate::backend::Accum;
use crate::shape::ConvShape;

/// Largest im2col slab, in elements (64 MiB of f32).
pub const COL_BUDGET: usize = 1 << 24;

/// Reusable im2col buffers; they only grow. Contents between calls are meaningless.
pub struct ConvScratch<T> {
    /// Largest slab in elements (at least one output depth plane is always done at once).
    pub budget: usize,
    col: Vec<T>,
    dcol: Vec<T>,
    /// Direct path: dout transposed for the filter gradient ([`direct::transposed_len`]).
    gt: Vec<T>,
}

impl<T: Float> ConvScratch<T> {
    pub fn new(budget: usize) -> Self {
        ConvScratch { budget, col: Vec::new(), dcol: Vec::new(), gt: Vec::new() }
    }
}

fn grow<T: Float>(v: &mut Vec<T>, len: usize) -> &mut [T] {
    if v.len() < len {
        v.resize(len, T::zero());
    }
    &mut v[..len]
}

/// Output depth planes per im2col slab of at most `budget` elements (at least one plane).
fn slab_planes(cs: &ConvShape, budget: usize) -> usize {
    let o = cs.out();
    let rows = cs.x.c * cs.k * cs.k * cs.k;
    (budget / (rows * o.h * o.w).max(1)).clamp(1, o.d.max(1))
}

/// Whether `conv3d_*_with` takes the direct kernels ([`direct`]) for `cs` with a scratch of
/// `budget` elements: 3×3×3 stride-1 convolutions whose padded input and padded dout fit in the
/// budget (so the large volumes of the full-size models stay on im2col + GEMM), on CPUs with
/// FMA (everywhere but x86-64 machines older than 2013, where `mul_add` would be a library call).
pub fn uses_direct(cs: &ConvShape, budget: usize) -> bool {
    let chans = cs.x.c + direct::grad_channels(cs.cout);
    let fma = cfg!(not(target_arch = "x86_64")) || has_fma();
    cs.k == 3 && cs.stride == 1 && chans * direct::Padded::new(cs.x, 1).len() <= budget && fma
}

/// What the convolutions run as on this CPU, for a device line.
pub fn kernels_line() -> &'static str {
    if cfg!(not(target_arch = "x86_64")) || has_fma() {
        "direct 3×3×3 convolutions (im2col + GEMM for 1×1×1, strided and large volumes)"
    } else {
        "im2col + GEMM convolutions (no FMA on this CPU)"
    }
}

#[cfg(target_arch = "x86_64")]
fn has_fma() -> bool {
    std::is_x86_feature_detected!("fma")
}
#[cfg(not(target_arch = "x86_64"))]
fn has_fma() -> bool {
    true
}

fn is_pointwise(cs: &ConvShape) -> bool {
    cs.k == 1 && cs.stride == 1
}

fn check(cs: &ConvShape, inp: usize, w: usize, out: usize) {
    assert!(cs.k == 1 || cs.k == 3, "conv3d: kernel {} not in {{1, 3}}", cs.k);
    assert!(cs.stride == 1 || cs.stride == 2, "conv3d: stride {} not in {{1, 2}}", cs.stride);
    assert_eq!(inp, cs.x.numel(), "conv3d: input length vs shape {}", cs.x);
    assert_eq!(w, cs.w_len(), "conv3d: weight length vs {}x{}x{k}x{k}x{k}", cs.cout, cs.x.c, k = cs.k);
    assert_eq!(out, cs.out().numel(), "conv3d: output length vs shape {}", cs.out());
}

/// Output indices `lo..hi` along one axis whose input index o·s + kk − p lies inside 0..n.
fn valid_range(o_len: usize, n: usize, s: usize, kk: usize, p: usize) -> (usize, usize) {
    let lo = if kk >= p { 0 } else { (p - kk).div_ceil(s) };
    let hi = if n + p < kk + 1 { 0 } else { (n - 1 + p - kk) / s + 1 };
    (lo.min(o_len), hi.min(o_len).max(lo.min(o_len)))
}

/// Fill `col` (Cin·k³ rows × planes·Ho·Wo columns) for output depth planes
/// `od0 .. od0 + planes` of one batch element `x` (Cin × D·H·W).
pub fn im2col<T: Float>(col: &mut [T], x: &[T], cs: &ConvShape, od0: usize, planes: usize) {
    let (k, s, p) = (cs.k, cs.stride, cs.pad());
    let (i, o) = (cs.x, cs.out());
    col.par_chunks_mut(planes * o.h * o.w).enumerate().for_each(|(r, row)| {
        let (ci, kd, kh, kw) = (r / (k * k * k), (r / (k * k)) % k, (r / k) % k, r % k);
        let xc = &x[ci * i.s()..(ci + 1) * i.s()];
        let (d_lo, d_hi) = valid_range(o.d, i.d, s, kd, p);
        let (h_lo, h_hi) = valid_range(o.h, i.h, s, kh, p);
        let (w_lo, w_hi) = valid_range(o.w, i.w, s, kw, p);
        for (od, plane) in (od0..od0 + planes).zip(row.chunks_mut(o.h * o.w)) {
            for (oh, line) in plane.chunks_mut(o.w).enumerate() {
                if od < d_lo || od >= d_hi || oh < h_lo || oh >= h_hi {
                    line.fill(T::zero());
                    continue;
                }
                // Input row (id, ih); ow reads iw = ow·s + kw − p.
                let base = ((od * s + kd - p) * i.h + oh * s + kh - p) * i.w;
                line[..w_lo].fill(T::zero());
                line[w_hi..].fill(T::zero());
                for (ow, v) in line.iter_mut().enumerate().take(w_hi).skip(w_lo) {
                    *v = xc[base + ow * s + kw - p];
                }
            }
        }
    });
}

/// Adjoint of [`im2col`]: `dx += col2im(dcol)` for the same slab.
pub fn col2im_add<T: Float>(dx: &mut [T], dcol: &[T], cs: &ConvShape, od0: usize, planes: usize) {
    let (k, s, p) = (cs.k, cs.stride, cs.pad());
    let (i, o) = (cs.x, cs.out());
    let (k3, len) = (k * k * k, planes * o.h * o.w);
    // One task per input channel: channel ci owns rows ci·k³ .. (ci+1)·k³ of dcol.
    dx.par_chunks_mut(i.s()).enumerate().for_each(|(ci, dxc)| {
        for t in 0..k3 {
            let (kd, kh, kw) = (t / (k * k), (t / k) % k, t % k);
            let row = &dcol[(ci * k3 + t) * len..(ci * k3 + t + 1) * len];
            let (d_lo, d_hi) = valid_range(o.d, i.d, s, kd, p);
            let (h_lo, h_hi) = valid_range(o.h, i.h, s, kh, p);
            let (w_lo, w_hi) = valid_range(o.w, i.w, s, kw, p);
            for (od, plane) in (od0..od0 + planes).zip(row.chunks(o.h * o.w)) {
                if od < d_lo || od >= d_hi {
                    continue;
                }
                for (oh, line) in plane.chunks(o.w).enumerate().take(h_hi).skip(h_lo) {
                    let base = ((od * s + kd - p) * i.h + oh * s + kh - p) * i.w;
                    for (ow, &v) in line.iter().enumerate().take(w_hi).skip(w_lo) {
                        dxc[base + ow * s + kw - p] += v;
                    }
                }
            }
        }
    });
}

/// out[N, Cout, Do, Ho, Wo] = conv(inp, w) + b.
pub fn conv3d_forward<T: Float>(out: &mut [T], inp: &[T], w: &[T], b: &[T], cs: ConvShape) {
    conv3d_forward_with(out, inp, w, b, cs, &mut ConvScratch::new(COL_BUDGET));
}

/// [`conv3d_forward`] with caller-provided scratch (and its slab budget).
pub fn conv3d_forward_with<T: Float>(
    out: &mut [T],
    inp: &[T],
    w: &[T],
    b: &[T],
    cs: ConvShape,
    scratch: &mut ConvScratch<T>,
) {
    conv3d_forward_acc(out, Accum::Overwrite, inp, w, Some(b), cs, scratch);
}

/// out = conv(inp, w) (+ b where given), overwriting `out` or added to it per `acc` (the U-Net's
/// residual adds and folded biases, `Backend::conv3d_forward_acc`).
pub fn conv3d_forward_acc<T: Float>(
    out: &mut [T],
    acc: Accum,
    inp: &[T],
    w: &[T],
    b: Option<&[T]>,
    cs: ConvShape,
    scratch: &mut ConvScratch<T>,
) {
    check(&cs, inp.len(), w.len(), out.len());
    if let Some(b) = b {
        assert_eq!(b.len(), cs.cout, "conv3d: bias length vs Cout");
    }
    let o = cs.out();
    let (cin, so, rows) = (cs.x.c, o.s(), cs.x.c * cs.k * cs.k * cs.k);
    if uses_direct(&cs, scratch.budget) {
        let px = direct::Padded::new(cs.x, cin);
        let xp = grow(&mut scratch.col, px.len());
        let wt = direct::arrange_weights(w, cs.cout, cin, false);
        let init = match (acc, b) {
            (Accum::Overwrite, Some(b)) => direct::Init::Bias(b),
            (Accum::Overwrite, None) => direct::Init::Zero,
            (Accum::Add, Some(b)) => direct::Init::AddBias(b),
            (Accum::Add, None) => direct::Init::Add,
        };
        for n in 0..cs.x.n {
            direct::pad(xp, &inp[n * cin * cs.x.s()..(n + 1) * cin * cs.x.s()], &px);
            let on = &mut out[n * cs.cout * so..(n + 1) * cs.cout * so];
            direct::correlate(on, cs.cout, xp, &px, cin, &wt, init);
        }
        return;
    }
    let wm = Mat::dense(w, cs.cout, rows);
    let planes = slab_planes(&cs, scratch.budget);
    let col = if is_pointwise(&cs) { &mut [][..] } else { grow(&mut scratch.col, rows * planes * o.h * o.w) };
    for n in 0..cs.x.n {
        let xn = &inp[n * cin * cs.x.s()..(n + 1) * cin * cs.x.s()];
        let on = &mut out[n * cs.cout * so..(n + 1) * cs.cout * so];
        // Start from the bias (or zero, or what is there), then accumulate the product.
        for (co, oc) in on.chunks_mut(so).enumerate() {
            match (acc, b) {
                (Accum::Overwrite, Some(b)) => oc.fill(b[co]),
                (Accum::Overwrite, None) => oc.fill(T::zero()),
                (Accum::Add, Some(b)) => oc.iter_mut().for_each(|v| *v += b[co]),
                (Accum::Add, None) => {}
            }
        }
        if is_pointwise(&cs) {
            gemm(MatMut::dense(on, cs.cout, so), true, T::one(), wm, Mat::dense(xn, cin, so));
            continue;
        }
        for od0 in (0..o.d).step_by(planes) {
            let pl = planes.min(o.d - od0);
            let len = pl * o.h * o.w;
            im2col(&mut col[..rows * len], xn, &cs, od0, pl);
            let dst = MatMut::new(&mut on[od0 * o.h * o.w..], cs.cout, len, so);
            gemm(dst, true, T::one(), wm, Mat::dense(&col[..rows * len], rows, len));
        }
    }
}

/// dinp (per `Accum`, skipped if `None`), dw += , db += , from dout[N, Cout, Do, Ho, Wo].
#[allow(clippy::too_many_arguments)]
pub fn conv3d_backward<T: Float>(
    dinp: Option<(&mut [T], Accum)>,
    dw: &mut [T],
    db: &mut [T],
    dout: &[T],
    inp: &[T],
    w: &[T],
    cs: ConvShape,
) {
    conv3d_backward_with(dinp, dw, Some(db), dout, inp, w, cs, &mut ConvScratch::new(COL_BUDGET));
}

/// db += the bias gradient: dout summed over batch and voxels (f64 accumulation, one channel
/// per task).
pub fn bias_grad<T: Float>(db: &mut [T], dout: &[T], cs: ConvShape) {
    let so = cs.out().s();
    db.par_iter_mut().enumerate().for_each(|(co, g)| {
        let mut acc = 0f64;
        for n in 0..cs.x.n {
            let base = (n * cs.cout + co) * so;
            acc += vectorized(
                #[inline(always)]
                || sum_f64(&dout[base..base + so], |v| v),
            );
        }
        *g += T::from_f64(acc);
    });
}

/// [`conv3d_backward`] with caller-provided scratch (and its slab budget); `db` None skips the
/// bias gradient.
#[allow(clippy::too_many_arguments)]
pub fn conv3d_backward_with<T: Float>(
    dinp: Option<(&mut [T], Accum)>,
    dw: &mut [T],
    db: Option<&mut [T]>,
    dout: &[T],
    inp: &[T],
    w: &[T],
    cs: ConvShape,
    scratch: &mut ConvScratch<T>,
) {
    check(&cs, inp.len(), w.len(), dout.len());
    assert_eq!(dw.len(), w.len(), "conv3d: dw length vs w");
    if let Some(db) = db {
        assert_eq!(db.len(), cs.cout, "conv3d: db length vs Cout");
        bias_grad(db, dout, cs);
    }
    backward_parts(dinp, Some((dw, inp)), dout, w, cs, scratch);
}

/// The data gradient alone: dinp (per `Accum`) from dout and w (`Backend::conv3d_backward_data`;
/// the same sums as [`conv3d_backward_with`]'s dinp).
pub fn conv3d_backward_data_with<T: Float>(
    dinp: (&mut [T], Accum),
    dout: &[T],
    w: &[T],
    cs: ConvShape,
    scratch: &mut ConvScratch<T>,
) {
    check(&cs, cs.x.numel(), w.len(), dout.len());
    backward_parts(Some(dinp), None, dout, w, cs, scratch);
}

/// Backward on whichever of the two parts is asked for: dinp, and `wg` = (dw, the forward's
/// input) for dw += the filter gradient.
fn backward_parts<T: Float>(
    dinp: Option<(&mut [T], Accum)>,
    mut wg: Option<(&mut [T], &[T])>,
    dout: &[T],
    w: &[T],
    cs: ConvShape,
    scratch: &mut ConvScratch<T>,
) {
    let o = cs.out();
    let (cin, si, so, rows) = (cs.x.c, cs.x.s(), o.s(), cs.x.c * cs.k * cs.k * cs.k);

    let wm = Mat::dense(w, cs.cout, rows);
    let (mut dinp, acc) = match dinp {
        Some((d, acc)) => {
            assert_eq!(d.len(), cs.x.numel(), "conv3d: dinp length vs input");
            (Some(d), acc)
        }
        None => (None, Accum::Add),
    };
    if uses_direct(&cs, scratch.budget) {
        let px = direct::Padded::new(cs.x, cin);
        let pg = direct::Padded::new(o, direct::grad_channels(cs.cout));
        let xp = grow(&mut scratch.col, px.len());
        let gp = grow(&mut scratch.dcol, pg.len());
        let gt = grow(&mut scratch.gt, direct::transposed_len(&pg, cs.cout));
        let wt = if dinp.is_some() { direct::arrange_weights(w, cs.cout, cin, true) } else { Vec::new() };
        let init = if acc == Accum::Add { direct::Init::Add } else { direct::Init::Zero };
        for n in 0..cs.x.n {
            direct::pad(gp, &dout[n * cs.cout * so..(n + 1) * cs.cout * so], &pg);
            if let Some((dw, inp)) = wg.as_mut() {
                direct::pad(xp, &inp[n * cin * si..(n + 1) * cin * si], &px);
                direct::filter_grad(dw, cs.cout, gp, &pg, xp, &px, cin, gt);
            }
            if let Some(d) = dinp.as_deref_mut() {
                direct::correlate(&mut d[n * cin * si..(n + 1) * cin * si], cin, gp, &pg, cs.cout, &wt, init);
            }
        }
        return;
    }
    if is_pointwise(&cs) {
        for n in 0..cs.x.n {
            let gn = &dout[n * cs.cout * so..(n + 1) * cs.cout * so];
            let gm = Mat::dense(gn, cs.cout, so);
            if let Some((dw, inp)) = wg.as_mut() {
                // dW (Cout × Cin) += dout[n] · x[n]ᵀ
                let xn = &inp[n * cin * si..(n + 1) * cin * si];
                gemm(MatMut::dense(dw, cs.cout, cin), true, T::one(), gm, Mat::dense(xn, cin, si).t());
            }
            if let Some(d) = dinp.as_deref_mut() {
                // dx[n] (Cin × S) (+)= Wᵀ · dout[n]
                let dn = &mut d[n * cin * si..(n + 1) * cin * si];
                gemm(MatMut::dense(dn, cin, si), acc == Accum::Add, T::one(), wm.t(), gm);
            }
        }
        return;
    }

    if let (Some(d), Accum::Overwrite) = (dinp.as_deref_mut(), acc) {
        d.fill(T::zero());
    }
    let planes = slab_planes(&cs, scratch.budget);
    let slab = rows * planes * o.h * o.w;
    let col = grow(&mut scratch.col, slab);
    let dcol = if dinp.is_some() { grow(&mut scratch.dcol, slab) } else { &mut [][..] };
    for n in 0..cs.x.n {
        let gn = &dout[n * cs.cout * so..(n + 1) * cs.cout * so];
        for od0 in (0..o.d).step_by(planes) {
            let pl = planes.min(o.d - od0);
            let len = pl * o.h * o.w;
            let gm = Mat::new(&gn[od0 * o.h * o.w..], cs.cout, len, so);
            if let Some((dw, inp)) = wg.as_mut() {
                let xn = &inp[n * cin * si..(n + 1) * cin * si];
                im2col(&mut col[..rows * len], xn, &cs, od0, pl);
                // dW (Cout × Cin·k³) += dout_slab · colᵀ
                let cm = Mat::dense(&col[..rows * len], rows, len).t();
                gemm(MatMut::dense(dw, cs.cout, rows), true, T::one(), gm, cm);
            }
            if let Some(d) = dinp.as_deref_mut() {
                // dcol = Wᵀ · dout_slab, then scatter back.
                gemm(MatMut::dense(&mut dcol[..rows * len], rows, len), false, T::one(), wm.t(), gm);
                col2im_add(&mut d[n * cin * si..(n + 1) * cin * si], &dcol[..rows * len], &cs, od0, pl);
            }
        }
    }
}
