//! A training dataset: (mask, image[s]) pairs read on demand, as the reference's
//! `NiftiPairImageGenerator` (`dataset.py`) does.
//!
//! Pairs come from a masks folder and one images folder per modality, or from a CSV manifest.
//! The reference sorts both folders, zips them and asserts that the integers made of *all digits*
//! in each path agree. We pair by the same key but make it robust: the digits of the *file name*
//! (not the whole path), after removing a BraTS modality suffix (`_seg`, `_t1`, `_t1ce`, `_t2`,
//! `_flair`, and BraTS-2023's `-seg`, `-t1n`, `-t1c`, `-t2w`, `-t2f` — whose own digits would
//! otherwise break the match, which is why `dataset_brats.py` disabled its check), compared as
//! integers (leading zeros ignored). Only `.nii` / `.nii.gz` files are listed. A file without a
//! partner, two files with one key, or a name without digits is an error naming the file.
//!
//! Manifest format: a header line whose first column is `mask` followed by one column per image
//! modality, then one line per pair; comma-separated, no quoting; paths relative to the CSV's
//! folder; blank lines and lines starting with `#` are skipped.
//!
//! [`Dataset::validate`] decodes every pair up front (in parallel) and reports the first problem
//! — unreadable file, non-3-D data, NaN/Inf, shape mismatch, labels out of range — so training
//! refuses before it starts.

use super::convention::{brats_prepare_image, brats_prepare_seg, brats_preprocess, Convention};
use super::nifti::{read_volume, read_volume_bytes, Volume};
use super::Sample;
use crate::error::{Error, Result};
use rayon::prelude::*;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Where a volume's bytes live.
#[derive(Clone, Debug)]
pub enum Source {
    File(PathBuf),
    /// Bytes compiled into the binary (the demo data); `name` is used in messages.
    Embedded {
        name: &'static str,
        bytes: &'static [u8],
    },
}

impl Source {
    /// A path-like name for messages.
    pub fn name(&self) -> PathBuf {
        match self {
            Source::File(p) => p.clone(),
            Source::Embedded { name, .. } => PathBuf::from(format!("<built-in>/{name}")),
        }
    }
    pub fn read(&self) -> Result<Volume> {
        match self {
            Source::File(p) => read_volume(p),
            Source::Embedded { bytes, .. } => read_volume_bytes(bytes, &self.name()),
        }
    }
}

/// One training example: a mask and its image volume(s) (1, or 4 for BraTS).
#[derive(Clone, Debug)]
pub struct Pair {
    pub mask: Source,
    pub images: Vec<Source>,
}

/// A list of pairs plus the convention and model size that turn them into tensors.
#[derive(Clone, Debug)]
pub struct Dataset {
    pairs: Vec<Pair>,
    convention: Convention,
    size: [usize; 3],
}

/// The pairing key of a file name: all digits after dropping extension and modality suffix,
/// leading zeros removed ("0" if all zeros). None if there are no digits.
pub fn pair_key(path: &Path) -> Option<String> {
    let name = path.file_name()?.to_string_lossy().to_lowercase();
    let mut stem = name.trim_end_matches(".gz").trim_end_matches(".nii").to_string();
    for suffix in ["_seg", "-seg", "_t1ce", "_t1", "_t2", "_flair", "-t1n", "-t1c", "-t2w", "-t2f"] {
        if let Some(s) = stem.strip_suffix(suffix) {
            stem = s.to_string();
            break;
        }
    }
    let digits: String = stem.chars().filter(|c| c.is_ascii_digit()).collect();
    if digits.is_empty() {
        return None;
    }
    let trimmed = digits.trim_start_matches('0');
    Some(if trimmed.is_empty() { "0".to_string() } else { trimmed.to_string() })
}

fn is_nifti(p: &Path) -> bool {
    let n = p.file_name().map(|n| n.to_string_lossy().to_lowercase()).unwrap_or_default();
    !n.starts_with('.') && (n.ends_with(".nii") || n.ends_with(".nii.gz"))
}

/// Sorted `.nii`/`.nii.gz` files of a folder; an empty or missing folder is an error.
pub fn list_nifti(dir: &Path) -> Result<Vec<PathBuf>> {
    let rd = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut files = Vec::new();
    for entry in rd {
        let p = entry.map_err(|e| Error::io(dir, e))?.path();
        if p.is_file() && is_nifti(&p) {
            files.push(p);
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(Error::data(dir, "no .nii or .nii.gz files in this folder"));
    }
    Ok(files)
}

fn keyed(files: &[PathBuf], dir: &Path) -> Result<HashMap<String, PathBuf>> {
    let mut map: HashMap<String, PathBuf> = HashMap::new();
    for f in files {
        let key = pair_key(f).ok_or_else(|| {
            Error::data(f, "file name has no digits to pair masks and images by; rename it or use a CSV manifest")
        })?;
        if let Some(prev) = map.insert(key.clone(), f.clone()) {
            return Err(Error::data(
                dir,
                format!("{} and {} both have the number {key}: pairing is ambiguous", prev.display(), f.display()),
            ));
        }
    }
    Ok(map)
}

impl Dataset {
    /// A dataset from explicit pairs (checked: non-empty, image count matches the convention).
    pub fn from_pairs(pairs: Vec<Pair>, convention: Convention, size_dhw: [usize; 3]) -> Result<Dataset> {
        convention.validate()?;
        if size_dhw.contains(&0) {
            return Err(Error::Config(format!("model size (D, H, W) = {size_dhw:?} has a zero")));
        }
        if pairs.is_empty() {
            return Err(Error::Config("the dataset has no pairs".into()));
        }
        for p in &pairs {
            if p.images.len() != convention.image_channels() {
                return Err(Error::data(
                    p.mask.name(),
                    format!(
                        "{} image(s) for this mask, the convention needs {}",
                        p.images.len(),
                        convention.image_channels()
                    ),
                ));
            }
        }
        Ok(Dataset { pairs, convention, size: size_dhw })
    }

    /// Masks folder + one images folder per modality, paired by the digits in file names.
    pub fn from_folders(
        masks: &Path,
        images: &[PathBuf],
        convention: Convention,
        size_dhw: [usize; 3],
    ) -> Result<Dataset> {
        if images.len() != convention.image_channels() {
            return Err(Error::Config(format!(
                "{} image folder(s) given, the {:?} convention needs {}",
                images.len(),
                convention.preset,
                convention.image_channels()
            )));
        }
        let mask_files = list_nifti(masks)?;
        let mask_keys = keyed(&mask_files, masks)?;
        let mut folders = Vec::new();
        for dir in images {
            let files = list_nifti(dir)?;
            let map = keyed(&files, dir)?;
            for (key, f) in &map {
                if !mask_keys.contains_key(key) {
                    return Err(Error::data(
                        f,
                        format!("no mask in {} has the number {key} to pair with this image", masks.display()),
                    ));
                }
            }
            folders.push((dir, map));
        }
        let mut pairs = Vec::with_capacity(mask_files.len());
        for m in &mask_files {
            let key = pair_key(m).expect("keyed() checked every name");
            let mut imgs = Vec::new();
            for (dir, map) in &folders {
                let f = map.get(&key).ok_or_else(|| {
                    Error::data(m, format!("no image in {} has the number {key} to pair with this mask", dir.display()))
                })?;
                imgs.push(Source::File(f.clone()));
            }
            pairs.push(Pair { mask: Source::File(m.clone()), images: imgs });
        }
        Dataset::from_pairs(pairs, convention, size_dhw)
    }

    /// A CSV manifest: `mask,<image>[,<image>...]` header, then one pair per line.
    pub fn from_manifest(csv: &Path, convention: Convention, size_dhw: [usize; 3]) -> Result<Dataset> {
        let text = std::fs::read_to_string(csv).map_err(|e| Error::io(csv, e))?;
        let base = csv.parent().unwrap_or(Path::new("."));
        let mut lines = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l.trim()))
            .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'));
        let (_, header) = lines.next().ok_or_else(|| Error::format(csv, "empty manifest"))?;
        let cols: Vec<&str> = header.split(',').map(str::trim).collect();
        if cols[0] != "mask" || cols.len() != 1 + convention.image_channels() {
            return Err(Error::format(
                csv,
                format!(
                    "header must be `mask` then {} image column(s) (e.g. `mask,image` or `mask,t1,t1ce,t2,flair`), got `{header}`",
                    convention.image_channels()
                ),
            ));
        }
        let mut pairs = Vec::new();
        for (lineno, line) in lines {
            if line.contains('"') {
                return Err(Error::format(csv, format!("line {lineno}: quoted fields are not supported")));
            }
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            if fields.len() != cols.len() {
                return Err(Error::format(
                    csv,
                    format!("line {lineno}: {} field(s), the header has {}", fields.len(), cols.len()),
                ));
            }
            let mut srcs = Vec::new();
            for f in &fields {
                let p = base.join(f);
                if !p.is_file() {
                    return Err(Error::data(&p, format!("listed on line {lineno} of {} but not found", csv.display())));
                }
                srcs.push(Source::File(p));
            }
            let mask = srcs.remove(0);
            pairs.push(Pair { mask, images: srcs });
        }
        if pairs.is_empty() {
            return Err(Error::format(csv, "manifest lists no pairs"));
        }
        Dataset::from_pairs(pairs, convention, size_dhw)
    }

    /// `path` ending in `.csv` is a manifest (then `images` must be empty); otherwise it is the
    /// masks folder and `images` the image folder(s).
    pub fn open(path: &Path, images: &[PathBuf], convention: Convention, size_dhw: [usize; 3]) -> Result<Dataset> {
        let is_csv = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("csv"));
        if is_csv {
            if !images.is_empty() {
                return Err(Error::Config("a CSV manifest names its images itself: give no image folders".into()));
            }
            Dataset::from_manifest(path, convention, size_dhw)
        } else {
            Dataset::from_folders(path, images, convention, size_dhw)
        }
    }

    pub fn len(&self) -> usize {
        self.pairs.len()
    }
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }
    pub fn pairs(&self) -> &[Pair] {
        &self.pairs
    }
    pub fn convention(&self) -> &Convention {
        &self.convention
    }
    /// Model size (D, H, W).
    pub fn size(&self) -> [usize; 3] {
        self.size
    }

    /// Read pair `i` and check it: equal shapes, labels in range (after BraTS preprocessing
    /// when enabled). Returns (mask, images) at their own size.
    pub fn load(&self, i: usize) -> Result<(Volume, Vec<Volume>)> {
        let pair = &self.pairs[i];
        let mask_name = pair.mask.name();
        let mask = pair.mask.read()?;
        let mut images = Vec::with_capacity(pair.images.len());
        for src in &pair.images {
            let img = src.read()?;
            if img.dims != mask.dims {
                return Err(Error::data(
                    src.name(),
                    format!(
                        "image is {:?} (X, Y, Z) but its mask {} is {:?}",
                        img.dims,
                        mask_name.display(),
                        mask.dims
                    ),
                ));
            }
            images.push(img);
        }
        if self.convention.brats_preprocess {
            let (imgs, seg) = brats_preprocess(&images, &mask, &mask_name)?;
            return Ok((seg, imgs));
        }
        self.convention.check_labels(&mask, &mask_name)?;
        Ok((mask, images))
    }

    /// Pair `i` as model tensors.
    pub fn get(&self, i: usize) -> Result<Sample> {
        let (mask, images) = self.load(i)?;
        let name = self.pairs[i].mask.name();
        let cond = self.convention.cond_tensor(&mask, self.size, &name)?;
        let image = self.convention.image_tensor(&images, self.size, &name)?;
        Ok(Sample {
            image,
            cond,
            image_channels: self.convention.image_channels(),
            cond_channels: self.convention.cond_channels(),
            dims: self.size,
            index: i,
        })
    }

    /// Only the condition of pair `i` (for sampling) and the mask it came from (after BraTS
    /// preprocessing when enabled, which needs the pair's T1).
    pub fn condition(&self, i: usize) -> Result<(Vec<f32>, Volume)> {
        let pair = &self.pairs[i];
        let name = pair.mask.name();
        let mut mask = pair.mask.read()?;
        if self.convention.brats_preprocess {
            let t1 = brats_prepare_image(&pair.images[0].read()?);
            mask = brats_prepare_seg(&t1, &mask, &name)?;
        }
        let cond = self.convention.cond_tensor(&mask, self.size, &name)?;
        Ok((cond, mask))
    }

    /// Read pair `i` and check it ([`Dataset::load`]); unless `resize`, a size other than the
    /// dataset's (the model's) is an error that names both sizes.
    pub fn check_pair(&self, i: usize, resize: bool) -> Result<()> {
        let (mask, _) = self.load(i)?;
        let [x, y, z] = mask.dims;
        if resize || [z, y, x] == self.size {
            return Ok(());
        }
        let dhw = |d: [usize; 3]| format!("{}×{}×{}", d[0], d[1], d[2]);
        Err(Error::data(
            self.pairs[i].mask.name(),
            format!(
                "the pair is {} (D×H×W) but the model trains on {} volumes; choose a model of the data's size \
                 (--preset, or [unet] depth/size in the run file), or --resize to resample the data",
                dhw([z, y, x]),
                dhw(self.size)
            ),
        ))
    }

    /// Decode and check every pair (in parallel); the first problem (in dataset order) is
    /// returned, with a count of the others.
    pub fn validate(&self) -> Result<()> {
        self.validate_sized(true)
    }

    /// [`Dataset::validate`], and unless `resize`, a pair whose size is not the dataset's (the
    /// model's) is a problem too, named with both sizes: data is resampled only when asked.
    pub fn validate_sized(&self, resize: bool) -> Result<()> {
        let check = |i: usize| self.check_pair(i, resize);
        let errors: Vec<(usize, Error)> =
            (0..self.len()).into_par_iter().filter_map(|i| check(i).err().map(|e| (i, e))).collect();
        let more = errors.len().saturating_sub(1);
        let first = errors.into_iter().min_by_key(|(i, _)| *i).map(|(_, e)| e);
        match first {
            None => Ok(()),
            Some(e) if more == 0 => Err(e),
            Some(e) => {
                let tail = format!(" (and {more} more pair(s) with problems)");
                Err(match e {
                    Error::Data { path, msg } => Error::Data { path, msg: msg + &tail },
                    Error::Format { path, msg } => Error::Format { path, msg: msg + &tail },
                    other => other,
                })
            }
        }
    }
}
