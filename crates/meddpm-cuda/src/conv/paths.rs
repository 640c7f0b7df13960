//! The conv entry points `CudaBackend` calls: forward (plain, accumulated, with a residual),
//! backward (data, weight and bias gradients), the data gradient that also takes the following
//! GroupNorm+SiLU backward's sums, and the ResBlocks' GroupNorm+SiLU → conv on the wgmma kernel.
//! Each takes the engine [`super::choose`] picks for the shape: wgmma, few-channel, or cuDNN.

use meddpm::{Accum, ConvShape, DType, Layout, Precision};

use super::algo_cache::ConvCache;
use super::choose::{
    dgrad_trial, forward_typed, small_decided, time_small, wgmma_decided, wgmma_fwd_chosen, wgmma_wgrad_chosen,
};
use super::cudnn::{
    cudnn_dgrad, cudnn_wgrad, forward_plain, operand, run_forward_beta, T_DY, T_W, T_WPD, T_WPF, T_X, T_Y,
};
use super::desc::{check_lens, compute_type, Dir};
use super::pad::padded_shape;
use super::small::{
    small_cin_wgrad, small_cout_wgrad, small_dgrad, small_dgrad_run, small_forward, small_fwd_kind, small_fwd_kind_in,
    wgrad_small, wgrad_small_cin,
};
use super::wgmma;
use crate::buf::{require_f32, GpuBuf, Mode};
use crate::device::Device;

/// out = conv(inp, w) + b (no bias where None), overwriting `out` or added to it (cuDNN's β = 1)
/// per `Accum`: through our few-channel kernel or cuDNN, whichever timed faster for the shape
/// (`KernelChoices::small_conv` overrides). An added-to or bias-less forward always takes
/// the plain cuDNN call (the U-Net's residual convs, never few-channel ones).
pub(crate) fn forward(
    dev: &Device,
    cache: &mut ConvCache,
    (out, acc): (&mut GpuBuf, Accum),
    inp: &GpuBuf,
    w: &GpuBuf,
    b: Option<&GpuBuf>,
    cs: ConvShape,
) {
    check_lens(cs, inp.len(), w.len(), out.len(), b.map_or(cs.cout, |b| b.len()));
    *cache.fwd_calls.entry(cs).or_insert(0) += 1;
    if let Some(b) = b {
        require_f32("conv3d bias", &[b]);
    }
    let b = match (acc, b) {
        (Accum::Overwrite, Some(b)) => b,
        _ => {
            cudnn_forward_acc(dev, cache, out, acc == Accum::Add, inp, w, b, cs);
            return;
        }
    };
    let (layout, mma) = (cache.layout, cache.mma_on());
    if let Some(kind) = small_fwd_kind_in(cs, (layout, mma)) {
        let gemm = if cache.choices.small_gemm { cache.choices.small_gemm_budget } else { 0 };
        let ours = match small_decided(cache, cs, Dir::Fwd) {
            Some(f) => f,
            None => time_small(dev, cache, cs, Dir::Fwd, |cache, ours| {
                if ours {
                    small_forward(dev, kind, out, inp, w, b, cs, (layout, mma, gemm));
                } else {
                    cudnn_forward(dev, cache, out, inp, w, b, cs);
                }
            }),
        };
        cache.small_used.insert((cs, Dir::Fwd), ours);
        if ours {
            small_forward(dev, kind, out, inp, w, b, cs, (layout, mma, gemm));
            return;
        }
    } else {
        // not ours in this configuration (Cin 5 to 8 with the tensor-core kernels off)
        cache.small_used.remove(&(cs, Dir::Fwd));
    }
    cudnn_forward(dev, cache, out, inp, w, b, cs);
}

/// out = conv(inp, w) + b + z (`Backend::conv3d_forward_res`): cuDNN's conv-bias-activation call
/// with z where the algorithm allows it and timing on first use says it is faster (`forward_plain`),
/// else our bias kernel writes z + b and cuDNN's conv adds onto it (β = 1). Operands of the other
/// type than the compute type, and few-channel or channel-padded shapes, take the second route.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_res(
    dev: &Device,
    cache: &mut ConvCache,
    out: &mut GpuBuf,
    inp: &GpuBuf,
    w: &GpuBuf,
    b: &GpuBuf,
    z: &GpuBuf,
    cs: ConvShape,
) {
    check_lens(cs, inp.len(), w.len(), out.len(), b.len());
    assert!(
        z.len() == out.len() && z.dtype() == out.dtype(),
        "conv3d {} -> {} with a residual: z has {} {:?} elements, expected {} {:?} (the output's)",
        cs.x,
        cs.cout,
        z.len(),
        z.dtype(),
        out.len(),
        out.dtype()
    );
    require_f32("conv3d bias", &[b]);
    *cache.fwd_calls.entry(cs).or_insert(0) += 1;
    if wgmma_forward(dev, cache, out, true, inp, w, Some(b), Some(z), cs) {
        return;
    }
    let cdt = compute_type(cache.precision);
    if out.dtype() != cdt || small_fwd_kind(cs).is_some() || padded_shape(cs).is_some() {
        let (yp, zp) = (dev.ptr_mut(out), dev.ptr(z));
        crate::elementwise::add_channel_bias_to(
            dev,
            yp,
            zp,
            dev.ptr(b),
            cs.out(),
            Mode::new(cache.layout, out.dtype()),
            false,
        );
        cudnn_forward_acc(dev, cache, out, true, inp, w, None, cs);
        return;
    }
    let (xp, wp) = (operand(dev, inp, cdt, T_X), operand(dev, w, cdt, T_W));
    let (bp, zp) = (dev.ptr(b), dev.ptr(z));
    forward_plain(dev, cache, cs, xp, wp, bp, dev.ptr_mut(out), Some(zp));
}

/// out = conv(inp, w) + b through cuDNN: operands converted to the compute type where needed.
fn cudnn_forward(
    dev: &Device,
    cache: &mut ConvCache,
    out: &mut GpuBuf,
    inp: &GpuBuf,
    w: &GpuBuf,
    b: &GpuBuf,
    cs: ConvShape,
) {
    if wgmma_forward(dev, cache, out, false, inp, w, Some(b), None, cs) {
        return;
    }
    let cdt = compute_type(cache.precision);
    let (xp, wp, bp) = (operand(dev, inp, cdt, T_X), operand(dev, w, cdt, T_W), dev.ptr(b));
    // an output of the other type is computed into a temporary and converted at the end
    let yp = if out.dtype() == cdt { dev.ptr_mut(out) } else { dev.temp(out.len(), cdt, T_Y) };
    forward_typed(dev, cache, cs, xp, wp, bp, yp);
    if out.dtype() != cdt {
        dev.cast(dev.ptr_mut(out), out.dtype(), yp, cdt, out.len(), false);
    }
}

/// out (+)= conv(inp, w) (+ b): the plain cuDNN forward with β = 1 where `add`, then our bias
/// kernel where there is a bias. An output of the other type goes through a temporary of the
/// compute type that holds its current values when added to.
#[allow(clippy::too_many_arguments)]
fn cudnn_forward_acc(
    dev: &Device,
    cache: &mut ConvCache,
    out: &mut GpuBuf,
    add: bool,
    inp: &GpuBuf,
    w: &GpuBuf,
    b: Option<&GpuBuf>,
    cs: ConvShape,
) {
    if wgmma_forward(dev, cache, out, add, inp, w, b, None, cs) {
        return;
    }
    let cdt = compute_type(cache.precision);
    let (xp, wp) = (operand(dev, inp, cdt, T_X), operand(dev, w, cdt, T_W));
    let yp = if out.dtype() == cdt {
        dev.ptr_mut(out)
    } else {
        let t = dev.temp(out.len(), cdt, T_Y);
        if add {
            dev.cast(t, cdt, dev.ptr(out), out.dtype(), out.len(), false);
        }
        t
    };
    // cudnnFind overwrites its output: an added-to output is not given to it
    let a = if cache.plan(cs).algo[0].is_some() || !add {
        cache.algo(dev, Dir::Fwd, cs, xp, wp, yp)
    } else {
        let mut tmp = dev.alloc(out.len(), cdt).unwrap_or_else(|e| panic!("{e}"));
        let tp = dev.ptr_mut(&mut tmp);
        let a = cache.algo(dev, Dir::Fwd, cs, xp, wp, tp);
        dev.sync();
        drop(tmp);
        a
    };
    run_forward_beta(dev, cache, a, cs, xp, wp, yp, if add { 1.0 } else { 0.0 });
    if let Some(b) = b {
        crate::elementwise::add_channel_bias(dev, yp, dev.ptr(b), cs.out(), Mode::new(cache.layout, cdt), false);
    }
    if out.dtype() != cdt {
        dev.cast(dev.ptr_mut(out), out.dtype(), yp, cdt, out.len(), false);
    }
}

/// out (= or += per `add`) = conv(inp, w) (+ b) through `conv3d_wgmma_fwd` where it fits (bf16
/// input and output, NDHWC, sm_90, Cin and Cout multiples of 64) and is chosen
/// ([`wgmma_decided`]); false (nothing done) otherwise. With `z` (and `add`): out = conv + b + z.
#[allow(clippy::too_many_arguments)]
fn wgmma_forward(
    dev: &Device,
    cache: &mut ConvCache,
    out: &mut GpuBuf,
    add: bool,
    inp: &GpuBuf,
    w: &GpuBuf,
    b: Option<&GpuBuf>,
    z: Option<&GpuBuf>,
    cs: ConvShape,
) -> bool {
    let bf = cache.precision == Precision::Bf16 && inp.dtype() == DType::Bf16 && out.dtype() == DType::Bf16;
    if !wgmma::fwd_fits(dev, cs, cache.layout, bf) {
        return false;
    }
    if !wgmma_fwd_chosen(dev, cache, cs, add, inp, w, out.len()) {
        return false;
    }
    let (xp, wp, wbf) = (dev.ptr(inp), dev.ptr(w), w.dtype() == DType::Bf16);
    let acc = if add { Accum::Add } else { Accum::Overwrite };
    let (bp, zp) = (b.map_or(0, |b| dev.ptr(b)), z.map_or(0, |z| dev.ptr(z)));
    wgmma::run(
        dev,
        (xp, wp, bp, dev.ptr_mut(out), zp),
        wbf,
        cs.x,
        cs.cout,
        acc,
        false,
        cache.choices.wgmma_reuse,
        T_WPF,
    );
    cache.runs.wgmma += 1;
    true
}

/// out (= or += per `acc`) = conv(silu(GN(inp + off)), w) (+ b) (+ z: with `Accum::Add`, out =
/// conv + b + z) through `conv3d_wgmma_fwd_gn`, the statistics given: where
/// [`gn_wgmma_chosen`] said so. With `x2` = (b, ca) the input is cat(inp, b) at channel ca, read
/// from the two parts ([`cat_free_chosen`]). With `ystats` = (mean, rstd, off, groups) also the
/// GroupNorm statistics of out + off as stored (the final values, accumulated or not), from the epilogue's
/// per-item partials ([`crate::groupnorm::finalize_stats_counted`]): no pass reads `out` for them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gn_wgmma_forward(
    dev: &Device,
    cache: &mut ConvCache,
    (out, acc): (&mut GpuBuf, Accum),
    (inp, off): (&GpuBuf, Option<&GpuBuf>),
    x2: Option<(&GpuBuf, usize)>,
    (mean, rstd): (&GpuBuf, &GpuBuf),
    (gamma, beta): (&GpuBuf, &GpuBuf),
    (w, b, z): (&GpuBuf, Option<&GpuBuf>, Option<&GpuBuf>),
    cs: ConvShape,
    groups: usize,
    ystats: Option<YStats>,
) {
    let x = cs.x;
    let inp_len = match x2 {
        Some((b2, ca)) => {
            let vox = x.n * x.s();
            assert!(
                inp.len() == vox * ca && b2.len() == vox * (x.c - ca) && b2.dtype() == DType::Bf16,
                "conv3d_wgmma_fwd_gn {cs:?} from parts at channel {ca}: lengths {} and {} (expected {} and {})",
                inp.len(),
                b2.len(),
                vox * ca,
                vox * (x.c - ca)
            );
            x.numel()
        }
        None => inp.len(),
    };
    check_lens(cs, inp_len, w.len(), out.len(), b.map_or(cs.cout, |b| b.len()));
    let ng = x.n * groups;
    assert!(
        out.dtype() == DType::Bf16
            && z.is_none_or(|z| z.len() == out.len() && z.dtype() == DType::Bf16 && acc == Accum::Add)
            && gamma.len() == x.c
            && beta.len() == x.c
            && mean.len() == ng
            && rstd.len() == ng
            && off.is_none_or(|o| o.len() == x.n * x.c && o.dtype() == DType::F32),
        "conv3d_wgmma_fwd_gn {cs:?} groups {groups}: operand lengths or types (out {} {:?}, gamma {}, mean {}, \
         off {:?})",
        out.len(),
        out.dtype(),
        gamma.len(),
        mean.len(),
        off.map(|o| o.len())
    );
    if let Some(b) = b {
        require_f32("conv3d bias", &[b]);
    }
    *cache.fwd_calls.entry(cs).or_insert(0) += 1;
    let reuse = cache.choices.wgmma_reuse;
    let gn = wgmma::GnPro {
        mean: dev.ptr(mean),
        rstd: dev.ptr(rstd),
        gamma: dev.ptr(gamma),
        beta: dev.ptr(beta),
        off: off.map_or(0, |o| dev.ptr(o)),
        groups,
        x2: x2.map_or(0, |(b2, _)| dev.ptr(b2)),
        ca: x2.map_or(0, |(_, ca)| ca),
        ys: 0,
    };
    let (bp, zp) = (b.map_or(0, |b| dev.ptr(b)), z.map_or(0, |z| dev.ptr(z)));
    let ptrs = (dev.ptr(inp), dev.ptr(w), bp, dev.ptr_mut(out), zp);
    let wbf = w.dtype() == DType::Bf16;
    // with ystats the output's statistics: per column item, finalized after the conv
    let items = wgmma::items(dev, x);
    let part = ystats.as_ref().map(|_| dev.scratch(items * cs.cout * 3));
    let gn = wgmma::GnPro { ys: part.as_ref().map_or(0, |p| dev.ptr(&**p)), ..gn };
    let modes = (reuse, false, wgmma::Up::No);
    wgmma::run_gn(dev, ptrs, wbf, x, cs.cout, acc, false, Some(gn), modes, T_WPF);
    if let (Some((ym, yr, yoff, yg)), Some(part)) = (ystats, part) {
        let od = cs.out();
        crate::groupnorm::finalize_stats_counted(dev, dev.ptr(&*part), yoff, (ym, yr), od, yg, items / x.n);
        cache.runs.conv_stats += 1;
    }
    cache.runs.wgmma += 1;
    cache.runs.wgmma_gn += 1;
}

/// Where [`gn_wgmma_forward`] also takes the GroupNorm statistics of its output (+ an offset):
/// mean, rstd [N·G], the offset [N·Cout] and G.
pub(crate) type YStats<'a> = (&'a mut GpuBuf, &'a mut GpuBuf, Option<&'a GpuBuf>, usize);

/// dinp (per Accum) = the data gradient, dw += the weight gradient, db += the bias gradient
/// (skipped when None).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    dev: &Device,
    cache: &mut ConvCache,
    dinp: Option<(&mut GpuBuf, Accum)>,
    dw: &mut GpuBuf,
    db: Option<&mut GpuBuf>,
    dout: &GpuBuf,
    inp: &GpuBuf,
    w: &GpuBuf,
    cs: ConvShape,
) {
    check_lens(cs, inp.len(), w.len(), dout.len(), db.as_ref().map_or(cs.cout, |b| b.len()));
    assert_eq!(dw.len(), cs.w_len(), "conv3d backward: dw length");
    require_f32("conv3d backward: dw", &[dw]);
    bias_grad(dev, db, dout, cs.out(), cache.layout);
    let cdt = compute_type(cache.precision);
    let (xp, dyp) = (operand(dev, inp, cdt, T_X), operand(dev, dout, cdt, T_DY));
    let ly = (cache.layout, cache.mma_on());
    weight_grad(dev, cache, dw, xp, dyp, cs, ly);
    if let Some(d) = dinp {
        data_grad(dev, cache, d, dyp, cdt, w, cs, ly);
    }
}

/// The bias gradient: db[c] += the sum over n and voxels of dout (as given; volume `yd`), where
/// there is a db.
pub(super) fn bias_grad(dev: &Device, db: Option<&mut GpuBuf>, dout: &GpuBuf, yd: meddpm::Dims, layout: Layout) {
    if let Some(db) = db {
        require_f32("conv3d backward: db", &[db]);
        let to = crate::elementwise::SumTo::AccumOverN(dev.ptr_mut(db));
        crate::elementwise::channel_sums(dev, dout, yd, layout, to);
    }
}

/// dw += the weight gradient from x and dy (device addresses, both in the compute type): our
/// few-channel kernels, `conv3d_wgmma_wgrad(_tf32)` or cuDNN, as chosen for `cs`.
pub(super) fn weight_grad(
    dev: &Device,
    cache: &mut ConvCache,
    dw: &mut GpuBuf,
    xp: u64,
    dyp: u64,
    cs: ConvShape,
    ly: (Layout, bool),
) {
    let cdt = compute_type(cache.precision);
    if small_cout_wgrad(cs, cdt) {
        wgrad_small(dev, dw, xp, dyp, cs, (Mode::new(ly.0, cdt), ly.1));
    } else if small_cin_wgrad(cs, cdt, ly) {
        wgrad_small_cin(dev, dw, xp, dyp, cs);
    } else if wgmma_wgrad_chosen(dev, cache, cs, xp, dyp) {
        let tf32 = cache.precision == Precision::Tf32;
        wgmma::wgrad(dev, (xp, dyp, dev.ptr_mut(dw)), cs.x, cs.cout, tf32);
        cache.runs.wgmma_wgrad += 1;
    } else {
        cudnn_wgrad(dev, cache, dev.ptr_mut(dw), xp, dyp, cs);
    }
}

/// `Backend::conv3d_backward_data`: the data gradient alone.
pub(crate) fn backward_data(
    dev: &Device,
    cache: &mut ConvCache,
    dinp: (&mut GpuBuf, Accum),
    dout: &GpuBuf,
    w: &GpuBuf,
    cs: ConvShape,
) {
    check_lens(cs, cs.x.numel(), w.len(), dout.len(), cs.cout);
    let cdt = compute_type(cache.precision);
    let dyp = operand(dev, dout, cdt, T_DY);
    let ly = (cache.layout, cache.mma_on());
    data_grad(dev, cache, dinp, dyp, cdt, w, cs, ly);
}

/// [`backward_data`] overwriting dinp whose epilogue also takes the GroupNorm+SiLU backward's
/// channel sums of dinp ([`wgmma::GnSums`], written to `s.part`) where our wgmma data
/// gradient runs this shape (decided as [`backward_data`] decides: the plain kernel against
/// cuDNN) and `KernelChoices::dgrad_gn` is on. Returns whether the sums were taken and whether dy's
/// channel sums were (`s.dys`, where the kernel can: 64 channels of dy, the window of planes); if
/// not, dinp is what [`backward_data`] gives and the caller takes the sums itself.
pub(crate) fn backward_data_gn(
    dev: &Device,
    cache: &mut ConvCache,
    dx: &mut GpuBuf,
    dout: &GpuBuf,
    w: &GpuBuf,
    cs: ConvShape,
    mut s: wgmma::GnSums,
) -> (bool, bool) {
    check_lens(cs, cs.x.numel(), w.len(), dout.len(), cs.cout);
    let cdt = compute_type(cache.precision);
    let dyp = operand(dev, dout, cdt, T_DY);
    let ly = (cache.layout, cache.mma_on());
    assert_eq!(dx.len(), cs.x.numel(), "conv3d backward: dinp length");
    let bf = cdt == DType::Bf16 && dx.dtype() == DType::Bf16;
    let (yd, ci) = (cs.out(), cs.x.c);
    if cache.choices.dgrad_gn
        && wgmma::fits(dev, yd, cs.k, cs.stride, ci, ly.0, bf)
        && wgmma::gnb_fits(cs.x.n, ci, s.groups)
    {
        let (wp, wbf) = (dev.ptr(w), w.dtype() == DType::Bf16);
        let worth = wgmma::worth(dev, cs.x, ci);
        let ours = wgmma_decided(dev, cache, cs, (Dir::BwdData, false), worth, dx.len(), |cache, ours, tp| {
            dgrad_trial(dev, cache, ours, tp, (dyp, wp, wbf), w, cs, Accum::Overwrite)
        });
        if ours {
            let reuse = cache.choices.wgmma_reuse;
            if !(reuse && yd.c == 64) {
                s.dys = 0;
            }
            wgmma::run_dgrad_gnb(dev, (dyp, wp, dev.ptr_mut(dx)), wbf, yd, ci, reuse, T_WPD, s);
            cache.runs.wgmma += 1;
            cache.runs.dgrad_gn += 1;
            return (true, s.dys != 0);
        }
    }
    data_grad(dev, cache, (dx, Accum::Overwrite), dyp, cdt, w, cs, ly);
    (false, false)
}

/// Data gradient: our few-channel kernel or cuDNN (timed on first use, on a scratch target
/// because dx may accumulate); dy already in the compute type `cdt`.
#[allow(clippy::too_many_arguments)]
fn data_grad(
    dev: &Device,
    cache: &mut ConvCache,
    (dx, acc): (&mut GpuBuf, Accum),
    dyp: u64,
    cdt: DType,
    w: &GpuBuf,
    cs: ConvShape,
    ly: (Layout, bool),
) {
    assert_eq!(dx.len(), cs.x.numel(), "conv3d backward: dinp length");
    let dxdt = dx.dtype();
    let bf = cdt == DType::Bf16 && dxdt == DType::Bf16;
    if wgmma::fits(dev, cs.out(), cs.k, cs.stride, cs.x.c, ly.0, bf) {
        // the data gradient is the forward conv of dy with the flipped, transposed weights
        let (wp, wbf, yd) = (dev.ptr(w), w.dtype() == DType::Bf16, cs.out());
        let worth = wgmma::worth(dev, cs.x, cs.x.c);
        let add = acc == Accum::Add;
        let ours = wgmma_decided(dev, cache, cs, (Dir::BwdData, add), worth, dx.len(), |cache, ours, tp| {
            dgrad_trial(dev, cache, ours, tp, (dyp, wp, wbf), w, cs, acc)
        });
        if ours {
            let (ptrs, modes) =
                ((dyp, wp, 0, dev.ptr_mut(dx), 0), (cache.choices.wgmma_reuse, cache.choices.wgmma_dual));
            if wgmma::run_dgrad(dev, ptrs, wbf, yd, cs.x.c, acc, modes, T_WPD) {
                cache.runs.wgmma_dual += 1;
            }
            cache.runs.wgmma += 1;
            return;
        }
    }
    let ours = small_dgrad(cs)
        && match small_decided(cache, cs, Dir::BwdData) {
            Some(f) => f,
            None => {
                let mut tmp = dev.alloc(dx.len(), dxdt).unwrap_or_else(|e| panic!("{e}"));
                let tp = dev.ptr_mut(&mut tmp);
                let f = time_small(dev, cache, cs, Dir::BwdData, |cache, ours| {
                    if ours {
                        small_dgrad_run(dev, tp, dxdt, Accum::Overwrite, w, dyp, cdt, cs, ly);
                    } else {
                        cudnn_dgrad(dev, cache, tp, dxdt, Accum::Overwrite, w, dyp, cs);
                    }
                });
                dev.sync();
                drop(tmp);
                f
            }
        };
    if small_dgrad(cs) {
        cache.small_used.insert((cs, Dir::BwdData), ours);
    }
    let dxp = dev.ptr_mut(dx);
    if ours {
        small_dgrad_run(dev, dxp, dxdt, acc, w, dyp, cdt, cs, ly);
    } else {
        cudnn_dgrad(dev, cache, dxp, dxdt, acc, w, dyp, cs);
    }
}
