//! The per-step agreement of data-parallel ranks: every rank's loss and stop request, gathered
//! so that all of them log the same global-batch loss and stop (or diverge) after the same
//! optimizer step.
//!
//! [`Agreement::Immediate`] gathers step s's values and waits for them before step s+1 is
//! launched: one blocking host wait per step, on the critical path. [`Agreement::Deferred`] (the
//! default) starts the gather of step s and reads it only after step s+1 was launched, so the
//! host never waits for it while the device could be working. Both are decided from the gathered
//! values alone, identical on every rank, so a stop or a NaN still ends every rank after the same
//! optimizer step: deferred, a stop asked during step s lands one step later than immediate, and
//! a NaN loss at step s is reported as step s (its weights are never written: the steps that
//! write a checkpoint, and the last step, read their own gather at once).
//!
//! [`SyncCounts`] counts the agreements and the blocking waits among them (a wait for step s's
//! values before step s+1 was launched); tests and `bench` read it.

use super::sync::{Gather, GradSync};
use crate::backend::Backend;
use crate::error::Result;

/// When the ranks read a step's agreement (see the module doc).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Agreement {
    /// Read at once after each step: one blocking host wait per step.
    Immediate,
    /// Read after the next step was launched (checkpoint and last steps at once).
    #[default]
    Deferred,
}

/// Agreements made in a session, and how many of them the host waited for before launching the
/// next step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncCounts {
    /// Steps agreed on.
    pub agreements: u64,
    /// Of those, read before the next step was launched.
    pub blocking_waits: u64,
    /// Of those, read after the next step was launched.
    pub deferred_reads: u64,
}

/// A step's values as one `u64`: the loss's bits, and the stop request in bit 32.
pub fn pack(loss: f32, stop: bool) -> u64 {
    loss.to_bits() as u64 | (stop as u64) << 32
}

/// The gathered values of a step: the mean loss over the global batch (summed in rank order, the
/// same bits on every rank) and whether any rank asked to stop.
pub fn unpack(all: &[u64]) -> (f32, bool) {
    let sum = all.iter().map(|&v| f32::from_bits(v as u32)).sum::<f32>();
    (sum / all.len().max(1) as f32, all.iter().any(|&v| v >> 32 != 0))
}

/// One step's agreement in flight.
pub struct Pending {
    pub step: u64,
    gather: Gather,
}

/// What the ranks agreed on for one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Agreed {
    pub step: u64,
    /// Mean loss over the global batch.
    pub loss: f32,
    /// Some rank asked to stop.
    pub stop: bool,
}

/// The agreement state of a rank through a session.
#[derive(Default)]
pub struct StepAgreement {
    pub mode: Agreement,
    pub counts: SyncCounts,
    pending: Option<Pending>,
}

impl StepAgreement {
    pub fn new(mode: Agreement) -> Self {
        StepAgreement { mode, ..StepAgreement::default() }
    }

    /// Step `step` just ran on this rank, with its own `loss` and stop request. Returns the
    /// agreements now known, oldest first: deferred, the previous step's (read now that this one
    /// was launched); immediate, or when `now` (a checkpoint or the last step), this step's too.
    pub fn after_step<B: Backend>(
        &mut self,
        sync: &mut dyn GradSync<B>,
        be: &B,
        step: u64,
        loss: f32,
        stop: bool,
        now: bool,
    ) -> Result<Vec<Agreed>> {
        let mut known = Vec::new();
        if let Some(p) = self.pending.take() {
            known.push(self.read(sync, be, p)?);
            self.counts.deferred_reads += 1;
        }
        // a previous step that ends the run: this one is read at once, so that every rank stops
        // with both logged (all ranks see the same values, so all take this branch)
        let ending = known.iter().any(|a| a.stop || !a.loss.is_finite());
        let started = Pending { step, gather: sync.start_gather_u64(be, pack(loss, stop))? };
        self.counts.agreements += 1;
        if self.mode == Agreement::Immediate || now || ending {
            known.push(self.read(sync, be, started)?);
            self.counts.blocking_waits += 1;
        } else {
            self.pending = Some(started);
        }
        Ok(known)
    }

    /// Whether a step's agreement is still to be read.
    pub fn in_flight(&self) -> bool {
        self.pending.is_some()
    }

    fn read<B: Backend>(&mut self, sync: &mut dyn GradSync<B>, be: &B, p: Pending) -> Result<Agreed> {
        let (loss, stop) = unpack(&sync.wait_gather_u64(be, p.gather)?);
        Ok(Agreed { step: p.step, loss, stop })
    }
}
