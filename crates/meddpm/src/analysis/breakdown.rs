//! Runtime breakdown tables from kernel records: by category, by block (NVTX range), by phase,
//! and the top kernels, each with its share of kernel time and of the measured step time, and
//! achieved TFLOP/s and GB/s where the records carry FLOP and byte counts.
//!
//! The step time is measured separately (wall clock around the whole step), so the report can show
//! what part of the step the recorded kernels/ops explain ("unattributed" = step − Σ records:
//! launch gaps, host work, synchronisation).

use super::kernels::{short_name, Category, KernelRecord};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One row of a grouped table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Category label, block name or kernel name.
    pub key: String,
    /// The category (for kernel rows and category rows).
    pub category: Option<Category>,
    pub calls: usize,
    pub total_ns: u64,
    /// Share of Σ record time, %.
    pub pct_of_kernels: f64,
    /// Share of the measured step time, % (when a step time is known).
    pub pct_of_step: Option<f64>,
    /// Σ FLOPs over the rows' records that have a count.
    pub flops: Option<f64>,
    pub bytes: Option<f64>,
    /// Σ flops / Σ time of the counted records, TFLOP/s.
    pub tflops: Option<f64>,
    /// Σ bytes / Σ time of the counted records, GB/s.
    pub gbps: Option<f64>,
}

/// All tables of one profiled pass (a training step or a sampling step).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Breakdown {
    /// Name of the pass ("train micro-step", "sampling forward").
    pub name: String,
    pub records: usize,
    /// Σ record time, ns.
    pub kernel_ns: u64,
    /// Measured wall time of the whole step, ns.
    pub step_ns: Option<u64>,
    pub by_category: Vec<Row>,
    pub by_phase: Vec<Row>,
    pub by_block: Vec<Row>,
    pub top: Vec<Row>,
}

impl Breakdown {
    /// Step time not covered by records (launch gaps, host work), ns; `None` without a step time.
    pub fn unattributed_ns(&self) -> Option<i64> {
        self.step_ns.map(|s| s as i64 - self.kernel_ns as i64)
    }
}

fn make_row(key: String, category: Option<Category>, rs: &[&KernelRecord], total: u64, step: Option<u64>) -> Row {
    let t: u64 = rs.iter().map(|r| r.duration_ns).sum();
    let pct = |a: u64, b: u64| if b > 0 { 100.0 * a as f64 / b as f64 } else { 0.0 };
    let with_f: Vec<&&KernelRecord> = rs.iter().filter(|r| r.flops.is_some()).collect();
    let with_b: Vec<&&KernelRecord> = rs.iter().filter(|r| r.bytes.is_some()).collect();
    let flops = (!with_f.is_empty()).then(|| with_f.iter().filter_map(|r| r.flops).sum::<f64>());
    let bytes = (!with_b.is_empty()).then(|| with_b.iter().filter_map(|r| r.bytes).sum::<f64>());
    let tf: u64 = with_f.iter().map(|r| r.duration_ns).sum();
    let tb: u64 = with_b.iter().map(|r| r.duration_ns).sum();
    Row {
        key,
        category,
        calls: rs.len(),
        total_ns: t,
        pct_of_kernels: pct(t, total),
        pct_of_step: step.map(|s| pct(t, s)),
        tflops: flops.filter(|_| tf > 0).map(|f| f / tf as f64 / 1e3),
        gbps: bytes.filter(|_| tb > 0).map(|b| b / tb as f64),
        flops,
        bytes,
    }
}

fn grouped<K: Ord + Clone>(
    records: &[KernelRecord],
    key: impl Fn(&KernelRecord) -> K,
    label: impl Fn(&K) -> (String, Option<Category>),
    total: u64,
    step: Option<u64>,
) -> Vec<Row> {
    let mut m: BTreeMap<K, Vec<&KernelRecord>> = BTreeMap::new();
    for r in records {
        m.entry(key(r)).or_default().push(r);
    }
    let mut rows: Vec<Row> = m
        .iter()
        .map(|(k, rs)| {
            let (l, c) = label(k);
            make_row(l, c, rs, total, step)
        })
        .collect();
    rows.sort_by(|a, b| b.total_ns.cmp(&a.total_ns).then(a.key.cmp(&b.key)));
    rows
}

/// Build every table for `records`; `top_n` limits the top-kernel table.
pub fn breakdown(name: &str, records: &[KernelRecord], step_ns: Option<u64>, top_n: usize) -> Breakdown {
    let total: u64 = records.iter().map(|r| r.duration_ns).sum();
    let by_category = grouped(records, |r| r.category, |c| (c.label().to_string(), Some(*c)), total, step_ns);
    let by_phase =
        grouped(records, |r| r.phase().unwrap_or("(no range)").to_string(), |k| (k.clone(), None), total, step_ns);
    let by_block = grouped(
        records,
        |r| r.block_name().unwrap_or("(outside blocks)").to_string(),
        |k| (k.clone(), None),
        total,
        step_ns,
    );
    let mut top =
        grouped(records, |r| (short_name(&r.name, 100), r.category), |(n, c)| (n.clone(), Some(*c)), total, step_ns);
    top.truncate(top_n);
    Breakdown {
        name: name.to_string(),
        records: records.len(),
        kernel_ns: total,
        step_ns,
        by_category,
        by_phase,
        by_block,
        top,
    }
}
