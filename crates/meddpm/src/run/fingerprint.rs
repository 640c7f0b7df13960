//! What a run's data looked like: one print per file of every pair (name, size, modification
//! time, content hash), recorded in each checkpoint, so that a resumed run can say before its
//! first step whether pairs were added, went missing or changed since.
//!
//! The hash is XXH3-128 of the file's bytes (`xxhash-rust`): a change detector, not a security
//! measure. Hashing a whole dataset costs one extra read of every file; when resuming, a file
//! whose size and modification time (ns) equal the recorded ones keeps its recorded hash without
//! being read, so a resume reads only what was touched. A file copied elsewhere (new mtime, same
//! bytes) is therefore re-hashed and not reported. Embedded (built-in) sources are hashed from
//! memory and have no modification time.

use crate::data::{Dataset, Source};
use crate::error::{Error, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use xxhash_rust::xxh3::Xxh3;

/// One file of a pair.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FilePrint {
    /// The file's path as the dataset names it (absolute for runs started by the CLI), or
    /// `<built-in>/…` for embedded data.
    pub path: String,
    pub size: u64,
    /// Modification time, ns since the Unix epoch (none for embedded data).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtime_ns: Option<u64>,
    /// XXH3-128 of the bytes, 32 hex digits.
    pub hash: String,
}

/// One (mask, images) pair.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairPrint {
    pub mask: FilePrint,
    pub images: Vec<FilePrint>,
}

/// XXH3-128 of everything `r` yields, as 32 hex digits (`name` for the error message).
pub fn hash_reader(mut r: impl Read, name: &Path) -> Result<String> {
    let mut h = Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = r.read(&mut buf).map_err(|e| Error::io(name, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("{:032x}", h.digest128()))
}

/// The print of one source; `known` prints (by path) are reused when size and mtime agree.
fn print_source(src: &Source, known: &BTreeMap<&str, &FilePrint>) -> Result<FilePrint> {
    match src {
        Source::Embedded { bytes, .. } => Ok(FilePrint {
            path: src.name().display().to_string(),
            size: bytes.len() as u64,
            mtime_ns: None,
            hash: hash_reader(*bytes, &src.name())?,
        }),
        Source::File(p) => {
            let path = p.display().to_string();
            let md = std::fs::metadata(p).map_err(|e| Error::io(p, e))?;
            let mtime_ns = md
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_nanos() as u64);
            if let Some(k) = known.get(path.as_str()) {
                if k.size == md.len() && k.mtime_ns.is_some() && k.mtime_ns == mtime_ns {
                    return Ok((*k).clone());
                }
            }
            let f = std::fs::File::open(p).map_err(|e| Error::io(p, e))?;
            Ok(FilePrint { path, size: md.len(), mtime_ns, hash: hash_reader(f, p)? })
        }
    }
}

/// Prints of every pair of `ds`, in dataset order (files read in parallel). Files listed in
/// `known` (a previous record) with the same size and modification time are not re-read.
pub fn fingerprint(ds: &Dataset, known: &[PairPrint]) -> Result<Vec<PairPrint>> {
    let known: BTreeMap<&str, &FilePrint> =
        known.iter().flat_map(|p| std::iter::once(&p.mask).chain(&p.images)).map(|f| (f.path.as_str(), f)).collect();
    ds.pairs()
        .par_iter()
        .map(|pair| {
            Ok(PairPrint {
                mask: print_source(&pair.mask, &known)?,
                images: pair.images.iter().map(|s| print_source(s, &known)).collect::<Result<_>>()?,
            })
        })
        .collect()
}

/// How a dataset differs from a recorded one; pairs are matched by their mask's path.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DataChanges {
    /// Masks present now but not in the record.
    pub added: Vec<String>,
    /// Masks in the record but not present now.
    pub missing: Vec<String>,
    /// Pairs whose mask or image files differ: "mask (what changed)".
    pub different: Vec<String>,
}

impl DataChanges {
    /// Compare the recorded prints `old` with the current `new`.
    pub fn between(old: &[PairPrint], new: &[PairPrint]) -> DataChanges {
        let by_mask = |v: &[PairPrint]| -> BTreeMap<String, PairPrint> {
            v.iter().map(|p| (p.mask.path.clone(), p.clone())).collect()
        };
        let (old, new) = (by_mask(old), by_mask(new));
        let mut c = DataChanges::default();
        for (k, n) in &new {
            match old.get(k) {
                None => c.added.push(k.clone()),
                Some(o) => {
                    let mut what = Vec::new();
                    if (o.mask.size, &o.mask.hash) != (n.mask.size, &n.mask.hash) {
                        what.push("mask content changed".to_string());
                    }
                    let paths = |p: &PairPrint| p.images.iter().map(|f| f.path.clone()).collect::<Vec<_>>();
                    if paths(o) != paths(n) {
                        what.push(format!("images now {}", paths(n).join(", ")));
                    } else {
                        for (a, b) in o.images.iter().zip(&n.images) {
                            if (a.size, &a.hash) != (b.size, &b.hash) {
                                what.push(format!("{} content changed", b.path));
                            }
                        }
                    }
                    if !what.is_empty() {
                        c.different.push(format!("{k} ({})", what.join("; ")));
                    }
                }
            }
        }
        c.missing = old.keys().filter(|k| !new.contains_key(*k)).cloned().collect();
        c
    }

    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.missing.is_empty() && self.different.is_empty()
    }

    /// One line per kind of change (at most 5 names each, then a count), empty when unchanged.
    pub fn report(&self) -> Vec<String> {
        let list = |v: &[String]| {
            let mut s = v.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
            if v.len() > 5 {
                s.push_str(&format!(" … ({} in all)", v.len()));
            }
            s
        };
        let mut out = Vec::new();
        for (what, v) in [("added", &self.added), ("missing", &self.missing), ("different", &self.different)] {
            if !v.is_empty() {
                out.push(format!("{} pair(s) {what}: {}", v.len(), list(v)));
            }
        }
        out
    }
}
