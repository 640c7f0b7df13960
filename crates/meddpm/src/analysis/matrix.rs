//! The optimisation matrix: configurations (fp32 + NCDHW baseline, TF32, NDHWC, TF32 + NDHWC, …)
//! side by side with ratios to the baseline for time, SM cycles, executed instructions,
//! tensor-pipe utilisation and IPC — the seed paper's headline table, for the GPU at hand.
//!
//! Inputs come per configuration, from an ncu export ([`ConfigInput::from_ncu`]) or from a timed
//! run (time only). A ratio is `config / baseline`: 0.01 means a hundred times fewer cycles.
//! Missing inputs stay `None` and print as "not collected".

use super::kernels::{Category, KernelRecord};
use super::ncu::{totals, NcuKernel};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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
