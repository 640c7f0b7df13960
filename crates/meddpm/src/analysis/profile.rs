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
//! The CUDA path (`meddpm profile --device cuda`, in the CLI) runs the same steps under CUPTI and
//! uses [`host_data`], [`median`] and [`preset_config`] from here.

use super::kernels::KernelRecord;
use super::report::Pass;
use super::timed::Timed;
use crate::backend::Backend;
use crate::diffusion::{TrainConfig, Trainer};
use crate::error::Result;
use crate::model::UNetConfig;
use crate::rng::Philox;
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
            tr.micro_step_ahead_fill(be, &mut |i, c| {
                i.clone_from(&img);
                c.clone_from(&cond);
                Ok(())
            })?;
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
        let net = &mut tr.net;
        let img_d = net.output_dims();
        let cd = net.input_dims().with_c(cfg.cond_channels());
        let mut x = be.alloc(img_d.numel())?;
        let mut z = be.alloc(img_d.numel())?;
        let mut c = be.alloc(cd.numel())?;
        let rng = Philox::new(o.seed, crate::diffusion::train::STREAM_SAMPLE);
        be.upload_act(&cond, cd, &mut c);
        be.randn(&mut x, rng, 0, img_d);
        let t = tr.sched.timesteps / 2;
        let coefs = vec![tr.sched.ddpm_coefs(t); img_d.n];
        let step = |be: &Timed<B>, x: &mut B::Buf, z: &mut B::Buf, net: &mut crate::model::UNet<Timed<B>>| {
            be.concat_channels(net.input_mut(), x, &c, img_d, img_d.c, cd.c);
            net.forward(be, &vec![t as f32; img_d.n]);
            be.randn(z, rng, img_d.numel() as u64, img_d);
            be.ddpm_step(x, net.output(), z, &coefs, img_d);
        };
        for _ in 0..o.warmup {
            step(be, &mut x, &mut z, net);
        }
        let mut runs = Vec::new();
        for _ in 0..o.repeats.max(1) {
            be.sync();
            be.take_records();
            be.push_range("sample");
            let t0 = Instant::now();
            step(be, &mut x, &mut z, net);
            be.sync();
            let ns = t0.elapsed().as_nanos() as u64;
            be.pop_range();
            runs.push((ns, be.take_records()));
        }
        passes.push(median_pass(format!("sampling step{}", o.label), runs, o.measured));
    }
    Ok(passes)
}
