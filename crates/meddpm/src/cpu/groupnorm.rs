//! GroupNorm (PyTorch `nn.GroupNorm(groups, C, eps=1e-5, affine=True)`): forward saving the
//! per-(n, group) mean and reciprocal standard deviation, and the standard backward.
//!
//! For batch element n and group g (channels g·C/G .. (g+1)·C/G, all voxels), with biased
//! variance: x̂ = (x − μ)·rstd, rstd = 1/√(σ² + eps), out = γ[c]·x̂ + β[c].
//! Backward, with m = elements per group and ĝ = dout·γ:
//! dx = rstd·(ĝ − mean(ĝ) − x̂·mean(ĝ·x̂)), dγ[c] += Σ dout·x̂, dβ[c] += Σ dout.
//! Statistics and reductions accumulate in f64. In NCDHW one (n, g) is a contiguous block, which
//! is the unit of parallel work.

use rayon::prelude::*;

use super::float::{put, Float};
use crate::backend::Accum;
use crate::shape::Dims;

pub const EPS: f64 = 1e-5;

fn check(len: usize, x: &Dims, groups: usize) {
    assert_eq!(len, x.numel(), "groupnorm: buffer length vs shape {x}");
    assert!(groups > 0 && x.c.is_multiple_of(groups), "groupnorm: {} channels not divisible into {groups} groups", x.c);
}

/// out = GroupNorm(inp); mean and rstd (length N·G) are saved for backward.
#[allow(clippy::too_many_arguments)]
pub fn groupnorm_forward<T: Float>(
    out: &mut [T],
    mean: &mut [T],
    rstd: &mut [T],
    inp: &[T],
    gamma: &[T],
    beta: &[T],
    x: Dims,
    groups: usize,
) {
    check(inp.len(), &x, groups);
    assert_eq!(out.len(), inp.len(), "groupnorm: out length");
    assert!(mean.len() == x.n * groups && rstd.len() == x.n * groups, "groupnorm: mean/rstd length vs N·G");
    assert!(gamma.len() == x.c && beta.len() == x.c, "groupnorm: gamma/beta length vs C = {}", x.c);
    let (cg, s) = (x.c / groups, x.s());
    let m = (cg * s) as f64;
    let stats: Vec<(f64, f64)> = out
        .par_chunks_mut(cg * s)
        .zip(inp.par_chunks(cg * s))
        .enumerate()
        .map(|(ng, (o, xi))| {
            let mu = xi.iter().map(|v| v.to_f64()).sum::<f64>() / m;
            let var = xi.iter().map(|v| (v.to_f64() - mu).powi(2)).sum::<f64>() / m;
            let rs = 1.0 / (var + EPS).sqrt();
            let g0 = (ng % groups) * cg;
            for (j, (oc, xc)) in o.chunks_mut(s).zip(xi.chunks(s)).enumerate() {
                let (ga, be) = (gamma[g0 + j].to_f64(), beta[g0 + j].to_f64());
                for (ov, xv) in oc.iter_mut().zip(xc) {
                    *ov = T::from_f64((xv.to_f64() - mu) * rs * ga + be);
                }
            }
            (mu, rs)
        })
        .collect();
    for (i, (mu, rs)) in stats.into_iter().enumerate() {
        mean[i] = T::from_f64(mu);
        rstd[i] = T::from_f64(rs);
    }
}

/// dinp (per `Accum`), dgamma += , dbeta += .
#[allow(clippy::too_many_arguments)]
pub fn groupnorm_backward<T: Float>(
    dinp: (&mut [T], Accum),
    dgamma: &mut [T],
    dbeta: &mut [T],
    dout: &[T],
    inp: &[T],
    mean: &[T],
    rstd: &[T],
    gamma: &[T],
    x: Dims,
    groups: usize,
) {
    check(inp.len(), &x, groups);
    let (dx, acc) = dinp;
    assert!(dx.len() == inp.len() && dout.len() == inp.len(), "groupnorm: dinp/dout length vs shape {x}");
    assert!(mean.len() == x.n * groups && rstd.len() == x.n * groups, "groupnorm: mean/rstd length vs N·G");
    assert!(gamma.len() == x.c && dgamma.len() == x.c && dbeta.len() == x.c, "groupnorm: gamma/dgamma/dbeta vs C");
    let (cg, s) = (x.c / groups, x.s());
    let m = (cg * s) as f64;
    // Per (n, g): the dγ and dβ contributions of its cg channels.
    let partials: Vec<Vec<(f64, f64)>> = dx
        .par_chunks_mut(cg * s)
        .zip(dout.par_chunks(cg * s).zip(inp.par_chunks(cg * s)))
        .enumerate()
        .map(|(ng, (dxi, (gi, xi)))| {
            let (mu, rs) = (mean[ng].to_f64(), rstd[ng].to_f64());
            let g0 = (ng % groups) * cg;
            let mut part = vec![(0f64, 0f64); cg];
            let (mut sum_g, mut sum_gx) = (0f64, 0f64);
            for j in 0..cg {
                let ga = gamma[g0 + j].to_f64();
                for i in j * s..(j + 1) * s {
                    let (g, xh) = (gi[i].to_f64(), (xi[i].to_f64() - mu) * rs);
                    part[j].0 += g * xh;
                    part[j].1 += g;
                    sum_g += g * ga;
                    sum_gx += g * ga * xh;
                }
            }
            let (mean_g, mean_gx) = (sum_g / m, sum_gx / m);
            for j in 0..cg {
                let ga = gamma[g0 + j].to_f64();
                for i in j * s..(j + 1) * s {
                    let xh = (xi[i].to_f64() - mu) * rs;
                    let v = rs * (gi[i].to_f64() * ga - mean_g - xh * mean_gx);
                    put(&mut dxi[i], T::from_f64(v), acc);
                }
            }
            part
        })
        .collect();
    for (ng, part) in partials.into_iter().enumerate() {
        let g0 = (ng % groups) * cg;
        for (j, (dg, dbt)) in part.into_iter().enumerate() {
            dgamma[g0 + j] += T::from_f64(dg);
            dbeta[g0 + j] += T::from_f64(dbt);
        }
    }
}
