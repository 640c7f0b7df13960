//! The cosine noise schedule (Nichol & Dhariwal 2021) with every buffer the reference
//! `GaussianDiffusion` registers (spec §3.1), computed in f64.
//!
//! f(u) = cos²(((u + s)/(1 + s))·π/2), s = 0.008, at u = i/T for i = 0..T; ᾱ_i = f(i/T)/f(0);
//! β_t = min(1 − ᾱ_{t+1}/ᾱ_t, 0.999). The arrays below are indexed by t = 0..T−1.

use crate::error::{Error, Result};

/// All 13 schedule buffers of the reference state dict, in its order and with its names.
pub const BUFFER_NAMES: [&str; 13] = [
    "betas",
    "alphas_cumprod",
    "alphas_cumprod_prev",
    "sqrt_alphas_cumprod",
    "sqrt_one_minus_alphas_cumprod",
    "log_one_minus_alphas_cumprod",
    "sqrt_recip_alphas_cumprod",
    "sqrt_recipm1_alphas_cumprod",
    "posterior_variance",
    "posterior_log_variance_clipped",
    "posterior_mean_coef1",
    "posterior_mean_coef2",
    "posterior_mean_coef3",
];

#[derive(Clone, Debug)]
pub struct Schedule {
    pub timesteps: usize,
    pub betas: Vec<f64>,
    pub alphas_cumprod: Vec<f64>,
    pub alphas_cumprod_prev: Vec<f64>,
    pub posterior_variance: Vec<f64>,
    pub posterior_log_variance_clipped: Vec<f64>,
    pub posterior_mean_coef1: Vec<f64>,
    pub posterior_mean_coef2: Vec<f64>,
}

impl Schedule {
    /// The cosine schedule with `timesteps` steps (Med-DDPM: 250); an error for 0 steps.
    pub fn try_cosine(timesteps: usize) -> Result<Self> {
        if timesteps == 0 {
            return Err(Error::Config("the schedule needs at least 1 timestep (T = 0 given)".into()));
        }
        Ok(Self::cosine(timesteps))
    }

    /// The T to sample a model with: `given` (the user's, if any) must be the T the weights record
    /// (`model`, where the file records one), since sampling needs the model's own schedule; fewer
    /// network evaluations are the sampler's `--steps`. Neither given: 250, the reference's T.
    pub fn model_timesteps(given: Option<usize>, model: Option<usize>) -> Result<usize> {
        match (given, model) {
            (Some(t), Some(model)) if t != model => Err(Error::Config(format!(
                "--timesteps {t}: the model was trained with T = {model}; sampling needs the model's own schedule \
                 (for fewer network evaluations, give --steps)"
            ))),
            (t, model) => Ok(t.or(model).unwrap_or(250)),
        }
    }

    /// The cosine schedule with `timesteps` ≥ 1 steps (Med-DDPM: 250); [`Schedule::try_cosine`]
    /// for a T that comes from the user.
    pub fn cosine(timesteps: usize) -> Self {
        assert!(timesteps >= 1, "the cosine schedule needs T ≥ 1");
        let s = 0.008f64;
        let t = timesteps as f64;
        let f = |u: f64| (((u + s) / (1.0 + s)) * std::f64::consts::FRAC_PI_2).cos().powi(2);
        let ac_full: Vec<f64> = (0..=timesteps).map(|i| f(i as f64 / t) / f(0.0)).collect();
        let betas: Vec<f64> = (0..timesteps).map(|i| (1.0 - ac_full[i + 1] / ac_full[i]).clamp(0.0, 0.999)).collect();
        let mut alphas_cumprod = Vec::with_capacity(timesteps);
        let mut acc = 1.0f64;
        for b in &betas {
            acc *= 1.0 - b;
            alphas_cumprod.push(acc);
        }
        let alphas_cumprod_prev: Vec<f64> =
            std::iter::once(1.0).chain(alphas_cumprod[..timesteps - 1].iter().copied()).collect();
        let pv: Vec<f64> =
            (0..timesteps).map(|i| betas[i] * (1.0 - alphas_cumprod_prev[i]) / (1.0 - alphas_cumprod[i])).collect();
        Schedule {
            timesteps,
            posterior_log_variance_clipped: pv.iter().map(|v| v.max(1e-20).ln()).collect(),
            posterior_mean_coef1: (0..timesteps)
                .map(|i| betas[i] * alphas_cumprod_prev[i].sqrt() / (1.0 - alphas_cumprod[i]))
                .collect(),
            posterior_mean_coef2: (0..timesteps)
                .map(|i| (1.0 - alphas_cumprod_prev[i]) * (1.0 - betas[i]).sqrt() / (1.0 - alphas_cumprod[i]))
                .collect(),
            posterior_variance: pv,
            betas,
            alphas_cumprod,
            alphas_cumprod_prev,
        }
    }

    /// One of the 13 reference buffers by name, as float32 (how the reference stores them).
    pub fn buffer(&self, name: &str) -> Option<Vec<f32>> {
        let ac = &self.alphas_cumprod;
        let v: Vec<f64> = match name {
            "betas" => self.betas.clone(),
            "alphas_cumprod" => ac.clone(),
            "alphas_cumprod_prev" => self.alphas_cumprod_prev.clone(),
            "sqrt_alphas_cumprod" => ac.iter().map(|a| a.sqrt()).collect(),
            "sqrt_one_minus_alphas_cumprod" => ac.iter().map(|a| (1.0 - a).sqrt()).collect(),
            "log_one_minus_alphas_cumprod" => ac.iter().map(|a| (1.0 - a).ln()).collect(),
            "sqrt_recip_alphas_cumprod" => ac.iter().map(|a| (1.0 / a).sqrt()).collect(),
            "sqrt_recipm1_alphas_cumprod" => ac.iter().map(|a| (1.0 / a - 1.0).sqrt()).collect(),
            "posterior_variance" => self.posterior_variance.clone(),
            "posterior_log_variance_clipped" => self.posterior_log_variance_clipped.clone(),
            "posterior_mean_coef1" => self.posterior_mean_coef1.clone(),
            "posterior_mean_coef2" => self.posterior_mean_coef2.clone(),
            "posterior_mean_coef3" => self.posterior_mean_coef2.iter().map(|c| 1.0 - c).collect(),
            _ => return None,
        };
        Some(v.into_iter().map(|x| x as f32).collect())
    }

    /// (√ᾱ_t, √(1−ᾱ_t)): the q_sample coefficients.
    pub fn q_coefs(&self, t: usize) -> (f32, f32) {
        let a = self.alphas_cumprod[t];
        (a.sqrt() as f32, (1.0 - a).sqrt() as f32)
    }

    /// ᾱ at a continuous timestep τ ∈ [0, T−1]: log √ᾱ interpolated linearly between the integer
    /// timesteps (the discrete-time wrapper of DPM-Solver, `NoiseScheduleVP('discrete')`); exactly
    /// `alphas_cumprod[t]` at integer τ = t. τ outside [0, T−1] is clamped.
    pub fn alpha_bar_at(&self, tau: f64) -> f64 {
        let last = self.timesteps - 1;
        let tau = tau.clamp(0.0, last as f64);
        let i = (tau.floor() as usize).min(last);
        let f = tau - i as f64;
        if f == 0.0 {
            return self.alphas_cumprod[i];
        }
        let (a, b) = (self.alphas_cumprod[i].ln(), self.alphas_cumprod[i + 1].ln());
        (a + (b - a) * f).exp()
    }

    /// Coefficients of the ancestral step at t ("fixed small" variance β̃_t, no noise at t = 0).
    pub fn ddpm_coefs(&self, t: usize) -> crate::backend::DdpmCoefs {
        let a = self.alphas_cumprod[t];
        crate::backend::DdpmCoefs {
            recip: (1.0 / a).sqrt() as f32,
            recipm1: (1.0 / a - 1.0).sqrt() as f32,
            coef1: self.posterior_mean_coef1[t] as f32,
            coef2: self.posterior_mean_coef2[t] as f32,
            sigma: if t == 0 { 0.0 } else { (0.5 * self.posterior_log_variance_clipped[t]).exp() as f32 },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosine_values_match_the_spec() {
        let s = Schedule::cosine(250);
        let rel = |a: f64, b: f64| ((a - b) / b).abs();
        assert!(rel(s.betas[0], 1.94269e-4) < 1e-5, "{}", s.betas[0]);
        assert!(rel(s.betas[1], 2.71987e-4) < 1e-5, "{}", s.betas[1]);
        assert!(rel(s.betas[124], 0.012466) < 1e-4, "{}", s.betas[124]);
        assert!(rel(s.betas[248], 0.74999) < 1e-4, "{}", s.betas[248]);
        assert_eq!(s.betas[249], 0.999);
        assert!(s.betas[..249].iter().all(|&b| b < 0.999), "only t = 249 hits the clip");
        assert!(rel(s.alphas_cumprod[0], 0.999806) < 1e-6);
        assert!(rel(s.alphas_cumprod[124], 0.4938) < 1e-3, "{}", s.alphas_cumprod[124]);
        assert!(rel(s.alphas_cumprod[249], 3.886e-8) < 1e-3, "{}", s.alphas_cumprod[249]);
        // at t = 0 the posterior mean is exactly x̂₀
        let c = s.ddpm_coefs(0);
        assert!((c.coef1 - 1.0).abs() < 1e-7 && c.coef2.abs() < 1e-7 && c.sigma == 0.0);
        for name in BUFFER_NAMES {
            let b = s.buffer(name).unwrap();
            assert_eq!(b.len(), 250, "{name}");
            assert!(b.iter().all(|v| v.is_finite()), "{name}");
        }
        assert_eq!(s.buffer("alphas_cumprod_prev").unwrap()[0], 1.0);
    }
}
