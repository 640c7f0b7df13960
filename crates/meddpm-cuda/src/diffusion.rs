//! Diffusion helpers on the device (kernels/diffusion.cu): Philox normals identical to
//! crates/meddpm/src/rng.rs (element i in logical NCDHW order, whatever the layout), q_sample and
//! one ancestral DDPM step; the training input (draw, q_sample and concatenation in one pass).
//! Semantics: `Backend::randn`, `q_sample`, `q_sample_input`, `ddpm_step`.
//! Per-sample coefficients travel by value in the kernel parameters, 16 samples per launch.

use meddpm::backend::DdpmCoefs;
use meddpm::rng::Philox;
use meddpm::{Dims, Layout};

use crate::buf::{require_f32, GpuBuf};
use crate::device::{Arg::*, Device};

const PER_LAUNCH: usize = 16;

#[repr(C)]
struct QCoef {
    a: [f32; PER_LAUNCH],
    b: [f32; PER_LAUNCH],
}

impl QCoef {
    /// The coefficients of samples n0 .. n0 + cnt (cnt <= PER_LAUNCH), zero past them.
    fn of(a: &[f32], b: &[f32], n0: usize, cnt: usize) -> QCoef {
        let mut k = QCoef { a: [0.0; PER_LAUNCH], b: [0.0; PER_LAUNCH] };
        k.a[..cnt].copy_from_slice(&a[n0..n0 + cnt]);
        k.b[..cnt].copy_from_slice(&b[n0..n0 + cnt]);
        k
    }
}

#[repr(C)]
struct DdpmCoef {
    v: [f32; PER_LAUNCH * 5],
}

pub(crate) fn randn(dev: &Device, out: &mut GpuBuf, rng: Philox, offset: u64, x: Dims, layout: Layout) {
    let cl = layout == Layout::Ndhwc;
    assert_eq!(out.len(), x.numel(), "randn {x}: buffer length");
    require_f32("randn", &[out]);
    dev.launch1(
        "randn",
        x.numel(),
        &[
            P(dev.ptr_mut(out)),
            U(rng.seed),
            U(rng.stream),
            U(offset),
            I(x.c as i32),
            L(x.s() as i64),
            L(x.numel() as i64),
            I(cl as i32),
        ],
    );
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn q_sample(dev: &Device, xt: &mut GpuBuf, x0: &GpuBuf, eps: &GpuBuf, a: &[f32], b: &[f32], x: Dims) {
    assert!(
        xt.len() == x.numel() && x0.len() == x.numel() && eps.len() == x.numel() && a.len() == x.n && b.len() == x.n,
        "q_sample {x}: lengths xt {} x0 {} eps {} a {} b {}",
        xt.len(),
        x0.len(),
        eps.len(),
        a.len(),
        b.len()
    );
    require_f32("q_sample", &[xt, x0, eps]);
    let per = x.numel() / x.n.max(1);
    let (xp, x0p, ep) = (dev.ptr_mut(xt), dev.ptr(x0), dev.ptr(eps));
    for n0 in (0..x.n).step_by(PER_LAUNCH) {
        let cnt = PER_LAUNCH.min(x.n - n0);
        let k = QCoef::of(a, b, n0, cnt);
        let off = (n0 * per * 4) as u64;
        dev.launch1(
            "q_sample",
            cnt * per,
            &[
                P(xp + off),
                P(x0p + off),
                P(ep + off),
                Raw(&k as *const QCoef as _),
                L(per as i64),
                L((cnt * per) as i64),
            ],
        );
    }
}

/// `Backend::q_sample_input` in one pass (kernel q_sample_input): eps drawn, x_t = a·x0 + b·eps,
/// input = cat([x_t, cond]); `x` is x0's shape, `cc` cond's channels.
#[allow(clippy::too_many_arguments)]
pub(crate) fn q_sample_input(
    dev: &Device,
    (input, eps): (&mut GpuBuf, &mut GpuBuf),
    (x0, cond): (&GpuBuf, &GpuBuf),
    rng: Philox,
    offset: u64,
    (a, b): (&[f32], &[f32]),
    x: Dims,
    cc: usize,
    layout: Layout,
) {
    let cl = layout == Layout::Ndhwc;
    let (ci, s) = (x.c, x.s());
    assert!(
        input.len() == x.with_c(ci + cc).numel()
            && eps.len() == x.numel()
            && x0.len() == x.numel()
            && cond.len() == x.with_c(cc).numel()
            && a.len() == x.n
            && b.len() == x.n,
        "q_sample_input {x}, {cc} condition channels: lengths input {} eps {} x0 {} cond {} a {} b {}",
        input.len(),
        eps.len(),
        x0.len(),
        cond.len(),
        a.len(),
        b.len()
    );
    require_f32("q_sample_input", &[input, eps, x0, cond]);
    let (ip, ep, xp, cp) = (dev.ptr_mut(input), dev.ptr_mut(eps), dev.ptr(x0), dev.ptr(cond));
    for n0 in (0..x.n).step_by(PER_LAUNCH) {
        let cnt = PER_LAUNCH.min(x.n - n0);
        let k = QCoef::of(a, b, n0, cnt);
        let at = |c: usize| (n0 * c * s * 4) as u64; // byte offset of sample n0 in a c-channel buffer
        dev.launch1(
            "q_sample_input",
            cnt * s,
            &[
                P(ip + at(ci + cc)),
                P(ep + at(ci)),
                P(xp + at(ci)),
                P(cp + at(cc)),
                Raw(&k as *const QCoef as _),
                U(rng.seed),
                U(rng.stream),
                U(offset + (n0 * ci * s) as u64),
                I(ci as i32),
                I(cc as i32),
                L(s as i64),
                L((cnt * s) as i64),
                I(cl as i32),
            ],
        );
    }
}

pub(crate) fn ddpm_step(dev: &Device, x: &mut GpuBuf, eps: &GpuBuf, z: &GpuBuf, coefs: &[DdpmCoefs], xd: Dims) {
    assert!(
        x.len() == xd.numel() && eps.len() == xd.numel() && z.len() == xd.numel() && coefs.len() == xd.n,
        "ddpm_step {xd}: lengths x {} eps {} z {} coefs {}",
        x.len(),
        eps.len(),
        z.len(),
        coefs.len()
    );
    require_f32("ddpm_step", &[x, eps, z]);
    let per = xd.numel() / xd.n.max(1);
    let (xp, ep, zp) = (dev.ptr_mut(x), dev.ptr(eps), dev.ptr(z));
    for n0 in (0..xd.n).step_by(PER_LAUNCH) {
        let cnt = PER_LAUNCH.min(xd.n - n0);
        let mut k = DdpmCoef { v: [0.0; PER_LAUNCH * 5] };
        for (j, c) in coefs[n0..n0 + cnt].iter().enumerate() {
            k.v[5 * j..5 * j + 5].copy_from_slice(&[c.recip, c.recipm1, c.coef1, c.coef2, c.sigma]);
        }
        let off = (n0 * per * 4) as u64;
        dev.launch1(
            "ddpm_step",
            cnt * per,
            &[
                P(xp + off),
                P(ep + off),
                P(zp + off),
                Raw(&k as *const DdpmCoef as _),
                L(per as i64),
                L((cnt * per) as i64),
            ],
        );
    }
}
