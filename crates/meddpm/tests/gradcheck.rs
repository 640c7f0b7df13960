//! Gradient checks and closed-form forward checks of every CPU primitive.
//!
//! Backward passes are checked in f64 (the CPU kernels are generic over f32/f64): for a random
//! weighting r, the scalar L = Σ r·f(x) has ∂L/∂x = backward(dout = r), which must match central
//! finite differences of L for every input and parameter. Forward passes are checked against
//! independent formulas (a naive 7-loop convolution, shifts by delta kernels, exact interpolation
//! of linear ramps, GroupNorm moments, hand-computed Adam and DDPM steps, Philox draws).
//! The gradient contract of `backend.rs` is checked too: `Accum::Add` adds, parameter grads `+=`.

use meddpm::backend::{AdamStep, DdpmCoefs};
use meddpm::cpu::{attention, conv3d, diffusion, elementwise, groupnorm, linear, loss, optim, silu, upsample};
use meddpm::rng::Philox;
use meddpm::testing::{central_diff, compare, dot, randn_f32, randn_f64, uniform_f64, Tolerance};
use meddpm::{Accum, Backend, ConvShape, Dims, LossKind};

/// Central-difference step and the tolerance for f64 analytic vs numeric gradients.
const H: f64 = 1e-5;
const GRAD_TOL: Tolerance = Tolerance::new(1e-7, 1e-6);
/// Same math, f64 vs exact/closed form.
const EXACT: Tolerance = Tolerance::new(1e-12, 1e-12);
/// f32 backend vs f64 reference.
const F32_TOL: Tolerance = Tolerance::new(1e-5, 1e-4);

fn gradcheck(name: &str, analytic: &[f64], x: &[f64], f: impl FnMut(&[f64]) -> f64) {
    let mut x = x.to_vec();
    let numeric = central_diff(&mut x, H, f);
    compare(name, analytic, &numeric, GRAD_TOL).unwrap();
}

fn plus(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

// ---- conv3d --------------------------------------------------------------------------------------

/// Direct convolution from the definition (independent of im2col/GEMM).
fn conv_naive(x: &[f64], w: &[f64], b: &[f64], cs: ConvShape) -> Vec<f64> {
    let (i, o, k, s, p) = (cs.x, cs.out(), cs.k, cs.stride, cs.pad() as isize);
    let mut out = vec![0.0; o.numel()];
    for n in 0..i.n {
        for co in 0..o.c {
            for od in 0..o.d {
                for oh in 0..o.h {
                    for ow in 0..o.w {
                        let mut acc = b[co];
                        for ci in 0..i.c {
                            for kd in 0..k {
                                for kh in 0..k {
                                    for kw in 0..k {
                                        let id = (od * s + kd) as isize - p;
                                        let ih = (oh * s + kh) as isize - p;
                                        let iw = (ow * s + kw) as isize - p;
                                        if id < 0 || ih < 0 || iw < 0 {
                                            continue;
                                        }
                                        let (id, ih, iw) = (id as usize, ih as usize, iw as usize);
                                        if id >= i.d || ih >= i.h || iw >= i.w {
                                            continue;
                                        }
                                        let xi = (((n * i.c + ci) * i.d + id) * i.h + ih) * i.w + iw;
                                        let wi = (((co * i.c + ci) * k + kd) * k + kh) * k + kw;
                                        acc += w[wi] * x[xi];
                                    }
                                }
                            }
                        }
                        out[(((n * o.c + co) * o.d + od) * o.h + oh) * o.w + ow] = acc;
                    }
                }
            }
        }
    }
    out
}

fn conv_case(name: &str, cs: ConvShape, seed: u64) {
    let o = cs.out();
    let x = randn_f64(seed, 0, cs.x.numel(), 1.0);
    let w = randn_f64(seed, 1, cs.w_len(), 0.5);
    let b = randn_f64(seed, 2, cs.cout, 1.0);
    let r = randn_f64(seed, 3, o.numel(), 1.0);
    let fwd = |x: &[f64], w: &[f64], b: &[f64]| {
        let mut out = vec![0.0; o.numel()];
        conv3d::conv3d_forward(&mut out, x, w, b, cs);
        out
    };
    compare(&format!("{name} forward vs naive"), &fwd(&x, &w, &b), &conv_naive(&x, &w, &b, cs), EXACT).unwrap();

    let (mut dx, mut dw, mut db) = (vec![0.0; x.len()], vec![0.0; w.len()], vec![0.0; b.len()]);
    conv3d::conv3d_backward(Some((&mut dx, Accum::Overwrite)), &mut dw, &mut db, &r, &x, &w, cs);
    gradcheck(&format!("{name} dinp"), &dx, &x, |xp| dot(&r, &fwd(xp, &w, &b)));
    gradcheck(&format!("{name} dw"), &dw, &w, |wp| dot(&r, &fwd(&x, wp, &b)));
    gradcheck(&format!("{name} db"), &db, &b, |bp| dot(&r, &fwd(&x, &w, bp)));

    // Contract: Accum::Add adds to dinp, dw and db always accumulate, dinp None leaves dw intact.
    let (px, pw, pb) =
        (randn_f64(seed, 4, x.len(), 1.0), randn_f64(seed, 5, w.len(), 1.0), randn_f64(seed, 6, b.len(), 1.0));
    let (mut dx2, mut dw2, mut db2) = (px.clone(), pw.clone(), pb.clone());
    conv3d::conv3d_backward(Some((&mut dx2, Accum::Add)), &mut dw2, &mut db2, &r, &x, &w, cs);
    compare(&format!("{name} dinp Accum::Add"), &dx2, &plus(&px, &dx), EXACT).unwrap();
    compare(&format!("{name} dw +="), &dw2, &plus(&pw, &dw), EXACT).unwrap();
    compare(&format!("{name} db +="), &db2, &plus(&pb, &db), EXACT).unwrap();
    let (mut dw3, mut db3) = (vec![0.0; w.len()], vec![0.0; b.len()]);
    conv3d::conv3d_backward(None, &mut dw3, &mut db3, &r, &x, &w, cs);
    compare(&format!("{name} dw (no dinp)"), &dw3, &dw, EXACT).unwrap();

    // One output plane per im2col slab must give the same results as one slab.
    let mut out1 = vec![0.0; o.numel()];
    conv3d::conv3d_forward_with(&mut out1, &x, &w, &b, cs, &mut conv3d::ConvScratch::new(1));
    compare(&format!("{name} forward, 1-plane slabs"), &out1, &fwd(&x, &w, &b), EXACT).unwrap();
    let (mut dx4, mut dw4, mut db4) = (px.clone(), vec![0.0; w.len()], vec![0.0; b.len()]);
    let mut scratch = conv3d::ConvScratch::new(1);
    conv3d::conv3d_backward_with(
        Some((&mut dx4, Accum::Overwrite)),
        &mut dw4,
        Some(&mut db4),
        &r,
        &x,
        &w,
        cs,
        &mut scratch,
    );
    compare(&format!("{name} dinp, 1-plane slabs"), &dx4, &dx, EXACT).unwrap();
    compare(&format!("{name} dw, 1-plane slabs"), &dw4, &dw, EXACT).unwrap();
}

#[test]
fn conv3d_k3_s1() {
    conv_case("conv k3 s1", ConvShape::new(Dims::new(2, 3, 5, 6, 7), 4, 3, 1), 1);
}

#[test]
fn conv3d_k3_s2_odd() {
    conv_case("conv k3 s2", ConvShape::new(Dims::new(2, 3, 5, 6, 7), 4, 3, 2), 2);
    conv_case("conv k3 s2 even", ConvShape::new(Dims::new(1, 2, 4, 6, 2), 3, 3, 2), 3);
    // Axes of length 1 and 2: some kernel taps fall entirely into the padding.
    conv_case("conv k3 s2 tiny", ConvShape::new(Dims::new(1, 2, 1, 2, 3), 3, 3, 2), 6);
    conv_case("conv k3 s1 tiny", ConvShape::new(Dims::new(2, 2, 1, 2, 1), 2, 3, 1), 7);
}

#[test]
fn conv3d_k1() {
    conv_case("conv k1 s1", ConvShape::new(Dims::new(2, 3, 5, 6, 7), 4, 1, 1), 4);
    conv_case("conv k1 s2", ConvShape::new(Dims::new(2, 3, 5, 6, 7), 4, 1, 2), 5);
}

#[test]
fn conv3d_delta_kernel_is_a_shift() {
    // w[c, c, 2, 1, 0] = 1 for every c: out[c, d, h, w] = x[c, d + 1, h, w − 1] (0 outside).
    let x = Dims::new(2, 3, 4, 5, 6);
    let cs = ConvShape::new(x, 3, 3, 1);
    let inp = randn_f64(9, 0, x.numel(), 1.0);
    let mut w = vec![0.0; cs.w_len()];
    for c in 0..3 {
        w[(((c * 3 + c) * 3 + 2) * 3 + 1) * 3] = 1.0;
    }
    let mut out = vec![0.0; x.numel()];
    conv3d::conv3d_forward(&mut out, &inp, &w, &[0.0; 3], cs);
    let mut want = vec![0.0; x.numel()];
    for nc in 0..x.n * x.c {
        for d in 0..x.d {
            for h in 0..x.h {
                for ww in 1..x.w {
                    if d + 1 < x.d {
                        want[((nc * x.d + d) * x.h + h) * x.w + ww] =
                            inp[((nc * x.d + d + 1) * x.h + h) * x.w + ww - 1];
                    }
                }
            }
        }
    }
    compare("conv delta kernel = shift", &out, &want, EXACT).unwrap();
}

// ---- groupnorm and silu ------------------------------------------------------------------------------

fn gn_fwd(x: &[f64], g: &[f64], b: &[f64], xd: Dims, groups: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut out, mut mean, mut rstd) = (vec![0.0; x.len()], vec![0.0; xd.n * groups], vec![0.0; xd.n * groups]);
    groupnorm::groupnorm_forward(&mut out, &mut mean, &mut rstd, x, g, b, xd, groups);
    (out, mean, rstd)
}

#[test]
fn groupnorm_grads() {
    let (xd, groups) = (Dims::new(2, 6, 3, 4, 5), 3);
    let x = randn_f64(11, 0, xd.numel(), 2.0).iter().map(|v| v + 0.7).collect::<Vec<_>>();
    let g = randn_f64(11, 1, xd.c, 1.0);
    let b = randn_f64(11, 2, xd.c, 1.0);
    let r = randn_f64(11, 3, xd.numel(), 1.0);
    let (_, mean, rstd) = gn_fwd(&x, &g, &b, xd, groups);
    let (mut dx, mut dg, mut db) = (vec![0.0; x.len()], vec![0.0; xd.c], vec![0.0; xd.c]);
    groupnorm::groupnorm_backward((&mut dx, Accum::Overwrite), &mut dg, &mut db, &r, &x, &mean, &rstd, &g, xd, groups);
    gradcheck("groupnorm dinp", &dx, &x, |xp| dot(&r, &gn_fwd(xp, &g, &b, xd, groups).0));
    gradcheck("groupnorm dgamma", &dg, &g, |gp| dot(&r, &gn_fwd(&x, gp, &b, xd, groups).0));
    gradcheck("groupnorm dbeta", &db, &b, |bp| dot(&r, &gn_fwd(&x, &g, bp, xd, groups).0));

    let (px, pg) = (randn_f64(11, 4, x.len(), 1.0), randn_f64(11, 5, xd.c, 1.0));
    let (mut dx2, mut dg2, mut db2) = (px.clone(), pg.clone(), pg.clone());
    groupnorm::groupnorm_backward((&mut dx2, Accum::Add), &mut dg2, &mut db2, &r, &x, &mean, &rstd, &g, xd, groups);
    compare("groupnorm dinp Accum::Add", &dx2, &plus(&px, &dx), EXACT).unwrap();
    compare("groupnorm dgamma +=", &dg2, &plus(&pg, &dg), EXACT).unwrap();
    compare("groupnorm dbeta +=", &db2, &plus(&pg, &db), EXACT).unwrap();
}

#[test]
fn groupnorm_forward_moments() {
    // γ = 1, β = 0: each (n, group) has mean 0 and variance σ²/(σ² + eps); saved stats match.
    let (xd, groups) = (Dims::new(2, 8, 2, 3, 4), 4);
    let x = randn_f64(12, 0, xd.numel(), 3.0).iter().map(|v| v - 1.5).collect::<Vec<_>>();
    let (out, mean, rstd) = gn_fwd(&x, &vec![1.0; xd.c], &vec![0.0; xd.c], xd, groups);
    let m = 2 * xd.s();
    let (mut got, mut want) = (vec![], vec![]);
    for (ng, (oc, xc)) in out.chunks(m).zip(x.chunks(m)).enumerate() {
        let mu = xc.iter().sum::<f64>() / m as f64;
        let var = xc.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / m as f64;
        let omu = oc.iter().sum::<f64>() / m as f64;
        let ovar = oc.iter().map(|v| (v - omu) * (v - omu)).sum::<f64>() / m as f64;
        got.extend([omu, ovar, mean[ng], rstd[ng]]);
        want.extend([0.0, var / (var + 1e-5), mu, 1.0 / (var + 1e-5).sqrt()]);
    }
    compare("groupnorm moments and saved stats", &got, &want, Tolerance::new(1e-12, 1e-10)).unwrap();
}

fn silu_fwd(x: &[f64]) -> Vec<f64> {
    let mut out = vec![0.0; x.len()];
    silu::silu_forward(&mut out, x);
    out
}

#[test]
fn silu_grads_and_values() {
    let x = randn_f64(13, 0, 300, 3.0);
    let r = randn_f64(13, 1, 300, 1.0);
    let want: Vec<f64> = x.iter().map(|&v| v / (1.0 + (-v).exp())).collect();
    compare("silu forward", &silu_fwd(&x), &want, EXACT).unwrap();
    let mut dx = vec![0.0; x.len()];
    silu::silu_backward((&mut dx, Accum::Overwrite), &r, &x);
    gradcheck("silu dinp", &dx, &x, |xp| dot(&r, &silu_fwd(xp)));
    let p = randn_f64(13, 2, 300, 1.0);
    let mut dx2 = p.clone();
    silu::silu_backward((&mut dx2, Accum::Add), &r, &x);
    compare("silu dinp Accum::Add", &dx2, &plus(&p, &dx), EXACT).unwrap();
}

#[test]
fn groupnorm_silu_default_method() {
    // f64: SiLU(GN(x)) composed from the free functions, gradient by finite differences.
    let (xd, groups) = (Dims::new(2, 4, 3, 2, 5), 2);
    let x = randn_f64(14, 0, xd.numel(), 1.5);
    let g = randn_f64(14, 1, xd.c, 1.0);
    let b = randn_f64(14, 2, xd.c, 1.0);
    let r = randn_f64(14, 3, xd.numel(), 1.0);
    let f = |x: &[f64], g: &[f64], b: &[f64]| silu_fwd(&gn_fwd(x, g, b, xd, groups).0);
    let (gn, mean, rstd) = gn_fwd(&x, &g, &b, xd, groups);
    let mut tmp = vec![0.0; x.len()];
    silu::silu_backward((&mut tmp, Accum::Overwrite), &r, &gn);
    let (mut dx, mut dg, mut db) = (vec![0.0; x.len()], vec![0.0; xd.c], vec![0.0; xd.c]);
    groupnorm::groupnorm_backward(
        (&mut dx, Accum::Overwrite),
        &mut dg,
        &mut db,
        &tmp,
        &x,
        &mean,
        &rstd,
        &g,
        xd,
        groups,
    );
    gradcheck("gn+silu dinp", &dx, &x, |xp| dot(&r, &f(xp, &g, &b)));
    gradcheck("gn+silu dgamma", &dg, &g, |gp| dot(&r, &f(&x, gp, &b)));
    gradcheck("gn+silu dbeta", &db, &b, |bp| dot(&r, &f(&x, &g, bp)));

    // The CPU backend's fused methods (f32) against the checked f64 values.
    let be = meddpm::cpu::CpuBackend::new();
    let (x32, g32, b32, r32) = (to_f32(&x), to_f32(&g), to_f32(&b), to_f32(&r));
    let mut out = vec![0f32; x.len()];
    let (mut mean32, mut rstd32) = (vec![0f32; xd.n * groups], vec![0f32; xd.n * groups]);
    be.groupnorm_silu_forward(&mut out, &mut mean32, &mut rstd32, &x32, None, &g32, &b32, xd, groups);
    compare("backend gn+silu forward", &out, &f(&x, &g, &b), F32_TOL).unwrap();
    let mut dx32 = vec![1f32; x.len()];
    let (mut dg32, mut db32) = (vec![0f32; xd.c], vec![0f32; xd.c]);
    let dinp = (&mut dx32, Accum::Add);
    be.groupnorm_silu_backward(dinp, &mut dg32, &mut db32, &r32, &x32, None, &mean32, &rstd32, &g32, &b32, xd, groups);
    let want_dx: Vec<f64> = dx.iter().map(|v| v + 1.0).collect();
    compare("backend gn+silu dinp (Add onto 1)", &dx32, &want_dx, F32_TOL).unwrap();
    compare("backend gn+silu dgamma", &dg32, &dg, F32_TOL).unwrap();
    compare("backend gn+silu dbeta", &db32, &db, F32_TOL).unwrap();
}

// ---- linear ------------------------------------------------------------------------------------------

#[test]
fn linear_grads_and_values() {
    let (n, i, o) = (3, 5, 4);
    let x = randn_f64(15, 0, n * i, 1.0);
    let w = randn_f64(15, 1, o * i, 1.0);
    let b = randn_f64(15, 2, o, 1.0);
    let r = randn_f64(15, 3, n * o, 1.0);
    let fwd = |x: &[f64], w: &[f64], b: &[f64]| {
        let mut out = vec![0.0; n * o];
        linear::linear_forward(&mut out, x, w, b, n, i, o);
        out
    };
    let mut want = vec![0.0; n * o];
    for r in 0..n {
        for c in 0..o {
            want[r * o + c] = b[c] + (0..i).map(|k| x[r * i + k] * w[c * i + k]).sum::<f64>();
        }
    }
    compare("linear forward", &fwd(&x, &w, &b), &want, EXACT).unwrap();
    let (mut dx, mut dw, mut db) = (vec![0.0; n * i], vec![0.0; o * i], vec![0.0; o]);
    linear::linear_backward(Some((&mut dx, Accum::Overwrite)), &mut dw, &mut db, &r, &x, &w, n, i, o);
    gradcheck("linear dinp", &dx, &x, |xp| dot(&r, &fwd(xp, &w, &b)));
    gradcheck("linear dw", &dw, &w, |wp| dot(&r, &fwd(&x, wp, &b)));
    gradcheck("linear db", &db, &b, |bp| dot(&r, &fwd(&x, &w, bp)));
    let (px, pw, pb) = (randn_f64(15, 4, n * i, 1.0), randn_f64(15, 5, o * i, 1.0), randn_f64(15, 6, o, 1.0));
    let (mut dx2, mut dw2, mut db2) = (px.clone(), pw.clone(), pb.clone());
    linear::linear_backward(Some((&mut dx2, Accum::Add)), &mut dw2, &mut db2, &r, &x, &w, n, i, o);
    compare("linear dinp Accum::Add", &dx2, &plus(&px, &dx), EXACT).unwrap();
    compare("linear dw +=", &dw2, &plus(&pw, &dw), EXACT).unwrap();
    compare("linear db +=", &db2, &plus(&pb, &db), EXACT).unwrap();
}

// ---- attention ---------------------------------------------------------------------------------------

fn attn_fwd(qkv: &[f64], x: Dims, heads: usize) -> (Vec<f64>, Vec<f64>) {
    let t = x.s();
    let (mut out, mut att) = (vec![0.0; x.numel()], vec![0.0; x.n * heads * t * t]);
    attention::attention_forward(&mut out, &mut att, qkv, x, heads, |_| {});
    (out, att)
}

/// Attention from the definition, one (n, h, t) at a time.
fn attn_naive(qkv: &[f64], x: Dims, heads: usize) -> Vec<f64> {
    let (c, t) = (x.c / heads, x.s());
    let scale = (c as f64).powf(-0.25);
    let mut out = vec![0.0; x.numel()];
    for n in 0..x.n {
        for h in 0..heads {
            let ch = |part: usize, j: usize, s: usize| qkv[((n * 3 * x.c) + h * 3 * c + part * c + j) * t + s];
            for q in 0..t {
                let logits: Vec<f64> =
                    (0..t).map(|s| (0..c).map(|j| ch(0, j, q) * scale * ch(1, j, s) * scale).sum()).collect();
                let mx = logits.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = logits.iter().map(|l| (l - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for j in 0..c {
                    out[(n * x.c + h * c + j) * t + q] = (0..t).map(|s| ch(2, j, s) * e[s] / z).sum();
                }
            }
        }
    }
    out
}

#[test]
fn attention_grads() {
    for heads in [1, 2] {
        let x = Dims::new(2, 4, 2, 3, 2);
        let qkv = randn_f64(16 + heads as u64, 0, 3 * x.numel(), 1.0);
        let r = randn_f64(16 + heads as u64, 1, x.numel(), 1.0);
        let (out, att) = attn_fwd(&qkv, x, heads);
        compare(&format!("attention heads={heads} forward vs naive"), &out, &attn_naive(&qkv, x, heads), EXACT)
            .unwrap();
        let (mut dqkv, mut datt) = (vec![7.0; qkv.len()], vec![0.0; att.len()]);
        attention::attention_backward(&mut dqkv, &mut datt, &r, &qkv, &att, x, heads, |_| {});
        gradcheck(&format!("attention heads={heads} dqkv"), &dqkv, &qkv, |p| dot(&r, &attn_fwd(p, x, heads).0));
    }
}

#[test]
fn attention_uniform_keys_average_values() {
    // k = 0 makes every logit equal: att = 1/T, out[j, t] = mean over s of v[j, s].
    let (x, heads) = (Dims::new(1, 6, 3, 2, 2), 3);
    let (c, t) = (2, x.s());
    let mut qkv = randn_f64(18, 0, 3 * x.numel(), 1.0);
    for h in 0..heads {
        qkv[(h * 3 * c + c) * t..(h * 3 * c + 2 * c) * t].fill(0.0);
    }
    let (out, att) = attn_fwd(&qkv, x, heads);
    let mut want = vec![0.0; x.numel()];
    for h in 0..heads {
        for j in 0..c {
            let v = &qkv[(h * 3 * c + 2 * c + j) * t..(h * 3 * c + 2 * c + j + 1) * t];
            want[(h * c + j) * t..(h * c + j + 1) * t].fill(v.iter().sum::<f64>() / t as f64);
        }
    }
    compare("attention uniform keys: out = mean(v)", &out, &want, EXACT).unwrap();
    compare("attention uniform keys: att = 1/T", &att, &vec![1.0 / t as f64; att.len()], EXACT).unwrap();
}

// ---- upsample ----------------------------------------------------------------------------------------

fn up_fwd(x: &[f64], xd: Dims) -> Vec<f64> {
    let mut out = vec![0.0; xd.up2().numel()];
    upsample::upsample_forward(&mut out, x, xd);
    out
}

#[test]
fn upsample_grads() {
    let xd = Dims::new(2, 2, 3, 4, 5);
    let x = randn_f64(19, 0, xd.numel(), 1.0);
    let r = randn_f64(19, 1, xd.up2().numel(), 1.0);
    let mut dx = vec![0.0; x.len()];
    upsample::upsample_backward((&mut dx, Accum::Overwrite), &r, xd);
    gradcheck("upsample dinp", &dx, &x, |p| dot(&r, &up_fwd(p, xd)));
    let p = randn_f64(19, 2, x.len(), 1.0);
    let mut dx2 = p.clone();
    upsample::upsample_backward((&mut dx2, Accum::Add), &r, xd);
    compare("upsample dinp Accum::Add", &dx2, &plus(&p, &dx), EXACT).unwrap();
}

#[test]
fn upsample_of_linear_ramp_is_exact() {
    // f = 1.0·d + 10·h + 100·w (+ 1000·channel): trilinear interpolation reproduces it at the
    // source coordinate, which align_corners=False clamps to [0, n − 1] at the borders.
    let xd = Dims::new(2, 3, 3, 4, 5);
    let mut x = vec![0.0; xd.numel()];
    for nc in 0..xd.n * xd.c {
        for d in 0..xd.d {
            for h in 0..xd.h {
                for w in 0..xd.w {
                    x[((nc * xd.d + d) * xd.h + h) * xd.w + w] =
                        d as f64 + 10.0 * h as f64 + 100.0 * w as f64 + 1e3 * nc as f64;
                }
            }
        }
    }
    let src = |o: usize, n: usize| ((o as f64 + 0.5) / 2.0 - 0.5).clamp(0.0, (n - 1) as f64);
    let u = xd.up2();
    let mut want = vec![0.0; u.numel()];
    for nc in 0..u.n * u.c {
        for d in 0..u.d {
            for h in 0..u.h {
                for w in 0..u.w {
                    want[((nc * u.d + d) * u.h + h) * u.w + w] =
                        src(d, xd.d) + 10.0 * src(h, xd.h) + 100.0 * src(w, xd.w) + 1e3 * nc as f64;
                }
            }
        }
    }
    compare("upsample of a linear ramp", &up_fwd(&x, xd), &want, Tolerance::new(1e-9, 1e-12)).unwrap();
}

// ---- channel plumbing --------------------------------------------------------------------------------

#[test]
fn channel_bias_and_sum_are_adjoint() {
    let xd = Dims::new(2, 3, 2, 3, 4);
    let x = randn_f64(20, 0, xd.numel(), 1.0);
    let bias = randn_f64(20, 1, xd.n * xd.c, 1.0);
    let r = randn_f64(20, 2, xd.numel(), 1.0);
    let fwd = |bias: &[f64]| {
        let mut y = x.clone();
        elementwise::add_channel_bias(&mut y, bias, xd);
        y
    };
    let mut want = x.clone();
    for (i, v) in want.iter_mut().enumerate() {
        *v += bias[i / xd.s()];
    }
    compare("add_channel_bias forward", &fwd(&bias), &want, EXACT).unwrap();
    let mut dbias = vec![5.0; bias.len()];
    elementwise::channel_sum(&mut dbias, &r, xd);
    gradcheck("channel_sum = d(add_channel_bias)/dbias", &dbias, &bias, |b| dot(&r, &fwd(b)));
}

#[test]
fn concat_split_are_adjoint() {
    let (x, ca, cb) = (Dims::new(3, 0, 2, 2, 3), 2, 3);
    let a = randn_f64(21, 0, x.n * ca * x.s(), 1.0);
    let b = randn_f64(21, 1, x.n * cb * x.s(), 1.0);
    let r = randn_f64(21, 2, x.n * (ca + cb) * x.s(), 1.0);
    let fwd = |a: &[f64], b: &[f64]| {
        let mut out = vec![0.0; r.len()];
        elementwise::concat_channels(&mut out, a, b, x, ca, cb);
        out
    };
    // Forward from the definition: out[n, c] is a[n, c] for c < ca, else b[n, c − ca].
    let s = x.s();
    let want: Vec<f64> = (0..r.len())
        .map(|i| {
            let (n, c, v) = (i / ((ca + cb) * s), (i / s) % (ca + cb), i % s);
            if c < ca {
                a[(n * ca + c) * s + v]
            } else {
                b[(n * cb + c - ca) * s + v]
            }
        })
        .collect();
    compare("concat forward", &fwd(&a, &b), &want, EXACT).unwrap();
    let (mut da, mut db) = (vec![9.0; a.len()], vec![0.0; b.len()]);
    let pa = da.clone();
    elementwise::split_channels((&mut da, Accum::Add), (&mut db, Accum::Overwrite), &r, x, ca, cb);
    let mut dbo = vec![0.0; b.len()];
    let mut dao = vec![0.0; a.len()];
    elementwise::split_channels((&mut dao, Accum::Overwrite), (&mut dbo, Accum::Overwrite), &r, x, ca, cb);
    gradcheck("split da", &dao, &a, |p| dot(&r, &fwd(p, &b)));
    gradcheck("split db", &db, &b, |p| dot(&r, &fwd(&a, p)));
    compare("split da Accum::Add", &da, &plus(&pa, &dao), EXACT).unwrap();
}

#[test]
fn add_assign_and_scale() {
    let a = randn_f64(22, 0, 40_000, 1.0);
    let b = randn_f64(22, 1, 40_000, 1.0);
    let mut c = a.clone();
    elementwise::add_assign(&mut c, &b);
    compare("add_assign", &c, &plus(&a, &b), EXACT).unwrap();
    elementwise::scale(&mut c, -0.5);
    let want: Vec<f64> = a.iter().zip(&b).map(|(x, y)| -0.5 * (x + y)).collect();
    compare("scale", &c, &want, EXACT).unwrap();
}

// ---- loss --------------------------------------------------------------------------------------------

#[test]
fn loss_grads_and_values() {
    let n = 200;
    let t = randn_f64(23, 0, n, 1.0);
    // Keep |pred − target| ≥ 0.1 so L1 is smooth within the finite-difference step.
    let p: Vec<f64> = uniform_f64(23, 1, n, 0.1, 1.0)
        .iter()
        .zip(&randn_f64(23, 2, n, 1.0))
        .zip(&t)
        .map(|((u, s), t)| t + u * s.signum())
        .collect();
    for (kind, name) in [(LossKind::L1, "L1"), (LossKind::L2, "L2")] {
        let want = p
            .iter()
            .zip(&t)
            .map(|(a, b)| if kind == LossKind::L1 { (a - b).abs() } else { (a - b).powi(2) })
            .sum::<f64>()
            / n as f64;
        let got = loss::loss_forward(&p, &t, kind);
        compare(&format!("{name} loss forward"), &[got], &[want], EXACT).unwrap();
        let mut g = vec![3.0; n];
        loss::loss_backward(&mut g, &p, &t, kind, 2.5);
        let g1: Vec<f64> = g.iter().map(|v| v / 2.5).collect();
        gradcheck(&format!("{name} loss dpred (scale 2.5)"), &g1, &p, |pp| loss::loss_forward(pp, &t, kind));
    }
    // L1 gradient is 0 where pred == target (torch.sign(0) = 0).
    let mut g = vec![1.0; 3];
    loss::loss_backward(&mut g, &[1.0, 2.0, 3.0], &[1.0, 0.0, 4.0], LossKind::L1, 1.0);
    compare("L1 sign(0) = 0", &g, &[0.0, 1.0 / 3.0, -1.0 / 3.0], EXACT).unwrap();
}

// ---- diffusion and optimiser (f32 backend vs hand computation) --------------------------------------

#[test]
fn randn_matches_philox() {
    let be = meddpm::cpu::CpuBackend::new();
    let x = Dims::new(2, 3, 5, 7, 11);
    let rng = Philox::new(1234, 7);
    let mut out = vec![0f32; x.numel()];
    be.randn(&mut out, rng, 1000, x);
    let want: Vec<f32> = (0..x.numel()).map(|i| rng.normal(1000 + i as u64)).collect();
    assert!(out.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "randn differs from Philox::normal");
    let mut out64 = vec![0f64; x.numel()];
    diffusion::randn(&mut out64, rng, 1000, x);
    assert!(out64.iter().zip(&want).all(|(&a, &b)| a == b as f64), "f64 randn differs from Philox::normal");
}

#[test]
fn q_sample_and_ddpm_step_by_hand() {
    let be = meddpm::cpu::CpuBackend::new();
    let x = Dims::new(2, 1, 2, 3, 4);
    let per = x.numel() / 2;
    let x0 = randn_f32(24, 0, x.numel(), 0.8);
    let eps = randn_f32(24, 1, x.numel(), 1.0);
    let z = randn_f32(24, 2, x.numel(), 1.0);
    let (a, b) = ([0.9f32, 0.3], [0.43589f32, 0.95394]);
    let mut xt = vec![0f32; x.numel()];
    be.q_sample(&mut xt, &x0, &eps, &a, &b, x);
    let want: Vec<f64> =
        (0..x.numel()).map(|i| a[i / per] as f64 * x0[i] as f64 + b[i / per] as f64 * eps[i] as f64).collect();
    compare("q_sample", &xt, &want, F32_TOL).unwrap();

    let coefs = [
        DdpmCoefs { recip: 1.2, recipm1: 0.66, coef1: 0.3, coef2: 0.65, sigma: 0.1 },
        DdpmCoefs { recip: 3.0, recipm1: 2.8, coef1: 0.05, coef2: 0.9, sigma: 0.0 },
    ];
    let mut xs = xt.clone();
    be.ddpm_step(&mut xs, &eps, &z, &coefs, x);
    let want: Vec<f64> = (0..x.numel())
        .map(|i| {
            let c = coefs[i / per];
            let (xv, ev) = (xt[i] as f64, eps[i] as f64);
            let x0 = (c.recip as f64 * xv - c.recipm1 as f64 * ev).clamp(-1.0, 1.0);
            c.coef1 as f64 * x0 + c.coef2 as f64 * xv + c.sigma as f64 * z[i] as f64
        })
        .collect();
    compare("ddpm_step", &xs, &want, F32_TOL).unwrap();
    // The clamp must have been active somewhere for this test to mean something.
    assert!(xt.iter().zip(&eps).any(|(&xv, &ev)| (3.0 * xv - 2.8 * ev).abs() > 1.0));
}

#[test]
fn adam_two_steps_by_hand() {
    let be = meddpm::cpu::CpuBackend::new();
    let p0 = vec![0.5f32, -1.0, 2.0, 0.0];
    let g1 = vec![0.1f32, -0.2, 0.0, 3.0];
    let g2 = vec![-0.3f32, 0.1, 1e-3, 3.0];
    let h = AdamStep { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, t: 1 };
    let (mut p, mut m, mut v) = (p0.clone(), vec![0f32; 4], vec![0f32; 4]);
    be.adam_step(&mut p, &g1, &mut m, &mut v, h);
    // Step 1: m̂ = g, v̂ = g², so p ← p − lr·g/(|g| + eps).
    let want1: Vec<f64> =
        p0.iter().zip(&g1).map(|(&p, &g)| p as f64 - 1e-2 * g as f64 / ((g as f64).abs() + 1e-8)).collect();
    compare("adam step 1", &p, &want1, Tolerance::new(1e-7, 1e-6)).unwrap();
    be.adam_step(&mut p, &g2, &mut m, &mut v, AdamStep { t: 2, ..h });
    let want2: Vec<f64> = (0..4)
        .map(|i| {
            let (g1, g2) = (g1[i] as f64, g2[i] as f64);
            let m = 0.9 * 0.1 * g1 + 0.1 * g2;
            let v = 0.999 * 0.001 * g1 * g1 + 0.001 * g2 * g2;
            let (mh, vh) = (m / (1.0 - 0.81), v / (1.0 - 0.999f64.powi(2)));
            want1[i] - 1e-2 * mh / (vh.sqrt() + 1e-8)
        })
        .collect();
    compare("adam step 2", &p, &want2, Tolerance::new(1e-6, 1e-5)).unwrap();

    let mut ema = vec![1f32, 2.0, 3.0, 4.0];
    be.ema_update(&mut ema, &p0, 0.75);
    let want: Vec<f64> = [1.0, 2.0, 3.0, 4.0].iter().zip(&p0).map(|(e, &p)| 0.75 * e + 0.25 * p as f64).collect();
    compare("ema", &ema, &want, F32_TOL).unwrap();
    // The f64 path agrees with the hand computation tightly.
    let (mut p, mut m, mut v) = (vec![0.5f64], vec![0.0], vec![0.0]);
    optim::adam_step(&mut p, &[0.1], &mut m, &mut v, h);
    compare("adam f64 step 1", &p, &[0.5 - 1e-2 * 0.1 / (0.1 + 1e-8)], Tolerance::new(1e-9, 1e-8)).unwrap();
}

// ---- the backend dispatch (f32) against the f64 kernels -------------------------------------------

#[test]
fn backend_dispatch_matches_f64() {
    let be = meddpm::cpu::CpuBackend::new();
    let cs = ConvShape::new(Dims::new(1, 4, 6, 5, 4), 8, 3, 2);
    let (x, w, b) = (randn_f64(25, 0, cs.x.numel(), 1.0), randn_f64(25, 1, cs.w_len(), 0.3), randn_f64(25, 2, 8, 1.0));
    let r = randn_f64(25, 3, cs.out().numel(), 1.0);
    let mut out = vec![0.0; r.len()];
    conv3d::conv3d_forward(&mut out, &x, &w, &b, cs);
    let (mut dx, mut dw, mut db) = (vec![0.0; x.len()], vec![0.0; w.len()], vec![0.0; 8]);
    conv3d::conv3d_backward(Some((&mut dx, Accum::Overwrite)), &mut dw, &mut db, &r, &x, &w, cs);
    // Dirty this thread's cached im2col scratch with a larger conv first: stale contents must not leak.
    let big = ConvShape::new(Dims::new(1, 5, 7, 7, 7), 3, 3, 1);
    let (bx, bw) = (randn_f32(25, 4, big.x.numel(), 1.0), randn_f32(25, 5, big.w_len(), 1.0));
    let (mut bo, mut bdx, mut bdw, mut bdb) =
        (vec![0f32; big.out().numel()], vec![0f32; bx.len()], vec![0f32; bw.len()], vec![0f32; 3]);
    be.conv3d_forward(&mut bo, &bx, &bw, &[1.0; 3].to_vec(), big);
    be.conv3d_backward(Some((&mut bdx, Accum::Add)), &mut bdw, Some(&mut bdb), &bo, &bx, &bw, big);
    let (x32, w32, b32, r32) = (to_f32(&x), to_f32(&w), to_f32(&b), to_f32(&r));
    let mut out32 = vec![0f32; r.len()];
    be.conv3d_forward(&mut out32, &x32, &w32, &b32, cs);
    compare("backend conv3d forward", &out32, &out, F32_TOL).unwrap();
    let (mut dx32, mut dw32, mut db32) = (vec![0f32; x.len()], vec![0f32; w.len()], vec![0f32; 8]);
    be.conv3d_backward(Some((&mut dx32, Accum::Overwrite)), &mut dw32, Some(&mut db32), &r32, &x32, &w32, cs);
    compare("backend conv3d dinp", &dx32, &dx, F32_TOL).unwrap();
    compare("backend conv3d dw", &dw32, &dw, F32_TOL).unwrap();
    compare("backend conv3d db", &db32, &db, F32_TOL).unwrap();

    let (xd, heads) = (Dims::new(1, 4, 2, 2, 3), 2);
    let qkv = randn_f64(26, 0, 3 * xd.numel(), 1.0);
    let (o64, a64) = attn_fwd(&qkv, xd, heads);
    let (mut o32, mut a32) = (vec![0f32; o64.len()], vec![0f32; a64.len()]);
    be.attention_forward(&mut o32, &mut a32, &to_f32(&qkv), xd, heads);
    compare("backend attention out", &o32, &o64, F32_TOL).unwrap();
    let mut up32 = vec![0f32; xd.up2().numel()];
    be.upsample_forward(&mut up32, &to_f32(&o64), xd);
    compare("backend upsample", &up32, &up_fwd(&o64, xd), F32_TOL).unwrap();
    let mut l = vec![0f32; 1];
    be.loss_forward(&mut l, &to_f32(&o64), &to_f32(&qkv[..o64.len()]), LossKind::L1);
    compare("backend L1", &l, &[loss::loss_forward(&o64, &qkv[..o64.len()], LossKind::L1)], F32_TOL).unwrap();
}

/// Timing of one 16→16 k=3 conv at 32³ (run with `--ignored --nocapture`).
#[test]
#[ignore]
fn bench_conv3d_16x16_32cubed() {
    let be = meddpm::cpu::CpuBackend::new();
    let cs = ConvShape::new(Dims::new(1, 16, 32, 32, 32), 16, 3, 1);
    let x = randn_f32(27, 0, cs.x.numel(), 1.0);
    let w = randn_f32(27, 1, cs.w_len(), 0.1);
    let b = vec![0f32; 16];
    let mut out = vec![0f32; cs.out().numel()];
    let (mut dx, mut dw, mut db) = (vec![0f32; x.len()], vec![0f32; w.len()], vec![0f32; 16]);
    // Process CPU seconds (user + system, all threads) from /proc/self/stat; 0 where unavailable.
    let cpu_s = || -> f64 {
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
        let after = stat.rsplit(')').next().unwrap_or("");
        let f: Vec<f64> = after.split_whitespace().map(|v| v.parse().unwrap_or(0.0)).collect();
        if f.len() > 13 {
            (f[11] + f[12]) / 100.0
        } else {
            0.0
        }
    };
    // Min and median of 10 runs each (the min is robust to other processes on a shared machine),
    // and CPU time per run (what the work costs regardless of contention).
    let time = |f: &mut dyn FnMut()| {
        f();
        let c0 = cpu_s();
        let mut t: Vec<f64> = (0..10)
            .map(|_| {
                let t0 = std::time::Instant::now();
                f();
                t0.elapsed().as_secs_f64()
            })
            .collect();
        let cpu = (cpu_s() - c0) / 10.0;
        t.sort_by(f64::total_cmp);
        (t[0], t[5], cpu)
    };
    let (f, fm, fc) = time(&mut || be.conv3d_forward(&mut out, &x, &w, &b, cs));
    let dout = randn_f32(27, 2, cs.out().numel(), 1.0);
    let (bw, bm, bc) =
        time(&mut || be.conv3d_backward(Some((&mut dx, Accum::Overwrite)), &mut dw, Some(&mut db), &dout, &x, &w, cs));
    println!(
        "conv3d 16->16 k3 at 32^3 ({} threads): forward min {:.2} ms / median {:.2} ms / CPU {:.1} ms \
         ({:.1} GFLOP/s at min), backward (data + filter + bias) min {:.2} ms / median {:.2} ms / \
         CPU {:.1} ms ({:.1} GFLOP/s at min)",
        rayon::current_num_threads(),
        f * 1e3,
        fm * 1e3,
        fc * 1e3,
        cs.flops() / f / 1e9,
        bw * 1e3,
        bm * 1e3,
        bc * 1e3,
        2.0 * cs.flops() / bw / 1e9
    );
}
