//! Watching a run learn: every so many optimizer steps, one volume sampled with DDPM-50 from the
//! EMA weights, for one fixed mask and seed (the data's first pair, the run's seed), saved as
//! `previews/step_NNNNNN.png` (mask | sample), and `progress.html` beside the checkpoint: the
//! loss curve (`loss.svg`) over the strip of previews, oldest first.
//!
//! The spacing is a number of steps, or `auto`: the first preview is taken once a few steps have
//! been timed, and its measured cost sets the spacing ([`auto_spacing`], a pure function) so
//! that all previews together stay within [`BUDGET`] of the session's training time. A preview
//! only reads the EMA weights (swapped in and back): training continues bit for bit as without.
//! Previews from before a resume stay; a new run in an old folder removes the old run's.

use crate::backend::Backend;
use crate::data::{output, preview, Convention, Volume};
use crate::diffusion::{plan, Sampler, SamplerSpec, Schedule, Trainer};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Share of the training time all of a session's previews may cost under `auto`.
pub const BUDGET: f64 = 0.05;
/// Sampler steps of a preview (DDPM respaced; fewer where the model's T is smaller).
pub const PREVIEW_STEPS: usize = 50;
/// Steps timed before `auto` takes its first preview (the session's first step, which plans and
/// warms up, is not counted).
pub const TIMED_STEPS: u64 = 5;
/// The folder of the preview PNGs, in the run folder.
pub const PREVIEW_DIR: &str = "previews";
/// The progress page, in the run folder.
pub const PROGRESS_HTML: &str = "progress.html";

/// `--preview-every`: off (0), every N optimizer steps, or auto.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PreviewEvery {
    Auto,
    Off,
    Steps(u64),
}

impl std::str::FromStr for PreviewEvery {
    type Err = String;
    /// `auto`, `0` (off) or a whole number of steps.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "auto" => Ok(PreviewEvery::Auto),
            n => match n.parse::<u64>() {
                Ok(0) => Ok(PreviewEvery::Off),
                Ok(n) => Ok(PreviewEvery::Steps(n)),
                Err(_) => Err("must be auto, 0 (off) or a whole number of steps ≥ 1".into()),
            },
        }
    }
}

/// The spacing, in steps, of the previews after a first one, under `auto`: a first preview
/// took `preview_secs`, an optimizer step takes `step_secs`, the session trains `session_steps`
/// steps of which `steps_left` are still to come. All previews together (the first included)
/// may cost `budget` × the session's training time; None when that leaves room for no other.
/// Previews then fall every N steps of the rest, at most as many as the budget pays for.
pub fn auto_spacing(
    step_secs: f64,
    preview_secs: f64,
    session_steps: u64,
    steps_left: u64,
    budget: f64,
) -> Option<u64> {
    let ok = |x: f64| x.is_finite() && x > 0.0;
    if !ok(step_secs) || !ok(preview_secs) || !ok(budget) || steps_left == 0 {
        return None;
    }
    let allowed = budget * session_steps as f64 * step_secs;
    let more = ((allowed - preview_secs) / preview_secs).floor();
    if more < 1.0 {
        return None;
    }
    let more = more.min(steps_left as f64) as u64;
    Some(steps_left.div_ceil(more))
}

/// When the next preview falls, as a session goes.
#[derive(Clone, Debug)]
pub struct PreviewSchedule {
    mode: PreviewEvery,
    /// The spacing in force (None: not known yet under `auto`, or no more previews).
    pub spacing: Option<u64>,
    /// Session steps timed so far, and their seconds (auto).
    timed: u64,
    timed_secs: f64,
    /// The step of the next preview under `auto` once its spacing is set.
    next: Option<u64>,
    /// Set once auto has decided (after its first preview).
    decided: bool,
}

/// What the preview schedule says after a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Due {
    No,
    /// Take a preview now.
    Yes,
}

impl PreviewSchedule {
    pub fn new(mode: PreviewEvery) -> Self {
        let spacing = match mode {
            PreviewEvery::Steps(n) => Some(n),
            _ => None,
        };
        PreviewSchedule { mode, spacing, timed: 0, timed_secs: 0.0, next: None, decided: false }
    }

    /// After optimizer step `step` (the session's `nth`, from 1), which took `secs`: is a
    /// preview due?
    pub fn after_step(&mut self, step: u64, nth: u64, secs: f64) -> Due {
        match self.mode {
            PreviewEvery::Off => Due::No,
            PreviewEvery::Steps(n) if step.is_multiple_of(n) => Due::Yes,
            PreviewEvery::Steps(_) => Due::No,
            PreviewEvery::Auto => {
                if nth > 1 && !self.decided {
                    self.timed += 1;
                    self.timed_secs += secs;
                }
                match (self.decided, self.next) {
                    (false, _) if self.timed >= TIMED_STEPS => Due::Yes,
                    (true, Some(at)) if step >= at => Due::Yes,
                    _ => Due::No,
                }
            }
        }
    }

    /// Mean seconds per step measured under `auto` (None before any).
    pub fn step_secs(&self) -> Option<f64> {
        (self.timed > 0).then(|| self.timed_secs / self.timed as f64)
    }

    /// A preview was taken at `step` in `preview_secs`; `session_steps` and `steps_left` as in
    /// [`auto_spacing`]. Under `auto`, the first one sets the spacing.
    pub fn taken(&mut self, step: u64, preview_secs: f64, session_steps: u64, steps_left: u64) {
        if self.mode != PreviewEvery::Auto {
            return;
        }
        if !self.decided {
            self.decided = true;
            let step_secs = self.step_secs().unwrap_or(f64::NAN);
            self.spacing = auto_spacing(step_secs, preview_secs, session_steps, steps_left, BUDGET);
        }
        self.next = self.spacing.map(|n| step + n);
    }
}

/// What a preview samples: the fixed mask and seed, the plan, and where the PNGs go.
pub struct Previewer {
    dir: PathBuf,
    conv: Convention,
    cond: Vec<f32>,
    mask: Volume,
    seed: u64,
    plan: crate::diffusion::Plan,
    spec: SamplerSpec,
}

impl Previewer {
    /// Previews into `run_dir/previews` of the condition `cond` (its label volume `mask`, in
    /// convention `conv`) with `seed`, by DDPM-[`PREVIEW_STEPS`] on the cosine schedule of T =
    /// `timesteps`.
    pub fn new(
        run_dir: &Path,
        conv: Convention,
        cond: Vec<f32>,
        mask: Volume,
        seed: u64,
        timesteps: usize,
    ) -> Result<Previewer> {
        let sched = Schedule::try_cosine(timesteps)?;
        let spec = SamplerSpec { steps: PREVIEW_STEPS.min(timesteps), ..SamplerSpec::ddpm(timesteps) };
        let plan = plan(&spec, &sched)?;
        Ok(Previewer { dir: run_dir.join(PREVIEW_DIR), conv, cond, mask, seed, plan, spec })
    }

    /// The sampler of the previews (e.g. "DDPM, 50 steps").
    pub fn spec(&self) -> SamplerSpec {
        self.spec
    }

    /// Remove the previews of another run (a new run in an old folder): `step_*.png` only.
    pub fn clear(&self) -> Result<()> {
        for (_, p) in list(&self.dir)? {
            std::fs::remove_file(&p).map_err(|e| Error::io(&p, e))?;
        }
        Ok(())
    }

    /// Sample the preview of `tr`'s current step from its EMA weights, write its PNG; returns
    /// the file and the seconds it took.
    pub fn take<B: Backend>(&self, be: &B, tr: &mut Trainer<B>) -> Result<(PathBuf, f64)> {
        let t0 = Instant::now();
        let cfg = tr.net.cfg.clone();
        let size = [cfg.depth, cfg.size, cfg.size];
        let (cond, seed, plan) = (&self.cond, self.seed, &self.plan);
        let vol = tr.with_ema(|net| -> Result<Vec<f32>> {
            let mut s = Sampler::new(be, net)?;
            let mut v = s.sample_jobs(be, net, plan, &[(cond.as_slice(), seed)], |_| {})?;
            Ok(v.swap_remove(0))
        })?;
        let images = output::image_volumes(&self.conv, &vol, cfg.out_channels, size, &self.mask)?;
        std::fs::create_dir_all(&self.dir).map_err(|e| Error::io(&self.dir, e))?;
        let path = self.dir.join(png_name(tr.step));
        let title = format!("step {}", tr.step);
        let mut panel = vec![(&self.mask, preview::Kind::Labels)];
        panel.extend(images.iter().map(|v| (v, preview::Kind::Intensity)));
        let mut titles = vec!["mask"];
        titles.extend(images.iter().map(|_| title.as_str()));
        preview::write_png_titled(&path, &panel, &titles)?;
        Ok((path, t0.elapsed().as_secs_f64()))
    }
}

/// The preview file name of optimizer step `step`.
pub fn png_name(step: u64) -> String {
    format!("step_{step:06}.png")
}

/// The previews in `dir` as (step, path), by step (none when the folder does not exist).
pub fn list(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(dir, e)),
    };
    let mut v = Vec::new();
    for e in rd {
        let p = e.map_err(|e| Error::io(dir, e))?.path();
        let step = p.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix("step_")?.strip_suffix(".png"));
        if let Some(s) = step.and_then(|s| s.parse::<u64>().ok()) {
            v.push((s, p));
        }
    }
    v.sort();
    Ok(v)
}

/// Write `run_dir/progress.html`: the loss curve (`loss.svg`, which the checkpoints rewrite)
/// over the strip of every preview in `run_dir/previews`, oldest first. Paths are relative, so
/// the folder can be moved or copied whole.
pub fn write_progress(run_dir: &Path, title: &str) -> Result<PathBuf> {
    let shots = list(&run_dir.join(PREVIEW_DIR))?;
    let esc = |s: &str| s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;");
    let mut h = String::new();
    h.push_str("<!doctype html>\n<html><head><meta charset=\"utf-8\">\n");
    h.push_str(&format!("<title>{}</title>\n", esc(title)));
    h.push_str(
        "<style>body{background:#202028;color:#ddd;font-family:sans-serif;margin:1em}\
         .strip{display:flex;overflow-x:auto;gap:8px}figure{margin:0}\
         figcaption{text-align:center}img.loss{background:#fff;max-width:100%}</style>\n",
    );
    h.push_str("</head><body>\n");
    h.push_str(&format!("<h1>{}</h1>\n", esc(title)));
    h.push_str("<h2>Loss</h2>\n<img class=\"loss\" src=\"loss.svg\" alt=\"loss curve (loss.svg)\">\n");
    h.push_str(&format!(
        "<h2>Previews ({}, DDPM-{PREVIEW_STEPS} from the EMA weights, one mask and seed)</h2>\n<div class=\"strip\">\n",
        shots.len()
    ));
    for (step, p) in &shots {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        h.push_str(&format!(
            "<figure><img src=\"{PREVIEW_DIR}/{}\" alt=\"step {step}\"><figcaption>step {step}</figcaption></figure>\n",
            esc(&name)
        ));
    }
    h.push_str("</div>\n</body></html>\n");
    let path = run_dir.join(PROGRESS_HTML);
    crate::checkpoint::write_atomic(&path, h.as_bytes())?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The share of training time the previews of [`auto_spacing`] cost, the first included.
    fn cost(step: f64, prev: f64, session: u64, left: u64) -> f64 {
        let n = auto_spacing(step, prev, session, left, BUDGET).map_or(0, |n| left / n);
        (1 + n) as f64 * prev / (session as f64 * step)
    }

    #[test]
    fn the_spacing_keeps_the_cost_within_the_budget() {
        for &step in &[0.01, 0.1, 0.37, 2.0] {
            for &prev in &[0.5, 2.5, 10.0, 60.0] {
                for &session in &[200u64, 1000, 10_000, 100_000] {
                    let left = session - TIMED_STEPS - 1;
                    if prev <= BUDGET * session as f64 * step {
                        let c = cost(step, prev, session, left);
                        assert!(c <= BUDGET + 1e-9, "step {step} preview {prev} session {session}: {c}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_spacing_of_long_runs_approaches_the_steady_rule() {
        // 0.1 s steps, 2 s previews: one preview per 2 / (0.05 × 0.1) = 400 steps in the long run
        let n = auto_spacing(0.1, 2.0, 1_000_000, 999_990, BUDGET).unwrap();
        assert!((400..=402).contains(&n), "{n}");
    }

    #[test]
    fn short_runs_get_one_preview_and_bad_times_none() {
        // the CPU demo: 200 steps of 0.37 s, 2.5 s a preview: 3.7 s allowed, one preview
        assert_eq!(auto_spacing(0.37, 2.5, 200, 194, BUDGET), None);
        // 1000 such steps: 18.5 s allowed, 6 more previews after the first, every 166 steps
        assert_eq!(auto_spacing(0.37, 2.5, 1000, 994, BUDGET), Some(166));
        assert_eq!(auto_spacing(0.0, 2.5, 1000, 994, BUDGET), None);
        assert_eq!(auto_spacing(0.3, f64::NAN, 1000, 994, BUDGET), None);
        assert_eq!(auto_spacing(0.3, 2.5, 1000, 0, BUDGET), None);
        // never more previews than steps
        assert_eq!(auto_spacing(1.0, 1e-6, 100, 3, BUDGET), Some(1));
    }

    #[test]
    fn the_schedule_times_then_follows_the_spacing() {
        let mut s = PreviewSchedule::new(PreviewEvery::Auto);
        let due: Vec<u64> = (1..=7).filter(|&k| s.after_step(k, k, 1.0) == Due::Yes).collect();
        // the first step is not timed: the 5 timed steps end at step 6, and it stays due until taken
        assert_eq!(due, vec![6, 7]);
        assert_eq!(s.step_secs(), Some(1.0));
        s.taken(7, 1.0, 1000, 993);
        let n = s.spacing.unwrap();
        assert!(s.after_step(7 + n - 1, 7 + n - 1, 1.0) == Due::No);
        assert!(s.after_step(7 + n, 7 + n, 1.0) == Due::Yes);
        let mut every = PreviewSchedule::new(PreviewEvery::Steps(3));
        let due: Vec<u64> = (1..=9).filter(|&k| every.after_step(k, k, 1.0) == Due::Yes).collect();
        assert_eq!(due, vec![3, 6, 9]);
        let mut off = PreviewSchedule::new(PreviewEvery::Off);
        assert!((1..=9).all(|k| off.after_step(k, k, 1.0) == Due::No));
    }

    #[test]
    fn preview_every_parses() {
        assert_eq!("auto".parse(), Ok(PreviewEvery::Auto));
        assert_eq!("0".parse(), Ok(PreviewEvery::Off));
        assert_eq!("25".parse(), Ok(PreviewEvery::Steps(25)));
        assert!("-1".parse::<PreviewEvery>().is_err());
        assert!("soon".parse::<PreviewEvery>().is_err());
    }
}
