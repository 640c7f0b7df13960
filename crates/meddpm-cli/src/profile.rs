//! `meddpm profile`: the performance study as one command (issue 4). Runs one training step and
//! one sampling step of a preset and writes the report folder (`report.md`, CSV, JSON, SVG) plus
//! a terminal summary; the engine does the analysis (`meddpm::analysis`), this file collects.
//!
//! - `--device cpu`: every backend call timed between syncs (`analysis::timed::Timed`).
//! - `--device cuda`: the per-kernel GPU timeline of one training and one sampling step through
//!   CUPTI (`meddpm_cuda::cupti`: names, durations, grid/block, registers, shared memory, each
//!   kernel under the innermost backend range, e.g. `train/backward/input_blocks.1.0`), plus the
//!   per-call view (`Timed<CudaBackend>`, synced per call) as second tables.
//! - `--counters`: the binary re-runs itself under Nsight Compute (`ncu --clock-control none
//!   --set full`, NVTX range `profile/` = the recorded steps, limited to the top
//!   `--counters-kernels` kernels of the CUPTI timeline) and adds the counters and the rule
//!   priority list. cuDNN algorithms are chosen outside the profiler: the parent process runs
//!   first and leaves them in the on-disk algorithm cache, and the child's warm-up steps run
//!   outside the profiled range (cudnnFind under ncu picks wrong algorithms).
//! - `--matrix` (no value, with `--device cuda`): the four configurations fp32/TF32 ×
//!   NCDHW/NDHWC, each timed through CUPTI, as the optimisation matrix (plus ncu totals with
//!   `--counters --counters-kernels 0`). `--matrix NAME=raw.csv[:IDs]` reads ncu exports instead.
//! - `--ncu-csv/--ncu-details`: existing Nsight Compute exports; `--torch-table`: a PyTorch
//!   profiler table (the reference, category by category).
//! - `meddpm profile [options] -- COMMAND…`: any CUDA program (e.g. `python3
//!   tools/reference/profile_torch.py`) under ncu, reported the same way.
//!
//! Whatever cannot be collected (no CUDA device, CUPTI busy under another profiler, no ncu,
//! counters not permitted, an unreadable export) is named in the report's "Not collected" section
//! and the rest is still written.
//!
//! This file keeps the arguments, the ncu child (its command line, and the child itself: only
//! the steps) and the wiring. The CUDA run (steps under CUPTI with and without graphs, per-call
//! passes, counters, matrix) is `meddpm_cuda::profile_steps::cuda_report`; the inputs that need no
//! GPU backend (a program under ncu: the process, its limit, its exports; PyTorch tables; counted
//! presets; ncu and matrix exports) are `meddpm::analysis::collect`; the pure parts live in the library:
//! `--matrix` values, configuration names and the CUDA matrix inputs in
//! `meddpm::analysis::matrix`; ncu argument lists, kernel selection (top kernels, regex escaping)
//! and ncu kernels → records in `analysis::ncu`; the median, the preset line and summed passes in
//! `analysis::profile` / `analysis::report`.

use crate::args::{whole, whole_usize, Preset};
use anyhow::{Context, Result};
use meddpm::analysis::collect::{self, CommandRun};
use meddpm::analysis::gpus::Math;
use meddpm::analysis::matrix::MatrixSpec;
use meddpm::analysis::ncu;
use meddpm::analysis::profile::{preset_config, profile_unet, Options};
use meddpm::analysis::report::{self, Input};
use meddpm::analysis::timed::Timed;
use meddpm::cpu::CpuBackend;
use meddpm::model::UNetConfig;
use meddpm::{Backend, Layout, Precision};
use meddpm_cuda::cupti;
use meddpm_cuda::profile_steps::{self, CudaRun};
use meddpm_cuda::CudaBackend;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ProfileDevice {
    /// Time every backend call on the CPU reference backend.
    Cpu,
    /// CUDA device 0: CUPTI kernel timeline, plus every backend call timed between syncs.
    Cuda,
}

/// Which steps a CUDA run records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Steps {
    Both,
    Train,
}

#[derive(clap::Args, Debug)]
pub struct ProfileArgs {
    /// Run the model here and time it: cpu, or cuda. Default: cpu, unless only ncu exports, a
    /// PyTorch table or a command are given.
    #[arg(long, value_enum)]
    pub device: Option<ProfileDevice>,
    /// Model preset to run.
    #[arg(long, value_enum, default_value = "tiny")]
    pub preset: Preset,
    /// Activation layout of the CUDA run.
    #[arg(long, value_enum, default_value = "ndhwc")]
    pub layout: Layout,
    /// Report folder.
    #[arg(long, short, default_value = "profile-report")]
    pub out: PathBuf,
    /// Nsight Compute raw-page export (`ncu -i REP --page raw --csv --print-units base`).
    #[arg(long)]
    pub ncu_csv: Option<PathBuf>,
    /// Nsight Compute details-page export (`ncu -i REP --page details --csv`): rules and speedups.
    #[arg(long)]
    pub ncu_details: Option<PathBuf>,
    /// The optimisation matrix. Without a value (and --device cuda): run fp32/TF32 × NCDHW/NDHWC
    /// here through CUPTI. NAME=RAW.csv or NAME=RAW.csv:ID,ID,…: a configuration from its ncu raw
    /// export (repeat it; the first is the baseline).
    #[arg(long = "matrix", value_parser = MatrixSpec::parse, num_args = 0..=1, default_missing_value = "cuda")]
    pub matrix: Vec<MatrixSpec>,
    /// Hardware counters: re-run under Nsight Compute (`ncu --set full`) for the CUDA run or the command.
    #[arg(long)]
    pub counters: bool,
    /// With --counters on a CUDA run: profile only the N kernels with the most GPU time (each at
    /// its first launch in the recorded steps; ncu replays ~38 passes per kernel); 0 = every kernel.
    #[arg(long, default_value_t = 6, allow_negative_numbers = true, value_parser = whole_usize(0, 100_000))]
    pub counters_kernels: usize,
    /// The Nsight Compute executable.
    #[arg(long, default_value = "ncu")]
    pub ncu: String,
    /// Stop an ncu run after this many seconds, ≥ 1 (the report says so and keeps the rest).
    #[arg(long, default_value_t = 900, allow_negative_numbers = true, value_parser = whole(1, u64::MAX))]
    pub ncu_timeout: u64,
    /// With a COMMAND: only kernels inside this NVTX push/pop range (ncu --nvtx-include; e.g. "forward/").
    #[arg(long)]
    pub nvtx_include: Option<String>,
    /// With a COMMAND: only kernels whose name matches this regex (ncu -k regex:…).
    #[arg(long)]
    pub kernel_regex: Option<String>,
    /// With a COMMAND: profile at most this many kernel launches (ncu -c), ≥ 1 [default: all].
    #[arg(long, allow_negative_numbers = true, value_parser = whole_usize(1, usize::MAX))]
    pub launch_count: Option<usize>,
    /// A PyTorch profiler table (`key_averages().table(...)`) to report as a pass, e.g. the
    /// reference model's forward (tools/reference/profile_torch.py --table).
    #[arg(long)]
    pub torch_table: Vec<PathBuf>,
    /// Also count (without running) a training and a sampling step of these presets for the
    /// roofline predictions across GPUs.
    #[arg(long, value_enum)]
    pub predict: Vec<Preset>,
    /// Convolution/GEMM math: of the CUDA run (fp32 or tf32) and of the roofline predictions.
    #[arg(long, value_enum, default_value = "tf32")]
    pub math: Precision,
    /// Unrecorded repetitions before the recorded steps, 0 to 10000.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = whole_usize(0, 10_000))]
    pub warmup: usize,
    /// Recorded repetitions, 1 to 10000; the report keeps the median step and shows the spread.
    #[arg(long, default_value_t = 5, allow_negative_numbers = true, value_parser = whole_usize(1, 10_000))]
    pub repeats: usize,
    /// Rows of the top-kernels table, 1 to 10000.
    #[arg(long, default_value_t = 15, allow_negative_numbers = true, value_parser = whole_usize(1, 10_000))]
    pub top: usize,
    /// Seed of the weights and the input data.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = whole(0, u64::MAX))]
    pub seed: u64,
    /// Internal: this process runs under ncu for a parent `profile --counters` (steps only).
    #[arg(long, hide = true)]
    pub ncu_child: bool,
    /// Internal, with --ncu-child: which recorded steps sit in the `profile` range.
    #[arg(long, hide = true, value_enum, default_value = "both")]
    pub ncu_child_steps: Steps,
    /// Run this CUDA program under Nsight Compute and report its kernels (after `--`).
    #[arg(last = true)]
    pub command: Vec<String>,
}

// ---- the command --------------------------------------------------------------------------------

/// The arguments that make a child of this binary run the same steps (under ncu).
fn child_args(a: &ProfileArgs, precision: Precision, layout: Layout, steps: Steps) -> Result<Vec<String>> {
    let exe = std::env::current_exe().context("locating the meddpm binary for the ncu re-run")?;
    Ok(vec![
        exe.display().to_string(),
        "profile".into(),
        "--device".into(),
        "cuda".into(),
        "--preset".into(),
        a.preset.name().into(),
        "--math".into(),
        precision.name().into(),
        "--layout".into(),
        if layout == Layout::Ncdhw { "ncdhw" } else { "ndhwc" }.into(),
        "--warmup".into(),
        a.warmup.max(1).to_string(),
        "--repeats".into(),
        "1".into(),
        "--seed".into(),
        a.seed.to_string(),
        "--ncu-child".into(),
        "--ncu-child-steps".into(),
        if steps == Steps::Train { "train" } else { "both" }.into(),
    ])
}

pub fn run(a: &ProfileArgs) -> Result<()> {
    let ncu_matrix = a.matrix.iter().any(|m| matches!(m, MatrixSpec::Ncu { .. }));
    let cuda_matrix = a.matrix.iter().any(|m| matches!(m, MatrixSpec::Cuda));
    let have_inputs = a.ncu_csv.is_some()
        || a.ncu_details.is_some()
        || ncu_matrix
        || !a.torch_table.is_empty()
        || !a.command.is_empty();
    let device = a.device.or(if have_inputs { None } else { Some(ProfileDevice::Cpu) });
    let cfg = a.preset.unet();
    let (precision, layout) = (a.math, a.layout);
    let math = Math::from(precision);
    let opts = Options { seed: a.seed, warmup: a.warmup, repeats: a.repeats, ..Options::default() };

    if a.ncu_child {
        // under ncu for a parent --counters run: only the steps, inside the `profile` range
        let be = CudaBackend::new(0, precision, layout).context("opening the CUDA backend under ncu")?;
        be.set_graphs(false); // every kernel launched by the host, inside its NVTX range
        eprintln!(
            "profile (ncu child): NVTX {}",
            if cupti::nvtx_tool_attached() { "ranges go to the attached tool" } else { "has no tool attached" }
        );
        let mut notes = Vec::new();
        profile_steps::unet_steps(
            &be,
            &cfg,
            &opts,
            a.ncu_child_steps == Steps::Both,
            false,
            true,
            &mut notes,
            &mut Vec::new(),
        )?;
        return Ok(());
    }

    let mut input = Input {
        title: format!("Med-DDPM U-Net, preset {}", a.preset.name()),
        device: "none (no model run)".into(),
        config: preset_config(a.preset.name(), &cfg),
        math: Some(math),
        top_n: a.top,
        ..Input::default()
    };
    if device.is_none() {
        input.title = if !a.command.is_empty() {
            "command under Nsight Compute".into()
        } else if !a.torch_table.is_empty() && a.ncu_csv.is_none() && !ncu_matrix {
            "PyTorch profiler tables".into()
        } else {
            "Nsight Compute exports".into()
        };
        input.config = "no model run".into();
    }
    let mut counters_done = false;
    match device {
        Some(ProfileDevice::Cpu) => {
            if matches!(a.preset, Preset::WholeHead | Preset::Brats) {
                eprintln!(
                    "note: a {} step on the CPU backend takes a very long time; --predict {} counts it without running",
                    a.preset.name(),
                    a.preset.name()
                );
            }
            let be = Timed::new(CpuBackend::new());
            input.device = be.describe();
            input.passes = profile_unet(&be, &cfg, &opts).context("profiling on the CPU backend")?;
            input.not_collected.push(
                "GPU kernel timeline (CUPTI): this is a CPU run — times are per backend call, and a CPU conv3d_backward \
                 computes data and weight gradients in one call (category \"conv backward (dgrad+wgrad)\")"
                    .into(),
            );
        }
        Some(ProfileDevice::Cuda) => {
            counters_done = true;
            let child = |p: Precision, l: Layout, train_only: bool| {
                let steps = if train_only { Steps::Train } else { Steps::Both };
                child_args(a, p, l, steps).map_err(|e| format!("{e:#}"))
            };
            let run = CudaRun {
                precision,
                layout,
                counters: a.counters,
                counters_kernels: a.counters_kernels,
                ncu: &a.ncu,
                ncu_dir: a.out.join("ncu"),
                ncu_timeout: a.ncu_timeout,
                matrix: cuda_matrix,
                child: &child,
            };
            profile_steps::cuda_report(&cfg, &opts, &run, &mut input)?;
        }
        None => {}
    }
    if cuda_matrix && device != Some(ProfileDevice::Cuda) {
        input.not_collected.push("optimization matrix of CUDA configurations: needs --device cuda".into());
    }
    // another program under ncu
    if !a.command.is_empty() {
        let args = ncu::command_args(a.counters, a.nvtx_include.as_deref(), a.kernel_regex.as_deref(), a.launch_count);
        let run = CommandRun {
            ncu: &a.ncu,
            args,
            command: &a.command,
            dir: a.out.join("ncu"),
            counters: a.counters,
            timeout_s: a.ncu_timeout,
        };
        collect::command_pass(&mut input, &run);
        counters_done = true;
    }
    collect::torch_tables(&mut input, &a.torch_table);
    let counted: Vec<(&str, UNetConfig)> = a.predict.iter().map(|&p| (p.name(), p.unet())).collect();
    collect::predictions(&mut input, &counted, &opts)?;
    if a.ncu_csv.is_some() || a.ncu_details.is_some() {
        collect::ncu_exports(&mut input, a.ncu_csv.as_deref(), a.ncu_details.as_deref());
    } else if !counters_done || (!a.counters && a.command.is_empty()) {
        input.not_collected.push(
            "hardware counters (Nsight Compute): not requested (add --counters, or pass --ncu-csv raw.csv \
             --ncu-details details.csv)"
                .into(),
        );
    }
    collect::matrix_exports(&mut input, &a.matrix);
    let (r, files) =
        report::write(&input, &a.out).with_context(|| format!("writing the report to {}", a.out.display()))?;
    print!("{}", report::summary(&r));
    println!("report: {} ({} files)", a.out.join("report.md").display(), files.len());
    Ok(())
}
