//! Running a sampler ([`super::solvers::Plan`]) on a backend: pure noise x_T, then per step one
//! ε-model evaluation and one [`Backend::sampler_step`]. The ε-model is a trait ([`EpsModel`]):
//! the U-Net with its condition ([`UNetEps`]) in production, a closed-form model in the tests,
//! the same loop for both.
//!
//! Noise (invariant 6): volume n of a batch has its own seed s_n and draws from the Philox stream
//! `STREAM_SAMPLE` of s_n at offsets that depend only on its own size V (one volume): x_T uses
//! [0, V), the noise of step k (0-based) [(k+1)·V, (k+2)·V). A volume is therefore the same in
//! any batch and at any batch position, and with all T DDPM steps a batch-1 run draws exactly the
//! numbers the first meddpm sampler drew (x_T at [0, V), the z of timestep t at (T−t)·V).
//!
//! Batches: [`Sampler::sample_jobs`] runs up to `net.batch` (condition, seed) jobs per forward;
//! a short batch is filled with copies of its last job, whose results are dropped.

use super::schedule::Schedule;
use super::solvers::{plan, Plan, SamplerSpec};
use super::train::STREAM_SAMPLE;
use crate::backend::{Backend, SamplerCoefs};
use crate::error::{Error, Result};
use crate::model::UNet;
use crate::rng::Philox;
use crate::shape::Dims;

/// What a sampler needs from the network: ε̂ for x at per-sample timesteps.
pub trait EpsModel<B: Backend> {
    /// Shape of x and ε̂.
    fn dims(&self) -> Dims;
    /// Evaluate ε̂(x, t) (t: one timestep per sample); the result is in [`EpsModel::output`].
    fn eval(&mut self, be: &B, x: &B::Buf, t: &[f32]);
    /// The ε̂ buffer of the last evaluation (any content before the first).
    fn output(&self) -> &B::Buf;
}

/// The U-Net with its conditioning channels: input = cat(x, cond).
pub struct UNetEps<'a, B: Backend> {
    pub net: &'a mut UNet<B>,
    pub cond: &'a B::Buf,
}

impl<B: Backend> EpsModel<B> for UNetEps<'_, B> {
    fn dims(&self) -> Dims {
        self.net.output_dims()
    }
    fn eval(&mut self, be: &B, x: &B::Buf, t: &[f32]) {
        let img = self.net.output_dims();
        let cc = self.net.cfg.cond_channels();
        be.concat_channels(self.net.input_mut(), x, self.cond, img, img.c, cc);
        self.net.forward(be, t);
    }
    fn output(&self) -> &B::Buf {
        self.net.output()
    }
}

/// Run `plan` with `model`: x (shape `model.dims()`) ends as the sample. `seeds[n]` is volume
/// n's noise seed; `hist` holds at least `plan.history` buffers of x's size. `on_step(k)` after
/// each step.
pub fn run_plan<B: Backend, M: EpsModel<B>>(
    be: &B,
    model: &mut M,
    plan: &Plan,
    seeds: &[u64],
    x: &mut B::Buf,
    hist: &mut [B::Buf],
    mut on_step: impl FnMut(usize),
) -> Result<()> {
    let d = model.dims();
    if seeds.len() != d.n {
        return Err(Error::Config(format!("{} seeds for a batch of {}", seeds.len(), d.n)));
    }
    if hist.len() < plan.history {
        return Err(Error::Config(format!("the plan needs {} history buffers, got {}", plan.history, hist.len())));
    }
    let per = (d.numel() / d.n.max(1)) as u64;
    let hist = &mut hist[..plan.history];
    let coefs = |offset: u64, f: &dyn Fn(&mut SamplerCoefs)| -> Vec<SamplerCoefs> {
        seeds
            .iter()
            .map(|&s| {
                let mut c = SamplerCoefs {
                    recip: 0.0,
                    recipm1: 0.0,
                    cx: 0.0,
                    cd: 0.0,
                    ch: [0.0; 3],
                    cz: 0.0,
                    noise: Philox::new(s, STREAM_SAMPLE),
                    offset,
                };
                f(&mut c);
                c
            })
            .collect()
    };
    // x_T = z: every other coefficient is zero, so neither x nor the stand-in ε̂ is read.
    let init = coefs(0, &|c| c.cz = 1.0);
    be.sampler_step(x, model.output(), &mut [], plan.pred, false, &init, d);
    for (k, st) in plan.steps.iter().enumerate() {
        model.eval(be, x, &vec![st.t as f32; d.n]);
        let c = coefs((k as u64 + 1) * per, &|c| {
            c.recip = st.recip as f32;
            c.recipm1 = st.recipm1 as f32;
            c.cx = st.cx as f32;
            c.cd = st.cd as f32;
            c.ch = st.ch.map(|v| v as f32);
            c.cz = st.cz as f32;
        });
        be.sampler_step(x, model.output(), hist, plan.pred, plan.clip, &c, d);
        if !hist.is_empty() {
            hist.rotate_right(1);
        }
        on_step(k);
    }
    Ok(())
}

/// Buffers of sampling runs with one network (planned once, reused across calls).
pub struct Sampler<B: Backend> {
    x: B::Buf,
    cond: B::Buf,
    hist: Vec<B::Buf>,
}

impl<B: Backend> Sampler<B> {
    pub fn new(be: &B, net: &UNet<B>) -> Result<Self> {
        let img = net.output_dims();
        let cd = net.input_dims().with_c(net.cfg.cond_channels());
        Ok(Sampler { x: be.alloc(img.numel())?, cond: be.alloc(cd.numel())?, hist: Vec::new() })
    }

    /// The reference sampler (ancestral DDPM, all T steps) for `cond` (host NCDHW
    /// (N, cond_ch, D, H, W), N = the network's batch); volume n uses seed `seed + n`. Returns host
    /// NCDHW (N, out_ch, D, H, W). `on_step(i)` is called after each of the T steps.
    pub fn sample(
        &mut self,
        be: &B,
        net: &mut UNet<B>,
        sched: &Schedule,
        cond: &[f32],
        seed: u64,
        on_step: impl FnMut(usize),
    ) -> Result<Vec<f32>> {
        let plan = plan(&SamplerSpec::ddpm(sched.timesteps), sched)?;
        let seeds: Vec<u64> = (0..net.batch as u64).map(|n| seed + n).collect();
        self.sample_batch(be, net, &plan, cond, &seeds, on_step)
    }

    /// Run `plan` for a full batch: `cond` host NCDHW (N, cond_ch, D, H, W), one seed per volume.
    /// Returns host NCDHW (N, out_ch, D, H, W).
    pub fn sample_batch(
        &mut self,
        be: &B,
        net: &mut UNet<B>,
        plan: &Plan,
        cond: &[f32],
        seeds: &[u64],
        on_step: impl FnMut(usize),
    ) -> Result<Vec<f32>> {
        let img = net.output_dims();
        let cd = net.input_dims().with_c(net.cfg.cond_channels());
        if cond.len() != cd.numel() {
            return Err(Error::Config(format!(
                "condition has {} values, the model expects {} ({cd})",
                cond.len(),
                cd.numel()
            )));
        }
        if be.len(&self.x) != img.numel() {
            return Err(Error::Config(format!("this sampler was planned for another network than {img}")));
        }
        while self.hist.len() < plan.history {
            self.hist.push(be.alloc(img.numel())?);
        }
        be.upload_act(cond, cd, &mut self.cond);
        let mut model = UNetEps { net, cond: &self.cond };
        run_plan(be, &mut model, plan, seeds, &mut self.x, &mut self.hist, on_step)?;
        let mut out = vec![0f32; img.numel()];
        be.download_act(&self.x, img, &mut out);
        Ok(out)
    }

    /// Run `plan` for up to `net.batch` jobs (condition of one volume, host NCDHW (cond_ch, D, H,
    /// W); seed) in one batch; returns one host volume (out_ch, D, H, W) per job. A short batch
    /// is padded with copies of the last job.
    pub fn sample_jobs(
        &mut self,
        be: &B,
        net: &mut UNet<B>,
        plan: &Plan,
        jobs: &[(&[f32], u64)],
        on_step: impl FnMut(usize),
    ) -> Result<Vec<Vec<f32>>> {
        let b = net.batch;
        if jobs.is_empty() || jobs.len() > b {
            return Err(Error::Config(format!("{} jobs for a network of batch {b}", jobs.len())));
        }
        let per_cond = Dims { n: 1, ..net.input_dims().with_c(net.cfg.cond_channels()) }.numel();
        let mut cond = Vec::with_capacity(per_cond * b);
        let mut seeds = Vec::with_capacity(b);
        for n in 0..b {
            let (c, s) = jobs[n.min(jobs.len() - 1)];
            if c.len() != per_cond {
                return Err(Error::Config(format!(
                    "condition of job {n} has {} values, one volume needs {per_cond}",
                    c.len()
                )));
            }
            cond.extend_from_slice(c);
            seeds.push(s);
        }
        let out = self.sample_batch(be, net, plan, &cond, &seeds, on_step)?;
        let per = out.len() / b;
        Ok(out.chunks(per).take(jobs.len()).map(|v| v.to_vec()).collect())
    }
}
