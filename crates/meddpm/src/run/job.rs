//! A whole training run, as `meddpm train` and Python's `meddpm.train` run it: the run folder
//! and its lock, the data checks and prints, the resume bookkeeping, the loop
//! ([`Session::run_watched`]) with previews, and the closing sample. Callers (the CLI, the
//! Python package) settle the configuration and start the trainer; [`train_run`] reports what
//! happens as [`Event`]s, which the caller prints (the CLI: lines and a progress bar), and
//! returns a [`Report`]. A data-parallel rank passes its [`RankJob`]: only rank 0 speaks,
//! writes the folder and takes previews.

use super::bookkeeping::{Continuation, StepPlan};
use super::lock::RunLock;
use super::preview::{self, Due, PreviewEvery, PreviewSchedule, Previewer};
use super::record::{absolute, DataSource, RunRecord, CHECKPOINT};
use super::session::{Faults, Ranks, Session, Summary};
use super::stop::StopFlag;
use crate::backend::Backend;
use crate::checkpoint::{bundled, LoadHints, WeightGroup};
use crate::data::output::{self, Beside};
use crate::data::{Convention, Dataset, Loader, Shard};
use crate::diffusion::{Sampler, SamplerSpec, Schedule, Trainer};
use crate::dist::GradSync;
use crate::error::{Error, Result};
use crate::model::{cost, UNet, UNetConfig};
use std::path::PathBuf;
use std::time::Instant;

/// What a run reports as it goes.
#[derive(Debug)]
pub enum Event {
    /// A line for the user (the CLI prints it on stdout).
    Say(String),
    /// A note (stderr, `note: …`).
    Note(String),
    /// A warning with its detail lines (stderr).
    Warn(Vec<String>),
    /// The loop starts: `steps` optimizer steps to go.
    Begin { steps: u64 },
    /// An optimizer step ended with this loss (the global-batch mean with ranks).
    Step { step: u64, loss: f32 },
    /// A preview was written.
    Preview { step: u64, path: PathBuf, secs: f64 },
    /// The closing sample: `done` of `total` network evaluations.
    Sampling { done: usize, total: usize },
}

/// A data-parallel rank's part in a run.
pub struct RankJob<'a, B: Backend> {
    pub sync: &'a mut dyn GradSync<B>,
    pub check_every: u64,
    /// Called once the session returned on every rank alike, before anything else can fail.
    pub agreed_end: Box<dyn FnOnce() + 'a>,
}

/// A run to train: its settings (the record: folder, data, convention, step target, intervals,
/// precision and layout; the data prints are filled in here), the data convention for the
/// model, what it continues, and how it is watched and stopped.
pub struct TrainJob<'a, B: Backend> {
    pub record: RunRecord,
    pub convention: Convention,
    /// The checkpoint a resume read and its run record (None: a new run).
    pub resumed: Option<(PathBuf, Option<RunRecord>)>,
    /// Resample pairs of another size than the model's.
    pub resize: bool,
    pub preview_every: PreviewEvery,
    pub stop: &'a StopFlag,
    pub faults: Faults,
    pub ranks: Option<RankJob<'a, B>>,
    /// What the first line adds after the backend (e.g. the precision and why).
    pub first_line: String,
}

/// What a run did.
pub struct Report {
    pub summary: Summary,
    /// Wall seconds of the loop, previews included.
    pub secs: f64,
    pub checkpoint: PathBuf,
    pub loss_csv: PathBuf,
    pub loss_svg: PathBuf,
    /// Previews taken and their seconds; the progress page when any was taken.
    pub previews: u64,
    pub preview_secs: f64,
    pub progress: Option<PathBuf>,
    /// The run's data (the closing sample conditions on its first pair).
    pub dataset: Dataset,
    /// The run record as written (absolute paths, data prints).
    pub record: RunRecord,
    /// The run folder's lock (rank 0), held until the report is dropped.
    pub lock: Option<RunLock>,
}

/// The dataset of a run record: folders, a manifest, or the built-in demo pairs, at `unet`'s
/// size.
pub fn open_dataset(data: &DataSource, conv: &Convention, unet: &UNetConfig) -> Result<Dataset> {
    let size = [unet.depth, unet.size, unet.size];
    match data {
        DataSource::Folders { masks, images } => Dataset::from_folders(masks, images, conv.clone(), size),
        DataSource::Manifest { csv } => Dataset::from_manifest(csv, conv.clone(), size),
        DataSource::Demo => {
            if unet.cond_channels() != 2 || unet.out_channels != 1 {
                return Err(Error::Config(
                    "the built-in demo data are whole-head (1 image, 2 condition channels); give --masks/--images"
                        .into(),
                ));
            }
            crate::data::demo::dataset_at(size)
        }
    }
}

/// Train `tr` as `job` says (see the module doc). The outcome (finished, stopped, diverged) is
/// in the report; errors are what stops a run otherwise (data refused, a failed write).
pub fn train_run<B: Backend>(
    be: &B,
    tr: &mut Trainer<B>,
    job: TrainJob<'_, B>,
    mut on_event: impl FnMut(Event),
) -> Result<Report> {
    let TrainJob { mut record, convention, resumed, resize, preview_every, stop, faults, ranks: dist, first_line } =
        job;
    let (rank, world) = dist.as_ref().map_or((0, 1), |d| (d.sync.rank(), d.sync.world()));
    tr.set_rank(rank, world)?;
    let lead = rank == 0;
    let say = |on_event: &mut dyn FnMut(Event), m: String| {
        if lead {
            on_event(Event::Say(m));
        }
    };
    if !lead {
        on_event(Event::Say(format!("rank {rank} of {world} on {}", be.describe())));
    }
    let cfg = tr.net.cfg.clone();
    let flops = cost::forward_flops(&cfg);
    let of_world = if world > 1 { format!(" (rank 0 of {world})") } else { String::new() };
    say(&mut on_event, format!("meddpm train on {}{of_world}{first_line}", be.describe()));
    say(
        &mut on_event,
        format!(
            "model: {}x{}x{} in {} out {} ch {} mult {:?} res {} attn {:?}: {} parameters, {:.2} GFLOP/forward",
            cfg.depth,
            cfg.size,
            cfg.size,
            cfg.in_channels,
            cfg.out_channels,
            cfg.model_channels,
            cfg.channel_mult,
            cfg.num_res_blocks,
            cfg.attention_ds,
            tr.net.param_count(),
            flops.total() / 1e9
        ),
    );
    let ranks_note =
        if world > 1 { format!(" × {world} ranks = global batch {}", tr.tc.batch * world) } else { String::new() };
    say(
        &mut on_event,
        format!(
            "training: steps {} → {} (batch {}{ranks_note} × accum {}), lr {:e}, loss {:?}, seed {}, activations \
             {:.1} MiB; checkpoint {}",
            tr.step,
            record.steps,
            tr.tc.batch,
            tr.tc.grad_accum,
            tr.tc.lr,
            tr.tc.loss,
            tr.tc.seed,
            tr.net.act_bytes as f64 / (1 << 20) as f64,
            match record.checkpoint_every {
                0 => "at the end only".to_string(),
                n => format!("every {n} steps and at the end"),
            }
        ),
    );
    // one run writes a folder at a time: a second one fails at the lock, naming the first
    if lead && !record.out.is_dir() {
        // a new folder: its data's first pair is checked before anything is written, so a run
        // refused for its data leaves nothing behind
        let first = open_dataset(&record.data.absolute()?, &convention, &cfg)?;
        if !first.is_empty() {
            first.check_pair(0, resize || record.data == DataSource::Demo)?;
        }
        std::fs::create_dir_all(&record.out).map_err(|e| Error::io(&record.out, e))?;
    }
    let lock = if lead { Some(RunLock::acquire(&record.out)?) } else { None };
    // From here on the run's paths are absolute, so the data prints name the files as a resume
    // from any directory will.
    record.out = absolute(&record.out)?;
    record.data = record.data.absolute()?;
    let out = record.out.clone();
    let ckpt = out.join(CHECKPOINT);
    let continued = Continuation {
        dir: &out,
        resumed: resumed.as_ref().map(|(path, rec)| (path.as_path(), rec.as_ref())),
        step: tr.step,
        lead,
    };
    if let Some(note) = continued.replaced_note() {
        on_event(Event::Note(note));
    }
    let dataset = open_dataset(&record.data, &convention, &cfg)?;
    say(
        &mut on_event,
        format!(
            "data: {} pairs from {}, {} convention; checking every pair…",
            dataset.len(),
            record.data.describe(),
            record.convention
        ),
    );
    // every rank checks and fingerprints the data (the same work keeps the ranks in step; only
    // rank 0's record is written)
    if record.data == DataSource::Demo {
        dataset.validate()?;
    } else {
        dataset.validate_sized(resize)?;
    }
    record.pairs = super::fingerprint(&dataset, continued.known_pairs())?;
    if let Some(changes) = continued.data_changes(&record.pairs) {
        let mut lines = vec![format!("the data changed since the checkpoint (step {}):", tr.step)];
        lines.extend(changes.report().into_iter().map(|l| format!("  {l}")));
        lines.push("  training continues on the data as it is now (the resume is not bit-identical)".into());
        on_event(Event::Warn(lines));
    }
    let (log, dropped_note) = continued.loss_log()?;
    if let Some(note) = dropped_note {
        on_event(Event::Note(note));
    }
    if faults.any() && lead {
        on_event(Event::Note(format!("test fault injection armed: {}", faults.describe())));
    }
    // this rank's part of the global sample stream, from the saved global position
    let shard = Shard::new(rank, world, tr.tc.batch)?;
    let workers = record.workers;
    let mut loader = Loader::sharded(dataset.clone(), tr.tc.seed, workers, 2 * workers.max(1), tr.samples, shard);
    let batch = tr.tc.batch;
    let saved_step = continued.saved_step();
    let steps_left = StepPlan::new(&record, tr).steps_left();
    // previews: rank 0 only (the others wait for it in the next step's collectives)
    let previewer = match (lead, preview_every) {
        (true, PreviewEvery::Auto | PreviewEvery::Steps(_)) => {
            let (cond, mask) = dataset.condition(0)?;
            let p = Previewer::new(&out, dataset.convention().clone(), cond, mask, tr.tc.seed, tr.tc.timesteps)?;
            if resumed.is_none() {
                p.clear()?; // a new run: previews in this folder belong to the run it replaces
            }
            Some(p)
        }
        _ => None,
    };
    let mut schedule = PreviewSchedule::new(if previewer.is_some() { preview_every } else { PreviewEvery::Off });
    match (&previewer, preview_every) {
        (Some(p), PreviewEvery::Auto) => say(
            &mut on_event,
            format!(
                "previews: {} from the EMA weights into {}; spacing auto (set after {} timed steps, previews within \
                 {:.0} % of training)",
                p.spec(),
                out.join(preview::PREVIEW_DIR).display(),
                preview::TIMED_STEPS,
                preview::BUDGET * 100.0
            ),
        ),
        (Some(p), PreviewEvery::Steps(n)) => say(
            &mut on_event,
            format!(
                "previews: {} from the EMA weights every {n} steps into {}",
                p.spec(),
                out.join(preview::PREVIEW_DIR).display()
            ),
        ),
        _ => {}
    }
    let mut session = Session { dir: out.clone(), record, log, stop, faults, saved_step };
    let progress_title = format!("meddpm train: {}", out.display());
    let target = tr.step + steps_left;
    let (mut shots, mut shot_secs, mut nth) = (0u64, 0.0f64, 0u64);
    let mut last = Instant::now();
    let t0 = Instant::now();
    if lead {
        on_event(Event::Begin { steps: steps_left });
    }
    let (ranks, agreed_end) = match dist {
        Some(d) => (
            Some(Ranks { sync: d.sync, check_every: d.check_every, agreement: Default::default() }),
            Some(d.agreed_end),
        ),
        None => (None, None),
    };
    let summary = session.run_watched(
        be,
        tr,
        ranks,
        || loader.next_batch(batch),
        |tr, step, loss| {
            if lead {
                on_event(Event::Step { step, loss });
            }
            nth += 1;
            let secs = last.elapsed().as_secs_f64();
            last = Instant::now();
            let Some(p) = &previewer else { return Ok(()) };
            if !loss.is_finite() || schedule.after_step(step, nth, secs) == Due::No {
                return Ok(());
            }
            let (path, took) = p.take(be, tr)?;
            (shots, shot_secs) = (shots + 1, shot_secs + took);
            preview::write_progress(&out, &progress_title)?;
            on_event(Event::Preview { step, path, secs: took });
            let before = schedule.spacing;
            schedule.taken(step, took, steps_left, target - step);
            if preview_every == PreviewEvery::Auto && shots == 1 {
                let step_secs = schedule.step_secs().unwrap_or(f64::NAN);
                let share = 100.0 * took / (steps_left as f64 * step_secs);
                on_event(Event::Say(match (before, schedule.spacing) {
                    (None, Some(n)) => format!(
                        "preview spacing: every {n} steps (auto: a step {step_secs:.3} s, a preview {took:.1} s = \
                         {share:.1} % of this session's training each)"
                    ),
                    _ => format!(
                        "preview spacing: no more previews (auto: a step {step_secs:.3} s, a preview {took:.1} s = \
                         {share:.1} % of this session's training; another would pass {:.0} %)",
                        preview::BUDGET * 100.0
                    ),
                }));
            }
            last = Instant::now();
            Ok(())
        },
    )?;
    if let Some(f) = agreed_end {
        f();
    }
    let secs = t0.elapsed().as_secs_f64();
    let progress = if shots > 0 {
        let progress = preview::write_progress(&out, &progress_title)?;
        let train_secs = (secs - shot_secs).max(1e-9);
        on_event(Event::Say(format!(
            "previews: {shots} in {shot_secs:.1} s ({:.1} % of the training time); progress: {}",
            100.0 * shot_secs / train_secs,
            progress.display()
        )));
        Some(progress)
    } else {
        None
    };
    Ok(Report {
        summary,
        secs,
        checkpoint: ckpt,
        loss_csv: session.log.csv_path().to_path_buf(),
        loss_svg: session.log.svg_path(),
        previews: shots,
        preview_secs: shot_secs,
        progress,
        dataset,
        record: session.record,
        lock,
    })
}

/// The run's closing sample: one volume for the first pair's mask with the EMA weights, written
/// into the run folder with its previews (beside it the bundled demo model's sample of the same
/// mask and seed, when the run trains on the demo data with a model of its shape). Returns the
/// files written.
pub fn sample_at_end<B: Backend>(
    be: &B,
    tr: &mut Trainer<B>,
    report: &Report,
    mut on_event: impl FnMut(Event),
) -> Result<Vec<PathBuf>> {
    let dataset = &report.dataset;
    let cfg = tr.net.cfg.clone();
    let size = [cfg.depth, cfg.size, cfg.size];
    let (cond, mask) = dataset.condition(0)?;
    let (_, real) = dataset.load(0)?;
    let sched = Schedule::try_cosine(tr.tc.timesteps)?;
    let seed = tr.tc.seed;
    let vol = tr.with_ema(|net| sample_volume(be, net, &sched, &cond, seed, &mut on_event))?;
    let mut others = Vec::new();
    let bundled = match report.record.data {
        DataSource::Demo => bundled::load(WeightGroup::Ema, &LoadHints::default())?.filter(|w| w.cfg == cfg),
        _ => None,
    };
    if let Some(w) = bundled {
        on_event(Event::Say(format!("comparison: {}", w.source)));
        let mut net = UNet::new(be, &w.cfg, 1)?;
        net.set_params(be, &w.params)?;
        let v = sample_volume(be, &mut net, &sched, &cond, seed, &mut on_event)?;
        others.extend(output::image_volumes(dataset.convention(), &v, cfg.out_channels, size, &mask)?);
    }
    let beside = Beside { others: &others, others_name: "bundled demo model", real: &real };
    let stem = report.record.out.join("sample_0");
    output::write_sample_with_views(&stem, dataset.convention(), &vol, cfg.out_channels, size, &mask, beside)
}

/// One volume with any network batch (a training net may have batch > 1): the batch is padded
/// with copies, and volume 0 is what a batch-1 network samples with this seed.
fn sample_volume<B: Backend>(
    be: &B,
    net: &mut UNet<B>,
    sched: &Schedule,
    cond: &[f32],
    seed: u64,
    on_event: &mut impl FnMut(Event),
) -> Result<Vec<f32>> {
    let mut s = Sampler::new(be, net)?;
    let plan = crate::diffusion::plan(&SamplerSpec::ddpm(sched.timesteps), sched)?;
    let total = sched.timesteps;
    let mut done = 0;
    let mut v = s.sample_jobs(be, net, &plan, &[(cond, seed)], |_| {
        done += 1;
        on_event(Event::Sampling { done, total });
    })?;
    Ok(v.swap_remove(0))
}
