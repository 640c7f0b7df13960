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
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

const RUNNING: u8 = 0;
const REQUESTED: u8 = 1;
const DISARMED: u8 = 2;

/// Exit status of an abort by a second signal (128 + SIGINT, as shells report Ctrl-C).
pub const ABORT_STATUS: i32 = 130;

/// Whether a stop was asked for; cheap to clone and to poll.
#[derive(Clone, Debug, Default)]
pub struct StopFlag {
    state: Arc<AtomicU8>,
    kept: Arc<Mutex<Kept>>,
}

/// What an abort leaves: the last checkpoint written and the command that resumes from it.
#[derive(Debug, Default)]
struct Kept {
    checkpoint: Option<(u64, PathBuf)>,
    resume: Option<String>,
}

impl Kept {
    /// The abort message's tail: the step kept and how to go on.
    fn note(&self) -> String {
        match (&self.checkpoint, &self.resume) {
            (Some((step, path)), Some(cmd)) => {
                format!("the checkpoint of step {step} is kept ({}); resume with: {cmd}", path.display())
            }
            (Some((step, path)), None) => format!("the checkpoint of step {step} is kept ({})", path.display()),
            (None, _) => "no checkpoint had been written yet".into(),
        }
    }
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
        let kept = flag.kept.clone();
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
                    let note = kept.lock().map(|k| k.note()).unwrap_or_else(|e| e.into_inner().note());
                    eprintln!("\naborted at once; {note}");
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

    /// A checkpoint of `step` was written to `path` (an abort names it).
    pub fn saved(&self, step: u64, path: &Path) {
        self.kept.lock().unwrap_or_else(|e| e.into_inner()).checkpoint = Some((step, path.to_path_buf()));
    }

    /// The command that resumes this run (an abort prints it with the checkpoint kept).
    pub fn set_resume_command(&self, cmd: String) {
        self.kept.lock().unwrap_or_else(|e| e.into_inner()).resume = Some(cmd);
    }

    /// Nothing is left to save: from now on the first signal exits at once.
    pub fn disarm(&self) {
        self.state.store(DISARMED, Ordering::SeqCst);
    }
}
