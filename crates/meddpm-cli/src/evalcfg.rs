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
//! This file parses the arguments, picks the checkpoint's weights, starts each configuration's
//! backend (with a progress bar) and writes the files. The rest is the library's: which
//! configurations run, sampling them, the report assembled and the panels in
//! `meddpm::eval::config_runs`; loading the pairs, the report types, the metrics per sample, the
//! comparison of the runs, the verdict rule and the Markdown in `meddpm::eval::configs`.
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
//! runs only the CPU ones (the CUDA ones are listed as skipped); `--device cpu` runs only the CPU
//! ones. The CPU configurations are the fp32 reference (`cpu`) and the emulations of the GPU's
//! rounding, `cpu-bf16` and `cpu-fp8` (`CpuBackend::bf16`, `CpuBackend::fp8`): with them the fp8
//! quality verdict can be measured without a GPU. Without any CPU configuration given, the CPU
//! reference runs.
//! Outputs: `<out>/eval_configs.json`, `<out>/eval_configs.md`, and per mask a PNG panel
//! `<out>/panel_pair<i>.png` (mask | real | baseline | each other configuration; first seed).

use std::path::PathBuf;
use std::time::Instant;

use crate::args::{parse_device, whole, whole_usize, Weights};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use meddpm::checkpoint::Checkpoint;
use meddpm::diffusion::Schedule;
pub use meddpm::eval::config_runs::Config;
use meddpm::eval::config_runs::{assemble, plan, sample_all, write_panels, ReportHead};
use meddpm::eval::configs::{load_pairs, to_markdown, Metrics, PairData, Run, Samples};
use meddpm::model::{param_specs, UNetConfig};
use meddpm::Backend;
pub use meddpm::DeviceSel;

/// `cpu`, `cpu-bf16`, `cpu-fp8`, or `PRECISION/LAYOUT` for CUDA (`fp32|tf32|bf16|fp8` /
/// `ncdhw|ndhwc`).
pub fn parse_config(s: &str) -> Result<Config, String> {
    s.parse()
}

#[derive(clap::Args, Debug, Clone)]
pub struct EvalConfigsArgs {
    /// A meddpm checkpoint (.safetensors) whose metadata holds the model config.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Which weights: ema (as the reference samples) or model (online).
    #[arg(long, value_enum, default_value = "ema")]
    pub weights: Weights,
    /// Configurations, comma-separated: PRECISION/LAYOUT on CUDA (fp32|tf32|bf16|fp8 / ncdhw|ndhwc),
    /// cpu (the fp32 reference), or cpu-bf16 / cpu-fp8 (the CPU's emulations of the GPU's bf16 and
    /// fp8 rounding; they run without a GPU). The first one that runs is the baseline.
    #[arg(long, value_delimiter = ',', default_value = "fp32/ncdhw,tf32/ncdhw,fp32/ndhwc,tf32/ndhwc,bf16/ncdhw,bf16/ndhwc", value_parser = parse_config)]
    pub configs: Vec<Config>,
    /// Also run the CPU reference (slow for large models).
    #[arg(long)]
    pub cpu_too: bool,
    /// auto | cpu | cuda | cuda:N. auto without a CUDA device, and cpu, run only the CPU reference.
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: DeviceSel,
    /// Seeds per mask (K), 1 to 1000: seed, seed+1, ..., seed+K−1. The spread needs K ≥ 2.
    #[arg(long, default_value_t = 3, allow_negative_numbers = true, value_parser = whole(1, 1000))]
    pub seeds: u64,
    /// First seed.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = whole(0, u64::MAX))]
    pub seed: u64,
    /// Which mask/image pairs (indices into the dataset), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0,1")]
    pub pairs: Vec<usize>,
    /// Folder of mask NIfTIs [default: the built-in demo pairs, resized to the model size].
    #[arg(long, requires = "images")]
    pub masks: Option<PathBuf>,
    /// Image folder paired with --masks by the digits in file names.
    #[arg(long)]
    pub images: Option<PathBuf>,
    /// Sampling steps T, 2 to 100000 [default: the checkpoint's training timesteps, else 250].
    #[arg(long, allow_negative_numbers = true, value_parser = whole_usize(2, 100_000))]
    pub timesteps: Option<usize>,
    /// SSIM window size, 1 to 99 [default: 11, MONAI's; smaller when the volume is].
    #[arg(long, allow_negative_numbers = true, value_parser = whole_usize(1, 99))]
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

/// [`sample_all`] with a progress bar: (samples, backend description, seconds sampling).
fn sample_with_bar<B: Backend>(
    be: &B,
    name: &str,
    (cfg, weights, sched): (&UNetConfig, &[Vec<f32>], &Schedule),
    pairs: &[PairData],
    seeds: &[u64],
) -> Result<(Samples, String, f64)> {
    let pb = bar((pairs.len() * seeds.len() * sched.timesteps) as u64, name);
    let (s, secs) = sample_all(be, cfg, weights, sched, pairs, seeds, &mut |pair, seed| {
        pb.set_message(format!("pair {pair} seed {seed}"));
        pb.inc(1);
    })?;
    pb.finish_and_clear();
    Ok((s, be.describe(), secs))
}

/// Run one configuration; Err(reason) for a configuration that cannot start (skipped).
fn run_config(
    c: Config,
    ordinal: usize,
    model: (&UNetConfig, &[Vec<f32>], &Schedule),
    pairs: &[PairData],
    seeds: &[u64],
) -> Result<std::result::Result<(Samples, String, f64), String>> {
    let name = c.name();
    Ok(match c {
        Config::Cpu | Config::CpuEmu(_) => {
            let be = c.cpu_backend().expect("a CPU configuration has a CPU backend");
            Ok(sample_with_bar(&be, &name, model, pairs, seeds)?)
        }
        Config::Cuda(p, l) => match meddpm_cuda::CudaBackend::new(ordinal, p, l) {
            Ok(be) => Ok(sample_with_bar(&be, &name, model, pairs, seeds)?),
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
    let want = a.weights.name();
    let group = if ck.has_group(want) {
        want
    } else if !ck.has_group("model") {
        ""
    } else {
        bail!("{}: has no '{want}' weights", a.checkpoint.display())
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
    let probe = || meddpm_cuda::probe().map(|_| ());
    let p = plan(&a.configs, a.cpu_too, &a.device, probe)?;
    let mut skipped = p.skipped;
    eprintln!(
        "eval-configs: {} ({} parameters), T = {timesteps}, {} pair(s) × {} seed(s), configurations: {}",
        a.checkpoint.display(),
        meddpm::model::param_count(&cfg),
        pairs.len(),
        seeds.len(),
        p.run.iter().map(Config::name).collect::<Vec<_>>().join(", ")
    );
    let n_samples = pairs.len() * seeds.len();
    let mut runs: Vec<Run> = Vec::new();
    for c in p.run {
        let t0 = Instant::now();
        match run_config(c, p.ordinal, (&cfg, &weights, &sched), &pairs, &seeds)? {
            Ok((samples, backend, secs)) => {
                let seconds = t0.elapsed().as_secs_f64();
                let per = secs / n_samples as f64;
                eprintln!("{:>10}: {backend}: {seconds:.1} s ({per:.2} s per sample)", c.name());
                runs.push(Run { name: c.name(), backend, seconds, seconds_per_sample: per, samples });
            }
            Err(why) => {
                if matches!(a.device, DeviceSel::Cuda(_)) && runs.is_empty() {
                    bail!("{}: {why}", c.name());
                }
                eprintln!("{:>10}: skipped: {why}", c.name());
                skipped.push((c, why));
            }
        }
    }
    if runs.is_empty() {
        bail!(
            "no configuration ran: {}",
            skipped.iter().map(|(c, w)| format!("{}: {w}", c.name())).collect::<Vec<_>>().join("; ")
        );
    }
    let head = ReportHead {
        tool: format!("meddpm {} eval-configs", env!("CARGO_PKG_VERSION")),
        checkpoint: a.checkpoint.display().to_string(),
        checkpoint_step: ck.step,
        weights: group.into(),
        model: cfg.clone(),
        timesteps,
        source,
    };
    let mut notes: Vec<String> = ms_note.iter().cloned().collect();
    notes.extend(p.notes);
    let report = assemble(head, &runs, &skipped, &pairs, &seeds, &metrics, ms_note, notes, range)?;

    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let json = a.out.join("eval_configs.json");
    let md = a.out.join("eval_configs.md");
    std::fs::write(&json, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", json.display()))?;
    let markdown = to_markdown(&report);
    std::fs::write(&md, &markdown).with_context(|| format!("writing {}", md.display()))?;
    for png in write_panels(&a.out, &pairs, &runs, dims)? {
        eprintln!("eval-configs: wrote {}", png.display());
    }
    println!("{markdown}");
    eprintln!("eval-configs: wrote {} and {}", json.display(), md.display());
    Ok(())
}
