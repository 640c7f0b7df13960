//! The training loader: an endless, seeded, shuffled stream of [`Sample`]s decoded by
//! background threads, so the accelerator never waits on gzip.
//!
//! The reference wraps `DataLoader(shuffle=True, num_workers=4)` in `cycle()`: every pass over
//! the data is a fresh random permutation, and iteration never ends. Here pass `e` uses the
//! Fisher–Yates permutation drawn from `Philox(seed, LOADER_STREAM | e)` ([`epoch_order`]), so
//! the sequence of samples depends only on (seed, position) — not on the number of threads or
//! their timing — and a resumed run can start at any position.
//!
//! Data parallelism ([`Shard`]): the sample sequence above is the *global* stream of a run. With W
//! ranks and batch b per rank, each micro-step takes the next W·b global samples and rank r gets
//! the r-th block of b of them; rank r's loader yields exactly those, in order. So within every
//! pass the ranks' samples are disjoint and together cover the pass once, everything follows from
//! (seed, pass, position), and the ranks together see the same sequence one process with batch
//! W·b sees. Resuming with another world size W' (or batch) continues the global stream at the
//! saved position (`Trainer::samples`): no sample of the pass in progress is repeated or skipped,
//! and each sample keeps its timestep and noise draws (they are indexed by global position); what
//! changes is which rank decodes which sample and how many samples make one optimizer step.
//!
//! Threads: `workers` std threads claim sequence numbers from a shared counter, decode, and send
//! `(seq, result)` over a channel; [`Loader::next`] reorders them. At most `prefetch` samples are
//! decoded ahead of the consumer. `workers = 0` decodes synchronously inside `next`.
//! [`Loader::next_batch`] concatenates `batch` samples into the training loop's host batch.
//!
//! Measured throughput (docs/perf/loader.md): ≈ 80 ms of CPU per 128³ pair from .nii.gz
//! (≈ 12 pairs/s per free core) on the 2-core development machine.

use super::dataset::Dataset;
use super::Sample;
use crate::error::{Error, Result};
use crate::rng::Philox;
use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Philox stream tag for loader shuffles ("LOAD" in the high word), OR-ed with the pass number,
/// keeping these draws apart from the noise/timestep streams of training.
pub const LOADER_STREAM: u64 = 0x4C4F_4144 << 32;

/// Which part of the global sample stream one rank reads (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
    /// Consecutive global samples per rank and micro-step (the per-rank batch).
    pub block: usize,
}

impl Shard {
    /// The whole stream (one process).
    pub const ALL: Shard = Shard { rank: 0, world: 1, block: 1 };

    pub fn new(rank: usize, world: usize, block: usize) -> Result<Shard> {
        if world == 0 || rank >= world || block == 0 {
            return Err(Error::Config(format!(
                "shard rank {rank} of {world}, block {block}: need rank < world, block > 0"
            )));
        }
        Ok(Shard { rank, world, block })
    }

    /// The global position of this rank's `k`-th sample, reading from global position `start`.
    pub fn global(&self, start: u64, k: u64) -> u64 {
        let (w, b) = (self.world as u64, self.block as u64);
        start + (k / b) * w * b + self.rank as u64 * b + k % b
    }
}

/// The dataset index at global position `seq` of the stream of a dataset of `n` pairs.
pub fn index_at(seed: u64, n: usize, seq: u64) -> usize {
    epoch_order(seed, seq / n as u64, n)[(seq % n as u64) as usize]
}

/// The order of dataset indices in pass `epoch` (a permutation of 0..n).
pub fn epoch_order(seed: u64, epoch: u64, n: usize) -> Vec<usize> {
    let rng = Philox::new(seed, LOADER_STREAM | epoch);
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = rng.below(i as u64, (i + 1) as u32) as usize;
        order.swap(i, j);
    }
    order
}

struct Shared {
    dataset: Dataset,
    seed: u64,
    start: u64,
    shard: Shard,
    state: Mutex<State>,
    cv: Condvar,
}

/// Sequence numbers here are local: this loader's k-th sample (k from 0).
struct State {
    next_seq: u64,
    consumed: u64,
    prefetch: u64,
    stop: bool,
    orders: HashMap<u64, Arc<Vec<usize>>>,
}

impl Shared {
    /// Dataset index of local sequence number `k` (caches the permutation of each pass).
    fn index_of(&self, st: &mut State, k: u64) -> usize {
        let seq = self.shard.global(self.start, k);
        let n = self.dataset.len() as u64;
        let epoch = seq / n;
        let order = st.orders.entry(epoch).or_insert_with(|| Arc::new(epoch_order(self.seed, epoch, n as usize)));
        let i = order[(seq % n) as usize];
        st.orders.retain(|&e, _| e + 1 >= epoch);
        i
    }
}

/// An endless shuffled sample stream.
pub struct Loader {
    shared: Arc<Shared>,
    rx: Option<Receiver<(u64, Result<Sample>)>>,
    pending: BTreeMap<u64, Result<Sample>>,
    pos: u64,
    threads: Vec<JoinHandle<()>>,
}

impl Loader {
    /// `workers` decoding threads (0: decode in `next`), `2·workers` samples prefetched.
    pub fn new(dataset: Dataset, seed: u64, workers: usize) -> Loader {
        Loader::with_options(dataset, seed, workers, 2 * workers.max(1), 0)
    }

    /// Full control: prefetch depth and the starting position (samples already consumed, for
    /// resuming a run exactly).
    pub fn with_options(dataset: Dataset, seed: u64, workers: usize, prefetch: usize, start: u64) -> Loader {
        Loader::sharded(dataset, seed, workers, prefetch, start, Shard::ALL)
    }

    /// One rank's loader: the samples of `shard` from global position `start` on (the saved
    /// `Trainer::samples` of a resumed run, whatever world size wrote it).
    pub fn sharded(dataset: Dataset, seed: u64, workers: usize, prefetch: usize, start: u64, shard: Shard) -> Loader {
        assert!(!dataset.is_empty(), "Loader: empty dataset (Dataset constructors refuse these)");
        let shared = Arc::new(Shared {
            dataset,
            seed,
            start,
            shard,
            state: Mutex::new(State {
                next_seq: 0,
                consumed: 0,
                prefetch: prefetch.max(1) as u64,
                stop: false,
                orders: HashMap::new(),
            }),
            cv: Condvar::new(),
        });
        let mut threads = Vec::new();
        let mut rx = None;
        if workers > 0 {
            let (tx, r) = channel();
            rx = Some(r);
            for w in 0..workers {
                let shared = Arc::clone(&shared);
                let tx = tx.clone();
                let h = std::thread::Builder::new()
                    .name(format!("meddpm-loader-{w}"))
                    .spawn(move || loop {
                        let (seq, idx) = {
                            let mut st = shared.state.lock().unwrap();
                            while !st.stop && st.next_seq >= st.consumed + st.prefetch {
                                st = shared.cv.wait(st).unwrap();
                            }
                            if st.stop {
                                return;
                            }
                            let seq = st.next_seq;
                            st.next_seq += 1;
                            (seq, shared.index_of(&mut st, seq))
                        };
                        // a panic must not leave `next` waiting forever for this sequence number
                        let sample = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| shared.dataset.get(idx)))
                            .unwrap_or_else(|p| {
                                let what = p
                                    .downcast_ref::<String>()
                                    .cloned()
                                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                                    .unwrap_or_default();
                                Err(Error::data(
                                    shared.dataset.pairs()[idx].mask.name(),
                                    format!("internal error while decoding this pair: {what}"),
                                ))
                            });
                        if tx.send((seq, sample)).is_err() {
                            return;
                        }
                    })
                    .expect("spawn loader thread");
                threads.push(h);
            }
        }
        Loader { shared, rx, pending: BTreeMap::new(), pos: 0, threads }
    }

    /// The next sample (blocks until decoded). A decoding error is returned for that sample;
    /// the stream continues after it. (Not `Iterator::next`: the stream never ends.)
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<Sample> {
        let seq = self.pos;
        let result = match &self.rx {
            None => {
                let idx = {
                    let mut st = self.shared.state.lock().unwrap();
                    self.shared.index_of(&mut st, seq)
                };
                self.shared.dataset.get(idx)
            }
            Some(rx) => loop {
                if let Some(r) = self.pending.remove(&seq) {
                    break r;
                }
                let (s, r) = rx.recv().expect("loader threads alive while the Loader exists");
                self.pending.insert(s, r);
            },
        };
        self.pos += 1;
        {
            let mut st = self.shared.state.lock().unwrap();
            st.consumed = self.pos;
        }
        self.shared.cv.notify_all();
        result
    }

    /// The next `batch` samples as one host batch: their images, then their conditions, each
    /// concatenated in stream order ((batch, C, D, H, W) tensors). The first decoding error is
    /// returned (the samples before it are consumed).
    pub fn next_batch(&mut self, batch: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut img, mut cond) = (Vec::new(), Vec::new());
        for _ in 0..batch {
            let s = self.next()?;
            img.extend(s.image);
            cond.extend(s.cond);
        }
        Ok((img, cond))
    }

    /// The global position after the samples consumed so far, assuming every rank consumed as
    /// many (true between micro-steps): `start` + consumed × world. With one rank, the `start` of
    /// a resumed loader.
    pub fn position(&self) -> u64 {
        self.shared.start + self.pos * self.shared.shard.world as u64
    }

    pub fn shard(&self) -> Shard {
        self.shared.shard
    }

    pub fn dataset(&self) -> &Dataset {
        &self.shared.dataset
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.shared.state.lock().unwrap().stop = true;
        self.shared.cv.notify_all();
        self.rx = None; // a worker blocked in send() sees the closed channel
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}
