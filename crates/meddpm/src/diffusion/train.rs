//! The Med-DDPM training step (spec §3.2, §4): draw t and ε, q_sample, ε̂ = UNet(cat(x_t, cond), t),
//! L1 loss, backward, gradient accumulation, Adam, and the reference EMA schedule.
//!
//! Randomness comes from Philox streams indexed by the number of micro-steps done (`draws`), so a
//! run that is saved and resumed continues with exactly the draws it would have made.
//! Reference quirks kept on purpose: the loss is divided by `grad_accum` *and* by the batch size
//! before backward; the EMA copies the online weights every `ema_every` steps until `ema_start`,
//! then averages with `ema_decay` every `ema_every` steps; Adam has no weight decay.

use super::schedule::Schedule;
use crate::backend::{AdamStep, Backend, LossKind};
use crate::error::{Error, Result};
use crate::model::{UNet, UNetConfig};
use crate::rng::Philox;
use serde::{Deserialize, Serialize};

/// Philox stream ids (the seed is the key): timestep draws, training noise, sampling noise.
pub const STREAM_T: u64 = 1;
pub const STREAM_NOISE: u64 = 2;
pub const STREAM_SAMPLE: u64 = 3;

/// Training hyper-parameters; defaults are the reference's (`train.py`, `Trainer`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    pub timesteps: usize,
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub adam_eps: f32,
    pub batch: usize,
    pub grad_accum: usize,
    pub ema_decay: f32,
    pub ema_every: u64,
    pub ema_start: u64,
    pub loss: LossKind,
    pub seed: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            timesteps: 250,
            lr: 1e-5,
            beta1: 0.9,
            beta2: 0.999,
            adam_eps: 1e-8,
            batch: 1,
            grad_accum: 2,
            ema_decay: 0.995,
            ema_every: 10,
            ema_start: 2000,
            loss: LossKind::L1,
            seed: 0,
        }
    }
}

impl TrainConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::Config(m.to_string()));
        if self.timesteps < 2 {
            return bad("timesteps must be >= 2");
        }
        if self.batch == 0 || self.grad_accum == 0 || self.ema_every == 0 {
            return bad("batch, grad_accum and ema_every must be > 0");
        }
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad("lr must be a positive number");
        }
        if !(0.0..1.0).contains(&self.ema_decay)
            || !(0.0..1.0).contains(&self.beta1)
            || !(0.0..1.0).contains(&self.beta2)
        {
            return bad("ema_decay, beta1 and beta2 must be in [0, 1)");
        }
        Ok(())
    }
}

/// Model + optimiser state + EMA + the buffers of one micro-step, all planned at construction.
pub struct Trainer<B: Backend> {
    pub net: UNet<B>,
    pub tc: TrainConfig,
    pub sched: Schedule,
    pub ema: Vec<B::Buf>,
    pub adam_m: Vec<B::Buf>,
    pub adam_v: Vec<B::Buf>,
    /// Optimizer steps done.
    pub step: u64,
    /// Micro-steps done (the RNG position).
    pub draws: u64,
    x0: B::Buf,
    cond: B::Buf,
    eps: B::Buf,
    xt: B::Buf,
    loss: B::Buf,
}

impl<B: Backend> Trainer<B> {
    /// A fresh trainer: parameters initialised from `tc.seed`, EMA = parameters, Adam moments 0.
    pub fn new(be: &B, cfg: &UNetConfig, tc: &TrainConfig) -> Result<Self> {
        tc.validate()?;
        let mut net = UNet::new(be, cfg, tc.batch)?;
        net.init_params(be, tc.seed);
        let zeros = |net: &UNet<B>| net.specs.iter().map(|s| be.alloc(s.numel())).collect::<Result<Vec<_>>>();
        let (adam_m, adam_v, mut ema) = (zeros(&net)?, zeros(&net)?, zeros(&net)?);
        for (e, p) in ema.iter_mut().zip(&net.params) {
            be.copy(e, p);
        }
        let img = net.output_dims();
        let cond = net.input_dims().with_c(cfg.cond_channels());
        Ok(Trainer {
            x0: be.alloc(img.numel())?,
            cond: be.alloc(cond.numel())?,
            eps: be.alloc(img.numel())?,
            xt: be.alloc(img.numel())?,
            loss: be.alloc(1)?,
            sched: Schedule::cosine(tc.timesteps),
            tc: tc.clone(),
            step: 0,
            draws: 0,
            net,
            ema,
            adam_m,
            adam_v,
        })
    }

    /// Bytes of everything the trainer planned: the U-Net's buffers ([`crate::model::MemPlan`]),
    /// the EMA weights and Adam moments, and the batch buffers (x0, cond, ε, x_t, loss; f32).
    pub fn plan_bytes(&self) -> usize {
        let p = self.net.param_count() * 4;
        let img = self.net.output_dims().numel();
        let cond = self.net.input_dims().with_c(self.net.cfg.cond_channels()).numel();
        self.net.mem.total() + 3 * p + 4 * (3 * img + cond + 1)
    }

    /// The timesteps micro-step `draw` uses, one per batch element.
    pub fn timesteps_for(&self, draw: u64) -> Vec<usize> {
        let r = Philox::new(self.tc.seed, STREAM_T);
        let n = self.tc.batch as u64;
        (0..n).map(|i| r.below(draw * n + i, self.tc.timesteps as u32) as usize).collect()
    }

    /// One forward/backward on a batch (host NCDHW: image (N, out_ch, D, H, W), cond
    /// (N, cond_ch, D, H, W)); gradients accumulate. Returns the unscaled mean loss.
    pub fn micro_step(&mut self, be: &B, image: &[f32], cond: &[f32]) -> f32 {
        let img = self.net.output_dims();
        let cd = self.net.input_dims().with_c(self.net.cfg.cond_channels());
        let ts = self.timesteps_for(self.draws);
        let (a, b): (Vec<f32>, Vec<f32>) = ts.iter().map(|&t| self.sched.q_coefs(t)).unzip();
        be.upload_act(image, img, &mut self.x0);
        be.upload_act(cond, cd, &mut self.cond);
        be.randn(&mut self.eps, Philox::new(self.tc.seed, STREAM_NOISE), self.draws * img.numel() as u64, img);
        be.q_sample(&mut self.xt, &self.x0, &self.eps, &a, &b, img);
        be.concat_channels(self.net.input_mut(), &self.xt, &self.cond, img, img.c, cd.c);
        let tf: Vec<f32> = ts.iter().map(|&t| t as f32).collect();
        self.net.forward(be, &tf);
        let (out, dout) = self.net.output_and_grad();
        be.loss_forward(&mut self.loss, out, &self.eps, self.tc.loss);
        let scale = 1.0 / (self.tc.grad_accum * self.tc.batch) as f32;
        be.loss_backward(dout, out, &self.eps, self.tc.loss, scale);
        self.net.backward(be);
        self.draws += 1;
        let mut l = [0f32];
        be.download(&self.loss, &mut l);
        l[0]
    }

    /// Adam on every parameter, zero the gradients, then the reference EMA rule; step += 1.
    pub fn opt_step(&mut self, be: &B) {
        let h = AdamStep {
            lr: self.tc.lr,
            beta1: self.tc.beta1,
            beta2: self.tc.beta2,
            eps: self.tc.adam_eps,
            t: self.step + 1,
        };
        let net = &mut self.net;
        // Adam on every tensor, gradients zeroed as they are used (one launch on the GPU)
        be.adam_step_all(&mut net.params, &mut net.grads, &mut self.adam_m, &mut self.adam_v, h, true);
        net.params_changed();
        if self.step.is_multiple_of(self.tc.ema_every) {
            // before ema_start the EMA copies the weights (decay 0 is an exact copy)
            let decay = if self.step < self.tc.ema_start { 0.0 } else { self.tc.ema_decay };
            be.ema_update_all(&mut self.ema, &net.params, decay);
        }
        self.step += 1;
    }

    /// `grad_accum` micro-steps then one optimizer step; `next` supplies (image, cond) batches.
    /// Returns the mean of the micro-step losses (what the reference logs).
    pub fn train_step<F>(&mut self, be: &B, mut next: F) -> Result<f32>
    where
        F: FnMut() -> Result<(Vec<f32>, Vec<f32>)>,
    {
        let mut sum = 0.0;
        for _ in 0..self.tc.grad_accum {
            let (img, cond) = next()?;
            sum += self.micro_step(be, &img, &cond);
        }
        self.opt_step(be);
        Ok(sum / self.tc.grad_accum as f32)
    }

    /// Run `f` with the EMA weights swapped into the network (how the reference samples).
    pub fn with_ema<R>(&mut self, f: impl FnOnce(&mut UNet<B>) -> R) -> R {
        std::mem::swap(&mut self.net.params, &mut self.ema);
        self.net.params_swapped();
        let r = f(&mut self.net);
        std::mem::swap(&mut self.net.params, &mut self.ema);
        self.net.params_swapped();
        r
    }
}
