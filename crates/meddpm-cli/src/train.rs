//! `meddpm train`: the run's configuration (run file < preset < flags, or the run a checkpoint
//! records for `--resume`) and the trainer; the run itself is the engine's
//! (`meddpm::run::train_run`: folder, data checks, loop, previews; `sample_at_end`), whose events
//! this file prints as lines and progress bars. A data-parallel rank (`--gpus`, torchrun, Slurm)
//! joins its group through `dist.rs` and trains through the same `train_on`.

use crate::args::{
    bar, number_f32, preview_every, whole, whole_usize, with_backend, BackendArgs, ConventionName, Device, Preset,
    RunConfig, RunFile, MAX_BATCH,
};
use anyhow::{bail, Result};
use indicatif::ProgressBar;
use meddpm::checkpoint::{init_trainer_with, load_weights, Checkpoint, WeightGroup};
use meddpm::data::Dataset;
use meddpm::diffusion::{TrainConfig, Trainer};
use meddpm::dist::spawn::GpuSelection;
use meddpm::dist::{config_hash, BucketPlan, DistEnv, GradSync, DEFAULT_BUCKET_BYTES};
use meddpm::model::UNetConfig;
use meddpm::run::job::{sample_at_end, train_run, Event, RankJob, TrainJob};
use meddpm::run::{DataSource, Faults, Outcome, Overrides, PreviewEvery, RunRecord, StopFlag};
use meddpm::{Backend, Layout, Precision};
use meddpm_cuda::collective::NcclSync;
use std::path::{Path, PathBuf};
use std::time::Duration;

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
    let mut tc = file.train.clone().unwrap_or_else(|| TrainConfig::for_preset(preset.name()));
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
    Ok(meddpm::run::job::open_dataset(&data_source(run), &run.convention.for_model(unet)?, unet)?)
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

/// The training run of a plan (`meddpm::run::train_run`), printed: its events as lines and a
/// progress bar, then how it ended and the closing sample. With `dist`, this process is one
/// data-parallel rank: only rank 0 prints, writes the run folder and samples at the end.
pub(crate) fn train_on<B: Backend>(
    be: &B,
    started: Started,
    mut tr: Trainer<B>,
    dist: Option<RankCtx<'_, B>>,
) -> Result<()> {
    let Started { run, backend, old: old_record, resize, preview_every } = started;
    let rank = dist.as_ref().map_or(0, |d| d.sync.rank());
    let lead = rank == 0;
    let record = record_of(&run, &backend)?;
    let ckpt = meddpm::run::record::absolute(&run.out)?.join(meddpm::run::CHECKPOINT);
    let stop = StopFlag::install()?;
    stop.set_resume_command(resume_command(&ckpt, &backend));
    let job = TrainJob {
        convention: run.convention.for_model(&tr.net.cfg)?,
        record,
        resumed: old_record,
        resize,
        preview_every,
        stop: &stop,
        faults: Faults::from_env()?,
        ranks: dist.map(|d| RankJob { sync: d.sync, check_every: d.check_every, agreed_end: d.agreed_end }),
        first_line: format!("; {}", backend.precision_choice()),
    };
    let pb = std::cell::RefCell::new(ProgressBar::hidden());
    let report = train_run(be, &mut tr, job, |e| print_event(&pb, e))?;
    let pb = pb.into_inner();
    pb.finish();
    let summary = &report.summary;
    let (secs, steps) = (report.secs, summary.steps());
    let ckpt = &report.checkpoint;
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
                report.loss_csv.display()
            )
        }
        Outcome::Stopped => {
            println!(
                "stopped at step {} after {steps} steps in {secs:.1} s; checkpoint: {}",
                summary.end,
                ckpt.display()
            );
            println!("resume with: {}", resume_command(ckpt, &backend));
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
        report.loss_csv.display(),
        report.loss_svg.display()
    );
    if run.sample_at_end {
        let pb = std::cell::RefCell::new(ProgressBar::hidden());
        let paths = sample_at_end(be, &mut tr, &report, |e| print_event(&pb, e))?;
        pb.into_inner().finish();
        for p in paths {
            println!("sample:     {}", p.display());
        }
    }
    Ok(())
}

/// One event of a run as the terminal shows it: lines on stdout, notes and warnings on stderr,
/// the steps and the closing sample as progress bars.
fn print_event(pb: &std::cell::RefCell<ProgressBar>, e: Event) {
    let mut pb = pb.borrow_mut();
    match e {
        Event::Say(m) => pb.suspend(|| println!("{m}")),
        Event::Note(m) => pb.suspend(|| eprintln!("note: {m}")),
        Event::Warn(lines) => pb.suspend(|| {
            for (i, l) in lines.iter().enumerate() {
                if i == 0 {
                    eprintln!("warning: {l}");
                } else {
                    eprintln!("{l}");
                }
            }
        }),
        Event::Begin { steps } => *pb = bar(steps, "train"),
        Event::Step { loss, .. } => {
            pb.set_message(format!("loss {loss:.4}"));
            pb.inc(1);
        }
        Event::Preview { step, path, secs } => {
            pb.suspend(|| println!("preview: step {step} in {secs:.1} s: {}", path.display()))
        }
        Event::Sampling { done, total } => {
            if done == 1 {
                *pb = bar(total as u64, "sample");
            }
            pb.set_position(done as u64);
        }
    }
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

/// The hash of the [`Agreement`] every rank must share (checked by the rendezvous).
fn rank_hash<B: Backend>(tr: &Trainer<B>, started: &Started) -> Result<u64> {
    let pairs = open_dataset(&started.run, &tr.net.cfg)?.len();
    Ok(config_hash(&Agreement {
        unet: &tr.net.cfg,
        train: &tr.tc,
        step: tr.step,
        samples: tr.samples,
        run: &started.run,
        pairs,
        precision: started.backend.precision(),
        layout: started.backend.layout(),
    }))
}

/// One data-parallel training rank: its GPU, the rendezvous (every rank must agree on the
/// [`Agreement`]), the NCCL gradient sync, then the usual loop ([`train_on`]). With `--device
/// cpu`, a CPU rank whose gradients are averaged over TCP (`meddpm::dist::TcpSync`).
pub fn train_rank(a: &TrainArgs, env: DistEnv, plan: Plan) -> Result<()> {
    let timeout = Duration::from_secs(a.dist_timeout.max(1));
    if matches!(plan.backend.resolve(), Device::Cpu) {
        // CPU ranks as processes: the collective runs over the rendezvous links (TcpSync)
        let be = crate::dist::cpu_rank_backend(&plan.backend)?;
        let (tr, started) = start_trainer(&be, a, plan)?;
        let hash = rank_hash(&tr, &started)?;
        let mut sync = crate::dist::join_cpu(&env, hash, timeout, &tr.net.cfg)?;
        let ctx = RankCtx { sync: &mut sync, check_every: a.check_every, agreed_end: Box::new(|| {}) };
        let r = train_on(&be, started, tr, Some(ctx));
        return r.map_err(|e| e.context(format!("rank {} of {}", env.rank, env.world)));
    }
    let be = crate::dist::rank_backend(&plan.backend, &env)?;
    let (tr, started) = start_trainer(&be, a, plan)?;
    let hash = rank_hash(&tr, &started)?;
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
