//! One sampler step on the device (kernels/sampler.cu): the update every sampler of
//! `meddpm::diffusion::solvers` runs once per network evaluation, with per-sample Philox noise
//! drawn in the kernel (identical to the CPU's `rng.rs`, element j in logical NCDHW order).
//! Semantics: `Backend::sampler_step`; CPU twin: crates/meddpm/src/cpu/sampler.rs.
//! Per-sample coefficients travel by value in the kernel parameters, 16 samples per launch.

use meddpm::backend::{Prediction, SamplerCoefs};
use meddpm::{Dims, Layout};

use crate::buf::{require_f32, GpuBuf};
use crate::device::{Arg::*, Device};

const PER_LAUNCH: usize = 16;

/// Mirrors `struct SamplerCoef` of sampler.cu.
#[repr(C)]
struct SamplerCoef {
    v: [f32; PER_LAUNCH * 8],
    seed: [u64; PER_LAUNCH],
    stream: [u64; PER_LAUNCH],
    offset: [u64; PER_LAUNCH],
}

pub(crate) fn sampler_step(
    dev: &Device,
    x: &mut GpuBuf,
    eps: &GpuBuf,
    hist: &mut [GpuBuf],
    pred: Prediction,
    clip: bool,
    coefs: &[SamplerCoefs],
    xd: Dims,
    layout: Layout,
) {
    let cl = layout == Layout::Ndhwc;
    assert!(
        x.len() == xd.numel() && eps.len() == xd.numel() && coefs.len() == xd.n,
        "sampler_step {xd}: lengths x {} eps {} coefs {}",
        x.len(),
        eps.len(),
        coefs.len()
    );
    assert!(hist.len() <= 3, "sampler_step: {} history buffers, at most 3", hist.len());
    require_f32("sampler_step", &[x, eps]);
    require_f32("sampler_step history", &hist.iter().collect::<Vec<_>>());
    assert!(hist.iter().all(|h| h.len() == xd.numel()), "sampler_step {xd}: history length");
    let per = xd.numel() / xd.n.max(1);
    let (xp, ep) = (dev.ptr_mut(x), dev.ptr(eps));
    let mut hp = [0u64; 3];
    for (p, h) in hp.iter_mut().zip(hist.iter_mut()) {
        *p = dev.ptr_mut(h);
    }
    for n0 in (0..xd.n).step_by(PER_LAUNCH) {
        let cnt = PER_LAUNCH.min(xd.n - n0);
        let mut k = SamplerCoef {
            v: [0.0; PER_LAUNCH * 8],
            seed: [0; PER_LAUNCH],
            stream: [0; PER_LAUNCH],
            offset: [0; PER_LAUNCH],
        };
        for (j, c) in coefs[n0..n0 + cnt].iter().enumerate() {
            k.v[8 * j..8 * j + 8].copy_from_slice(&[c.recip, c.recipm1, c.cx, c.cd, c.ch[0], c.ch[1], c.ch[2], c.cz]);
            k.seed[j] = c.noise.seed;
            k.stream[j] = c.noise.stream;
            k.offset[j] = c.offset;
        }
        let off = (n0 * per * 4) as u64;
        let h = |p: u64| if p == 0 { 0 } else { p + off };
        dev.launch1(
            "sampler_step",
            cnt * per,
            &[
                P(xp + off),
                P(ep + off),
                P(h(hp[0])),
                P(h(hp[1])),
                P(h(hp[2])),
                I(hist.len() as i32),
                I((pred == Prediction::Noise) as i32),
                I(clip as i32),
                Raw(&k as *const SamplerCoef as _),
                I(xd.c as i32),
                L(xd.s() as i64),
                I(cl as i32),
                L(per as i64),
                L((cnt * per) as i64),
            ],
        );
    }
}
