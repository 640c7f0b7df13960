//! Synthetic datasets from masks (`meddpm synthesize`): (image, label) pairs for training a
//! segmentation network, laid out for nnU-Net v2, MONAI or as plain folders.
//!
//! - **Plan** ([`plan`]): the mask sources (files of a folder, or the built-in demo masks), each
//!   followed by `augment` new masks made from it by [`super::masks`]' tumour scaling and
//!   shifting (candidates in a seeded order; one that fails its rule is passed over). Pair i takes
//!   mask i mod pool and noise seed `seed + i`, and is the case `synth_<i>` (five digits at least).
//! - **Sampling**: the batched sampler of `meddpm sample` ([`Sampler::sample_jobs`], one Philox
//!   stream per volume's seed), so a volume is the same in any batch and at any position
//!   (invariant 6): [`regenerate`] rebuilds any case from its manifest line, bit for bit on the
//!   same backend and precision.
//! - **Layouts** ([`Format`]), paths relative to the dataset root:
//!   - `nnunet`: the root is `<out>/DatasetNNN_Name`; `imagesTr/<case>_<cccc>.nii.gz` per channel,
//!     `labelsTr/<case>.nii.gz`, and `dataset.json` (`channel_names`, `labels`, `numTraining`,
//!     `file_ending`), as nnU-Net v2's `verify_dataset_integrity` expects;
//!   - `monai`: the root is `<out>`; `images/<case>.nii.gz` (BraTS: one file per modality),
//!     `labels/<case>.nii.gz`, and `datalist.json` (`{"training": [{"image", "label"}]}`, paths
//!     relative to the root, as MONAI's `load_decathlon_datalist` reads it);
//!   - `plain`: the root is `<out>`; `images/<case>.nii.gz` and `masks/<case>.nii.gz`, which
//!     `meddpm train --masks <out>/masks --images <out>/images` pairs again by the case number.
//!
//!   The image is what `meddpm sample` writes for the mask ([`sample_outputs`]: on the mask's
//!   grid with its header); the label is the (augmented) mask itself, uint8 on the same grid
//!   (BraTS: the mask as the reference exports it, labels 0..3).
//! - **Manifest**: `meddpm_manifest.jsonl` in the root, one [`ManifestLine`] per finished pair
//!   (mask source and its hash, augmentation, seed, sampler, steps, precision, device, the
//!   checkpoint's XXH3-128 hash, the files), appended and fsync'd after the pair's files. Under
//!   several ranks each rank appends to `meddpm_manifest.rank<r>.jsonl`; readers take all of them.
//! - **Resume**: a pair whose manifest line exists and whose files all exist is skipped; a line
//!   for the case made with other settings (another checkpoint, sampler, seed, mask...) is an
//!   error, not an overwrite. Every NIfTI and JSON file is written to a temporary file and renamed
//!   ([`write_volume`], [`write_atomic`]); a torn last manifest line (a crash mid-append) is
//!   dropped when the manifest is read.

use super::convention::{Convention, Preset};
use super::dataset::{list_nifti, Source};
use super::masks::{linspace, scale_tumour, shift_grid, shift_tumour, Labels};
use super::nifti::{write_labels, write_volume, Volume};
use super::output::{sample_outputs, OutputVolume, BRATS_MODALITIES};
use crate::backend::Backend;
use crate::checkpoint::{bundled, write_atomic, LoadedWeights, WeightGroup};
use crate::diffusion::{plan as sampler_plan, Sampler, SamplerSpec, Schedule};
use crate::error::{Error, Result};
use crate::model::UNet;
use crate::rng::Philox;
use crate::run::fingerprint::hash_reader;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The manifest's file name (rank 0 of one, or the common prefix of the per-rank files).
pub const MANIFEST: &str = "meddpm_manifest.jsonl";
/// The Philox stream of the augmentation order (distinct from training's and sampling's).
const STREAM_AUGMENT: u64 = 0x5157_4E54;

/// Which folder layout to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// nnU-Net v2 raw dataset: `DatasetNNN_Name/{imagesTr,labelsTr,dataset.json}`.
    Nnunet,
    /// A folder plus a MONAI datalist JSON.
    Monai,
    /// `images/` and `masks/`, as `meddpm train` reads them.
    Plain,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Nnunet => "nnunet",
            Format::Monai => "monai",
            Format::Plain => "plain",
        }
    }
}

impl std::str::FromStr for Format {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "nnunet" => Ok(Format::Nnunet),
            "monai" => Ok(Format::Monai),
            "plain" => Ok(Format::Plain),
            _ => Err(Error::Config(format!("unknown format {s:?}: expected nnunet, monai or plain"))),
        }
    }
}

/// How a pair's mask was made from its source mask.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Augmentation {
    /// The source mask as it is.
    None,
    /// [`scale_tumour`] by `scale` (with `min_voxels`).
    Scale { scale: f64, min_voxels: usize },
    /// [`shift_tumour`] by `shift` voxels along (x, y, z).
    Shift { shift: [i64; 3] },
}

impl Augmentation {
    /// The augmented mask, or None when the augmentation's rule rejects it.
    pub fn apply(&self, mask: &Volume, labels: Labels) -> Option<Volume> {
        match *self {
            Augmentation::None => Some(mask.clone()),
            Augmentation::Scale { scale, min_voxels } => scale_tumour(mask, scale, labels, min_voxels),
            Augmentation::Shift { shift } => shift_tumour(mask, shift, labels),
        }
    }
}

/// The notebook's candidates for new masks: 20 scales from 2.0 to 0.5 (min 30 voxels), then the
/// shifts −40..40 step 10 on every axis (the zero shift left out).
pub fn augmentation_candidates() -> Vec<Augmentation> {
    let mut v: Vec<Augmentation> =
        linspace(2.0, 0.5, 20).into_iter().map(|scale| Augmentation::Scale { scale, min_voxels: 30 }).collect();
    v.extend(shift_grid(40, 10).into_iter().filter(|s| *s != [0, 0, 0]).map(|shift| Augmentation::Shift { shift }));
    v
}

/// Which model made the volumes: a name for people and the hash of its file's bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelId {
    pub name: String,
    /// XXH3-128 of the checkpoint file (hex).
    pub hash: String,
    /// `ema` or `model`.
    pub weights: String,
}

impl ModelId {
    /// The id of a checkpoint file.
    pub fn of_file(path: &Path, group: WeightGroup) -> Result<ModelId> {
        let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        Ok(ModelId { name: path.display().to_string(), hash: hash_reader(f, path)?, weights: group.name().into() })
    }
    /// The id of the bundled demo model, if this build has one.
    pub fn bundled(group: WeightGroup) -> Result<Option<ModelId>> {
        let Some(b) = bundled::bytes() else { return Ok(None) };
        let name = format!("<bundled>/{}", bundled::PATH);
        Ok(Some(ModelId { hash: hash_reader(b, Path::new(&name))?, name, weights: group.name().into() }))
    }
}

/// What to synthesize.
#[derive(Clone, Debug)]
pub struct SynthSpec {
    /// Output folder (nnU-Net: the `nnUNet_raw`-like folder the dataset folder goes into).
    pub out: PathBuf,
    pub format: Format,
    /// nnU-Net's dataset id (NNN) and name.
    pub dataset_id: u32,
    pub dataset_name: String,
    /// Mask files (`.nii`/`.nii.gz`) or folders of them; none: the built-in demo masks.
    pub masks: Vec<PathBuf>,
    /// New masks per source mask through scaling and shifting.
    pub augment: usize,
    /// Pairs to make [default: one per mask of the pool].
    pub count: Option<usize>,
    /// Pair i draws its noise from seed `seed + i`; the augmentation order too.
    pub seed: u64,
    pub sampler: SamplerSpec,
    /// T of the model's cosine schedule.
    pub timesteps: usize,
    /// Volumes per network batch.
    pub batch: usize,
    pub convention: Convention,
    /// The head and tumour labels for augmentation.
    pub labels: Labels,
    /// This process's share: pairs `rank, rank + world, …` (0 and 1 for all of them).
    pub rank: usize,
    pub world: usize,
    /// Masks of another size than the model's volumes are resampled (and the pair written on the
    /// mask's grid); without it they are an error naming both sizes.
    pub resize: bool,
}

impl SynthSpec {
    /// Defaults: DDPM with all T = 250 steps, whole-head, batch 1, one process.
    pub fn new(out: impl Into<PathBuf>, format: Format) -> SynthSpec {
        SynthSpec {
            out: out.into(),
            format,
            dataset_id: 500,
            dataset_name: "MedDDPM".into(),
            masks: Vec::new(),
            augment: 0,
            count: None,
            seed: 0,
            sampler: SamplerSpec::ddpm(250),
            timesteps: 250,
            batch: 1,
            convention: Convention::whole_head(),
            labels: Labels::default(),
            rank: 0,
            world: 1,
            resize: false,
        }
    }

    /// The dataset's root folder (nnU-Net: `<out>/DatasetNNN_Name`).
    pub fn root(&self) -> PathBuf {
        match self.format {
            Format::Nnunet => self.out.join(format!("Dataset{:03}_{}", self.dataset_id, self.dataset_name)),
            Format::Monai | Format::Plain => self.out.clone(),
        }
    }

    fn check(&self) -> Result<()> {
        if self.batch == 0 {
            return Err(Error::Config("batch must be at least 1".into()));
        }
        if self.count == Some(0) {
            return Err(Error::Config("count must be at least 1".into()));
        }
        if self.world == 0 || self.rank >= self.world {
            return Err(Error::Config(format!("rank {} of {} ranks", self.rank, self.world)));
        }
        if self.format == Format::Nnunet {
            if self.dataset_id > 999 {
                return Err(Error::Config(format!("nnU-Net dataset ids have three digits, got {}", self.dataset_id)));
            }
            let ok = !self.dataset_name.is_empty()
                && self.dataset_name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
            if !ok {
                return Err(Error::Config(format!(
                    "nnU-Net dataset name {:?}: letters, digits, '_' and '-' only",
                    self.dataset_name
                )));
            }
        }
        self.convention.validate()
    }

    /// The manifest this process appends to.
    pub fn manifest_path(&self) -> PathBuf {
        let name = if self.world > 1 { format!("meddpm_manifest.rank{}.jsonl", self.rank) } else { MANIFEST.into() };
        self.root().join(name)
    }

    /// The files of `case` relative to the root: image channels, then the label.
    pub fn files(&self, case: &str) -> (Vec<String>, String) {
        let channels = self.convention.image_channels();
        let brats = self.convention.preset == Preset::Brats;
        let images = (0..channels)
            .map(|c| match self.format {
                Format::Nnunet => format!("imagesTr/{case}_{c:04}.nii.gz"),
                Format::Monai | Format::Plain if brats => format!("images/{case}_{}.nii.gz", BRATS_MODALITIES[c]),
                Format::Monai | Format::Plain => format!("images/{case}.nii.gz"),
            })
            .collect();
        let label = match self.format {
            Format::Nnunet => format!("labelsTr/{case}.nii.gz"),
            Format::Monai => format!("labels/{case}.nii.gz"),
            Format::Plain => format!("masks/{case}.nii.gz"),
        };
        (images, label)
    }
}

/// One mask source of the plan.
#[derive(Clone, Debug)]
pub struct MaskSource {
    pub source: Source,
    /// XXH3-128 of its bytes.
    pub hash: String,
}

/// One pair to make.
#[derive(Clone, Debug)]
pub struct PlannedPair {
    /// Position in the plan (seed = spec.seed + index).
    pub index: usize,
    pub case: String,
    /// Index into [`Plan::sources`].
    pub source: usize,
    pub augmentation: Augmentation,
    pub seed: u64,
}

/// The pairs of a spec, and notes (fewer new masks than asked for a source).
#[derive(Clone, Debug)]
pub struct Plan {
    pub sources: Vec<MaskSource>,
    pub pairs: Vec<PlannedPair>,
    pub notes: Vec<String>,
}

/// Case name of pair `i`.
pub fn case_name(i: usize) -> String {
    format!("synth_{i:05}")
}

fn source_hash(src: &Source) -> Result<String> {
    match src {
        Source::File(p) => {
            let f = std::fs::File::open(p).map_err(|e| Error::io(p, e))?;
            hash_reader(f, p)
        }
        Source::Embedded { bytes, .. } => hash_reader(*bytes, &src.name()),
    }
}

/// The mask sources of `paths` (files, or folders of NIfTI files; none: the built-in demo masks).
pub fn mask_sources(paths: &[PathBuf]) -> Result<Vec<Source>> {
    if paths.is_empty() {
        return Ok(super::demo::pairs().into_iter().map(|p| p.mask).collect());
    }
    let mut v = Vec::new();
    for p in paths {
        if p.is_dir() {
            v.extend(list_nifti(p)?.into_iter().map(Source::File));
        } else {
            v.push(Source::File(p.clone()));
        }
    }
    Ok(v)
}

/// A source by the name a manifest line gives it (a path, or `<built-in>/…` for a demo mask).
pub fn source_by_name(name: &str) -> Result<Source> {
    if name.starts_with("<built-in>/") {
        return super::demo::pairs()
            .into_iter()
            .map(|p| p.mask)
            .find(|s| s.name().display().to_string() == name)
            .ok_or_else(|| Error::Config(format!("no built-in mask is named {name}")));
    }
    Ok(Source::File(PathBuf::from(name)))
}

/// Seeded order of `n` candidates (Fisher–Yates on Philox draws) for source `s`.
fn candidate_order(n: usize, seed: u64, s: usize) -> Vec<usize> {
    let rng = Philox::new(seed, STREAM_AUGMENT + ((s as u64) << 20));
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = rng.below(i as u64, (i + 1) as u32) as usize;
        v.swap(i, j);
    }
    v
}

/// The pairs to make (see the module doc): reads every source mask, and makes the augmented
/// masks to know which candidates their rules keep.
pub fn plan(spec: &SynthSpec) -> Result<Plan> {
    spec.check()?;
    let srcs = mask_sources(&spec.masks)?;
    if srcs.is_empty() {
        return Err(Error::Config("no masks to synthesize from".into()));
    }
    let cands = augmentation_candidates();
    let mut pool: Vec<(usize, Augmentation)> = Vec::new();
    let mut notes = Vec::new();
    let mut sources = Vec::new();
    for (s, src) in srcs.into_iter().enumerate() {
        let hash = source_hash(&src)?;
        pool.push((s, Augmentation::None));
        if spec.augment > 0 {
            let mask = src.read()?;
            spec.convention.check_labels(&mask, &src.name())?;
            let mut made = 0;
            for k in candidate_order(cands.len(), spec.seed, s) {
                if made == spec.augment {
                    break;
                }
                if cands[k].apply(&mask, spec.labels).is_some() {
                    pool.push((s, cands[k]));
                    made += 1;
                }
            }
            if made < spec.augment {
                notes.push(format!(
                    "{}: {made} new mask(s) of the {} asked (the other candidates left too little tumour)",
                    src.name().display(),
                    spec.augment
                ));
            }
        }
        sources.push(MaskSource { source: src, hash });
    }
    let n = spec.count.unwrap_or(pool.len());
    let pairs = (0..n)
        .map(|i| {
            let (source, augmentation) = pool[i % pool.len()];
            PlannedPair { index: i, case: case_name(i), source, augmentation, seed: spec.seed + i as u64 }
        })
        .collect();
    Ok(Plan { sources, pairs, notes })
}

/// One finished pair: everything needed to make it again.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ManifestLine {
    pub case: String,
    /// The source mask (a path, or `<built-in>/…`) and its XXH3-128 hash.
    pub mask: String,
    pub mask_hash: String,
    pub augmentation: Augmentation,
    /// The head and tumour labels the augmentation used.
    pub aug_labels: [f32; 2],
    pub seed: u64,
    pub sampler: SamplerSpec,
    pub timesteps: usize,
    /// (D, H, W) the model sampled at.
    pub size: [usize; 3],
    pub convention: Convention,
    pub precision: crate::Precision,
    /// The backend that drew it (`Backend::describe`).
    pub device: String,
    pub checkpoint: String,
    pub checkpoint_hash: String,
    pub weights: String,
    /// Image files, then the label file, relative to the dataset root.
    pub images: Vec<String>,
    pub label: String,
}

impl ManifestLine {
    /// True when `other` was made with the same settings (files and device aside).
    fn same_settings(&self, other: &ManifestLine) -> bool {
        (&self.mask_hash, &self.augmentation, self.aug_labels, self.seed, &self.sampler, self.timesteps, self.size)
            == (
                &other.mask_hash,
                &other.augmentation,
                other.aug_labels,
                other.seed,
                &other.sampler,
                other.timesteps,
                other.size,
            )
            && (&self.convention, self.precision, &self.checkpoint_hash, &self.weights)
                == (&other.convention, other.precision, &other.checkpoint_hash, &other.weights)
    }
}

/// Every manifest line of the dataset at `root` (all ranks' files). A last line that does not
/// parse (a crash mid-append) is dropped; any other bad line is an error naming the file.
pub fn read_manifest(root: &Path) -> Result<Vec<ManifestLine>> {
    let mut files: Vec<PathBuf> = match std::fs::read_dir(root) {
        Ok(rd) => rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                let n = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                n.starts_with("meddpm_manifest") && n.ends_with(".jsonl")
            })
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(root, e)),
    };
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).map_err(|e| Error::io(&f, e))?;
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        for (i, l) in lines.iter().enumerate() {
            match serde_json::from_str::<ManifestLine>(l) {
                Ok(m) => out.push(m),
                Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => {}
                Err(e) => return Err(Error::format(&f, format!("manifest line {}: {e}", i + 1))),
            }
        }
    }
    Ok(out)
}

/// Progress after each batch (and once before the first, with `done` = `skipped`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Progress {
    /// Pairs of this process's share that are finished (skipped included).
    pub done: usize,
    /// Pairs of this process's share.
    pub total: usize,
    /// Pairs found finished at the start (resume).
    pub skipped: usize,
    /// Volumes sampled by this run so far.
    pub sampled: usize,
}

/// What a run did.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    /// Pairs in the whole plan, in this process's share, skipped (already there), and sampled.
    pub planned: usize,
    pub share: usize,
    pub skipped: usize,
    pub sampled: usize,
    pub root: PathBuf,
    pub notes: Vec<String>,
}

/// The mask of a pair: its source mask augmented.
fn pair_mask(labels: Labels, mask: &Volume, aug: &Augmentation, name: &Path) -> Result<Volume> {
    aug.apply(mask, labels)
        .ok_or_else(|| Error::data(name, format!("the augmentation {aug:?} no longer applies to this mask")))
}

/// The files of a pair under `root`: its images and its label map.
fn write_pair(root: &Path, images: &[String], label: &str, outs: &[OutputVolume], mask: &Volume) -> Result<()> {
    let imgs: Vec<&OutputVolume> = outs.iter().filter(|o| !o.labels).collect();
    if imgs.len() != images.len() {
        return Err(Error::Config(format!("{} image volumes for {} image files", imgs.len(), images.len())));
    }
    for (rel, o) in images.iter().zip(imgs) {
        write_volume(root.join(rel), &o.volume)?;
    }
    match outs.iter().find(|o| o.labels) {
        Some(o) => write_labels(root.join(label), &o.volume),
        None => write_labels(root.join(label), mask),
    }
}

fn make_dirs(root: &Path, rels: &[String]) -> Result<()> {
    for r in rels {
        if let Some(d) = root.join(r).parent() {
            std::fs::create_dir_all(d).map_err(|e| Error::io(d, e))?;
        }
    }
    Ok(())
}

/// Make the pairs of `spec`'s plan (this process's share) with the weights `w` on `be`, skipping
/// finished ones; `model` identifies the weights in the manifest. Writes the dataset file
/// (`dataset.json` / `datalist.json`) at the end when this is the only process ([`finalize`]
/// otherwise, once every rank is done). `on_progress` after each batch.
pub fn synthesize<B: Backend>(
    be: &B,
    w: &LoadedWeights,
    model: &ModelId,
    spec: &SynthSpec,
    mut on_progress: impl FnMut(&Progress),
) -> Result<Summary> {
    let plan = plan(spec)?;
    let cfg = &w.cfg;
    let size = [cfg.depth, cfg.size, cfg.size];
    if !spec.resize {
        for s in &plan.sources {
            super::check_mask_size(&s.source.name(), &s.source.read()?, &spec.convention, size, false)?;
        }
    }
    let root = spec.root();
    std::fs::create_dir_all(&root).map_err(|e| Error::io(&root, e))?;
    if cfg.out_channels != spec.convention.image_channels() {
        return Err(Error::Config(format!(
            "the model makes {} channel(s); the {:?} convention writes {}",
            cfg.out_channels,
            spec.convention.preset,
            spec.convention.image_channels()
        )));
    }
    Schedule::model_timesteps(Some(spec.timesteps), w.timesteps)?;
    let sched = Schedule::try_cosine(spec.timesteps)?;
    let splan = sampler_plan(&spec.sampler, &sched)?;
    let line_of = |p: &PlannedPair| -> ManifestLine {
        let (images, label) = spec.files(&p.case);
        let src = &plan.sources[p.source];
        ManifestLine {
            case: p.case.clone(),
            mask: src.source.name().display().to_string(),
            mask_hash: src.hash.clone(),
            augmentation: p.augmentation,
            aug_labels: [spec.labels.head, spec.labels.tumour],
            seed: p.seed,
            sampler: spec.sampler,
            timesteps: spec.timesteps,
            size,
            convention: spec.convention.clone(),
            precision: be.precision(),
            device: be.describe(),
            checkpoint: model.name.clone(),
            checkpoint_hash: model.hash.clone(),
            weights: model.weights.clone(),
            images,
            label,
        }
    };
    // What is there already.
    let done: HashMap<String, ManifestLine> = read_manifest(&root)?.into_iter().map(|l| (l.case.clone(), l)).collect();
    let share: Vec<&PlannedPair> = plan.pairs.iter().skip(spec.rank).step_by(spec.world).collect();
    let mut todo = Vec::new();
    for p in &share {
        let want = line_of(p);
        match done.get(&p.case) {
            Some(have) if !have.same_settings(&want) => {
                return Err(Error::Config(format!(
                    "case {} there was made with other settings (checkpoint {}, {} from seed {}, mask {}); \
                     synthesize into another folder",
                    p.case, have.checkpoint, have.sampler, have.seed, have.mask
                )))
            }
            Some(have) if have.images.iter().chain([&have.label]).all(|f| root.join(f).is_file()) => {}
            _ => todo.push(*p),
        }
    }
    let skipped = share.len() - todo.len();
    let mut progress = Progress { done: skipped, total: share.len(), skipped, sampled: 0 };
    on_progress(&progress);
    if !todo.is_empty() {
        let (images, label) = spec.files(&todo[0].case);
        make_dirs(&root, &[images, vec![label]].concat())?;
        let mpath = spec.manifest_path();
        // A torn last line (a crash mid-append) is completed into its own bad line otherwise.
        if let Ok(text) = std::fs::read_to_string(&mpath) {
            if !text.is_empty() && !text.ends_with('\n') {
                let keep = text.rfind('\n').map_or(0, |i| i + 1);
                write_atomic(&mpath, &text.as_bytes()[..keep])?;
            }
        }
        let b = spec.batch.min(todo.len());
        let mut net = UNet::new(be, cfg, b)?;
        net.set_params(be, &w.params)?;
        let mut sampler = Sampler::new(be, &net)?;
        let mut masks: HashMap<usize, Volume> = HashMap::new();
        let mut manifest =
            std::fs::OpenOptions::new().create(true).append(true).open(&mpath).map_err(|e| Error::io(&mpath, e))?;
        for chunk in todo.chunks(b) {
            let mut conds = Vec::new();
            let mut labels = Vec::new();
            for p in chunk {
                let src = &plan.sources[p.source].source;
                if let std::collections::hash_map::Entry::Vacant(e) = masks.entry(p.source) {
                    e.insert(src.read()?);
                }
                let m = pair_mask(spec.labels, &masks[&p.source], &p.augmentation, &src.name())?;
                conds.push(spec.convention.cond_tensor(&m, size, &src.name())?);
                labels.push(m);
            }
            let jobs: Vec<(&[f32], u64)> = conds.iter().zip(chunk).map(|(c, p)| (c.as_slice(), p.seed)).collect();
            let vols = sampler.sample_jobs(be, &mut net, &splan, &jobs, |_| {})?;
            for ((p, vol), m) in chunk.iter().zip(&vols).zip(&labels) {
                let line = line_of(p);
                let outs = sample_outputs(&spec.convention, vol, cfg.out_channels, size, m)?;
                write_pair(&root, &line.images, &line.label, &outs, m)?;
                let mut text = serde_json::to_string(&line).map_err(|e| Error::format(&mpath, e.to_string()))?;
                text.push('\n');
                manifest
                    .write_all(text.as_bytes())
                    .and_then(|_| manifest.sync_data())
                    .map_err(|e| Error::io(&mpath, e))?;
                progress.done += 1;
                progress.sampled += 1;
            }
            on_progress(&progress);
        }
    }
    if spec.world == 1 {
        finalize(spec)?;
    }
    Ok(Summary {
        planned: plan.pairs.len(),
        share: share.len(),
        skipped,
        sampled: progress.sampled,
        root,
        notes: plan.notes,
    })
}

/// Label names of a convention's exported label maps, by value.
fn label_names(conv: &Convention) -> Vec<(String, usize)> {
    match conv.preset {
        Preset::WholeHead => {
            let mut v = vec![("background".to_string(), 0), ("head".to_string(), 1), ("tumour".to_string(), 2)];
            v.truncate(conv.num_labels);
            for l in v.len()..conv.num_labels {
                v.push((format!("label_{l}"), l));
            }
            v
        }
        // The reference's export: 1 necrotic core, 2 oedema, 3 enhancing tumour (4 before preprocessing).
        Preset::Brats => {
            ["background", "NCR", "ED", "ET"].iter().enumerate().map(|(i, n)| (n.to_string(), i)).collect()
        }
    }
}

fn channel_names(conv: &Convention) -> Vec<&'static str> {
    match conv.preset {
        Preset::WholeHead => vec!["T1"],
        Preset::Brats => vec!["T1", "T1ce", "T2", "FLAIR"],
    }
}

/// Write the dataset file of the plan's finished pairs (all ranks' manifests): nnU-Net's
/// `dataset.json` or MONAI's `datalist.json` (nothing for `plain`). Errors when a planned pair is
/// not finished, so a dataset file always lists complete cases only.
pub fn finalize(spec: &SynthSpec) -> Result<PathBuf> {
    let root = spec.root();
    let plan = plan(spec)?;
    let lines: HashMap<String, ManifestLine> = read_manifest(&root)?.into_iter().map(|l| (l.case.clone(), l)).collect();
    let mut cases = Vec::new();
    for p in &plan.pairs {
        match lines.get(&p.case) {
            Some(l) if l.images.iter().chain([&l.label]).all(|f| root.join(f).is_file()) => cases.push(l),
            _ => return Err(Error::Config(format!("{}: case {} is not finished yet", root.display(), p.case))),
        }
    }
    let sampler = cases.first().map(|l| l.sampler.to_string()).unwrap_or_default();
    let ck = cases.first().map(|l| format!("{} ({})", l.checkpoint, l.checkpoint_hash)).unwrap_or_default();
    match spec.format {
        Format::Nnunet => {
            let channels: serde_json::Map<String, serde_json::Value> = channel_names(&spec.convention)
                .into_iter()
                .enumerate()
                .map(|(i, n)| (i.to_string(), n.into()))
                .collect();
            let labels: serde_json::Map<String, serde_json::Value> =
                label_names(&spec.convention).into_iter().map(|(n, v)| (n, v.into())).collect();
            let json = serde_json::json!({
                "channel_names": channels,
                "labels": labels,
                "numTraining": cases.len(),
                "file_ending": ".nii.gz",
                "name": spec.dataset_name,
                "description": format!("synthetic Med-DDPM pairs: {sampler}, checkpoint {ck}"),
                "licence": "as the checkpoint and masks it was made from",
            });
            let path = root.join("dataset.json");
            write_atomic(&path, serde_json::to_string_pretty(&json).expect("JSON of plain values").as_bytes())?;
            Ok(path)
        }
        Format::Monai => {
            let training: Vec<serde_json::Value> = cases
                .iter()
                .map(|l| {
                    let image: serde_json::Value =
                        if l.images.len() == 1 { l.images[0].clone().into() } else { l.images.clone().into() };
                    serde_json::json!({ "image": image, "label": l.label })
                })
                .collect();
            let json = serde_json::json!({
                "description": format!("synthetic Med-DDPM pairs: {sampler}, checkpoint {ck}"),
                "labels": label_names(&spec.convention).into_iter().map(|(n, v)| (v.to_string(), n)).collect::<HashMap<_, _>>(),
                "numTraining": cases.len(),
                "training": training,
            });
            let path = root.join("datalist.json");
            write_atomic(&path, serde_json::to_string_pretty(&json).expect("JSON of plain values").as_bytes())?;
            Ok(path)
        }
        Format::Plain => Ok(root),
    }
}

/// Make one pair again from its manifest line with the weights `w` on `be` (checked against the
/// line: the mask's and the checkpoint's hashes): its output volumes, images then the label, as
/// the synthesis wrote them. Bit for bit the files' voxels on the same backend and precision.
pub fn regenerate<B: Backend>(
    be: &B,
    w: &LoadedWeights,
    model: &ModelId,
    line: &ManifestLine,
) -> Result<Vec<OutputVolume>> {
    if model.hash != line.checkpoint_hash {
        return Err(Error::Config(format!(
            "case {} was made by checkpoint {} (hash {}), not {} (hash {})",
            line.case, line.checkpoint, line.checkpoint_hash, model.name, model.hash
        )));
    }
    let src = source_by_name(&line.mask)?;
    let hash = source_hash(&src)?;
    if hash != line.mask_hash {
        return Err(Error::data(
            src.name(),
            format!("the mask changed since case {} was made (hash {hash}, was {})", line.case, line.mask_hash),
        ));
    }
    let cfg = &w.cfg;
    let size = [cfg.depth, cfg.size, cfg.size];
    if size != line.size {
        return Err(Error::Config(format!(
            "case {} was sampled at {:?}, the weights give {size:?}",
            line.case, line.size
        )));
    }
    let mask = pair_mask(
        Labels { head: line.aug_labels[0], tumour: line.aug_labels[1] },
        &src.read()?,
        &line.augmentation,
        &src.name(),
    )?;
    let cond = line.convention.cond_tensor(&mask, size, &src.name())?;
    let splan = sampler_plan(&line.sampler, &Schedule::try_cosine(line.timesteps)?)?;
    let mut net = UNet::new(be, cfg, 1)?;
    net.set_params(be, &w.params)?;
    let vol = Sampler::new(be, &net)?.sample_jobs(be, &mut net, &splan, &[(&cond, line.seed)], |_| {})?.swap_remove(0);
    let mut outs = sample_outputs(&line.convention, &vol, cfg.out_channels, size, &mask)?;
    if !outs.iter().any(|o| o.labels) {
        outs.push(OutputVolume { suffix: "_label".into(), volume: mask, labels: true });
    }
    Ok(outs)
}

/// Volumes for masks held in memory (the Python package's `Model.sample`): mask k with seed
/// `seeds[k]`, `batch` volumes per network forward, through the same batched sampler as
/// [`synthesize`] and `meddpm sample`. Returns each mask's output volumes
/// ([`sample_outputs`]: on the mask's grid; BraTS: the four modalities and the exported mask).
#[allow(clippy::too_many_arguments)]
pub fn sample_masks<B: Backend>(
    be: &B,
    w: &LoadedWeights,
    convention: &Convention,
    masks: &[Volume],
    seeds: &[u64],
    sampler: &SamplerSpec,
    timesteps: usize,
    batch: usize,
    resize: bool,
) -> Result<Vec<Vec<OutputVolume>>> {
    if masks.len() != seeds.len() {
        return Err(Error::Config(format!("{} masks and {} seeds", masks.len(), seeds.len())));
    }
    if masks.is_empty() || batch == 0 {
        return Err(Error::Config("no mask given, or a batch of 0".into()));
    }
    let cfg = &w.cfg;
    let size = [cfg.depth, cfg.size, cfg.size];
    let name = Path::new("<mask array>");
    for m in masks {
        super::check_mask_size(name, m, convention, size, resize)?;
    }
    Schedule::model_timesteps(Some(timesteps), w.timesteps)?;
    let conds = masks.iter().map(|m| convention.cond_tensor(m, size, name)).collect::<Result<Vec<_>>>()?;
    let splan = sampler_plan(sampler, &Schedule::try_cosine(timesteps)?)?;
    let b = batch.min(masks.len());
    let mut net = UNet::new(be, cfg, b)?;
    net.set_params(be, &w.params)?;
    let mut s = Sampler::new(be, &net)?;
    let mut out = Vec::with_capacity(masks.len());
    let jobs: Vec<(&[f32], u64)> = conds.iter().map(|c| c.as_slice()).zip(seeds.iter().copied()).collect();
    for (k, chunk) in jobs.chunks(b).enumerate() {
        let vols = s.sample_jobs(be, &mut net, &splan, chunk, |_| {})?;
        for (i, v) in vols.iter().enumerate() {
            out.push(sample_outputs(convention, v, cfg.out_channels, size, &masks[k * b + i])?);
        }
    }
    Ok(out)
}
