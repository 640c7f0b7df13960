//! The cuDNN convolution calls: forward (plain, β = 1 accumulation, bias and residual fused
//! into `cudnnConvolutionBiasActivationForward`), data and weight gradient.
//!
//! - Operand types: the compute type is bf16 under `Bf16`, else f32. An operand of the other type
//!   (the network's f32 input and output, an f32 weight) is converted through a kept temporary
//!   ([`operand`]); under `Bf16` the weight gradient is written by cuDNN in bf16 into a temporary
//!   and added to the f32 gradient.
//! - Bias: fused into cuDNN (identity activation) when the algorithm is IMPLICIT_PRECOMP_GEMM and
//!   timing on first use says it is faster, else our `add_channel_bias` kernel; under bf16 the
//!   fused call takes the bias rounded to bf16 (cuDNN wants it in the output's type; PyTorch's
//!   autocast rounds a conv bias the same way). The same call adds a residual tensor z
//!   (`Backend::conv3d_forward_res`): y = conv + z + b in one pass instead of our bias kernel
//!   writing z + b and the conv adding onto it (β = 1).

use cudarc::cudnn::sys as nsys;
use meddpm::{Accum, ConvShape, DType, Layout};

use super::algo_cache::ConvCache;
use super::desc::{bwd_data_algo, bwd_filter_algo, ck, compute_type, fwd_algo, Algo, Dir};
use super::timing::stream_ms;
use crate::buf::{GpuBuf, Mode};
use crate::device::Device;

/// Temporary slots of converted operands (see `Device::temp`).
pub(super) const T_X: u8 = 10;
pub(super) const T_W: u8 = 11;
pub(super) const T_Y: u8 = 12;
pub(super) const T_DY: u8 = 13;
const T_DX: u8 = 14;
const T_DW: u8 = 15;
const T_B: u8 = 16;
pub(super) const T_P: u8 = 17;
pub(super) const T_WF: u8 = 18;
pub(super) const T_WPF: u8 = 19;
pub(super) const T_WPD: u8 = 20;

/// Address of `b`'s data in type `dt`: the buffer itself, or a kept temporary (slot) holding its
/// conversion.
pub(super) fn operand(dev: &Device, b: &GpuBuf, dt: DType, slot: u8) -> u64 {
    if b.dtype() == dt {
        return dev.ptr(b);
    }
    let t = dev.temp(b.len(), dt, slot);
    dev.cast(t, dt, dev.ptr(b), b.dtype(), b.len(), false);
    t
}

/// One cuDNN run of a forward's first-use timing: the bf16 conv of x (at `xp`) with w into the
/// scratch `tp` (added onto it where `add`); cudnnFind (first use) writes its output, the scratch.
pub(super) fn cudnn_fwd_trial(
    dev: &Device,
    cache: &mut ConvCache,
    cs: ConvShape,
    xp: u64,
    w: &GpuBuf,
    tp: u64,
    add: bool,
) {
    let wc = operand(dev, w, DType::Bf16, T_W);
    let a = cache.algo(dev, Dir::Fwd, cs, xp, wc, tp);
    run_forward_beta(dev, cache, a, cs, xp, wc, tp, if add { 1.0 } else { 0.0 });
}

/// The unpadded forward y = conv(x, w) + b (+ z where given, a tensor of y's dims and type):
/// cuDNN with the bias (and z) fused, or cuDNN's conv then our bias kernel (chosen by timing).
#[allow(clippy::too_many_arguments)]
pub(super) fn forward_plain(
    dev: &Device,
    cache: &mut ConvCache,
    cs: ConvShape,
    xp: u64,
    wp: u64,
    bp: u64,
    yp: u64,
    z: Option<u64>,
) {
    let a = cache.algo(dev, Dir::Fwd, cs, xp, wp, yp);
    let r = z.is_some() as usize;
    let can_fuse = a.id == nsys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM as u32;
    let fused = match (can_fuse, cache.choices.fused_bias, cache.plan(cs).fused_bias[r]) {
        (false, _, _) => false,
        (true, Some(f), _) => f,
        (true, None, Some(f)) => f,
        (true, None, None) => {
            // time both variants (second of two runs each) and keep the faster
            let mut t = [f32::INFINITY; 2];
            for f in [false, true] {
                for _ in 0..2 {
                    let mut ok = true;
                    let ms = stream_ms(dev, || {
                        ok = run_forward(dev, cache, a, cs, f, xp, wp, bp, yp, cache.layout, true, z)
                    });
                    t[f as usize] = if ok { ms } else { f32::INFINITY };
                    if !ok {
                        break;
                    }
                }
            }
            let f = t[1] < t[0];
            if cache.choices.conv_log {
                eprintln!(
                    "meddpm-cuda conv {} -> {} k{} s{}{}: bias fused into cuDNN {:.3} ms, separate {:.3} ms: {}",
                    cs.x,
                    cs.cout,
                    cs.k,
                    cs.stride,
                    if z.is_some() { " + residual" } else { "" },
                    t[1],
                    t[0],
                    if f { "fused" } else { "separate" }
                );
            }
            cache.plan(cs).fused_bias[r] = Some(f);
            f
        }
    };
    if !run_forward(dev, cache, a, cs, fused, xp, wp, bp, yp, cache.layout, true, z) {
        if cache.choices.conv_log {
            eprintln!("meddpm-cuda conv {} -> {} k{}: cuDNN refused the fused bias call", cs.x, cs.cout, cs.k);
        }
        cache.plan(cs).fused_bias[r] = Some(false);
        run_forward(dev, cache, a, cs, false, xp, wp, bp, yp, cache.layout, true, z);
    }
}

/// One forward y = conv(x, w) (+ b where `bias`) (+ z where given): fused conv+bias(+z) through
/// cuDNN (y = conv + 1·z + b; under bf16 the f32 bias is rounded to bf16 first, as cuDNN takes it
/// in the output's type and PyTorch's autocast rounds it), or our bias kernel (onto z first where
/// given) and cuDNN's conv (β = 1 onto it). Returns false when cuDNN refuses the fused call (the
/// caller falls back).
#[allow(clippy::too_many_arguments)]
pub(super) fn run_forward(
    dev: &Device,
    cache: &mut ConvCache,
    a: Algo,
    cs: ConvShape,
    fused: bool,
    xp: u64,
    wp: u64,
    bp: u64,
    yp: u64,
    layout: Layout,
    bias: bool,
    z: Option<u64>,
) -> bool {
    let cl = layout == Layout::Ndhwc;
    let cdt = compute_type(cache.precision);
    let bf = (cdt == DType::Bf16) as i32;
    if fused {
        let bp = if cdt == DType::Bf16 {
            let t = dev.temp(cs.cout, DType::Bf16, T_B);
            dev.cast(t, DType::Bf16, bp, DType::F32, cs.cout, false);
            t
        } else {
            bp
        };
        let act = cache.identity.0;
        let p = cache.plan(cs);
        let ws = dev.workspace(a.ws);
        let wsp = ws_ptr(dev, &ws);
        let (one, alpha2) = (1.0f32, if z.is_some() { 1.0f32 } else { 0.0 });
        dev.bind();
        let st = unsafe {
            nsys::cudnnConvolutionBiasActivationForward(
                dev.cudnn.0,
                &one as *const f32 as _,
                p.x.0,
                xp as _,
                p.w.0,
                wp as _,
                p.conv[0].0,
                fwd_algo(a.id),
                wsp as _,
                a.ws,
                &alpha2 as *const f32 as _,
                p.y.0,
                z.unwrap_or(yp) as _,
                p.bias.0,
                bp as _,
                act,
                p.y.0,
                yp as _,
            )
        };
        if st != nsys::cudnnStatus_t::CUDNN_STATUS_SUCCESS && cache.choices.conv_log {
            eprintln!(
                "meddpm-cuda conv {} -> {} k{}: cudnnConvolutionBiasActivationForward: {st:?}",
                cs.x, cs.cout, cs.k
            );
        }
        return st == nsys::cudnnStatus_t::CUDNN_STATUS_SUCCESS;
    }
    match z {
        Some(zp) => {
            assert!(bias, "conv3d forward with a residual: the bias pass writes z + b first");
            crate::elementwise::add_channel_bias_to(dev, yp, zp, bp, cs.out(), Mode::from_flags(cl, bf), false);
            run_forward_beta(dev, cache, a, cs, xp, wp, yp, 1.0);
        }
        None => {
            run_forward_beta(dev, cache, a, cs, xp, wp, yp, 0.0);
            if bias {
                crate::elementwise::add_channel_bias(dev, yp, bp, cs.out(), Mode::from_flags(cl, bf), false);
            }
        }
    }
    true
}

/// y = conv(x, w) + β·y through cudnnConvolutionForward with algorithm `a`.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_forward_beta(
    dev: &Device,
    cache: &mut ConvCache,
    a: Algo,
    cs: ConvShape,
    xp: u64,
    wp: u64,
    yp: u64,
    beta: f32,
) {
    let p = cache.plan(cs);
    let ws = dev.workspace(a.ws);
    let wsp = ws_ptr(dev, &ws);
    let one = 1.0f32;
    dev.bind();
    ck(
        unsafe {
            nsys::cudnnConvolutionForward(
                dev.cudnn.0,
                &one as *const f32 as _,
                p.x.0,
                xp as _,
                p.w.0,
                wp as _,
                p.conv[0].0,
                fwd_algo(a.id),
                wsp as _,
                a.ws,
                &beta as *const f32 as _,
                p.y.0,
                yp as _,
            )
        },
        "cudnnConvolutionForward",
    );
}

fn ws_ptr(dev: &Device, ws: &cudarc::driver::CudaSlice<u8>) -> u64 {
    use cudarc::driver::DevicePtr;
    let (p, _g) = ws.device_ptr(&dev.stream);
    p
}

/// dW (f32 at `dw`) += the weight gradient through cuDNN: beta = 1 into the f32 gradient, or
/// (bf16) beta = 0 into a bf16 temporary then added to it.
pub(super) fn cudnn_wgrad(dev: &Device, cache: &mut ConvCache, dw: u64, xp: u64, dyp: u64, cs: ConvShape) {
    let cdt = compute_type(cache.precision);
    let one = 1.0f32;
    let beta = if cdt == DType::F32 { 1.0f32 } else { 0.0 };
    let dwp = if cdt == DType::F32 { dw } else { dev.temp(cs.w_len(), cdt, T_DW) };
    // cudnnFind writes its output, so it gets a scratch dw.
    let a = if cache.plan(cs).algo[2].is_some() {
        cache.algo(dev, Dir::BwdFilter, cs, xp, 0, dyp)
    } else {
        let mut tmp = dev.alloc(cs.w_len(), cdt).unwrap_or_else(|e| panic!("{e}"));
        let tp = dev.ptr_mut(&mut tmp);
        let a = cache.algo(dev, Dir::BwdFilter, cs, xp, tp, dyp);
        dev.sync();
        drop(tmp);
        a
    };
    {
        let p = cache.plan(cs);
        let ws = dev.workspace(a.ws);
        let wsp = ws_ptr(dev, &ws);
        dev.bind();
        ck(
            unsafe {
                nsys::cudnnConvolutionBackwardFilter(
                    dev.cudnn.0,
                    &one as *const f32 as _,
                    p.x.0,
                    xp as _,
                    p.y.0,
                    dyp as _,
                    p.conv[2].0,
                    bwd_filter_algo(a.id),
                    wsp as _,
                    a.ws,
                    &beta as *const f32 as _,
                    p.w.0,
                    dwp as _,
                )
            },
            "cudnnConvolutionBackwardFilter",
        );
    }
    if cdt != DType::F32 {
        dev.cast(dw, DType::F32, dwp, cdt, cs.w_len(), true);
    }
}

/// dx (type `dxdt`; = or += per `acc`) = the data gradient through cuDNN, from dy in the compute
/// type (an input gradient of the other type goes through a temporary).
#[allow(clippy::too_many_arguments)]
pub(super) fn cudnn_dgrad(
    dev: &Device,
    cache: &mut ConvCache,
    dxp: u64,
    dxdt: DType,
    acc: Accum,
    w: &GpuBuf,
    dyp: u64,
    cs: ConvShape,
) {
    let cdt = compute_type(cache.precision);
    let wp = operand(dev, w, cdt, T_W);
    let n = cs.x.numel();
    let (one, zero) = (1.0f32, 0.0f32);
    let direct = dxdt == cdt;
    let (dxc, acc_c) = if direct { (dxp, acc) } else { (dev.temp(n, cdt, T_DX), Accum::Overwrite) };
    let a = if cache.plan(cs).algo[1].is_some() || acc_c == Accum::Overwrite {
        cache.algo(dev, Dir::BwdData, cs, dxc, wp, dyp)
    } else {
        let mut tmp = dev.alloc(n, cdt).unwrap_or_else(|e| panic!("{e}"));
        let tp = dev.ptr_mut(&mut tmp);
        let a = cache.algo(dev, Dir::BwdData, cs, tp, wp, dyp);
        dev.sync();
        drop(tmp);
        a
    };
    let p = cache.plan(cs);
    let ws = dev.workspace(a.ws);
    let wsp = ws_ptr(dev, &ws);
    let beta = if acc_c == Accum::Add { one } else { zero };
    dev.bind();
    ck(
        unsafe {
            nsys::cudnnConvolutionBackwardData(
                dev.cudnn.0,
                &one as *const f32 as _,
                p.w.0,
                wp as _,
                p.y.0,
                dyp as _,
                p.conv[1].0,
                bwd_data_algo(a.id),
                wsp as _,
                a.ws,
                &beta as *const f32 as _,
                p.x.0,
                dxc as _,
            )
        },
        "cudnnConvolutionBackwardData",
    );
    drop(ws);
    if !direct {
        dev.cast(dxp, dxdt, dxc, cdt, n, acc == Accum::Add);
    }
}
