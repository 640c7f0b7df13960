//! Runtime breakdown tables from kernel records: by category, by block (NVTX range), by phase,
//! and the top kernels, each with its share of kernel time and of the measured step time, and
//! achieved TFLOP/s and GB/s where every record of a row carries a FLOP / byte count.
//!
//! The step time is measured separately (wall clock around the whole step). When every record has
//! a GPU start timestamp (CUPTI), the breakdown also measures where the GPU was idle ([`Idle`]):
//! the union of the kernel intervals is the busy time, the gaps between kernels are idle time
//! inside the GPU timeline (launch latency, host work, synchronisation inside the step), and the
//! time before the first kernel starts and after the last one ends is outside the timeline; so
//! categories + gaps + outside − overlap = the step, exactly. Each gap is charged to the range of
//! the kernel that follows it (what the GPU was waiting for). Without timestamps only
//! step − Σ records is known ([`Breakdown::unattributed_ns`]).
//!
//! Data-parallel steps: the NCCL kernels ([`Category::Collective`]) run on their own stream next to
//! backward; [`CommOverlap`] says how much of their time other kernels ran at the same moment
//! (the gradient all-reduce hidden behind backward; issue 14's target is ≥ 80 %).

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
    /// Σ FLOPs of the row's records; `None` unless every record has a FLOP count (a partial sum
    /// divided by the row's time would understate the rate, a partial sum alone the work).
    pub flops: Option<f64>,
    /// Σ bytes of the row's records; `None` unless every record has a byte count.
    pub bytes: Option<f64>,
    /// flops / the row's time, TFLOP/s (when `flops` is known).
    pub tflops: Option<f64>,
    /// bytes / the row's time, GB/s (when `bytes` is known).
    pub gbps: Option<f64>,
}

/// Idle time charged to one range (or phase): the gaps that end at a kernel of it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GapRow {
    /// Range path (`train/backward/input_blocks.1.0`) or phase (`train/backward`) of the kernels
    /// that follow the gaps; `(no range)` for kernels outside any range.
    pub key: String,
    /// Number of gaps (> 0 ns) before kernels of this key.
    pub gaps: usize,
    pub total_ns: u64,
    pub largest_ns: u64,
    /// total_ns / the step time, %.
    pub pct_of_step: f64,
}

/// Where the GPU was idle during a step, from the kernels' start timestamps.
///
/// busy + gaps = span; span + outside = step (when the span fits in the step); Σ record
/// durations − overlap = busy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Idle {
    /// Length of the union of the kernel intervals [start, start + duration), ns.
    pub busy_ns: u64,
    /// Last kernel end − first kernel start, ns.
    pub span_ns: u64,
    /// span − busy: GPU idle between kernels (launch latency, host work, syncs inside the step), ns.
    pub gaps_ns: u64,
    /// step − span, clamped at 0: host work before the first kernel starts and the sync after the
    /// last kernel ends, ns.
    pub outside_ns: u64,
    /// Σ record durations − busy: time during which kernels ran concurrently (counted once per
    /// kernel in the category rows), ns.
    pub overlap_ns: u64,
    /// Number of gaps (> 0 ns) between kernels.
    pub gaps: usize,
    /// Gaps by the range path of the kernel that follows each gap, largest total first.
    pub by_range: Vec<GapRow>,
    /// Gaps by the phase of the kernel that follows each gap, largest total first.
    pub by_phase: Vec<GapRow>,
}

/// A row of the by-category table below the kernel categories: step time outside kernels (or a
/// correction), so that the `% of step` column sums to 100 %.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepRow {
    pub key: String,
    /// Number of gaps, for the gap row.
    pub count: Option<usize>,
    /// Signed: corrections (kernel overlap, a span longer than the step) are negative.
    pub ns: i64,
    pub pct_of_step: f64,
}

/// Label of the step row for the gaps between kernels.
pub const IDLE_GAPS: &str = "GPU idle: gaps between kernels";
/// Label of the step row for the time before the first / after the last kernel.
pub const IDLE_OUTSIDE: &str = "GPU idle: before first / after last kernel";
/// Label of the correction row for concurrently running kernels.
pub const IDLE_OVERLAP: &str = "kernel overlap (concurrent time counted twice above)";
/// Label of the correction row for a kernel span longer than the measured step.
pub const IDLE_SPAN_EXCESS: &str = "kernel span beyond the measured step (clocks disagree)";

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
    /// GPU idle time, when every record has a start timestamp and the step time is known.
    #[serde(default)]
    pub idle: Option<Idle>,
    /// Collective time hidden behind other kernels, when there are NCCL kernels and every record
    /// has a start timestamp.
    #[serde(default)]
    pub comm: Option<CommOverlap>,
}

/// How much of the collectives' GPU time ran concurrently with other kernels.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommOverlap {
    /// Collective kernels.
    pub calls: usize,
    /// Length of the union of the collective kernels' intervals, ns.
    pub comm_ns: u64,
    /// The part of it during which at least one other kernel ran, ns.
    pub hidden_ns: u64,
    /// hidden / comm, %.
    pub hidden_pct: f64,
}

/// Sorted, merged union of half-open intervals.
fn union(mut iv: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    iv.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(iv.len());
    for (s, e) in iv.into_iter().filter(|(s, e)| e > s) {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// The collective time of `records` and how much of it other kernels covered ([`CommOverlap`]);
/// `None` without collective records or when any record lacks a start timestamp.
pub fn comm_overlap(records: &[KernelRecord]) -> Option<CommOverlap> {
    let (mut comm, mut other) = (Vec::new(), Vec::new());
    for r in records {
        let s = r.start_ns?;
        let iv = (s, s.saturating_add(r.duration_ns));
        if r.category == Category::Collective {
            comm.push(iv);
        } else {
            other.push(iv);
        }
    }
    let calls = comm.len();
    if calls == 0 {
        return None;
    }
    let (comm, other) = (union(comm), union(other));
    let comm_ns: u64 = comm.iter().map(|(s, e)| e - s).sum();
    // intersection of two sorted disjoint interval lists
    let (mut i, mut j, mut hidden_ns) = (0, 0, 0u64);
    while i < comm.len() && j < other.len() {
        let (s, e) = (comm[i].0.max(other[j].0), comm[i].1.min(other[j].1));
        hidden_ns += e.saturating_sub(s);
        if comm[i].1 < other[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    let hidden_pct = if comm_ns > 0 { 100.0 * hidden_ns as f64 / comm_ns as f64 } else { 0.0 };
    Some(CommOverlap { calls, comm_ns, hidden_ns, hidden_pct })
}

impl Breakdown {
    /// Step time not covered by records, step − Σ records (launch gaps, host work, overlap not
    /// separated), ns; `None` without a step time. With timestamps, [`Breakdown::idle`] splits it.
    pub fn unattributed_ns(&self) -> Option<i64> {
        self.step_ns.map(|s| s as i64 - self.kernel_ns as i64)
    }

    /// The rows that follow the kernel categories in the by-category table when the idle time is
    /// known: gaps between kernels, time before the first / after the last kernel, and the
    /// corrections for overlapping kernels and for a span longer than the step (each only when
    /// non-zero). With them, the categories' and these rows' `pct_of_step` sum to 100 %. Empty
    /// without [`Breakdown::idle`].
    pub fn idle_rows(&self) -> Vec<StepRow> {
        let (Some(i), Some(step)) = (&self.idle, self.step_ns) else { return Vec::new() };
        let pct = |ns: i64| if step > 0 { 100.0 * ns as f64 / step as f64 } else { 0.0 };
        let mut v = vec![
            StepRow { key: IDLE_GAPS.into(), count: Some(i.gaps), ns: i.gaps_ns as i64, pct_of_step: 0.0 },
            StepRow { key: IDLE_OUTSIDE.into(), count: None, ns: i.outside_ns as i64, pct_of_step: 0.0 },
        ];
        if i.overlap_ns > 0 {
            v.push(StepRow { key: IDLE_OVERLAP.into(), count: None, ns: -(i.overlap_ns as i64), pct_of_step: 0.0 });
        }
        if i.span_ns > step {
            v.push(StepRow {
                key: IDLE_SPAN_EXCESS.into(),
                count: None,
                ns: step as i64 - i.span_ns as i64,
                pct_of_step: 0.0,
            });
        }
        for r in &mut v {
            r.pct_of_step = pct(r.ns);
        }
        v
    }
}

fn make_row(key: String, category: Option<Category>, rs: &[&KernelRecord], total: u64, step: Option<u64>) -> Row {
    let t: u64 = rs.iter().map(|r| r.duration_ns).sum();
    let pct = |a: u64, b: u64| if b > 0 { 100.0 * a as f64 / b as f64 } else { 0.0 };
    // a count only when every record of the row has one: Σ over the counted records alone would
    // show e.g. a 16-byte memset as the "bytes" of a block of conv kernels
    let all = |get: fn(&KernelRecord) -> Option<f64>| -> Option<f64> {
        if rs.is_empty() {
            return None;
        }
        rs.iter().map(|r| get(r)).sum::<Option<f64>>()
    };
    let flops = all(|r| r.flops);
    let bytes = all(|r| r.bytes);
    let rate = |v: Option<f64>, div: f64| v.filter(|_| t > 0).map(|v| v / t as f64 / div);
    Row {
        key,
        category,
        calls: rs.len(),
        total_ns: t,
        pct_of_kernels: pct(t, total),
        pct_of_step: step.map(|s| pct(t, s)),
        tflops: rate(flops, 1e3),
        gbps: rate(bytes, 1.0),
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
    let by_phase = grouped(
        records,
        |r| r.phase().unwrap_or_else(|| "(no range)".to_string()),
        |k| (k.clone(), None),
        total,
        step_ns,
    );
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
    let idle = step_ns.and_then(|s| idle(records, s));
    let comm = comm_overlap(records);
    Breakdown {
        name: name.to_string(),
        records: records.len(),
        kernel_ns: total,
        step_ns,
        by_category,
        by_phase,
        by_block,
        top,
        idle,
        comm,
    }
}

fn gap_rows(m: BTreeMap<String, (usize, u64, u64)>, step: u64) -> Vec<GapRow> {
    let mut v: Vec<GapRow> = m
        .into_iter()
        .map(|(key, (gaps, total_ns, largest_ns))| GapRow {
            key,
            gaps,
            total_ns,
            largest_ns,
            pct_of_step: if step > 0 { 100.0 * total_ns as f64 / step as f64 } else { 0.0 },
        })
        .collect();
    v.sort_by(|a, b| b.total_ns.cmp(&a.total_ns).then(a.key.cmp(&b.key)));
    v
}

/// The GPU idle time of a step of `step_ns` from the records' start timestamps; `None` when there
/// are no records or any record lacks a timestamp.
///
/// Records are swept in start order (ties in record order) keeping the end of the union so far; a
/// record that starts after that end leaves a gap, charged to it (the kernel the GPU waited for).
/// A record that starts before the end overlaps: no gap.
pub fn idle(records: &[KernelRecord], step_ns: u64) -> Option<Idle> {
    let mut iv: Vec<(u64, u64, &KernelRecord)> = Vec::with_capacity(records.len());
    for r in records {
        let s = r.start_ns?;
        iv.push((s, s.saturating_add(r.duration_ns), r));
    }
    iv.sort_by_key(|&(s, _, _)| s); // stable: ties keep record order
    let (first, _, _) = *iv.first()?;
    let mut end = first;
    let (mut busy, mut gaps_ns, mut gaps) = (0u64, 0u64, 0usize);
    let mut by_range: BTreeMap<String, (usize, u64, u64)> = BTreeMap::new();
    let mut by_phase: BTreeMap<String, (usize, u64, u64)> = BTreeMap::new();
    for &(s, e, r) in &iv {
        if s > end {
            let g = s - end;
            gaps_ns += g;
            gaps += 1;
            let range = r.range.clone().filter(|x| !x.is_empty()).unwrap_or_else(|| "(no range)".into());
            let phase = r.phase().unwrap_or_else(|| "(no range)".into());
            for (m, k) in [(&mut by_range, range), (&mut by_phase, phase)] {
                let x = m.entry(k).or_insert((0, 0, 0));
                x.0 += 1;
                x.1 += g;
                x.2 = x.2.max(g);
            }
        }
        if e > end {
            busy += e - s.max(end);
            end = e;
        }
    }
    let span = end - first;
    debug_assert_eq!(busy + gaps_ns, span);
    let total: u64 = records.iter().map(|r| r.duration_ns).sum();
    Some(Idle {
        busy_ns: busy,
        span_ns: span,
        gaps_ns,
        outside_ns: step_ns.saturating_sub(span),
        overlap_ns: total - busy,
        gaps,
        by_range: gap_rows(by_range, step_ns),
        by_phase: gap_rows(by_phase, step_ns),
    })
}
