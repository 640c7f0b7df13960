//! The Upsample's conv (`Backend::upsample_conv3d_forward` / `_backward`): where our wgmma kernels
//! run it, the forward's producer computes the trilinear doubling of x per stage and the data
//! gradient writes it beside dx for the weight gradient, so no pass stores the doubled volume
//! first (timed as its own choice "wgmma_up"; `KernelChoices::up_conv` off in tests); else an upsampling
//! pass and the plain conv.

use meddpm::{Accum, ConvShape, DType, Precision};

use super::algo_cache::ConvCache;
use super::choose::timed_choice;
use super::cudnn::{cudnn_dgrad, cudnn_fwd_trial, T_WPD, T_WPF};
use super::desc::{check_lens, compute_type, Dir};
use super::paths::{backward, bias_grad, forward, weight_grad};
use super::wgmma;
use crate::buf::{require_f32, GpuBuf, Mode};
use crate::device::Device;

/// `Backend::upsample_conv3d_forward`: out = conv(up(x), w) (+ b), x of dims `xd`, `cs.x` its
/// trilinear doubling. `conv3d_wgmma_fwd_up` computes the doubling in its producer (`u` stays
/// unwritten) where `conv3d_wgmma` fits `cs`, `KernelChoices::up_conv` is on and the first-use timing
/// keeps it (its own choice: the fused kernel against the upsampling pass and cuDNN's conv; a
/// shape shared with the ResBlocks' convs is timed apart from them); else x is doubled into `u`
/// and [`forward`] runs on it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn upsample_forward(
    dev: &Device,
    cache: &mut ConvCache,
    out: &mut GpuBuf,
    u: &mut GpuBuf,
    x: &GpuBuf,
    xd: meddpm::Dims,
    w: &GpuBuf,
    b: Option<&GpuBuf>,
    cs: ConvShape,
) {
    assert_eq!(cs.x, xd.up2(), "upsample conv: its input {} is not the doubling of {xd}", cs.x);
    let bf = cache.precision == Precision::Bf16 && [x, &*u, &*out].iter().all(|t| t.dtype() == DType::Bf16);
    if cache.choices.up_conv && wgmma::fwd_fits(dev, cs, cache.layout, bf) {
        check_lens(cs, u.len(), w.len(), out.len(), b.map_or(cs.cout, |b| b.len()));
        assert_eq!(x.len(), xd.numel(), "upsample conv: x length vs {xd}");
        let (xp, wp, wbf, reuse) = (dev.ptr(x), dev.ptr(w), w.dtype() == DType::Bf16, cache.choices.wgmma_reuse);
        let worth = wgmma::worth(dev, cs.out(), cs.cout);
        let up = dev.ptr_mut(u);
        let ours = timed_choice(dev, cache, cs, (Dir::Fwd, false, true), worth, out.len(), |cache, ours, tp| {
            if ours {
                wgmma::run_up(dev, (xp, wp, 0, tp), wbf, cs.x, cs.cout, reuse, T_WPF);
            } else {
                crate::upsample::forward_ptrs(dev, (up, xp), xd, Mode::new(cache.layout, DType::Bf16));
                cudnn_fwd_trial(dev, cache, cs, up, w, tp, false);
            }
        });
        if ours {
            if let Some(b) = b {
                require_f32("conv3d bias", &[b]);
            }
            *cache.fwd_calls.entry(cs).or_insert(0) += 1;
            let ptrs = (xp, wp, b.map_or(0, |b| dev.ptr(b)), dev.ptr_mut(out));
            wgmma::run_up(dev, ptrs, wbf, cs.x, cs.cout, reuse, T_WPF);
            cache.runs.wgmma += 1;
            cache.runs.up_conv += 1;
            return;
        }
    }
    crate::upsample::forward(dev, u, x, xd, cache.layout);
    forward(dev, cache, (out, Accum::Overwrite), u, w, b, cs);
}

/// `Backend::upsample_conv3d_backward`: du (overwritten) = the data gradient, dw += and db += the
/// weight and bias gradients of the conv over up(x) (`cs.x` the doubling of `xd`). Where
/// `conv3d_wgmma` fits the data gradient with the window of planes (64 channels of dout, one
/// slice a block), `KernelChoices::up_conv` is on and the first-use timing keeps it (against the
/// upsampling pass and cuDNN's data gradient), `conv3d_wgmma_dgrad_up` computes du and writes the
/// doubling into `u` beside it, and the weight gradient reads `u`; else x is doubled into `u` and
/// [`backward`] runs on it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn upsample_backward(
    dev: &Device,
    cache: &mut ConvCache,
    du: &mut GpuBuf,
    u: &mut GpuBuf,
    dw: &mut GpuBuf,
    db: Option<&mut GpuBuf>,
    dout: &GpuBuf,
    x: &GpuBuf,
    xd: meddpm::Dims,
    w: &GpuBuf,
    cs: ConvShape,
) {
    assert_eq!(cs.x, xd.up2(), "upsample conv backward: its input {} is not the doubling of {xd}", cs.x);
    let cdt = compute_type(cache.precision);
    let yd = cs.out();
    let bf = cdt == DType::Bf16 && [x, &*u, &*du, dout].iter().all(|t| t.dtype() == DType::Bf16);
    if cache.choices.up_conv
        && bf
        && yd.c == 64
        && cache.choices.wgmma_reuse
        && !wgmma::dual_fits(cs.x.c, cache.choices.wgmma_dual)
        && wgmma::fits(dev, yd, cs.k, cs.stride, cs.x.c, cache.layout, true)
    {
        check_lens(cs, u.len(), w.len(), dout.len(), cs.cout);
        assert!(du.len() == u.len() && x.len() == xd.numel(), "upsample conv backward: du / x lengths vs {xd}");
        assert_eq!(dw.len(), cs.w_len(), "conv3d backward: dw length");
        require_f32("conv3d backward: dw", &[dw]);
        let (dyp, wp, wbf, xp, up) = (dev.ptr(dout), dev.ptr(w), w.dtype() == DType::Bf16, dev.ptr(x), dev.ptr_mut(u));
        let worth = wgmma::worth(dev, cs.x, cs.x.c);
        let ours = timed_choice(dev, cache, cs, (Dir::BwdData, false, true), worth, du.len(), |cache, ours, tp| {
            if ours {
                wgmma::run_dgrad_up(dev, (dyp, wp, tp), wbf, yd, cs.x.c, (xp, up), T_WPD);
            } else {
                cudnn_dgrad(dev, cache, tp, DType::Bf16, Accum::Overwrite, w, dyp, cs);
                crate::upsample::forward_ptrs(dev, (up, xp), xd, Mode::new(cache.layout, DType::Bf16));
            }
        });
        if ours {
            bias_grad(dev, db, dout, yd, cache.layout);
            wgmma::run_dgrad_up(dev, (dyp, wp, dev.ptr_mut(du)), wbf, yd, cs.x.c, (xp, up), T_WPD);
            cache.runs.wgmma += 1;
            cache.runs.up_conv += 1;
            weight_grad(dev, cache, dw, up, dyp, cs, (cache.layout, cache.mma_on()));
            return;
        }
    }
    crate::upsample::forward(dev, u, x, xd, cache.layout);
    backward(dev, cache, Some((du, Accum::Overwrite)), dw, db, dout, u, w, cs);
}
