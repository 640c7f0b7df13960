//! meddpm's own checkpoints: one safetensors file holding the online weights, the EMA weights,
//! the Adam moments, and as metadata the step, the RNG position and both configs — everything
//! needed to resume exactly; checkpoints of a run folder also carry its run record (metadata
//! `run`, see `crate::run::record`). Non-finite weights are never written ([`trainer_bytes`]). Tensors are stored in PyTorch layouts under `model.<key>`,
//! `ema.<key>`, `adam_m.<key>`, `adam_v.<key>` (keys = the reference state-dict names).
//!
//! Writes are atomic: the bytes go to `<path>.tmp` (fsync'd), then a rename replaces the target,
//! so an interrupted save never destroys the previous checkpoint; a failed one (full disk)
//! removes the temp file.
//! A plain state dict (keys without a group prefix, e.g. from `meddpm convert` or
//! [`export_state_dict`]) is read too; it has no optimiser state and may lack a config.

use crate::backend::Backend;
use crate::diffusion::{TrainConfig, Trainer};
use crate::error::{Error, Result};
use crate::model::{ParamSpec, UNetConfig};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

pub const FORMAT: &str = "meddpm-checkpoint";
pub const VERSION: &str = "1";
/// Tensor groups of a full checkpoint, in file order.
pub const GROUPS: [&str; 4] = ["model", "ema", "adam_m", "adam_v"];

/// Write `bytes` to `path` atomically (temp file in the same folder, fsync, rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |f| f.write_all(bytes))
}

/// [`write_atomic`] with the writing done by `fill` (which gets the temp file): the temp file is
/// fsync'd and renamed over `path` only when `fill` succeeds. On any failure (a full disk, a
/// quota, an I/O error) the temp file is removed and `path` is left exactly as it was; the error
/// names `path` and the OS reason once.
pub fn write_atomic_with(path: &Path, fill: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let written = fill(&mut f).and_then(|_| f.sync_all());
    drop(f);
    match written.and_then(|_| std::fs::rename(&tmp, path)) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(Error::io(path, e))
        }
    }
}

fn to_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Serialise named f32 tensors (PyTorch layouts) with metadata to safetensors bytes.
pub fn serialize(tensors: &[(String, Vec<usize>, Vec<f32>)], meta: HashMap<String, String>) -> Result<Vec<u8>> {
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|(_, _, v)| to_bytes(v)).collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((k, shape, _), b)| {
            Ok((k.clone(), TensorView::new(Dtype::F32, shape.clone(), b).map_err(|e| Error::Backend(e.to_string()))?))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize(views, Some(meta)).map_err(|e| Error::Backend(format!("safetensors: {e}")))
}

/// Save a trainer's full state to `path` (atomic).
pub fn save_trainer<B: Backend>(path: &Path, be: &B, tr: &Trainer<B>) -> Result<()> {
    write_atomic(path, &trainer_bytes(be, tr, &[])?)
}

/// A trainer's full state as checkpoint bytes, with `extra` metadata entries (e.g. the run
/// record, `crate::run`) besides the standard ones. Refuses (`Error::NonFinite`) when any
/// weight, EMA weight or Adam moment is NaN or ±Inf: a diverged run must never replace its last
/// good checkpoint.
pub fn trainer_bytes<B: Backend>(be: &B, tr: &Trainer<B>, extra: &[(&str, String)]) -> Result<Vec<u8>> {
    let specs = &tr.net.specs;
    let mut tensors = Vec::with_capacity(4 * specs.len());
    for (group, bufs) in GROUPS.iter().zip([&tr.net.params, &tr.ema, &tr.adam_m, &tr.adam_v]) {
        for (spec, b) in specs.iter().zip(bufs) {
            let mut h = vec![0f32; spec.numel()];
            be.download_param(b, &spec.shape, &mut h);
            if let Some(i) = h.iter().position(|x| !x.is_finite()) {
                return Err(Error::NonFinite(format!(
                    "{group}.{} holds {} (element {i}) after step {}",
                    spec.key, h[i], tr.step
                )));
            }
            tensors.push((format!("{group}.{}", spec.key), spec.shape.clone(), h));
        }
    }
    let mut meta = HashMap::new();
    meta.insert("format".into(), FORMAT.into());
    meta.insert("version".into(), VERSION.into());
    meta.insert("unet".into(), serde_json::to_string(&tr.net.cfg).expect("config serialises"));
    meta.insert("train".into(), serde_json::to_string(&tr.tc).expect("config serialises"));
    meta.insert("step".into(), tr.step.to_string());
    meta.insert("draws".into(), tr.draws.to_string());
    // the global sample position (all ranks), and the world size that wrote it (information)
    meta.insert("samples".into(), tr.samples.to_string());
    meta.insert("world".into(), tr.world.to_string());
    for (k, v) in extra {
        meta.insert(k.to_string(), v.clone());
    }
    serialize(&tensors, meta)
}

/// Export weights as a plain state dict (reference keys, no prefix) that PyTorch's
/// `load_state_dict` accepts; `unet` config stored as metadata.
pub fn export_state_dict(path: &Path, cfg: &UNetConfig, specs: &[ParamSpec], weights: &[Vec<f32>]) -> Result<()> {
    let tensors: Vec<_> = specs.iter().zip(weights).map(|(s, w)| (s.key.clone(), s.shape.clone(), w.clone())).collect();
    let mut meta = HashMap::new();
    meta.insert("format".into(), "meddpm-state-dict".into());
    meta.insert("unet".into(), serde_json::to_string(cfg).expect("config serialises"));
    write_atomic(path, &serialize(&tensors, meta)?)
}

/// A checkpoint read from disk.
pub struct Checkpoint {
    pub path: PathBuf,
    pub unet: Option<UNetConfig>,
    pub train: Option<TrainConfig>,
    pub step: u64,
    pub draws: u64,
    /// Global samples drawn (all ranks); files written before data parallelism lack it.
    pub samples: Option<u64>,
    /// Data-parallel ranks of the run that wrote the file (1 when absent).
    pub world: u64,
    pub tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    /// Every metadata entry of the file (the parsed ones above included), e.g. `run`.
    pub meta: HashMap<String, String>,
}

impl Checkpoint {
    /// Read a meddpm checkpoint or a plain safetensors state dict.
    pub fn read(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        Checkpoint::from_bytes(&bytes, path)
    }

    /// Parse checkpoint bytes held in memory; `path` names them in messages.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        let bad = |m: String| Error::format(path, m);
        // a file that starts like safetensors (a header length, then '{') but does not parse was
        // most likely cut short (a copy or download that stopped)
        let started = bytes.len() > 8 && bytes[8] == b'{';
        let hint = if started { "; is the file truncated?" } else { "" };
        let st =
            SafeTensors::deserialize(bytes).map_err(|e| bad(format!("not a readable safetensors file ({e}){hint}")))?;
        let (_, md) = SafeTensors::read_metadata(bytes).map_err(|e| bad(format!("bad safetensors header: {e}")))?;
        let meta = md.metadata().clone().unwrap_or_default();
        fn json<T: serde::de::DeserializeOwned>(
            meta: &HashMap<String, String>,
            k: &str,
            path: &Path,
        ) -> Result<Option<T>> {
            let parse = |s: &String| {
                serde_json::from_str(s)
                    .map_err(|e| Error::format(path, format!("metadata '{k}' is not a valid config: {e}")))
            };
            meta.get(k).map(parse).transpose()
        }
        let num = |k: &str| -> Result<u64> {
            meta.get(k)
                .map(|s| s.parse().map_err(|_| bad(format!("metadata '{k}' = {s:?} is not a number"))))
                .unwrap_or(Ok(0))
        };
        if let Some(v) = meta.get("version").filter(|_| meta.get("format").map(String::as_str) == Some(FORMAT)) {
            if v != VERSION {
                return Err(bad(format!("checkpoint format version {v}, this meddpm reads version {VERSION}")));
            }
        }
        let mut tensors = BTreeMap::new();
        for (name, view) in st.tensors() {
            let data: Vec<f32> = match view.dtype() {
                Dtype::F32 => {
                    view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
                }
                Dtype::F64 => view
                    .data()
                    .chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
                    .collect(),
                d => return Err(bad(format!("tensor {name} has dtype {d:?}; expected F32 or F64"))),
            };
            tensors.insert(name, (view.shape().to_vec(), data));
        }
        Ok(Checkpoint {
            path: path.to_path_buf(),
            unet: json(&meta, "unet", path)?,
            train: json(&meta, "train", path)?,
            step: num("step")?,
            draws: num("draws")?,
            samples: meta.contains_key("samples").then(|| num("samples")).transpose()?,
            world: num("world")?.max(1),
            tensors,
            meta,
        })
    }

    /// True when the file holds the tensor group `group` (e.g. "ema").
    pub fn has_group(&self, group: &str) -> bool {
        let p = format!("{group}.");
        self.tensors.keys().any(|k| k.starts_with(&p))
    }

    /// The tensors of `group` ("" for a plain state dict) in `specs` order, checked key by key:
    /// the error lists every missing, unexpected and wrong-shaped key.
    pub fn group(&self, group: &str, specs: &[ParamSpec]) -> Result<Vec<Vec<f32>>> {
        let prefix = if group.is_empty() { String::new() } else { format!("{group}.") };
        let known: std::collections::HashSet<&str> = GROUPS.iter().copied().collect();
        let in_group = |k: &str| {
            if prefix.is_empty() {
                !k.split_once('.').is_some_and(|(g, _)| known.contains(g))
            } else {
                k.starts_with(&prefix)
            }
        };
        let (mut missing, mut shapes, mut out) = (Vec::new(), Vec::new(), Vec::new());
        for s in specs {
            match self.tensors.get(&format!("{prefix}{}", s.key)) {
                None => missing.push(s.key.clone()),
                Some((shape, _)) if *shape != s.shape => {
                    shapes.push(format!("{} is {:?}, expected {:?}", s.key, shape, s.shape))
                }
                Some((_, v)) => out.push(v.clone()),
            }
        }
        let expected: std::collections::HashSet<String> = specs.iter().map(|s| format!("{prefix}{}", s.key)).collect();
        let unexpected: Vec<&String> = self.tensors.keys().filter(|k| in_group(k) && !expected.contains(*k)).collect();
        if missing.is_empty() && shapes.is_empty() && unexpected.is_empty() {
            return Ok(out);
        }
        let list = |v: Vec<String>| {
            if v.len() > 12 {
                format!("{} … ({} in all)", v[..12].join(", "), v.len())
            } else {
                v.join(", ")
            }
        };
        let mut msg = Vec::new();
        if !missing.is_empty() {
            msg.push(format!("missing {}", list(missing)));
        }
        if !unexpected.is_empty() {
            msg.push(format!("unexpected {}", list(unexpected.into_iter().cloned().collect())));
        }
        if !shapes.is_empty() {
            msg.push(format!("wrong shape: {}", list(shapes)));
        }
        let g = if group.is_empty() { "state dict".to_string() } else { format!("group '{group}'") };
        Err(Error::Checkpoint { path: self.path.clone(), msg: format!("{g}: {}", msg.join("; ")) })
    }

    /// Rebuild a trainer exactly as it was saved (weights, EMA, Adam moments, step, RNG position).
    pub fn restore_trainer<B: Backend>(&self, be: &B) -> Result<Trainer<B>> {
        let ckerr = |m: &str| Error::Checkpoint { path: self.path.clone(), msg: m.to_string() };
        let unet = self.unet.as_ref().ok_or_else(|| ckerr("no 'unet' config in the metadata"))?;
        let tc = self.train.as_ref().ok_or_else(|| ckerr("no 'train' config: not a training checkpoint"))?;
        let mut tr = Trainer::new(be, unet, tc)?;
        let specs = tr.net.specs.clone();
        let groups: Vec<Vec<Vec<f32>>> = GROUPS.iter().map(|g| self.group(g, &specs)).collect::<Result<_>>()?;
        tr.net.set_params(be, &groups[0])?;
        for (bufs, host) in [(&mut tr.ema, &groups[1]), (&mut tr.adam_m, &groups[2]), (&mut tr.adam_v, &groups[3])] {
            for ((b, h), s) in bufs.iter_mut().zip(host).zip(&specs) {
                be.upload_param(h, &s.shape, b);
            }
        }
        tr.step = self.step;
        tr.draws = self.draws;
        tr.samples = self.samples.unwrap_or(self.draws * tc.batch as u64);
        Ok(tr)
    }
}
