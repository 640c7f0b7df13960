//! The Med-DDPM training step (spec §3.2, §4): draw t and ε, q_sample, ε̂ = UNet(cat(x_t, cond), t),
//! L1 loss, backward, gradient accumulation, Adam, and the reference EMA schedule.
//!
//! Randomness comes from Philox streams indexed by the global sample position (`samples`: samples
//! drawn so far by all ranks together), so a run that is saved and resumed continues with exactly
//! the draws it would have made.
//!
//! Data parallelism (`dist`): rank r of W, batch b per rank, takes the global samples
//! `samples + r·b .. samples + (r+1)·b` of each micro-step (then `samples += W·b`). Sample s gets
//! timestep draw s of `STREAM_T` and the noise at offsets s·V.. of `STREAM_NOISE` (V = elements per
//! sample) whatever W is, so W ranks × batch b draw exactly what one rank × batch W·b draws; the loss
//! is divided by the global batch W·b and the gradients averaged over ranks, which makes the
//! averaged gradient equal the single-process one (up to summation order).
//!
//! Overlapped input: the batch buffers are doubled. [`Trainer::train_step`] takes the next batch
//! from `next` and stages it (`Backend::stage_act`, a side-stream copy on the GPU) while the GPU
//! runs the current micro-step, so a step never waits for its own upload. A staged batch counts
//! nowhere (`samples`, `draws`) until its micro-step runs, so a checkpoint never skips it: the
//! loader of a resumed run starts at `samples` and fetches it again.
//! Reference quirks kept on purpose: the loss is divided by `grad_accum` *and* by the batch size
//! before backward; the EMA copies the online weights every `ema_every` steps until `ema_start`,
//! then averages with `ema_decay` every `ema_every` steps; Adam has no weight decay.

use super::schedule::Schedule;
use crate::backend::{AdamStep, Backend, LossKind};
use crate::dist::GradSync;
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
    /// The training settings a model preset starts from: the reference's, except that the demo
    /// and tiny presets take lr 2e-4 (the reference lr 1e-5 needs ~10⁵ steps; the demo must show
    /// learning in ~10²).
    pub fn for_preset(preset: &str) -> Self {
        match preset {
            "demo" | "tiny" => TrainConfig { lr: 2e-4, ..TrainConfig::default() },
            _ => TrainConfig::default(),
        }
    }

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

/// A hook told as each layer's backward is queued: (layer index, all parameter gradients).
pub type LayerDone<'a, B> = dyn FnMut(usize, &mut [<B as Backend>::Buf]) + 'a;

/// Where the trainer gets its next batch: host NCDHW (image, cond), or the loader's error.
pub type NextBatch<'a> = dyn FnMut() -> Result<(Vec<f32>, Vec<f32>)> + 'a;

/// A batch source that writes the next batch (host NCDHW image, cond) into the trainer's own
/// host buffers, kept from batch to batch: one that overwrites them in place (`clone_from`,
/// `copy_from_slice`) allocates nothing per micro-step. `bench` and `profile` use it: a fresh
/// 85 MB `Vec` per BraTS volume is paged in on first touch, which took the host longer than
/// the GPU's bf16 step at times (8–27 ms of GPU idle a step on the H200).
pub type FillBatch<'a> = dyn FnMut(&mut Vec<f32>, &mut Vec<f32>) -> Result<()> + 'a;

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
    /// Micro-steps done by this rank.
    pub draws: u64,
    /// Global samples drawn by all ranks together (the RNG and data position); with one rank,
    /// `draws · batch`.
    pub samples: u64,
    /// This process's rank and the number of data-parallel ranks (0 and 1 for a plain run).
    pub rank: usize,
    pub world: usize,
    /// The batch of the micro-step being run, and the next one (staged while it runs).
    x0: B::Buf,
    cond: B::Buf,
    next_x0: B::Buf,
    next_cond: B::Buf,
    staged: bool,
    /// The host (image, cond) a [`FillBatch`] writes the next batch into.
    host: (Vec<f32>, Vec<f32>),
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
            next_x0: be.alloc(img.numel())?,
            next_cond: be.alloc(cond.numel())?,
            staged: false,
            host: (Vec::new(), Vec::new()),
            eps: be.alloc(img.numel())?,
            xt: be.alloc(img.numel())?,
            loss: be.alloc(1)?,
            sched: Schedule::cosine(tc.timesteps),
            tc: tc.clone(),
            step: 0,
            draws: 0,
            samples: 0,
            rank: 0,
            world: 1,
            net,
            ema,
            adam_m,
            adam_v,
        })
    }

    /// Make this trainer rank `rank` of `world` data-parallel ranks (see the module docs).
    pub fn set_rank(&mut self, rank: usize, world: usize) -> Result<()> {
        if world == 0 || rank >= world {
            return Err(Error::Config(format!("rank {rank} of {world}: need 0 <= rank < world")));
        }
        self.rank = rank;
        self.world = world;
        Ok(())
    }

    /// Bytes of everything the trainer planned: the U-Net's buffers ([`crate::model::MemPlan`]),
    /// the EMA weights and Adam moments, and the batch buffers (x0 and cond twice, ε, x_t, loss;
    /// f32).
    pub fn plan_bytes(&self) -> usize {
        let p = self.net.param_count() * 4;
        let img = self.net.output_dims().numel();
        let cond = self.net.input_dims().with_c(self.net.cfg.cond_channels()).numel();
        self.net.mem.total() + 3 * p + 4 * (4 * img + 2 * cond + 1)
    }

    /// The timesteps of the batch whose first element is global sample `first`.
    pub fn timesteps_at(&self, first: u64) -> Vec<usize> {
        let r = Philox::new(self.tc.seed, STREAM_T);
        (0..self.tc.batch as u64).map(|i| r.below(first + i, self.tc.timesteps as u32) as usize).collect()
    }

    /// The global sample index of this rank's first batch element in the next micro-step.
    pub fn first_sample(&self) -> u64 {
        self.samples + (self.rank * self.tc.batch) as u64
    }

    /// Whether a batch is staged for the next micro-step ([`Trainer::stage`]).
    pub fn is_staged(&self) -> bool {
        self.staged
    }

    /// Upload the next micro-step's batch (host NCDHW: image (N, out_ch, D, H, W), cond
    /// (N, cond_ch, D, H, W)) beside the work already queued; replaces a batch staged before.
    pub fn stage(&mut self, be: &B, image: &[f32], cond: &[f32]) -> Result<()> {
        let img = self.net.output_dims();
        let cd = self.net.input_dims().with_c(self.net.cfg.cond_channels());
        for (what, got, d) in [("image", image.len(), img), ("cond", cond.len(), cd)] {
            if got != d.numel() {
                return Err(Error::Config(format!(
                    "training batch {what}: {got} values, the model takes {} ({d}, NCDHW)",
                    d.numel()
                )));
            }
        }
        // The contract of stage_act: the host has waited for the device since the last
        // micro-step that read these buffers (each micro-step ends downloading its loss).
        be.stage_act(image, img, &mut self.next_x0);
        be.stage_act(cond, cd, &mut self.next_cond);
        self.staged = true;
        Ok(())
    }

    /// One forward/backward on a batch (host NCDHW, see [`Trainer::stage`]); gradients
    /// accumulate. Returns the unscaled mean loss.
    pub fn micro_step(&mut self, be: &B, image: &[f32], cond: &[f32]) -> f32 {
        self.stage(be, image, cond).unwrap_or_else(|e| panic!("micro_step: {e}"));
        self.run_staged(be, None, None).expect("no prefetch, no error")
    }

    /// One micro-step as training runs it, one batch ahead: the batch staged before (or, on a
    /// first call, the one `next` gives now), while the following one from `next` is staged as
    /// this one runs ([`Trainer::run_staged`]).
    pub fn micro_step_ahead(&mut self, be: &B, next: &mut NextBatch<'_>) -> Result<f32> {
        self.run_ahead(be, None, next)
    }

    /// [`Trainer::micro_step_ahead`] from a [`FillBatch`] source (no host allocation per step).
    pub fn micro_step_ahead_fill(&mut self, be: &B, fill: &mut FillBatch<'_>) -> Result<f32> {
        self.run_ahead_fill(be, None, fill)
    }

    /// [`Trainer::micro_step_ahead_fill`] on the same host batch every step, copied into the kept
    /// buffers as a loader would write a fresh one (`bench`, `profile`).
    pub fn micro_step_ahead_copy(&mut self, be: &B, image: &[f32], cond: &[f32]) -> Result<f32> {
        self.micro_step_ahead_fill(be, &mut |i, c| {
            i.clear();
            i.extend_from_slice(image);
            c.clear();
            c.extend_from_slice(cond);
            Ok(())
        })
    }

    /// [`Trainer::micro_step_ahead`] with the backward hook of [`Trainer::run_staged`].
    fn run_ahead(&mut self, be: &B, done: Option<&mut LayerDone<'_, B>>, next: &mut NextBatch<'_>) -> Result<f32> {
        // the source's vectors move into the host buffers (no copy)
        self.run_ahead_fill(be, done, &mut |i, c| next().map(|(a, b)| (*i, *c) = (a, b)))
    }

    /// Stage a first batch if none is, then the micro-step with the next one fetched meanwhile.
    fn run_ahead_fill(&mut self, be: &B, done: Option<&mut LayerDone<'_, B>>, fill: &mut FillBatch<'_>) -> Result<f32> {
        if !self.staged {
            self.stage_next(be, fill)?;
        }
        self.run_staged(be, done, Some(fill))
    }

    /// The next batch from `fill`, through the host buffers, staged.
    fn stage_next(&mut self, be: &B, fill: &mut FillBatch<'_>) -> Result<()> {
        let (mut img, mut cond) = std::mem::take(&mut self.host);
        let staged = fill(&mut img, &mut cond).and_then(|()| self.stage(be, &img, &cond));
        self.host = (img, cond);
        staged
    }

    /// The micro-step on the staged batch. While the GPU runs it, `prefetch` (when given) supplies
    /// the next batch, which is staged. With `done`, it is called as each layer's backward is
    /// queued ([`UNet::backward_with`], launched from the host); without it the backward may be
    /// a replayed graph ([`UNet::backward`]).
    pub fn run_staged(
        &mut self,
        be: &B,
        done: Option<&mut LayerDone<'_, B>>,
        prefetch: Option<&mut FillBatch<'_>>,
    ) -> Result<f32> {
        assert!(self.staged, "run_staged: no batch staged (Trainer::stage)");
        std::mem::swap(&mut self.x0, &mut self.next_x0);
        std::mem::swap(&mut self.cond, &mut self.next_cond);
        self.staged = false;
        let img = self.net.output_dims();
        let first = self.first_sample();
        let ts = self.timesteps_at(first);
        let (a, b): (Vec<f32>, Vec<f32>) = ts.iter().map(|&t| self.sched.q_coefs(t)).unzip();
        let per_sample = (img.numel() / img.n) as u64;
        // ε drawn, x_t = q_sample(x0, ε), the input cat([x_t, cond]): one call
        let (cc, rng) = (self.net.cfg.cond_channels(), Philox::new(self.tc.seed, STREAM_NOISE));
        let bufs = (&mut self.eps, &mut self.xt);
        be.q_sample_input(
            self.net.input_mut(),
            bufs,
            (&self.x0, &self.cond),
            rng,
            first * per_sample,
            (&a, &b),
            img,
            cc,
        );
        let tf: Vec<f32> = ts.iter().map(|&t| t as f32).collect();
        self.net.forward(be, &tf);
        let (out, dout) = self.net.output_and_grad();
        be.loss_forward(&mut self.loss, out, &self.eps, self.tc.loss);
        // the reference divides by the batch: the global one when ranks average their gradients
        let scale = 1.0 / (self.tc.grad_accum * self.tc.batch * self.world) as f32;
        be.loss_backward(dout, out, &self.eps, self.tc.loss, scale);
        match done {
            Some(done) => self.net.backward_with(be, done),
            None => self.net.backward(be),
        }
        self.draws += 1;
        self.samples += (self.world * self.tc.batch) as u64;
        // the next batch goes up while the GPU works through this one
        let fetched = prefetch.map(|fill| self.stage_next(be, fill));
        let mut l = [0f32];
        be.download(&self.loss, &mut l);
        fetched.transpose()?;
        Ok(l[0])
    }

    /// Adam on every parameter, zero the gradients, then the reference EMA rule; step += 1.
    pub fn opt_step(&mut self, be: &B) {
        self.adam_on(be, 0..self.net.params.len());
        self.opt_step_end(be);
    }

    /// Adam on the parameters `r` (gradients zeroed as they are used; one launch on the GPU).
    /// Adam is elementwise, so running it on parts of the parameters in any order gives the
    /// same bits as one call on all of them.
    fn adam_on(&mut self, be: &B, r: std::ops::Range<usize>) {
        if r.is_empty() {
            return;
        }
        let h = AdamStep {
            lr: self.tc.lr,
            beta1: self.tc.beta1,
            beta2: self.tc.beta2,
            eps: self.tc.adam_eps,
            t: self.step + 1,
        };
        let net = &mut self.net;
        let (p, g) = (&mut net.params[r.clone()], &mut net.grads[r.clone()]);
        be.adam_step_all(p, g, &mut self.adam_m[r.clone()], &mut self.adam_v[r], h, true);
    }

    /// After Adam on every parameter: the weight copies, the EMA, the step count.
    fn opt_step_end(&mut self, be: &B) {
        let net = &mut self.net;
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
            // always one batch ahead, across optimizer steps too
            sum += self.run_ahead(be, None, &mut next)?;
        }
        self.opt_step(be);
        Ok(sum / self.tc.grad_accum as f32)
    }

    /// [`Trainer::train_step`] for data-parallel ranks: on the last micro-step the gradient
    /// buckets are handed to `sync` as backward finishes their layers, and `sync.finish` makes
    /// them the average over ranks before Adam. Returns this rank's mean micro-step loss.
    pub fn train_step_synced<F>(&mut self, be: &B, mut next: F, sync: &mut dyn GradSync<B>) -> Result<f32>
    where
        F: FnMut() -> Result<(Vec<f32>, Vec<f32>)>,
    {
        if sync.world() != self.world || sync.rank() != self.rank {
            return Err(Error::Config(format!(
                "trainer is rank {} of {}, the gradient sync rank {} of {}",
                self.rank,
                self.world,
                sync.rank(),
                sync.world()
            )));
        }
        let mut sum = 0.0;
        for k in 0..self.tc.grad_accum {
            sum += if k + 1 == self.tc.grad_accum {
                let mut hook = |layer, grads: &mut [B::Buf]| sync.layer_done(be, layer, grads);
                self.run_ahead(be, Some(&mut hook), &mut next)?
            } else {
                self.run_ahead(be, None, &mut next)?
            };
        }
        // every bucket but the last averaged, Adam on those while the last one is (the collective
        // runs beside the optimizer), then the last bucket's Adam
        match sync.finish_early(be, &mut self.net.grads)? {
            Some(held) if held.end <= self.net.params.len() => {
                let n = self.net.params.len();
                self.adam_on(be, 0..held.start);
                self.adam_on(be, held.end..n);
                sync.finish(be, &mut self.net.grads)?;
                self.adam_on(be, held);
                self.opt_step_end(be);
            }
            Some(held) => {
                return Err(Error::Dist(format!(
                    "the gradient sync held back parameters {held:?}; the network has {}",
                    self.net.params.len()
                )))
            }
            None => self.opt_step(be),
        }
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
