//! The `meddpm` command: glue between arguments, the engine and the backends.
//!
//! Subcommands parse their arguments once into typed structs, pick a backend once (`--device`),
//! and call a function generic over `meddpm::Backend`. Errors print as one chain with exit code 2.

mod args;
mod bench;
mod convert;
mod dist;
mod doctor;
mod eval;
mod evalcfg;
mod info;
mod lesion;
mod masks;
mod preview;
mod profile;
mod sample;
mod study;
mod synthesize;
mod train;
mod view;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "meddpm",
    version,
    about = "Train and sample Med-DDPM (mask-conditioned 3D brain-MRI diffusion) on CPU or NVIDIA GPUs"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train a model. With no data options it trains the built-in demo (small model, built-in
    /// volumes), then samples one volume: the whole pipeline in a few minutes on 2 CPU cores.
    /// Several GPUs: `--gpus N`, or one process per GPU under torchrun or `srun`.
    Train(train::TrainArgs),
    /// Sample volumes for conditioning masks: DDPM-250 (reference) or DDIM, DPM-Solver++, iPNDM
    ///
    /// Samplers (`--sampler`, `--steps S` network evaluations per volume, all on the model's
    /// cosine schedule; x̂₀ is clipped to [−1, 1] as the reference clips):
    ///   ddpm          ancestral sampling, "fixed small" variance; the reference with S = T; with
    ///                 S < T the respaced chain of Improved DDPM (timesteps round(i·(T−1)/(S−1))).
    ///   ddim          DDIM with --eta (0: deterministic ODE solver, first order; 1 with S = T is
    ///                 ancestral DDPM); the DDIM paper's linear selection ⌊i·T/S⌋; ends on x̂₀.
    ///   dpm-solver++  DPM-Solver++(2M): multistep, second order, data prediction; time-uniform
    ///                 steps with the official discrete-time interpolation (fractional timesteps).
    ///   ipndm         iPNDM (DEIS), the sampler of the reference's fast_sampling script (10 steps
    ///                 there): DDIM steps with Adams–Bashforth-combined ε, timesteps ⌊i·(T−1)/S⌋.
    /// ddpm and ddim end on x̂₀; dpm-solver++ and ipndm on x at timestep 0, as their reference
    /// implementations (noise of σ ≈ 0.014 left).
    ///
    /// `--batch B` runs B volumes per network forward (masks and seeds mixed); each volume draws
    /// its noise from its own seed's Philox stream, so it is the same volume in any batch. Wall
    /// time per batch and per volume is printed and saved in <out>_timing.json.
    ///
    /// `--gpus N` spreads the volumes over N GPUs of this machine (one process each; rank r draws
    /// volumes r, r+N, …): the same files as one GPU, one merged <out>_timing.json.
    #[command(verbatim_doc_comment)]
    Sample(sample::SampleArgs),
    /// Make a synthetic (image, label) dataset from masks: nnU-Net v2 (DatasetNNN_Name/imagesTr,
    /// labelsTr, dataset.json), MONAI (a datalist JSON) or plain folders. --augment N adds N new
    /// masks per input (as `meddpm masks`); pair i draws from seed + i; a manifest line per pair
    /// makes any volume again bit for bit; a rerun skips finished pairs; --gpus N spreads the pairs.
    Synthesize(synthesize::SynthesizeArgs),
    /// Print a model configuration: parameters, FLOPs, planned memory.
    Info(info::InfoArgs),
    /// Make new conditioning masks: tumour scaling and shifting (the reference's augmentation).
    Masks(masks::MasksArgs),
    /// Make (mask, image) training pairs from masks and a lesion-free T1 darkened on each
    /// mask's tumour (as the demo data): the augmented masks of `meddpm masks` become training data.
    LesionPairs(lesion::LesionPairsArgs),
    /// PNG mid-slice previews of NIfTI volumes side by side.
    Preview(preview::PreviewArgs),
    /// A self-contained HTML viewer: three slices with sliders, window/level, mask overlay,
    /// volumes side by side.
    View(view::ViewArgs),
    /// Measure the whole-head train step, sampling forward and 250-step volume per precision ×
    /// layout (PyTorch side by side with --torch); with --gpus N, the data-parallel step on N
    /// GPUs against one and the scaling efficiency.
    Bench(bench::BenchArgs),
    /// Convert a reference PyTorch checkpoint (.pt) to a safetensors state dict.
    Convert(convert::ConvertArgs),
    /// Synthesis quality: SSIM / MS-SSIM (MONAI definitions), PSNR, MAE, MMD, histograms.
    Eval(eval::EvalArgs),
    /// Sample the same masks and seeds under each precision × layout (and the CPU reference);
    /// compare with the fp32 baseline and its seed-to-seed spread.
    EvalConfigs(evalcfg::EvalConfigsArgs),
    /// The sampler study's table, CSV and chart (quality against wall time per volume) from the
    /// run folders of scripts/gpu/samplers.sh.
    EvalSamplers(study::EvalSamplersArgs),
    /// Where a training and a sampling step spend their time: per-op/kernel breakdown, Nsight
    /// Compute counters, the optimization matrix, roofline.
    Profile(profile::ProfileArgs),
    /// Report the compute devices and libraries meddpm can use.
    Doctor,
}

fn main() {
    // NVLink multicast stays off unless the user says otherwise (our shared GPU machines need it
    // off); set before any thread exists, inherited by every process started from here.
    for (k, v) in meddpm::dist::spawn::NO_MULTICAST_ENV {
        if std::env::var_os(k).is_none() {
            std::env::set_var(k, v);
        }
    }
    let cli = Cli::parse();
    let r = match &cli.cmd {
        Cmd::Train(a) => train::run(a),
        Cmd::Sample(a) => sample::run(a),
        Cmd::Info(a) => info::run(a),
        Cmd::Masks(a) => masks::run(a),
        Cmd::LesionPairs(a) => lesion::run(a),
        Cmd::Preview(a) => preview::run(a),
        Cmd::View(a) => view::run(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::Convert(a) => convert::run(a),
        Cmd::Eval(a) => eval::run(a),
        Cmd::EvalConfigs(a) => evalcfg::run(a),
        Cmd::EvalSamplers(a) => study::run(a),
        Cmd::Synthesize(a) => synthesize::run(a),
        Cmd::Profile(a) => profile::run(a),
        Cmd::Doctor => doctor::run(),
    };
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        std::process::exit(2);
    }
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::CommandFactory;

    /// Every flag of every command is described (`--help` has a line for it), and a flag's
    /// default is shown: by clap, or in its text where it depends on other inputs.
    #[test]
    fn every_flag_is_described() {
        let cli = Cli::command();
        let mut missing = Vec::new();
        for sub in cli.get_subcommands() {
            for arg in sub.get_arguments().filter(|a| !a.is_hide_set()) {
                let id = arg.get_id().as_str();
                if matches!(id, "help" | "version") {
                    continue;
                }
                if arg.get_help().is_none_or(|h| h.to_string().trim().is_empty()) {
                    missing.push(format!("{} --{id}", sub.get_name()));
                }
            }
        }
        assert!(missing.is_empty(), "flags without a description: {missing:?}");
        let train = cli.find_subcommand("train").unwrap();
        for id in ["steps", "out", "preset", "lr", "seed", "batch", "checkpoint_every"] {
            let arg = train.get_arguments().find(|a| a.get_id() == id).unwrap();
            let help = arg.get_help().unwrap().to_string();
            assert!(help.contains("[default:") || !arg.get_default_values().is_empty(), "train --{id}: {help}");
        }
    }
}
