//! The run record: what a checkpoint remembers about the run that wrote it, so that
//! `train --resume CK` continues that run — in CK's folder, on the same data, to the same step
//! target, with the same checkpoint interval, precision and layout — unless a flag says
//! otherwise ([`RunRecord::apply`] returns one note per override).
//!
//! Stored as JSON under the checkpoint metadata key [`META_KEY`]. Training hyper-parameters
//! (lr, batch, accumulation, seed, ...) are the checkpoint's `train` entry, overridden by
//! [`override_train`]. A checkpoint without a record (written before meddpm recorded runs, or a
//! plain state dict) reads as `None`: callers fall back to flags and defaults and say so.
//!
//! [`DataSource::from_paths`] and [`DataSource::paths`] convert between the record's data source
//! and the flat masks / images / manifest settings of flags and run files, so the CLI and the
//! engine read a run's data source one way.

use super::fingerprint::PairPrint;
use crate::checkpoint::Checkpoint;
use crate::diffusion::TrainConfig;
use crate::error::{Error, Result};
use crate::{Layout, Precision};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Checkpoint file name in a run folder.
pub const CHECKPOINT: &str = "checkpoint.safetensors";

/// The run folder of a checkpoint path (its parent; `.` for a bare file name).
pub fn run_dir(checkpoint: &Path) -> PathBuf {
    checkpoint.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf()
}

/// Metadata key of the run record in a checkpoint.
pub const META_KEY: &str = "run";

/// Where a run's pairs come from. Paths are absolute ([`DataSource::absolute`]) so a run can be
/// resumed from any working directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum DataSource {
    /// The built-in MNI152-derived demo pairs.
    Demo,
    /// A masks folder and one images folder per modality.
    Folders { masks: PathBuf, images: Vec<PathBuf> },
    /// A CSV manifest.
    Manifest { csv: PathBuf },
}

/// `p` absolute: resolved (symbolic links, `..`) when it exists, else joined to the current
/// directory.
pub fn absolute(p: &Path) -> Result<PathBuf> {
    p.canonicalize().or_else(|_| std::path::absolute(p)).map_err(|e| Error::io(p, e))
}

impl DataSource {
    /// The source that a masks folder (with its image folders) or a CSV manifest names, as the
    /// flags and run files give them: the masks folder wins over a manifest; neither is the
    /// built-in demo data.
    pub fn from_paths(masks: Option<&Path>, images: &[PathBuf], manifest: Option<&Path>) -> DataSource {
        match (masks, manifest) {
            (Some(m), _) => DataSource::Folders { masks: m.to_path_buf(), images: images.to_vec() },
            (None, Some(csv)) => DataSource::Manifest { csv: csv.to_path_buf() },
            (None, None) => DataSource::Demo,
        }
    }

    /// The (masks folder, image folders, manifest) the source stands for: the inverse of
    /// [`DataSource::from_paths`].
    pub fn paths(&self) -> (Option<PathBuf>, Vec<PathBuf>, Option<PathBuf>) {
        match self {
            DataSource::Demo => (None, Vec::new(), None),
            DataSource::Folders { masks, images } => (Some(masks.clone()), images.clone(), None),
            DataSource::Manifest { csv } => (None, Vec::new(), Some(csv.clone())),
        }
    }

    /// The same source with every path made absolute (against the current directory).
    pub fn absolute(&self) -> Result<DataSource> {
        Ok(match self {
            DataSource::Demo => DataSource::Demo,
            DataSource::Folders { masks, images } => DataSource::Folders {
                masks: absolute(masks)?,
                images: images.iter().map(|p| absolute(p)).collect::<Result<_>>()?,
            },
            DataSource::Manifest { csv } => DataSource::Manifest { csv: absolute(csv)? },
        })
    }

    /// One line for messages.
    pub fn describe(&self) -> String {
        match self {
            DataSource::Demo => "the built-in demo pairs (MNI152-derived, 32³)".into(),
            DataSource::Folders { masks, images } => format!(
                "masks {} with images {}",
                masks.display(),
                images.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
            ),
            DataSource::Manifest { csv } => format!("manifest {}", csv.display()),
        }
    }
}

/// A run's settings and its data's fingerprint, as of the checkpoint that holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// The run's folder (absolute) when the checkpoint was written.
    pub out: PathBuf,
    pub data: DataSource,
    /// Data convention, by its CLI name (`whole-head`, `brats`, ...).
    pub convention: String,
    /// Optimizer steps to reach.
    pub steps: u64,
    /// Checkpoint every N steps (0: only at the end).
    pub checkpoint_every: u64,
    pub sample_at_end: bool,
    /// Background decoding threads.
    pub workers: usize,
    /// Requested math precision and activation layout (used on GPUs).
    pub precision: Precision,
    pub layout: Layout,
    /// Every pair's files as last trained on.
    pub pairs: Vec<PairPrint>,
}

/// Values given on the command line when resuming; `None` keeps the record's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Overrides {
    pub steps: Option<u64>,
    pub checkpoint_every: Option<u64>,
    pub out: Option<PathBuf>,
    pub sample_at_end: Option<bool>,
    pub data: Option<DataSource>,
    pub convention: Option<String>,
    pub precision: Option<Precision>,
    pub layout: Option<Layout>,
}

fn note<T: PartialEq + std::fmt::Debug>(
    notes: &mut Vec<String>,
    flag: &str,
    new: Option<T>,
    old: &mut T,
    show: impl Fn(&T) -> String,
) {
    if let Some(v) = new {
        if v != *old {
            notes.push(format!("{flag} {} overrides the run's {}", show(&v), show(old)));
            *old = v;
        }
    }
}

impl RunRecord {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a run record serialises")
    }

    /// The record stored in `ck`, or `None` for a file without one.
    pub fn from_checkpoint(ck: &Checkpoint) -> Result<Option<RunRecord>> {
        ck.meta
            .get(META_KEY)
            .map(|s| {
                serde_json::from_str(s).map_err(|e| {
                    Error::format(&ck.path, format!("metadata '{META_KEY}' is not a valid run record: {e}"))
                })
            })
            .transpose()
    }

    /// The record to resume from the checkpoint at `ck_path`: the run continues in the
    /// checkpoint's folder, wherever the run was started. Returns a note when that folder is not
    /// the recorded one (the run was moved or copied).
    pub fn resumed_at(&self, ck_path: &Path) -> Result<(RunRecord, Option<String>)> {
        let dir = absolute(ck_path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new(".")))?;
        let moved = (dir != self.out).then(|| {
            format!(
                "the run was recorded in {}; it continues in its checkpoint's folder {}",
                self.out.display(),
                dir.display()
            )
        });
        Ok((RunRecord { out: dir, ..self.clone() }, moved))
    }

    /// The record with `o` applied, and one note per value that changes (naming the flag, the new
    /// and the recorded value). Paths given are made absolute.
    pub fn apply(&self, o: &Overrides) -> Result<(RunRecord, Vec<String>)> {
        let mut r = self.clone();
        let mut notes = Vec::new();
        note(&mut notes, "--steps", o.steps, &mut r.steps, |v| v.to_string());
        note(&mut notes, "--checkpoint-every", o.checkpoint_every, &mut r.checkpoint_every, |v| v.to_string());
        let out = o.out.as_deref().map(absolute).transpose()?;
        note(&mut notes, "--out", out, &mut r.out, |v| v.display().to_string());
        note(&mut notes, "--no-sample", o.sample_at_end, &mut r.sample_at_end, |v| {
            if *v { "(sample at the end)" } else { "(no sample at the end)" }.to_string()
        });
        let data = o.data.as_ref().map(DataSource::absolute).transpose()?;
        note(&mut notes, "--masks/--images/--manifest", data, &mut r.data, DataSource::describe);
        note(&mut notes, "--convention", o.convention.clone(), &mut r.convention, |v| v.clone());
        note(&mut notes, "--precision", o.precision, &mut r.precision, |v| format!("{v:?}").to_lowercase());
        note(&mut notes, "--layout", o.layout, &mut r.layout, |v| format!("{v:?}").to_lowercase());
        Ok((r, notes))
    }
}

/// Apply command-line training values to a resumed run's config `tc`: `lr` and `grad_accum`
/// may change (one note each); `batch` and `seed` may not (they decide which data and noise
/// every step draws, so the run would not be the same run): an error names the recorded value.
pub fn override_train(
    tc: &mut TrainConfig,
    lr: Option<f32>,
    grad_accum: Option<usize>,
    batch: Option<usize>,
    seed: Option<u64>,
) -> Result<Vec<String>> {
    if let Some(b) = batch.filter(|b| *b != tc.batch) {
        return Err(Error::Config(format!(
            "--batch {b}: a resumed run keeps its batch size ({}); start a new run (--init-from) to change it",
            tc.batch
        )));
    }
    if let Some(s) = seed.filter(|s| *s != tc.seed) {
        return Err(Error::Config(format!(
            "--seed {s}: a resumed run keeps its seed ({}); start a new run (--init-from) to change it",
            tc.seed
        )));
    }
    let mut notes = Vec::new();
    note(&mut notes, "--lr", lr, &mut tc.lr, |v| format!("{v:e}"));
    note(&mut notes, "--grad-accum", grad_accum, &mut tc.grad_accum, |v| v.to_string());
    tc.validate()?;
    Ok(notes)
}
