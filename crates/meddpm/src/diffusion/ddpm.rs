//! Ancestral DDPM sampling (spec §3.3): T network evaluations from pure noise, x̂₀ clamped to
//! [−1, 1], "fixed small" posterior variance, no noise at t = 0 (so the result is in [−1, 1]).
//!
//! Noise comes from the Philox stream `STREAM_SAMPLE` of `seed`: the initial x_T uses offsets
//! [0, numel), the z of step t uses [(T − t)·numel, (T − t + 1)·numel). The same seed therefore
//! gives the same volume on every backend, precision and layout — which is what lets
//! `meddpm eval --configs` compare them.

use super::schedule::Schedule;
use super::train::STREAM_SAMPLE;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::model::UNet;
use crate::rng::Philox;

/// Buffers of one sampling run (planned once per call, not per step).
pub struct Sampler<B: Backend> {
    x: B::Buf,
    z: B::Buf,
    cond: B::Buf,
}

impl<B: Backend> Sampler<B> {
    pub fn new(be: &B, net: &UNet<B>) -> Result<Self> {
        let img = net.output_dims();
        let cd = net.input_dims().with_c(net.cfg.cond_channels());
        Ok(Sampler { x: be.alloc(img.numel())?, z: be.alloc(img.numel())?, cond: be.alloc(cd.numel())? })
    }

    /// Sample one batch for `cond` (host NCDHW (N, cond_ch, D, H, W)); returns host NCDHW
    /// (N, out_ch, D, H, W). `on_step(i)` is called after each of the T steps.
    pub fn sample(
        &mut self,
        be: &B,
        net: &mut UNet<B>,
        sched: &Schedule,
        cond: &[f32],
        seed: u64,
        mut on_step: impl FnMut(usize),
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
        let rng = Philox::new(seed, STREAM_SAMPLE);
        let numel = img.numel() as u64;
        let big_t = sched.timesteps;
        be.upload_act(cond, cd, &mut self.cond);
        be.randn(&mut self.x, rng, 0, img);
        for (i, t) in (0..big_t).rev().enumerate() {
            be.concat_channels(net.input_mut(), &self.x, &self.cond, img, img.c, cd.c);
            net.forward(be, &vec![t as f32; img.n]);
            be.randn(&mut self.z, rng, (big_t - t) as u64 * numel, img);
            be.ddpm_step(&mut self.x, net.output(), &self.z, &vec![sched.ddpm_coefs(t); img.n], img);
            on_step(i);
        }
        let mut out = vec![0f32; img.numel()];
        be.download_act(&self.x, img, &mut out);
        Ok(out)
    }
}
