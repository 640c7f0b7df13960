//! The samplers as plans: for a schedule and a step count, the network times and the
//! coefficients of every [`Backend::sampler_step`](crate::backend::Backend::sampler_step), computed
//! in f64 with no backend in sight. `diffusion::sampler` runs a plan on any backend, with the
//! U-Net or with any other ε-model (the tests' Gaussian toy), so both share this code.
//!
//! Notation: ᾱ_t = `alphas_cumprod[t]` (t = 0..T−1, the network's timestep index), x̂₀ =
//! clamp(√(1/ᾱ)·x − √(1/ᾱ−1)·ε̂, −1, 1) (every sampler clips as the reference's `p_sample`).
//!
//! - **ddpm** — ancestral sampling (spec §3.3), "fixed small" variance β̃ with the reference's
//!   log clamp, no noise on the last step. With all T steps this is the reference sampler
//!   operation for operation. With S < T steps: the respaced chain of Improved DDPM (Nichol &
//!   Dhariwal 2021, §4): timesteps `round(i·(T−1)/(S−1))` (half up), β'_t = 1 − ᾱ_t/ᾱ_prev.
//! - **ddim** — DDIM (Song et al. 2021, eq. 12) with σ = η·√((1−ᾱ_prev)/(1−ᾱ_t))·√(1−ᾱ_t/ᾱ_prev),
//!   ε re-derived from the clipped x̂₀ (as guided-diffusion's `ddim_sample`); the paper's linear
//!   selection τ_i = ⌊i·T/S⌋ (1-based, i = 1..S, so τ_S = T: network timesteps τ_i − 1); the last
//!   step goes to ᾱ = 1 (x̂₀). η = 1 with S = T is ancestral DDPM (β̃ = σ², coefficients equal).
//! - **dpm-solver++** — DPM-Solver++(2M) (Lu et al. 2022, Alg. 2), data prediction with clipped
//!   x̂₀, first step first-order, and (as the official code) a first-order last step below 10
//!   steps. Discrete time as the official `NoiseScheduleVP('discrete')`: log √ᾱ linear between
//!   timesteps ([`Schedule::alpha_bar_at`]), the network gets the fractional timestep. Steps are
//!   uniform in time from T−1 to 0 (`skip_type='time_uniform'`, the official default and its
//!   advice for high-resolution data; uniform-λ steps would spend about a quarter of them between
//!   timesteps 248 and 249, where the cosine schedule's clipped last β sits). Ends at timestep 0.
//! - **ipndm** — iPNDM of DEIS (Zhang & Chen 2023), the variant the reference's
//!   `fast_sampling/inference_deis.py` runs (`method="ipndm"`, up to 3 past ε): a DDIM step whose
//!   ε is the Adams–Bashforth combination of the last four ε (weights 1; 3/2, −1/2;
//!   (23, −16, 5)/12; (55, −59, 37, −9)/24 while the history fills), each ε re-derived from the
//!   clipped x̂₀ (the script's `predict_eps`); timesteps `⌊i·(T−1)/S⌋`, i = S..0 (its integer
//!   `linspace`), ending at timestep 0 (with S = T the last step has zero length, as there).
//!   Difference: DEIS floors ᾱ at 1e−7, which changes the first step for the cosine schedule
//!   (ᾱ_249 = 3.9e−8); here ᾱ is the schedule's. Order: the AB weights are for steps uniform in t
//!   while the DDIM step integrates in ρ = √(1/ᾱ−1), so on a schedule whose ρ(t) is not linear
//!   the global order is 2, not the polynomial's 4 (see tests/samplers.rs).

use std::fmt;
use std::str::FromStr;

use super::schedule::Schedule;
use crate::backend::Prediction;
use crate::error::{Error, Result};

/// Which sampler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum SamplerKind {
    #[serde(rename = "ddpm")]
    Ddpm,
    #[serde(rename = "ddim")]
    Ddim,
    #[serde(rename = "dpm-solver++")]
    DpmSolverPp,
    #[serde(rename = "ipndm")]
    Ipndm,
}

impl SamplerKind {
    pub const ALL: [SamplerKind; 4] =
        [SamplerKind::Ddpm, SamplerKind::Ddim, SamplerKind::DpmSolverPp, SamplerKind::Ipndm];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            SamplerKind::Ddpm => "ddpm",
            SamplerKind::Ddim => "ddim",
            SamplerKind::DpmSolverPp => "dpm-solver++",
            SamplerKind::Ipndm => "ipndm",
        }
    }
}

impl fmt::Display for SamplerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SamplerKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        SamplerKind::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| {
            Error::Config(format!("unknown sampler {s:?}: expected one of ddpm, ddim, dpm-solver++, ipndm"))
        })
    }
}

/// A sampler and its settings.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplerSpec {
    pub kind: SamplerKind,
    /// Network evaluations per volume (1..=T).
    pub steps: usize,
    /// DDIM's η (0: deterministic, 1: ancestral variance); must be 0 for the other samplers.
    pub eta: f64,
}

impl SamplerSpec {
    /// The reference sampler: ancestral DDPM with all `timesteps` steps.
    pub fn ddpm(timesteps: usize) -> Self {
        SamplerSpec { kind: SamplerKind::Ddpm, steps: timesteps, eta: 0.0 }
    }

    pub fn validate(&self, timesteps: usize) -> Result<()> {
        if self.steps == 0 || self.steps > timesteps {
            return Err(Error::Config(format!(
                "{} steps: must be between 1 and the schedule's {timesteps} timesteps",
                self.steps
            )));
        }
        match self.kind {
            SamplerKind::Ddim if !(0.0..=1.0).contains(&self.eta) => {
                Err(Error::Config(format!("DDIM eta {} must be in [0, 1]", self.eta)))
            }
            SamplerKind::Ddim => Ok(()),
            k if self.eta != 0.0 => Err(Error::Config(format!("eta ({}) applies to ddim only, not {k}", self.eta))),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for SamplerSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} steps", self.kind, self.steps)?;
        if self.kind == SamplerKind::Ddim {
            write!(f, " eta {}", self.eta)?;
        }
        Ok(())
    }
}

/// One network evaluation and the update after it; coefficients as in `backend::SamplerCoefs`
/// (the same for every sample: the loop adds each sample's noise stream).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlanStep {
    /// Network timestep (fractional for DPM-Solver++).
    pub t: f64,
    pub recip: f64,
    pub recipm1: f64,
    pub cx: f64,
    pub cd: f64,
    pub ch: [f64; 3],
    pub cz: f64,
}

/// A whole sampling run.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub spec: SamplerSpec,
    pub pred: Prediction,
    pub clip: bool,
    /// History buffers the steps use (0, 1 or 3).
    pub history: usize,
    pub steps: Vec<PlanStep>,
    /// ᾱ of the result: 1 for samplers that end on x̂₀ (ddpm, ddim), ᾱ_0 for those that end on
    /// x at timestep 0 (dpm-solver++, ipndm).
    pub end_alpha_bar: f64,
}

/// Improved-DDPM respacing: S timesteps evenly spaced over [0, T−1], rounded half up, descending.
pub fn ddpm_timesteps(t: usize, s: usize) -> Vec<usize> {
    if s == 1 {
        return vec![t - 1];
    }
    (0..s).rev().map(|i| (2 * i * (t - 1) + (s - 1)) / (2 * (s - 1))).collect()
}

/// DDIM's linear selection ⌊i·T/S⌋ − 1 for i = S..1 (descending network timesteps).
pub fn ddim_timesteps(t: usize, s: usize) -> Vec<usize> {
    (1..=s).rev().map(|i| i * t / s - 1).collect()
}

/// iPNDM's ⌊i·(T−1)/S⌋ for i = S..0: S + 1 timesteps, the last one 0.
pub fn ipndm_timesteps(t: usize, s: usize) -> Vec<usize> {
    (0..=s).rev().map(|i| i * (t - 1) / s).collect()
}

/// DPM-Solver++'s time-uniform grid: (T−1)·(1 − i/S) for i = 0..S.
pub fn dpm_solver_times(t: usize, s: usize) -> Vec<f64> {
    (0..=s).map(|i| if i == s { 0.0 } else { (t - 1) as f64 * (1.0 - i as f64 / s as f64) }).collect()
}

/// (√(1/ᾱ), √(1/ᾱ − 1)): x̂₀ = recip·x − recipm1·ε̂.
fn x0_coefs(a: f64) -> (f64, f64) {
    ((1.0 / a).sqrt(), (1.0 / a - 1.0).sqrt())
}

/// The plan of `spec` on `sched` (validated first), on the sampler's own timestep selection.
pub fn plan(spec: &SamplerSpec, sched: &Schedule) -> Result<Plan> {
    spec.validate(sched.timesteps)?;
    let (t, s) = (sched.timesteps, spec.steps);
    Ok(match spec.kind {
        SamplerKind::Ddpm => ddpm_plan(sched, &ddpm_timesteps(t, s)),
        SamplerKind::Ddim => ddim_plan(sched, &ddim_timesteps(t, s), spec.eta),
        SamplerKind::DpmSolverPp => dpm_solver_pp_plan(sched, &dpm_solver_times(t, s)),
        SamplerKind::Ipndm => ipndm_plan(sched, &ipndm_timesteps(t, s)),
    })
}

/// A step with only the x̂₀ coefficients of ᾱ = `a` filled in.
fn step_at(t: f64, a: f64) -> PlanStep {
    let (recip, recipm1) = x0_coefs(a);
    PlanStep { t, recip, recipm1, cx: 0.0, cd: 0.0, ch: [0.0; 3], cz: 0.0 }
}

fn spec_of(kind: SamplerKind, steps: usize, eta: f64) -> SamplerSpec {
    SamplerSpec { kind, steps, eta }
}

/// Ancestral DDPM on descending timesteps `ts` (one network evaluation each; the last one lands
/// on x̂₀).
pub fn ddpm_plan(sched: &Schedule, ts: &[usize]) -> Plan {
    let ac = &sched.alphas_cumprod;
    let mut steps = Vec::with_capacity(ts.len());
    for (k, &t) in ts.iter().enumerate() {
        let prev = ts.get(k + 1).copied();
        let a = ac[t];
        // The schedule's own β where the step is one timestep (so all T steps reproduce
        // `Schedule::ddpm_coefs` bit for bit), the respaced β' = 1 − ᾱ_t/ᾱ_prev elsewhere.
        let (ap, beta) = match prev {
            Some(p) if p + 1 == t => (ac[p], sched.betas[t]),
            Some(p) => (ac[p], 1.0 - a / ac[p]),
            None if t == 0 => (1.0, sched.betas[0]),
            None => (1.0, 1.0 - a),
        };
        let pv = beta * (1.0 - ap) / (1.0 - a);
        let mut st = step_at(t as f64, a);
        st.cd = beta * ap.sqrt() / (1.0 - a);
        st.cx = (1.0 - ap) * (1.0 - beta).sqrt() / (1.0 - a);
        st.cz = if prev.is_none() { 0.0 } else { (0.5 * pv.max(1e-20).ln()).exp() };
        steps.push(st);
    }
    Plan {
        spec: spec_of(SamplerKind::Ddpm, ts.len(), 0.0),
        pred: Prediction::Data,
        clip: true,
        history: 0,
        steps,
        end_alpha_bar: 1.0,
    }
}

/// DDIM with `eta` on descending timesteps `ts`; the last step lands on x̂₀ (ᾱ = 1).
pub fn ddim_plan(sched: &Schedule, ts: &[usize], eta: f64) -> Plan {
    let ac = &sched.alphas_cumprod;
    let mut steps = Vec::with_capacity(ts.len());
    for (k, &t) in ts.iter().enumerate() {
        let a = ac[t];
        let ap = ts.get(k + 1).map_or(1.0, |&p| ac[p]);
        let sigma = eta * ((1.0 - ap) / (1.0 - a)).sqrt() * (1.0 - a / ap).sqrt();
        let c_eps = (1.0 - ap - sigma * sigma).max(0.0).sqrt();
        // x' = √ᾱp·x̂₀ + c_eps·ε' + σz with ε' = (x − √ᾱ·x̂₀)/√(1−ᾱ)
        let mut st = step_at(t as f64, a);
        st.cd = ap.sqrt() - c_eps * a.sqrt() / (1.0 - a).sqrt();
        st.cx = c_eps / (1.0 - a).sqrt();
        st.cz = sigma;
        steps.push(st);
    }
    Plan {
        spec: spec_of(SamplerKind::Ddim, ts.len(), eta),
        pred: Prediction::Data,
        clip: true,
        history: 0,
        steps,
        end_alpha_bar: 1.0,
    }
}

/// DPM-Solver++(2M) from `taus[0]` to `taus[S]` (descending continuous timesteps; S steps).
pub fn dpm_solver_pp_plan(sched: &Schedule, taus: &[f64]) -> Plan {
    let s = taus.len() - 1;
    let at = |tau: f64| {
        let a = sched.alpha_bar_at(tau);
        let (alpha, sigma) = (a.sqrt(), (1.0 - a).sqrt());
        (a, alpha, sigma, alpha.ln() - sigma.ln())
    };
    let mut steps = Vec::with_capacity(s);
    let mut h_prev: Option<f64> = None;
    for k in 0..s {
        let (a_s, _, sig_s, lam_s) = at(taus[k]);
        let (_, alpha_t, sig_t, lam_t) = at(taus[k + 1]);
        let h = lam_t - lam_s;
        let phi = -alpha_t * (-h).exp_m1(); // α_t·(1 − e^{−h})
        let mut st = step_at(taus[k], a_s);
        st.cx = sig_t / sig_s;
        let lower_order_final = s < 10 && k == s - 1;
        match h_prev {
            Some(hp) if !lower_order_final => {
                // D = (1 + 1/2r)·x̂₀ − 1/2r·x̂₀_prev, r = h_prev/h
                let r = hp / h;
                st.cd = phi * (1.0 + 0.5 / r);
                st.ch[0] = -phi * 0.5 / r;
            }
            _ => st.cd = phi,
        }
        h_prev = Some(h);
        steps.push(st);
    }
    Plan {
        spec: spec_of(SamplerKind::DpmSolverPp, s, 0.0),
        pred: Prediction::Data,
        clip: true,
        history: 1,
        steps,
        end_alpha_bar: sched.alpha_bar_at(taus[s]),
    }
}

/// iPNDM from `ts[0]` to `ts[S]` (descending timesteps; S steps, uniform for its AB weights).
pub fn ipndm_plan(sched: &Schedule, ts: &[usize]) -> Plan {
    const AB: [&[f64]; 4] = [
        &[1.0],
        &[1.5, -0.5],
        &[23.0 / 12.0, -16.0 / 12.0, 5.0 / 12.0],
        &[55.0 / 24.0, -59.0 / 24.0, 37.0 / 24.0, -9.0 / 24.0],
    ];
    let ac = &sched.alphas_cumprod;
    let s = ts.len() - 1;
    let mut steps = Vec::with_capacity(s);
    for k in 0..s {
        let (a, b) = (ac[ts[k]], ac[ts[k + 1]]);
        let cx = (b / a).sqrt();
        let ddim = (1.0 - b).sqrt() - cx * (1.0 - a).sqrt();
        let w = AB[k.min(3)];
        let mut st = step_at(ts[k] as f64, a);
        st.cx = cx;
        st.cd = ddim * w[0];
        for (j, wj) in w.iter().enumerate().skip(1) {
            st.ch[j - 1] = ddim * wj;
        }
        steps.push(st);
    }
    Plan {
        spec: spec_of(SamplerKind::Ipndm, s, 0.0),
        pred: Prediction::Noise,
        clip: true,
        history: 3,
        steps,
        end_alpha_bar: ac[ts[s]],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestep_selections() {
        assert_eq!(ddpm_timesteps(250, 250), (0..250).rev().collect::<Vec<_>>());
        assert_eq!(ddpm_timesteps(250, 2), vec![249, 0]);
        // 249/4 = 62.25: 0, 62.25, 124.5, 186.75, 249 → rounded half up
        assert_eq!(ddpm_timesteps(250, 5), vec![249, 187, 125, 62, 0]);
        assert_eq!(ddpm_timesteps(250, 1), vec![249]);
        assert_eq!(ddim_timesteps(250, 250), (0..250).rev().collect::<Vec<_>>());
        assert_eq!(ddim_timesteps(250, 10), vec![249, 224, 199, 174, 149, 124, 99, 74, 49, 24]);
        assert_eq!(ddim_timesteps(250, 3), vec![249, 165, 82]);
        // torch.linspace(0, 249, 11, dtype=long) flipped, as the reference's DEIS script
        assert_eq!(ipndm_timesteps(250, 10), vec![249, 224, 199, 174, 149, 124, 99, 74, 49, 24, 0]);
        let full = ipndm_timesteps(250, 250);
        assert_eq!((full[0], full[1], full[249], full[250]), (249, 248, 0, 0));
        let d = dpm_solver_times(250, 4);
        assert_eq!(d, vec![249.0, 186.75, 124.5, 62.25, 0.0]);
    }

    #[test]
    fn full_ddpm_plan_is_the_schedules_ancestral_step() {
        let sched = Schedule::cosine(250);
        let p = plan(&SamplerSpec::ddpm(250), &sched).unwrap();
        assert_eq!(p.steps.len(), 250);
        for (k, st) in p.steps.iter().enumerate() {
            let t = 249 - k;
            let c = sched.ddpm_coefs(t);
            assert_eq!(st.t, t as f64);
            let got = [st.recip, st.recipm1, st.cd, st.cx, st.cz].map(|v| v as f32);
            assert_eq!(got, [c.recip, c.recipm1, c.coef1, c.coef2, c.sigma], "t = {t}");
        }
    }

    #[test]
    fn ddim_eta_one_full_is_ddpm_and_eta_zero_is_deterministic() {
        let sched = Schedule::cosine(250);
        let d = plan(&SamplerSpec::ddpm(250), &sched).unwrap();
        let i = plan(&SamplerSpec { kind: SamplerKind::Ddim, steps: 250, eta: 1.0 }, &sched).unwrap();
        for (a, b) in d.steps.iter().zip(&i.steps) {
            assert_eq!(a.t, b.t);
            for (x, y) in [(a.cd, b.cd), (a.cx, b.cx), (a.cz, b.cz)] {
                assert!((x - y).abs() <= 1e-9 * x.abs().max(1.0), "t {}: {x} vs {y}", a.t);
            }
        }
        let z = plan(&SamplerSpec { kind: SamplerKind::Ddim, steps: 10, eta: 0.0 }, &sched).unwrap();
        assert!(z.steps.iter().all(|s| s.cz == 0.0));
        // the last step lands on x̂₀
        let last = z.steps.last().unwrap();
        assert_eq!((last.t, last.cd, last.cx), (24.0, 1.0, 0.0));
    }

    #[test]
    fn ipndm_coefficients_are_ddim_times_adams_bashforth() {
        let sched = Schedule::cosine(250);
        let p = plan(&SamplerSpec { kind: SamplerKind::Ipndm, steps: 10, eta: 0.0 }, &sched).unwrap();
        assert_eq!((p.pred, p.history, p.end_alpha_bar), (Prediction::Noise, 3, sched.alphas_cumprod[0]));
        let ac = &sched.alphas_cumprod;
        let ts = ipndm_timesteps(250, 10);
        let want: [&[f64]; 4] = [
            &[1.0],
            &[1.5, -0.5],
            &[23.0 / 12.0, -4.0 / 3.0, 5.0 / 12.0],
            &[55.0 / 24.0, -59.0 / 24.0, 37.0 / 24.0, -0.375],
        ];
        for (k, st) in p.steps.iter().enumerate() {
            let (a, b) = (ac[ts[k]], ac[ts[k + 1]]);
            let ddim = (1.0 - b).sqrt() - (b / a).sqrt() * (1.0 - a).sqrt();
            assert!((st.cx - (b / a).sqrt()).abs() < 1e-12);
            let w = want[k.min(3)];
            let got = [st.cd, st.ch[0], st.ch[1], st.ch[2]];
            for (j, g) in got.iter().enumerate() {
                let wj = w.get(j).copied().unwrap_or(0.0);
                assert!((g - ddim * wj).abs() < 1e-12, "step {k} weight {j}: {g} vs {}", ddim * wj);
            }
            // consistency: the weights sum to the DDIM coefficient
            assert!((got.iter().sum::<f64>() - ddim).abs() < 1e-12);
        }
    }

    #[test]
    fn dpm_solver_pp_steps() {
        let sched = Schedule::cosine(250);
        let p = plan(&SamplerSpec { kind: SamplerKind::DpmSolverPp, steps: 20, eta: 0.0 }, &sched).unwrap();
        assert_eq!((p.pred, p.history), (Prediction::Data, 1));
        assert_eq!(p.steps[0].ch[0], 0.0, "the first step is first order");
        for st in &p.steps[1..] {
            // D = (1 + 1/2r)·x̂₀ − 1/2r·x̂₀_prev: the two weights sum to α_t(1 − e^{−h})
            assert!(st.ch[0] < 0.0 && st.cd > 0.0);
        }
        // fewer than 10 steps: the last one is first order
        let q = plan(&SamplerSpec { kind: SamplerKind::DpmSolverPp, steps: 5, eta: 0.0 }, &sched).unwrap();
        assert_eq!(q.steps[4].ch[0], 0.0);
        assert!(q.steps[3].ch[0] != 0.0);
        // the network sees fractional timesteps between 249 and 0
        assert_eq!(p.steps[0].t, 249.0);
        assert!((p.steps[1].t - 236.55).abs() < 1e-9);
    }

    #[test]
    fn bad_specs_are_errors() {
        let sched = Schedule::cosine(250);
        for (spec, want) in [
            (SamplerSpec { kind: SamplerKind::Ddim, steps: 0, eta: 0.0 }, "between 1 and"),
            (SamplerSpec { kind: SamplerKind::Ddim, steps: 251, eta: 0.0 }, "between 1 and"),
            (SamplerSpec { kind: SamplerKind::Ddim, steps: 10, eta: 1.5 }, "eta"),
            (SamplerSpec { kind: SamplerKind::Ipndm, steps: 10, eta: 0.5 }, "ddim only"),
        ] {
            let e = plan(&spec, &sched).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        assert_eq!("dpm-solver++".parse::<SamplerKind>().unwrap(), SamplerKind::DpmSolverPp);
        assert!("euler".parse::<SamplerKind>().unwrap_err().to_string().contains("ddpm, ddim"));
    }
}
