//! The training loop of a run folder: optimizer steps until the step target, a checkpoint (with
//! the run record) every `checkpoint_every` steps and at the end, the loss log and its plot
//! rewritten at each checkpoint — and the ways a run must stop without losing work:
//!
//! - **stop requested** ([`StopFlag`], SIGINT/SIGTERM): the step in progress finishes, the
//!   checkpoint is written, [`Outcome::Stopped`];
//! - **divergence**: a NaN/±Inf loss, or non-finite weights when a checkpoint is due, ends the run
//!   at that step with [`Outcome::Diverged`]; nothing is written over the last good checkpoint
//!   (the loss log is, with the bad row, for diagnosis; a resume drops rows past its checkpoint);
//! - **a write that fails** (full disk, quota, I/O error): `Err(Error::NotWritten)` naming the
//!   file and the OS reason; the temp file is removed and the previous checkpoint is intact.
//!
//! **Data-parallel ranks** ([`Session::run_ranked`] with [`Ranks`]): every rank runs this loop
//! in lockstep; rank 0's weights, EMA and Adam moments are broadcast first, gradients are averaged
//! each step (`Trainer::train_step_synced`), and each step ends with one tiny all-gather of every
//! rank's loss *and its stop flag*: the logged loss is the mean over the global batch, and a stop
//! requested on any rank (a signal to rank 0 alone is enough) stops all of them after the same
//! optimizer step — the decision is taken from the gathered values, identical on every rank. By
//! default that gather is read only after the next step was launched, off the critical path
//! (`dist::agree`: [`Agreement`]; checkpoint steps and the last step read theirs at once). The
//! weights of all ranks are compared by hash every `check_every` steps and at the end. Rank 0
//! alone writes the checkpoint and the loss log; how its write went (written, weights not finite,
//! failed) is sent to the others, so that they stop at the same step too.
//!
//! Fault injection for tests ([`Faults`]): from the environment in the `meddpm` binary
//! (`MEDDPM_FAULT_NAN_AT_STEP=N`: the image batch of step N is all NaN, so the loss and then the
//! weights really become NaN; `MEDDPM_FAULT_DISK_FULL_AT_STEP=N`: the checkpoint write at step N
//! stops half-way with "no space left on device"; `MEDDPM_FAULT_SLOW_STEP_MS=M`: every batch
//! fetch inside a step sleeps M ms, so a signal sent after a checkpoint lands in a running step),
//! or set directly by library tests. Nothing reads these variables unless they are set.
//!
//! [`Summary`] reports what a session did (outcome, steps, losses; [`Summary::loss_means`] is the
//! first/last-steps loss of `meddpm train`'s closing line).

use super::bookkeeping::{on_interval, StepPlan};
use super::losslog::LossLog;
use super::record::{RunRecord, CHECKPOINT, META_KEY};
use super::stop::StopFlag;
use crate::backend::Backend;
use crate::checkpoint::{trainer_bytes, write_atomic_with};
use crate::diffusion::Trainer;
use crate::dist::agree::{Agreed, Agreement, StepAgreement, SyncCounts};
use crate::dist::{broadcast_state, check_weights, GradSync};
use crate::error::{Error, Result};
use std::io::Write;
use std::path::PathBuf;

/// Injected faults (see the module doc). The default injects nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Optimizer step whose image batch is replaced by NaN.
    pub nan_at_step: Option<u64>,
    /// Optimizer step whose checkpoint write fails half-way with a full disk.
    pub disk_full_at_step: Option<u64>,
    /// Milliseconds every batch fetch inside a step sleeps (a slow step, for signal tests).
    pub slow_step_ms: Option<u64>,
}

impl Faults {
    pub const NAN_VAR: &'static str = "MEDDPM_FAULT_NAN_AT_STEP";
    pub const DISK_FULL_VAR: &'static str = "MEDDPM_FAULT_DISK_FULL_AT_STEP";
    pub const SLOW_STEP_VAR: &'static str = "MEDDPM_FAULT_SLOW_STEP_MS";

    /// The faults named by the environment (unset variables inject nothing).
    pub fn from_env() -> Result<Faults> {
        let var = |k: &str| -> Result<Option<u64>> {
            match std::env::var(k) {
                Err(_) => Ok(None),
                Ok(v) => {
                    v.trim().parse().map(Some).map_err(|_| Error::Config(format!("{k}={v:?}: expected a whole number")))
                }
            }
        };
        Ok(Faults {
            nan_at_step: var(Self::NAN_VAR)?,
            disk_full_at_step: var(Self::DISK_FULL_VAR)?,
            slow_step_ms: var(Self::SLOW_STEP_VAR)?,
        })
    }

    pub fn any(&self) -> bool {
        *self != Faults::default()
    }

    /// The armed faults in words, e.g. "NaN image batch at step 5, full disk at the checkpoint
    /// of step 4".
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(s) = self.nan_at_step {
            parts.push(format!("NaN image batch at step {s} ({})", Self::NAN_VAR));
        }
        if let Some(s) = self.disk_full_at_step {
            parts.push(format!("full disk at the checkpoint of step {s} ({})", Self::DISK_FULL_VAR));
        }
        if let Some(ms) = self.slow_step_ms {
            parts.push(format!("every batch fetch {ms} ms slower ({})", Self::SLOW_STEP_VAR));
        }
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join(", ")
        }
    }
}

/// How a [`Session::run`] ended (errors aside).
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// The step target was reached; the final checkpoint is written.
    Finished,
    /// A stop was requested; the checkpoint of the step reached is written.
    Stopped,
    /// The loss or the weights became non-finite at `step`; the last good checkpoint is kept.
    Diverged { step: u64, reason: String },
}

/// What a run did.
#[derive(Clone, Debug)]
pub struct Summary {
    pub outcome: Outcome,
    /// Optimizer steps before and after.
    pub start: u64,
    pub end: u64,
    /// The losses of this session's steps.
    pub losses: Vec<f32>,
    /// Step of the checkpoint now on disk (None: none was ever written).
    pub saved_step: Option<u64>,
    /// The per-step agreements of data-parallel ranks (all zero alone).
    pub sync: SyncCounts,
}

impl Summary {
    /// Optimizer steps this session took.
    pub fn steps(&self) -> u64 {
        self.end - self.start
    }

    /// Mean loss of this session's first `n` and of its last `n` steps (fewer when it took fewer;
    /// NaN when it took none): the "first → last" of the end-of-run report.
    pub fn loss_means(&self, n: usize) -> (f32, f32) {
        let mean = |v: &[f32]| if v.is_empty() { f32::NAN } else { v.iter().sum::<f32>() / v.len() as f32 };
        let l = &self.losses;
        (mean(&l[..l.len().min(n)]), mean(&l[l.len().saturating_sub(n)..]))
    }
}

/// A run folder being trained.
pub struct Session<'a> {
    /// The run folder (checkpoint, loss log).
    pub dir: PathBuf,
    /// Written into every checkpoint; its `steps` and `checkpoint_every` drive the loop.
    pub record: RunRecord,
    pub log: LossLog,
    pub stop: &'a StopFlag,
    pub faults: Faults,
    /// Step of the checkpoint already in `dir` for this run (a resume), if any.
    pub saved_step: Option<u64>,
}

/// A data-parallel rank's part in [`Session::run_ranked`] (see the module doc).
pub struct Ranks<'s, B: Backend> {
    /// The collective the ranks average gradients and agree through.
    pub sync: &'s mut dyn GradSync<B>,
    /// Compare the weights of all ranks by hash every N optimizer steps (0: only at the end).
    pub check_every: u64,
    /// When each step's loss and stop request are read (deferred by default).
    pub agreement: Agreement,
}

impl<B: Backend> Ranks<'_, B> {
    fn lead(&self) -> bool {
        self.sync.rank() == 0
    }

    /// Rank 0's `v` on every rank.
    fn lead_value(&mut self, be: &B, v: u64) -> Result<u64> {
        Ok(self.sync.all_gather_u64(be, v)?[0])
    }
}

/// A writer that fails with "no space left on device" after `left` bytes.
struct FullDisk<'f> {
    f: &'f mut std::fs::File,
    left: usize,
}

impl Write for FullDisk<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.left == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::StorageFull, "no space left on device (injected)"));
        }
        let n = buf.len().min(self.left);
        self.left -= n;
        self.f.write(&buf[..n])
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.f.flush()
    }
}

impl Session<'_> {
    pub fn checkpoint_path(&self) -> PathBuf {
        self.dir.join(CHECKPOINT)
    }

    fn kept(&self) -> String {
        match self.saved_step {
            Some(s) => format!("the previous checkpoint (step {s}) is intact"),
            None => "no checkpoint had been written yet".into(),
        }
    }

    /// Write the checkpoint then the loss log. `Ok(Some(reason))`: the weights are not finite,
    /// nothing was written.
    fn save<B: Backend>(&mut self, be: &B, tr: &Trainer<B>) -> Result<Option<String>> {
        let path = self.checkpoint_path();
        let bytes = match trainer_bytes(be, tr, &[(META_KEY, self.record.to_json())]) {
            Ok(b) => b,
            Err(Error::NonFinite(m)) => return Ok(Some(format!("the weights are not finite ({m})"))),
            Err(e) => return Err(e),
        };
        let written = if self.faults.disk_full_at_step == Some(tr.step) {
            write_atomic_with(&path, |f| FullDisk { f, left: bytes.len() / 2 }.write_all(&bytes))
        } else {
            write_atomic_with(&path, |f| f.write_all(&bytes))
        };
        written.map_err(|e| self.not_written(e, &format!("checkpoint of step {}", tr.step)))?;
        self.saved_step = Some(tr.step);
        self.stop.saved(tr.step, &path);
        self.flush_log()?;
        Ok(None)
    }

    fn not_written(&self, e: Error, what: &str) -> Error {
        match e {
            Error::Io { path, err } => Error::NotWritten { path, err, kept: format!("{what} lost; {}", self.kept()) },
            e => e,
        }
    }

    fn flush_log(&self) -> Result<()> {
        self.log.flush().map_err(|e| match e {
            Error::Io { path, err } => Error::NotWritten {
                path,
                err,
                kept: format!(
                    "the checkpoint (step {}) was written",
                    self.saved_step.map(|s| s.to_string()).unwrap_or("none".into())
                ),
            },
            e => e,
        })
    }

    /// Write the checkpoint on rank 0 (every process when alone), and tell every rank how it
    /// went so that all of them take the same next step. `Ok(Some(reason))`: the weights are not
    /// finite, nothing was written.
    fn save_agreed<B: Backend>(
        &mut self,
        be: &B,
        tr: &Trainer<B>,
        ranks: &mut Option<Ranks<'_, B>>,
    ) -> Result<Option<String>> {
        let Some(r) = ranks else { return self.save(be, tr) };
        let mine = if r.lead() { self.save(be, tr) } else { Ok(None) };
        let code = match &mine {
            Ok(None) => 0,
            Ok(Some(_)) => 1,
            Err(_) => 2,
        };
        match (mine, r.lead_value(be, code)?) {
            (Err(e), _) => Err(e),
            (Ok(x), 0) => {
                self.saved_step = Some(tr.step);
                Ok(x)
            }
            (Ok(Some(reason)), _) => Ok(Some(reason)),
            (Ok(None), 1) => Ok(Some("the weights are not finite (rank 0 found them so)".into())),
            (Ok(None), _) => Err(Error::Dist(format!(
                "rank 0 could not write the checkpoint of step {} (its error says why); stopping with it",
                tr.step
            ))),
        }
    }

    /// Train `tr` until the record's step target, a stop request or a divergence; `next`
    /// supplies (image, cond) batches, `on_step(step, loss)` is called after each step.
    pub fn run<B: Backend>(
        &mut self,
        be: &B,
        tr: &mut Trainer<B>,
        next: impl FnMut() -> Result<(Vec<f32>, Vec<f32>)>,
        on_step: impl FnMut(u64, f32),
    ) -> Result<Summary> {
        self.run_ranked(be, tr, None, next, on_step)
    }

    /// [`Session::run`] as one data-parallel rank of `ranks` (see the module doc), or alone with
    /// `None`. Every rank must call it with the same record, trainer state and step target; only
    /// rank 0 writes into `dir`. `next` supplies this rank's batches (its shard of the global
    /// sample stream); the losses of the summary and of `on_step` are the global-batch means.
    pub fn run_ranked<B: Backend>(
        &mut self,
        be: &B,
        tr: &mut Trainer<B>,
        ranks: Option<Ranks<'_, B>>,
        next: impl FnMut() -> Result<(Vec<f32>, Vec<f32>)>,
        mut on_step: impl FnMut(u64, f32),
    ) -> Result<Summary> {
        self.run_watched(be, tr, ranks, next, |_, step, loss| {
            on_step(step, loss);
            Ok(())
        })
    }

    /// [`Session::run_ranked`] whose `on_step(trainer, step, loss)` sees the trainer after each
    /// step (before that step's checkpoint) and may fail, ending the run with its error: how
    /// `train_run` takes previews from the EMA weights. It must leave the training state as it
    /// found it.
    pub fn run_watched<B: Backend>(
        &mut self,
        be: &B,
        tr: &mut Trainer<B>,
        mut ranks: Option<Ranks<'_, B>>,
        mut next: impl FnMut() -> Result<(Vec<f32>, Vec<f32>)>,
        mut on_step: impl FnMut(&mut Trainer<B>, u64, f32) -> Result<()>,
    ) -> Result<Summary> {
        let start = tr.step;
        let lead = ranks.as_ref().is_none_or(Ranks::lead);
        if let Some(r) = &mut ranks {
            tr.set_rank(r.sync.rank(), r.sync.world())?;
            broadcast_state(r.sync, be, tr)?;
        }
        if let (true, Some(s)) = (lead, self.saved_step) {
            self.stop.saved(s, &self.checkpoint_path());
        }
        // A temp file left by an aborted write is garbage (the checkpoint beside it is whole).
        if lead {
            let _ = std::fs::remove_file(self.dir.join(format!("{CHECKPOINT}.tmp")));
        }
        let mut losses = Vec::new();
        let plan = StepPlan::new(&self.record, tr);
        // with ranks: the stop all of them agreed on, and the agreements in flight
        let mut agreed_stop = false;
        let mut agree = StepAgreement::new(ranks.as_ref().map_or(Agreement::Immediate, |r| r.agreement));
        // batches fetched so far in this session (the plan gives each one's step)
        let mut fetched = 0u64;
        let mut outcome = loop {
            if plan.reached(tr.step) {
                break Outcome::Finished;
            }
            if agreed_stop || (ranks.is_none() && self.stop.requested()) {
                break Outcome::Stopped;
            }
            let batches = || {
                let (mut img, cond) = next()?;
                let step = plan.batch_step(fetched);
                fetched += 1;
                if self.faults.nan_at_step == Some(step) {
                    img.fill(f32::NAN);
                }
                if let Some(ms) = self.faults.slow_step_ms {
                    std::thread::sleep(std::time::Duration::from_millis(ms));
                }
                Ok((img, cond))
            };
            // the steps whose losses are now known (with ranks and deferred agreement: the
            // previous one, and this one when it writes a checkpoint or ends the run)
            let known = match &mut ranks {
                None => {
                    let loss = tr.train_step(be, batches)?;
                    vec![Agreed { step: tr.step, loss, stop: false }]
                }
                Some(r) => {
                    let own = tr.train_step_synced(be, batches, r.sync)?;
                    let now = plan.checkpoint_due(tr.step) || plan.reached(tr.step);
                    let known = agree.after_step(r.sync, be, tr.step, own, self.stop.requested(), now)?;
                    if on_interval(tr.step, r.check_every) {
                        check_weights(r.sync, be, tr)?;
                    }
                    known
                }
            };
            let mut diverged = None;
            for a in known {
                losses.push(a.loss);
                self.log.push(a.step, a.loss);
                on_step(tr, a.step, a.loss)?;
                agreed_stop |= a.stop;
                if !a.loss.is_finite() {
                    diverged = Some(Outcome::Diverged { step: a.step, reason: format!("the loss is {}", a.loss) });
                    break;
                }
            }
            if let Some(d) = diverged {
                break d;
            }
            debug_assert!(!agree.in_flight() || !plan.checkpoint_due(tr.step));
            if plan.checkpoint_due(tr.step) {
                if let Some(reason) = self.save_agreed(be, tr, &mut ranks)? {
                    break Outcome::Diverged { step: tr.step, reason };
                }
            }
        };
        if !matches!(outcome, Outcome::Diverged { .. }) {
            if let Some(r) = &mut ranks {
                check_weights(r.sync, be, tr)?;
            }
        }
        // whether the end needs a checkpoint: rank 0's view (only it sees the file for sure)
        let mut missing = self.saved_step != Some(tr.step) || !(lead && self.checkpoint_path().is_file());
        if let Some(r) = &mut ranks {
            missing = r.lead_value(be, missing as u64)? != 0;
        }
        match outcome {
            Outcome::Diverged { .. } if lead => self.flush_log()?,
            Outcome::Diverged { .. } => {}
            _ if missing => {
                if let Some(reason) = self.save_agreed(be, tr, &mut ranks)? {
                    if lead {
                        self.flush_log()?;
                    }
                    outcome = Outcome::Diverged { step: tr.step, reason };
                }
            }
            _ => {}
        }
        Ok(Summary { outcome, start, end: tr.step, losses, saved_step: self.saved_step, sync: agree.counts })
    }
}
