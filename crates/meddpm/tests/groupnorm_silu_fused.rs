//! The fused GroupNorm+SiLU kernels (`cpu/groupnorm.rs`: `groupnorm_silu_forward`,
//! `groupnorm_silu_backward`, one task per (n, group) doing the whole chain) against the
//! composition of the separate primitives (`groupnorm_forward`, `silu_forward`, `silu_backward`,
//! `groupnorm_backward`), in f64 and f32, on odd shapes (a voxel count that is not a multiple of
//! the 8-element reduction chunks, one channel per group, batch 2), with both `Accum` modes.

use meddpm::cpu::float::Float;
use meddpm::cpu::{groupnorm, silu};
use meddpm::testing::{compare, randn_f64, Tolerance};
use meddpm::{Accum, Dims};

fn check<T: Float + Into<f64>>(xd: Dims, groups: usize, tol: Tolerance) {
    let v = |stream, len, scale: f64| -> Vec<T> {
        randn_f64(31, stream, len, scale).into_iter().map(|x| T::from_f64(x + 0.3)).collect()
    };
    let (x, gamma, beta, dout, prior) =
        (v(0, xd.numel(), 1.5), v(1, xd.c, 1.0), v(2, xd.c, 1.0), v(3, xd.numel(), 1.0), v(4, xd.numel(), 1.0));
    let ng = xd.n * groups;
    let name = format!("{xd} / {groups} groups");

    // Forward: composed, then fused.
    let (mut y, mut mean, mut rstd) = (vec![T::zero(); x.len()], vec![T::zero(); ng], vec![T::zero(); ng]);
    groupnorm::groupnorm_forward(&mut y, &mut mean, &mut rstd, &x, &gamma, &beta, xd, groups);
    let mut want = vec![T::zero(); x.len()];
    silu::silu_forward(&mut want, &y);
    let (mut out, mut mean2, mut rstd2) = (vec![T::zero(); x.len()], vec![T::zero(); ng], vec![T::zero(); ng]);
    groupnorm::groupnorm_silu_forward(&mut out, &mut mean2, &mut rstd2, &x, &gamma, &beta, xd, groups);
    compare(&format!("{name}: forward"), &out, &want, tol).unwrap();
    compare(&format!("{name}: mean"), &mean2, &mean, tol).unwrap();
    compare(&format!("{name}: rstd"), &rstd2, &rstd, tol).unwrap();

    for acc in [Accum::Overwrite, Accum::Add] {
        // Composed backward.
        let mut g = vec![T::zero(); x.len()];
        silu::silu_backward((&mut g, Accum::Overwrite), &dout, &y);
        let (mut dx, mut dg, mut db) = (prior.clone(), vec![T::zero(); xd.c], vec![T::zero(); xd.c]);
        groupnorm::groupnorm_backward((&mut dx, acc), &mut dg, &mut db, &g, &x, &mean, &rstd, &gamma, xd, groups);
        // Fused backward.
        let (mut dx2, mut dg2, mut db2) = (prior.clone(), vec![T::zero(); xd.c], vec![T::zero(); xd.c]);
        let mut scratch = vec![T::zero(); x.len()];
        groupnorm::groupnorm_silu_backward(
            (&mut dx2, acc),
            &mut dg2,
            &mut db2,
            &dout,
            &x,
            &mean,
            &rstd,
            &gamma,
            &beta,
            xd,
            groups,
            &mut scratch,
        );
        compare(&format!("{name}: dinp ({acc:?})"), &dx2, &dx, tol).unwrap();
        compare(&format!("{name}: dgamma"), &dg2, &dg, tol).unwrap();
        compare(&format!("{name}: dbeta"), &db2, &db, tol).unwrap();
    }
}

const SHAPES: [(Dims, usize); 3] =
    [(Dims::new(2, 6, 3, 5, 7), 3), (Dims::new(1, 4, 2, 3, 3), 4), (Dims::new(1, 8, 4, 4, 4), 2)];

#[test]
fn fused_equals_composed_f64() {
    for (xd, groups) in SHAPES {
        check::<f64>(xd, groups, Tolerance::new(1e-12, 1e-12));
    }
}

#[test]
fn fused_equals_composed_f32() {
    for (xd, groups) in SHAPES {
        check::<f32>(xd, groups, Tolerance::new(1e-5, 1e-5));
    }
}
