//! One entry point for "give me sampling weights from this file", whatever the file is, and the
//! reference's way of starting a training run from a released checkpoint.
//!
//! [`load_weights`] accepts every weights file meddpm meets:
//! - a meddpm training checkpoint (safetensors, groups `model.` / `ema.` / `adam_*.`, config in
//!   the metadata: [`Checkpoint::read`]);
//! - a safetensors state dict (from `meddpm convert` or [`crate::checkpoint::export_state_dict`] /
//!   [`torch::export_safetensors`]), with U-Net keys or GaussianDiffusion keys (`denoise_fn.` and
//!   the 13 schedule buffers), with or without a stored config;
//! - a PyTorch `.pt` file: Med-DDPM's `torch.save({'step', 'model', 'ema'})` or a bare state dict
//!   (spec §4.1–4.2), read by [`torch::read_state_dicts`] without Python.
//!
//! The U-Net configuration comes from the file's metadata when it has one, otherwise it is
//! inferred from the tensor shapes ([`torch::infer_config`]); what shapes cannot tell (volume
//! size, attention heads, GroupNorm groups) comes from [`LoadHints`] or defaults to the reference
//! (128³ for the whole-head topology, 144×192×192 for BraTS, 1 head, 32 groups) — the same rules
//! as `meddpm convert`. Every key and shape is then checked ([`torch::map_to_unet`]); schedule
//! buffers that differ from the cosine schedule become warnings naming the buffer.
//!
//! [`init_trainer_from`] is the reference's `train.py --resume_weight` (spec §4, "resume"): it
//! loads `ckpt['ema']` into the **online** model; the step restarts at 0, there is no optimizer
//! state (Adam moments are zero) and the EMA is a copy of the loaded weights (and keeps being
//! re-copied until `ema_start`, 2000 steps in the reference). This is not [`Checkpoint::restore_trainer`],
//! which continues a meddpm run exactly.

use crate::backend::Backend;
use crate::checkpoint::native::{Checkpoint, GROUPS};
use crate::checkpoint::torch::{self, StateDict};
use crate::diffusion::Trainer;
use crate::error::{Error, Result};
use crate::model::UNetConfig;
use std::io::Read;
use std::path::Path;

/// Which weights of a training checkpoint to take (a plain state dict has only one set).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightGroup {
    /// The EMA weights: what the reference samples and resumes with.
    Ema,
    /// The online (training) weights.
    Model,
}

impl WeightGroup {
    /// The group's name in both file formats (`"ema"`, `"model"`).
    pub fn name(self) -> &'static str {
        match self {
            WeightGroup::Ema => "ema",
            WeightGroup::Model => "model",
        }
    }
}

/// What the weights cannot tell about the model. `size` = (depth D, height = width) overrides
/// the stored or default volume size (the network is convolutional: any multiple of
/// 2^(levels−1) works); `num_heads` and `groups` are used only when the file stores no config
/// (the default is the reference's 1 head and 32 groups).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadHints {
    pub size: Option<(usize, usize)>,
    pub num_heads: Option<usize>,
    pub groups: Option<usize>,
}

/// Weights ready for [`crate::model::UNet::set_params`].
#[derive(Clone, Debug)]
pub struct LoadedWeights {
    /// The model configuration (stored or inferred, with the hints applied).
    pub cfg: UNetConfig,
    /// One tensor per [`crate::model::param_specs`] entry, in that order, PyTorch layouts.
    pub params: Vec<Vec<f32>>,
    /// Non-fatal findings: schedule buffers that differ, a stored size overridden, ...
    pub warnings: Vec<String>,
    /// One line saying what was read, e.g. `PyTorch checkpoint m.pt, dict 'ema', step 100000`.
    pub source: String,
    /// The training step the file records, if any.
    pub step: Option<u64>,
    /// T of the cosine schedule the weights were trained with, where the file says it (a meddpm
    /// checkpoint's train config, a PyTorch file's `betas` buffer).
    pub timesteps: Option<usize>,
}

/// [`load_weights_with`] with only a size hint (heads and groups as the reference).
pub fn load_weights(path: &Path, group: WeightGroup, size_hint: Option<(usize, usize)>) -> Result<LoadedWeights> {
    load_weights_with(path, group, &LoadHints { size: size_hint, ..LoadHints::default() })
}

/// True for PyTorch files: zip archives (torch ≥ 1.6) or raw pickles (legacy format).
pub fn is_pytorch_file(path: &Path) -> Result<bool> {
    let mut head = [0u8; 8];
    let n = std::fs::File::open(path).and_then(|mut f| f.read(&mut head)).map_err(|e| Error::io(path, e))?;
    Ok(n >= 4 && &head[..4] == b"PK\x03\x04" || n >= 2 && head[0] == 0x80 && head[1] <= 5)
}

/// Sampling weights from any supported file (see the module doc). Errors name the file and say
/// what was expected: an unknown format, a missing group, or every missing / unexpected /
/// wrong-shaped key when the weights are not this kind of U-Net.
pub fn load_weights_with(path: &Path, group: WeightGroup, hints: &LoadHints) -> Result<LoadedWeights> {
    if is_pytorch_file(path)? {
        load_torch(path, group, hints)
    } else {
        load_safetensors(path, group, hints)
    }
}

fn load_torch(path: &Path, group: WeightGroup, hints: &LoadHints) -> Result<LoadedWeights> {
    let ck = torch::read_state_dicts(path)?;
    let which = if ck.dicts.contains_key("") { "" } else { group.name() };
    let (name, dict) = ck.dict(Some(which))?;
    let (cfg, how) = config_for(path, dict, None, hints)?;
    let mapped = ck.to_unet(Some(name), &cfg)?;
    let step = ck.step.and_then(|s| u64::try_from(s).ok());
    let what = if name.is_empty() { "bare state dict".to_string() } else { format!("dict '{name}'") };
    let source = format!(
        "PyTorch checkpoint {}, {what}{}, config {how}",
        path.display(),
        step.map(|s| format!(", step {s}")).unwrap_or_default()
    );
    // the GaussianDiffusion state dict holds the schedule: T = betas' length
    let timesteps = ck
        .dicts
        .values()
        .flatten()
        .find(|(k, shape, _)| (k == "betas" || k.ends_with(".betas")) && shape.len() == 1)
        .map(|(_, shape, _)| shape[0]);
    Ok(LoadedWeights { cfg, params: mapped.params, warnings: mapped.warnings, source, step, timesteps })
}

/// [`load_weights_with`] for safetensors bytes held in memory (a bundled model, see
/// [`crate::checkpoint::bundled`]); `name` stands for the file in messages and in `source`.
pub fn load_weights_from_bytes(
    bytes: &[u8],
    name: &Path,
    group: WeightGroup,
    hints: &LoadHints,
) -> Result<LoadedWeights> {
    load_safetensors_from(Checkpoint::from_bytes(bytes, name), name, group, hints)
}

fn load_safetensors(path: &Path, group: WeightGroup, hints: &LoadHints) -> Result<LoadedWeights> {
    load_safetensors_from(Checkpoint::read(path), path, group, hints)
}

fn load_safetensors_from(
    ck: Result<Checkpoint>,
    path: &Path,
    group: WeightGroup,
    hints: &LoadHints,
) -> Result<LoadedWeights> {
    let ck = ck.map_err(|e| match e {
        Error::Format { path, msg } => Error::Format {
            path,
            msg: format!("{msg} (expected a meddpm checkpoint, a safetensors state dict or a PyTorch .pt file)"),
        },
        e => e,
    })?;
    let present: Vec<&str> = GROUPS.iter().copied().filter(|g| ck.has_group(g)).collect();
    let (prefix, what) = if present.is_empty() {
        (String::new(), "safetensors state dict".to_string())
    } else if present.contains(&group.name()) {
        (format!("{}.", group.name()), format!("meddpm checkpoint, group '{}'", group.name()))
    } else {
        return Err(Error::format(
            path,
            format!("has no '{}' weights (groups in the file: {present:?})", group.name()),
        ));
    };
    let timesteps = ck.train.as_ref().map(|t| t.timesteps);
    let Checkpoint { unet, step, tensors, .. } = ck;
    let dict: StateDict = tensors
        .into_iter()
        .filter_map(|(k, (shape, v))| {
            if prefix.is_empty() {
                Some((k, shape, v))
            } else {
                k.strip_prefix(&prefix).map(|s| (s.to_string(), shape, v))
            }
        })
        .collect();
    let (cfg, how) = config_for(path, &dict, unet.as_ref(), hints)?;
    let mapped = torch::map_to_unet(&dict, &cfg).map_err(|e| name_file(e, path))?;
    let mut warnings = mapped.warnings;
    if let (Some(stored), Some((d, s))) = (&unet, hints.size) {
        if (stored.depth, stored.size) != (d, s) {
            warnings.push(format!(
                "the file's config is for a {}x{}x{} volume; using {d}x{s}x{s} as asked",
                stored.depth, stored.size, stored.size
            ));
        }
    }
    let step = (step > 0 || !prefix.is_empty()).then_some(step);
    let source =
        format!("{what} {}{}, config {how}", path.display(), step.map(|s| format!(", step {s}")).unwrap_or_default());
    Ok(LoadedWeights { cfg, params: mapped.params, warnings, source, step, timesteps })
}

/// Errors from the state-dict functions say `<state dict>`; put the file's name in.
fn name_file(e: Error, path: &Path) -> Error {
    match e {
        Error::Checkpoint { msg, .. } => Error::Checkpoint { path: path.to_path_buf(), msg },
        e => e,
    }
}

/// The config to map the weights with: the stored one (size from the hint), or one inferred from
/// the shapes with the reference defaults (as `meddpm convert`). Returns it and how it was found.
fn config_for(
    path: &Path,
    dict: &StateDict,
    stored: Option<&UNetConfig>,
    hints: &LoadHints,
) -> Result<(UNetConfig, &'static str)> {
    if let Some(c) = stored {
        let (depth, size) = hints.size.unwrap_or((c.depth, c.size));
        let cfg = UNetConfig { depth, size, ..c.clone() };
        cfg.validate()?;
        return Ok((cfg, "from the file's metadata"));
    }
    // Infer the topology with a placeholder volume (a multiple of every 2^(levels−1)), then
    // put the real size in.
    let probe = torch::infer_config(dict, 1 << 16, 1 << 16).map_err(|e| match e {
        Error::Checkpoint { msg, .. } => {
            Error::Checkpoint { path: path.to_path_buf(), msg: format!("cannot infer the U-Net configuration: {msg}") }
        }
        e => e,
    })?;
    let same_topology = |r: &UNetConfig| UNetConfig { depth: r.depth, size: r.size, ..probe.clone() } == *r;
    let default = if same_topology(&UNetConfig::whole_head()) {
        Some((128, 128))
    } else if same_topology(&UNetConfig::brats()) {
        Some((144, 192))
    } else {
        None
    };
    let Some((depth, size)) = hints.size.or(default) else {
        return Err(Error::Config(format!(
            "{}: the weights are neither the whole-head nor the BraTS topology (inferred in {} out {} model_channels {} \
             channel_mult {:?} num_res_blocks {} attention_ds {:?}); give the volume size (depth, size)",
            path.display(),
            probe.in_channels,
            probe.out_channels,
            probe.model_channels,
            probe.channel_mult,
            probe.num_res_blocks,
            probe.attention_ds
        )));
    };
    let cfg = UNetConfig {
        depth,
        size,
        num_heads: hints.num_heads.unwrap_or(probe.num_heads),
        groups: hints.groups.unwrap_or(probe.groups),
        ..probe
    };
    cfg.validate()?;
    Ok((cfg, "inferred from the tensor shapes"))
}

/// True when two configs describe the same network apart from the volume size.
pub fn same_topology(a: &UNetConfig, b: &UNetConfig) -> bool {
    UNetConfig { depth: b.depth, size: b.size, ..a.clone() } == *b
}

/// The reference's "resume from a released checkpoint" on an existing trainer: read the EMA
/// weights of `path` (any file [`load_weights`] reads; a plain state dict's only weights) with
/// the trainer's size, heads and groups as hints, then [`init_trainer_with`]. The file's
/// topology must equal the trainer's (the error shows both).
pub fn init_trainer_from<B: Backend>(be: &B, tr: &mut Trainer<B>, path: &Path) -> Result<LoadedWeights> {
    let c = &tr.net.cfg;
    let hints = LoadHints { size: Some((c.depth, c.size)), num_heads: Some(c.num_heads), groups: Some(c.groups) };
    let mut w = load_weights_with(path, WeightGroup::Ema, &hints)?;
    init_trainer_with(be, tr, &w)?;
    w.params = Vec::new(); // on the device now; the caller needs the rest
    Ok(w)
}

/// Put `w` into `tr` as `train.py --resume_weight` does: the weights become the **online**
/// parameters, the EMA becomes a copy of them, the Adam moments and gradients are zeroed, and
/// `step`, `draws` and `samples` (the RNG position) restart at 0. The volume size may differ from the
/// weights' (the trainer's is kept); any other config difference is an error.
pub fn init_trainer_with<B: Backend>(be: &B, tr: &mut Trainer<B>, w: &LoadedWeights) -> Result<()> {
    if !same_topology(&w.cfg, &tr.net.cfg) {
        return Err(Error::Config(format!(
            "the weights ({}) are for {:?}; the trainer's model is {:?}",
            w.source, w.cfg, tr.net.cfg
        )));
    }
    tr.net.set_params(be, &w.params)?;
    for (e, p) in tr.ema.iter_mut().zip(&tr.net.params) {
        be.copy(e, p);
    }
    for b in tr.adam_m.iter_mut().chain(tr.adam_v.iter_mut()) {
        be.zero(b);
    }
    tr.net.zero_grads(be);
    tr.step = 0;
    tr.draws = 0;
    tr.samples = 0;
    Ok(())
}
