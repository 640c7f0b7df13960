//! `train`, `sample`, `info`, `doctor`: argument structs, run-file (TOML) handling, backend
//! choice, and the loops with progress bars. The engine does the work; this file only wires.

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use meddpm::checkpoint::{save_trainer, Checkpoint};
use meddpm::cpu::CpuBackend;
use meddpm::diffusion::{Sampler, Schedule, TrainConfig, Trainer};
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
    fn precision(&self) -> Precision {
        match self.precision {
            PrecisionArg::Fp32 => Precision::Fp32,
            PrecisionArg::Tf32 => Precision::Tf32,
        }
    }
    fn layout(&self) -> Layout {
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
                let _ = ($args.precision(), $args.layout());
                anyhow::bail!("cuda:{i}: the CUDA backend is not wired into the CLI yet")
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
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig { steps: 200, checkpoint_every: 100, out: PathBuf::from("runs/demo"), sample_at_end: true }
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
    #[command(flatten)]
    pub backend: BackendArgs,
}

/// Settle the configuration: run file < preset < flags; the demo is the default.
fn plan_train(a: &TrainArgs) -> Result<(UNetConfig, TrainConfig, RunConfig)> {
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
    unet.validate()?;
    tc.validate()?;
    Ok((unet, tc, run))
}

pub fn train(a: &TrainArgs) -> Result<()> {
    let (unet, tc, run) = plan_train(a)?;
    with_backend!(a.backend, be => train_on(&be, a, unet, tc, run))
}

/// Host (image, cond) batches for training: the built-in phantom pairs for now.
struct Data {
    dims: [usize; 3],
    batch: usize,
    next: u64,
}

impl Data {
    fn next_batch(&mut self) -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut img, mut cond) = (Vec::new(), Vec::new());
        for _ in 0..self.batch {
            let (i, c) = meddpm::phantom::pair(self.dims[0], self.dims[1], self.dims[2], (self.next % 4) as u32);
            img.extend(i);
            cond.extend(c);
            self.next += 1;
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

fn train_on<B: Backend>(be: &B, a: &TrainArgs, unet: UNetConfig, tc: TrainConfig, run: RunConfig) -> Result<()> {
    let mut tr = match &a.resume {
        Some(p) => {
            let ck = Checkpoint::read(p)?;
            let tr = ck.restore_trainer(be)?;
            if tr.net.cfg != unet && a.config.is_some() {
                eprintln!("note: the checkpoint's model config is used; the run file's [unet] is ignored");
            }
            tr
        }
        None => Trainer::new(be, &unet, &tc)?,
    };
    let cfg = tr.net.cfg.clone();
    let flops = cost::forward_flops(&cfg);
    println!("meddpm train on {}", be.describe());
    println!(
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
    );
    println!(
        "training: steps {} → {} (batch {} × accum {}), lr {:e}, loss {:?}, seed {}, activations {:.1} MiB",
        tr.step,
        run.steps,
        tr.tc.batch,
        tr.tc.grad_accum,
        tr.tc.lr,
        tr.tc.loss,
        tr.tc.seed,
        tr.net.act_bytes as f64 / (1 << 20) as f64
    );
    std::fs::create_dir_all(&run.out).with_context(|| format!("creating {}", run.out.display()))?;
    let ckpt = run.out.join("checkpoint.safetensors");
    let mut data =
        Data { dims: [cfg.depth, cfg.size, cfg.size], batch: tr.tc.batch, next: tr.draws * tr.tc.batch as u64 };
    let mut log = String::new();
    let t0 = Instant::now();
    let start = tr.step;
    let pb = bar(run.steps.saturating_sub(start), "train");
    let mut recent = Vec::new();
    while tr.step < run.steps {
        let loss = tr.train_step(be, || data.next_batch().map_err(|e| meddpm::Error::Backend(e.to_string())))?;
        if !loss.is_finite() {
            bail!("loss became {loss} at step {}; last good checkpoint: {}", tr.step, ckpt.display());
        }
        recent.push(loss);
        log.push_str(&format!("{},{loss}\n", tr.step));
        pb.set_message(format!("loss {loss:.4}"));
        pb.inc(1);
        if run.checkpoint_every > 0 && tr.step % run.checkpoint_every == 0 {
            save_trainer(&ckpt, be, &tr)?;
        }
    }
    pb.finish();
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
        let (_, cond) = meddpm::phantom::pair(cfg.depth, cfg.size, cfg.size, 0);
        let sched = Schedule::cosine(tr.tc.timesteps);
        let seed = tr.tc.seed;
        let vol = tr.with_ema(|net| sample_volume(be, net, &sched, &cond, seed))?;
        let path = run.out.join("sample_0.safetensors");
        write_sample(&path, &vol, [cfg.depth, cfg.size, cfg.size])?;
        println!("sample:     {}", path.display());
    }
    Ok(())
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

/// Write a sampled volume (C, D, H, W) as a safetensors tensor (NIfTI output comes with the data layer).
fn write_sample(path: &Path, vol: &[f32], dhw: [usize; 3]) -> Result<()> {
    let c = vol.len() / (dhw[0] * dhw[1] * dhw[2]);
    let t = vec![("sample".to_string(), vec![c, dhw[0], dhw[1], dhw[2]], vol.to_vec())];
    let bytes = meddpm::checkpoint::native::serialize(&t, Default::default())?;
    meddpm::checkpoint::write_atomic(path, &bytes)?;
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct SampleArgs {
    /// A meddpm checkpoint or state dict (.safetensors).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Which weights: ema (as the reference samples) or model (online).
    #[arg(long, default_value = "ema")]
    pub weights: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value_t = 250)]
    pub timesteps: usize,
    /// Output file.
    #[arg(long, default_value = "sample.safetensors")]
    pub out: PathBuf,
    #[command(flatten)]
    pub backend: BackendArgs,
}

pub fn sample(a: &SampleArgs) -> Result<()> {
    let ck = Checkpoint::read(&a.checkpoint)?;
    with_backend!(a.backend, be => sample_on(&be, a, &ck))
}

fn sample_on<B: Backend>(be: &B, a: &SampleArgs, ck: &Checkpoint) -> Result<()> {
    let cfg = ck
        .unet
        .clone()
        .with_context(|| format!("{}: no model config in the file's metadata", a.checkpoint.display()))?;
    let mut net = UNet::new(be, &cfg, 1)?;
    let group = match a.weights.as_str() {
        "ema" | "model" if ck.has_group(&a.weights) => a.weights.as_str(),
        "ema" | "model" if !ck.has_group("model") => "",
        "ema" | "model" => bail!("{}: has no '{}' weights", a.checkpoint.display(), a.weights),
        w => bail!("--weights {w}: expected ema or model"),
    };
    let specs = net.specs.clone();
    net.set_params(be, &ck.group(group, &specs)?)?;
    let (_, cond) = meddpm::phantom::pair(cfg.depth, cfg.size, cfg.size, 0);
    let sched = Schedule::cosine(a.timesteps);
    println!("meddpm sample on {}: {} steps, seed {}", be.describe(), a.timesteps, a.seed);
    let vol = sample_volume(be, &mut net, &sched, &cond, a.seed)?;
    write_sample(&a.out, &vol, [cfg.depth, cfg.size, cfg.size])?;
    println!("sample: {}", a.out.display());
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
    println!("parameters:          {}", meddpm::model::param_count(&cfg));
    println!(
        "forward GFLOP (B=1): {:.1} (conv {:.1}, attention {:.1}, linear {:.3})",
        f.total() / 1e9,
        f.conv / 1e9,
        f.attention / 1e9,
        f.linear / 1e9
    );
    println!("train micro-step GFLOP: {:.1}", f.train_step(&cfg) / 1e9);
    Ok(())
}

pub fn doctor() -> Result<()> {
    println!("meddpm {}", env!("CARGO_PKG_VERSION"));
    println!("cpu: {} threads (rayon)", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    match meddpm_cuda::probe() {
        Ok(s) => println!("{s}"),
        Err(e) => println!("{e}"),
    }
    Ok(())
}
