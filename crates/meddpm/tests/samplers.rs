//! The samplers (crates/meddpm/src/diffusion/{solvers,sampler}.rs) on the CPU reference:
//! - the `sampler_step` primitive against a scalar f64 evaluation of its definition;
//! - the default sampler (DDPM, all T steps) bit-identical to the first meddpm sampler
//!   (`randn` + `ddpm_step` with whole-buffer noise), and DDIM η = 1 over all steps equal to it;
//! - batched sampling equal to one-volume sampling, bit for bit, for every sampler;
//! - convergence orders on a Gaussian toy whose exact ε-predictor and ODE solution are known in
//!   closed form, driven through the same `run_plan` loop as the U-Net.

use meddpm::backend::{Prediction, SamplerCoefs};
use meddpm::cpu::CpuBackend;
use meddpm::diffusion::solvers::{ipndm_plan, Plan};
use meddpm::diffusion::train::STREAM_SAMPLE;
use meddpm::diffusion::{plan, run_plan, EpsModel, Sampler, SamplerKind, SamplerSpec, Schedule};
use meddpm::model::{UNet, UNetConfig};
use meddpm::rng::Philox;
use meddpm::{Backend, Dims};

fn rand(n: usize, stream: u64, scale: f32) -> Vec<f32> {
    let r = Philox::new(4242, stream);
    (0..n).map(|i| scale * r.normal(i as u64)).collect()
}

/// A tiny U-Net with random weights (zero-initialised output convs would make ε̂ = 0).
fn tiny_net(be: &CpuBackend, batch: usize) -> UNet<CpuBackend> {
    let cfg = UNetConfig::tiny();
    let mut net = UNet::new(be, &cfg, batch).unwrap();
    let host: Vec<Vec<f32>> = net.specs.iter().enumerate().map(|(i, s)| rand(s.numel(), 500 + i as u64, 0.2)).collect();
    net.set_params(be, &host).unwrap();
    net
}

fn cond(variant: u32) -> Vec<f32> {
    let c = UNetConfig::tiny();
    meddpm::phantom::pair(c.depth, c.size, c.size, variant).1
}

fn spec(kind: SamplerKind, steps: usize, eta: f64) -> SamplerSpec {
    SamplerSpec { kind, steps, eta }
}

#[test]
fn sampler_step_by_hand() {
    let be = CpuBackend::new();
    let xd = Dims::new(2, 1, 2, 3, 4);
    let n = xd.numel();
    let per = n / 2;
    let x0 = rand(n, 1, 1.5);
    let eps = rand(n, 2, 1.0);
    let h0 = rand(n, 3, 1.0);
    let coef = |k: usize| SamplerCoefs {
        recip: 1.3 + 0.2 * k as f32,
        recipm1: 0.7,
        cx: 0.9,
        cd: 0.4 - 0.1 * k as f32,
        ch: [0.3, -0.2, 0.1],
        cz: 0.05 * (k + 1) as f32,
        noise: Philox::new(10 + k as u64, STREAM_SAMPLE),
        offset: 1000 * k as u64,
    };
    let coefs = [coef(0), coef(1)];
    for pred in [Prediction::Data, Prediction::Noise] {
        for clip in [false, true] {
            let mut x = x0.clone();
            let mut hist = vec![h0.clone(), rand(n, 4, 1.0), rand(n, 5, 1.0)];
            let before = hist.clone();
            be.sampler_step(&mut x, &eps, &mut hist, pred, clip, &coefs, xd);
            let mut clipped = 0;
            for i in 0..n {
                let (k, j) = (i / per, i % per);
                let c = coefs[k];
                let f = |v: f32| v as f64;
                let x0u = f(c.recip) * f(x0[i]) - f(c.recipm1) * f(eps[i]);
                let xh = if clip { x0u.clamp(-1.0, 1.0) } else { x0u };
                clipped += (xh != x0u) as usize;
                let d = match pred {
                    Prediction::Data => xh,
                    Prediction::Noise => (f(c.recip) * f(x0[i]) - xh) / f(c.recipm1),
                };
                let z = c.noise.normal(c.offset + j as u64) as f64;
                let want = f(c.cd) * d
                    + f(c.cx) * f(x0[i])
                    + (0..3).map(|h| f(c.ch[h]) * f(before[h][i])).sum::<f64>()
                    + f(c.cz) * z;
                assert!((x[i] as f64 - want).abs() < 2e-6, "{pred:?} clip {clip} element {i}: {} vs {want}", x[i]);
                assert!((hist[2][i] as f64 - d).abs() < 2e-6, "d is written into the last history buffer");
                assert_eq!((hist[0][i], hist[1][i]), (before[0][i], before[1][i]), "older history is only read");
            }
            assert_eq!(clipped > 0, clip, "the test data reach the clamp");
        }
    }
    // Zero coefficients skip their terms: a NaN x is not read when cx = cd = 0 (the x_T draw),
    // and z depends on the sample's own (seed, offset), not on its batch position.
    let mut x = vec![f32::NAN; n];
    let only_z = |k: usize| SamplerCoefs { cx: 0.0, cd: 0.0, ch: [0.0; 3], cz: 1.0, ..coef(k) };
    be.sampler_step(&mut x, &eps, &mut [], Prediction::Data, true, &[only_z(1), only_z(0)], xd);
    for (i, &v) in x.iter().enumerate() {
        let (k, j) = (1 - i / per, i % per);
        assert_eq!(v, coefs[k].noise.normal(coefs[k].offset + j as u64));
    }
}

/// The first meddpm sampler (before the sampler family), kept here as the reference: x_T from
/// offsets [0, V) of one stream over the whole buffer, the z of timestep t at (T − t)·V.
fn original_ddpm(be: &CpuBackend, net: &mut UNet<CpuBackend>, sched: &Schedule, cond: &[f32], seed: u64) -> Vec<f32> {
    let img = net.output_dims();
    let cd = net.input_dims().with_c(net.cfg.cond_channels());
    let rng = Philox::new(seed, STREAM_SAMPLE);
    let numel = img.numel() as u64;
    let (mut x, mut z, mut c) =
        (be.alloc(img.numel()).unwrap(), be.alloc(img.numel()).unwrap(), be.alloc(cd.numel()).unwrap());
    be.upload_act(cond, cd, &mut c);
    be.randn(&mut x, rng, 0, img);
    for t in (0..sched.timesteps).rev() {
        be.concat_channels(net.input_mut(), &x, &c, img, img.c, cd.c);
        net.forward(be, &vec![t as f32; img.n]);
        be.randn(&mut z, rng, (sched.timesteps - t) as u64 * numel, img);
        be.ddpm_step(&mut x, net.output(), &z, &vec![sched.ddpm_coefs(t); img.n], img);
    }
    x
}

#[test]
fn default_sampler_is_the_original_ddpm_and_ddim_eta_one_matches_it() {
    let be = CpuBackend::new();
    let mut net = tiny_net(&be, 1);
    let sched = Schedule::cosine(250);
    let c = cond(1);
    let want = original_ddpm(&be, &mut net, &sched, &c, 7);
    let mut s = Sampler::new(&be, &net).unwrap();
    let got = s.sample(&be, &mut net, &sched, &c, 7, |_| {}).unwrap();
    assert!(got.iter().zip(&want).all(|(a, b)| a == b), "DDPM-250 must reproduce the original sampler exactly");
    assert!(want.iter().all(|v| (-1.0..=1.0).contains(v)) && want.iter().any(|v| v.abs() > 0.05));

    // DDIM with η = 1 over all 250 steps: the same noise, variance and clipping.
    let ddim1 = plan(&spec(SamplerKind::Ddim, 250, 1.0), &sched).unwrap();
    let d1 = s.sample_batch(&be, &mut net, &ddim1, &c, &[7], |_| {}).unwrap();
    let max = d1.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(max < 1e-4, "DDIM eta=1 differs from DDPM by {max}");
    // ... and that is not because the noise does not matter: η = 0 lands elsewhere
    let ddim0 = plan(&spec(SamplerKind::Ddim, 250, 0.0), &sched).unwrap();
    let d0 = s.sample_batch(&be, &mut net, &ddim0, &c, &[7], |_| {}).unwrap();
    let far = d0.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(far > 0.05, "DDIM eta=0 vs DDPM: {far}");
    println!("DDIM eta=1 vs DDPM-250: max |diff| {max:e}; eta=0 vs DDPM: {far}");
}

#[test]
fn batched_sampling_equals_one_volume_at_a_time() {
    let be = CpuBackend::new();
    let sched = Schedule::cosine(250);
    let mut one = tiny_net(&be, 1);
    let mut three = tiny_net(&be, 3);
    let mut s1 = Sampler::new(&be, &one).unwrap();
    let mut s3 = Sampler::new(&be, &three).unwrap();
    let conds = [cond(0), cond(1), cond(2)];
    for sp in [
        spec(SamplerKind::Ddpm, 6, 0.0),
        spec(SamplerKind::Ddim, 6, 0.5),
        spec(SamplerKind::DpmSolverPp, 6, 0.0),
        spec(SamplerKind::Ipndm, 6, 0.0),
    ] {
        let p = plan(&sp, &sched).unwrap();
        // different masks and seeds in one batch
        let jobs: Vec<(&[f32], u64)> = vec![(&conds[0], 3), (&conds[1], 11), (&conds[2], 5)];
        let batched = s3.sample_jobs(&be, &mut three, &p, &jobs, |_| {}).unwrap();
        // other positions, and a short batch padded with a copy of its last job
        let swapped = s3.sample_jobs(&be, &mut three, &p, &[jobs[2], jobs[0]], |_| {}).unwrap();
        for (k, (c, seed)) in jobs.iter().enumerate() {
            let alone = s1.sample_jobs(&be, &mut one, &p, &[(c, *seed)], |_| {}).unwrap();
            assert!(batched[k] == alone[0], "{sp}: job {k} differs in a batch of 3");
        }
        assert!(swapped[0] == batched[2] && swapped[1] == batched[0], "{sp}: batch position changed a volume");
        assert!(batched[0] != batched[1] && batched[1] != batched[2]);
    }
    // bad input names the problem
    let p = plan(&spec(SamplerKind::Ddim, 3, 0.0), &sched).unwrap();
    let e = s1.sample_jobs(&be, &mut one, &p, &[(&conds[0][1..], 1)], |_| {}).unwrap_err().to_string();
    assert!(e.contains("condition of job 0"), "{e}");
    let e = s1.sample_jobs(&be, &mut one, &p, &[(&conds[0], 1), (&conds[1], 2)], |_| {}).unwrap_err().to_string();
    assert!(e.contains("2 jobs for a network of batch 1"), "{e}");
}

// ---- convergence on a Gaussian toy ----------------------------------------------------------------
//
// Data x₀ ~ N(μ, s²) per element. Then x_t ~ N(√ᾱ μ, ᾱ s² + 1 − ᾱ) and the exact ε-predictor is
// ε*(x, t) = √(1−ᾱ)·(x − √ᾱ μ)/(ᾱ s² + 1 − ᾱ). Along the probability-flow ODE the standardised
// value z = (x − √ᾱ μ)/√(ᾱ s² + 1 − ᾱ) is constant, so the exact end point of a deterministic
// sampler from x_start is √ᾱ_e μ + √(ᾱ_e s² + 1 − ᾱ_e)·z (ᾱ_e = the plan's end_alpha_bar).
// With |μ| + 4s < 1 the clamp of x̂₀ never acts, so the samplers solve the plain ODE.

const MU: f64 = 0.1;
const SD: f64 = 0.2;

struct Toy {
    sched: Schedule,
    dims: Dims,
    out: Vec<f32>,
}

impl EpsModel<CpuBackend> for Toy {
    fn dims(&self) -> Dims {
        self.dims
    }
    fn eval(&mut self, _be: &CpuBackend, x: &Vec<f32>, t: &[f32]) {
        let per = self.dims.numel() / self.dims.n;
        for (i, (o, &xv)) in self.out.iter_mut().zip(x).enumerate() {
            let a = self.sched.alpha_bar_at(t[i / per] as f64);
            *o = ((1.0 - a).sqrt() * (xv as f64 - a.sqrt() * MU) / (a * SD * SD + 1.0 - a)) as f32;
        }
    }
    fn output(&self) -> &Vec<f32> {
        &self.out
    }
}

/// RMS error of `plan`'s result against the exact ODE solution, over 2 × 512 elements.
fn toy_error(sched: &Schedule, p: &Plan) -> f64 {
    let be = CpuBackend::new();
    let dims = Dims::new(2, 1, 8, 8, 8);
    let seeds = [1u64, 2];
    let mut toy = Toy { sched: sched.clone(), dims, out: vec![0.0; dims.numel()] };
    let mut x = be.alloc(dims.numel()).unwrap();
    let mut hist: Vec<Vec<f32>> = (0..p.history).map(|_| be.alloc(dims.numel()).unwrap()).collect();
    run_plan(&be, &mut toy, p, &seeds, &mut x, &mut hist, |_| {}).unwrap();
    let a0 = sched.alpha_bar_at(p.steps[0].t);
    let ae = p.end_alpha_bar;
    let per = dims.numel() / 2;
    let mut se = 0.0;
    for (i, &xv) in x.iter().enumerate() {
        let start = Philox::new(seeds[i / per], STREAM_SAMPLE).normal((i % per) as u64) as f64;
        let z = (start - a0.sqrt() * MU) / (a0 * SD * SD + 1.0 - a0).sqrt();
        let exact = ae.sqrt() * MU + (ae * SD * SD + 1.0 - ae).sqrt() * z;
        se += (xv as f64 - exact).powi(2);
    }
    (se / x.len() as f64).sqrt()
}

/// Least-squares slope of −log(error) against log(steps), and the errors.
fn order(sched: &Schedule, steps: &[usize], make: impl Fn(usize) -> Plan) -> (f64, Vec<f64>) {
    let errs: Vec<f64> = steps.iter().map(|&s| toy_error(sched, &make(s))).collect();
    let xs: Vec<f64> = steps.iter().map(|&s| (s as f64).ln()).collect();
    let ys: Vec<f64> = errs.iter().map(|e| -e.ln()).collect();
    let (mx, my) = (xs.iter().sum::<f64>() / xs.len() as f64, ys.iter().sum::<f64>() / ys.len() as f64);
    let num: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let den: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
    (num / den, errs)
}

#[test]
fn convergence_orders_on_a_gaussian_toy() {
    let sched = Schedule::cosine(250);
    let by = |kind: SamplerKind| move |s: usize| plan(&spec(kind, s, 0.0), &Schedule::cosine(250)).unwrap();

    // DDIM (η = 0) is first order; steps that divide T keep its linear selection exactly uniform.
    let (p, e) = order(&sched, &[10, 25, 50, 125], by(SamplerKind::Ddim));
    println!("ddim: order {p:.3}, errors {e:?}");
    assert!((0.85..=1.15).contains(&p), "DDIM order {p} (errors {e:?})");

    // DPM-Solver++(2M) is second order (time-uniform steps; the asymptotic range starts near 60).
    let (p, e) = order(&sched, &[60, 80, 120, 160, 250], by(SamplerKind::DpmSolverPp));
    println!("dpm-solver++: order {p:.3}, errors {e:?}");
    assert!((1.8..=2.3).contains(&p), "DPM-Solver++(2M) order {p} (errors {e:?})");

    // iPNDM: AB weights for steps uniform in t, so on [T−1, 0] with T = 250 its integer grid
    // ⌊i·249/S⌋ is uneven (249 = 3·83) and near t = 0 the cosine schedule's ρ(t) bends sharply;
    // its order shows on an interior interval with exactly uniform steps: about 3 over 10–30
    // steps (the regime it is used in), tending to 2 for many steps (fixed AB weights in t
    // against an integral in ρ; f64 runs of the same toy: 2.3 at 80→120 steps).
    let fine = Schedule::cosine(2401);
    let interior = |s: usize| {
        let ts: Vec<usize> = (0..=s).rev().map(|i| 480 + i * 960 / s).collect();
        ipndm_plan(&fine, &ts)
    };
    let (p, e) = order(&fine, &[10, 15, 20, 30], interior);
    println!("ipndm (interior, uniform): order {p:.3}, errors {e:?}");
    assert!((2.5..=3.5).contains(&p), "iPNDM order {p} (errors {e:?})");

    // The whole production path at 10 steps: iPNDM < DPM-Solver++ < DDIM in error.
    let at10: Vec<f64> = [SamplerKind::Ipndm, SamplerKind::DpmSolverPp, SamplerKind::Ddim]
        .iter()
        .map(|&k| toy_error(&sched, &plan(&spec(k, 10, 0.0), &sched).unwrap()))
        .collect();
    println!("10 steps, full range: ipndm {:.3e}, dpm-solver++ {:.3e}, ddim {:.3e}", at10[0], at10[1], at10[2]);
    assert!(at10[0] < at10[1] && at10[1] < at10[2], "{at10:?}");
}
