//! `meddpm synthesize`: a synthetic (image, label) dataset from masks, for nnU-Net v2, MONAI or
//! plain folders. The engine does the work (`meddpm::data::synth`: the plan, augmentation,
//! layouts, manifest, resume, batched sampling); this file parses flags, loads the weights, picks
//! the backend, draws the progress bar (volumes per hour, ETA) and, under `--gpus`, starts one
//! rank per GPU and writes the dataset file once they are all done.

use crate::args::{whole, whole_usize, with_backend, BackendArgs, ConventionName, SamplingArgs, Weights, MAX_BATCH};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use meddpm::checkpoint::{bundled, load_weights, LoadHints, LoadedWeights};
use meddpm::data::masks::Labels;
use meddpm::data::synth::{self, Format, ModelId, Progress, SynthSpec};
use meddpm::dist::spawn::GpuSelection;
use meddpm::dist::DistEnv;
use meddpm::{Backend, PrecisionChoice};
use std::path::PathBuf;
use std::time::Instant;

/// nnU-Net's dataset ids are three digits.
fn whole_u32(lo: u32, hi: u32) -> impl Fn(&str) -> Result<u32, String> + Clone + Send + Sync + 'static {
    let f = whole(lo as u64, hi as u64);
    move |s: &str| f(s).map(|v| v as u32)
}

/// Label values of a mask.
fn whole_u8(lo: u8, hi: u8) -> impl Fn(&str) -> Result<u8, String> + Clone + Send + Sync + 'static {
    let f = whole(lo as u64, hi as u64);
    move |s: &str| f(s).map(|v| v as u8)
}

/// `--format`: the folder layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FormatArg {
    /// nnU-Net v2: <out>/DatasetNNN_Name/{imagesTr/<case>_0000.nii.gz, labelsTr/<case>.nii.gz, dataset.json}
    Nnunet,
    /// MONAI: <out>/{images, labels, datalist.json} (load_decathlon_datalist's "training" list)
    Monai,
    /// <out>/{images, masks}: what `meddpm train --masks --images` reads
    Plain,
}

impl FormatArg {
    fn format(self) -> Format {
        match self {
            FormatArg::Nnunet => Format::Nnunet,
            FormatArg::Monai => Format::Monai,
            FormatArg::Plain => Format::Plain,
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct SynthesizeArgs {
    /// Mask files or folders of .nii/.nii.gz masks. Default: the built-in demo masks.
    #[arg(long, num_args = 1..)]
    pub masks: Vec<PathBuf>,
    /// Output folder; nnunet puts DatasetNNN_Name in it (an nnUNet_raw folder).
    #[arg(long, default_value = "synthetic")]
    pub out: PathBuf,
    /// Folder layout.
    #[arg(long, value_enum, default_value = "nnunet")]
    pub format: FormatArg,
    /// New masks per input mask, made by tumour scaling and shifting (as `meddpm masks`), used
    /// beside the inputs.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = whole_usize(0, 1000))]
    pub augment: usize,
    /// Pairs to make; the masks (inputs and new ones) are used in turn [default: one per mask].
    #[arg(long, allow_negative_numbers = true, value_parser = whole_usize(1, 10_000_000))]
    pub count: Option<usize>,
    /// Pair i draws its noise from seed + i.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = whole(0, u64::MAX))]
    pub seed: u64,
    /// Weights (as for `sample`). Default: the bundled demo model, when this build has one.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Which weights of a training checkpoint.
    #[arg(long, value_enum, default_value = "ema")]
    pub weights: Weights,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Volumes per network batch (each volume is the same in any batch).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = whole_usize(1, MAX_BATCH))]
    pub batch: usize,
    /// Data convention: how masks become the model's input channels and how images are written.
    #[arg(long, value_enum, default_value = "whole-head")]
    pub convention: ConventionName,
    /// nnU-Net dataset id (NNN of DatasetNNN_Name).
    #[arg(long, default_value_t = 500, allow_negative_numbers = true, value_parser = whole_u32(1, 999))]
    pub dataset_id: u32,
    /// nnU-Net dataset name (Name of DatasetNNN_Name).
    #[arg(long, default_value = "MedDDPM")]
    pub dataset_name: String,
    /// Label of the head/brain region (augmentation).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = whole_u8(0, 255))]
    pub head_label: u8,
    /// Label of the tumour (augmentation).
    #[arg(long, default_value_t = 2, allow_negative_numbers = true, value_parser = whole_u8(0, 255))]
    pub tumour_label: u8,
    /// Spread the pairs over GPUs of this machine, one process per GPU (a count, 'all', or
    /// indices); rank r makes pairs r, r+N, …, and the dataset file is written when all are done.
    #[arg(long)]
    pub gpus: Option<GpuSelection>,
    /// Resample masks of another size than the model's volumes (each pair is then written on its
    /// mask's grid); without it such a mask is an error naming both sizes.
    #[arg(long)]
    pub resize: bool,
    #[command(flatten)]
    pub backend: BackendArgs,
}

/// The weights and their identity (file hash) for the manifest.
fn weights(a: &SynthesizeArgs) -> Result<(LoadedWeights, ModelId)> {
    let group = a.weights.group();
    Ok(match &a.checkpoint {
        Some(p) => (load_weights(p, group, None)?, ModelId::of_file(p, group)?),
        None => match (bundled::load(group, &LoadHints::default())?, ModelId::bundled(group)?) {
            (Some(w), Some(id)) => (w, id),
            _ => bail!("no --checkpoint given, and {}", bundled::absent_message()),
        },
    })
}

fn spec(a: &SynthesizeArgs, w: &LoadedWeights) -> Result<SynthSpec> {
    if a.head_label == a.tumour_label {
        bail!("--head-label and --tumour-label are both {}", a.head_label);
    }
    let (timesteps, sampler) = a.sampling.resolve(w.timesteps)?;
    Ok(SynthSpec {
        out: a.out.clone(),
        format: a.format.format(),
        dataset_id: a.dataset_id,
        dataset_name: a.dataset_name.clone(),
        masks: a.masks.clone(),
        augment: a.augment,
        count: a.count,
        seed: a.seed,
        sampler,
        timesteps,
        batch: a.batch,
        convention: a.convention.for_model(&w.cfg)?,
        labels: Labels { head: a.head_label as f32, tumour: a.tumour_label as f32 },
        rank: 0,
        world: 1,
        resize: a.resize,
    })
}

pub fn run(a: &SynthesizeArgs) -> Result<()> {
    let (w, id) = weights(a)?;
    let mut sp = spec(a, &w)?;
    if let Some(sel) = &a.gpus {
        let world = crate::dist::launch_local(sel)?;
        let path = synth::finalize(&sp)?;
        println!("{world} rank(s) done; {}", path.display());
        return Ok(());
    }
    for m in &w.warnings {
        eprintln!("warning: {}: {m}", id.name);
    }
    let precision = a.backend.precision_choice();
    match DistEnv::from_env()?.filter(|e| e.world > 1) {
        Some(env) => {
            (sp.rank, sp.world) = (env.rank, env.world);
            let be = crate::dist::rank_backend(&a.backend, &env)?;
            synthesize_on(&be, &w, &id, &sp, &precision)
        }
        None => with_backend!(a.backend, be => synthesize_on(&be, &w, &id, &sp, &precision)),
    }
}

fn synthesize_on<B: Backend>(
    be: &B,
    w: &LoadedWeights,
    id: &ModelId,
    sp: &SynthSpec,
    precision: &PrecisionChoice,
) -> Result<()> {
    let part = if sp.world > 1 { format!(", rank {} of {}", sp.rank, sp.world) } else { String::new() };
    println!(
        "meddpm synthesize on {}; {precision}: {} (T = {}), {} layout in {}{part}",
        be.describe(),
        sp.sampler,
        sp.timesteps,
        sp.format.name(),
        sp.root().display()
    );
    println!("weights: {} (hash {})", w.source, id.hash);
    let pb = ProgressBar::new(0);
    pb.set_style(
        ProgressStyle::with_template("synthesize {bar:30} {pos}/{len} [{elapsed_precise}, ETA {msg}]")
            .expect("valid template"),
    );
    let t0 = Instant::now();
    let mut first = true;
    let s = synth::synthesize(be, w, id, sp, |p: &Progress| {
        if first {
            pb.set_length(p.total as u64);
            if p.skipped > 0 {
                pb.println(format!("{} of {} pair(s) already there: skipped", p.skipped, p.total));
            }
            first = false;
        }
        pb.set_position(p.done as u64);
        pb.set_message(rate(p, t0.elapsed().as_secs_f64()));
    })
    .with_context(|| format!("synthesizing into {}", sp.root().display()))?;
    pb.finish_and_clear();
    for n in &s.notes {
        println!("note: {n}");
    }
    let secs = t0.elapsed().as_secs_f64();
    let per_hour =
        if s.sampled > 0 { format!(" ({:.0} volumes/h)", s.sampled as f64 / secs * 3600.0) } else { String::new() };
    println!(
        "{} pair(s) in {}: {} made in {secs:.1} s{per_hour}, {} already there; manifest {}",
        s.share,
        s.root.display(),
        s.sampled,
        s.skipped,
        sp.manifest_path().display()
    );
    Ok(())
}

/// "ETA 0:03:10, 412 volumes/h" from the volumes this run made so far.
fn rate(p: &Progress, secs: f64) -> String {
    if p.sampled == 0 || secs <= 0.0 {
        return "?".into();
    }
    let per_hour = p.sampled as f64 / secs * 3600.0;
    let left = (p.total - p.done) as f64 / (p.sampled as f64 / secs);
    let (h, m, s) = ((left / 3600.0) as u64, (left / 60.0) as u64 % 60, left as u64 % 60);
    format!("{h}:{m:02}:{s:02}, {per_hour:.0} volumes/h")
}
