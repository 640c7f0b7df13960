//! `meddpm._meddpm`: the native half of the Python package `meddpm` (the pure-Python half,
//! `python/meddpm/__init__.py`, converts numpy arrays and nibabel images). Thin: every function
//! calls the engine (`meddpm::checkpoint`, `meddpm::data::synth`, `meddpm::run::train_run`) on
//! the CPU or CUDA backend, with the GIL released while it works. Volumes cross as little-endian f32 bytes in NIfTI order (x
//! fastest, i.e. a Fortran-order (X, Y, Z) array) with their dims. Engine errors become
//! `meddpm.MeddpmError` with the message the CLI prints.

use meddpm::checkpoint::Checkpoint;
use meddpm::checkpoint::{bundled, load_weights, LoadHints, LoadedWeights, WeightGroup};
use meddpm::cpu::CpuBackend;
use meddpm::data::synth::{self, Format, ModelId, SynthSpec};
use meddpm::data::{Convention, Volume};
use meddpm::diffusion::{SamplerKind, SamplerSpec, Schedule};
use meddpm::diffusion::{TrainConfig, Trainer};
use meddpm::model::UNetConfig;
use meddpm::run::job::{train_run, Event, TrainJob};
use meddpm::run::{override_train, DataSource, Faults, Outcome, Overrides, PreviewEvery, RunRecord, StopFlag};
use meddpm::{Backend, DeviceSel, Layout, Precision, PrecisionChoice, Target as HwTarget};
use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::path::PathBuf;

create_exception!(meddpm, MeddpmError, PyRuntimeError, "An error of the meddpm engine (the CLI's message).");

fn err(e: impl std::fmt::Display) -> PyErr {
    MeddpmError::new_err(e.to_string())
}

/// Where and how to compute: the device, its precision (with the reason) and layout.
#[derive(Clone, Debug)]
struct Target {
    device: DeviceSel,
    precision: Precision,
    choice: PrecisionChoice,
    layout: Layout,
    /// What the default precision depends on.
    hw: HwTarget,
}

impl Target {
    /// `precision="auto"` follows the device as the CLI's default does (bf16 on sm_80+ GPUs, TF32
    /// before them, fp32 on the CPU).
    fn parse(device: &str, precision: &str, layout: &str) -> PyResult<Target> {
        let device: DeviceSel = device.parse().map_err(err)?;
        let asked = match precision {
            "auto" => None,
            "fp32" => Some(Precision::Fp32),
            "tf32" => Some(Precision::Tf32),
            "bf16" => Some(Precision::Bf16),
            p => return Err(err(format!("precision {p:?}: expected auto, fp32, tf32 or bf16"))),
        };
        let layout = match layout {
            "ndhwc" => Layout::Ndhwc,
            "ncdhw" => Layout::Ncdhw,
            l => return Err(err(format!("layout {l:?}: expected ndhwc or ncdhw"))),
        };
        let (device, hw) = match device {
            DeviceSel::Auto => match meddpm_cuda::usable_gpu(0) {
                Ok(t) => (DeviceSel::Cuda(0), t),
                Err(_) => (DeviceSel::Cpu, HwTarget::Cpu),
            },
            DeviceSel::Cuda(i) => {
                let t = meddpm_cuda::usable_gpu(i)
                    .map_err(|e| err(format!("device=\"cuda:{i}\" asked, but no CUDA device is usable: {e}")))?;
                (DeviceSel::Cuda(i), t)
            }
            d => (d, HwTarget::Cpu),
        };
        let choice = PrecisionChoice::settle(asked, "precision=", None, &hw);
        Ok(Target { device, precision: choice.precision, choice, layout, hw })
    }
}

/// Run `$body` with `$be` bound to the backend of `$t` (a [`Target`]).
macro_rules! with_backend {
    ($t:expr, $be:ident => $body:expr) => {{
        match $t.device {
            DeviceSel::Cuda(i) => {
                let $be = meddpm_cuda::CudaBackend::new(i, $t.precision, $t.layout)?;
                $body
            }
            _ => {
                let $be = CpuBackend::with_precision(match $t.precision {
                    Precision::Bf16 => Precision::Bf16,
                    _ => Precision::Fp32,
                })?;
                $body
            }
        }
    }};
}

fn sampler_spec(sampler: &str, steps: Option<usize>, timesteps: usize, eta: f64) -> PyResult<SamplerSpec> {
    let kind: SamplerKind = sampler.parse().map_err(err)?;
    Ok(SamplerSpec { kind, steps: steps.unwrap_or(timesteps), eta })
}

fn convention(name: &str, w: &LoadedWeights) -> PyResult<Convention> {
    let c = match name {
        "whole-head" => Convention { num_labels: w.cfg.cond_channels() + 1, ..Convention::whole_head() },
        "whole-head-reference" => {
            Convention { num_labels: w.cfg.cond_channels() + 1, ..Convention::whole_head_reference() }
        }
        "brats" => Convention::brats(),
        n => return Err(err(format!("convention {n:?}: expected whole-head, whole-head-reference or brats"))),
    };
    Ok(c)
}

fn group(weights: &str) -> PyResult<WeightGroup> {
    match weights {
        "ema" => Ok(WeightGroup::Ema),
        "model" => Ok(WeightGroup::Model),
        w => Err(err(format!("weights {w:?}: expected ema or model"))),
    }
}

/// Weights and their identity: a file (`.pt` or safetensors), or the bundled demo model.
fn load_model(
    path: Option<PathBuf>,
    group: WeightGroup,
    size: Option<(usize, usize)>,
) -> PyResult<(LoadedWeights, ModelId)> {
    match path {
        Some(p) => {
            let w = load_weights(&p, group, size).map_err(err)?;
            Ok((w, ModelId::of_file(&p, group).map_err(err)?))
        }
        None => {
            let hints = LoadHints { size, ..LoadHints::default() };
            match (bundled::load(group, &hints).map_err(err)?, ModelId::bundled(group).map_err(err)?) {
                (Some(w), Some(id)) => Ok((w, id)),
                _ => Err(err(format!("no checkpoint given, and {}", bundled::absent_message()))),
            }
        }
    }
}

/// A loaded model: weights, their identity and the device they run on.
#[pyclass(module = "meddpm._meddpm", frozen)]
struct Model {
    weights: LoadedWeights,
    id: ModelId,
    target: Target,
}

#[pymethods]
impl Model {
    #[new]
    #[pyo3(signature = (path=None, device="cpu", precision="auto", layout="ndhwc", weights="ema", size=None))]
    fn new(
        path: Option<PathBuf>,
        device: &str,
        precision: &str,
        layout: &str,
        weights: &str,
        size: Option<(usize, usize)>,
    ) -> PyResult<Model> {
        let target = Target::parse(device, precision, layout)?;
        let (weights, id) = load_model(path, group(weights)?, size)?;
        Ok(Model { weights, id, target })
    }

    /// Where the weights came from (one line), and the checkpoint file's XXH3-128 hash.
    #[getter]
    fn source(&self) -> String {
        self.weights.source.clone()
    }
    #[getter]
    fn checkpoint_hash(&self) -> String {
        self.id.hash.clone()
    }
    /// (D, H, W) the model samples at.
    #[getter]
    fn size(&self) -> (usize, usize, usize) {
        (self.weights.cfg.depth, self.weights.cfg.size, self.weights.cfg.size)
    }
    /// The precision sampling uses (fp32, tf32 or bf16).
    #[getter]
    fn precision(&self) -> &'static str {
        self.target.precision.name()
    }
    /// Which precision, and why (e.g. "precision fp32 (default on the CPU: …)").
    #[getter]
    fn precision_reason(&self) -> String {
        self.target.choice.to_string()
    }
    #[getter]
    fn device(&self) -> String {
        match self.target.device {
            DeviceSel::Cuda(i) => format!("cuda:{i}"),
            _ => "cpu".into(),
        }
    }

    /// Sample one volume per mask. `masks`: (bytes of x-fastest f32 voxels, (X, Y, Z)) each;
    /// mask k uses seed `seed + k`. Returns per mask a list of (suffix, bytes, (X, Y, Z), is_label).
    #[pyo3(signature = (masks, steps=None, sampler="ddpm", seed=0, batch=1, timesteps=None, eta=0.0, convention="whole-head", resize=false))]
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    #[pyo3(name = "_sample")]
    fn sample_raw<'py>(
        &self,
        py: Python<'py>,
        masks: Vec<(Vec<u8>, (usize, usize, usize))>,
        steps: Option<usize>,
        sampler: &str,
        seed: u64,
        batch: usize,
        timesteps: Option<usize>,
        eta: f64,
        convention: &str,
        resize: bool,
    ) -> PyResult<Vec<Vec<(String, Bound<'py, PyBytes>, (usize, usize, usize), bool)>>> {
        let timesteps = Schedule::model_timesteps(timesteps, self.weights.timesteps).map_err(err)?;
        let spec = sampler_spec(sampler, steps, timesteps, eta)?;
        let conv = self::convention(convention, &self.weights)?;
        let mut vols = Vec::with_capacity(masks.len());
        for (k, (bytes, (x, y, z))) in masks.into_iter().enumerate() {
            if bytes.len() != 4 * x * y * z {
                return Err(err(format!("mask {k}: {} bytes for {x}×{y}×{z} float32 voxels", bytes.len())));
            }
            let data = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            vols.push(Volume::new([x, y, z], [1.0; 3], data));
        }
        let seeds: Vec<u64> = (0..vols.len() as u64).map(|k| seed + k).collect();
        let (w, t) = (&self.weights, self.target.clone());
        let outs = py
            .detach(|| -> meddpm::Result<_> {
                with_backend!(t, be => synth::sample_masks(&be, w, &conv, &vols, &seeds, &spec, timesteps, batch, resize))
            })
            .map_err(err)?;
        Ok(outs
            .into_iter()
            .map(|per| {
                per.into_iter()
                    .map(|o| {
                        let b: Vec<u8> = o.volume.data.iter().flat_map(|v| v.to_le_bytes()).collect();
                        let [x, y, z] = o.volume.dims;
                        (o.suffix, PyBytes::new(py, &b), (x, y, z), o.labels)
                    })
                    .collect()
            })
            .collect())
    }
}

/// `meddpm synthesize` (see its --help); returns a summary dict.
#[pyfunction]
#[pyo3(signature = (out, format="nnunet", masks=Vec::new(), checkpoint=None, weights="ema", augment=0, count=None,
    seed=0, sampler="ddpm", steps=None, timesteps=None, eta=0.0, batch=1, convention="whole-head",
    dataset_id=500, dataset_name="MedDDPM", device="cpu", precision="auto", layout="ndhwc", resize=false))]
#[allow(clippy::too_many_arguments)]
fn synthesize<'py>(
    py: Python<'py>,
    out: PathBuf,
    format: &str,
    masks: Vec<PathBuf>,
    checkpoint: Option<PathBuf>,
    weights: &str,
    augment: usize,
    count: Option<usize>,
    seed: u64,
    sampler: &str,
    steps: Option<usize>,
    timesteps: Option<usize>,
    eta: f64,
    batch: usize,
    convention: &str,
    dataset_id: u32,
    dataset_name: &str,
    device: &str,
    precision: &str,
    layout: &str,
    resize: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let t = Target::parse(device, precision, layout)?;
    let (w, id) = load_model(checkpoint, group(weights)?, None)?;
    let timesteps = Schedule::model_timesteps(timesteps, w.timesteps).map_err(err)?;
    let format: Format = format.parse().map_err(err)?;
    let spec = SynthSpec {
        dataset_id,
        dataset_name: dataset_name.into(),
        masks,
        augment,
        count,
        seed,
        sampler: sampler_spec(sampler, steps, timesteps, eta)?,
        timesteps,
        batch,
        convention: self::convention(convention, &w)?,
        resize,
        ..SynthSpec::new(out, format)
    };
    let root = spec.root();
    let s = py
        .detach(|| -> meddpm::Result<_> { with_backend!(t, be => synth::synthesize(&be, &w, &id, &spec, |_| {})) })
        .map_err(|e| err(format!("synthesizing into {}: {e}", root.display())))?;
    let d = PyDict::new(py);
    d.set_item("root", s.root)?;
    d.set_item("planned", s.planned)?;
    d.set_item("skipped", s.skipped)?;
    d.set_item("sampled", s.sampled)?;
    d.set_item("notes", s.notes)?;
    d.set_item("manifest", spec.manifest_path())?;
    Ok(d)
}

/// The data convention `name` for `unet`, checked against its channel counts (the CLI's
/// `--convention`).
fn convention_for(name: &str, unet: &UNetConfig) -> PyResult<Convention> {
    let mut c = match name {
        "whole-head" => Convention::whole_head(),
        "whole-head-reference" => Convention::whole_head_reference(),
        "brats" => Convention::brats(),
        "brats-raw" => Convention { brats_preprocess: true, ..Convention::brats() },
        n => {
            return Err(err(format!("convention {n:?}: expected whole-head, whole-head-reference, brats or brats-raw")))
        }
    };
    if c.preset == meddpm::data::Preset::WholeHead {
        c.num_labels = unet.cond_channels() + 1;
    }
    if c.image_channels() != unet.out_channels || c.cond_channels() != unet.cond_channels() {
        return Err(err(format!(
            "convention {name:?} gives {} image and {} condition channels; the model has {} out and {} in channels",
            c.image_channels(),
            c.cond_channels(),
            unet.out_channels,
            unet.in_channels
        )));
    }
    Ok(c)
}

/// A preset's model (the CLI's `--preset`).
fn preset_unet(name: &str) -> PyResult<UNetConfig> {
    UNetConfig::preset(name)
        .ok_or_else(|| err(format!("preset {name:?}: expected demo, tiny, whole-head or brats")))
}

/// What `train` settled before the trainer exists: a new run, or the resumed checkpoint.
struct TrainPlan {
    unet: UNetConfig,
    tc: TrainConfig,
    record: RunRecord,
    /// The checkpoint resumed, and its run record.
    resume: Option<(Checkpoint, RunRecord)>,
    convention: Convention,
    notes: Vec<String>,
}

/// The run's words and outcome, as `train` returns them.
struct TrainOutcome {
    outcome: &'static str,
    reason: Option<String>,
    start: u64,
    step: u64,
    secs: f64,
    losses: (f32, f32),
    checkpoint: PathBuf,
    loss_csv: PathBuf,
    progress: Option<PathBuf>,
    previews: u64,
    samples: Vec<PathBuf>,
    log: Vec<String>,
}

/// Train `plan` on the backend of `t` until it finishes or `stop` is requested (see `train`).
fn train_on<B: Backend>(
    be: &B,
    plan: TrainPlan,
    t: &Target,
    preview_every: PreviewEvery,
    resize: bool,
    verbose: bool,
    stop: &StopFlag,
) -> meddpm::Result<TrainOutcome> {
    let TrainPlan { unet, tc, record, resume, convention, notes } = plan;
    let mut log = Vec::new();
    let mut say = |line: String| {
        if verbose {
            println!("{line}");
        }
        log.push(line);
    };
    for n in notes {
        say(format!("note: {n}"));
    }
    let (mut tr, resumed) = match resume {
        Some((ck, rec)) => {
            let mut tr = ck.restore_trainer(be)?;
            tr.tc = tc; // the checkpoint's, with lr / grad_accum applied
            (tr, Some((ck.path.clone(), Some(rec))))
        }
        None => (Trainer::new(be, &unet, &tc)?, None),
    };
    let sample_at_end = record.sample_at_end;
    let job = TrainJob {
        record,
        convention,
        resumed,
        resize,
        preview_every,
        stop,
        faults: Faults::default(),
        ranks: None,
        first_line: format!("; {}", t.choice),
    };
    let report = train_run(be, &mut tr, job, |e| match e {
        Event::Say(m) => say(m),
        Event::Note(m) => say(format!("note: {m}")),
        Event::Warn(lines) => {
            lines.into_iter().enumerate().for_each(|(i, l)| say(if i == 0 { format!("warning: {l}") } else { l }))
        }
        Event::Preview { step, path, secs } => say(format!("preview: step {step} in {secs:.1} s: {}", path.display())),
        Event::Begin { .. } | Event::Step { .. } | Event::Sampling { .. } => {}
    })?;
    let sm = &report.summary;
    let (outcome, reason) = match &sm.outcome {
        Outcome::Finished => ("finished", None),
        Outcome::Stopped => ("stopped", None),
        Outcome::Diverged { step, reason } => ("diverged", Some(format!("training diverged at step {step}: {reason}"))),
    };
    let mut samples = Vec::new();
    if outcome == "finished" && sample_at_end {
        samples = meddpm::run::job::sample_at_end(be, &mut tr, &report, |e| {
            if let Event::Say(m) = e {
                say(m)
            }
        })?;
    }
    Ok(TrainOutcome {
        outcome,
        reason,
        start: sm.start,
        step: sm.end,
        secs: report.secs,
        losses: sm.loss_means(10),
        checkpoint: report.checkpoint.clone(),
        loss_csv: report.loss_csv.clone(),
        progress: report.progress.clone(),
        previews: report.previews,
        samples,
        log,
    })
}

/// `meddpm train` (see its --help): a new run into `out`, or `resume` a run from its checkpoint
/// (keyword arguments then override its settings, as the command's flags do). Returns a dict
/// with the outcome ("finished", "stopped" after Ctrl-C: the checkpoint is saved, "diverged"),
/// the steps, the files and the log lines. The GIL is released while it trains.
#[pyfunction]
#[pyo3(signature = (out=None, preset=None, masks=None, images=Vec::new(), manifest=None, convention=None,
    steps=None, lr=None, grad_accum=None, batch=None, seed=None, checkpoint_every=None, resume=None,
    sample_at_end=None, preview_every="auto", resize=false, workers=2, device="cpu", precision="auto",
    layout="ndhwc", verbose=true))]
#[allow(clippy::too_many_arguments)]
fn train<'py>(
    py: Python<'py>,
    out: Option<PathBuf>,
    preset: Option<&str>,
    masks: Option<PathBuf>,
    images: Vec<PathBuf>,
    manifest: Option<PathBuf>,
    convention: Option<&str>,
    steps: Option<u64>,
    lr: Option<f32>,
    grad_accum: Option<usize>,
    batch: Option<usize>,
    seed: Option<u64>,
    checkpoint_every: Option<u64>,
    resume: Option<PathBuf>,
    sample_at_end: Option<bool>,
    preview_every: &str,
    resize: bool,
    workers: usize,
    device: &str,
    precision: &str,
    layout: &str,
    verbose: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let preview_every: PreviewEvery =
        preview_every.parse().map_err(|e| err(format!("preview_every {preview_every:?}: {e}")))?;
    if steps == Some(0) {
        return Err(err("steps = 0: a run needs at least 1 optimizer step"));
    }
    let mut t = Target::parse(device, precision, layout)?;
    let own_data = masks.is_some() || manifest.is_some();
    let data = own_data.then(|| DataSource::from_paths(masks.as_deref(), &images, manifest.as_deref()));
    let plan = match &resume {
        Some(path) => {
            let ck = Checkpoint::read(path).map_err(err)?;
            let (Some(unet), Some(mut tc)) = (ck.unet.clone(), ck.train.clone()) else {
                return Err(err(format!("{}: not a meddpm training checkpoint", path.display())));
            };
            let mut notes = override_train(&mut tc, lr, grad_accum, batch, seed).map_err(err)?;
            let Some(rec) = RunRecord::from_checkpoint(&ck).map_err(err)? else {
                return Err(err(format!(
                    "{}: no run record (written by an older meddpm); resume it with `meddpm train --resume`",
                    path.display()
                )));
            };
            let asked = (precision != "auto").then_some(t.precision);
            let o = Overrides {
                steps,
                checkpoint_every,
                out: out.clone(),
                sample_at_end,
                data,
                convention: convention.map(str::to_string),
                precision: asked,
                layout: Some(t.layout),
            };
            let (here, moved) = rec.resumed_at(path).map_err(err)?;
            notes.extend(moved);
            let (new, more) = here.apply(&o).map_err(err)?;
            notes.extend(more);
            // a resumed run keeps its own precision unless one was asked for
            t.choice = PrecisionChoice::settle(asked, "precision=", Some(new.precision), &t.hw);
            t.precision = t.choice.precision;
            let conv = convention_for(&new.convention, &unet)?;
            TrainPlan { unet, tc, record: new, resume: Some((ck, rec)), convention: conv, notes }
        }
        None => {
            if own_data && preset.is_none() {
                return Err(err(
                    "masks/manifest: say which model to train on this data with preset= (whole-head, brats, tiny or demo)",
                ));
            }
            let preset = preset.unwrap_or("demo");
            let unet = preset_unet(preset)?;
            let mut tc = TrainConfig::for_preset(preset);
            override_train(&mut tc, lr, grad_accum, batch, seed).map_err(err)?;
            let conv_name = convention.unwrap_or("whole-head");
            let record = RunRecord {
                out: out.clone().unwrap_or_else(|| PathBuf::from("runs/demo")),
                data: data.unwrap_or(DataSource::Demo),
                convention: conv_name.to_string(),
                steps: steps.unwrap_or(200),
                checkpoint_every: checkpoint_every.unwrap_or(100),
                sample_at_end: sample_at_end.unwrap_or(true),
                workers,
                precision: t.precision,
                layout: t.layout,
                pairs: Vec::new(),
            };
            unet.validate().map_err(err)?;
            tc.validate().map_err(err)?;
            let conv = convention_for(conv_name, &unet)?;
            TrainPlan { unet, tc, record, resume: None, convention: conv, notes: Vec::new() }
        }
    };
    // The run trains on a thread of its own; this one waits without the GIL and looks for
    // Ctrl-C (Python's SIGINT) between waits: a Ctrl-C asks the run to stop after its step.
    let stop = StopFlag::new();
    let (tx, rx) = std::sync::mpsc::channel();
    let rx = std::sync::Mutex::new(rx); // shared with the GIL-free waits
    let result = std::thread::scope(|scope| {
        let (stop, t) = (&stop, &t);
        scope.spawn(move || {
            let r = (|| -> meddpm::Result<TrainOutcome> {
                with_backend!(t, be => train_on(&be, plan, t, preview_every, resize, verbose, stop))
            })();
            let _ = tx.send(r);
        });
        loop {
            match py.detach(|| {
                rx.lock().unwrap_or_else(|e| e.into_inner()).recv_timeout(std::time::Duration::from_millis(100))
            }) {
                Ok(r) => break r,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    if py.check_signals().is_err() {
                        stop.request();
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    break Err(meddpm::Error::Config("the training thread ended without a result".into()))
                }
            }
        }
    });
    let o = result.map_err(err)?;
    if let Some(reason) = &o.reason {
        return Err(err(format!("{reason}; the last good checkpoint is kept: {}", o.checkpoint.display())));
    }
    let d = PyDict::new(py);
    d.set_item("outcome", o.outcome)?;
    d.set_item("start", o.start)?;
    d.set_item("step", o.step)?;
    d.set_item("seconds", o.secs)?;
    d.set_item("loss_first", o.losses.0)?;
    d.set_item("loss_last", o.losses.1)?;
    d.set_item("checkpoint", o.checkpoint)?;
    d.set_item("loss_csv", o.loss_csv)?;
    d.set_item("progress", o.progress)?;
    d.set_item("previews", o.previews)?;
    d.set_item("samples", o.samples)?;
    d.set_item("precision", t.precision.name())?;
    d.set_item("log", o.log)?;
    Ok(d)
}

#[pymodule]
fn _meddpm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Model>()?;
    m.add_function(wrap_pyfunction!(synthesize, m)?)?;
    m.add_function(wrap_pyfunction!(train, m)?)?;
    m.add("MeddpmError", m.py().get_type::<MeddpmError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
