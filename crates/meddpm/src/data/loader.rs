//! The training loader: an endless, seeded, shuffled stream of [`Sample`]s decoded by
//! background threads, so the accelerator never waits on gzip.
//!
//! The reference wraps `DataLoader(shuffle=True, num_workers=4)` in `cycle()`: every pass over
//! the data is a fresh random permutation, and iteration never ends. Here pass `e` uses the
//! Fisher–Yates permutation drawn from `Philox(seed, LOADER_STREAM | e)` ([`epoch_order`]), so
//! the sequence of samples depends only on (seed, position) — not on the number of threads or
//! their timing — and a resumed run can start at any position.
//!
//! Threads: `workers` std threads claim sequence numbers from a shared counter, decode, and send
//! `(seq, result)` over a channel; [`Loader::next`] reorders them. At most `prefetch` samples are
//! decoded ahead of the consumer. `workers = 0` decodes synchronously inside `next`.
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
    state: Mutex<State>,
    cv: Condvar,
}

struct State {
    next_seq: u64,
    consumed: u64,
    prefetch: u64,
    stop: bool,
    orders: HashMap<u64, Arc<Vec<usize>>>,
}

impl Shared {
    /// Dataset index of sequence number `seq` (caches the permutation of each pass).
    fn index_of(&self, st: &mut State, seq: u64) -> usize {
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
        assert!(!dataset.is_empty(), "Loader: empty dataset (Dataset constructors refuse these)");
        let shared = Arc::new(Shared {
            dataset,
            seed,
            state: Mutex::new(State {
                next_seq: start,
                consumed: start,
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
        Loader { shared, rx, pending: BTreeMap::new(), pos: start, threads }
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

    /// Samples consumed so far (the `start` of a resumed loader).
    pub fn position(&self) -> u64 {
        self.pos
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
