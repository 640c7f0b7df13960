//! The bookkeeping around a training session, apart from the optimizer step itself: the
//! decisions that the loop ([`Session::run_ranked`](super::Session::run_ranked)) and `meddpm
//! train` take, in one place that tests check without a trainer.
//!
//! - [`StepPlan`]: when the loop has reached its step target, which optimizer steps end with a
//!   checkpoint, which step a fetched batch belongs to (gradient accumulation, a batch staged
//!   before the session began) and how many steps the session has left (the progress bar's
//!   length); [`on_interval`] picks every N-th step (checkpoints, the ranks' weight checks).
//! - [`Continuation`]: what a run continues from — the loss log it appends to (a resume drops the
//!   rows past its checkpoint, they are redone, and writes the log into the run folder), the
//!   checkpoint step already on disk for this run, the data changes since the checkpoint, and the
//!   note when a new run replaces another run's checkpoint. Only the process that writes the run
//!   folder (rank 0, or the only process) reads or rewrites files here; notes are returned for
//!   the caller to print.

use super::fingerprint::{DataChanges, PairPrint};
use super::losslog::{self, LossLog};
use super::record::{absolute, run_dir, RunRecord, CHECKPOINT};
use crate::backend::Backend;
use crate::checkpoint::Checkpoint;
use crate::diffusion::Trainer;
use crate::error::Result;
use std::path::Path;

/// Whether `step` is one of every `every`-th optimizer step (0: none is).
pub fn on_interval(step: u64, every: u64) -> bool {
    every > 0 && step.is_multiple_of(every)
}

/// When a session's loop stops and checkpoints, and the optimizer step of each fetched batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepPlan {
    /// The trainer's optimizer step when the session began.
    pub start: u64,
    /// The optimizer step the run trains to (the run record's `steps`).
    pub target: u64,
    /// A checkpoint every N optimizer steps (0: only at the end, which always has one).
    pub checkpoint_every: u64,
    /// Micro-steps (batches) per optimizer step.
    pub grad_accum: u64,
    /// Whether the trainer held a staged batch when the session began (it is the first step's).
    pub staged_at_start: bool,
}

impl StepPlan {
    /// The plan of a session that trains `trainer` as `record` says, from the trainer's step.
    pub fn new<B: Backend>(record: &RunRecord, trainer: &Trainer<B>) -> StepPlan {
        StepPlan {
            start: trainer.step,
            target: record.steps,
            checkpoint_every: record.checkpoint_every,
            grad_accum: trainer.tc.grad_accum as u64,
            staged_at_start: trainer.is_staged(),
        }
    }

    /// Whether a trainer at optimizer step `step` has reached the target (nothing left to train).
    pub fn reached(&self, step: u64) -> bool {
        step >= self.target
    }

    /// Whether optimizer step `step` ends with a checkpoint.
    pub fn checkpoint_due(&self, step: u64) -> bool {
        on_interval(step, self.checkpoint_every)
    }

    /// Optimizer steps from the start to the target (0 when the start is past it).
    pub fn steps_left(&self) -> u64 {
        self.target.saturating_sub(self.start)
    }

    /// The optimizer step of the batch fetched after `fetched_before` others in this session.
    /// The trainer fetches one batch ahead (it stages the next while the current one runs), so a
    /// batch's step follows from how many came before it (a staged batch counts as one).
    pub fn batch_step(&self, fetched_before: u64) -> u64 {
        self.start + 1 + (fetched_before + self.staged_at_start as u64) / self.grad_accum.max(1)
    }
}

/// What a run continues from (see the module doc).
#[derive(Clone, Copy, Debug)]
pub struct Continuation<'a> {
    /// The run folder, absolute (the run record's `out`).
    pub dir: &'a Path,
    /// The checkpoint a resume read, with its run record (None: a checkpoint written before
    /// meddpm recorded runs); None for a new run.
    pub resumed: Option<(&'a Path, Option<&'a RunRecord>)>,
    /// The trainer's optimizer step (on a resume, the checkpoint's).
    pub step: u64,
    /// Whether this process writes the run folder and speaks to the user (rank 0, or alone).
    pub lead: bool,
}

impl<'a> Continuation<'a> {
    /// The note for a new run into a folder that holds a checkpoint already: this run replaces
    /// it (its step named when the file reads). None on a resume, when there is no checkpoint,
    /// and on ranks other than 0.
    pub fn replaced_note(&self) -> Option<String> {
        let ckpt = self.dir.join(CHECKPOINT);
        if !self.lead || self.resumed.is_some() || !ckpt.is_file() {
            return None;
        }
        let step = Checkpoint::read(&ckpt).map(|c| format!(" (step {})", c.step)).unwrap_or_default();
        Some(format!(
            "{} holds another run's checkpoint{step}; this new run replaces it and its loss log",
            self.dir.display()
        ))
    }

    /// The data prints the resumed checkpoint recorded (files with the same size and
    /// modification time keep their hashes without being read); empty for a new run.
    pub fn known_pairs(&self) -> &'a [PairPrint] {
        match self.resumed {
            Some((_, Some(record))) => &record.pairs,
            _ => &[],
        }
    }

    /// What changed in the data (`pairs`: its prints now) since the resumed checkpoint's record.
    /// None when nothing did, for a new run or a checkpoint without a record, and on ranks
    /// other than 0.
    pub fn data_changes(&self, pairs: &[PairPrint]) -> Option<DataChanges> {
        let Some((_, Some(record))) = self.resumed.filter(|_| self.lead) else { return None };
        Some(DataChanges::between(&record.pairs, pairs)).filter(|c| !c.is_empty())
    }

    /// The loss log the run appends to, and a note when rows were dropped from it. On a resume,
    /// rank 0 opens the log beside the checkpoint, drops the rows past `step` (the file is
    /// rewritten at once) and writes the log into `dir` from now on; a new run, and every other
    /// rank (which never writes it), starts an empty log in `dir`.
    pub fn loss_log(&self) -> Result<(LossLog, Option<String>)> {
        let Some((checkpoint, _)) = self.resumed.filter(|_| self.lead) else {
            return Ok((LossLog::fresh(self.dir), None));
        };
        let (mut log, dropped) = LossLog::open(&run_dir(checkpoint).join(losslog::CSV), self.step)?;
        let note = (dropped > 0).then(|| {
            format!(
                "{dropped} row(s) past step {} dropped from {} (they are redone)",
                self.step,
                log.csv_path().display()
            )
        });
        log.move_to(self.dir);
        Ok((log, note))
    }

    /// The step of the checkpoint already in `dir` for this run: the resumed one's when it lies
    /// in `dir` (not when the run moved to another folder with `--out`); None for a new run.
    pub fn saved_step(&self) -> Option<u64> {
        let (checkpoint, _) = self.resumed?;
        (absolute(&run_dir(checkpoint)).ok().as_deref() == Some(self.dir)).then_some(self.step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::save_trainer;
    use crate::cpu::CpuBackend;
    use crate::diffusion::TrainConfig;
    use crate::model::UNetConfig;
    use crate::run::fingerprint::FilePrint;
    use crate::run::DataSource;
    use crate::{Layout, Precision};
    use std::path::PathBuf;

    /// A fresh, absolute (symbolic links resolved) scratch folder.
    fn scratch(name: &str) -> PathBuf {
        crate::testing::scratch_dir(&format!("bookkeeping-{name}"))
    }

    fn plan(start: u64, target: u64, checkpoint_every: u64, grad_accum: u64, staged_at_start: bool) -> StepPlan {
        StepPlan { start, target, checkpoint_every, grad_accum, staged_at_start }
    }

    fn record(dir: &Path, steps: u64, checkpoint_every: u64, pairs: Vec<PairPrint>) -> RunRecord {
        RunRecord {
            out: dir.to_path_buf(),
            data: DataSource::Demo,
            convention: "whole-head".into(),
            steps,
            checkpoint_every,
            sample_at_end: false,
            workers: 1,
            precision: Precision::Tf32,
            layout: Layout::Ndhwc,
            pairs,
        }
    }

    fn pair(mask: &str, hash: &str) -> PairPrint {
        let file = |path: &str| FilePrint { path: path.into(), size: 4, mtime_ns: Some(1), hash: hash.into() };
        PairPrint { mask: file(mask), images: vec![file(&format!("{mask}.img"))] }
    }

    fn write_log(csv: &Path, steps: std::ops::RangeInclusive<u64>) {
        let mut log = LossLog::fresh(csv.parent().unwrap());
        for s in steps {
            log.push(s, 0.5);
        }
        log.flush().unwrap();
    }

    fn logged_steps(log: &LossLog) -> Vec<u64> {
        log.rows().iter().map(|r| r.0).collect()
    }

    #[test]
    fn every_nth_step_and_never_for_zero() {
        let hits = |every| (1..=12).filter(|&s| on_interval(s, every)).collect::<Vec<u64>>();
        assert_eq!(hits(4), [4, 8, 12]);
        assert_eq!(hits(1), (1..=12).collect::<Vec<_>>());
        assert!(hits(0).is_empty());
        assert!(on_interval(0, 5), "step 0 is a multiple (the loop never asks: it checks after a step)");
    }

    #[test]
    fn checkpoints_fall_on_the_interval_and_the_loop_stops_at_the_target() {
        let p = plan(0, 10, 3, 1, false);
        assert_eq!((1..=10).filter(|&s| p.checkpoint_due(s)).collect::<Vec<_>>(), [3, 6, 9]);
        assert!(!p.reached(9) && p.reached(10) && p.reached(11));
        // 0: no checkpoint inside the run (the session writes the one at the end)
        assert!((1..=10).all(|s| !plan(0, 10, 0, 1, false).checkpoint_due(s)));
        // the interval counts from step 0, not from a resume's start
        let resumed = plan(4, 10, 3, 1, false);
        assert_eq!((5..=10).filter(|&s| resumed.checkpoint_due(s)).collect::<Vec<_>>(), [6, 9]);
    }

    #[test]
    fn steps_left_count_from_the_start_and_are_zero_past_the_target() {
        assert_eq!(plan(0, 10, 0, 1, false).steps_left(), 10);
        assert_eq!(plan(4, 10, 0, 1, false).steps_left(), 6);
        assert_eq!(plan(10, 10, 0, 1, false).steps_left(), 0);
        assert_eq!(plan(12, 10, 0, 1, false).steps_left(), 0);
    }

    #[test]
    fn a_batch_belongs_to_the_step_its_predecessors_fill() {
        let steps = |p: StepPlan| (0..6).map(|f| p.batch_step(f)).collect::<Vec<_>>();
        assert_eq!(steps(plan(0, 9, 0, 1, false)), [1, 2, 3, 4, 5, 6]);
        assert_eq!(steps(plan(7, 99, 0, 3, false)), [8, 8, 8, 9, 9, 9]);
        // a batch staged before the session is the first step's first micro-step
        assert_eq!(steps(plan(7, 99, 0, 3, true)), [8, 8, 9, 9, 9, 10]);
        assert_eq!(steps(plan(0, 9, 0, 1, true)), [2, 3, 4, 5, 6, 7]);
        // an invalid accumulation of 0 (TrainConfig refuses it) counts as 1 instead of dividing by 0
        assert_eq!(steps(plan(0, 9, 0, 0, false)), [1, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn a_plan_takes_the_record_and_the_trainer() {
        let be = CpuBackend::new();
        let tc = TrainConfig { timesteps: 6, grad_accum: 2, ..TrainConfig::default() };
        let mut tr = Trainer::new(&be, &UNetConfig::tiny(), &tc).unwrap();
        tr.step = 5;
        let p = StepPlan::new(&record(Path::new("/run"), 20, 4, Vec::new()), &tr);
        assert_eq!(p, plan(5, 20, 4, 2, false));
    }

    #[test]
    fn a_new_run_starts_an_empty_log_and_has_no_checkpoint_on_disk() {
        let dir = scratch("new");
        write_log(&dir.join(losslog::CSV), 1..=4);
        let c = Continuation { dir: &dir, resumed: None, step: 0, lead: true };
        let (log, note) = c.loss_log().unwrap();
        assert!(log.rows().is_empty() && note.is_none());
        assert_eq!(log.csv_path(), dir.join(losslog::CSV));
        assert_eq!(c.saved_step(), None);
        assert!(c.known_pairs().is_empty());
        assert_eq!(c.data_changes(&[pair("a", "1")]), None);
        // the old file is only replaced at the first checkpoint
        assert_eq!(std::fs::read_to_string(dir.join(losslog::CSV)).unwrap().lines().count(), 5);
    }

    #[test]
    fn a_resume_drops_the_rows_past_its_step_and_knows_its_checkpoint() {
        let dir = scratch("resume");
        let csv = dir.join(losslog::CSV);
        write_log(&csv, 1..=7);
        let ck = dir.join(CHECKPOINT);
        let c = Continuation { dir: &dir, resumed: Some((&ck, None)), step: 4, lead: true };
        let (log, note) = c.loss_log().unwrap();
        assert_eq!(logged_steps(&log), [1, 2, 3, 4]);
        assert_eq!(note.unwrap(), format!("3 row(s) past step 4 dropped from {} (they are redone)", csv.display()));
        // rewritten at once
        let rows = losslog::parse_csv(&std::fs::read_to_string(&csv).unwrap(), &csv).unwrap();
        assert_eq!(rows.len(), 4);
        assert_eq!(c.saved_step(), Some(4));
        // a second open drops nothing and says nothing
        assert!(c.loss_log().unwrap().1.is_none());
    }

    #[test]
    fn a_resume_into_another_folder_carries_the_log_there_and_has_no_checkpoint_there_yet() {
        let (old, new) = (scratch("moved-old"), scratch("moved-new"));
        write_log(&old.join(losslog::CSV), 1..=3);
        let ck = old.join(CHECKPOINT);
        let c = Continuation { dir: &new, resumed: Some((&ck, None)), step: 3, lead: true };
        let (log, note) = c.loss_log().unwrap();
        assert!(note.is_none());
        assert_eq!(logged_steps(&log), [1, 2, 3]);
        assert_eq!(log.csv_path(), new.join(losslog::CSV));
        assert_eq!(c.saved_step(), None);
    }

    #[test]
    fn other_ranks_neither_read_nor_rewrite_the_log_nor_report() {
        let dir = scratch("rank1");
        let csv = dir.join(losslog::CSV);
        write_log(&csv, 1..=6);
        let ck = dir.join(CHECKPOINT);
        let old = record(&dir, 10, 2, vec![pair("a", "1")]);
        let c = Continuation { dir: &dir, resumed: Some((&ck, Some(&old))), step: 2, lead: false };
        let (log, note) = c.loss_log().unwrap();
        assert!(log.rows().is_empty() && note.is_none());
        assert_eq!(std::fs::read_to_string(&csv).unwrap().lines().count(), 7, "rank 0's file is untouched");
        assert_eq!(c.data_changes(&[pair("a", "2")]), None);
        // every rank knows the step on disk and the recorded prints (they all run the same loop)
        assert_eq!(c.saved_step(), Some(2));
        assert_eq!(c.known_pairs(), old.pairs.as_slice());
    }

    #[test]
    fn data_changes_since_the_record_are_reported_only_when_there_are_some() {
        let dir = scratch("changes");
        let ck = dir.join(CHECKPOINT);
        let old = record(&dir, 10, 2, vec![pair("a", "1"), pair("b", "1")]);
        let c = Continuation { dir: &dir, resumed: Some((&ck, Some(&old))), step: 2, lead: true };
        assert_eq!(c.data_changes(&old.pairs), None);
        let changes = c.data_changes(&[pair("a", "2"), pair("c", "1")]).unwrap();
        assert_eq!(changes.added, ["c"]);
        assert_eq!(changes.missing, ["b"]);
        assert_eq!(changes.different.len(), 1);
        // a checkpoint without a record has nothing to compare with
        let bare = Continuation { resumed: Some((&ck, None)), ..c };
        assert_eq!(bare.data_changes(&[pair("c", "1")]), None);
        assert!(bare.known_pairs().is_empty());
    }

    #[test]
    fn a_new_run_over_another_runs_checkpoint_says_it_replaces_it() {
        let dir = scratch("replace");
        let c = Continuation { dir: &dir, resumed: None, step: 0, lead: true };
        assert_eq!(c.replaced_note(), None, "an empty folder");
        let ck = dir.join(CHECKPOINT);
        std::fs::write(&ck, b"not a checkpoint").unwrap();
        let tail = "holds another run's checkpoint; this new run replaces it and its loss log";
        assert_eq!(c.replaced_note().unwrap(), format!("{} {tail}", dir.display()), "unreadable: no step");
        let be = CpuBackend::new();
        let mut tr =
            Trainer::new(&be, &UNetConfig::tiny(), &TrainConfig { timesteps: 6, ..TrainConfig::default() }).unwrap();
        tr.step = 3;
        save_trainer(&ck, &be, &tr).unwrap();
        assert_eq!(
            c.replaced_note().unwrap(),
            format!(
                "{} holds another run's checkpoint (step 3); this new run replaces it and its loss log",
                dir.display()
            )
        );
        // a resume continues that checkpoint, and other ranks do not speak
        assert_eq!(Continuation { resumed: Some((&ck, None)), step: 3, ..c }.replaced_note(), None);
        assert_eq!(Continuation { lead: false, ..c }.replaced_note(), None);
    }
}
