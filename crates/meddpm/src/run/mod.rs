//! A training run is a folder: `checkpoint.safetensors` (weights, EMA, Adam state, step, RNG
//! position, configs and the run record), `loss.csv` and `loss.svg`, and what the run samples.
//!
//! - `record`: [`RunRecord`] — data source and convention, folder, step target, checkpoint
//!   interval, precision, layout and the data's fingerprint, stored in each checkpoint; flags
//!   override it on resume with one note each; [`DataSource`] ↔ the masks/images/manifest settings
//! - `fingerprint`: per-file size, mtime and content hash of every pair; [`DataChanges`] says what
//!   was added, went missing or changed since the checkpoint
//! - `losslog`: `loss.csv` (appended across resumes) and its plot `loss.svg` with the EMA
//! - `stop`: [`StopFlag`] — SIGINT/SIGTERM finish the step and save; a second one aborts
//! - `session`: [`Session::run`] — the loop with checkpoints, stop, divergence and write failures
//!   handled, and the test-only fault injection ([`Faults`]); [`Session::run_ranked`] is the same
//!   loop as one data-parallel rank ([`Ranks`]: stop and divergence agreed by all ranks); its
//!   [`Summary`] gives the steps taken and the first/last loss means
//! - `preview`: `train --preview-every`: DDPM-50 previews from the EMA weights into
//!   `previews/step_NNNNNN.png`, `progress.html` (loss curve + strip), and the `auto` spacing
//!   ([`auto_spacing`]: previews within 5 % of the training time)
//! - `job`: [`train_run`] — a whole run (folder and lock, data checks and prints, resume
//!   bookkeeping, the loop with previews) for a caller that settled the configuration, reporting
//!   [`Event`]s; `sample_at_end`, the closing sample
//! - `bookkeeping`: the decisions around the loop — [`StepPlan`] (step target, checkpoint
//!   interval, a batch's step, steps left) and [`Continuation`] (what a run continues from: its
//!   loss log, the checkpoint step on disk, data changes, the note for a replaced checkpoint)

pub mod bookkeeping;
pub mod fingerprint;
pub mod job;
pub mod lock;
pub mod losslog;
pub mod preview;
pub mod record;
pub mod session;
pub mod stop;

pub use bookkeeping::{on_interval, Continuation, StepPlan};
pub use fingerprint::{fingerprint, DataChanges, FilePrint, PairPrint};
pub use job::{train_run, Event, RankJob, Report, TrainJob};
pub use lock::RunLock;
pub use losslog::LossLog;
pub use preview::{auto_spacing, PreviewEvery, PreviewSchedule, Previewer};
pub use record::{override_train, run_dir, DataSource, Overrides, RunRecord, CHECKPOINT};
pub use session::{Faults, Outcome, Ranks, Session, Summary};
pub use stop::StopFlag;
