//! `meddpm train`: the run's configuration (run file < preset < flags, or the run a checkpoint
//! records for `--resume`), the trainer, and the loop with its progress bar and closing sample.
//! The engine does the work (`meddpm::run`: record, resume, loss log, safe stop); this file
//! wires. A data-parallel rank (`--gpus`, torchrun, Slurm) joins its group through `dist.rs` and
//! trains through the same `train_on`.

use crate::args::{
    bar, number_f32, preview_every, whole, whole_usize, with_backend, BackendArgs, ConventionName, Device, Preset,
    RunConfig, RunFile, MAX_BATCH,
};
use anyhow::{bail, Context, Result};
use indicatif::ProgressBar;
use meddpm::checkpoint::{bundled, init_trainer_with, load_weights, Checkpoint, LoadHints, LoadedWeights, WeightGroup};
use meddpm::data::output::{self, Beside};
use meddpm::data::{Dataset, Loader, Shard};
use meddpm::diffusion::{Sampler, SamplerSpec, Schedule, TrainConfig, Trainer};
use meddpm::dist::spawn::GpuSelection;
use meddpm::dist::{config_hash, BucketPlan, DistEnv, GradSync, DEFAULT_BUCKET_BYTES};
use meddpm::model::{cost, UNet, UNetConfig};
use meddpm::run::preview::{self, Due};
use meddpm::run::{
    Continuation, DataSource, Faults, Outcome, Overrides, PreviewEvery, PreviewSchedule, Previewer, Ranks, RunLock,
    RunRecord, Session, StepPlan, StopFlag,
};
use meddpm::{Backend, Layout, Precision};
use meddpm_cuda::collective::NcclSync;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// Run file (TOML) with [unet], [train], [run] tables; flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Model preset [default: demo with the built-in data; required with --masks or --manifest
    /// unless the run file has a [unet] table or a preset].
    #[arg(long, value_enum)]
    pub preset: Option<Preset>,
    /// Continue the run of this meddpm checkpoint exactly (weights, EMA, Adam, step, RNG), in the
    /// checkpoint's folder, on the run's data, to its step target; flags override the run's
    /// settings (a note is printed for each), and data that changed since is reported.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Start from the EMA weights of a released checkpoint (.pt, safetensors or meddpm) as the
    /// reference's --resume_weight does: they become the online weights, step 0, fresh Adam,
    /// EMA copied. The model config comes from the file (the volume size from the run file/preset).
    #[arg(long, conflicts_with = "resume")]
    pub init_from: Option<PathBuf>,
    /// Optimizer steps to reach, ≥ 1 (each is grad_accum micro-steps) [default: 200; the demo on a
    /// GPU 8000; a resumed run: its own target].
    #[arg(long, allow_negative_numbers = true, value_parser = whole(1, u64::MAX))]
    pub steps: Option<u64>,
    /// Adam learning rate, in (0, 1] [default: 2e-4 for the demo and tiny presets, 1e-5 (the
    /// reference's) otherwise; a resumed run: its own].
    #[arg(long, allow_negative_numbers = true, value_parser = number_f32(0.0, false, 1.0))]
    pub lr: Option<f32>,
    /// Micro-steps (batches) accumulated per optimizer step, 1 to 1024 [default: 1].
    #[arg(long, allow_negative_numbers = true, value_parser = whole_usize(1, MAX_BATCH))]
    pub grad_accum: Option<usize>,
    /// Seed of the weights' initialisation, the data order and the noise [default: 0].
    #[arg(long, allow_negative_numbers = true, value_parser = whole(0, u64::MAX))]
    pub seed: Option<u64>,
    /// Volumes per micro-step (per GPU in data-parallel runs), 1 to 1024 [default: 1].
    #[arg(long, allow_negative_numbers = true, value_parser = whole_usize(1, MAX_BATCH))]
    pub batch: Option<usize>,
    /// Save the checkpoint and loss log every N optimizer steps; 0: only at the end (the last
    /// step always saves) [default: 100; the demo on a GPU 1000].
    #[arg(long, allow_negative_numbers = true, value_parser = whole(0, u64::MAX))]
    pub checkpoint_every: Option<u64>,
    /// Output folder: checkpoint, loss log and plot, closing sample; one run at a time (locked)
    /// [default: runs/demo].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Watch the run learn: every N optimizer steps, a DDPM-50 sample of the first pair's mask
    /// (fixed seed) from the EMA weights into previews/step_NNNNNN.png, with progress.html (loss
    /// curve and previews); 0: off; auto: a spacing that keeps previews within 5 % of the
    /// training time, set from the measured step and preview times [default: auto].
    #[arg(long, default_value = "auto", allow_negative_numbers = true, value_parser = preview_every)]
    pub preview_every: PreviewEvery,
    /// Do not sample a volume at the end.
    #[arg(long)]
    pub no_sample: bool,
    /// Folder of mask NIfTIs (default: the built-in MNI152-derived demo pairs).
    #[arg(long)]
    pub masks: Option<PathBuf>,
    /// Image folder(s) paired with --masks (BraTS: four, T1 T1ce T2 FLAIR).
    #[arg(long, num_args = 1..)]
    pub images: Vec<PathBuf>,
    /// CSV manifest (mask,image[,image...]) instead of folders.
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    /// Resample training pairs whose size differs from the model's (otherwise such data is an
    /// error that names both sizes).
    #[arg(long)]
    pub resize: bool,
    /// Data convention of --masks/--images/--manifest [default: whole-head].
    #[arg(long, value_enum)]
    pub convention: Option<ConventionName>,
    /// Data-parallel training on this machine, one process per GPU: a count (2), 'all', or device
    /// indices (0,1). Batch, lr and steps are per optimizer step as before; the global batch is
    /// batch × GPUs. Under torchrun or srun, leave it out: the launcher starts the ranks.
    #[arg(long)]
    pub gpus: Option<GpuSelection>,
    /// Data-parallel runs: compare the weights of all ranks by hash every N optimizer steps
    /// (0: only at the end); a difference stops the run.
    #[arg(long, default_value_t = 100, allow_negative_numbers = true, value_parser = whole(0, u64::MAX))]
    pub check_every: u64,
    /// Data-parallel runs: seconds to wait for the other ranks (rendezvous, each gradient
    /// all-reduce) before failing, ≥ 1.
    #[arg(long, default_value_t = 300, allow_negative_numbers = true, value_parser = whole(1, u64::MAX))]
    pub dist_timeout: u64,
    #[command(flatten)]
    pub backend: BackendArgs,
}

/// Settle the configuration of a new run (or of a resumed checkpoint without a run record):
/// run file < preset < flags; the demo is the default.
fn plan_from_flags(a: &TrainArgs) -> Result<(UNetConfig, TrainConfig, RunConfig)> {
    let file = RunFile::read(a.config.as_deref())?;
    let own_data = a.masks.is_some() || a.manifest.is_some() || file.run.masks.is_some() || file.run.manifest.is_some();
    if own_data && a.preset.is_none() && file.preset.is_none() && file.unet.is_none() {
        bail!(
            "--masks/--manifest: say which model to train on this data with --preset (whole-head, brats, tiny or \
             demo) or a run file's [unet] table; without data options, train trains the built-in demo"
        );
    }
    let preset = a.preset.or(file.preset).unwrap_or(Preset::Demo);
    let unet = file.unet.clone().unwrap_or_else(|| preset.unet());
    let mut tc = file.train.clone().unwrap_or_else(|| match preset {
        // The reference lr 1e-5 needs ~10⁵ steps; the demo must show learning in ~10².
        Preset::Demo | Preset::Tiny => TrainConfig { lr: 2e-4, ..TrainConfig::default() },
        _ => TrainConfig::default(),
    });
    let mut run = file.run.clone();
    if let Some(v) = a.lr {
        tc.lr = v;
    }
    if let Some(v) = a.grad_accum {
        tc.grad_accum = v;
    }
    if let Some(v) = a.seed {
        tc.seed = v;
    }
    if let Some(v) = a.batch {
        tc.batch = v;
    }
    if let Some(v) = a.steps {
        run.steps = v;
    }
    if let Some(v) = a.checkpoint_every {
        run.checkpoint_every = v;
    }
    if let Some(v) = &a.out {
        run.out = v.clone();
    }
    if a.no_sample {
        run.sample_at_end = false;
    }
    if a.masks.is_some() || a.manifest.is_some() {
        run.masks = a.masks.clone();
        run.images = a.images.clone();
        run.manifest = a.manifest.clone();
    }
    if let Some(c) = a.convention {
        run.convention = c;
    }
    if run.steps == 0 {
        bail!("[run] steps = 0 in the run file: a run needs at least 1 optimizer step");
    }
    unet.validate()?;
    tc.validate()?;
    Ok((unet, tc, run))
}

/// Where a run's pairs come from, as a run record says it.
fn data_source(run: &RunConfig) -> DataSource {
    DataSource::from_paths(run.masks.as_deref(), &run.images, run.manifest.as_deref())
}

/// A run's settings as its record keeps them (paths absolute; the data prints come later).
fn record_of(run: &RunConfig, backend: &BackendArgs) -> Result<RunRecord> {
    Ok(RunRecord {
        out: meddpm::run::record::absolute(&run.out)?,
        data: data_source(run).absolute()?,
        convention: run.convention.name(),
        steps: run.steps,
        checkpoint_every: run.checkpoint_every,
        sample_at_end: run.sample_at_end,
        workers: run.workers,
        precision: backend.precision(),
        layout: backend.layout(),
        pairs: Vec::new(),
    })
}

/// The run settings a record stands for.
fn run_config_of(rec: &RunRecord) -> Result<RunConfig> {
    let (masks, images, manifest) = rec.data.paths();
    Ok(RunConfig {
        steps: rec.steps,
        checkpoint_every: rec.checkpoint_every,
        out: rec.out.clone(),
        sample_at_end: rec.sample_at_end,
        masks,
        images,
        manifest,
        convention: ConventionName::from_name(&rec.convention)?,
        workers: rec.workers,
    })
}

/// A settled training run.
pub(crate) struct Plan {
    pub unet: UNetConfig,
    pub tc: TrainConfig,
    pub run: RunConfig,
    pub backend: BackendArgs,
    /// The checkpoint resumed from, and its run record (None: an older checkpoint).
    pub resume: Option<(Checkpoint, Option<RunRecord>)>,
}

/// `train --resume CK`: the run recorded in CK, with the flags as overrides (one note each,
/// printed when `say` — by rank 0 alone in a data-parallel run).
fn plan_resume(a: &TrainArgs, path: &Path, say: bool) -> Result<Plan> {
    let ck = Checkpoint::read(path)?;
    let Some(unet) = ck.unet.clone() else {
        bail!("{}: no 'unet' config in the metadata: not a meddpm training checkpoint", path.display())
    };
    let Some(mut tc) = ck.train.clone() else {
        bail!("{}: no 'train' config in the metadata: not a meddpm training checkpoint", path.display())
    };
    let mut notes = meddpm::run::override_train(&mut tc, a.lr, a.grad_accum, a.batch, a.seed)?;
    let rec = RunRecord::from_checkpoint(&ck)?;
    let (run, backend) = match &rec {
        Some(rec) => {
            if a.config.is_some() {
                bail!(
                    "--config with --resume: {} records its run; override its settings with flags instead",
                    path.display()
                );
            }
            let data = (a.masks.is_some() || a.manifest.is_some()).then(|| {
                data_source(&RunConfig {
                    masks: a.masks.clone(),
                    images: a.images.clone(),
                    manifest: a.manifest.clone(),
                    ..RunConfig::default()
                })
            });
            let o = Overrides {
                steps: a.steps,
                checkpoint_every: a.checkpoint_every,
                out: a.out.clone(),
                sample_at_end: a.no_sample.then_some(false),
                data,
                convention: a.convention.map(ConventionName::name),
                precision: a.backend.precision,
                layout: a.backend.layout,
            };
            let (here, moved) = rec.resumed_at(path)?;
            notes.extend(moved);
            let (new, more) = here.apply(&o)?;
            notes.extend(more);
            (run_config_of(&new)?, a.backend.with_defaults(new.precision, new.layout))
        }
        None => {
            notes.push(format!(
                "{} has no run record (written by an older meddpm): the data, output folder and step target \
                 come from the flags and defaults, as before",
                path.display()
            ));
            let (_, _, run) = plan_from_flags(a)?;
            (run, a.backend.clone())
        }
    };
    for n in notes.iter().filter(|_| say) {
        eprintln!("note: {n}");
    }
    Ok(Plan { unet, tc, run, backend, resume: Some((ck, rec)) })
}

/// Optimizer steps of the demo when it runs on a GPU (see [`train`]).
const GPU_DEMO_STEPS: u64 = 8000;

pub fn run(a: &TrainArgs) -> Result<()> {
    if let Some(sel) = &a.gpus {
        return crate::dist::launch_local(sel).map(|_| ());
    }
    let env = DistEnv::from_env()?.filter(|e| e.world > 1);
    let plan = match &a.resume {
        Some(p) => plan_resume(a, p, env.as_ref().is_none_or(|e| e.rank == 0))?,
        None => {
            let (unet, tc, mut run) = plan_from_flags(a)?;
            // The demo on a GPU: enough steps for a recognisable brain (the bundled model had one
            // after 10,000 steps, about 100 s on the H200) instead of the CPU's 200.
            let demo = a.config.is_none() && a.preset.unwrap_or(Preset::Demo) == Preset::Demo;
            let gpu = match a.backend.resolve() {
                Device::Cuda(i) => meddpm_cuda::usable_gpu(i).is_ok(),
                _ => false,
            };
            if demo && a.steps.is_none() && gpu {
                run.steps = GPU_DEMO_STEPS;
                run.checkpoint_every = 1000;
                println!("demo on the GPU: {GPU_DEMO_STEPS} steps (--steps to change)");
            }
            Plan { unet, tc, run, backend: a.backend.clone(), resume: None }
        }
    };
    if let Some(env) = env {
        return train_rank(a, env, plan);
    }
    let backend = plan.backend.clone();
    with_backend!(backend, be => {
        let (tr, plan) = start_trainer(&be, a, plan)?;
        train_on(&be, plan, tr, None)
    })
}

/// The dataset a run trains on: folders, a manifest, or the built-in demo pairs.
pub(crate) fn open_dataset(run: &RunConfig, unet: &UNetConfig) -> Result<Dataset> {
    let size = [unet.depth, unet.size, unet.size];
    let conv = run.convention.for_model(unet)?;
    Ok(match (&run.masks, &run.manifest) {
        (Some(m), _) => Dataset::from_folders(m, &run.images, conv, size)?,
        (None, Some(csv)) => Dataset::from_manifest(csv, conv, size)?,
        (None, None) => {
            if unet.cond_channels() != 2 || unet.out_channels != 1 {
                bail!("the built-in demo data are whole-head (1 image, 2 condition channels); give --masks/--images");
            }
            meddpm::data::demo::dataset_at(size)?
        }
    })
}

/// The command that continues the run of `ck` (the device repeated when one was chosen; the
/// GPUs when `--gpus` started this rank, see `dist::GPUS_ENV`).
fn resume_command(ck: &Path, backend: &BackendArgs) -> String {
    let q = |s: &str| shlex::try_quote(s).map(|c| c.into_owned()).unwrap_or_else(|_| s.to_string());
    let mut cmd = format!("meddpm train --resume {}", q(&ck.display().to_string()));
    if let Ok(g) = std::env::var(crate::dist::GPUS_ENV) {
        cmd.push_str(&format!(" --gpus {}", q(&g)));
        return cmd;
    }
    match backend.device {
        Device::Auto => {}
        Device::Cpu => cmd.push_str(" --device cpu"),
        Device::Cuda(i) => cmd.push_str(&format!(" --device cuda:{i}")),
    }
    cmd
}

/// The run a trainer continues: the checkpoint it was resumed from and that checkpoint's run
/// record (None: a new run).
pub(crate) type OldRun = Option<(PathBuf, Option<RunRecord>)>;

/// The trainer of a plan: resumed (`--resume`), initialised (`--init-from`) or fresh.
pub(crate) fn start_trainer<B: Backend>(be: &B, a: &TrainArgs, plan: Plan) -> Result<(Trainer<B>, Started)> {
    let Plan { unet, tc, run, backend, resume } = plan;
    let (tr, old) = match resume {
        Some((ck, rec)) => {
            let mut tr = ck.restore_trainer(be)?;
            tr.tc = tc; // the checkpoint's, with --lr / --grad-accum applied (batch and seed unchanged)
            (tr, Some((ck.path.clone(), rec)))
        }
        None => match &a.init_from {
            Some(p) => {
                let w = load_weights(p, WeightGroup::Ema, Some((unet.depth, unet.size)))?;
                for m in &w.warnings {
                    eprintln!("warning: {}: {m}", p.display());
                }
                println!("init from {}", w.source);
                let mut tr = Trainer::new(be, &w.cfg, &tc)?;
                init_trainer_with(be, &mut tr, &w)?;
                (tr, None)
            }
            None => (Trainer::new(be, &unet, &tc)?, None),
        },
    };
    Ok((tr, Started { run, backend, old, resize: a.resize, preview_every: a.preview_every }))
}

/// What the loop needs of a plan once its trainer exists.
pub(crate) struct Started {
    pub run: RunConfig,
    pub backend: BackendArgs,
    pub old: OldRun,
    /// Resample pairs of another size than the model's (`--resize`).
    pub resize: bool,
    /// `--preview-every`.
    pub preview_every: PreviewEvery,
}

/// What a data-parallel rank brings to the training loop ([`train_rank`] makes it).
pub(crate) struct RankCtx<'a, B: Backend> {
    pub sync: &'a mut dyn GradSync<B>,
    pub check_every: u64,
    /// Called once the session returned on every rank alike (finished, stopped or diverged:
    /// no collective is left), before anything else can fail: the rank leaves the group cleanly.
    pub agreed_end: Box<dyn FnOnce() + 'a>,
}

/// The training loop of a run folder (`meddpm::run::Session`). With `dist`, this process is one
/// data-parallel rank: it reads its shard of the data, and the session averages gradients,
/// agrees on stops and checks the weights; only rank 0 prints, writes the run folder and samples
/// at the end.
pub(crate) fn train_on<B: Backend>(
    be: &B,
    started: Started,
    mut tr: Trainer<B>,
    dist: Option<RankCtx<'_, B>>,
) -> Result<()> {
    let Started { mut run, backend, old: old_record, resize, preview_every } = started;
    let (rank, world) = dist.as_ref().map_or((0, 1), |d| (d.sync.rank(), d.sync.world()));
    tr.set_rank(rank, world)?;
    let lead = rank == 0;
    let say = |m: String| {
        if lead {
            println!("{m}");
        }
    };
    if !lead {
        println!("rank {rank} of {world} on {}", be.describe());
    }
    let cfg = tr.net.cfg.clone();
    let flops = cost::forward_flops(&cfg);
    say(format!(
        "meddpm train on {}{}; {}",
        be.describe(),
        if world > 1 { format!(" (rank 0 of {world})") } else { String::new() },
        backend.precision_choice()
    ));
    say(format!(
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
    ));
    let ranks =
        if world > 1 { format!(" × {world} ranks = global batch {}", tr.tc.batch * world) } else { String::new() };
    say(format!(
        "training: steps {} → {} (batch {}{ranks} × accum {}), lr {:e}, loss {:?}, seed {}, activations {:.1} MiB; \
         checkpoint {}",
        tr.step,
        run.steps,
        tr.tc.batch,
        tr.tc.grad_accum,
        tr.tc.lr,
        tr.tc.loss,
        tr.tc.seed,
        tr.net.act_bytes as f64 / (1 << 20) as f64,
        match run.checkpoint_every {
            0 => "at the end only".to_string(),
            n => format!("every {n} steps and at the end"),
        }
    ));
    // one run writes a folder at a time: a second one fails here, naming the first
    if lead && !run.out.is_dir() {
        // a new folder: its data's first pair is checked before anything is written, so a run
        // refused for its data leaves nothing behind
        let rec = record_of(&run, &backend)?;
        let first = open_dataset(&run_config_of(&rec)?, &cfg)?;
        if !first.is_empty() {
            first.check_pair(0, resize || rec.data == DataSource::Demo)?;
        }
        std::fs::create_dir_all(&run.out).with_context(|| format!("creating {}", run.out.display()))?;
    }
    let _lock = if lead { Some(RunLock::acquire(&run.out)?) } else { None };
    let mut record = record_of(&run, &backend)?;
    // From here on the run's paths are the record's (absolute), so the data prints name the
    // files as a resume from any directory will.
    run = run_config_of(&record)?;
    let ckpt = run.out.join(meddpm::run::CHECKPOINT);
    let continued = Continuation {
        dir: &run.out,
        resumed: old_record.as_ref().map(|(path, rec)| (path.as_path(), rec.as_ref())),
        step: tr.step,
        lead,
    };
    if let Some(note) = continued.replaced_note() {
        eprintln!("note: {note}");
    }
    let dataset = open_dataset(&run, &cfg)?;
    say(format!(
        "data: {} pairs from {}, {:?} convention; checking every pair…",
        dataset.len(),
        record.data.describe(),
        run.convention
    ));
    // every rank checks and fingerprints the data (the same work keeps the ranks in step; only
    // rank 0's record is written)
    if record.data == DataSource::Demo {
        dataset.validate()?;
    } else {
        dataset.validate_sized(resize)?;
    }
    record.pairs = meddpm::run::fingerprint(&dataset, continued.known_pairs())?;
    if let Some(changes) = continued.data_changes(&record.pairs) {
        eprintln!("warning: the data changed since the checkpoint (step {}):", tr.step);
        for line in changes.report() {
            eprintln!("  {line}");
        }
        eprintln!("  training continues on the data as it is now (the resume is not bit-identical)");
    }
    let (log, dropped_note) = continued.loss_log()?;
    if let Some(note) = dropped_note {
        eprintln!("note: {note}");
    }
    let stop = StopFlag::install()?;
    stop.set_resume_command(resume_command(&ckpt, &backend));
    let faults = Faults::from_env()?;
    if faults.any() && lead {
        eprintln!("note: test fault injection armed: {}", faults.describe());
    }
    // this rank's part of the global sample stream, from the saved global position
    let shard = Shard::new(rank, world, tr.tc.batch)?;
    let mut loader =
        Loader::sharded(dataset.clone(), tr.tc.seed, run.workers, 2 * run.workers.max(1), tr.samples, shard);
    let batch = tr.tc.batch;
    let saved_step = continued.saved_step();
    let steps_left = StepPlan::new(&record, &tr).steps_left();
    let mut session = Session { dir: run.out.clone(), record, log, stop: &stop, faults, saved_step };
    // previews: rank 0 only (the others wait for it in the next step's collectives)
    let previewer = match (lead, preview_every) {
        (true, PreviewEvery::Auto | PreviewEvery::Steps(_)) => {
            let (cond, mask) = dataset.condition(0)?;
            let p = Previewer::new(&run.out, dataset.convention().clone(), cond, mask, tr.tc.seed, tr.tc.timesteps)?;
            if old_record.is_none() {
                p.clear()?; // a new run: previews in this folder belong to the run it replaces
            }
            Some(p)
        }
        _ => None,
    };
    let mut schedule = PreviewSchedule::new(if previewer.is_some() { preview_every } else { PreviewEvery::Off });
    match (&previewer, preview_every) {
        (Some(p), PreviewEvery::Auto) => say(format!(
            "previews: {} from the EMA weights into {}; spacing auto (set after {} timed steps, previews within {:.0} % \
             of training)",
            p.spec(),
            run.out.join(preview::PREVIEW_DIR).display(),
            preview::TIMED_STEPS,
            preview::BUDGET * 100.0
        )),
        (Some(p), PreviewEvery::Steps(n)) => say(format!(
            "previews: {} from the EMA weights every {n} steps into {}",
            p.spec(),
            run.out.join(preview::PREVIEW_DIR).display()
        )),
        _ => {}
    }
    let target = tr.step + steps_left;
    let (mut shots, mut shot_secs, mut nth) = (0u64, 0.0f64, 0u64);
    let mut last = Instant::now();
    let t0 = Instant::now();
    let pb = if lead { bar(steps_left, "train") } else { ProgressBar::hidden() };
    let (ranks, agreed_end) = match dist {
        Some(d) => (Some(Ranks { sync: d.sync, check_every: d.check_every }), Some(d.agreed_end)),
        None => (None, None),
    };
    let summary = session.run_watched(
        be,
        &mut tr,
        ranks,
        || loader.next_batch(batch),
        |tr, step, loss| {
            pb.set_message(format!("loss {loss:.4}"));
            pb.inc(1);
            nth += 1;
            let secs = last.elapsed().as_secs_f64();
            last = Instant::now();
            let Some(p) = &previewer else { return Ok(()) };
            if !loss.is_finite() || schedule.after_step(step, nth, secs) == Due::No {
                return Ok(());
            }
            let (path, took) = p.take(be, tr)?;
            (shots, shot_secs) = (shots + 1, shot_secs + took);
            preview::write_progress(&run.out, &format!("meddpm train: {}", run.out.display()))?;
            pb.suspend(|| println!("preview: step {step} in {took:.1} s: {}", path.display()));
            let before = schedule.spacing;
            schedule.taken(step, took, steps_left, target - step);
            if preview_every == PreviewEvery::Auto && shots == 1 {
                let step_secs = schedule.step_secs().unwrap_or(f64::NAN);
                let share = 100.0 * took / (steps_left as f64 * step_secs);
                pb.suspend(|| match (before, schedule.spacing) {
                    (None, Some(n)) => println!(
                        "preview spacing: every {n} steps (auto: a step {step_secs:.3} s, a preview {took:.1} s = \
                         {share:.1} % of this session's training each)"
                    ),
                    _ => println!(
                        "preview spacing: no more previews (auto: a step {step_secs:.3} s, a preview {took:.1} s = \
                         {share:.1} % of this session's training; another would pass {:.0} %)",
                        preview::BUDGET * 100.0
                    ),
                });
            }
            last = Instant::now();
            Ok(())
        },
    )?;
    if let Some(f) = agreed_end {
        f();
    }
    pb.finish();
    let secs = t0.elapsed().as_secs_f64();
    let steps = summary.steps();
    if shots > 0 {
        let progress = preview::write_progress(&run.out, &format!("meddpm train: {}", run.out.display()))?;
        let train_secs = (secs - shot_secs).max(1e-9);
        println!(
            "previews: {shots} in {shot_secs:.1} s ({:.1} % of the training time); progress: {}",
            100.0 * shot_secs / train_secs,
            progress.display()
        );
    }
    if !lead {
        // rank 0 reports the run; the others say where they stopped
        return match &summary.outcome {
            Outcome::Diverged { step, reason } => bail!("rank {rank}: training diverged at step {step}: {reason}"),
            Outcome::Stopped => {
                println!("rank {rank}: stopped at step {} with the others", summary.end);
                Ok(())
            }
            Outcome::Finished => {
                println!("rank {rank}: done at step {}", summary.end);
                Ok(())
            }
        };
    }
    let kept = |s: Option<u64>| match s {
        Some(s) => format!("the last good checkpoint (step {s}) is kept: {}", ckpt.display()),
        None => "no checkpoint had been written".to_string(),
    };
    match &summary.outcome {
        Outcome::Diverged { step, reason } => {
            bail!(
                "training diverged at step {step}: {reason}; {}; the loss log is {}",
                kept(summary.saved_step),
                session.log.csv_path().display()
            )
        }
        Outcome::Stopped => {
            println!(
                "stopped at step {} after {steps} steps in {secs:.1} s; checkpoint: {}",
                summary.end,
                ckpt.display()
            );
            println!("resume with: {}", resume_command(&ckpt, &backend));
            return Ok(());
        }
        Outcome::Finished => {}
    }
    stop.disarm();
    let (first, last) = summary.loss_means(10);
    println!(
        "done: {steps} steps in {secs:.1} s ({:.2} steps/s); loss {first:.4} (first 10) → {last:.4} (last 10)",
        steps as f64 / secs.max(1e-9),
    );
    println!(
        "checkpoint: {}\nloss log:   {} (plot: {})",
        ckpt.display(),
        session.log.csv_path().display(),
        session.log.svg_path().display()
    );
    if run.sample_at_end {
        sample_at_end(be, &mut tr, &run, &dataset)?;
    }
    Ok(())
}

/// The run's closing sample: one volume for the first pair's mask with the EMA weights, written
/// into the run folder with its previews (beside it the bundled demo model's sample of the same
/// mask and seed, when that is the same kind of model).
fn sample_at_end<B: Backend>(be: &B, tr: &mut Trainer<B>, run: &RunConfig, dataset: &Dataset) -> Result<()> {
    let cfg = tr.net.cfg.clone();
    let size = [cfg.depth, cfg.size, cfg.size];
    let (cond, mask) = dataset.condition(0)?;
    let (_, real) = dataset.load(0)?;
    let sched = Schedule::cosine(tr.tc.timesteps);
    let seed = tr.tc.seed;
    let vol = tr.with_ema(|net| sample_volume(be, net, &sched, &cond, seed))?;
    let mut others = Vec::new();
    if let Some(w) = bundled_for_demo(run, &cfg)? {
        println!("comparison: {}", w.source);
        let mut net = UNet::new(be, &w.cfg, 1)?;
        net.set_params(be, &w.params)?;
        let v = sample_volume(be, &mut net, &sched, &cond, seed)?;
        others.extend(output::image_volumes(dataset.convention(), &v, cfg.out_channels, size, &mask)?);
    }
    let beside = Beside { others: &others, others_name: "bundled demo model", real: &real };
    let stem = run.out.join("sample_0");
    let paths =
        output::write_sample_with_views(&stem, dataset.convention(), &vol, cfg.out_channels, size, &mask, beside)?;
    for p in paths {
        println!("sample:     {}", p.display());
    }
    Ok(())
}

/// The bundled demo model, when the run trains on the built-in demo data with a model of the
/// same shape (its sample then sits beside the run's in the preview).
fn bundled_for_demo(run: &RunConfig, cfg: &UNetConfig) -> Result<Option<LoadedWeights>> {
    if data_source(run) != DataSource::Demo {
        return Ok(None);
    }
    Ok(bundled::load(WeightGroup::Ema, &LoadHints::default())?.filter(|w| w.cfg == *cfg))
}

fn sample_volume<B: Backend>(
    be: &B,
    net: &mut UNet<B>,
    sched: &Schedule,
    cond: &[f32],
    seed: u64,
) -> meddpm::Result<Vec<f32>> {
    // One volume with any network batch (a training net may have batch > 1): the batch is
    // padded with copies, and volume 0 is what a batch-1 network samples with this seed.
    let mut s = Sampler::new(be, net)?;
    let plan = meddpm::diffusion::plan(&SamplerSpec::ddpm(sched.timesteps), sched)?;
    let pb = bar(sched.timesteps as u64, "sample");
    let mut v = s.sample_jobs(be, net, &plan, &[(cond, seed)], |_| pb.inc(1))?;
    pb.finish();
    Ok(v.swap_remove(0))
}

/// Everything every rank must agree on before training together.
#[derive(serde::Serialize)]
struct Agreement<'a> {
    unet: &'a UNetConfig,
    train: &'a TrainConfig,
    step: u64,
    samples: u64,
    run: &'a RunConfig,
    pairs: usize,
    precision: Precision,
    layout: Layout,
}

/// One data-parallel training rank: its GPU, the rendezvous (every rank must agree on the
/// [`Agreement`]), the NCCL gradient sync, then the usual loop ([`train_on`]).
pub fn train_rank(a: &TrainArgs, env: DistEnv, plan: Plan) -> Result<()> {
    let be = crate::dist::rank_backend(&plan.backend, &env)?;
    let (tr, started) = start_trainer(&be, a, plan)?;
    let pairs = open_dataset(&started.run, &tr.net.cfg)?.len();
    let hash = config_hash(&Agreement {
        unet: &tr.net.cfg,
        train: &tr.tc,
        step: tr.step,
        samples: tr.samples,
        run: &started.run,
        pairs,
        precision: started.backend.precision(),
        layout: started.backend.layout(),
    });
    let timeout = Duration::from_secs(a.dist_timeout.max(1));
    let (ids, watch, slot) = crate::dist::join(&env, hash, timeout, 1)?;
    let plan = BucketPlan::for_unet(&tr.net.cfg, DEFAULT_BUCKET_BYTES);
    let mut sync = NcclSync::new(&be, &ids[0], env.rank, env.world, plan, timeout, Some(&slot))?;
    // once the session ended alike on every rank, leave the group with a goodbye: what follows
    // (rank 0's report and sample, an agreed divergence's error) must not look like a lost peer
    let watch = std::sync::Mutex::new(Some(watch));
    let close = || {
        if let Some(w) = watch.lock().unwrap_or_else(|e| e.into_inner()).take() {
            w.close();
        }
    };
    let ctx = RankCtx { sync: &mut sync, check_every: a.check_every, agreed_end: Box::new(close) };
    let r = train_on(&be, started, tr, Some(ctx));
    let open = watch.lock().unwrap_or_else(|e| e.into_inner()).take();
    match (r, open) {
        (Ok(()), w) => {
            if let Some(w) = w {
                w.close();
            }
            Ok(())
        }
        (Err(e), None) => Err(e.context(format!("rank {} of {}", env.rank, env.world))),
        (Err(e), Some(w)) => {
            // a failure during the session, maybe caused by a lost peer: let the watch name it
            // (it exits the process)
            std::thread::sleep(meddpm_cuda::collective::WATCH_GRACE);
            // dropping the watch without a goodbye stops the other ranks too
            drop(w);
            Err(e.context(format!("rank {} of {}", env.rank, env.world)))
        }
    }
}
