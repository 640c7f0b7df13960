//! Loss of ε̂ against ε (guided-diffusion `mean_flat` over all elements, then batch mean, which
//! for equal-size samples is the mean over every element): L1 |p − t| (Med-DDPM's default) or
//! L2 (p − t)². Backward: dpred = scale·sign(p − t)/numel (sign(0) = 0, as `torch.sign`) or
//! scale·2(p − t)/numel.

use rayon::prelude::*;

use super::float::Float;
use crate::backend::LossKind;

const CHUNK: usize = 1 << 14;

/// Mean loss over all elements (f64 accumulation).
pub fn loss_forward<T: Float>(pred: &[T], target: &[T], kind: LossKind) -> T {
    assert_eq!(pred.len(), target.len(), "loss: pred vs target length");
    assert!(!pred.is_empty(), "loss: empty prediction");
    let sum: f64 = pred
        .par_chunks(CHUNK)
        .zip(target.par_chunks(CHUNK))
        .map(|(p, t)| {
            p.iter()
                .zip(t)
                .map(|(&p, &t)| {
                    let d = p.to_f64() - t.to_f64();
                    match kind {
                        LossKind::L1 => d.abs(),
                        LossKind::L2 => d * d,
                    }
                })
                .sum::<f64>()
        })
        .sum();
    T::from_f64(sum / pred.len() as f64)
}

/// dpred (overwritten) = scale · ∂(mean loss)/∂pred.
pub fn loss_backward<T: Float>(dpred: &mut [T], pred: &[T], target: &[T], kind: LossKind, scale: T) {
    assert!(dpred.len() == pred.len() && pred.len() == target.len(), "loss: dpred/pred/target length");
    let k = scale / T::from_f64(pred.len() as f64);
    let two = T::from_f64(2.0);
    dpred.par_chunks_mut(CHUNK).zip(pred.par_chunks(CHUNK).zip(target.par_chunks(CHUNK))).for_each(|(g, (p, t))| {
        for (gv, (&pv, &tv)) in g.iter_mut().zip(p.iter().zip(t)) {
            let d = pv - tv;
            *gv = match kind {
                LossKind::L1 if d > T::zero() => k,
                LossKind::L1 if d < T::zero() => -k,
                LossKind::L1 => T::zero(),
                LossKind::L2 => k * two * d,
            };
        }
    });
}
