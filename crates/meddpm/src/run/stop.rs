//! Stopping a run safely on SIGINT / SIGTERM (Ctrl-C, `kill`, a scheduler's pre-emption).
//!
//! [`StopFlag::install`] connects the process's interrupt and termination signals (through the
//! `ctrlc` crate with its `termination` feature: SIGINT, SIGTERM and SIGHUP on Unix, Ctrl-C /
//! Ctrl-Break on Windows) to a flag: the first signal only sets it — the training loop
//! ([`super::session`]) finishes the optimizer step in progress, writes the checkpoint
//! atomically and returns — and a second signal exits the process at once with status 130,
//! leaving the last checkpoint on disk as it was (a checkpoint being written is a temp file that
//! is never renamed). After [`StopFlag::disarm`] (nothing left to save) the first signal exits
//! at once. Messages go to stderr from the handler thread, when the signal arrives.
//!
//! Only binaries should call `install` (it takes over the process's signals, once per process);
//! tests and libraries use [`StopFlag::new`] and [`StopFlag::request`].

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

const RUNNING: u8 = 0;
const REQUESTED: u8 = 1;
const DISARMED: u8 = 2;

/// Exit status of an abort by a second signal (128 + SIGINT, as shells report Ctrl-C).
pub const ABORT_STATUS: i32 = 130;

/// Whether a stop was asked for; cheap to clone and to poll.
#[derive(Clone, Debug, Default)]
pub struct StopFlag {
    state: Arc<AtomicU8>,
}

static INSTALLED: OnceLock<StopFlag> = OnceLock::new();

impl StopFlag {
    /// A flag no signal sets (for tests and embedding).
    pub fn new() -> StopFlag {
        StopFlag::default()
    }

    /// The process-wide flag set by SIGINT / SIGTERM (see the module doc); installed on the
    /// first call, the same flag afterwards.
    pub fn install() -> Result<StopFlag> {
        if let Some(f) = INSTALLED.get() {
            return Ok(f.clone());
        }
        let flag = StopFlag::new();
        let state = flag.state.clone();
        ctrlc::set_handler(move || {
            match state.compare_exchange(RUNNING, REQUESTED, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => eprintln!(
                    "\nstop requested: finishing the current step, then saving the checkpoint \
                     (interrupt again to abort at once)"
                ),
                Err(DISARMED) => {
                    eprintln!("\ninterrupted");
                    std::process::exit(ABORT_STATUS);
                }
                Err(_) => {
                    eprintln!("\naborted at once; the last checkpoint written before is intact");
                    std::process::exit(ABORT_STATUS);
                }
            }
        })
        .map_err(|e| Error::Backend(format!("cannot install the SIGINT/SIGTERM handler: {e}")))?;
        Ok(INSTALLED.get_or_init(|| flag).clone())
    }

    /// True once a stop was requested (and not disarmed).
    pub fn requested(&self) -> bool {
        self.state.load(Ordering::SeqCst) == REQUESTED
    }

    /// Ask for a stop, as a first signal does.
    pub fn request(&self) {
        let _ = self.state.compare_exchange(RUNNING, REQUESTED, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Nothing is left to save: from now on the first signal exits at once.
    pub fn disarm(&self) {
        self.state.store(DISARMED, Ordering::SeqCst);
    }
}
