//! GroupNorm (PyTorch `nn.GroupNorm(groups, C, eps=1e-5, affine=True)`): forward saving the
//! per-(n, group) mean and reciprocal standard deviation, and the standard backward.
//!
//! For batch element n and group g (channels g·C/G .. (g+1)·C/G, all voxels), with biased
//! variance: x̂ = (x − μ)·rstd, rstd = 1/√(σ² + eps), out = γ[c]·x̂ + β[c].
//! Backward, with m = elements per group and ĝ = dout·γ:
//! dx = rstd·(ĝ − mean(ĝ) − x̂·mean(ĝ·x̂)), dγ[c] += Σ dout·x̂, dβ[c] += Σ dout.
//! Statistics and reductions accumulate in f64 (as interleaved partial sums, see
//! [`sum_f64`]); each (n, g) runs under [`vectorized`]. In NCDHW one (n, g) is a contiguous block, which
//! is the unit of parallel work. GroupNorm followed by SiLU has its own fused forward and backward
//! (the U-Net's `norm → SiLU` pairs): one task per (n, g) does the whole chain, so the GroupNorm
//! output never makes a round trip through a whole-buffer temporary.

use rayon::prelude::*;

use super::float::{put, sum2_f64, sum_f64, vectorized, Float};
use super::silu::{silu, silu_grad};
use crate::backend::Accum;
use crate::shape::Dims;

pub const EPS: f64 = 1e-5;

fn check(len: usize, x: &Dims, groups: usize) {
    assert_eq!(len, x.numel(), "groupnorm: buffer length vs shape {x}");
    assert!(groups > 0 && x.c.is_multiple_of(groups), "groupnorm: {} channels not divisible into {groups} groups", x.c);
}

/// Mean and 1/√(σ² + eps) of one (n, g) block, in f64 (two passes: mean, then variance).
#[inline(always)]
fn stats<T: Float>(xi: &[T]) -> (f64, f64) {
    let m = xi.len() as f64;
    let mu = sum_f64(xi, |v| v) / m;
    let var = sum_f64(xi, |v| (v - mu) * (v - mu)) / m;
    (mu, 1.0 / (var + EPS).sqrt())
}

/// o = act(γ·x̂ + β) over one (n, g) block of channels g0 .. g0 + cg (each `s` long).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn apply<T: Float>(
    o: &mut [T],
    xi: &[T],
    s: usize,
    g0: usize,
    gamma: &[T],
    beta: &[T],
    (mu, rs): (f64, f64),
    act: impl Fn(T) -> T,
) {
    for (j, (oc, xc)) in o.chunks_mut(s).zip(xi.chunks(s)).enumerate() {
        // γ·x̂ + β = (x − μ)·(rstd·γ) + β
        let (a, be) = (rs * gamma[g0 + j].to_f64(), beta[g0 + j].to_f64());
        for (ov, xv) in oc.iter_mut().zip(xc) {
            *ov = act(T::from_f64((xv.to_f64() - mu) * a + be));
        }
    }
}

/// Forward of GroupNorm followed by `act` (identity, or SiLU without storing the GroupNorm output).
#[allow(clippy::too_many_arguments)]
fn forward_with<T: Float>(
    out: &mut [T],
    mean: &mut [T],
    rstd: &mut [T],
    inp: &[T],
    gamma: &[T],
    beta: &[T],
    x: Dims,
    groups: usize,
    act: impl Fn(T) -> T + Sync,
) {
    check(inp.len(), &x, groups);
    assert_eq!(out.len(), inp.len(), "groupnorm: out length");
    assert!(mean.len() == x.n * groups && rstd.len() == x.n * groups, "groupnorm: mean/rstd length vs N·G");
    assert!(gamma.len() == x.c && beta.len() == x.c, "groupnorm: gamma/beta length vs C = {}", x.c);
    let (cg, s) = (x.c / groups, x.s());
    let stats: Vec<(f64, f64)> = out
        .par_chunks_mut(cg * s)
        .zip(inp.par_chunks(cg * s))
        .enumerate()
        .map(|(ng, (o, xi))| {
            vectorized(
                #[inline(always)]
                || {
                    let st = stats(xi);
                    apply(o, xi, s, (ng % groups) * cg, gamma, beta, st, &act);
                    st
                },
            )
        })
        .collect();
    for (i, (mu, rs)) in stats.into_iter().enumerate() {
        mean[i] = T::from_f64(mu);
        rstd[i] = T::from_f64(rs);
    }
}

/// The statistics a forward of `inp` saves (mean and rstd, length N·G), and nothing else.
pub fn groupnorm_stats<T: Float>(mean: &mut [T], rstd: &mut [T], inp: &[T], x: Dims, groups: usize) {
    check(inp.len(), &x, groups);
    assert!(mean.len() == x.n * groups && rstd.len() == x.n * groups, "groupnorm: mean/rstd length vs N·G");
    let cg = x.c / groups;
    let st: Vec<(f64, f64)> = inp.par_chunks(cg * x.s()).map(|xi| vectorized(|| stats(xi))).collect();
    for (i, (mu, rs)) in st.into_iter().enumerate() {
        mean[i] = T::from_f64(mu);
        rstd[i] = T::from_f64(rs);
    }
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
    forward_with(out, mean, rstd, inp, gamma, beta, x, groups, |v| v);
}

/// out = SiLU(GroupNorm(inp)) in one pass over the normalised values (which are not stored);
/// mean and rstd as [`groupnorm_forward`]'s.
#[allow(clippy::too_many_arguments)]
pub fn groupnorm_silu_forward<T: Float>(
    out: &mut [T],
    mean: &mut [T],
    rstd: &mut [T],
    inp: &[T],
    gamma: &[T],
    beta: &[T],
    x: Dims,
    groups: usize,
) {
    forward_with(out, mean, rstd, inp, gamma, beta, x, groups, silu);
}

/// The backward of one (n, g) block: dxi per `acc` from gi = ∂loss/∂(GroupNorm output);
/// returns (Σ g·x̂, Σ g) per channel.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn backward_group<T: Float>(
    dxi: &mut [T],
    gi: &[T],
    xi: &[T],
    s: usize,
    (mu, rs): (f64, f64),
    gamma: &[T],
    acc: Accum,
) -> Vec<(f64, f64)> {
    let (cg, m) = (gamma.len(), xi.len() as f64);
    // Per channel j: (Σ g·x̂, Σ g); then Σ ĝ = Σ_j γ_j·Σ g, Σ ĝ·x̂ = Σ_j γ_j·Σ g·x̂.
    let part: Vec<(f64, f64)> = (0..cg)
        .map(|j| {
            let (gc, xc) = (&gi[j * s..(j + 1) * s], &xi[j * s..(j + 1) * s]);
            (sum2_f64(gc, xc, |g, x| g * (x - mu) * rs), sum_f64(gc, |g| g))
        })
        .collect();
    let sum_g: f64 = part.iter().enumerate().map(|(j, p)| gamma[j].to_f64() * p.1).sum();
    let sum_gx: f64 = part.iter().enumerate().map(|(j, p)| gamma[j].to_f64() * p.0).sum();
    let (mean_g, mean_gx) = (sum_g / m, sum_gx / m);
    for (j, ga) in gamma.iter().enumerate() {
        let ga = ga.to_f64();
        let (dc, gc, xc) = (&mut dxi[j * s..(j + 1) * s], &gi[j * s..(j + 1) * s], &xi[j * s..(j + 1) * s]);
        for (dv, (gv, xv)) in dc.iter_mut().zip(gc.iter().zip(xc)) {
            let xh = (xv.to_f64() - mu) * rs;
            put(dv, T::from_f64(rs * (gv.to_f64() * ga - mean_g - xh * mean_gx)), acc);
        }
    }
    part
}

/// dγ += Σ g·x̂ and dβ += Σ g from the per-(n, g) channel partials.
fn add_partials<T: Float>(dgamma: &mut [T], dbeta: &mut [T], partials: Vec<Vec<(f64, f64)>>, groups: usize, cg: usize) {
    for (ng, part) in partials.into_iter().enumerate() {
        let g0 = (ng % groups) * cg;
        for (j, (dg, dbt)) in part.into_iter().enumerate() {
            dgamma[g0 + j] += T::from_f64(dg);
            dbeta[g0 + j] += T::from_f64(dbt);
        }
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
    // Per (n, g): the dγ and dβ contributions of its cg channels.
    let partials: Vec<Vec<(f64, f64)>> = dx
        .par_chunks_mut(cg * s)
        .zip(dout.par_chunks(cg * s).zip(inp.par_chunks(cg * s)))
        .enumerate()
        .map(|(ng, (dxi, (gi, xi)))| {
            let (st, g0) = ((mean[ng].to_f64(), rstd[ng].to_f64()), (ng % groups) * cg);
            vectorized(
                #[inline(always)]
                || backward_group(dxi, gi, xi, s, st, &gamma[g0..g0 + cg], acc),
            )
        })
        .collect();
    add_partials(dgamma, dbeta, partials, groups, cg);
}

/// The backward of out = SiLU(GroupNorm(inp)): per (n, g) block, the GroupNorm output is
/// recomputed (statistics recomputed in f64, exactly as the forward computed them), SiLU's
/// backward written into `scratch` (inp.len()), then GroupNorm's backward with the saved mean and
/// rstd — the same values as [`groupnorm_forward`], [`super::silu::silu_backward`] and
/// [`groupnorm_backward`] in turn, without the intermediate passes over whole buffers.
#[allow(clippy::too_many_arguments)]
pub fn groupnorm_silu_backward<T: Float>(
    dinp: (&mut [T], Accum),
    dgamma: &mut [T],
    dbeta: &mut [T],
    dout: &[T],
    inp: &[T],
    mean: &[T],
    rstd: &[T],
    gamma: &[T],
    beta: &[T],
    x: Dims,
    groups: usize,
    scratch: &mut [T],
) {
    check(inp.len(), &x, groups);
    let (dx, acc) = dinp;
    assert!(dx.len() == inp.len() && dout.len() == inp.len(), "groupnorm: dinp/dout length vs shape {x}");
    assert_eq!(scratch.len(), inp.len(), "groupnorm: scratch length");
    assert!(mean.len() == x.n * groups && rstd.len() == x.n * groups, "groupnorm: mean/rstd length vs N·G");
    assert!(gamma.len() == x.c && beta.len() == x.c, "groupnorm: gamma/beta length vs C = {}", x.c);
    assert!(dgamma.len() == x.c && dbeta.len() == x.c, "groupnorm: dgamma/dbeta vs C");
    let (cg, s) = (x.c / groups, x.s());
    let partials: Vec<Vec<(f64, f64)>> = dx
        .par_chunks_mut(cg * s)
        .zip(scratch.par_chunks_mut(cg * s))
        .zip(dout.par_chunks(cg * s).zip(inp.par_chunks(cg * s)))
        .enumerate()
        .map(|(ng, ((dxi, gi), (di, xi)))| {
            let (saved, g0) = ((mean[ng].to_f64(), rstd[ng].to_f64()), (ng % groups) * cg);
            vectorized(
                #[inline(always)]
                || {
                    // gi = y, the GroupNorm output, then ∂loss/∂y = SiLU'(y)·dout in place.
                    apply(gi, xi, s, g0, gamma, beta, stats(xi), |v| v);
                    gi.iter_mut().zip(di).for_each(|(g, &d)| *g = silu_grad(d, *g));
                    backward_group(dxi, gi, xi, s, saved, &gamma[g0..g0 + cg], acc)
                },
            )
        })
        .collect();
    add_partials(dgamma, dbeta, partials, groups, cg);
}

/// [`groupnorm_silu_forward`] in place: x := SiLU(GroupNorm(x)); each (n, g) block's statistics
/// are taken before the block is rewritten, with the same arithmetic, so bit for bit the
/// out-of-place result.
#[allow(clippy::too_many_arguments)]
pub fn groupnorm_silu_forward_inplace<T: Float>(
    xb: &mut [T],
    mean: &mut [T],
    rstd: &mut [T],
    gamma: &[T],
    beta: &[T],
    x: Dims,
    groups: usize,
) {
    check(xb.len(), &x, groups);
    assert!(mean.len() == x.n * groups && rstd.len() == x.n * groups, "groupnorm: mean/rstd length vs N·G");
    assert!(gamma.len() == x.c && beta.len() == x.c, "groupnorm: gamma/beta length vs C = {}", x.c);
    let (cg, s) = (x.c / groups, x.s());
    let stats_all: Vec<(f64, f64)> = xb
        .par_chunks_mut(cg * s)
        .enumerate()
        .map(|(ng, xi)| {
            vectorized(
                #[inline(always)]
                || {
                    let (mu, rs) = stats(xi);
                    let g0 = (ng % groups) * cg;
                    for (j, xc) in xi.chunks_mut(s).enumerate() {
                        let (a, be) = (rs * gamma[g0 + j].to_f64(), beta[g0 + j].to_f64());
                        for v in xc.iter_mut() {
                            *v = silu(T::from_f64((v.to_f64() - mu) * a + be));
                        }
                    }
                    (mu, rs)
                },
            )
        })
        .collect();
    for (i, (mu, rs)) in stats_all.into_iter().enumerate() {
        mean[i] = T::from_f64(mu);
        rstd[i] = T::from_f64(rs);
    }
}

/// [`groupnorm_silu_backward`] in place with `Accum::Overwrite`: `d` holds ∂loss/∂SiLU(GN(inp))
/// and gets ∂loss/∂inp; each block's incoming gradient is consumed into the scratch before the
/// block is rewritten (bit for bit the out-of-place result).
#[allow(clippy::too_many_arguments)]
pub fn groupnorm_silu_backward_inplace<T: Float>(
    d: &mut [T],
    dgamma: &mut [T],
    dbeta: &mut [T],
    inp: &[T],
    mean: &[T],
    rstd: &[T],
    gamma: &[T],
    beta: &[T],
    x: Dims,
    groups: usize,
    scratch: &mut [T],
) {
    check(inp.len(), &x, groups);
    assert!(d.len() == inp.len() && scratch.len() == inp.len(), "groupnorm: gradient/scratch length vs shape {x}");
    assert!(mean.len() == x.n * groups && rstd.len() == x.n * groups, "groupnorm: mean/rstd length vs N·G");
    assert!(gamma.len() == x.c && beta.len() == x.c, "groupnorm: gamma/beta length vs C = {}", x.c);
    assert!(dgamma.len() == x.c && dbeta.len() == x.c, "groupnorm: dgamma/dbeta vs C");
    let (cg, s) = (x.c / groups, x.s());
    let partials: Vec<Vec<(f64, f64)>> = d
        .par_chunks_mut(cg * s)
        .zip(scratch.par_chunks_mut(cg * s))
        .zip(inp.par_chunks(cg * s))
        .enumerate()
        .map(|(ng, ((di, gi), xi))| {
            let (saved, g0) = ((mean[ng].to_f64(), rstd[ng].to_f64()), (ng % groups) * cg);
            vectorized(
                #[inline(always)]
                || {
                    apply(gi, xi, s, g0, gamma, beta, stats(xi), |v| v);
                    gi.iter_mut().zip(di.iter()).for_each(|(g, &dv)| *g = silu_grad(dv, *g));
                    backward_group(di, gi, xi, s, saved, &gamma[g0..g0 + cg], Accum::Overwrite)
                },
            )
        })
        .collect();
    add_partials(dgamma, dbeta, partials, groups, cg);
}
