//! `train`, `sample`, `info`, `doctor`: argument structs, run-file (TOML) handling, backend
//! choice, and the loops with progress bars. The engine does the work (`meddpm::run` for the
//! run folder: record, resume, loss log, safe stop); this file only wires. Data-parallel runs
//! (`--gpus`, torchrun, Slurm) are set up in `dist.rs` and train through the same `train_on`.
//!
//! Kept in the library instead (moved from here): data source ↔ masks/images/manifest settings
//! (`meddpm::run::DataSource::{from_paths, paths}`), the host batch (`data::Loader::next_batch`),
//! the closing line's loss means (`run::Summary::loss_means`), a sample's files with PNG
//! preview and viewer page plus the mask × seed file stems (`data::output::{write_sample_with_views,
//! image_volumes, sample_stems}`), what a run continues from (a resume's loss log, the checkpoint
//! step on disk, data changes, the note for a replaced checkpoint: `run::Continuation`) and the
//! progress bar's step count (`run::StepPlan`). The run-file types stay here: `Preset` and
//! `ConventionName` derive clap's `ValueEnum` (`RunFile` and `RunConfig` hold them).

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use meddpm::checkpoint::{bundled, init_trainer_with, load_weights, Checkpoint, LoadHints, LoadedWeights, WeightGroup};
use meddpm::cpu::CpuBackend;
use meddpm::data::output::{self, Beside};
use meddpm::data::{Convention, Dataset, Loader, Shard, Volume};
use meddpm::diffusion::{Sampler, SamplerKind, SamplerSpec, Schedule, TrainConfig, Trainer};
use meddpm::dist::spawn::GpuSelection;
use meddpm::dist::{DistEnv, GradSync};
use meddpm::eval::samplers::{BatchTiming, SampleTiming, TimedVolume};
use meddpm::model::{cost, UNet, UNetConfig};
use meddpm::run::{
    Continuation, DataSource, Faults, Outcome, Overrides, Ranks, RunRecord, Session, StepPlan, StopFlag,
};
use meddpm::{Backend, Layout, Precision};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Named model presets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Preset {
    /// 32³, 8 base channels, 4 levels: the built-in CPU demo.
    Demo,
    /// 8³ test model.
    Tiny,
    /// The reference whole-head model (128³, 40.2 M parameters).
    WholeHead,
    /// The reference BraTS 4-modality model (192×192×144, 57.6 M parameters).
    Brats,
}

impl Preset {
    pub fn unet(self) -> UNetConfig {
        match self {
            Preset::Demo => UNetConfig {
                depth: 32,
                size: 32,
                model_channels: 8,
                channel_mult: vec![1, 2, 2, 4],
                attention_ds: vec![4],
                groups: 4,
                ..UNetConfig::whole_head()
            },
            Preset::Tiny => UNetConfig::tiny(),
            Preset::WholeHead => UNetConfig::whole_head(),
            Preset::Brats => UNetConfig::brats(),
        }
    }
}

/// Where the compute happens (`auto`: CUDA if a device is present, else CPU).
pub use meddpm::DeviceSel as Device;

fn parse_device(s: &str) -> Result<Device, String> {
    s.parse()
}

#[derive(clap::Args, Clone, Debug)]
pub struct BackendArgs {
    /// auto | cpu | cuda | cuda:N
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: Device,
    /// Precision on the GPU: fp32 (true FMA), tf32 (tensor-core convs and GEMMs) or bf16 (activations
    /// stored in bf16, bf16 tensor-core convs, fp32 statistics/loss/weights/optimizer); on the CPU
    /// bf16 emulates the GPU's bf16 rounding, fp32 and tf32 are the fp32 reference [default: tf32;
    /// a resumed run: its own].
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionArg>,
    /// Activation layout on the GPU: ndhwc (channels-last) or ncdhw [default: ndhwc; a resumed
    /// run: its own].
    #[arg(long, value_enum)]
    pub layout: Option<LayoutArg>,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum PrecisionArg {
    Fp32,
    Tf32,
    Bf16,
}
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum LayoutArg {
    Ncdhw,
    Ndhwc,
}

impl BackendArgs {
    pub(crate) fn precision(&self) -> Precision {
        match self.precision.unwrap_or(PrecisionArg::Tf32) {
            PrecisionArg::Fp32 => Precision::Fp32,
            PrecisionArg::Tf32 => Precision::Tf32,
            PrecisionArg::Bf16 => Precision::Bf16,
        }
    }
    pub(crate) fn layout(&self) -> Layout {
        match self.layout.unwrap_or(LayoutArg::Ndhwc) {
            LayoutArg::Ncdhw => Layout::Ncdhw,
            LayoutArg::Ndhwc => Layout::Ndhwc,
        }
    }
    /// These arguments with `p` and `l` where no flag gave them.
    fn with_defaults(&self, p: Precision, l: Layout) -> BackendArgs {
        let precision = Some(match p {
            Precision::Fp32 => PrecisionArg::Fp32,
            Precision::Tf32 => PrecisionArg::Tf32,
            Precision::Bf16 => PrecisionArg::Bf16,
        });
        let layout = Some(match l {
            Layout::Ncdhw => LayoutArg::Ncdhw,
            Layout::Ndhwc => LayoutArg::Ndhwc,
        });
        BackendArgs {
            device: self.device.clone(),
            precision: self.precision.or(precision),
            layout: self.layout.or(layout),
        }
    }
    /// The device to use: `Auto` becomes CUDA 0 when a device answers, else the CPU.
    fn resolve(&self) -> Device {
        match &self.device {
            Device::Auto => match meddpm_cuda::probe() {
                Ok(_) => Device::Cuda(0),
                Err(_) => Device::Cpu,
            },
            d => d.clone(),
        }
    }
}

/// Run `$body` with `$be` bound to the chosen backend (the one place backends are picked).
macro_rules! with_backend {
    ($args:expr, $be:ident => $body:expr) => {{
        match $args.resolve() {
            Device::Cpu | Device::Auto => {
                let $be = CpuBackend::with_precision(match $args.precision() {
                    Precision::Bf16 => Precision::Bf16,
                    Precision::Fp32 | Precision::Tf32 => Precision::Fp32,
                })?;
                $body
            }
            Device::Cuda(i) => {
                let $be = meddpm_cuda::CudaBackend::new(i, $args.precision(), $args.layout())?;
                $body
            }
        }
    }};
}

/// What a `--config` TOML file may hold: `[unet]`, `[train]` and `[run]` tables.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunFile {
    pub preset: Option<Preset>,
    pub unet: Option<UNetConfig>,
    pub train: Option<TrainConfig>,
    pub run: RunConfig,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    /// Optimizer steps to reach.
    pub steps: u64,
    /// Save a checkpoint every N steps (0: only at the end).
    pub checkpoint_every: u64,
    /// Output folder (checkpoint, loss log, samples).
    pub out: PathBuf,
    /// Sample one volume with the EMA weights at the end.
    pub sample_at_end: bool,
    /// Folder of mask NIfTIs (none: the built-in demo data).
    pub masks: Option<PathBuf>,
    /// Image folder(s) paired with the masks by the digits in file names (BraTS: 4, in
    /// T1, T1ce, T2, FLAIR order).
    pub images: Vec<PathBuf>,
    /// CSV manifest `mask,image[,image...]` instead of folders.
    pub manifest: Option<PathBuf>,
    /// Data convention.
    pub convention: ConventionName,
    /// Background decoding threads.
    pub workers: usize,
}

/// Named data conventions (see `meddpm::data::convention`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ConventionName {
    /// Whole-head, image scaled by one global min-max (default).
    WholeHead,
    /// Whole-head exactly as the reference: per-axial-slice min-max of the image.
    WholeHeadReference,
    /// BraTS 4 modalities, preprocessed inputs.
    Brats,
    /// BraTS 4 modalities, raw 240×240×155 inputs: crop, rescale and brain label on load.
    BratsRaw,
}

impl ConventionName {
    /// The CLI name (`whole-head`, ...), as run records store it.
    pub fn name(self) -> String {
        clap::ValueEnum::to_possible_value(&self).expect("no variant is skipped").get_name().to_string()
    }

    /// The convention called `name` (a run record's).
    pub fn from_name(name: &str) -> Result<ConventionName> {
        <ConventionName as clap::ValueEnum>::from_str(name, false)
            .map_err(|_| anyhow::anyhow!("unknown data convention '{name}' in the run record"))
    }

    /// The convention for `unet`, checked against its channel counts.
    pub fn for_model(self, unet: &UNetConfig) -> Result<Convention> {
        let mut c = match self {
            ConventionName::WholeHead => Convention::whole_head(),
            ConventionName::WholeHeadReference => Convention::whole_head_reference(),
            ConventionName::Brats => Convention::brats(),
            ConventionName::BratsRaw => Convention { brats_preprocess: true, ..Convention::brats() },
        };
        if c.preset == meddpm::data::Preset::WholeHead {
            c.num_labels = unet.cond_channels() + 1;
        }
        if c.image_channels() != unet.out_channels || c.cond_channels() != unet.cond_channels() {
            bail!(
                "the {self:?} data convention gives {} image and {} condition channels; the model has {} out and {} in \
                 channels (in = out + condition)",
                c.image_channels(),
                c.cond_channels(),
                unet.out_channels,
                unet.in_channels
            );
        }
        Ok(c)
    }
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            steps: 200,
            checkpoint_every: 100,
            out: PathBuf::from("runs/demo"),
            sample_at_end: true,
            masks: None,
            images: Vec::new(),
            manifest: None,
            convention: ConventionName::WholeHead,
            workers: 2,
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// Run file (TOML) with [unet], [train], [run] tables; flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Model preset (ignored when the run file has a [unet] table).
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
    /// Optimizer steps to reach (each is grad_accum micro-steps).
    #[arg(long)]
    pub steps: Option<u64>,
    #[arg(long)]
    pub lr: Option<f32>,
    /// Micro-steps (batches) accumulated per optimizer step.
    #[arg(long)]
    pub grad_accum: Option<usize>,
    #[arg(long)]
    pub seed: Option<u64>,
    #[arg(long)]
    pub batch: Option<usize>,
    #[arg(long)]
    pub checkpoint_every: Option<u64>,
    /// Output folder.
    #[arg(long)]
    pub out: Option<PathBuf>,
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
    #[arg(long, value_enum)]
    pub convention: Option<ConventionName>,
    /// Data-parallel training on this machine, one process per GPU: a count (2), 'all', or device
    /// indices (0,1). Batch, lr and steps are per optimizer step as before; the global batch is
    /// batch × GPUs. Under torchrun or srun, leave it out: the launcher starts the ranks.
    #[arg(long)]
    pub gpus: Option<GpuSelection>,
    /// Data-parallel runs: compare the weights of all ranks by hash every N optimizer steps
    /// (0: only at the end); a difference stops the run.
    #[arg(long, default_value_t = 100)]
    pub check_every: u64,
    /// Data-parallel runs: seconds to wait for the other ranks (rendezvous, each gradient
    /// all-reduce) before failing.
    #[arg(long, default_value_t = 300)]
    pub dist_timeout: u64,
    #[command(flatten)]
    pub backend: BackendArgs,
}

/// Settle the configuration of a new run (or of a resumed checkpoint without a run record):
/// run file < preset < flags; the demo is the default.
fn plan_from_flags(a: &TrainArgs) -> Result<(UNetConfig, TrainConfig, RunConfig)> {
    let file = match &a.config {
        Some(p) => {
            let s = std::fs::read_to_string(p).with_context(|| format!("reading run file {}", p.display()))?;
            toml::from_str::<RunFile>(&s).with_context(|| format!("run file {}", p.display()))?
        }
        None => RunFile::default(),
    };
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

fn precision_of(p: PrecisionArg) -> Precision {
    BackendArgs { device: Device::Auto, precision: Some(p), layout: None }.precision()
}
fn layout_of(l: LayoutArg) -> Layout {
    BackendArgs { device: Device::Auto, precision: None, layout: Some(l) }.layout()
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
                precision: a.backend.precision.map(precision_of),
                layout: a.backend.layout.map(layout_of),
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

pub fn train(a: &TrainArgs) -> Result<()> {
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
            if demo && a.steps.is_none() && matches!(a.backend.resolve(), Device::Cuda(_)) {
                run.steps = GPU_DEMO_STEPS;
                run.checkpoint_every = 1000;
                println!("demo on the GPU: {GPU_DEMO_STEPS} steps (--steps to change)");
            }
            Plan { unet, tc, run, backend: a.backend.clone(), resume: None }
        }
    };
    if let Some(env) = env {
        return crate::dist::train_rank(a, env, plan);
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

fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(&format!(
            "{what} {{bar:30}} {{pos}}/{{len}} [{{elapsed_precise}}<{{eta_precise}}, {{per_sec}}] {{msg}}"
        ))
        .expect("valid template"),
    );
    pb
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
    Ok((tr, Started { run, backend, old }))
}

/// What the loop needs of a plan once its trainer exists.
pub(crate) struct Started {
    pub run: RunConfig,
    pub backend: BackendArgs,
    pub old: OldRun,
}

/// What a data-parallel rank brings to the training loop (`dist.rs` makes it).
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
    let Started { mut run, backend, old: old_record } = started;
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
        "meddpm train on {}{}",
        be.describe(),
        if world > 1 { format!(" (rank 0 of {world})") } else { String::new() }
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
        "training: steps {} → {} (batch {}{ranks} × accum {}), lr {:e}, loss {:?}, seed {}, activations {:.1} MiB",
        tr.step,
        run.steps,
        tr.tc.batch,
        tr.tc.grad_accum,
        tr.tc.lr,
        tr.tc.loss,
        tr.tc.seed,
        tr.net.act_bytes as f64 / (1 << 20) as f64
    ));
    if lead {
        std::fs::create_dir_all(&run.out).with_context(|| format!("creating {}", run.out.display()))?;
    }
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
    dataset.validate()?;
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
    let faults = Faults::from_env()?;
    if faults.any() && lead {
        eprintln!("note: test fault injection armed: {faults:?}");
    }
    // this rank's part of the global sample stream, from the saved global position
    let shard = Shard::new(rank, world, tr.tc.batch)?;
    let mut loader =
        Loader::sharded(dataset.clone(), tr.tc.seed, run.workers, 2 * run.workers.max(1), tr.samples, shard);
    let batch = tr.tc.batch;
    let saved_step = continued.saved_step();
    let steps_left = StepPlan::new(&record, &tr).steps_left();
    let mut session = Session { dir: run.out.clone(), record, log, stop: &stop, faults, saved_step };
    let t0 = Instant::now();
    let pb = if lead { bar(steps_left, "train") } else { ProgressBar::hidden() };
    let (ranks, agreed_end) = match dist {
        Some(d) => (Some(Ranks { sync: d.sync, check_every: d.check_every }), Some(d.agreed_end)),
        None => (None, None),
    };
    let summary = session.run_ranked(
        be,
        &mut tr,
        ranks,
        || loader.next_batch(batch),
        |_, loss| {
            pb.set_message(format!("loss {loss:.4}"));
            pb.inc(1);
        },
    )?;
    if let Some(f) = agreed_end {
        f();
    }
    pb.finish();
    let secs = t0.elapsed().as_secs_f64();
    let steps = summary.steps();
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
    let beside = Beside { others: &others, real: &real };
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

/// `--sampler`: the samplers of `meddpm::diffusion::solvers`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SamplerArg {
    /// Ancestral DDPM: the reference sampler with all T steps; fewer steps use Improved-DDPM
    /// respacing
    Ddpm,
    /// DDIM (Song et al. 2021): --eta 0 deterministic, 1 = ancestral variance (η = 1 with all
    /// steps is DDPM); linear timestep selection ⌊i·T/S⌋
    Ddim,
    /// DPM-Solver++(2M) (Lu et al. 2022): multistep second order in data prediction, x̂₀ clipped
    /// to [−1, 1], time-uniform steps
    #[value(name = "dpm-solver++")]
    DpmSolverPp,
    /// iPNDM of DEIS (Zhang & Chen 2023): the Adams–Bashforth DDIM variant of the reference's
    /// fast-sampling script (10 steps there), timesteps ⌊i·(T−1)/S⌋
    Ipndm,
}

impl SamplerArg {
    pub fn kind(self) -> SamplerKind {
        match self {
            SamplerArg::Ddpm => SamplerKind::Ddpm,
            SamplerArg::Ddim => SamplerKind::Ddim,
            SamplerArg::DpmSolverPp => SamplerKind::DpmSolverPp,
            SamplerArg::Ipndm => SamplerKind::Ipndm,
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct SampleArgs {
    /// Weights: a meddpm checkpoint, a safetensors state dict (meddpm convert/export) or a
    /// PyTorch .pt (Med-DDPM {'step','model','ema'} or a bare state dict). Default: the demo
    /// model bundled into this binary (testdata/demo/model.safetensors), when it has one.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Which weights: ema (as the reference samples) or model (online); ignored for a plain state dict.
    #[arg(long, value_enum, default_value = "ema")]
    pub weights: crate::convert::Weights,
    /// Volume depth D [default: the file's config; 128 whole-head, 144 BraTS for .pt files].
    #[arg(long, requires = "size")]
    pub depth: Option<usize>,
    /// Volume height = width [default: the file's config; 128 whole-head, 192 BraTS for .pt files].
    #[arg(long, requires = "depth")]
    pub size: Option<usize>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// T of the cosine schedule the model was trained with.
    #[arg(long, default_value_t = 250)]
    pub timesteps: usize,
    /// The sampler.
    #[arg(long, value_enum, default_value = "ddpm")]
    pub sampler: SamplerArg,
    /// Network evaluations per volume, 1..=T [default: T, all of them].
    #[arg(long)]
    pub steps: Option<usize>,
    /// DDIM's η in [0, 1] (ddim only) [default: 0].
    #[arg(long)]
    pub eta: Option<f64>,
    /// Conditioning mask(s) (NIfTI). Default: the first built-in demo mask.
    #[arg(long, num_args = 1..)]
    pub mask: Vec<PathBuf>,
    #[arg(long, value_enum, default_value = "whole-head")]
    pub convention: ConventionName,
    /// Volumes to draw per mask (seeds seed, seed+1, ...).
    #[arg(long, default_value_t = 1)]
    pub num_samples: u64,
    /// Volumes per network batch; different masks and seeds share a batch, and every volume is
    /// the one it would be alone.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Output stem: writes <out>.nii.gz (or <out>_<i>.nii.gz, with several masks
    /// <out>_<mask>_<i>.nii.gz), a PNG preview beside each, and <out>_timing.json.
    #[arg(long, default_value = "sample")]
    pub out: PathBuf,
    /// Spread the volumes over GPUs of this machine, one process per GPU: a count (2), 'all', or
    /// device indices (0,1). The volume files are those one GPU writes. Under torchrun or srun,
    /// leave it out: rank r of W draws volumes r, r+W, … (each writes <out>_timing_rank<r>.json).
    #[arg(long)]
    pub gpus: Option<GpuSelection>,
    #[command(flatten)]
    pub backend: BackendArgs,
}

pub fn sample(a: &SampleArgs) -> Result<()> {
    if let Some(sel) = &a.gpus {
        let world = crate::dist::launch_local(sel)?;
        return crate::dist::merge_timing(&a.out, world);
    }
    let part = DistEnv::from_env()?.filter(|e| e.world > 1);
    let group = match a.weights {
        crate::convert::Weights::Ema => WeightGroup::Ema,
        crate::convert::Weights::Model => WeightGroup::Model,
    };
    let w = match &a.checkpoint {
        Some(p) => load_weights(p, group, a.depth.zip(a.size))?,
        None => {
            let hints = LoadHints { size: a.depth.zip(a.size), ..LoadHints::default() };
            match bundled::load(group, &hints)? {
                Some(w) => w,
                None => bail!("no --checkpoint given, and {}", bundled::absent_message()),
            }
        }
    };
    let name = a.checkpoint.as_deref().unwrap_or(Path::new(bundled::PATH));
    for m in &w.warnings {
        eprintln!("warning: {}: {m}", name.display());
    }
    println!("weights: {}", w.source);
    match &part {
        Some(env) => {
            let be = crate::dist::rank_backend(&a.backend, env)?;
            sample_on(&be, a, &w, env.rank, env.world)
        }
        None => with_backend!(a.backend, be => sample_on(&be, a, &w, 0, 1)),
    }
}

/// Draw the volumes (mask × seed jobs) `rank, rank + world, …` — all of them for one process —
/// in batches of `--batch`. Each volume's noise comes from its own seed, so which rank draws it
/// and in which batch changes nothing in its file.
fn sample_on<B: Backend>(be: &B, a: &SampleArgs, w: &LoadedWeights, rank: usize, world: usize) -> Result<()> {
    let cfg = w.cfg.clone();
    let size = [cfg.depth, cfg.size, cfg.size];
    let conv = a.convention.for_model(&cfg)?;
    // (name, condition, label volume) per mask
    let masks: Vec<(String, Vec<f32>, Volume)> = if a.mask.is_empty() {
        let (c, m) = meddpm::data::demo::dataset_at(size)?.condition(0)?;
        vec![("built-in demo mask 0".into(), c, m)]
    } else {
        let mut v = Vec::new();
        for p in &a.mask {
            let (c, m) = meddpm::data::load_condition(p, &conv, size)?;
            v.push((p.display().to_string(), c, m));
        }
        v
    };
    let sched = Schedule::cosine(a.timesteps);
    let spec = SamplerSpec { kind: a.sampler.kind(), steps: a.steps.unwrap_or(a.timesteps), eta: a.eta.unwrap_or(0.0) };
    let plan = meddpm::diffusion::plan(&spec, &sched)?;
    if a.batch == 0 || a.num_samples == 0 {
        bail!("--batch and --num-samples must be at least 1");
    }
    // (mask index, seed, output stem) per volume
    let jobs = output::sample_stems(&a.out, &a.mask, a.num_samples, a.seed);
    let total = jobs.len();
    let jobs: Vec<_> = jobs.into_iter().skip(rank).step_by(world).collect();
    if jobs.is_empty() {
        println!("rank {rank} of {world}: no volume left for this rank ({total} for {world} ranks)");
        return Ok(());
    }
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let b = a.batch.min(jobs.len());
    let mut net = UNet::new(be, &cfg, b)?;
    net.set_params(be, &w.params)?;
    let mut s = Sampler::new(be, &net)?;
    let part = if world > 1 {
        format!(" (rank {rank} of {world}: {} of the {total} volumes, jobs {rank}, {}, …)", jobs.len(), rank + world)
    } else {
        String::new()
    };
    println!(
        "meddpm sample on {}: {spec} (T = {}), {} volume(s) from seed {}, {b} per batch{part}",
        be.describe(),
        a.timesteps,
        jobs.len(),
        a.seed
    );
    let batches = jobs.len().div_ceil(b);
    let pb = bar((batches * spec.steps) as u64, "sample");
    let mut timing = SampleTiming {
        tool: format!("meddpm {} sample", env!("CARGO_PKG_VERSION")),
        device: be.describe(),
        sampler: spec,
        timesteps: a.timesteps,
        batch: b,
        batches: Vec::new(),
        ranks: 1,
    };
    for chunk in jobs.chunks(b) {
        let inputs: Vec<(&[f32], u64)> = chunk.iter().map(|(m, seed, _)| (masks[*m].1.as_slice(), *seed)).collect();
        be.sync();
        let t0 = Instant::now();
        let vols = s.sample_jobs(be, &mut net, &plan, &inputs, |_| pb.inc(1))?;
        let secs = t0.elapsed().as_secs_f64();
        let mut volumes = Vec::new();
        for ((m, seed, stem), vol) in chunk.iter().zip(&vols) {
            let paths = output::write_sample_with_views(
                stem,
                &conv,
                vol,
                cfg.out_channels,
                size,
                &masks[*m].2,
                Beside::default(),
            )?;
            let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
            pb.println(format!("seed {seed}, {}: {}", masks[*m].0, names.join(", ")));
            volumes.push(TimedVolume { file: names[0].clone(), mask: masks[*m].0.clone(), seed: *seed });
        }
        pb.println(format!("batch of {}: {secs:.2} s ({:.3} s/volume)", chunk.len(), secs / chunk.len() as f64));
        timing.batches.push(BatchTiming { seconds: secs, volumes });
    }
    pb.finish_and_clear();
    let tpath = crate::dist::timing_path(&a.out, rank, world);
    meddpm::checkpoint::write_atomic(&tpath, serde_json::to_string_pretty(&timing)?.as_bytes())?;
    println!(
        "{} volume(s): {:.3} s/volume (after the first batch when there are several); timing: {}",
        timing.volumes(),
        timing.seconds_per_volume(),
        tpath.display()
    );
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct InfoArgs {
    #[arg(long, value_enum, default_value = "whole-head")]
    pub preset: Preset,
}

pub fn info(a: &InfoArgs) -> Result<()> {
    let cfg = a.preset.unet();
    let f = cost::forward_flops(&cfg);
    println!("{}", toml::to_string(&cfg)?);
    let params = meddpm::model::param_count(&cfg);
    println!("parameters:          {params}");
    println!(
        "forward GFLOP (B=1): {:.1} (conv {:.1}, attention {:.1}, linear {:.3})",
        f.total() / 1e9,
        f.conv / 1e9,
        f.attention / 1e9,
        f.linear / 1e9
    );
    println!("train micro-step GFLOP: {:.1}", f.train_step(&cfg) / 1e9);
    // The buffer plan, counted without allocating (NullBackend buffers are lengths), per storage
    // precision (fp32 and tf32 store the same).
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    let plans = [Precision::Fp32, Precision::Bf16]
        .map(|p| UNet::new(&meddpm::analysis::timed::NullBackend { precision: p, ..Default::default() }, &cfg, 1));
    let [p32, p16] = plans;
    let (p32, p16) = (p32?, p16?);
    println!("\nplanned memory, batch 1 (GiB)       fp32/tf32      bf16");
    for ((name, a), (_, b)) in p32.mem.rows().iter().zip(p16.mem.rows().iter()) {
        println!("  {name:<50} {:>8.3}  {:>8.3}", gib(*a), gib(*b));
    }
    let opt = 3 * 4 * params;
    println!("  {:<50} {:>8.3}  {:>8.3}", "EMA weights, Adam m and v (f32)", gib(opt), gib(opt));
    println!("  {:<50} {:>8.3}  {:>8.3}", "total", gib(p32.mem.total() + opt), gib(p16.mem.total() + opt));
    Ok(())
}

pub fn doctor() -> Result<()> {
    println!("meddpm {}", env!("CARGO_PKG_VERSION"));
    println!("cpu: {} threads (rayon)", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    match meddpm_cuda::probe() {
        Ok(s) => println!("{s}\n{}", meddpm_cuda::doctor()),
        Err(e) => println!("{e}"),
    }
    Ok(())
}
