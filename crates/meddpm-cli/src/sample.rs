//! `meddpm sample`: volumes for conditioning masks from a checkpoint (or the bundled demo
//! model), with any of the engine's samplers, in batches, on one device or spread over GPUs.

use crate::args::{
    bar, whole, whole_usize, with_backend, BackendArgs, ConventionName, SamplingArgs, Weights, MAX_BATCH,
};
use anyhow::{bail, Context, Result};
use meddpm::checkpoint::{bundled, load_weights, LoadHints, LoadedWeights};
use meddpm::data::output::{self, Beside};
use meddpm::data::Volume;
use meddpm::diffusion::{Sampler, Schedule};
use meddpm::dist::spawn::GpuSelection;
use meddpm::dist::DistEnv;
use meddpm::eval::samplers::{BatchTiming, SampleTiming, TimedVolume};
use meddpm::model::UNet;
use meddpm::Backend;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct SampleArgs {
    /// Weights: a meddpm checkpoint, a safetensors state dict (meddpm convert/export) or a
    /// PyTorch .pt (Med-DDPM {'step','model','ema'} or a bare state dict). Default: the demo
    /// model bundled into this binary (testdata/demo/model.safetensors), when it has one.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Which weights: ema (as the reference samples) or model (online); ignored for a plain state dict.
    #[arg(long, value_enum, default_value = "ema")]
    pub weights: Weights,
    /// Volume depth D, 1 to 1024 [default: the file's config; 128 whole-head, 144 BraTS for .pt files].
    #[arg(long, requires = "size", allow_negative_numbers = true, value_parser = whole_usize(1, 1024))]
    pub depth: Option<usize>,
    /// Volume height = width, 1 to 1024 [default: the file's config; 128 whole-head, 192 BraTS for
    /// .pt files].
    #[arg(long, requires = "depth", allow_negative_numbers = true, value_parser = whole_usize(1, 1024))]
    pub size: Option<usize>,
    /// Seed of the first volume's noise (the next volumes take seed+1, ...).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = whole(0, u64::MAX))]
    pub seed: u64,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Conditioning mask(s) (NIfTI label volumes of the model's size) [default: the first built-in
    /// demo mask].
    #[arg(long, num_args = 1..)]
    pub mask: Vec<PathBuf>,
    /// Resample masks whose size differs from the model's (the samples are written at the
    /// mask's size); without it such a mask is an error that names both sizes.
    #[arg(long)]
    pub resize: bool,
    /// Data convention of the masks.
    #[arg(long, value_enum, default_value = "whole-head")]
    pub convention: ConventionName,
    /// Volumes to draw per mask (seeds seed, seed+1, ...), 1 to 1000000.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = whole(1, 1_000_000))]
    pub num_samples: u64,
    /// Volumes per network batch, 1 to 1024; different masks and seeds share a batch, and every
    /// volume is the one it would be alone.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = whole_usize(1, MAX_BATCH))]
    pub batch: usize,
    /// Output stem: writes <out>.nii.gz (or <out>_<i>.nii.gz, with several masks
    /// <out>_<mask>_<i>.nii.gz), a PNG preview and an HTML viewer beside each, and
    /// <out>_timing.json; existing files are an error unless --overwrite.
    #[arg(long, default_value = "sample")]
    pub out: PathBuf,
    /// Replace output files that already exist.
    #[arg(long)]
    pub overwrite: bool,
    /// Spread the volumes over GPUs of this machine, one process per GPU: a count (2), 'all', or
    /// device indices (0,1). The volume files are those one GPU writes. Under torchrun or srun,
    /// leave it out: rank r of W draws volumes r, r+W, … (each writes <out>_timing_rank<r>.json).
    #[arg(long)]
    pub gpus: Option<GpuSelection>,
    #[command(flatten)]
    pub backend: BackendArgs,
}

/// Without `--overwrite`, an error naming the first file of `stems` (and `timing`) that exists.
fn refuse_existing<'a>(a: &SampleArgs, stems: impl Iterator<Item = &'a PathBuf>, timing: PathBuf) -> Result<()> {
    if a.overwrite {
        return Ok(());
    }
    let preset = a.convention.preset();
    let mut paths = stems.flat_map(|stem| output::sample_paths(stem, preset)).chain([timing]);
    match paths.find(|p| p.exists()) {
        Some(p) => bail!("{} exists: give another --out, or --overwrite to replace it", p.display()),
        None => Ok(()),
    }
}

pub fn run(a: &SampleArgs) -> Result<()> {
    if let Some(sel) = &a.gpus {
        // before any rank starts: every file of the run, and the merged timing
        let jobs = output::sample_stems(&a.out, &a.mask, a.num_samples, a.seed);
        refuse_existing(a, jobs.iter().map(|j| &j.2), crate::dist::timing_path(&a.out, 0, 1))?;
        let world = crate::dist::launch_local(sel)?;
        return crate::dist::merge_timing(&a.out, world);
    }
    let part = DistEnv::from_env()?.filter(|e| e.world > 1);
    let group = a.weights.group();
    let w = match &a.checkpoint {
        Some(p) => load_weights(p, group, a.depth.zip(a.size))?,
        None => {
            let hints = LoadHints { size: a.depth.zip(a.size), ..LoadHints::default() };
            match bundled::load(group, &hints)? {
                Some(w) => w,
                None => bail!("no --checkpoint given, and {}", bundled::absent_message()),
            }
        }
    };
    let name = a.checkpoint.as_deref().unwrap_or(Path::new(bundled::PATH));
    for m in &w.warnings {
        eprintln!("warning: {}: {m}", name.display());
    }
    match &part {
        Some(env) => {
            let be = crate::dist::rank_backend(&a.backend, env)?;
            sample_on(&be, a, &w, env.rank, env.world)
        }
        None => with_backend!(a.backend, be => sample_on(&be, a, &w, 0, 1)),
    }
}

/// Draw the volumes (mask × seed jobs) `rank, rank + world, …` — all of them for one process —
/// in batches of `--batch`. Each volume's noise comes from its own seed, so which rank draws it
/// and in which batch changes nothing in its file.
fn sample_on<B: Backend>(be: &B, a: &SampleArgs, w: &LoadedWeights, rank: usize, world: usize) -> Result<()> {
    let cfg = w.cfg.clone();
    let size = [cfg.depth, cfg.size, cfg.size];
    let conv = a.convention.for_model(&cfg)?;
    let (timesteps, spec) = a.sampling.resolve(w.timesteps)?;
    // (name, condition, label volume) per mask
    let masks: Vec<(String, Vec<f32>, Volume)> = if a.mask.is_empty() {
        let (c, m) = meddpm::data::demo::dataset_at(size)?.condition(0)?;
        vec![("built-in demo mask 0".into(), c, m)]
    } else {
        let mut v = Vec::new();
        for p in &a.mask {
            let (c, m) = meddpm::data::load_condition_checked(p, &conv, size, a.resize)?;
            v.push((p.display().to_string(), c, m));
        }
        v
    };
    let sched = Schedule::try_cosine(timesteps)?;
    let plan = meddpm::diffusion::plan(&spec, &sched)?;
    if a.batch == 0 || a.num_samples == 0 {
        bail!("--batch and --num-samples must be at least 1");
    }
    // (mask index, seed, output stem) per volume
    let jobs = output::sample_stems(&a.out, &a.mask, a.num_samples, a.seed);
    let total = jobs.len();
    let jobs: Vec<_> = jobs.into_iter().skip(rank).step_by(world).collect();
    // each rank checks the files it writes (its volumes are its own)
    refuse_existing(a, jobs.iter().map(|j| &j.2), crate::dist::timing_path(&a.out, rank, world))?;
    if jobs.is_empty() {
        println!("rank {rank} of {world}: no volume left for this rank ({total} for {world} ranks)");
        return Ok(());
    }
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let b = a.batch.min(jobs.len());
    let mut net = UNet::new(be, &cfg, b)?;
    net.set_params(be, &w.params)?;
    let mut s = Sampler::new(be, &net)?;
    let part = if world > 1 {
        format!(" (rank {rank} of {world}: {} of the {total} volumes, jobs {rank}, {}, …)", jobs.len(), rank + world)
    } else {
        String::new()
    };
    println!(
        "meddpm sample on {}; {}: {spec} (T = {}), {} volume(s) from seed {}, {b} per batch{part}",
        be.describe(),
        a.backend.precision_choice(),
        timesteps,
        jobs.len(),
        a.seed
    );
    println!("weights: {}", w.source);
    let batches = jobs.len().div_ceil(b);
    let pb = bar((batches * spec.steps) as u64, "sample");
    let mut timing = SampleTiming {
        tool: format!("meddpm {} sample", env!("CARGO_PKG_VERSION")),
        device: be.describe(),
        sampler: spec,
        timesteps,
        batch: b,
        batches: Vec::new(),
        ranks: 1,
    };
    for chunk in jobs.chunks(b) {
        let inputs: Vec<(&[f32], u64)> = chunk.iter().map(|(m, seed, _)| (masks[*m].1.as_slice(), *seed)).collect();
        be.sync();
        let t0 = Instant::now();
        let vols = s.sample_jobs(be, &mut net, &plan, &inputs, |_| pb.inc(1))?;
        let secs = t0.elapsed().as_secs_f64();
        let mut volumes = Vec::new();
        for ((m, seed, stem), vol) in chunk.iter().zip(&vols) {
            let paths = output::write_sample_with_views(
                stem,
                &conv,
                vol,
                cfg.out_channels,
                size,
                &masks[*m].2,
                Beside::default(),
            )?;
            let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
            pb.suspend(|| println!("seed {seed}, {}: wrote {}", masks[*m].0, names.join(", ")));
            volumes.push(TimedVolume { file: names[0].clone(), mask: masks[*m].0.clone(), seed: *seed });
        }
        pb.suspend(|| println!("batch of {}: {secs:.2} s ({:.3} s/volume)", chunk.len(), secs / chunk.len() as f64));
        timing.batches.push(BatchTiming { seconds: secs, volumes });
    }
    pb.finish_and_clear();
    let tpath = crate::dist::timing_path(&a.out, rank, world);
    meddpm::checkpoint::write_atomic(&tpath, serde_json::to_string_pretty(&timing)?.as_bytes())?;
    println!(
        "{} volume(s): {:.3} s/volume (after the first batch when there are several); timing: {}",
        timing.volumes(),
        timing.seconds_per_volume(),
        tpath.display()
    );
    Ok(())
}
