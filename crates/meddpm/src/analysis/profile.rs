//! Profile the Med-DDPM U-Net through a [`Timed`] backend: one training step (a micro-step —
//! draw t and ε, q_sample, forward, L1 loss, backward — then the Adam step and EMA rule) and one
//! sampling step (forward, draw z, ancestral update), each after `warmup` unrecorded repetitions.
//! The result is one [`Pass`] per step with every backend call as a record under the range path
//! `pass/phase/block` (`train/forward/input_blocks.1.0`, `train/optimizer`, `sample/forward/out`).
//!
//! Over the CPU backend this is `meddpm profile --device cpu`; over [`super::timed::NullBackend`]
//! it counts the calls, FLOPs and bytes of any preset without computing (the roofline input).
//! The training step is exactly `Trainer::micro_step_ahead` + `Trainer::opt_step` (spec §3.2); the
//! sampling step is one iteration of `Sampler::sample` (spec §3.3) at t = T/2.
//!
//! The CUDA path (`meddpm profile --device cuda`, `meddpm_cuda::profile_steps`) runs the same
//! steps under CUPTI and uses [`host_data`], [`median`], [`SampleStep`] and [`preset_config`] from
//! here.

use super::kernels::KernelRecord;
use super::report::Pass;
use super::timed::Timed;
use crate::backend::{Backend, DdpmCoefs};
use crate::diffusion::{TrainConfig, Trainer};
use crate::error::Result;
use crate::model::{UNet, UNetConfig};
use crate::rng::Philox;
use crate::shape::Dims;
use std::time::Instant;

/// What to profile.
#[derive(Clone, Debug)]
pub struct Options {
    pub seed: u64,
    /// Unrecorded repetitions before the recorded ones (cuDNN algorithm choice, caches).
    pub warmup: usize,
    /// Recorded repetitions (≥ 1): the pass keeps the records of the median step time, and all
    /// step times (a shared machine's timings scatter).
    pub repeats: usize,
    pub train: bool,
    pub sample: bool,
    /// `true` when the backend computes (times are measurements); `false` for the null backend.
    pub measured: bool,
    /// Suffix for pass names ("" or " (whole-head, counted)").
    pub label: String,
}

impl Default for Options {
    fn default() -> Self {
        Options { seed: 0, warmup: 1, repeats: 3, train: true, sample: true, measured: true, label: String::new() }
    }
}

/// Deterministic stand-in data of the model's shapes: an image in [−1, 1] and ±1 masks.
pub fn host_data(cfg: &UNetConfig) -> (Vec<f32>, Vec<f32>) {
    let s = cfg.depth * cfg.size * cfg.size;
    let img: Vec<f32> = (0..cfg.out_channels * s).map(|i| ((i % 97) as f32 / 48.0 - 1.0).clamp(-1.0, 1.0)).collect();
    let cond: Vec<f32> = (0..cfg.cond_channels() * s).map(|i| if (i / 7) % 3 == 0 { 1.0 } else { -1.0 }).collect();
    (img, cond)
}

/// `preset NAME (D×H×W, C base channels, channel_mult [..]), batch 1`: the report's configuration line.
pub fn preset_config(name: &str, cfg: &UNetConfig) -> String {
    format!(
        "preset {} ({}×{}×{}, {} base channels, channel_mult {:?}), batch 1",
        name, cfg.depth, cfg.size, cfg.size, cfg.model_channels, cfg.channel_mult
    )
}

/// The profiled sampling step: one ancestral DDPM step at t = T/2 (spec §3.3) on the network of
/// a trainer, from noise drawn with `seed`'s sampling stream and the given condition; its buffers
/// allocated here, once, so that repeated [`SampleStep::run`]s allocate nothing.
pub struct SampleStep<B: Backend> {
    x: B::Buf,
    z: B::Buf,
    cond: B::Buf,
    img: Dims,
    cd: Dims,
    ts: Vec<f32>,
    coefs: Vec<DdpmCoefs>,
    rng: Philox,
}

impl<B: Backend> SampleStep<B> {
    pub fn new(be: &B, tr: &Trainer<B>, cond: &[f32], seed: u64) -> Result<Self> {
        let (img, cd) = (tr.net.output_dims(), tr.net.input_dims().with_c(tr.net.cfg.cond_channels()));
        let (mut x, z, mut c) = (be.alloc(img.numel())?, be.alloc(img.numel())?, be.alloc(cd.numel())?);
        let rng = Philox::new(seed, crate::diffusion::train::STREAM_SAMPLE);
        be.upload_act(cond, cd, &mut c);
        be.randn(&mut x, rng, 0, img);
        let t = tr.sched.timesteps / 2;
        let (ts, coefs) = (vec![t as f32; img.n], vec![tr.sched.ddpm_coefs(t); img.n]);
        Ok(SampleStep { x, z, cond: c, img, cd, ts, coefs, rng })
    }

    /// x ← one ancestral step of x through `net` (forward, draw z, update).
    pub fn run(&mut self, be: &B, net: &mut UNet<B>) {
        let (img, cd) = (self.img, self.cd);
        be.concat_channels(net.input_mut(), &self.x, &self.cond, img, img.c, cd.c);
        net.forward(be, &self.ts);
        be.randn(&mut self.z, self.rng, img.numel() as u64, img);
        be.ddpm_step(&mut self.x, net.output(), &self.z, &self.coefs, img);
    }
}

/// The median of wall times, the upper one of an even count (`None` when empty).
pub fn median(mut v: Vec<u64>) -> Option<u64> {
    v.sort_unstable();
    v.get(v.len() / 2).copied()
}

/// The pass of the median step time among recorded repetitions.
fn median_pass(name: String, mut runs: Vec<(u64, Vec<KernelRecord>)>, measured: bool) -> Pass {
    let repeats: Vec<u64> = runs.iter().map(|r| r.0).collect();
    runs.sort_by_key(|r| r.0);
    let (ns, records) = runs.swap_remove(runs.len() / 2);
    Pass {
        name,
        records,
        step_ns: measured.then_some(ns),
        measured,
        repeats: if measured { repeats } else { Vec::new() },
        plain_step_ns: None,
        power: None,
    }
}

/// Run and record the passes (see the module docs).
pub fn profile_unet<B: Backend>(be: &Timed<B>, cfg: &UNetConfig, o: &Options) -> Result<Vec<Pass>> {
    let tc = TrainConfig { batch: 1, grad_accum: 1, seed: o.seed, ..TrainConfig::default() };
    let mut tr = Trainer::new(be, cfg, &tc)?;
    let (img, cond) = host_data(cfg);
    let mut passes = Vec::new();
    if o.train {
        for _ in 0..o.warmup {
            tr.micro_step(be, &img, &cond);
            tr.opt_step(be);
        }
        let mut runs = Vec::new();
        tr.stage(be, &img, &cond)?;
        for _ in 0..o.repeats.max(1) {
            be.sync();
            be.take_records();
            be.push_range("train");
            let t0 = Instant::now();
            // as in training: the batch was staged before, the next one goes up meanwhile
            tr.micro_step_ahead_copy(be, &img, &cond)?;
            be.push_range("optimizer");
            tr.opt_step(be);
            be.pop_range();
            be.sync();
            let ns = t0.elapsed().as_nanos() as u64;
            be.pop_range();
            runs.push((ns, be.take_records()));
        }
        passes.push(median_pass(format!("train step{}", o.label), runs, o.measured));
    }
    if o.sample {
        let mut step = SampleStep::new(be, &tr, &cond, o.seed)?;
        let net = &mut tr.net;
        for _ in 0..o.warmup {
            step.run(be, net);
        }
        let mut runs = Vec::new();
        for _ in 0..o.repeats.max(1) {
            be.sync();
            be.take_records();
            be.push_range("sample");
            let t0 = Instant::now();
            step.run(be, net);
            be.sync();
            let ns = t0.elapsed().as_nanos() as u64;
            be.pop_range();
            runs.push((ns, be.take_records()));
        }
        passes.push(median_pass(format!("sampling step{}", o.label), runs, o.measured));
    }
    Ok(passes)
}
