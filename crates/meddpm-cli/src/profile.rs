//! `meddpm profile`: the performance study as one command (issue 4). Runs one training step and
//! one sampling step of a preset through the op timer (`--device cpu`, or `--device cuda`: per
//! call between device syncs until the CUPTI timeline exists), and/or reads Nsight
//! Compute exports (`--ncu-csv raw.csv --ncu-details details.csv`, `--matrix NAME=raw.csv`), adds
//! roofline predictions for every GPU of the table (also for presets only counted, `--predict`),
//! and writes the report folder (`report.md`, CSV, JSON, SVG) plus a terminal summary.
//!
//! Whatever cannot be collected (no CUDA device, no CUPTI timeline yet, an unreadable export) is named in the
//! report's "Not collected" section and the rest is still written. The engine does the work
//! (`meddpm::analysis`); this file only wires arguments to it.

use crate::run::Preset;
use anyhow::{Context, Result};
use meddpm::analysis::gpus::{self, Math};
use meddpm::analysis::matrix::ConfigInput;
use meddpm::analysis::ncu::NcuData;
use meddpm::analysis::profile::{profile_unet, Options};
use meddpm::analysis::report::{self, Input};
use meddpm::analysis::timed::{NullBackend, Timed};
use meddpm::cpu::CpuBackend;
use meddpm::{Backend, Layout, Precision};
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ProfileDevice {
    /// Time every backend call on the CPU reference backend.
    Cpu,
    /// Time every backend call on CUDA device 0 (NDHWC; `--math fp32` or tf32), synced per call.
    Cuda,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum MathArg {
    Fp32,
    Tf32,
    Bf16,
}

/// One `--matrix` configuration: a name, an ncu raw export, optionally the launch IDs to sum.
#[derive(Clone, Debug)]
pub struct MatrixSpec {
    pub name: String,
    pub path: PathBuf,
    pub ids: Option<Vec<u64>>,
}

fn parse_matrix(s: &str) -> Result<MatrixSpec, String> {
    let bad = || format!("'{s}' is not NAME=RAW.csv or NAME=RAW.csv:ID,ID,…");
    let (name, rest) = s.split_once('=').ok_or_else(bad)?;
    let (path, ids) = match rest.rsplit_once(':') {
        Some((p, list)) if !list.is_empty() && list.split(',').all(|x| x.trim().parse::<u64>().is_ok()) => {
            (p, Some(list.split(',').map(|x| x.trim().parse().expect("checked")).collect()))
        }
        _ => (rest, None),
    };
    if name.is_empty() || path.is_empty() {
        return Err(bad());
    }
    Ok(MatrixSpec { name: name.to_string(), path: PathBuf::from(path), ids })
}

#[derive(clap::Args, Debug)]
pub struct ProfileArgs {
    /// Run the model here and time it: cpu, or cuda. Default: cpu, unless only ncu exports are given.
    #[arg(long, value_enum)]
    pub device: Option<ProfileDevice>,
    /// Model preset to run.
    #[arg(long, value_enum, default_value = "tiny")]
    pub preset: Preset,
    /// Report folder.
    #[arg(long, short, default_value = "profile-report")]
    pub out: PathBuf,
    /// Nsight Compute raw-page export (`ncu -i REP --page raw --csv --print-units base`).
    #[arg(long)]
    pub ncu_csv: Option<PathBuf>,
    /// Nsight Compute details-page export (`ncu -i REP --page details --csv`): rules and speedups.
    #[arg(long)]
    pub ncu_details: Option<PathBuf>,
    /// A configuration of the optimisation matrix from its ncu raw export: NAME=RAW.csv, or
    /// NAME=RAW.csv:ID,ID,… to sum only those launches. Repeat it; the first is the baseline
    /// (e.g. --matrix fp32-ncdhw=a.csv --matrix tf32-ndhwc=b.csv).
    #[arg(long = "matrix", value_parser = parse_matrix)]
    pub matrix: Vec<MatrixSpec>,
    /// Also count (without running) a training and a sampling step of these presets for the
    /// roofline predictions across GPUs.
    #[arg(long, value_enum)]
    pub predict: Vec<Preset>,
    /// Convolution/GEMM math of the roofline predictions.
    #[arg(long, value_enum, default_value = "tf32")]
    pub math: MathArg,
    /// Unrecorded repetitions before the recorded steps.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Recorded repetitions; the report keeps the median step and shows the spread.
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Rows of the top-kernels table.
    #[arg(long, default_value_t = 15)]
    pub top: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

fn preset_name(p: Preset) -> &'static str {
    match p {
        Preset::Demo => "demo",
        Preset::Tiny => "tiny",
        Preset::WholeHead => "whole-head",
        Preset::Brats => "brats",
    }
}

pub fn run(a: &ProfileArgs) -> Result<()> {
    let math = match a.math {
        MathArg::Fp32 => Math::Fp32,
        MathArg::Tf32 => Math::Tf32,
        MathArg::Bf16 => Math::Bf16,
    };
    let have_ncu = a.ncu_csv.is_some() || a.ncu_details.is_some() || !a.matrix.is_empty();
    let device = a.device.or(if have_ncu { None } else { Some(ProfileDevice::Cpu) });
    let cfg = a.preset.unet();
    let mut input = Input {
        title: format!("Med-DDPM U-Net, preset {}", preset_name(a.preset)),
        device: "none (no model run)".into(),
        config: format!(
            "preset {} ({}×{}×{}, {} base channels, channel_mult {:?}), batch 1",
            preset_name(a.preset),
            cfg.depth,
            cfg.size,
            cfg.size,
            cfg.model_channels,
            cfg.channel_mult
        ),
        math: Some(math),
        top_n: a.top,
        ..Input::default()
    };
    if device.is_none() {
        input.title = "Nsight Compute exports".into();
        input.config = "no model run (counters and matrix from the given exports)".into();
    }
    let opts = Options { seed: a.seed, warmup: a.warmup, repeats: a.repeats, ..Options::default() };
    match device {
        Some(ProfileDevice::Cpu) => {
            if matches!(a.preset, Preset::WholeHead | Preset::Brats) {
                eprintln!(
                    "note: a {} step on the CPU backend takes a very long time; --predict {} counts it without running",
                    preset_name(a.preset),
                    preset_name(a.preset)
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
            let precision = if matches!(a.math, MathArg::Fp32) { Precision::Fp32 } else { Precision::Tf32 };
            match meddpm_cuda::CudaBackend::new(0, precision, Layout::Ndhwc) {
                Ok(cuda) => {
                    input.device_gpu = gpus::find(&cuda.info().name);
                    // the roofline uses the math the backend runs (it has fp32 and tf32)
                    input.math = Some(if precision == Precision::Fp32 { Math::Fp32 } else { Math::Tf32 });
                    let be = Timed::new(cuda);
                    input.device = be.describe();
                    input.passes = profile_unet(&be, &cfg, &opts).context("profiling on the CUDA backend")?;
                    input.not_collected.push(
                        "CUPTI kernel timeline: not built yet — GPU times here are per backend call between two device \
                         syncs (each call's kernels plus launch latency; no per-kernel names, grids or registers)"
                            .into(),
                    );
                }
                Err(e) => {
                    eprintln!("warning: {e}");
                    input.not_collected.push(format!("GPU timeline: no CUDA backend ({e})"));
                }
            }
        }
        None => {}
    }
    // counted-only passes for the roofline predictions
    for &p in &a.predict {
        let nb = Timed::new(NullBackend::default());
        let o = Options {
            warmup: 0,
            repeats: 1,
            measured: false,
            label: format!(" ({}, counted)", preset_name(p)),
            ..opts.clone()
        };
        input
            .passes
            .extend(profile_unet(&nb, &p.unet(), &o).with_context(|| format!("counting preset {}", preset_name(p)))?);
    }
    // Nsight Compute exports: a bad file is reported, not fatal
    if a.ncu_csv.is_some() || a.ncu_details.is_some() {
        match NcuData::load(a.ncu_csv.as_deref(), a.ncu_details.as_deref()) {
            Ok(n) => input.ncu = Some(n),
            Err(e) => {
                eprintln!("warning: {e}");
                input.not_collected.push(format!("hardware counters: {e}"));
            }
        }
    } else {
        input.not_collected.push(
            "hardware counters (Nsight Compute): no export given (run under `ncu --set full` and pass --ncu-csv raw.csv \
             --ncu-details details.csv)"
                .into(),
        );
    }
    for m in &a.matrix {
        match NcuData::load(Some(&m.path), None) {
            Ok(n) => {
                let ks: Vec<_> = match &m.ids {
                    Some(ids) => n.kernels.into_iter().filter(|k| ids.contains(&k.id)).collect(),
                    None => n.kernels,
                };
                if ks.is_empty() {
                    input.not_collected.push(format!(
                        "matrix configuration {}: no kernel with IDs {:?} in {}",
                        m.name,
                        m.ids,
                        m.path.display()
                    ));
                } else {
                    input.matrix.push(ConfigInput::from_ncu(&m.name, &ks));
                }
            }
            Err(e) => {
                eprintln!("warning: {e}");
                input.not_collected.push(format!("matrix configuration {}: {e}", m.name));
            }
        }
    }
    if !a.matrix.is_empty() && input.matrix.len() < 2 {
        input.not_collected.push("optimization matrix: fewer than two configurations could be read".into());
    }
    let (r, files) =
        report::write(&input, &a.out).with_context(|| format!("writing the report to {}", a.out.display()))?;
    print!("{}", report::summary(&r));
    println!("report: {} ({} files)", a.out.join("report.md").display(), files.len());
    Ok(())
}
