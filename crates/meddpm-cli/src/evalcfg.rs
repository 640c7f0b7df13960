//! `meddpm eval-configs`: does a speed switch (TF32 math, channels-last layout, the GPU itself)
//! change what the model generates? Issue 6, second half.
//!
//! One checkpoint (EMA weights by default) samples the same masks with the same seeds under each
//! configuration — CUDA `fp32/ncdhw` (the baseline), `tf32/ncdhw`, `fp32/ndhwc`, `tf32/ndhwc`, and
//! the CPU reference (`cpu`). `meddpm::diffusion::Sampler` draws every random number from Philox
//! by seed (spec §3.3), so two configurations start from the same x_T and add the same z at every
//! step: any difference between their volumes is numerical. Per configuration the report gives
//! (a) agreement with the baseline volume of the same mask and seed (max |Δ|, PSNR, SSIM),
//! (b) quality against the real image (SSIM, MS-SSIM when the size allows it, PSNR and MAE whole
//! and inside the head mask, mean intensity and Wasserstein-1 per mask label), and
//! (c) a verdict: a configuration is *within spread* when, for every mask and quality metric, the
//! largest per-seed change from the baseline, max_k |q_k − q_k(baseline)|, is at most the
//! baseline's seed-to-seed standard deviation of that metric (sample std over the K seeds).
//!
//! This file parses the arguments, samples each configuration (with progress bars) and writes the
//! files; loading the pairs, the report types, the metrics per sample, the comparison of the runs,
//! the verdict rule and the Markdown live in `meddpm::eval::configs`
//! (`crates/meddpm/src/eval/configs.rs`).
//!
//! Metric definitions are `meddpm eval`'s (MONAI's; `crates/meddpm/src/eval/`): images in
//! [−1, 1] are mapped to [0, 1] first, so SSIM uses data_range 1 and PSNR max_val 1. SSIM uses
//! MONAI's default Gaussian window (11, σ 1.5), smaller when the volume is; MS-SSIM (5 scales) is
//! reported only when every axis is ≥ 48 voxels (window ≥ 3) — at the 32³ demo size only a
//! 1-voxel window would fit, which is not a structural similarity, so it is left out and the
//! report says so. Labels at model size come from the condition tensor (the channel above the
//! midpoint of the condition values), so they are exactly what the model was conditioned on.
//!
//! Devices: `--device auto` runs the CUDA configurations when a device answers and otherwise
//! runs only the CPU reference (the CUDA ones are listed as skipped); `--device cpu` collapses
//! every configuration into the CPU reference (it has one precision and layout: fp32 NCDHW).
//! Outputs: `<out>/eval_configs.json`, `<out>/eval_configs.md`, and per mask a PNG panel
//! `<out>/panel_pair<i>.png` (mask | real | baseline | each other configuration; first seed).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use meddpm::checkpoint::Checkpoint;
use meddpm::cpu::CpuBackend;
use meddpm::data::preview::{label_position, write_png_at, Kind};
use meddpm::data::{Convention, Volume};
use meddpm::diffusion::{Sampler, Schedule};
use meddpm::eval::configs::{
    compare_runs, load_pairs, to_markdown, ConfigReport, Metrics, PairData, Report, Run, Samples, Settings,
};
use meddpm::model::{param_specs, UNet, UNetConfig};
use meddpm::{Backend, Layout, Precision};

/// One way of running the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Config {
    /// The CPU reference backend (fp32, NCDHW).
    Cpu,
    /// The CUDA backend with this math precision and activation layout.
    Cuda(Precision, Layout),
}

impl Config {
    pub fn name(&self) -> String {
        match self {
            Config::Cpu => "cpu".into(),
            Config::Cuda(p, l) => format!(
                "{}/{}",
                p.name(),
                match l {
                    Layout::Ncdhw => "ncdhw",
                    Layout::Ndhwc => "ndhwc",
                }
            ),
        }
    }
}

/// `cpu`, or `PRECISION/LAYOUT` for CUDA (`fp32|tf32|bf16` / `ncdhw|ndhwc`).
pub fn parse_config(s: &str) -> Result<Config, String> {
    let t = s.trim().to_ascii_lowercase();
    if t == "cpu" {
        return Ok(Config::Cpu);
    }
    let bad =
        || format!("'{s}' is not a configuration: use cpu or PRECISION/LAYOUT with fp32|tf32|bf16 and ncdhw|ndhwc");
    let (p, l) = t.split_once('/').ok_or_else(bad)?;
    let p: Precision = p.parse().map_err(|_| bad())?;
    let l = match l {
        "ncdhw" => Layout::Ncdhw,
        "ndhwc" => Layout::Ndhwc,
        _ => return Err(bad()),
    };
    Ok(Config::Cuda(p, l))
}

/// Where the CUDA configurations run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceSel {
    /// CUDA device 0 when it answers, else only the CPU reference.
    Auto,
    /// Everything on the CPU reference.
    Cpu,
    /// CUDA device N (an error if it is absent).
    Cuda(usize),
}

fn parse_device(s: &str) -> Result<DeviceSel, String> {
    match s {
        "auto" => Ok(DeviceSel::Auto),
        "cpu" => Ok(DeviceSel::Cpu),
        "cuda" => Ok(DeviceSel::Cuda(0)),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(DeviceSel::Cuda)
            .ok_or_else(|| format!("'{s}' is not a device: use auto, cpu, cuda or cuda:N")),
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct EvalConfigsArgs {
    /// A meddpm checkpoint (.safetensors) whose metadata holds the model config.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Which weights: ema (as the reference samples) or model (online).
    #[arg(long, default_value = "ema")]
    pub weights: String,
    /// Configurations, comma-separated: PRECISION/LAYOUT on CUDA (fp32|tf32 / ncdhw|ndhwc) or
    /// cpu. The first one that runs is the baseline.
    #[arg(long, value_delimiter = ',', default_value = "fp32/ncdhw,tf32/ncdhw,fp32/ndhwc,tf32/ndhwc,bf16/ncdhw,bf16/ndhwc", value_parser = parse_config)]
    pub configs: Vec<Config>,
    /// Also run the CPU reference (slow for large models).
    #[arg(long)]
    pub cpu_too: bool,
    /// auto | cpu | cuda | cuda:N. auto without a CUDA device, and cpu, run only the CPU reference.
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: DeviceSel,
    /// Seeds per mask (K): seed, seed+1, ..., seed+K−1. The spread needs K ≥ 2.
    #[arg(long, default_value_t = 3)]
    pub seeds: u64,
    /// First seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Which mask/image pairs (indices into the dataset), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0,1")]
    pub pairs: Vec<usize>,
    /// Folder of mask NIfTIs (default: the built-in demo pairs, resized to the model size).
    #[arg(long, requires = "images")]
    pub masks: Option<PathBuf>,
    /// Image folder paired with --masks by the digits in file names.
    #[arg(long)]
    pub images: Option<PathBuf>,
    /// Sampling steps T (default: the checkpoint's training timesteps, else 250).
    #[arg(long)]
    pub timesteps: Option<usize>,
    /// SSIM window size (default 11, MONAI's; smaller when the volume is).
    #[arg(long)]
    pub kernel_size: Option<usize>,
    /// Output folder (created): eval_configs.json, eval_configs.md, panel_pair<i>.png.
    #[arg(long)]
    pub out: PathBuf,
}

fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(&format!(
            "{what:>10} {{bar:30}} {{pos}}/{{len}} [{{elapsed_precise}}<{{eta_precise}}] {{msg}}"
        ))
        .expect("valid template"),
    );
    pb
}

/// Sample every (pair, seed) with one backend: returns (samples[pair][seed], description,
/// seconds spent sampling).
fn sample_all<B: Backend>(
    be: &B,
    cfg: &UNetConfig,
    weights: &[Vec<f32>],
    sched: &Schedule,
    pairs: &[PairData],
    seeds: &[u64],
    name: &str,
) -> Result<(Vec<Vec<Vec<f32>>>, f64)> {
    let mut net = UNet::new(be, cfg, 1)?;
    net.set_params(be, weights)?;
    let mut s = Sampler::new(be, &net)?;
    let pb = bar((pairs.len() * seeds.len() * sched.timesteps) as u64, name);
    let t0 = Instant::now();
    let mut out = Vec::new();
    for p in pairs {
        let mut per_seed = Vec::new();
        for &seed in seeds {
            pb.set_message(format!("pair {} seed {seed}", p.info.index));
            let v = s.sample(be, &mut net, sched, &p.cond, seed, |_| pb.inc(1))?;
            per_seed.push(v);
        }
        out.push(per_seed);
    }
    pb.finish_and_clear();
    Ok((out, t0.elapsed().as_secs_f64()))
}

/// Run one configuration; Err(reason) for a configuration that cannot start (skipped).
fn run_config(
    c: Config,
    ordinal: usize,
    cfg: &UNetConfig,
    weights: &[Vec<f32>],
    sched: &Schedule,
    pairs: &[PairData],
    seeds: &[u64],
) -> Result<std::result::Result<(Samples, String, f64), String>> {
    let name = c.name();
    Ok(match c {
        Config::Cpu => {
            let be = CpuBackend::new();
            let (s, secs) = sample_all(&be, cfg, weights, sched, pairs, seeds, &name)?;
            Ok((s, be.describe(), secs))
        }
        Config::Cuda(p, l) => match meddpm_cuda::CudaBackend::new(ordinal, p, l) {
            Ok(be) => {
                let (s, secs) = sample_all(&be, cfg, weights, sched, pairs, seeds, &name)?;
                Ok((s, be.describe(), secs))
            }
            Err(e) => Err(format!("the CUDA backend did not start: {e}")),
        },
    })
}

pub fn run(a: &EvalConfigsArgs) -> Result<()> {
    if a.seeds == 0 {
        bail!("--seeds must be ≥ 1 (≥ 2 for a spread and a verdict)");
    }
    let ck = Checkpoint::read(&a.checkpoint)?;
    let cfg = ck
        .unet
        .clone()
        .with_context(|| format!("{}: no model config in the file's metadata", a.checkpoint.display()))?;
    if cfg.out_channels != 1 {
        bail!(
            "{}: the model has {} image channels; eval-configs handles single-image (whole-head) models",
            a.checkpoint.display(),
            cfg.out_channels
        );
    }
    let group = match a.weights.as_str() {
        "ema" | "model" if ck.has_group(&a.weights) => a.weights.as_str(),
        "ema" | "model" if !ck.has_group("model") => "",
        "ema" | "model" => bail!("{}: has no '{}' weights", a.checkpoint.display(), a.weights),
        w => bail!("--weights {w}: expected ema or model"),
    };
    let weights = ck.group(group, &param_specs(&cfg))?;
    let timesteps = a.timesteps.or(ck.train.as_ref().map(|t| t.timesteps)).unwrap_or(250);
    if timesteps < 2 {
        bail!("--timesteps must be ≥ 2");
    }
    let sched = Schedule::cosine(timesteps);
    let range = [-1.0, 1.0];
    let dims = [cfg.depth, cfg.size, cfg.size];
    if let Some(k) = a.kernel_size {
        let smallest = *dims.iter().min().expect("3 dims");
        if k == 0 || k > smallest {
            bail!("--kernel-size {k}: must be in 1..={smallest} for volumes of {dims:?} (D,H,W)");
        }
    }
    let (metrics, ms_note) = Metrics::new(dims, a.kernel_size)?;
    if a.pairs.is_empty() {
        bail!("--pairs: give at least one pair index");
    }
    let (pairs, source) =
        load_pairs(a.masks.as_deref(), a.images.as_deref(), &a.pairs, &cfg, range).map_err(|e| match e {
            meddpm::Error::Config(m) => anyhow::anyhow!("--pairs/--masks/--images: {m}"),
            e => e.into(),
        })?;
    let seeds: Vec<u64> = (0..a.seeds).map(|k| a.seed + k).collect();
    let mut notes: Vec<String> = ms_note.iter().cloned().collect();

    // Which configurations run, in order (the first that runs is the baseline).
    let mut wanted = a.configs.clone();
    if wanted.is_empty() {
        bail!("--configs: give at least one configuration");
    }
    if a.cpu_too && !wanted.contains(&Config::Cpu) {
        wanted.push(Config::Cpu);
    }
    let mut dedup = Vec::new();
    for c in wanted {
        if !dedup.contains(&c) {
            dedup.push(c);
        }
    }
    let mut skipped: Vec<(Config, String)> = Vec::new();
    let (plan, ordinal): (Vec<Config>, usize) = match &a.device {
        DeviceSel::Cuda(i) => (dedup, *i),
        DeviceSel::Auto if meddpm_cuda::probe().is_ok() => (dedup, 0),
        sel => {
            let why = match sel {
                DeviceSel::Auto => {
                    let e = meddpm_cuda::probe().err().unwrap_or_default();
                    let first = e.lines().next().unwrap_or("").trim().to_string();
                    if first.is_empty() {
                        "no CUDA device".to_string()
                    } else {
                        first
                    }
                }
                _ => "--device cpu: collapsed into the CPU reference (fp32, NCDHW)".to_string(),
            };
            let gpu: Vec<Config> = dedup.iter().copied().filter(|c| *c != Config::Cpu).collect();
            for c in &gpu {
                skipped.push((*c, why.clone()));
            }
            if !gpu.is_empty() {
                notes.push(format!(
                    "{}: the CUDA configurations ({}) were not run; only the CPU reference ran",
                    why,
                    gpu.iter().map(Config::name).collect::<Vec<_>>().join(", ")
                ));
            }
            (vec![Config::Cpu], 0)
        }
    };

    eprintln!(
        "eval-configs: {} ({} parameters), T = {timesteps}, {} pair(s) × {} seed(s), configurations: {}",
        a.checkpoint.display(),
        meddpm::model::param_count(&cfg),
        pairs.len(),
        seeds.len(),
        plan.iter().map(Config::name).collect::<Vec<_>>().join(", ")
    );
    let mut ran: Vec<(Config, String, f64, f64, Samples)> = Vec::new();
    for c in plan {
        let t0 = Instant::now();
        match run_config(c, ordinal, &cfg, &weights, &sched, &pairs, &seeds)? {
            Ok((s, desc, secs)) => {
                let total = t0.elapsed().as_secs_f64();
                eprintln!(
                    "{:>10}: {desc}: {total:.1} s ({:.2} s per sample)",
                    c.name(),
                    secs / (pairs.len() * seeds.len()) as f64
                );
                ran.push((c, desc, total, secs, s));
            }
            Err(why) => {
                if matches!(a.device, DeviceSel::Cuda(_)) && ran.is_empty() {
                    bail!("{}: {why}", c.name());
                }
                eprintln!("{:>10}: skipped: {why}", c.name());
                skipped.push((c, why));
            }
        }
    }
    if ran.is_empty() {
        bail!(
            "no configuration ran: {}",
            skipped.iter().map(|(c, w)| format!("{}: {w}", c.name())).collect::<Vec<_>>().join("; ")
        );
    }

    // Metrics on [0, 1].
    let baseline_name = ran[0].0.name();
    let n_samples = pairs.len() * seeds.len();
    let runs: Vec<Run> = ran
        .into_iter()
        .map(|(c, desc, total, secs, samples)| Run {
            name: c.name(),
            backend: desc,
            seconds: total,
            seconds_per_sample: secs / n_samples as f64,
            samples,
        })
        .collect();
    let (mut configurations, spread) = compare_runs(&runs, &pairs, &seeds, &metrics, range)?;
    if seeds.len() < 2 {
        notes.push("one seed per mask: no seed-to-seed spread, so no verdicts (use --seeds ≥ 2)".into());
    }
    for (c, why) in &skipped {
        configurations.push(ConfigReport {
            name: c.name(),
            status: "skipped".into(),
            skip_reason: Some(why.clone()),
            backend: None,
            seconds: None,
            seconds_per_sample: None,
            agreement: Vec::new(),
            quality: Vec::new(),
            verdict: None,
        });
    }
    if pairs.iter().any(|p| !p.labels.iter().any(|&l| l != 0)) {
        notes.push(
            "a mask has no foreground at model size: its masked PSNR/MAE are NaN (left out of the spread)".into(),
        );
    }
    notes.push(format!("masks: {source}"));

    let report = Report {
        tool: format!("meddpm {} eval-configs", env!("CARGO_PKG_VERSION")),
        checkpoint: a.checkpoint.display().to_string(),
        checkpoint_step: ck.step,
        weights: if group.is_empty() { "(plain state dict)".into() } else { group.into() },
        parameters: meddpm::model::param_count(&cfg),
        model: cfg.clone(),
        timesteps,
        seeds: seeds.clone(),
        pairs: pairs.iter().map(|p| p.info.clone()).collect(),
        settings: Settings {
            intensity_range: range,
            ssim: metrics.ssim.clone(),
            ms_ssim_kernel: metrics.ms.as_ref().map(|m| m.ssim.kernel_size),
            ms_ssim_note: ms_note,
            psnr_max_val: 1.0,
        },
        baseline: baseline_name,
        verdict_rule: "within spread ⇔ for every mask and quality metric, max over seeds of |metric(config) − \
                       metric(baseline)| (same mask, same seed) ≤ the baseline's sample std of that metric over the \
                       seeds"
            .into(),
        configurations,
        spread,
        notes,
    };

    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let json = a.out.join("eval_configs.json");
    let md = a.out.join("eval_configs.md");
    std::fs::write(&json, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", json.display()))?;
    let markdown = to_markdown(&report);
    std::fs::write(&md, &markdown).with_context(|| format!("writing {}", md.display()))?;

    // Panels: mask | real | each configuration that ran (baseline first), first seed.
    let conv = Convention::whole_head();
    for (pi, p) in pairs.iter().enumerate() {
        let gens: Vec<Volume> =
            runs.iter().map(|r| conv.output_volumes(&r.samples[pi][0], 1, dims, &p.mask_vol).remove(0)).collect();
        let mut cols: Vec<(&Volume, Kind)> = vec![(&p.mask_vol, Kind::Labels), (&p.real_vol, Kind::Intensity)];
        cols.extend(gens.iter().map(|v| (v, Kind::Intensity)));
        let pos = label_position(&p.mask_vol, 2.0).unwrap_or([0.5; 3]);
        let png = a.out.join(format!("panel_pair{}.png", p.info.index));
        write_png_at(&png, &cols, pos)?;
        eprintln!("eval-configs: wrote {}", png.display());
    }
    println!("{markdown}");
    eprintln!("eval-configs: wrote {} and {}", json.display(), md.display());
    Ok(())
}
