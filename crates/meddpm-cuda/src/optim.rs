//! Adam (torch.optim.Adam semantics, no weight decay) and the EMA update (kernels/optim.cu).
//! Semantics: `Backend::adam_step`, `ema_update`; CPU twin cpu/optim.rs.

use meddpm::backend::AdamStep;

use crate::buf::{require_f32, GpuBuf};
use crate::device::{Arg::*, Device};

pub(crate) fn adam(dev: &Device, p: &mut GpuBuf, g: &GpuBuf, m: &mut GpuBuf, v: &mut GpuBuf, h: AdamStep) {
    let n = p.len();
    assert!(
        g.len() == n && m.len() == n && v.len() == n,
        "adam_step: lengths p {n} g {} m {} v {}",
        g.len(),
        m.len(),
        v.len()
    );
    assert!(h.t >= 1, "adam_step: step count t is 1-based, got 0");
    require_f32("adam_step", &[p, g, m, v]);
    let t = h.t as f64;
    let bc1 = 1.0 - (h.beta1 as f64).powf(t);
    let bc2 = 1.0 - (h.beta2 as f64).powf(t);
    let step_size = (h.lr as f64 / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    dev.launch1(
        "adam_step",
        n,
        &[
            P(dev.ptr_mut(p)),
            P(dev.ptr(g)),
            P(dev.ptr_mut(m)),
            P(dev.ptr_mut(v)),
            F(h.beta1),
            F(h.beta2),
            F(h.eps),
            F(step_size),
            F(bc2_sqrt),
            L(n as i64),
        ],
    );
}

pub(crate) fn ema(dev: &Device, ema: &mut GpuBuf, p: &GpuBuf, decay: f32) {
    assert_eq!(ema.len(), p.len(), "ema_update: lengths differ");
    require_f32("ema_update", &[ema, p]);
    let n = p.len();
    dev.launch1("ema_update", n, &[P(dev.ptr_mut(ema)), P(dev.ptr(p)), F(decay), L(n as i64)]);
}
