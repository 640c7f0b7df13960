//! The optimisation matrix: configurations (fp32 + NCDHW baseline, TF32, NDHWC, TF32 + NDHWC, …)
//! side by side with ratios to the baseline for time, SM cycles, executed instructions,
//! tensor-pipe utilisation and IPC — the seed paper's headline table, for the GPU at hand.
//!
//! Inputs come per configuration, from an ncu export ([`ConfigInput::from_ncu`]) or from a timed
//! run (time only). A ratio is `config / baseline`: 0.01 means a hundred times fewer cycles.
//! Missing inputs stay `None` and print as "not collected".
//!
//! `meddpm profile --matrix` names its configurations here too: [`MatrixSpec`] (the option's
//! value), [`CUDA_CONFIGS`] and [`config_name`] (the configurations it runs itself), and
//! [`from_cuda_runs`] (their CUPTI records and ncu totals → the matrix inputs, baseline first).

use super::kernels::{Category, KernelRecord};
use super::ncu::{totals, NcuKernel};
use crate::backend::{Layout, Precision};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// One `--matrix` configuration: a name, an ncu raw export, optionally the launch IDs to sum;
/// or (`--matrix` without a value, spelled `cuda`) the CUDA configurations run by the profiler.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MatrixSpec {
    Cuda,
    Ncu { name: String, path: PathBuf, ids: Option<Vec<u64>> },
}

impl MatrixSpec {
    /// `cuda`, `NAME=RAW.csv` or `NAME=RAW.csv:ID,ID,…`; the error is the message for the user.
    pub fn parse(s: &str) -> Result<MatrixSpec, String> {
        if s == "cuda" {
            return Ok(MatrixSpec::Cuda);
        }
        let bad =
            || format!("'{s}' is not NAME=RAW.csv or NAME=RAW.csv:ID,ID,… (or no value: the four CUDA configurations)");
        let (name, rest) = s.split_once('=').ok_or_else(bad)?;
        let (path, ids) = match rest.rsplit_once(':') {
            Some((p, list)) if !list.is_empty() && list.split(',').all(|x| x.trim().parse::<u64>().is_ok()) => {
                (p, Some(list.split(',').map(|x| x.trim().parse().expect("checked")).collect()))
            }
            _ => (rest, None),
        };
        if name.is_empty() || path.is_empty() {
            return Err(bad());
        }
        Ok(MatrixSpec::Ncu { name: name.to_string(), path: PathBuf::from(path), ids })
    }
}

/// The CUDA configurations of `--matrix` in the order they run: fp32/TF32 × NCDHW/NDHWC, then bf16.
pub const CUDA_CONFIGS: [(Precision, Layout); 6] = [
    (Precision::Fp32, Layout::Ncdhw),
    (Precision::Tf32, Layout::Ncdhw),
    (Precision::Fp32, Layout::Ndhwc),
    (Precision::Tf32, Layout::Ndhwc),
    (Precision::Bf16, Layout::Ncdhw),
    (Precision::Bf16, Layout::Ndhwc),
];

/// A configuration's name: `tf32-ndhwc`.
pub fn config_name(p: Precision, l: Layout) -> String {
    format!("{}-{}", p.name(), if l == Layout::Ncdhw { "ncdhw" } else { "ndhwc" })
}

/// The matrix inputs of CUDA runs: per configuration the training step's CUPTI records (`None`
/// when there were none) and, matched by [`config_name`], its ncu totals from `ncu_by_config`.
/// Time and time by category come from the records when there are any (ncu's replayed durations
/// otherwise). Sorted baseline first: fp32-ncdhw, tf32-ncdhw, fp32-ndhwc, tf32-ndhwc, then
/// bf16-ncdhw, bf16-ndhwc.
pub fn from_cuda_runs(
    mut runs: Vec<(Precision, Layout, Option<Vec<KernelRecord>>)>,
    ncu_by_config: &[(String, ConfigInput)],
) -> Vec<ConfigInput> {
    let order = |p: Precision, l: Layout| match p {
        Precision::Bf16 => 4 + (l != Layout::Ncdhw) as u8,
        _ => (p != Precision::Fp32) as u8 + 2 * (l != Layout::Ncdhw) as u8,
    };
    runs.sort_by_key(|r| order(r.0, r.1));
    runs.into_iter()
        .map(|(p, l, recs)| {
            let name = config_name(p, l);
            let mut c = ncu_by_config
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, c)| c.clone())
                .unwrap_or_else(|| ConfigInput { name: name.clone(), ..ConfigInput::default() });
            if let Some(recs) = recs {
                c.time_ns = Some(recs.iter().map(|r| r.duration_ns as f64).sum());
                c = c.with_records(&recs);
            }
            c
        })
        .collect()
}

/// What is known about one configuration.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ConfigInput {
    pub name: String,
    pub time_ns: Option<f64>,
    pub sm_cycles: Option<f64>,
    pub instructions: Option<f64>,
    /// Tensor-pipe utilisation, %.
    pub tensor_pct: Option<f64>,
    pub ipc: Option<f64>,
    /// Kernel time by category, ns (the stacked bar of this configuration); empty when unknown.
    #[serde(default)]
    pub by_category: Vec<(Category, f64)>,
}

/// Σ time per category of `(category, ns)` pairs, in [`Category::ALL`] order, empty categories left out.
pub fn category_times(items: impl IntoIterator<Item = (Category, f64)>) -> Vec<(Category, f64)> {
    let mut m: BTreeMap<Category, f64> = BTreeMap::new();
    for (c, t) in items {
        *m.entry(c).or_default() += t;
    }
    Category::ALL.iter().filter_map(|c| m.get(c).filter(|t| **t > 0.0).map(|t| (*c, *t))).collect()
}

impl ConfigInput {
    /// Kernel time by category from a timeline's records (CUPTI).
    pub fn with_records(mut self, records: &[KernelRecord]) -> Self {
        self.by_category = category_times(records.iter().map(|r| (r.category, r.duration_ns as f64)));
        self
    }

    /// Totals of the kernels one configuration ran, from its ncu export.
    pub fn from_ncu(name: &str, kernels: &[NcuKernel]) -> Self {
        let t = totals(kernels);
        ConfigInput {
            name: name.to_string(),
            time_ns: t.time_ns,
            sm_cycles: t.sm_cycles,
            instructions: t.instructions,
            tensor_pct: t.tensor_pct,
            ipc: t.ipc,
            by_category: category_times(kernels.iter().filter_map(|k| Some((k.category, k.counters().duration_ns?)))),
        }
    }
}

/// Ratios of one configuration to the baseline (`config / baseline`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Ratios {
    pub time: Option<f64>,
    pub sm_cycles: Option<f64>,
    pub instructions: Option<f64>,
    /// `None` when the baseline used no tensor pipe (a ratio to 0 is meaningless: read the values).
    pub tensor: Option<f64>,
    pub ipc: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MatrixRow {
    pub input: ConfigInput,
    pub ratios: Ratios,
    pub is_baseline: bool,
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b.abs() > 0.0 => Some(a / b),
        _ => None,
    }
}

/// The matrix with `inputs[baseline]` as the baseline.
pub fn matrix(inputs: &[ConfigInput], baseline: usize) -> Vec<MatrixRow> {
    let Some(b) = inputs.get(baseline) else { return Vec::new() };
    inputs
        .iter()
        .enumerate()
        .map(|(i, c)| MatrixRow {
            input: c.clone(),
            is_baseline: i == baseline,
            ratios: Ratios {
                time: ratio(c.time_ns, b.time_ns),
                sm_cycles: ratio(c.sm_cycles, b.sm_cycles),
                instructions: ratio(c.instructions, b.instructions),
                tensor: ratio(c.tensor_pct, b.tensor_pct.filter(|&t| t >= 0.01)),
                ipc: ratio(c.ipc, b.ipc),
            },
        })
        .collect()
}
