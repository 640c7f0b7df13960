//! Mean L1 / L2 loss and its gradient (kernels/loss.cu). Semantics: `Backend::loss_*`
//! (torch.nn.functional.l1_loss / mse_loss, reduction "mean"); CPU twin cpu/loss.rs.

use meddpm::LossKind;

use crate::buf::{require_f32, GpuBuf};
use crate::device::{Arg::*, Device};

const PARTS: usize = 1024;

fn kind_id(k: LossKind) -> i32 {
    match k {
        LossKind::L1 => 0,
        LossKind::L2 => 1,
    }
}

pub(crate) fn forward(dev: &Device, loss: &mut GpuBuf, pred: &GpuBuf, target: &GpuBuf, kind: LossKind) {
    assert!(
        pred.len() == target.len() && !loss.is_empty(),
        "loss: pred {} target {} loss {}",
        pred.len(),
        target.len(),
        loss.len()
    );
    require_f32("loss", &[loss, pred, target]);
    let n = pred.len();
    let blocks = n.div_ceil(256).clamp(1, PARTS);
    let part = dev.scratch(PARTS);
    let pp = dev.ptr(&*part);
    dev.launch(
        "loss_partial",
        (blocks as u32, 1, 1),
        (256, 1, 1),
        &[P(dev.ptr(pred)), P(dev.ptr(target)), P(pp), L(n as i64), I(kind_id(kind))],
    );
    dev.launch(
        "loss_final",
        (1, 1, 1),
        (1024, 1, 1),
        &[P(pp), I(blocks as i32), P(dev.ptr_mut(loss)), D(1.0 / n as f64)],
    );
}

pub(crate) fn backward(dev: &Device, dpred: &mut GpuBuf, pred: &GpuBuf, target: &GpuBuf, kind: LossKind, scale: f32) {
    assert!(pred.len() == target.len() && dpred.len() == pred.len(), "loss backward: lengths");
    require_f32("loss backward", &[dpred, pred, target]);
    let n = pred.len();
    let k = (scale as f64 / n as f64) as f32;
    dev.launch1(
        "loss_bwd",
        n,
        &[P(dev.ptr_mut(dpred)), P(dev.ptr(pred)), P(dev.ptr(target)), L(n as i64), I(kind_id(kind)), F(k)],
    );
}
