//! The timed choices between conv engines: our wgmma kernels against cuDNN per shape, direction
//! and accumulation ([`wgmma_decided`], [`timed_choice`]), our few-channel kernels against cuDNN
//! ([`small_decided`], [`time_small`]), the channel-padded forward against the plain one
//! ([`forward_typed`]). A decision is timed once (best of five runs of each) and kept in
//! `ConvCache` and its disk cache; a switch that forces or forbids an engine skips the timing.

use meddpm::{Accum, ConvShape, DType, Precision};

use super::algo_cache::{choice_key, ConvCache};
use super::cudnn::{cudnn_dgrad, cudnn_fwd_trial, cudnn_wgrad, forward_plain, T_WPD, T_WPF};
use super::desc::Dir;
use super::pad::{forward_padded, padded_shape};
use super::timing::stream_ms;
use super::wgmma;
use crate::buf::GpuBuf;
use crate::device::Device;

/// Whether `conv3d_wgmma_*` computes (cs, dir) (its channels fit, `wgmma::fits`): forced by
/// `KernelChoices::wgmma`, else, where the volume is large enough (`worth`), timed against cuDNN on first
/// use (`run(cache, ours, target)` computes the direction one way or the other into a scratch
/// bf16 target of `len` elements, accumulated onto it where `add`; the best of five runs each,
/// interleaved) and the faster kept for the shape, direction and `add`, in this process and in the
/// disk cache (keyed by our kernels' sources): later processes take it from there. Timed afresh
/// in every process, the choice flipped between processes where the two are within a few per
/// cent, one source of the ±0.5 ms spread of the whole-head training step between runs.
#[allow(clippy::too_many_arguments)]
pub(super) fn wgmma_decided(
    dev: &Device,
    cache: &mut ConvCache,
    cs: ConvShape,
    (dir, add): (Dir, bool),
    worth: bool,
    len: usize,
    run: impl FnMut(&mut ConvCache, bool, u64),
) -> bool {
    timed_choice(dev, cache, cs, (dir, add, false), worth, len, run)
}

/// [`wgmma_decided`]'s timing and caches, for our plain kernel (`up` false) or for the Upsample
/// conv's kernels that compute or write the doubled input (`up`: `run` times them against the
/// upsampling pass plus cuDNN; their own choice, "wgmma_up" in the disk cache).
#[allow(clippy::too_many_arguments)]
pub(super) fn timed_choice(
    dev: &Device,
    cache: &mut ConvCache,
    cs: ConvShape,
    (dir, add, up): (Dir, bool, bool),
    worth: bool,
    len: usize,
    mut run: impl FnMut(&mut ConvCache, bool, u64),
) -> bool {
    if let Some(f) = cache.choices.wgmma.or_else(|| cache.wgmma.get(&(cs, dir, add, up)).copied()) {
        return f;
    }
    if !worth {
        return false;
    }
    // the data gradients `conv3d_wgmma_dgrad2` computes are their own choice (A/B)
    let dual = dir == Dir::BwdData && wgmma::dual_fits(cs.x.c, cache.choices.wgmma_dual);
    let kind = if up {
        "wgmma_up"
    } else if dual {
        "wgmma2"
    } else {
        "wgmma"
    };
    let k = choice_key(kind, dir, &cs, (cache.layout, cache.precision), add);
    if let Some(on) = cache.disk_choice(&k) {
        if cache.choices.conv_log {
            eprintln!(
                "meddpm-cuda conv {} -> {} k{} s{} {dir:?}{}: {kind} {} (timed by an earlier process, disk cache)",
                cs.x,
                cs.cout,
                cs.k,
                cs.stride,
                if add { " accumulated" } else { "" },
                if on { "kept" } else { "not kept" }
            );
        }
        cache.wgmma.insert((cs, dir, add, up), on);
        return on;
    }
    let mut tmp = dev.alloc(len, DType::Bf16).unwrap_or_else(|e| panic!("{e}"));
    let tp = dev.ptr_mut(&mut tmp);
    let t = best_of_five(dev, cache, |cache, ours| run(cache, ours, tp));
    dev.sync();
    drop(tmp);
    let on = t[1] < t[0];
    if cache.choices.conv_log {
        eprintln!(
            "meddpm-cuda conv {} -> {} k{} s{} {dir:?}{}: {kind} {:.3} ms, cuDNN {:.3} ms",
            cs.x,
            cs.cout,
            cs.k,
            cs.stride,
            if add { " accumulated" } else { "" },
            t[1],
            t[0]
        );
    }
    cache.wgmma.insert((cs, dir, add, up), on);
    cache.remember_choice(k, on);
    on
}

/// [`wgmma_decided`] for the forward of `cs` (accumulated where `add`) with `wgmma::fits`
/// already checked: timed on `inp` and `w` into a scratch of `len` elements.
pub(super) fn wgmma_fwd_chosen(
    dev: &Device,
    cache: &mut ConvCache,
    cs: ConvShape,
    add: bool,
    inp: &GpuBuf,
    w: &GpuBuf,
    len: usize,
) -> bool {
    let (xp, wp, wbf) = (dev.ptr(inp), dev.ptr(w), w.dtype() == DType::Bf16);
    let worth = wgmma::worth(dev, cs.out(), cs.cout);
    let acc = if add { Accum::Add } else { Accum::Overwrite };
    wgmma_decided(dev, cache, cs, (Dir::Fwd, add), worth, len, |cache, ours, tp| {
        if ours {
            wgmma::run(dev, (xp, wp, 0, tp, 0), wbf, cs.x, cs.cout, acc, false, cache.choices.wgmma_reuse, T_WPF);
        } else {
            cudnn_fwd_trial(dev, cache, cs, xp, w, tp, add);
        }
    })
}

/// Whether [`gn_wgmma_forward`] computes the GroupNorm+SiLU → conv `cs` (accumulated or with a
/// residual where `add`) on `inp` with `groups`: `conv3d_wgmma` runs the plain conv of the shape
/// (fits, chosen or forced; the prologue only removes a pass, so it goes wherever the conv does),
/// its table fits, and `wgmma_gn` is on.
pub(crate) fn gn_wgmma_chosen(
    dev: &Device,
    cache: &mut ConvCache,
    cs: ConvShape,
    add: bool,
    (inp, w): (&GpuBuf, &GpuBuf),
    groups: usize,
) -> bool {
    let bf = cache.precision == Precision::Bf16 && inp.dtype() == DType::Bf16;
    cache.choices.wgmma_gn
        && wgmma::fwd_fits(dev, cs, cache.layout, bf)
        && wgmma::gn_fits(cs.x, groups)
        && wgmma_fwd_chosen(dev, cache, cs, add, inp, w, cs.out().numel())
}

/// Whether a decoder ResBlock over cat(a (ca channels), b) runs without the concatenation stored
/// (`Backend::cat_conv_fusable`): in_layers' conv `cs` (over the concatenation, whose buffer `x`
/// is) on `conv3d_wgmma_fwd_gn` ([`gn_wgmma_chosen`]), both parts whole stages of 64 channels,
/// the skip conv's weight `w_skip` bf16 and its shared memory within a block's
/// ([`crate::groupnorm::cat_skip_fits`]), and `cat_free` on.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cat_free_chosen(
    dev: &Device,
    cache: &mut ConvCache,
    cs: ConvShape,
    (x, w, w_skip): (&GpuBuf, &GpuBuf, &GpuBuf),
    ca: usize,
    groups: usize,
) -> bool {
    let c = cs.x.c;
    cache.choices.cat_free
        && ca.is_multiple_of(64)
        && ca < c
        && (c - ca).is_multiple_of(64)
        && cs.cout.is_multiple_of(64)
        && w_skip.dtype() == DType::Bf16
        && w_skip.len() == cs.cout * c
        && crate::groupnorm::cat_skip_fits(c, cs.cout)
        && gn_wgmma_chosen(dev, cache, cs, false, (x, w), groups)
}

/// The forward on operands already in the compute type.
pub(super) fn forward_typed(dev: &Device, cache: &mut ConvCache, cs: ConvShape, xp: u64, wp: u64, bp: u64, yp: u64) {
    if let Some(pcs) = padded_shape(cs) {
        let decided = cache.choices.conv_pad.or_else(|| cache.pads.get(&cs).and_then(|p| p.on));
        let on = match decided {
            Some(on) => on,
            None => {
                // time both (third of three runs each, the first ones include cudnnFind) and keep the faster
                let mut t = [f32::INFINITY; 2];
                for (i, padded) in [false, true].into_iter().enumerate() {
                    for _ in 0..3 {
                        t[i] = stream_ms(dev, || {
                            if padded {
                                forward_padded(dev, cache, cs, pcs, xp, wp, bp, yp);
                            } else {
                                forward_plain(dev, cache, cs, xp, wp, bp, yp, None);
                            }
                        });
                    }
                }
                let on = t[1] < t[0];
                if cache.choices.conv_log {
                    eprintln!(
                        "meddpm-cuda conv {} -> {} k{} s{}: channel-padded {:.3} ms, plain {:.3} ms",
                        cs.x, cs.cout, cs.k, cs.stride, t[1], t[0]
                    );
                }
                cache.pads.get_mut(&cs).expect("created by forward_padded").on = Some(on);
                on
            }
        };
        if on {
            forward_padded(dev, cache, cs, pcs, xp, wp, bp, yp);
            return;
        }
    }
    forward_plain(dev, cache, cs, xp, wp, bp, yp, None);
}

/// Whether (cs, dir) runs our few-channel kernel, if known without timing: forced by
/// `KernelChoices::small_conv`, or decided on an earlier call.
pub(super) fn small_decided(cache: &ConvCache, cs: ConvShape, dir: Dir) -> Option<bool> {
    cache.choices.small_conv.or_else(|| cache.small.get(&(cs, dir)).copied())
}

/// Decide by timing whether (cs, dir) runs our few-channel kernel: `run(cache, ours)` computes the
/// direction one way or the other (into a target the caller may overwrite); the best of five runs
/// each, interleaved, is compared (the first cuDNN one includes cudnnFind), the faster is kept for
/// the shape.
pub(super) fn time_small(
    dev: &Device,
    cache: &mut ConvCache,
    cs: ConvShape,
    dir: Dir,
    run: impl FnMut(&mut ConvCache, bool),
) -> bool {
    let t = best_of_five(dev, cache, run);
    let on = t[1] < t[0];
    if cache.choices.conv_log {
        eprintln!(
            "meddpm-cuda conv {} -> {} k{} s{} {dir:?}: our few-channel kernel {:.3} ms, cuDNN {:.3} ms",
            cs.x, cs.cout, cs.k, cs.stride, t[1], t[0]
        );
    }
    cache.small.insert((cs, dir), on);
    on
}

/// Milliseconds of `run(cache, false)` and `run(cache, true)` on the stream: the best of five runs
/// each, interleaved (clock ramps and cuDNN's first-call setup fall on both sides; the first
/// whole-head measurement kept the last of 3 in a row and chose cuDNN where ours was faster).
fn best_of_five(dev: &Device, cache: &mut ConvCache, mut run: impl FnMut(&mut ConvCache, bool)) -> [f32; 2] {
    let mut t = [f32::INFINITY; 2];
    for _ in 0..5 {
        for (i, ours) in [false, true].into_iter().enumerate() {
            t[i] = t[i].min(stream_ms(dev, || run(cache, ours)));
        }
    }
    t
}

/// Whether `conv3d_wgmma_wgrad` (bf16) or `conv3d_wgmma_wgrad_tf32` (TF32: f32 operands) computes
/// the weight gradient of `cs` (NDHWC): it fits ([`wgmma::wgrad_fits`]), the
/// precision has a kernel (bf16 or TF32; fp32 keeps its exact FMA sums), it is allowed
/// (`wgmma_wgrad`), and it is forced or timed faster than cuDNN's ([`wgmma_decided`], a scratch
/// f32 dW of the weight's length).
pub(super) fn wgmma_wgrad_chosen(dev: &Device, cache: &mut ConvCache, cs: ConvShape, xp: u64, dyp: u64) -> bool {
    let tf32 = cache.precision == Precision::Tf32;
    let ok = matches!(cache.precision, Precision::Bf16 | Precision::Tf32);
    if !(ok && cache.choices.wgmma_wgrad && wgmma::wgrad_fits(dev, cs.x, (cs.k, cs.stride), cs.cout, cache.layout)) {
        return false;
    }
    // Timed at every size: the kernel's blocks are (kd, input group, output slice) triples times
    // chunks of tiles, so small volumes with wide channels still fill the GPU (the forward's
    // `worth` counts output tiles only).
    // the scratch target: 2 · w_len bf16 elements are w_len f32
    wgmma_decided(dev, cache, cs, (Dir::BwdFilter, false), true, 2 * cs.w_len(), |cache, ours, tp| {
        if ours {
            wgmma::wgrad(dev, (xp, dyp, tp), cs.x, cs.cout, tf32);
        } else {
            cudnn_wgrad(dev, cache, tp, xp, dyp, cs);
        }
    })
}

/// One run of the first-use timing of the bf16 data gradient into the scratch target `tp`: our
/// wgmma kernel or cuDNN's.
#[allow(clippy::too_many_arguments)]
pub(super) fn dgrad_trial(
    dev: &Device,
    cache: &mut ConvCache,
    ours: bool,
    tp: u64,
    (dyp, wp, wbf): (u64, u64, bool),
    w: &GpuBuf,
    cs: ConvShape,
    acc: Accum,
) {
    if ours {
        let modes = (cache.choices.wgmma_reuse, cache.choices.wgmma_dual);
        wgmma::run_dgrad(dev, (dyp, wp, 0, tp, 0), wbf, cs.out(), cs.x.c, acc, modes, T_WPD);
    } else {
        cudnn_dgrad(dev, cache, tp, DType::Bf16, acc, w, dyp, cs);
    }
}
