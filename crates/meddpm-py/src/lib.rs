//! `meddpm._meddpm`: the native half of the Python package `meddpm` (the pure-Python half,
//! `python/meddpm/__init__.py`, converts numpy arrays and nibabel images). Thin: every function
//! calls the engine (`meddpm::checkpoint`, `meddpm::data::synth`) on the CPU or CUDA backend, with
//! the GIL released while it works. Volumes cross as little-endian f32 bytes in NIfTI order (x
//! fastest, i.e. a Fortran-order (X, Y, Z) array) with their dims. Engine errors become
//! `meddpm.MeddpmError` with the message the CLI prints.

use meddpm::checkpoint::{bundled, load_weights, LoadHints, LoadedWeights, WeightGroup};
use meddpm::cpu::CpuBackend;
use meddpm::data::synth::{self, Format, ModelId, SynthSpec};
use meddpm::data::{Convention, Volume};
use meddpm::diffusion::{SamplerKind, SamplerSpec, Schedule};
use meddpm::{DeviceSel, Layout, Precision, PrecisionChoice, Target as HwTarget};
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
        Ok(Target { device, precision: choice.precision, choice, layout })
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

#[pymodule]
fn _meddpm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Model>()?;
    m.add_function(wrap_pyfunction!(synthesize, m)?)?;
    m.add("MeddpmError", m.py().get_type::<MeddpmError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
