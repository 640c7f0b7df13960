//! What several commands share: the backend flags (`--device`, `--precision`, `--layout`) and
//! the one place a backend is picked, the model presets, the run file (TOML), the weights
//! choice and the progress bar. Precision and layout are the engine's own enums (clap value
//! enums through the engine's `clap` feature).

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use meddpm::checkpoint::WeightGroup;
use meddpm::data::Convention;
use meddpm::diffusion::{SamplerKind, SamplerSpec, Schedule, TrainConfig};
use meddpm::model::UNetConfig;
use meddpm::{Layout, Precision, PrecisionChoice, Target};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Where the compute happens (`auto`: CUDA if a device is present, else CPU).
pub use meddpm::DeviceSel as Device;

/// `--device`: auto | cpu | cuda | cuda:N.
pub fn parse_device(s: &str) -> Result<Device, String> {
    s.parse()
}

/// Named model presets (the configurations are `UNetConfig`'s).
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
        // every variant's name is an engine preset (the test `presets_are_the_engines` holds it)
        UNetConfig::preset(self.name()).expect("a CLI preset the engine does not know")
    }
    /// The command-line name (`whole-head`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Preset::Demo => "demo",
            Preset::Tiny => "tiny",
            Preset::WholeHead => "whole-head",
            Preset::Brats => "brats",
        }
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct BackendArgs {
    /// Where to compute: auto (CUDA device 0 when one answers, else the CPU), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: Device,
    /// Precision: fp32 (true FMA), tf32 (tensor-core convs and GEMMs) or bf16 (activations stored
    /// in bf16, bf16 tensor-core convs, fp32 statistics/loss/weights/optimizer); on the CPU bf16
    /// emulates the GPU's bf16 rounding, fp32 and tf32 are the fp32 reference; fp8 (E4M3 wide
    /// convs) is refused on every device for now (eval-configs' cpu-fp8 row emulates it)
    /// [default: bf16 on GPUs with bf16 tensor cores (sm_80+), tf32 before them, fp32 on the CPU; a
    /// resumed run: its own].
    #[arg(long, value_enum)]
    pub precision: Option<Precision>,
    /// Activation layout on the GPU: ndhwc (channels-last) or ncdhw [default: ndhwc; a resumed
    /// run: its own].
    #[arg(long, value_enum)]
    pub layout: Option<Layout>,
    /// The precision a resumed run recorded (used where --precision is not given).
    #[arg(skip)]
    pub recorded: Option<Precision>,
}

impl BackendArgs {
    /// The precision in use: --precision, else the resumed run's, else the device's default.
    pub fn precision(&self) -> Precision {
        self.precision_choice().precision
    }
    /// [`BackendArgs::precision`] with the reason (what first lines print).
    pub fn precision_choice(&self) -> PrecisionChoice {
        PrecisionChoice::settle(self.precision, "--precision", self.recorded, &self.target())
    }
    pub fn layout(&self) -> Layout {
        self.layout.unwrap_or(Layout::Ndhwc)
    }
    /// These arguments with the recorded precision `p` and layout `l` where no flag gave them.
    pub fn with_defaults(&self, p: Precision, l: Layout) -> BackendArgs {
        BackendArgs {
            device: self.device.clone(),
            precision: self.precision,
            layout: self.layout.or(Some(l)),
            recorded: Some(p),
        }
    }
    /// The device to use: `Auto` becomes CUDA 0 when the driver reports a usable GPU (a light
    /// query, no backend is built), else the CPU.
    pub fn resolve(&self) -> Device {
        match &self.device {
            Device::Auto => match meddpm_cuda::usable_gpu(0) {
                Ok(_) => Device::Cuda(0),
                Err(_) => Device::Cpu,
            },
            d => d.clone(),
        }
    }
    /// What the default precision depends on: the CPU, or the chosen GPU as the driver names it
    /// (a GPU the driver cannot describe counts as the oldest supported, sm_80).
    pub fn target(&self) -> Target {
        match self.resolve() {
            Device::Cpu | Device::Auto => Target::Cpu,
            Device::Cuda(i) => meddpm_cuda::gpu_identity(i)
                .unwrap_or_else(|_| Target::Gpu { name: format!("CUDA device {i}"), cc: (8, 0) }),
        }
    }
}

/// Run `$body` with `$be` bound to the backend `$args` (a [`BackendArgs`]) chooses: the one
/// place backends are picked.
macro_rules! with_backend {
    ($args:expr, $be:ident => $body:expr) => {{
        match $args.resolve() {
            $crate::args::Device::Cpu | $crate::args::Device::Auto => {
                let $be = meddpm::cpu::CpuBackend::with_precision(match $args.precision() {
                    meddpm::Precision::Bf16 => meddpm::Precision::Bf16,
                    meddpm::Precision::Fp8 => meddpm::Precision::Fp8,
                    meddpm::Precision::Fp32 | meddpm::Precision::Tf32 => meddpm::Precision::Fp32,
                })?;
                $body
            }
            $crate::args::Device::Cuda(i) => {
                let $be = meddpm_cuda::CudaBackend::new(i, $args.precision(), $args.layout())?;
                $body
            }
        }
    }};
}
pub(crate) use with_backend;

/// Which weights of a training checkpoint to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Weights {
    /// The EMA weights (what the reference samples with).
    Ema,
    /// The online (training) weights.
    Model,
}

impl Weights {
    pub fn group(self) -> WeightGroup {
        match self {
            Weights::Ema => WeightGroup::Ema,
            Weights::Model => WeightGroup::Model,
        }
    }
    /// The group's name in a meddpm checkpoint (`ema`, `model`).
    pub fn name(self) -> &'static str {
        match self {
            Weights::Ema => "ema",
            Weights::Model => "model",
        }
    }
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

impl RunFile {
    /// The run file at `path`, or the empty one.
    pub fn read(path: Option<&Path>) -> Result<RunFile> {
        let Some(p) = path else { return Ok(RunFile::default()) };
        let s = std::fs::read_to_string(p).with_context(|| format!("reading run file {}", p.display()))?;
        toml::from_str::<RunFile>(&s).with_context(|| format!("run file {}", p.display()))
    }
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

    /// The data preset (whole-head or BraTS) of this convention.
    pub fn preset(self) -> meddpm::data::Preset {
        match self {
            ConventionName::WholeHead | ConventionName::WholeHeadReference => meddpm::data::Preset::WholeHead,
            ConventionName::Brats | ConventionName::BratsRaw => meddpm::data::Preset::Brats,
        }
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

/// A progress bar of `len` steps labelled `what`.
pub fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(&format!(
            "{what} {{bar:30}} {{pos}}/{{len}} [{{elapsed_precise}}<{{eta_precise}}, {{per_sec}}] {{msg}}"
        ))
        .expect("valid template"),
    );
    pb
}

// ---- value ranges ------------------------------------------------------------------------------
//
// Every numeric flag parses through one of these, so a value out of range is refused by clap
// (exit 2) with the range in the message. Flags that take them also set
// `allow_negative_numbers`, so that `-5` reaches the parser instead of reading as a flag.

/// A whole number in `lo..=hi` (`hi` = `u64::MAX`: no upper bound).
pub fn whole(lo: u64, hi: u64) -> impl Fn(&str) -> Result<u64, String> + Clone + Send + Sync + 'static {
    move |s: &str| {
        let expected = || match (lo, hi) {
            (lo, u64::MAX) => format!("must be a whole number ≥ {lo}"),
            (lo, hi) => format!("must be a whole number from {lo} to {hi}"),
        };
        match s.trim().parse::<i128>() {
            Ok(v) if v >= lo as i128 && v <= hi as i128 => Ok(v as u64),
            _ => Err(expected()),
        }
    }
}

/// [`whole`] as a `usize`.
pub fn whole_usize(lo: usize, hi: usize) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync + 'static {
    let f = whole(lo as u64, if hi == usize::MAX { u64::MAX } else { hi as u64 });
    move |s: &str| f(s).map(|v| v as usize)
}

/// A finite number `x` with `lo < x` (or `lo ≤ x` when `closed`) and `x ≤ hi`.
pub fn number(lo: f64, closed: bool, hi: f64) -> impl Fn(&str) -> Result<f64, String> + Clone + Send + Sync + 'static {
    move |s: &str| {
        let ok = |x: f64| x.is_finite() && (x > lo || closed && x == lo) && x <= hi;
        match s.trim().parse::<f64>() {
            Ok(x) if ok(x) => Ok(x),
            _ => Err(format!("must be a number in {}{lo}, {hi}]", if closed { "[" } else { "(" })),
        }
    }
}

/// [`number`] as an `f32`.
pub fn number_f32(
    lo: f64,
    closed: bool,
    hi: f64,
) -> impl Fn(&str) -> Result<f32, String> + Clone + Send + Sync + 'static {
    let f = number(lo, closed, hi);
    move |s: &str| f(s).map(|v| v as f32)
}

/// `--preview-every`: `auto`, `0` (off) or a whole number of steps.
pub fn preview_every(s: &str) -> Result<meddpm::run::PreviewEvery, String> {
    s.parse()
}

/// Values most flags allow: a batch of volumes, a count of repetitions.
pub const MAX_BATCH: usize = 1024;

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

/// The sampling flags `sample` and `synthesize` share: the model's T, the sampler, its steps and η.
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// T of the cosine schedule the model was trained with; must be the model's T where the file
    /// records it (fewer network evaluations: --steps) [default: the file's T, else 250].
    #[arg(long, allow_negative_numbers = true, value_parser = whole_usize(1, 100_000))]
    pub timesteps: Option<usize>,
    /// The sampler.
    #[arg(long, value_enum, default_value = "ddpm")]
    pub sampler: SamplerArg,
    /// Network evaluations per volume, 1..=T [default: T, all of them].
    #[arg(long, allow_negative_numbers = true, value_parser = whole_usize(1, 100_000))]
    pub steps: Option<usize>,
    /// DDIM's η in [0, 1] (ddim only) [default: 0].
    #[arg(long, allow_negative_numbers = true, value_parser = number(0.0, true, 1.0))]
    pub eta: Option<f64>,
}

impl SamplingArgs {
    /// T and the sampler for a model trained with `model_t` (None where the file does not record
    /// it): a --timesteps other than the model's is an error naming both (fewer network
    /// evaluations are --steps).
    pub fn resolve(&self, model_t: Option<usize>) -> Result<(usize, SamplerSpec)> {
        let t = Schedule::model_timesteps(self.timesteps, model_t)?;
        let spec =
            SamplerSpec { kind: self.sampler.kind(), steps: self.steps.unwrap_or(t), eta: self.eta.unwrap_or(0.0) };
        Ok((t, spec))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum;

    /// Every `--preset` is one of the engine's presets, under the same name, and the other way
    /// round: `Preset::unet` cannot miss.
    #[test]
    fn presets_are_the_engines() {
        let names: Vec<&str> = Preset::value_variants().iter().map(|p| p.name()).collect();
        assert_eq!(names, UNetConfig::PRESETS);
        for p in Preset::value_variants() {
            assert_eq!(p.to_possible_value().map(|v| v.get_name().to_string()).as_deref(), Some(p.name()));
            assert!(UNetConfig::preset(p.name()).is_some(), "{}", p.name());
        }
    }
}
