//! `train`, `sample`, `info`, `doctor`: argument structs, run-file (TOML) handling, backend
//! choice, and the loops with progress bars. The engine does the work; this file only wires.
//! Data-parallel runs (`--gpus`, torchrun, Slurm) are set up in `dist.rs` and use the same loop.

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use meddpm::checkpoint::{init_trainer_with, load_weights, save_trainer, Checkpoint, LoadedWeights, WeightGroup};
use meddpm::cpu::CpuBackend;
use meddpm::data::{preview, Convention, Dataset, Loader, Shard, Volume};
use meddpm::diffusion::{Sampler, Schedule, TrainConfig, Trainer};
use meddpm::dist::spawn::GpuSelection;
use meddpm::dist::{broadcast_state, check_weights, DistEnv};
use meddpm::model::{cost, UNet, UNetConfig};
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

/// Where the compute happens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Device {
    /// CUDA if a device is present, else CPU.
    Auto,
    Cpu,
    Cuda(usize),
}

fn parse_device(s: &str) -> Result<Device, String> {
    match s {
        "auto" => Ok(Device::Auto),
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(Device::Cuda)
            .ok_or_else(|| format!("'{s}' is not a device: use auto, cpu, cuda or cuda:N")),
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct BackendArgs {
    /// auto | cpu | cuda | cuda:N
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: Device,
    /// Convolution/GEMM math on the GPU: fp32 (true FMA) or tf32 (tensor cores).
    #[arg(long, value_enum, default_value = "tf32")]
    pub precision: PrecisionArg,
    /// Activation layout on the GPU: ndhwc (channels-last, default) or ncdhw.
    #[arg(long, value_enum, default_value = "ndhwc")]
    pub layout: LayoutArg,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum PrecisionArg {
    Fp32,
    Tf32,
}
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum LayoutArg {
    Ncdhw,
    Ndhwc,
}

impl BackendArgs {
    pub(crate) fn precision(&self) -> Precision {
        match self.precision {
            PrecisionArg::Fp32 => Precision::Fp32,
            PrecisionArg::Tf32 => Precision::Tf32,
        }
    }
    pub(crate) fn layout(&self) -> Layout {
        match self.layout {
            LayoutArg::Ncdhw => Layout::Ncdhw,
            LayoutArg::Ndhwc => Layout::Ndhwc,
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
                let $be = CpuBackend::new();
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
    /// Resume from a meddpm checkpoint (continues exactly: weights, EMA, Adam, step, RNG).
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
    /// (0: never); a difference stops the run.
    #[arg(long, default_value_t = 100)]
    pub check_every: u64,
    /// Data-parallel runs: seconds to wait for the other ranks (rendezvous, each gradient
    /// all-reduce) before failing.
    #[arg(long, default_value_t = 300)]
    pub dist_timeout: u64,
    #[command(flatten)]
    pub backend: BackendArgs,
}

/// Settle the configuration: run file < preset < flags; the demo is the default.
pub(crate) fn plan_train(a: &TrainArgs) -> Result<(UNetConfig, TrainConfig, RunConfig)> {
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

pub fn train(a: &TrainArgs) -> Result<()> {
    if let Some(sel) = &a.gpus {
        return crate::dist::launch_local(sel);
    }
    let (unet, tc, run) = plan_train(a)?;
    if let Some(env) = DistEnv::from_env()?.filter(|e| e.world > 1) {
        return crate::dist::train_rank(a, env, unet, tc, run);
    }
    with_backend!(a.backend, be => {
        let tr = make_trainer(&be, a, &unet, &tc)?;
        train_on(&be, tr, run, None)
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

/// Host (image, cond) batches from the loader.
struct Batches {
    loader: Loader,
    batch: usize,
}

impl Batches {
    fn next_batch(&mut self) -> meddpm::Result<(Vec<f32>, Vec<f32>)> {
        let (mut img, mut cond) = (Vec::new(), Vec::new());
        for _ in 0..self.batch {
            let s = self.loader.next()?;
            img.extend(s.image);
            cond.extend(s.cond);
        }
        Ok((img, cond))
    }
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

/// A fresh, resumed (`--resume`) or initialised (`--init-from`) trainer.
pub(crate) fn make_trainer<B: Backend>(
    be: &B,
    a: &TrainArgs,
    unet: &UNetConfig,
    tc: &TrainConfig,
) -> Result<Trainer<B>> {
    Ok(match &a.resume {
        Some(p) => {
            let ck = Checkpoint::read(p)?;
            let tr = ck.restore_trainer(be)?;
            if tr.net.cfg != *unet && a.config.is_some() {
                eprintln!("note: the checkpoint's model config is used; the run file's [unet] is ignored");
            }
            tr
        }
        None => match &a.init_from {
            Some(p) => {
                let w = load_weights(p, WeightGroup::Ema, Some((unet.depth, unet.size)))?;
                for m in &w.warnings {
                    eprintln!("warning: {}: {m}", p.display());
                }
                println!("init from {}", w.source);
                let mut tr = Trainer::new(be, &w.cfg, tc)?;
                init_trainer_with(be, &mut tr, &w)?;
                tr
            }
            None => Trainer::new(be, unet, tc)?,
        },
    })
}

/// What a data-parallel rank brings to the training loop (`dist.rs` makes it).
pub(crate) struct RankCtx<'a, B: Backend> {
    pub sync: &'a mut dyn meddpm::dist::GradSync<B>,
    pub check_every: u64,
}

/// The training loop. With `dist`, this process is one data-parallel rank: it reads its shard,
/// averages gradients through `dist.sync`, checks the weights every `check_every` steps, and only
/// rank 0 prints, logs, writes checkpoints and samples at the end.
pub(crate) fn train_on<B: Backend>(
    be: &B,
    mut tr: Trainer<B>,
    run: RunConfig,
    mut dist: Option<RankCtx<'_, B>>,
) -> Result<()> {
    if let Some(d) = &mut dist {
        tr.set_rank(d.sync.rank(), d.sync.world())?;
        broadcast_state(d.sync, be, &mut tr)?;
    }
    let (rank, world) = (tr.rank, tr.world);
    let lead = rank == 0;
    let cfg = tr.net.cfg.clone();
    let flops = cost::forward_flops(&cfg);
    if !lead {
        println!("rank {rank}/{world} on {}", be.describe());
    }
    let say = |m: String| {
        if lead {
            println!("{m}");
        }
    };
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
    let ckpt = run.out.join("checkpoint.safetensors");
    let dataset = open_dataset(&run, &cfg)?;
    let source = match (&run.masks, &run.manifest) {
        (Some(m), _) => m.display().to_string(),
        (None, Some(c)) => c.display().to_string(),
        (None, None) => "built-in demo pairs (MNI152-derived, 32³)".into(),
    };
    say(format!("data: {} pairs from {source}, {:?} convention; checking every pair…", dataset.len(), run.convention));
    dataset.validate()?;
    // this rank's part of the global sample stream, from the saved global position
    let shard = Shard::new(rank, world, tr.tc.batch)?;
    let loader = Loader::sharded(dataset.clone(), tr.tc.seed, run.workers, 2 * run.workers.max(1), tr.samples, shard);
    let mut data = Batches { loader, batch: tr.tc.batch };
    let mut log = String::new();
    let t0 = Instant::now();
    let start = tr.step;
    let pb = if lead { bar(run.steps.saturating_sub(start), "train") } else { ProgressBar::hidden() };
    let mut recent = Vec::new();
    while tr.step < run.steps {
        let loss = match &mut dist {
            None => tr.train_step(be, || data.next_batch())?,
            Some(d) => {
                let own = tr.train_step_synced(be, || data.next_batch(), d.sync)?;
                // the logged loss is the mean over the global batch, as one process would log it
                let all = d.sync.all_gather_u64(be, own.to_bits() as u64)?;
                let global = all.iter().map(|&b| f32::from_bits(b as u32)).sum::<f32>() / world as f32;
                if d.check_every > 0 && tr.step.is_multiple_of(d.check_every) {
                    check_weights(d.sync, be, &tr)?;
                }
                global
            }
        };
        if !loss.is_finite() {
            bail!("loss became {loss} at step {}; last good checkpoint: {}", tr.step, ckpt.display());
        }
        recent.push(loss);
        log.push_str(&format!("{},{loss}\n", tr.step));
        pb.set_message(format!("loss {loss:.4}"));
        pb.inc(1);
        if lead && run.checkpoint_every > 0 && tr.step.is_multiple_of(run.checkpoint_every) {
            save_trainer(&ckpt, be, &tr)?;
        }
    }
    pb.finish();
    if let Some(d) = &mut dist {
        check_weights(d.sync, be, &tr)?;
    }
    if !lead {
        println!("rank {rank}: done at step {}", tr.step);
        return Ok(());
    }
    save_trainer(&ckpt, be, &tr)?;
    let log_path = run.out.join("loss.csv");
    let mut prev = std::fs::read_to_string(&log_path).unwrap_or_else(|_| "step,loss\n".into());
    prev.push_str(&log);
    meddpm::checkpoint::write_atomic(&log_path, prev.as_bytes())?;
    let secs = t0.elapsed().as_secs_f64();
    let steps = tr.step - start;
    let tail = &recent[recent.len().saturating_sub(10)..];
    let first = &recent[..recent.len().min(10)];
    let mean = |v: &[f32]| if v.is_empty() { f32::NAN } else { v.iter().sum::<f32>() / v.len() as f32 };
    println!(
        "done: {steps} steps in {secs:.1} s ({:.2} steps/s); loss {:.4} (first 10) → {:.4} (last 10)",
        steps as f64 / secs.max(1e-9),
        mean(first),
        mean(tail)
    );
    println!("checkpoint: {}\nloss log:   {}", ckpt.display(), log_path.display());
    if run.sample_at_end {
        let (cond, mask) = dataset.condition(0)?;
        let (_, real) = dataset.load(0)?;
        let sched = Schedule::cosine(tr.tc.timesteps);
        let seed = tr.tc.seed;
        let vol = tr.with_ema(|net| sample_volume(be, net, &sched, &cond, seed))?;
        let paths = write_outputs(&run.out.join("sample_0"), &vol, &cfg, dataset.convention(), &mask, &real)?;
        for p in paths {
            println!("sample:     {}", p.display());
        }
    }
    Ok(())
}

/// Write a generated (C, D, H, W) volume as the convention's NIfTI files
/// (`meddpm::data::write_sample`: whole-head `<stem>.nii.gz`; BraTS `<stem>_{t1,t1ce,t2,flair}.nii.gz`
/// rescaled to [0, 1] and crop/padded to 240×240×155, plus `<stem>_mask.nii.gz`) and a PNG preview
/// (mask | generated | real when given). Returns the files written.
fn write_outputs(
    stem: &Path,
    vol: &[f32],
    cfg: &UNetConfig,
    conv: &Convention,
    mask: &Volume,
    real: &[Volume],
) -> Result<Vec<PathBuf>> {
    let size = [cfg.depth, cfg.size, cfg.size];
    let outs = meddpm::data::write_sample(stem, conv, vol, cfg.out_channels, size, mask)?;
    let mut written: Vec<PathBuf> = outs.iter().map(|(p, _)| p.clone()).collect();
    let png = stem.with_extension("png");
    let mut panel: Vec<(&Volume, preview::Kind)> = vec![(mask, preview::Kind::Labels)];
    panel.extend(outs.iter().filter(|(_, o)| !o.labels).map(|(_, o)| (&o.volume, preview::Kind::Intensity)));
    panel.extend(real.iter().map(|v| (v, preview::Kind::Intensity)));
    preview::write_png(&png, &panel)?;
    written.push(png);
    Ok(written)
}

fn sample_volume<B: Backend>(
    be: &B,
    net: &mut UNet<B>,
    sched: &Schedule,
    cond: &[f32],
    seed: u64,
) -> meddpm::Result<Vec<f32>> {
    let mut s = Sampler::new(be, net)?;
    let pb = bar(sched.timesteps as u64, "sample");
    let v = s.sample(be, net, sched, cond, seed, |_| pb.inc(1))?;
    pb.finish();
    Ok(v)
}

#[derive(clap::Args, Debug)]
pub struct SampleArgs {
    /// Weights: a meddpm checkpoint, a safetensors state dict (meddpm convert/export) or a
    /// PyTorch .pt (Med-DDPM {'step','model','ema'} or a bare state dict).
    #[arg(long)]
    pub checkpoint: PathBuf,
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
    #[arg(long, default_value_t = 250)]
    pub timesteps: usize,
    /// Conditioning mask (NIfTI). Default: the first built-in demo mask.
    #[arg(long)]
    pub mask: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "whole-head")]
    pub convention: ConventionName,
    /// Volumes to draw (seeds seed, seed+1, ...).
    #[arg(long, default_value_t = 1)]
    pub num_samples: u64,
    /// Output stem: writes <out>.nii.gz (or <out>_<i>.nii.gz) and a PNG preview beside it.
    #[arg(long, default_value = "sample")]
    pub out: PathBuf,
    /// Spread the volumes over GPUs of this machine, one process per GPU: a count (2), 'all', or
    /// device indices (0,1). The files are those one GPU writes. Under torchrun or srun, leave it
    /// out: rank r of W draws volumes r, r+W, ...
    #[arg(long)]
    pub gpus: Option<GpuSelection>,
    #[command(flatten)]
    pub backend: BackendArgs,
}

pub fn sample(a: &SampleArgs) -> Result<()> {
    if let Some(sel) = &a.gpus {
        return crate::dist::launch_local(sel);
    }
    let part = DistEnv::from_env()?.filter(|e| e.world > 1);
    let group = match a.weights {
        crate::convert::Weights::Ema => WeightGroup::Ema,
        crate::convert::Weights::Model => WeightGroup::Model,
    };
    let w = load_weights(&a.checkpoint, group, a.depth.zip(a.size))?;
    for m in &w.warnings {
        eprintln!("warning: {}: {m}", a.checkpoint.display());
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

/// Draw volumes `rank, rank + world, ...` of `0..num_samples` (all of them for one process).
fn sample_on<B: Backend>(be: &B, a: &SampleArgs, w: &LoadedWeights, rank: usize, world: usize) -> Result<()> {
    let cfg = w.cfg.clone();
    let mut net = UNet::new(be, &cfg, 1)?;
    net.set_params(be, &w.params)?;
    let size = [cfg.depth, cfg.size, cfg.size];
    let conv = a.convention.for_model(&cfg)?;
    let (cond, mask) = match &a.mask {
        Some(m) => meddpm::data::load_condition(m, &conv, size)?,
        None => meddpm::data::demo::dataset_at(size)?.condition(0)?,
    };
    let sched = Schedule::cosine(a.timesteps);
    let part = if world > 1 {
        format!(" (rank {rank} of {world}: volumes {rank}, {}, …)", rank + world)
    } else {
        String::new()
    };
    println!(
        "meddpm sample on {}: {} steps, {} volume(s) from seed {}{part}",
        be.describe(),
        a.timesteps,
        a.num_samples,
        a.seed
    );
    for k in (rank as u64..a.num_samples).step_by(world) {
        let t0 = Instant::now();
        let vol = sample_volume(be, &mut net, &sched, &cond, a.seed + k)?;
        let stem = if a.num_samples == 1 { a.out.clone() } else { PathBuf::from(format!("{}_{k}", a.out.display())) };
        let paths = write_outputs(&stem, &vol, &cfg, &conv, &mask, &[])?;
        let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        println!("seed {}: {:.1} s → {}", a.seed + k, t0.elapsed().as_secs_f64(), names.join(", "));
    }
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
    // The activation plan, counted without allocating (NullBackend buffers are lengths).
    let plan = UNet::new(&meddpm::analysis::timed::NullBackend::default(), &cfg, 1)?;
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    println!(
        "planned memory (B=1, fp32): activations+gradients+scratch {:.2} GiB; parameters, gradients, Adam m/v, EMA {:.2} GiB",
        gib(plan.act_bytes),
        gib(5 * 4 * params)
    );
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
