//! Gradient synchronisation between data-parallel ranks, as a trait the [`Trainer`] calls, and
//! the checks that keep ranks honest.
//!
//! [`GradSync`] is what a collective backend provides: average a bucket of gradient buffers over
//! the ranks, broadcast buffers from rank 0, gather one `u64` from every rank. The Trainer drives
//! it (see `Trainer::train_step_synced`): on the last micro-step of an optimizer step it reports
//! each layer whose backward is done ([`GradSync::layer_done`]; a backend may start the buckets
//! that became ready, overlapping the rest of backward), then [`GradSync::finish`] before Adam.
//!
//! Implementations: [`Solo`] (one rank, does nothing), [`ThreadSync`] (ranks as threads of one
//! process, sums through shared memory, any backend: CI's stand-in for NCCL), and the NCCL one
//! in the CUDA crate (`meddpm_cuda::collective::NcclSync`).
//!
//! Averages, not sums: each rank scales its loss by 1/(grad_accum · batch · world) — the reference
//! divides by the batch, and the batch of a step is the global one, W·batch — and the collective
//! averages over the W ranks. With the mean loss over a rank's own batch this gives every sample
//! the weight 1/(grad_accum · (W·batch)²) that one process with batch W·batch gives it, so W ranks
//! × batch b equal one rank × batch W·b (docs/multigpu.md derives it).
//!
//! [`Trainer`]: crate::diffusion::Trainer

use super::buckets::{BucketCursor, BucketPlan};
use crate::backend::Backend;
use crate::error::{Error, Result};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Averaging gradients and comparing state across data-parallel ranks.
pub trait GradSync<B: Backend> {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Layer `layer` of `UNet::layers` finished its backward on the micro-step whose gradients
    /// are averaged (`buckets::BACKWARD_DONE`: all of it). Buckets that became ready may start.
    /// Errors are kept and returned by [`GradSync::finish`].
    fn layer_done(&mut self, _be: &B, _layer: usize, _grads: &mut [B::Buf]) {}
    /// Every gradient buffer holds the average over ranks (starting what is not started yet).
    fn finish(&mut self, be: &B, grads: &mut [B::Buf]) -> Result<()>;
    /// Overwrite `bufs` on every rank with rank 0's.
    fn broadcast(&mut self, be: &B, bufs: &mut [B::Buf]) -> Result<()>;
    /// Every rank's `v`, in rank order.
    fn all_gather_u64(&mut self, be: &B, v: u64) -> Result<Vec<u64>>;

    /// Start gathering every rank's `v` without waiting for the others; the result is read by
    /// [`GradSync::wait_gather_u64`] with the returned ticket, later (after the next step was
    /// launched). At most one gather is in flight; other collectives may run in between. The
    /// default gathers at once (a backend that cannot defer still gives the right answer).
    fn start_gather_u64(&mut self, be: &B, v: u64) -> Result<Gather> {
        self.all_gather_u64(be, v).map(|all| Gather { ready: Some(all) })
    }
    /// The result of the gather `t` started.
    fn wait_gather_u64(&mut self, _be: &B, t: Gather) -> Result<Vec<u64>> {
        t.ready.ok_or_else(|| Error::Dist(format!("rank {}: a deferred gather was never started", self.rank())))
    }

    /// Average every bucket but the one backward finishes last, so that Adam can run on those
    /// parameters while the last bucket is still being averaged; returns the parameter indices of
    /// that held-back bucket (contiguous), which [`GradSync::finish`] then completes. `None`:
    /// everything was finished here (the default), Adam runs once on all parameters.
    fn finish_early(&mut self, be: &B, grads: &mut [B::Buf]) -> Result<Option<std::ops::Range<usize>>> {
        self.finish(be, grads).map(|()| None)
    }
}

/// A gather started by [`GradSync::start_gather_u64`]: its result when the backend already has
/// it (the default, and [`Solo`]), else empty until `wait_gather_u64` reads it.
#[derive(Debug)]
pub struct Gather {
    pub ready: Option<Vec<u64>>,
}

/// The parameter indices of `params` as one range, when they are contiguous (the last bucket of
/// the U-Net's plan is: the time embedding and the first input blocks).
pub fn as_range(params: &[usize]) -> Option<std::ops::Range<usize>> {
    let (lo, hi) = (*params.iter().min()?, *params.iter().max()?);
    (hi + 1 - lo == params.len()).then_some(lo..hi + 1)
}

/// One rank: nothing to average.
#[derive(Clone, Copy, Debug, Default)]
pub struct Solo;

impl<B: Backend> GradSync<B> for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn finish(&mut self, _: &B, _: &mut [B::Buf]) -> Result<()> {
        Ok(())
    }
    fn broadcast(&mut self, _: &B, _: &mut [B::Buf]) -> Result<()> {
        Ok(())
    }
    fn all_gather_u64(&mut self, _: &B, v: u64) -> Result<Vec<u64>> {
        Ok(vec![v])
    }
}

/// FNV-1a (64-bit) over `bytes`, continuing from `h` (start with [`FNV_OFFSET`]). Stable across
/// processes and builds, which the config hash of the rendezvous needs.
pub fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// Hash of a configuration every rank must share (its JSON form: field order is fixed by the
/// struct, so equal values give equal hashes on every machine).
pub fn config_hash<T: serde::Serialize>(v: &T) -> u64 {
    fnv1a(FNV_OFFSET, serde_json::to_string(v).expect("configs serialise").as_bytes())
}

/// A cheap hash of the exact bits of `bufs` (raw element order): one multiply per element.
pub fn buffers_hash<B: Backend>(be: &B, bufs: &[B::Buf]) -> u64 {
    let mut h = FNV_OFFSET;
    let mut host = Vec::new();
    for b in bufs {
        host.resize(be.len(b), 0f32);
        be.download(b, &mut host);
        h = (h ^ host.len() as u64).wrapping_mul(0x0000_0100_0000_01b3);
        for x in &host {
            h = (h ^ x.to_bits() as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Compare a hash across ranks: every rank gets the same error, naming the ranks that differ
/// from rank 0, when they are not all equal.
pub fn check_same<B: Backend>(sync: &mut dyn GradSync<B>, be: &B, what: &str, h: u64) -> Result<()> {
    let all = sync.all_gather_u64(be, h)?;
    let differ: Vec<String> =
        all.iter().enumerate().filter(|(_, &x)| x != all[0]).map(|(r, x)| format!("rank {r} {x:016x}")).collect();
    if differ.is_empty() {
        return Ok(());
    }
    Err(Error::Dist(format!(
        "{what} diverged across ranks (rank 0 {:016x}; {}): the ranks no longer train the same model; stopping",
        all[0],
        differ.join(", ")
    )))
}

/// An in-process barrier that gives up: after `timeout`, or at once when a rank has left (its
/// [`ThreadSync`] was dropped, e.g. its thread panicked), instead of waiting forever.
struct Meet {
    world: usize,
    timeout: Duration,
    state: Mutex<MeetState>,
    cv: Condvar,
}

struct MeetState {
    arrived: usize,
    generation: u64,
    left: Option<usize>,
    /// One host copy of each rank's bucket (or gathered value), and the reduced result.
    slots: Vec<Vec<f32>>,
    gathered: Vec<u64>,
}

impl Meet {
    fn wait(&self, rank: usize) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = st.left {
            return Err(Error::Dist(format!("rank {rank}: rank {r} left the group")));
        }
        let gen = st.generation;
        st.arrived += 1;
        if st.arrived == self.world {
            st.arrived = 0;
            st.generation += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let (st, t) = self
            .cv
            .wait_timeout_while(st, self.timeout, |s| s.generation == gen && s.left.is_none())
            .unwrap_or_else(|e| e.into_inner());
        if st.generation != gen {
            return Ok(());
        }
        if let Some(r) = st.left {
            return Err(Error::Dist(format!("rank {rank}: rank {r} left the group")));
        }
        debug_assert!(t.timed_out());
        Err(Error::Dist(format!(
            "rank {rank}: the other ranks did not reach the collective within {:.0} s",
            self.timeout.as_secs_f64()
        )))
    }
}

/// Ranks as threads of one process ([`ThreadSync::group`]): every collective meets at a barrier
/// and reduces through host copies in shared memory, in rank order, so every rank gets the same
/// bits. Works with any backend (through `download`/`upload`); slow, for tests and CI.
pub struct ThreadSync {
    rank: usize,
    meet: Arc<Meet>,
    plan: BucketPlan,
    cursor: BucketCursor,
    host: Vec<f32>,
    error: Option<Error>,
    /// Buckets started from `layer_done` (during backward) since construction.
    pub started_in_backward: usize,
    /// Buckets started from `finish`.
    pub started_at_finish: usize,
    /// Hold the last bucket back in [`GradSync::finish_early`] (Adam runs on the others first).
    pub overlap_last: bool,
    /// Optimizer steps whose last bucket was held back.
    pub held_back: usize,
}

impl ThreadSync {
    /// `world` handles, one per rank thread, bucketing gradients by `plan`. A collective that
    /// does not complete within `timeout` fails on the ranks that reached it.
    pub fn group(world: usize, plan: &BucketPlan, timeout: Duration) -> Vec<ThreadSync> {
        let meet = Arc::new(Meet {
            world,
            timeout,
            state: Mutex::new(MeetState {
                arrived: 0,
                generation: 0,
                left: None,
                slots: vec![Vec::new(); world],
                gathered: vec![0; world],
            }),
            cv: Condvar::new(),
        });
        (0..world)
            .map(|rank| ThreadSync {
                rank,
                meet: meet.clone(),
                plan: plan.clone(),
                cursor: BucketCursor::new(plan),
                host: Vec::new(),
                error: None,
                started_in_backward: 0,
                started_at_finish: 0,
                overlap_last: true,
                held_back: 0,
            })
            .collect()
    }

    /// Sum `self.host` over ranks (rank order), times 1/world, into `self.host` on every rank.
    fn all_reduce_host(&mut self) -> Result<()> {
        let w = self.meet.world;
        {
            let mut st = self.meet.state.lock().unwrap_or_else(|e| e.into_inner());
            st.slots[self.rank] = std::mem::take(&mut self.host);
        }
        self.meet.wait(self.rank)?;
        {
            let st = self.meet.state.lock().unwrap_or_else(|e| e.into_inner());
            let n = st.slots[self.rank].len();
            if let Some((r, s)) = st.slots.iter().enumerate().find(|(_, s)| s.len() != n) {
                return Err(Error::Dist(format!(
                    "rank {}: rank {r} reduces {} elements, this rank {n}: the ranks' models differ",
                    self.rank,
                    s.len()
                )));
            }
            let mut acc = st.slots[0].clone();
            for s in &st.slots[1..] {
                for (a, &x) in acc.iter_mut().zip(s) {
                    *a += x;
                }
            }
            let inv = 1.0 / w as f32;
            acc.iter_mut().for_each(|a| *a *= inv);
            self.host = acc;
        }
        // nobody overwrites a slot before every rank has read them all
        self.meet.wait(self.rank)
    }

    fn reduce_bucket<B: Backend>(&mut self, be: &B, k: usize, grads: &mut [B::Buf]) -> Result<()> {
        let params = self.plan.buckets[k].params.clone();
        self.host.clear();
        let mut tmp = Vec::new();
        for &p in &params {
            tmp.resize(be.len(&grads[p]), 0f32);
            be.download(&grads[p], &mut tmp);
            self.host.extend_from_slice(&tmp);
        }
        self.all_reduce_host()?;
        let mut off = 0;
        for &p in &params {
            let n = be.len(&grads[p]);
            be.upload(&self.host[off..off + n], &mut grads[p]);
            off += n;
        }
        Ok(())
    }
}

impl Drop for ThreadSync {
    fn drop(&mut self) {
        let mut st = self.meet.state.lock().unwrap_or_else(|e| e.into_inner());
        st.left.get_or_insert(self.rank);
        self.meet.cv.notify_all();
    }
}

impl<B: Backend> GradSync<B> for ThreadSync {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.meet.world
    }
    fn layer_done(&mut self, be: &B, layer: usize, grads: &mut [B::Buf]) {
        for k in self.cursor.layer_done(layer) {
            if self.error.is_none() {
                self.started_in_backward += 1;
                if let Err(e) = self.reduce_bucket(be, k, grads) {
                    self.error = Some(e);
                }
            }
        }
    }
    fn finish_early(&mut self, be: &B, grads: &mut [B::Buf]) -> Result<Option<std::ops::Range<usize>>> {
        let last = self.plan.buckets.len().saturating_sub(1);
        let held = match self.plan.buckets.last().and_then(|b| as_range(&b.params)) {
            Some(r) if self.overlap_last && self.plan.buckets.len() > 1 => r,
            _ => return self.finish(be, grads).map(|()| None),
        };
        for k in self.cursor.rest_but(last) {
            if self.error.is_none() {
                self.started_at_finish += 1;
                if let Err(e) = self.reduce_bucket(be, k, grads) {
                    self.error = Some(e);
                }
            }
        }
        match self.error.take() {
            Some(e) => Err(e),
            None => {
                self.held_back += 1;
                Ok(Some(held))
            }
        }
    }
    fn finish(&mut self, be: &B, grads: &mut [B::Buf]) -> Result<()> {
        for k in self.cursor.rest() {
            if self.error.is_none() {
                self.started_at_finish += 1;
                if let Err(e) = self.reduce_bucket(be, k, grads) {
                    self.error = Some(e);
                }
            }
        }
        self.error.take().map_or(Ok(()), Err)
    }
    fn broadcast(&mut self, be: &B, bufs: &mut [B::Buf]) -> Result<()> {
        for b in bufs.iter_mut() {
            let mut host = vec![0f32; be.len(b)];
            be.download(b, &mut host);
            {
                let mut st = self.meet.state.lock().unwrap_or_else(|e| e.into_inner());
                st.slots[self.rank] = host;
            }
            self.meet.wait(self.rank)?;
            let root = {
                let st = self.meet.state.lock().unwrap_or_else(|e| e.into_inner());
                st.slots[0].clone()
            };
            self.meet.wait(self.rank)?;
            if root.len() != be.len(b) {
                return Err(Error::Dist(format!(
                    "broadcast: rank 0 sent {} elements, rank {} expects {}",
                    root.len(),
                    self.rank,
                    be.len(b)
                )));
            }
            be.upload(&root, b);
        }
        Ok(())
    }
    fn all_gather_u64(&mut self, _: &B, v: u64) -> Result<Vec<u64>> {
        {
            let mut st = self.meet.state.lock().unwrap_or_else(|e| e.into_inner());
            st.gathered[self.rank] = v;
        }
        self.meet.wait(self.rank)?;
        let all = self.meet.state.lock().unwrap_or_else(|e| e.into_inner()).gathered.clone();
        self.meet.wait(self.rank)?;
        Ok(all)
    }
}
