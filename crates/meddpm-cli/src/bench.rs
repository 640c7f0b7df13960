//! `meddpm bench`: end-to-end speed of the U-Net on one device (issue 7), for each selected
//! precision × layout: the real training micro-step (`Trainer::micro_step` + `opt_step`), the
//! sampling forward (`UNet::forward`), a 250-step volume estimate (250 × forward, and with `--full`
//! a real `Sampler::sample` run), device memory, achieved TFLOP/s (`meddpm::model::cost`) and the
//! share of the physical floor (../shared/perf/README.md: 13 ms forward, 39 ms training micro-step,
//! TF32 on one H200, whole-head model). With `--torch` the same configurations run through
//! tools/reference/bench_torch.py (our PyTorch re-implementation) and are shown side by side.
//!
//! Power: on a GPU that NVML sees, a background thread reads board power, SM clock, the
//! clocks-event reasons and the energy counter every 10 ms over the timed calls
//! (`meddpm_cuda::power`, `meddpm::analysis::power`): a `power` line a row (SM clock, mean power
//! from the energy counter's updates, J a step, how often the power cap held the clock) and
//! `train_power` / `fwd_power` in the JSON. Short windows (a few forwards) leave the counter too
//! few updates: their mean power is n/a; more `--iters` give it.
//! The H200's 700 W cap holds the BraTS bf16 step at ~1 785 MHz.
//!
//! Timing: wall time around each call, bracketed by `Backend::sync` (so it is CUDA-synchronised);
//! median of `--iters` after `--warmup` calls (the warm-up includes cudnnFind and the first-use
//! timing choices of the CUDA backend). The micro-step includes uploading the batch from the host,
//! as in training. Memory: total − free from cudaMemGetInfo after the timed training steps, for the
//! whole process (CUDA context, cuDNN/cuBLAS, workspace, pool); the backend allocates everything
//! before the first step and nothing in a step, so this is the step's peak up to cudnnFind's
//! temporary workspace (during warm-up only). On the CPU backend memory is not measured.
//!
//! `--gpus N` (or under torchrun/srun) measures data-parallel scaling instead: per precision ×
//! layout, the training step on one GPU and on N, and the efficiency ([`bench_rank`],
//! `meddpm::dist::scaling`).

use crate::args::{whole, whole_usize, Preset, RunFile};
use anyhow::{bail, Context, Result};
use meddpm::analysis::breakdown::{comm_overlap, CommOverlap};
use meddpm::analysis::power::{PowerSummary, READ_EVERY};
use meddpm::cpu::CpuBackend;
use meddpm::diffusion::{Sampler, Schedule, TrainConfig, Trainer};
use meddpm::dist::scaling::median;
use meddpm::dist::spawn::GpuSelection;
use meddpm::dist::{config_hash, BucketPlan, DistEnv, DEFAULT_BUCKET_BYTES};
use meddpm::model::{cost, UNetConfig};
use meddpm::{Backend, Layout, Precision};
use meddpm_cuda::collective::NcclSync;
use meddpm_cuda::cupti;
use meddpm_cuda::power::PowerMonitor;
use meddpm_cuda::CudaBackend;
use serde::Serialize;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Physical floor on one H200 for the whole-head model in TF32 (../shared/perf/README.md).
const FLOOR_FWD_MS: f64 = 13.0;
const FLOOR_TRAIN_MS: f64 = 39.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchDevice {
    Cpu,
    Cuda,
}

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// cpu or cuda.
    #[arg(long, value_enum, default_value = "cuda")]
    pub device: BenchDevice,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = whole_usize(0, 1024))]
    pub gpu: usize,
    /// Model preset [default: whole-head; ignored with --config holding a [unet] table].
    #[arg(long, value_enum)]
    pub preset: Option<Preset>,
    /// Run file (TOML) whose [unet] table (or preset) is the model to time.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Precisions to time (comma-separated). The CPU backend is fp32 (bf16 emulates bf16 rounding).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "bf16,tf32")]
    pub precision: Vec<Precision>,
    /// Layouts to time (comma-separated). The CPU backend is always ncdhw.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "ndhwc,ncdhw")]
    pub layout: Vec<Layout>,
    /// Timed iterations, 1 to 100000 (the median is reported).
    #[arg(long, default_value_t = 5, allow_negative_numbers = true, value_parser = whole_usize(1, 100_000))]
    pub iters: usize,
    /// Untimed iterations first, 0 to 100000.
    #[arg(long, default_value_t = 2, allow_negative_numbers = true, value_parser = whole_usize(0, 100_000))]
    pub warmup: usize,
    /// Launch every kernel from the host instead of replaying the U-Net's passes as CUDA graphs.
    #[arg(long)]
    pub no_graphs: bool,
    /// Upload each training batch at the start of its own step instead of staging it during the
    /// step before (the A/B switch of the overlapped input).
    #[arg(long)]
    pub no_overlap: bool,
    /// Skip the training measurement.
    #[arg(long)]
    pub no_train: bool,
    /// Also run one real 250-step sampling of a volume per configuration.
    #[arg(long)]
    pub full: bool,
    /// Also time our PyTorch re-implementation (tools/reference/bench_torch.py) via python3.
    #[arg(long)]
    pub torch: bool,
    /// With --torch: torch.compile the PyTorch model (how PyTorch's users get its best numbers; several
    /// minutes of compilation per configuration).
    #[arg(long)]
    pub torch_compile: bool,
    /// The Python interpreter for --torch.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// The PyTorch bench script for --torch.
    #[arg(long, default_value = "tools/reference/bench_torch.py")]
    pub torch_script: PathBuf,
    /// Write all rows as JSON here [default: none].
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Data-parallel scaling on this machine, one process per GPU: a count (2), 'all', or device
    /// indices (0,1): per precision × layout the training step (batch 1 per GPU) on one GPU and
    /// on all of them, and the scaling efficiency. Under torchrun or srun, leave it out.
    #[arg(long)]
    pub gpus: Option<GpuSelection>,
    /// With --gpus: seconds to wait for the other ranks before failing, ≥ 1.
    #[arg(long, default_value_t = 300, allow_negative_numbers = true, value_parser = whole(1, u64::MAX))]
    pub dist_timeout: u64,
}

/// One configuration's measurements (times in ms).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Row {
    pub device: String,
    pub precision: String,
    pub layout: String,
    /// U-Net passes replayed as CUDA graphs.
    pub graphs: bool,
    /// Training batches staged during the step before (overlapped input).
    pub overlap: bool,
    pub train_ms: Option<f64>,
    pub train_all_ms: Vec<f64>,
    pub opt_ms: Option<f64>,
    pub fwd_ms: f64,
    pub fwd_all_ms: Vec<f64>,
    pub volume_est_s: f64,
    pub volume_full_s: Option<f64>,
    /// total − free (cudaMemGetInfo) after training, bytes; whole process.
    pub mem_used_bytes: Option<usize>,
    /// The same before the model was built (context, handles, kernels), bytes.
    pub mem_baseline_bytes: Option<usize>,
    /// Our planned buffers: the U-Net (activations, gradients, scratch, parameters, weight
    /// copies) and the trainer (EMA, Adam moments, batch buffers), bytes.
    pub plan_bytes: Option<usize>,
    /// The U-Net's plan by buffer class (see `meddpm info`), bytes.
    pub plan_classes: Vec<(String, usize)>,
    pub fwd_tflops: f64,
    pub train_tflops: Option<f64>,
    /// Floor / measured, % (TF32 whole-head only).
    pub fwd_pct_of_floor: Option<f64>,
    pub train_pct_of_floor: Option<f64>,
    pub torch: Option<serde_json::Value>,
    /// Board power, SM clock and energy over the timed training steps and forwards (NVML; none
    /// on the CPU or without NVML): `meddpm::analysis::power`.
    pub train_power: Option<PowerSummary>,
    pub fwd_power: Option<PowerSummary>,
    /// The CUDA backend's kernel choices in force (none on the CPU).
    pub kernel_choices: Option<meddpm_cuda::KernelChoices>,
}

#[derive(Serialize)]
struct Report<'a> {
    model: &'a UNetConfig,
    params: usize,
    fwd_flops: f64,
    train_flops: f64,
    iters: usize,
    warmup: usize,
    floor: &'static str,
    memory: &'static str,
    rows: &'a [Row],
}

/// Deterministic host data in [-1, 1) (the bench only needs non-trivial values).
pub(crate) fn host_data(n: usize, seed: u64) -> Vec<f32> {
    let r = meddpm::rng::Philox::new(seed, 99);
    (0..n as u64).map(|i| r.below(i, 1 << 20) as f32 / (1 << 19) as f32 - 1.0).collect()
}

pub(crate) fn model(a: &BenchArgs) -> Result<UNetConfig> {
    let file = RunFile::read(a.config.as_deref())?;
    let cfg = match (file.unet, a.preset.or(file.preset)) {
        (Some(u), _) => u,
        (None, p) => p.unwrap_or(Preset::WholeHead).unet(),
    };
    cfg.validate()?;
    Ok(cfg)
}

/// Time everything for one backend. `mem` reads (free, total) device bytes when it can; `meter`
/// starts a power monitor over the timed calls when it can.
fn measure<B: Backend>(
    be: &B,
    cfg: &UNetConfig,
    a: &BenchArgs,
    mem: &dyn Fn() -> Option<(usize, usize)>,
    meter: &dyn Fn() -> Option<PowerMonitor>,
) -> Result<Row> {
    let used = || mem().map(|(f, t)| t - f);
    let mem_baseline_bytes = used();
    let tc = TrainConfig { batch: 1, grad_accum: 1, ..TrainConfig::default() };
    let mut tr = Trainer::new(be, cfg, &tc)?;
    let img = tr.net.output_dims();
    let cd = tr.net.input_dims().with_c(cfg.cond_channels());
    let image = host_data(img.numel(), 1);
    let cond = host_data(cd.numel(), 2);
    let plan_classes = tr.net.mem.rows().iter().map(|(k, v)| (k.to_string(), *v)).collect();
    let mut row = Row { mem_baseline_bytes, plan_bytes: Some(tr.plan_bytes()), plan_classes, ..Row::default() };

    if !a.no_train {
        let (mut ts, mut os) = (Vec::new(), Vec::new());
        let mut pm = None;
        for i in 0..a.warmup + a.iters {
            be.sync();
            if i == a.warmup {
                pm = meter();
            }
            let t0 = Instant::now();
            // as in training: this batch was staged during the previous step, and the next one
            // goes up while this one runs (Trainer::micro_step_ahead_copy: into kept host buffers)
            let loss = if a.no_overlap {
                tr.micro_step(be, &image, &cond)
            } else {
                tr.micro_step_ahead_copy(be, &image, &cond)?
            };
            let t1 = Instant::now();
            tr.opt_step(be);
            be.sync();
            let t2 = Instant::now();
            if !loss.is_finite() {
                bail!("training loss is {loss} at micro-step {i}");
            }
            if i >= a.warmup {
                ts.push((t2 - t0).as_secs_f64() * 1e3);
                os.push((t2 - t1).as_secs_f64() * 1e3);
            }
        }
        row.train_power = pm.and_then(PowerMonitor::stop);
        row.train_ms = Some(median(&ts));
        row.opt_ms = Some(median(&os));
        row.train_all_ms = ts;
        row.mem_used_bytes = used();
    }

    // sampling forward: the network input as sampling builds it (x_t ‖ cond), one timestep
    let mut xin = be.alloc(tr.net.input_dims().numel())?;
    let mut x = vec![0f32; tr.net.input_dims().numel()];
    x[..img.numel()].copy_from_slice(&host_data(img.numel(), 3));
    x[img.numel()..].copy_from_slice(&cond);
    be.upload_act(&x, tr.net.input_dims(), &mut xin);
    be.copy(tr.net.input_mut(), &xin);
    drop(xin);
    let mut fs = Vec::new();
    let mut pm = None;
    for i in 0..a.warmup + a.iters {
        be.sync();
        if i == a.warmup {
            pm = meter();
        }
        let t0 = Instant::now();
        tr.net.forward(be, &[100.0]);
        be.sync();
        if i >= a.warmup {
            fs.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    row.fwd_power = pm.and_then(PowerMonitor::stop);
    if row.mem_used_bytes.is_none() {
        row.mem_used_bytes = used();
    }
    row.fwd_ms = median(&fs);
    row.fwd_all_ms = fs;
    let steps = tc.timesteps as f64;
    row.volume_est_s = steps * row.fwd_ms / 1e3;

    if a.full {
        let sched = Schedule::cosine(tc.timesteps);
        let mut s = Sampler::new(be, &tr.net)?;
        be.sync();
        let t0 = Instant::now();
        let v = s.sample(be, &mut tr.net, &sched, &cond, 0, |_| {})?;
        row.volume_full_s = Some(t0.elapsed().as_secs_f64());
        if v.iter().any(|x| !x.is_finite()) {
            bail!("the sampled volume has non-finite values");
        }
    }

    let f = cost::forward_flops(cfg);
    row.fwd_tflops = f.total() / (row.fwd_ms * 1e-3) / 1e12;
    row.train_tflops = row.train_ms.map(|t| f.train_step(cfg) / (t * 1e-3) / 1e12);
    Ok(row)
}

fn torch_row(a: &BenchArgs, cfg: &UNetConfig, p: Precision, l: Layout) -> serde_json::Value {
    let mut cmd = std::process::Command::new(&a.python);
    cmd.arg(&a.torch_script)
        .args(["--config", &serde_json::to_string(cfg).unwrap_or_default()])
        .args(["--precision", p.name(), "--layout", layout_name(l)])
        .args(["--iters", &a.iters.to_string(), "--warmup", &a.warmup.to_string()]);
    if a.no_train {
        cmd.arg("--no-train");
    }
    if a.torch_compile {
        cmd.arg("--compile");
    }
    match cmd.output() {
        Ok(o) if o.status.success() => {
            let text = String::from_utf8_lossy(&o.stdout);
            let last = text.lines().last().unwrap_or("");
            serde_json::from_str(last)
                .unwrap_or_else(|e| serde_json::json!({"error": format!("unreadable output ({e}): {last}")}))
        }
        Ok(o) => {
            let err = String::from_utf8_lossy(&o.stderr);
            let tail: String = err.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
            serde_json::json!({"error": format!("{} exited with {}: {tail}", a.torch_script.display(), o.status)})
        }
        Err(e) => serde_json::json!({"error": format!("could not run {}: {e}", a.python)}),
    }
}

/// A layout's command-line name.
fn layout_name(l: Layout) -> &'static str {
    match l {
        Layout::Ncdhw => "ncdhw",
        Layout::Ndhwc => "ndhwc",
    }
}

fn gib(b: usize) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn print_table(rows: &[Row], whole_head: bool) {
    let pct = |v: Option<f64>| v.map(|x| format!("{x:.0}%")).unwrap_or_else(|| "-".into());
    let o = |v: Option<f64>, d: usize| v.map(|x| format!("{x:.d$}")).unwrap_or_else(|| "-".into());
    println!(
        "\n{:<6} {:<5} {:<6} {:>10} {:>9} {:>10} {:>9} {:>10} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8}",
        "device",
        "prec",
        "layout",
        "train ms",
        "TFLOP/s",
        "fwd ms",
        "TFLOP/s",
        "250×fwd s",
        "full s",
        "mem GiB",
        "fwd/floor",
        "tr/floor",
        "torch fwd",
        "torch tr"
    );
    for r in rows {
        let tf = |k: &str| r.torch.as_ref().and_then(|t| t.get(k)).and_then(|v| v.as_f64());
        let ratio = |ours: Option<f64>, theirs: Option<f64>| match (ours, theirs) {
            (Some(a), Some(b)) => format!("{b:.1} ({:.2}×)", b / a),
            _ => "-".into(),
        };
        println!(
            "{:<6} {:<5} {:<6} {:>10} {:>9} {:>10.2} {:>9.1} {:>10.2} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8}",
            r.device,
            r.precision,
            r.layout,
            o(r.train_ms, 2),
            o(r.train_tflops, 1),
            r.fwd_ms,
            r.fwd_tflops,
            r.volume_est_s,
            o(r.volume_full_s, 2),
            o(r.mem_used_bytes.map(gib), 2),
            pct(r.fwd_pct_of_floor),
            pct(r.train_pct_of_floor),
            ratio(Some(r.fwd_ms), tf("fwd_ms")),
            ratio(r.train_ms, tf("train_ms")),
        );
        if let Some(e) = r.torch.as_ref().and_then(|t| t.get("error")) {
            println!("       torch: {e}");
        }
    }
    for r in rows {
        let windows = [("train", &r.train_power, r.train_all_ms.len()), ("fwd", &r.fwd_power, r.fwd_all_ms.len())];
        for (what, p, steps) in windows {
            if let Some(p) = p {
                println!("power  {} {} {} {what}: {}", r.device, r.precision, r.layout, p.line(steps));
            }
        }
    }
    if rows.iter().any(|r| r.train_power.is_some() || r.fwd_power.is_some()) {
        println!(
            "power: NVML readings every {} ms over the timed calls: the SM clock, mean board power (the energy counter's \
             increase between its first and last update in the window), energy a call, and the share of readings with \
             the power cap (or power brake) on.",
            READ_EVERY.as_millis()
        );
    }
    if whole_head {
        println!(
            "fwd/floor, train/floor: the physical floor (13 ms forward, 39 ms training micro-step, TF32, one H200, \
             ../shared/perf/README.md) as a share of the measured time; TF32 rows only."
        );
    }
    if rows.iter().any(|r| r.device == "cpu") {
        println!(
            "times: median of wall times (the CPU backend returns when the work is done); train = micro_step + \
             opt_step; memory is not measured on the CPU."
        );
    } else {
        println!(
            "times: median of CUDA-synchronised wall times; train = micro_step (the next batch staged meanwhile) + \
             opt_step; mem = total − free (cudaMemGetInfo) after training, whole process. torch columns: ms (torch / \
             ours)."
        );
    }
}

pub fn run(a: &BenchArgs) -> Result<()> {
    if let Some(sel) = &a.gpus {
        return crate::dist::launch_local(sel).map(|_| ());
    }
    if let Some(env) = DistEnv::from_env()?.filter(|e| e.world > 1) {
        return bench_rank(a, env);
    }
    let cfg = model(a)?;
    let whole_head = cfg == UNetConfig::whole_head();
    let f = cost::forward_flops(&cfg);
    let mut rows = Vec::new();
    match a.device {
        BenchDevice::Cpu => {
            if a.precision.contains(&Precision::Fp8) {
                // the CPU times fp32 whatever --precision says; fp8 is refused, not timed as fp32
                CpuBackend::with_precision(Precision::Fp8)?;
            }
            let be = CpuBackend::new();
            eprintln!("bench: {}", be.describe());
            let mut r = measure(&be, &cfg, a, &|| None, &|| None)?;
            r.device = "cpu".into();
            r.precision = "fp32".into();
            r.layout = "ncdhw".into();
            rows.push(r);
        }
        BenchDevice::Cuda => {
            for &p in &a.precision {
                for &l in &a.layout {
                    let mut r = {
                        let be = meddpm_cuda::CudaBackend::new(a.gpu, p, l)?;
                        be.set_graphs(!a.no_graphs);
                        eprintln!("bench: {}\nbench: kernel choices\n{}", be.describe(), be.choices());
                        let mem = || Some(be.mem_info()).filter(|m| m.1 > 0);
                        let meter = || be.power_monitor(READ_EVERY);
                        let r = measure(&be, &cfg, a, &mem, &meter)
                            .with_context(|| format!("{} {}", p.name(), layout_name(l)))?;
                        Row { kernel_choices: Some(be.choices()), ..r }
                    };
                    r.device = format!("cuda:{}", a.gpu);
                    r.precision = p.name().into();
                    r.layout = layout_name(l).into();
                    r.graphs = !a.no_graphs;
                    r.overlap = !a.no_overlap;
                    if whole_head && p == Precision::Tf32 {
                        r.fwd_pct_of_floor = Some(100.0 * FLOOR_FWD_MS / r.fwd_ms);
                        r.train_pct_of_floor = r.train_ms.map(|t| 100.0 * FLOOR_TRAIN_MS / t);
                    }
                    if a.torch {
                        eprintln!("bench: torch {} {}", p.name(), layout_name(l));
                        r.torch = Some(torch_row(a, &cfg, p, l));
                    }
                    eprintln!(
                        "bench: {} {}: fwd {:.2} ms, train {}",
                        p.name(),
                        layout_name(l),
                        r.fwd_ms,
                        r.train_ms.map(|t| format!("{t:.2} ms")).unwrap_or_else(|| "-".into())
                    );
                    rows.push(r);
                }
            }
        }
    }
    print_table(&rows, whole_head);
    if let Some(path) = &a.json {
        let rep = Report {
            model: &cfg,
            params: meddpm::model::params::param_count(&cfg),
            fwd_flops: f.total(),
            train_flops: f.train_step(&cfg),
            iters: a.iters,
            warmup: a.warmup,
            floor: "13 ms forward / 39 ms training micro-step, TF32, one H200, whole-head (../shared/perf/README.md)",
            memory: "cudaMemGetInfo total - free after the timed training steps, whole process",
            rows: &rows,
        };
        std::fs::write(path, serde_json::to_string_pretty(&rep)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("bench: wrote {}", path.display());
    }
    Ok(())
}

/// Synced steps of `bench --gpus` whose kernel timeline rank 0 records (CUPTI) for the overlap.
const COMM_STEPS: usize = 3;

/// One rank of `bench --gpus`: for each precision × layout, a fresh backend, trainer (batch 1,
/// no accumulation) and NCCL communicator; one-GPU steps, then synced steps
/// (`meddpm::dist::scaling::measure`), then [`COMM_STEPS`] synced steps under CUPTI on every rank
/// for how much of the all-reduce other kernels hide (`analysis::breakdown::comm_overlap`) and
/// the GPU's idle time, gathered to rank 0 (`scaling::gather_rank_comm`). Rank 0 prints the
/// tables and writes `--json` (each row's `ranks`).
pub fn bench_rank(a: &BenchArgs, env: DistEnv) -> Result<()> {
    use meddpm::dist::scaling::{gather_rank_comm, measure, rank_table, RankComm, Scaling};
    if a.device == BenchDevice::Cpu {
        bail!("bench: --device cpu has no data-parallel mode; --gpus and RANK/WORLD_SIZE need CUDA devices");
    }
    let cfg = model(a)?;
    let configs: Vec<(Precision, Layout, String)> = a
        .precision
        .iter()
        .flat_map(|&p| a.layout.iter().map(move |&l| (p, l, format!("{} {}", p.name(), layout_name(l)))))
        .collect();
    let hash = config_hash(&(&cfg, configs.iter().map(|c| &c.2).collect::<Vec<_>>(), a.iters, a.warmup));
    let timeout = Duration::from_secs(a.dist_timeout.max(1));
    let (ids, watch, slot) = crate::dist::join(&env, hash, timeout, configs.len())?;
    let lead = env.rank == 0;
    let tc = TrainConfig { batch: 1, grad_accum: 1, ..TrainConfig::default() };
    let mut rows: Vec<(String, Scaling, Option<CommOverlap>, Vec<RankComm>)> = Vec::new();
    for ((p, l, name), id) in configs.iter().zip(&ids) {
        let be = CudaBackend::new(env.local_rank, *p, *l)
            .with_context(|| format!("rank {}: opening cuda:{} (LOCAL_RANK)", env.rank, env.local_rank))?;
        if lead {
            eprintln!("bench: {name} on {} rank(s): {}", env.world, be.describe());
        }
        let mut tr = meddpm::diffusion::Trainer::new(&be, &cfg, &tc)?;
        let plan = BucketPlan::for_unet(&cfg, DEFAULT_BUCKET_BYTES);
        let mut sync = NcclSync::new(&be, id, env.rank, env.world, plan, timeout, Some(&slot))?;
        let img = tr.net.output_dims();
        let cd = tr.net.input_dims().with_c(cfg.cond_channels());
        let seed = 10 * env.rank as u64;
        let (image, cond) = (host_data(img.numel(), seed + 1), host_data(cd.numel(), seed + 2));
        let (s, _, _) = measure(&be, &mut tr, &mut sync, a.warmup, a.iters, || Ok((image.clone(), cond.clone())))
            .with_context(|| format!("rank {}: {name}", env.rank))?;
        // Then a few more synced steps on every rank under CUPTI: how much of the all-reduce
        // kernels' time other kernels ran beside them, and how long the GPU was idle.
        let collector = cupti::Collector::start();
        be.sync();
        let t0 = std::time::Instant::now();
        for _ in 0..COMM_STEPS {
            tr.train_step_synced(&be, || Ok((image.clone(), cond.clone())), &mut sync)
                .with_context(|| format!("rank {}: {name}: overlap steps", env.rank))?;
        }
        be.sync();
        let wall_ns = t0.elapsed().as_nanos() as u64;
        let records =
            collector.and_then(|c| c.finish()).map(|t| t.activities.iter().map(|a| a.to_record()).collect::<Vec<_>>());
        let comm = Some(
            records
                .as_ref()
                .map_err(|e| e.to_string())
                .and_then(|r| comm_overlap(r).ok_or_else(|| "no NCCL kernel in the CUPTI timeline".to_string())),
        );
        let idle = records.as_ref().ok().and_then(|r| meddpm::analysis::breakdown::idle(r, wall_ns));
        let per_step = |ns: u64| ns as f64 / 1e6 / COMM_STEPS as f64;
        let own = match &comm {
            Some(Ok(c)) => [Some(per_step(c.comm_ns)), Some(c.hidden_pct)],
            _ => [None, None],
        };
        let ranks =
            gather_rank_comm(&mut sync, &be, [own[0], own[1], idle.map(|i| per_step(i.gaps_ns + i.outside_ns))])
                .with_context(|| format!("rank {}: {name}: gathering the ranks' figures", env.rank))?;
        if lead {
            eprintln!(
                "bench: {name}: one GPU {:.2} ms, {} GPUs {:.2} ms per step: {:.2}× the throughput, {:.1} % efficiency",
                s.one_gpu_ms, s.world, s.dp_ms, s.speedup, s.efficiency_pct
            );
            match &comm {
                Some(Ok(c)) => eprintln!(
                    "bench: {name}: all-reduce kernels {:.2} ms per step, {:.1} % of it with other kernels running \
                     (CUPTI on rank 0, {COMM_STEPS} steps)",
                    c.comm_ns as f64 / 1e6 / COMM_STEPS as f64,
                    c.hidden_pct
                ),
                Some(Err(e)) => eprintln!("bench: {name}: all-reduce overlap not measured: {e}"),
                None => {}
            }
        }
        rows.push((name.clone(), s, comm.and_then(|c| c.ok()), ranks));
    }
    watch.close();
    if !lead {
        return Ok(());
    }
    println!(
        "\n{:<12} {:>6} {:>12} {:>12} {:>9} {:>11} {:>15}",
        "config", "GPUs", "1 GPU ms", "N GPUs ms", "speedup", "efficiency", "all-reduce hid"
    );
    for (name, s, c, _) in &rows {
        let hid = c.as_ref().map_or("-".to_string(), |c| format!("{:.1}%", c.hidden_pct));
        println!(
            "{name:<12} {:>6} {:>12.2} {:>12.2} {:>8.2}× {:>10.1}% {hid:>15}",
            s.world, s.one_gpu_ms, s.dp_ms, s.speedup, s.efficiency_pct
        );
    }
    println!(
        "step = one optimizer step, batch 1 per GPU, median of {} after {} warm-up (CUDA-synchronised); 1 GPU: the \
         same ranks training alone first (mean of their medians); speedup = N · (1 GPU ms) / (N GPUs ms).",
        a.iters, a.warmup
    );
    println!("\nevery rank over {COMM_STEPS} synced steps (CUPTI), per step:");
    for (name, _, _, ranks) in &rows {
        print!("{}", rank_table(name, ranks));
    }
    if let Some(path) = &a.json {
        #[derive(serde::Serialize)]
        struct Row<'a> {
            config: &'a str,
            #[serde(flatten)]
            scaling: &'a Scaling,
            /// All-reduce kernel time and the part of it other kernels ran beside (rank 0, CUPTI; every
            /// rank in `ranks`).
            comm_ns: Option<u64>,
            comm_hidden_ns: Option<u64>,
            comm_hidden_pct: Option<f64>,
            /// Every rank's all-reduce time, hidden share and GPU idle time per step.
            ranks: &'a [RankComm],
        }
        let rows: Vec<Row> = rows
            .iter()
            .map(|(c, s, o, ranks)| Row {
                config: c,
                scaling: s,
                comm_ns: o.as_ref().map(|o| o.comm_ns),
                comm_hidden_ns: o.as_ref().map(|o| o.hidden_ns),
                comm_hidden_pct: o.as_ref().map(|o| o.hidden_pct),
                ranks,
            })
            .collect();
        let rep = serde_json::json!({ "model": cfg, "iters": a.iters, "warmup": a.warmup, "rows": rows });
        meddpm::checkpoint::write_atomic(path, serde_json::to_string_pretty(&rep)?.as_bytes())?;
        eprintln!("bench: wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: BenchArgs,
    }

    /// The CI path: the tiny preset on the CPU backend writes one row whose FLOP rate is the
    /// analytic count over the measured time, and the JSON carries the model's parameter count.
    #[test]
    fn cpu_tiny_bench_writes_json() {
        let path = std::env::temp_dir().join(format!("meddpm-bench-test-{}.json", std::process::id()));
        let p = path.to_str().unwrap();
        let cli =
            Cli::parse_from(["x", "--device", "cpu", "--preset", "tiny", "--iters", "2", "--warmup", "1", "--json", p]);
        run(&cli.a).unwrap();
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        std::fs::remove_file(&path).ok();
        assert_eq!(v["params"].as_u64(), Some(184_649), "tiny preset parameter count");
        let rows = v["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        let (fwd, train) = (r["fwd_ms"].as_f64().unwrap(), r["train_ms"].as_f64().unwrap());
        assert!(fwd > 0.0 && train > fwd, "fwd {fwd} ms, train {train} ms");
        assert_eq!(r["fwd_all_ms"].as_array().unwrap().len(), 2);
        let tflops = v["fwd_flops"].as_f64().unwrap() / (fwd * 1e-3) / 1e12;
        assert!((r["fwd_tflops"].as_f64().unwrap() - tflops).abs() <= 1e-9 * tflops.max(1.0));
        assert!(r["mem_used_bytes"].is_null(), "no memory figure on the CPU");
    }

    /// `--gpus` goes to the local launcher, which refuses clearly where no GPU is visible.
    #[test]
    fn gpus_without_a_device_is_a_clear_error() {
        if meddpm_cuda::collective::device_count() > 0 {
            println!("skipped: CUDA devices present (scripts/gpu/multigpu.sh runs bench --gpus)");
            return;
        }
        let cli = Cli::parse_from(["x", "--preset", "tiny", "--gpus", "2"]);
        let e = run(&cli.a).unwrap_err().to_string();
        assert!(e.contains("--gpus: no CUDA device is visible"), "{e}");
        assert!(Cli::try_parse_from(["x", "--gpus", "0"]).is_err(), "--gpus 0 is refused by the parser");
    }
}
