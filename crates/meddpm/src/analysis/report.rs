//! The profile report: one folder with `report.md` (what a person reads), CSV tables, `report.json`
//! (everything, machine-readable), SVG charts (`breakdown.svg`: a stacked category breakdown per
//! pass/configuration, up to the step time; `roofline.svg`: the records placed on the roofline of
//! the device), and a short terminal summary. Passes whose records carry GPU start timestamps
//! (CUPTI) also get the GPU idle time: gaps between kernels and time outside them, and where the
//! GPU waits (see [`super::breakdown::Idle`]).
//!
//! Every number says where it comes from: times of profiled passes are *measured* on the device
//! that ran them; roofline times are *predicted*; GPU table values are *datasheet* values. What
//! could not be collected is listed by name, and the rest of the report is still written.

use super::breakdown::{breakdown, Breakdown, CommOverlap, GapRow, Row};
use super::csv;
use super::gpus::{self, check, CategoryPrediction, Check, Gpu, Math, Verdict};
use super::kernels::{short_name, Category, KernelRecord};
use super::matrix::{matrix, ConfigInput, MatrixRow};
use super::ncu::{priority_list, Counters, NcuData, RankedRule};
use super::occupancy::{sm_limits, theoretical, Occupancy, SmLimits};
use super::power::PowerSummary;
use crate::error::{Error, Result};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// One profiled (or only counted) pass: a training micro-step, a sampling forward, or one
/// configuration of the optimisation study.
#[derive(Clone, Debug, Serialize)]
pub struct Pass {
    pub name: String,
    pub records: Vec<KernelRecord>,
    /// Wall time of the whole pass, measured around it.
    pub step_ns: Option<u64>,
    /// `false` for passes run on [`super::timed::NullBackend`]: counts only, no times.
    pub measured: bool,
    /// Step times of every recorded repetition, ns; `records` are those of the median one.
    pub repeats: Vec<u64>,
    /// Median wall time of the same step repeated without the recording (CUPTI off), ns: what
    /// `meddpm bench` measures, so the report shows the profiler's own overhead.
    pub plain_step_ns: Option<u64>,
    /// SM clock, power and energy over the pass's steps (plain and recorded; NVML, GPU passes).
    pub power: Option<PowerSummary>,
}

impl Pass {
    /// A measured pass whose time is the sum of its records' durations (kernels serialised, no
    /// wall time): a command's kernels under ncu replay, or a PyTorch profiler table.
    pub fn summed(name: String, records: Vec<KernelRecord>) -> Pass {
        let total: f64 = records.iter().map(|r| r.duration_ns as f64).sum();
        Pass {
            name,
            records,
            step_ns: Some(total.round() as u64),
            measured: true,
            repeats: Vec::new(),
            plain_step_ns: None,
            power: None,
        }
    }
}

/// Everything the report is built from.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Input {
    pub title: String,
    /// The device the passes ran on (backend `describe()`).
    pub device: String,
    /// The device as a GPU of the table, when it is one (enables the prediction check).
    pub device_gpu: Option<Gpu>,
    /// Model / preset / layout description.
    pub config: String,
    pub math: Option<Math>,
    pub passes: Vec<Pass>,
    pub ncu: Option<NcuData>,
    /// Configurations of the optimisation matrix; the first is the baseline.
    pub matrix: Vec<ConfigInput>,
    /// Things that could not be collected, each one line.
    pub not_collected: Vec<String>,
    pub top_n: usize,
}

/// Per-pass results.
#[derive(Clone, Debug, Serialize)]
pub struct PassReport {
    pub name: String,
    pub measured: bool,
    pub breakdown: Breakdown,
    pub predictions: Vec<CategoryPrediction>,
    /// Prediction vs measurement on the device, per category and in total (GPU devices only).
    pub checks: Vec<(String, Check)>,
    /// See [`Pass::plain_step_ns`].
    pub plain_step_ns: Option<u64>,
    /// See [`Pass::power`].
    pub power: Option<PowerSummary>,
    /// Theoretical occupancy of the top kernels (measured GPU passes on a GPU of the table).
    pub occupancy: Vec<OccupancyRow>,
}

/// The theoretical occupancy of a top kernel's longest call, from the registers, shared memory
/// and block size CUPTI recorded for it and the device's SM limits ([`super::occupancy`]).
#[derive(Clone, Debug, Serialize)]
pub struct OccupancyRow {
    pub kernel: String,
    pub registers: u32,
    /// Static + dynamic shared memory per block, bytes.
    pub shared_mem: u32,
    pub threads: u32,
    pub occupancy: Occupancy,
}

/// [`OccupancyRow`]s of the top kernels whose records carry registers and a block size.
fn occupancy_rows(top: &[Row], records: &[KernelRecord], l: SmLimits) -> Vec<OccupancyRow> {
    top.iter()
        .filter_map(|row| {
            let longest = records
                .iter()
                .filter(|r| r.registers.is_some() && r.block.is_some())
                .filter(|r| Some(r.category) == row.category && short_name(&r.name, 100) == row.key)
                .max_by_key(|r| r.duration_ns)?;
            let (regs, smem) = (longest.registers?, longest.shared_mem.unwrap_or(0));
            let threads = longest.block?.iter().product();
            let occupancy = theoretical(l, regs, smem, threads)?;
            Some(OccupancyRow { kernel: row.key.clone(), registers: regs, shared_mem: smem, threads, occupancy })
        })
        .collect()
}

/// One ncu kernel in the report.
#[derive(Clone, Debug, Serialize)]
pub struct NcuRow {
    pub id: u64,
    pub kernel: String,
    pub category: Category,
    pub counters: Counters,
}

/// The computed report (serialised as `report.json`).
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub title: String,
    pub device: String,
    pub config: String,
    pub math: Math,
    pub passes: Vec<PassReport>,
    /// Step times of every recorded repetition per pass (same order as `passes`), ns.
    pub repeats: Vec<Vec<u64>>,
    pub gpus: Vec<Gpu>,
    pub ncu_kernels: Vec<NcuRow>,
    pub priority: Vec<RankedRule>,
    pub matrix: Vec<MatrixRow>,
    pub not_collected: Vec<String>,
}

/// Compute every table of the report.
pub fn build(input: &Input) -> Report {
    let math = input.math.unwrap_or(Math::Fp32);
    let table = gpus::gpus();
    let mut not_collected = input.not_collected.clone();
    let passes = input
        .passes
        .iter()
        .map(|p| {
            let b = breakdown(&p.name, &p.records, p.step_ns, input.top_n.max(1));
            let predictions = gpus::predict(&p.records, &table, math);
            let mut checks = Vec::new();
            if let (Some(g), true) = (&input.device_gpu, p.measured) {
                let (mut tp, mut tm) = (0.0, 0.0);
                for c in &predictions {
                    if c.counted == 0 {
                        continue;
                    }
                    let pred = c.predicted_ns[g.key];
                    tp += pred;
                    tm += c.measured_ns;
                    checks.push((c.category.label().to_string(), check(pred, c.measured_ns, 0.05)));
                }
                checks.push(("all counted categories".into(), check(tp, tm, 0.05)));
            }
            let occupancy = match input.device_gpu.as_ref().and_then(|g| sm_limits(g.arch)) {
                Some(l) if p.measured => occupancy_rows(&b.top, &p.records, l),
                _ => Vec::new(),
            };
            PassReport {
                name: p.name.clone(),
                measured: p.measured,
                breakdown: b,
                predictions,
                checks,
                plain_step_ns: p.plain_step_ns,
                power: p.power.clone(),
                occupancy,
            }
        })
        .collect::<Vec<_>>();
    if input.device_gpu.is_none() && passes.iter().any(|p| p.measured) {
        not_collected.push(format!(
            "prediction check: the profiled device ({}) is not a GPU of the table, so roofline predictions cannot be checked against these measurements",
            input.device
        ));
    }
    let (ncu_kernels, priority) = match &input.ncu {
        Some(n) => (
            n.kernels
                .iter()
                .map(|k| NcuRow { id: k.id, kernel: k.name.clone(), category: k.category, counters: k.counters() })
                .collect(),
            priority_list(&n.kernels),
        ),
        None => (Vec::new(), Vec::new()),
    };
    if let Some(n) = &input.ncu {
        if n.raw_path.is_none() {
            not_collected.push("ncu raw page: not given (counters come from the details page only; SM cycles, tensor pipes, instruction mix and stall reasons need the raw page)".into());
        }
        if n.details_path.is_none() {
            not_collected.push("ncu details page: not given (no guided-analysis rules, no priority list)".into());
        }
    }
    let m = if input.matrix.len() >= 2 { matrix(&input.matrix, 0) } else { Vec::new() };
    Report {
        title: input.title.clone(),
        device: input.device.clone(),
        config: input.config.clone(),
        math,
        repeats: input.passes.iter().map(|p| p.repeats.clone()).collect(),
        passes,
        gpus: table,
        ncu_kernels,
        priority,
        matrix: m,
        not_collected,
    }
}

// ---- formatting ----------------------------------------------------------------------------------

const NC: &str = "not collected";

/// A duration in readable units.
pub fn fmt_ns(ns: f64) -> String {
    let a = ns.abs();
    if a >= 1e9 {
        format!("{:.3} s", ns / 1e9)
    } else if a >= 1e6 {
        format!("{:.3} ms", ns / 1e6)
    } else if a >= 1e3 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

/// A large count with an SI suffix (1.23 G).
pub fn fmt_si(v: f64) -> String {
    let v = v + 0.0; // an empty f64 sum is −0.0: print it as 0
    let a = v.abs();
    let (d, s) = if a >= 1e12 {
        (1e12, " T")
    } else if a >= 1e9 {
        (1e9, " G")
    } else if a >= 1e6 {
        (1e6, " M")
    } else if a >= 1e3 {
        (1e3, " k")
    } else {
        (1.0, "")
    };
    format!("{:.3}{s}", v / d)
}

/// A compact SI label for chart axes: 100G, 2.5M.
fn short_si(v: f64) -> String {
    let s = fmt_si(v);
    let (num, unit) = s.split_once(' ').unwrap_or((&s, ""));
    let num = if num.contains('.') { num.trim_end_matches('0').trim_end_matches('.') } else { num };
    format!("{num}{unit}")
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map(f).unwrap_or_else(|| NC.to_string())
}

fn f2(v: f64) -> String {
    format!("{v:.2}")
}

fn md_escape(s: &str) -> String {
    s.replace('|', "\\|").replace('<', "&lt;").replace('>', "&gt;")
}

fn md_table(out: &mut String, header: &[&str], rows: &[Vec<String>]) {
    let _ = writeln!(out, "| {} |", header.join(" | "));
    let _ = writeln!(out, "|{}", header.iter().map(|_| "---|").collect::<String>());
    for r in rows {
        let _ = writeln!(out, "| {} |", r.join(" | "));
    }
    out.push('\n');
}

fn rows_md(rows: &[Row], measured: bool, with_rate: bool) -> Vec<Vec<String>> {
    rows.iter()
        .map(|r| {
            let mut v = vec![
                md_escape(&r.key),
                r.calls.to_string(),
                if measured { fmt_ns(r.total_ns as f64) } else { "—".into() },
                if measured { format!("{:.1} %", r.pct_of_kernels) } else { "—".into() },
                match (measured, r.pct_of_step) {
                    (true, Some(p)) => format!("{p:.1} %"),
                    _ => "—".into(),
                },
            ];
            if with_rate {
                let dash = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map(f).unwrap_or_else(|| "—".into());
                v.push(dash(r.flops, &fmt_si));
                v.push(dash(r.bytes, &fmt_si));
                v.push(if measured { dash(r.tflops, &|t| format!("{t:.4}")) } else { "—".into() });
                v.push(if measured { dash(r.gbps, &|g| format!("{g:.1}")) } else { "—".into() });
            }
            v
        })
        .collect()
}

/// Rows of the "where the GPU waits" section shown per range.
pub const WAITS_TOP: usize = 15;

/// "1 gap", "3 gaps".
fn gaps(n: usize) -> String {
    format!("{n} gap{}", if n == 1 { "" } else { "s" })
}

fn gap_rows_md(rows: &[GapRow]) -> Vec<Vec<String>> {
    rows.iter()
        .map(|g| {
            vec![
                md_escape(&g.key),
                g.gaps.to_string(),
                fmt_ns(g.total_ns as f64),
                fmt_ns(g.largest_ns as f64),
                format!("{:.1} %", g.pct_of_step),
            ]
        })
        .collect()
}

fn waits_md(o: &mut String, i: &super::breakdown::Idle) {
    let _ = writeln!(o, "### Where the GPU waits\n");
    let _ = writeln!(
        o,
        "Each gap between kernels on the GPU timeline is charged to the kernel that follows it, i.e. to what \
         the GPU was waiting for (its launch, host work before it, a synchronisation): {}, {} in all.\n",
        gaps(i.gaps),
        fmt_ns(i.gaps_ns as f64)
    );
    if i.gaps == 0 {
        return;
    }
    md_table(o, &["phase", "gaps", "idle", "largest gap", "% of step"], &gap_rows_md(&i.by_phase));
    let n = i.by_range.len().min(WAITS_TOP);
    let _ = writeln!(o, "Top {n} of {} ranges by idle time before their kernels:\n", i.by_range.len());
    md_table(o, &["range", "gaps", "idle", "largest gap", "% of step"], &gap_rows_md(&i.by_range[..n]));
}

fn occupancy_md(o: &mut String, rows: &[OccupancyRow]) {
    let _ = writeln!(o, "### Occupancy of the top kernels (theoretical)\n");
    let _ = writeln!(
        o,
        "Resident blocks per SM from each kernel's registers, shared memory and block size (its longest call, \
         as CUPTI recorded them) and the device's SM limits, as CUDA's occupancy calculator computes them. A \
         memory-bound kernel far below 100 % may have too few loads in flight; Nsight Compute's achieved \
         occupancy (`--counters`) is what actually ran.\n"
    );
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                md_escape(&r.kernel),
                r.registers.to_string(),
                if r.shared_mem == 0 { "0".into() } else { format!("{:.1} KiB", r.shared_mem as f64 / 1024.0) },
                r.threads.to_string(),
                r.occupancy.blocks_per_sm.to_string(),
                format!("{:.1} %", r.occupancy.pct),
                r.occupancy.limiter.label().to_string(),
            ]
        })
        .collect();
    md_table(
        o,
        &["kernel", "registers", "shared memory", "threads a block", "blocks per SM", "occupancy", "limited by"],
        &cells,
    );
}

/// The Markdown report.
pub fn markdown(r: &Report) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# meddpm profile — {}\n", r.title);
    let _ = writeln!(o, "- device: {}", r.device);
    let _ = writeln!(o, "- configuration: {}", r.config);
    let _ = writeln!(o, "- convolution/GEMM math for the roofline: {}", r.math.label());
    let _ = writeln!(
        o,
        "\nProvenance: times of profiled passes are **measured** on the device above (wall time between two \
         backend `sync()`s per call, or CUPTI kernel times on a GPU); roofline times are **predicted** from \
         the FLOPs and bytes we count; GPU specifications are **datasheet** values. FLOPs: a multiply-add is 2; \
         bytes: each buffer a call reads or writes counted once (minimum DRAM traffic).\n"
    );
    if !r.passes.is_empty() {
        let _ = writeln!(o, "## Summary\n");
        let rows: Vec<Vec<String>> = r
            .passes
            .iter()
            .zip(&r.repeats)
            .map(|(p, reps)| {
                let b = &p.breakdown;
                // every counted FLOP (rows show a count only when all their calls have one)
                let flops: f64 = p.predictions.iter().map(|c| c.flops).sum();
                let idle = b.idle.as_ref().filter(|_| p.measured);
                vec![
                    md_escape(&p.name),
                    if p.measured { "measured" } else { "counted only" }.into(),
                    b.records.to_string(),
                    match (p.measured, b.step_ns) {
                        (true, Some(s)) => fmt_ns(s as f64),
                        _ => "—".into(),
                    },
                    match (reps.iter().min(), reps.iter().max()) {
                        (Some(lo), Some(hi)) if p.measured => {
                            format!("{} – {} ({} runs)", fmt_ns(*lo as f64), fmt_ns(*hi as f64), reps.len())
                        }
                        _ => "—".into(),
                    },
                    match (p.plain_step_ns, b.step_ns) {
                        (Some(q), Some(s)) => {
                            format!("{} ({:+.1} %)", fmt_ns(q as f64), 100.0 * (s as f64 - q as f64) / q.max(1) as f64)
                        }
                        (Some(q), None) => fmt_ns(q as f64),
                        _ => "—".into(),
                    },
                    if p.measured { fmt_ns(b.kernel_ns as f64) } else { "—".into() },
                    idle.map(|i| fmt_ns(i.gaps_ns as f64)).unwrap_or("—".into()),
                    idle.map(|i| fmt_ns(i.outside_ns as f64)).unwrap_or("—".into()),
                    match (p.measured, b.unattributed_ns()) {
                        (true, Some(u)) if idle.is_none() => fmt_ns(u as f64),
                        _ => "—".into(),
                    },
                    if flops > 0.0 { fmt_si(flops) } else { "—".into() },
                ]
            })
            .collect();
        md_table(
            &mut o,
            &[
                "pass",
                "times",
                "calls",
                "step (wall, median)",
                "min – max of repeats",
                "step without profiler (overhead)",
                "Σ calls",
                "GPU idle (gaps)",
                "outside kernels",
                "step − Σ calls (no timestamps)",
                "FLOPs counted",
            ],
            &rows,
        );
        let _ = writeln!(
            o,
            "GPU idle (gaps): time between kernels on the GPU timeline (launch latency, host work, syncs inside \
             the step); outside kernels: step time before the first kernel starts and after the last one ends. \
             Both need the kernels' GPU start timestamps (CUPTI); for other passes only step − Σ calls is known \
             (host work, launch gaps and per-call syncs together). Step without profiler: the median wall time \
             of the same step repeated with CUPTI off (what `meddpm bench` measures), and how much longer the \
             recorded step took.\n"
        );
        let powered: Vec<_> =
            r.passes.iter().zip(&r.repeats).filter_map(|(p, reps)| Some((p, reps, p.power.as_ref()?))).collect();
        if !powered.is_empty() {
            let _ = writeln!(
                o,
                "Clock and power over each pass's steps, plain and recorded (NVML readings every {} ms):\n",
                super::power::READ_EVERY.as_millis()
            );
            for (p, reps, w) in powered {
                let steps = reps.len() + p.plain_step_ns.map_or(0, |_| reps.len());
                let _ = writeln!(o, "- {}: {}", md_escape(&p.name), w.line(steps));
            }
            let _ = writeln!(
                o,
                "\nUnder a power cap the SM clock falls below its maximum and time follows energy: kernels timed alone \
                 (first-use choices) run at full clock, the same kernels inside a long step may not.\n"
            );
        }
        let _ = writeln!(o, "![category breakdown per pass](breakdown.svg)\n");
    }
    for p in &r.passes {
        let b = &p.breakdown;
        let _ = writeln!(o, "## {}\n", p.name);
        if !p.measured {
            let _ = writeln!(o, "Counted on the null backend: call counts, FLOPs and bytes only (no times).\n");
        }
        let _ = writeln!(
            o,
            "FLOPs are counted for convolutions, linears and attention matmuls only, bytes for the calls we count \
             (CUPTI kernels have neither, only copies and fills carry bytes). A row shows FLOPs and TFLOP/s only \
             when every call in it has a FLOP count, bytes and GB/s only when every call has a byte count \
             (\"—\" otherwise, e.g. a row with an elementwise op); TFLOP/s and GB/s divide by the row's measured \
             time.\n"
        );
        let _ = writeln!(o, "### By category\n");
        let mut rows = rows_md(&b.by_category, p.measured, true);
        let idle_rows = if p.measured { b.idle_rows() } else { Vec::new() };
        if !idle_rows.is_empty() {
            for x in &idle_rows {
                rows.push(vec![
                    x.key.clone(),
                    x.count.map(gaps).unwrap_or("—".into()),
                    fmt_ns(x.ns as f64),
                    "—".into(),
                    format!("{:.1} %", x.pct_of_step),
                    String::new(),
                    String::new(),
                    String::new(),
                    String::new(),
                ]);
            }
            rows.push(vec![
                "**step**".into(),
                b.records.to_string(),
                b.step_ns.map(|s| fmt_ns(s as f64)).unwrap_or("—".into()),
                "—".into(),
                "100.0 %".into(),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
            ]);
        } else if p.measured {
            rows.push(vec![
                "**total**".into(),
                b.records.to_string(),
                fmt_ns(b.kernel_ns as f64),
                "100.0 %".into(),
                b.step_ns
                    .map(|s| format!("{:.1} %", 100.0 * b.kernel_ns as f64 / s.max(1) as f64))
                    .unwrap_or("—".into()),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
            ]);
        }
        md_table(
            &mut o,
            &["category", "calls", "time", "% of calls", "% of step", "FLOPs", "bytes", "TFLOP/s", "GB/s"],
            &rows,
        );
        if let (Some(i), true) = (&b.idle, p.measured) {
            let _ = writeln!(
                o,
                "GPU timeline (CUPTI start timestamps): busy {} (union of kernel intervals), span {} (first kernel \
                 start to last kernel end), gaps {} in {}, outside {}{}.\n",
                fmt_ns(i.busy_ns as f64),
                fmt_ns(i.span_ns as f64),
                fmt_ns(i.gaps_ns as f64),
                gaps(i.gaps),
                fmt_ns(i.outside_ns as f64),
                if i.overlap_ns > 0 {
                    format!(
                        "; kernels overlapped for {} (Σ kernel time exceeds busy by that)",
                        fmt_ns(i.overlap_ns as f64)
                    )
                } else {
                    String::new()
                }
            );
        }
        if let Some(c) = &b.comm {
            let _ = writeln!(o, "{}\n", comm_line(c));
        }
        let _ = writeln!(o, "### By phase\n");
        md_table(
            &mut o,
            &["phase", "calls", "time", "% of calls", "% of step"],
            &rows_md(&b.by_phase, p.measured, false),
        );
        let _ = writeln!(o, "### By block (U-Net module)\n");
        md_table(
            &mut o,
            &["block", "calls", "time", "% of calls", "% of step", "FLOPs", "bytes", "TFLOP/s", "GB/s"],
            &rows_md(&b.by_block, p.measured, true),
        );
        if let (Some(i), true) = (&b.idle, p.measured) {
            waits_md(&mut o, i);
        }
        let _ = writeln!(o, "### Top {} kernels / ops\n", b.top.len());
        let rows: Vec<Vec<String>> = b
            .top
            .iter()
            .zip(rows_md(&b.top, p.measured, true))
            .map(|(r, mut v)| {
                v.insert(1, r.category.map(|c| c.label().to_string()).unwrap_or_default());
                v
            })
            .collect();
        md_table(
            &mut o,
            &["kernel", "category", "calls", "time", "% of calls", "% of step", "FLOPs", "bytes", "TFLOP/s", "GB/s"],
            &rows,
        );
        if !p.occupancy.is_empty() {
            occupancy_md(&mut o, &p.occupancy);
        }
    }
    // ---- roofline ----
    if !r.passes.is_empty() {
        let _ = writeln!(o, "## Across GPUs: roofline predictions (predicted)\n");
        let _ = writeln!(
            o,
            "Each call is bounded by max(FLOPs / peak, bytes / bandwidth) on each GPU ({} math for convolutions and \
             GEMMs, FP32 for the rest), then summed per category. These are lower bounds: real kernels reach a \
             fraction of them.\n",
            r.math.label()
        );
        for p in &r.passes {
            let _ = writeln!(o, "### {}\n", p.name);
            if !has_counts(p) {
                let _ = writeln!(
                    o,
                    "No roofline: the records of this pass carry no FLOP counts (e.g. CUPTI kernel records); \
                     see the counted pass of the same step.\n"
                );
                continue;
            }
            let mut header: Vec<String> =
                vec!["category".into(), "FLOPs".into(), "bytes".into(), "counted calls".into()];
            if p.measured {
                header.push("measured here".into());
            }
            header.extend(r.gpus.iter().map(|g| format!("{} (pred.)", g.key)));
            let mut rows = Vec::new();
            let mut totals = vec![0.0; r.gpus.len()];
            for c in &p.predictions {
                let mut v = vec![
                    c.category.label().to_string(),
                    fmt_si(c.flops),
                    fmt_si(c.bytes),
                    format!("{}/{}", c.counted, c.records),
                ];
                if p.measured {
                    v.push(fmt_ns(c.measured_ns));
                }
                for (i, g) in r.gpus.iter().enumerate() {
                    let t = c.predicted_ns[g.key];
                    totals[i] += t;
                    v.push(fmt_ns(t));
                }
                rows.push(v);
            }
            let mut v = vec!["**total**".into(), String::new(), String::new(), String::new()];
            if p.measured {
                v.push(fmt_ns(p.predictions.iter().map(|c| c.measured_ns).sum()));
            }
            v.extend(totals.iter().map(|&t| fmt_ns(t)));
            rows.push(v);
            let h: Vec<&str> = header.iter().map(|s| s.as_str()).collect();
            md_table(&mut o, &h, &rows);
            if !p.checks.is_empty() {
                let _ = writeln!(
                    o,
                    "Check on the device it ran on (measured vs predicted; a roofline is a lower bound):\n"
                );
                let rows: Vec<Vec<String>> = p
                    .checks
                    .iter()
                    .map(|(k, c)| {
                        vec![
                            k.clone(),
                            fmt_ns(c.predicted_ns),
                            fmt_ns(c.measured_ns),
                            format!("{:.1} %", 100.0 * c.efficiency),
                            match c.verdict {
                                Verdict::Consistent => "consistent".into(),
                                Verdict::FasterThanRoofline => {
                                    "**faster than the roofline: count or table wrong**".into()
                                }
                                Verdict::NotComparable => "not comparable".into(),
                            },
                        ]
                    })
                    .collect();
                md_table(&mut o, &["category", "predicted", "measured", "of roofline", "verdict"], &rows);
            }
        }
        let _ = writeln!(o, "![roofline](roofline.svg)\n");
    }
    let _ = writeln!(o, "## GPU table (datasheet)\n");
    let rows: Vec<Vec<String>> = r
        .gpus
        .iter()
        .map(|g| {
            vec![
                g.name.to_string(),
                g.arch.to_string(),
                g.sms.map(|s| s.to_string()).unwrap_or("n/a".into()),
                g.boost_mhz.map(|s| s.to_string()).unwrap_or("n/a".into()),
                format!("{}", g.fp32_tflops),
                g.tf32_tflops.map(|v| v.to_string()).unwrap_or("—".into()),
                g.bf16_tflops.map(|v| v.to_string()).unwrap_or("—".into()),
                format!("{}", g.mem_gbps),
                g.l2_mib.map(|v| v.to_string()).unwrap_or("n/a".into()),
                g.source.to_string(),
            ]
        })
        .collect();
    md_table(
        &mut o,
        &[
            "GPU",
            "arch",
            "SMs",
            "boost MHz",
            "FP32 TFLOP/s",
            "TF32 dense",
            "BF16 dense",
            "memory GB/s",
            "L2 MiB",
            "source",
        ],
        &rows,
    );
    // ---- ncu ----
    let _ = writeln!(o, "## Hardware counters (Nsight Compute)\n");
    if r.ncu_kernels.is_empty() {
        let _ = writeln!(
            o,
            "{NC}: no Nsight Compute export was given (`--ncu-csv raw.csv [--ncu-details details.csv]`).\n"
        );
    } else {
        ncu_sections(&mut o, r);
    }
    // ---- matrix ----
    let _ = writeln!(o, "## Optimization matrix\n");
    if r.matrix.is_empty() {
        let _ = writeln!(o, "{NC}: needs at least two configurations (the first is the baseline).\n");
    } else {
        let rows: Vec<Vec<String>> = r
            .matrix
            .iter()
            .map(|m| {
                let c = &m.input;
                let rt = |v: Option<f64>| v.map(|x| format!(" ({x:.3}×)")).unwrap_or_default();
                vec![
                    format!("{}{}", md_escape(&c.name), if m.is_baseline { " (baseline)" } else { "" }),
                    format!("{}{}", opt(c.time_ns, fmt_ns), rt(m.ratios.time)),
                    format!("{}{}", opt(c.sm_cycles, fmt_si), rt(m.ratios.sm_cycles)),
                    format!("{}{}", opt(c.instructions, fmt_si), rt(m.ratios.instructions)),
                    format!("{}{}", opt(c.tensor_pct, |t| format!("{t:.2} %")), rt(m.ratios.tensor)),
                    format!("{}{}", opt(c.ipc, f2), rt(m.ratios.ipc)),
                ]
            })
            .collect();
        md_table(&mut o, &["configuration", "time", "SM cycles", "instructions", "tensor pipe", "IPC"], &rows);
        let _ = writeln!(o, "Ratios are configuration / baseline (0.010× = a hundred times fewer).\n");
        matrix_by_category(&mut o, &r.matrix);
    }
    let _ = writeln!(o, "## Not collected\n");
    if r.not_collected.is_empty() {
        let _ = writeln!(o, "Everything requested was collected.");
    } else {
        for n in &r.not_collected {
            let _ = writeln!(o, "- {n}");
        }
    }
    o
}

fn ncu_sections(o: &mut String, r: &Report) {
    let ks = &r.ncu_kernels;
    let _ = writeln!(o, "### Per kernel\n");
    let rows: Vec<Vec<String>> = ks
        .iter()
        .map(|k| {
            let c = &k.counters;
            vec![
                k.id.to_string(),
                md_escape(&short_name(&k.kernel, 60)),
                k.category.label().to_string(),
                opt(c.duration_ns, fmt_ns),
                opt(c.sm_cycles_elapsed, fmt_si),
                opt(c.instructions, fmt_si),
                opt(c.ipc, f2),
                opt(c.tensor_pipe_pct, f2),
                opt(c.tensor_hmma_pct, f2),
                opt(c.tensor_gmma_inst_pct, f2),
                opt(c.achieved_occupancy_pct, |v| format!("{v:.1}")),
                opt(c.registers, |v| format!("{v:.0}")),
            ]
        })
        .collect();
    md_table(
        o,
        &[
            "ID",
            "kernel",
            "category",
            "time",
            "SM cycles",
            "warp inst.",
            "IPC",
            "tensor %",
            "hmma pipe %",
            "gmma inst. %",
            "occupancy %",
            "regs",
        ],
        &rows,
    );
    let _ = writeln!(o, "### Memory system\n");
    let rows: Vec<Vec<String>> = ks
        .iter()
        .map(|k| {
            let c = &k.counters;
            vec![
                k.id.to_string(),
                opt(c.dram_read_bytes, fmt_si),
                opt(c.dram_write_bytes, fmt_si),
                opt(c.dram_pct, f2),
                opt(c.l2_pct, f2),
                opt(c.l1_pct, f2),
                opt(c.l2_hit_pct, f2),
                opt(c.l1_hit_pct, f2),
                opt(c.sm_pct, f2),
                opt(c.memory_pct, f2),
            ]
        })
        .collect();
    md_table(
        o,
        &[
            "ID",
            "DRAM read B",
            "DRAM write B",
            "DRAM %",
            "L2 %",
            "L1 %",
            "L2 hit %",
            "L1 hit %",
            "SM SOL %",
            "memory SOL %",
        ],
        &rows,
    );
    let _ = writeln!(o, "### Instruction mix and pipes\n");
    let rows: Vec<Vec<String>> = ks
        .iter()
        .map(|k| {
            let c = &k.counters;
            let mut mix: Vec<(&String, &f64)> = c.inst_mix.iter().filter(|(_, v)| **v > 0.0).collect();
            mix.sort_by(|a, b| b.1.total_cmp(a.1));
            let mut pipes: Vec<(&String, &f64)> = c.pipes.iter().filter(|(_, v)| **v > 0.0).collect();
            pipes.sort_by(|a, b| b.1.total_cmp(a.1));
            let fmt_list = |v: &[(&String, &f64)], f: &dyn Fn(f64) -> String| {
                if v.is_empty() {
                    NC.to_string()
                } else {
                    v.iter().take(6).map(|(k, x)| format!("{k} {}", f(**x))).collect::<Vec<_>>().join(", ")
                }
            };
            vec![
                k.id.to_string(),
                fmt_list(&mix, &|x| fmt_si(x).replace(' ', "")),
                fmt_list(&pipes, &|x| format!("{x:.1}%")),
            ]
        })
        .collect();
    md_table(o, &["ID", "executed instructions by opcode class (top 6)", "pipe utilisation (top 6)"], &rows);
    let _ = writeln!(o, "### Warp stalls (warps stalled per issued instruction)\n");
    let rows: Vec<Vec<String>> = ks
        .iter()
        .map(|k| {
            let c = &k.counters;
            let mut st: Vec<(&String, &f64)> =
                c.stalls.iter().filter(|(n, v)| **v > 0.0 && n.as_str() != "selected").collect();
            st.sort_by(|a, b| b.1.total_cmp(a.1));
            vec![
                k.id.to_string(),
                opt(c.warp_cycles_per_inst, f2),
                if st.is_empty() {
                    NC.to_string()
                } else {
                    st.iter().take(5).map(|(n, v)| format!("{n} {v:.2}")).collect::<Vec<_>>().join(", ")
                },
            ]
        })
        .collect();
    md_table(o, &["ID", "cycles per issued inst.", "top stall reasons"], &rows);
    let _ = writeln!(o, "### Priority list (guided-analysis OPT rules ranked by estimated time saved)\n");
    if r.priority.is_empty() {
        let _ = writeln!(
            o,
            "{NC}: the details page (with rule results) was not given or has no OPT rule with a speedup.\n"
        );
    } else {
        let total: f64 = ks.iter().filter_map(|k| k.counters.duration_ns).sum();
        let rows: Vec<Vec<String>> = r
            .priority
            .iter()
            .take(25)
            .map(|p| {
                vec![
                    p.rank.to_string(),
                    p.rule.clone(),
                    format!("{} {}", p.kernel_id, md_escape(&short_name(&p.kernel, 50))),
                    p.speedup_type.clone().unwrap_or_default(),
                    format!("{:.2} %", p.speedup_pct),
                    opt(p.est_saved_ns, fmt_ns),
                    match p.est_saved_ns {
                        Some(s) if total > 0.0 => format!("{:.2} %", 100.0 * s / total),
                        _ => "—".into(),
                    },
                    md_escape(&p.description.chars().take(110).collect::<String>()),
                ]
            })
            .collect();
        md_table(
            o,
            &["rank", "rule", "kernel", "type", "est. speedup", "est. saved", "% of profiled time", "finding"],
            &rows,
        );
    }
}

// ---- CSV -----------------------------------------------------------------------------------------

fn o2s(v: Option<f64>) -> String {
    v.map(|x| format!("{x}")).unwrap_or_default()
}

/// CSV files: name → content.
pub fn csv_files(r: &Report, input: &Input) -> Vec<(&'static str, String)> {
    let mut files = Vec::new();
    let mut s = csv::line(&[
        "pass",
        "name",
        "category",
        "duration_ns",
        "range",
        "flops",
        "bytes",
        "grid",
        "block",
        "registers",
        "shared_mem",
        "start_ns",
    ]);
    for p in input.passes.iter().filter(|p| p.measured) {
        for k in &p.records {
            let dims = |d: Option<[u32; 3]>| d.map(|d| format!("{}x{}x{}", d[0], d[1], d[2])).unwrap_or_default();
            s += &csv::line(&[
                p.name.clone(),
                k.name.clone(),
                k.category.label().to_string(),
                if p.measured { k.duration_ns.to_string() } else { String::new() },
                k.range.clone().unwrap_or_default(),
                o2s(k.flops),
                o2s(k.bytes),
                dims(k.grid),
                dims(k.block),
                k.registers.map(|v| v.to_string()).unwrap_or_default(),
                k.shared_mem.map(|v| v.to_string()).unwrap_or_default(),
                k.start_ns.map(|v| v.to_string()).unwrap_or_default(),
            ]);
        }
    }
    files.push(("kernels.csv", s));
    let mut s = csv::line(&[
        "pass",
        "table",
        "key",
        "category",
        "calls",
        "total_ns",
        "pct_of_calls",
        "pct_of_step",
        "flops",
        "bytes",
        "tflops",
        "gbps",
        "largest_ns",
    ]);
    for p in &r.passes {
        let b = &p.breakdown;
        for (t, rows) in [("category", &b.by_category), ("phase", &b.by_phase), ("block", &b.by_block), ("top", &b.top)]
        {
            for row in rows {
                s += &csv::line(&[
                    p.name.clone(),
                    t.to_string(),
                    row.key.clone(),
                    row.category.map(|c| c.label().to_string()).unwrap_or_default(),
                    row.calls.to_string(),
                    if p.measured { row.total_ns.to_string() } else { String::new() },
                    if p.measured { format!("{:.4}", row.pct_of_kernels) } else { String::new() },
                    if p.measured { o2s(row.pct_of_step) } else { String::new() },
                    o2s(row.flops),
                    o2s(row.bytes),
                    if p.measured { o2s(row.tflops) } else { String::new() },
                    if p.measured { o2s(row.gbps) } else { String::new() },
                    String::new(),
                ]);
            }
        }
        // GPU idle (passes with timestamps): table "idle" holds the step rows below the categories
        // (signed: corrections are negative; calls = number of gaps), "idle_phase" / "idle_range"
        // the gaps charged to the phase / range of the kernel that follows each gap
        let Some(i) = b.idle.as_ref().filter(|_| p.measured) else { continue };
        let empty = || vec![String::new(); 4];
        for x in b.idle_rows() {
            let mut v = vec![
                p.name.clone(),
                "idle".into(),
                x.key.clone(),
                String::new(),
                x.count.map(|c| c.to_string()).unwrap_or_default(),
                x.ns.to_string(),
                String::new(),
                x.pct_of_step.to_string(),
            ];
            v.extend(empty());
            v.push(String::new());
            s += &csv::line(&v);
        }
        for (t, rows) in [("idle_phase", &i.by_phase), ("idle_range", &i.by_range)] {
            for g in rows {
                let mut v = vec![
                    p.name.clone(),
                    t.to_string(),
                    g.key.clone(),
                    String::new(),
                    g.gaps.to_string(),
                    g.total_ns.to_string(),
                    String::new(),
                    g.pct_of_step.to_string(),
                ];
                v.extend(empty());
                v.push(g.largest_ns.to_string());
                s += &csv::line(&v);
            }
        }
    }
    files.push(("breakdown.csv", s));
    let mut h = vec!["pass".to_string(), "category".into(), "flops".into(), "bytes".into(), "measured_ns".into()];
    h.extend(r.gpus.iter().map(|g| format!("predicted_ns_{}", g.key)));
    let mut s = csv::line(&h);
    for p in &r.passes {
        for c in &p.predictions {
            let mut v = vec![
                p.name.clone(),
                c.category.label().to_string(),
                format!("{}", c.flops),
                format!("{}", c.bytes),
                if p.measured { format!("{}", c.measured_ns) } else { String::new() },
            ];
            v.extend(r.gpus.iter().map(|g| format!("{:.1}", c.predicted_ns[g.key])));
            s += &csv::line(&v);
        }
    }
    files.push(("roofline.csv", s));
    let mut s = csv::line(&[
        "key",
        "name",
        "arch",
        "sms",
        "boost_mhz",
        "fp32_tflops",
        "tf32_tflops",
        "bf16_tflops",
        "fp16_tflops",
        "mem_gbps",
        "l2_mib",
        "source",
    ]);
    for g in &r.gpus {
        s += &csv::line(&[
            g.key.to_string(),
            g.name.to_string(),
            g.arch.to_string(),
            g.sms.map(|v| v.to_string()).unwrap_or_default(),
            g.boost_mhz.map(|v| v.to_string()).unwrap_or_default(),
            g.fp32_tflops.to_string(),
            o2s(g.tf32_tflops),
            o2s(g.bf16_tflops),
            o2s(g.fp16_tflops),
            g.mem_gbps.to_string(),
            o2s(g.l2_mib),
            g.source.to_string(),
        ]);
    }
    files.push(("gpus.csv", s));
    if !r.ncu_kernels.is_empty() {
        let mut s = csv::line(&[
            "id",
            "kernel",
            "category",
            "duration_ns",
            "sm_cycles_elapsed",
            "sm_cycles_active",
            "instructions",
            "ipc",
            "issue_active_pct",
            "tensor_pipe_pct",
            "tensor_hmma_pct",
            "tensor_gmma_inst_pct",
            "tensor_ops",
            "dram_read_bytes",
            "dram_write_bytes",
            "dram_pct",
            "l2_pct",
            "l1_pct",
            "l2_hit_pct",
            "l1_hit_pct",
            "sm_pct",
            "memory_pct",
            "achieved_occupancy_pct",
            "theoretical_occupancy_pct",
            "registers",
            "waves_per_sm",
            "warp_cycles_per_inst",
        ]);
        for k in &r.ncu_kernels {
            let c = &k.counters;
            s += &csv::line(&[
                k.id.to_string(),
                k.kernel.clone(),
                k.category.label().to_string(),
                o2s(c.duration_ns),
                o2s(c.sm_cycles_elapsed),
                o2s(c.sm_cycles_active),
                o2s(c.instructions),
                o2s(c.ipc),
                o2s(c.issue_active_pct),
                o2s(c.tensor_pipe_pct),
                o2s(c.tensor_hmma_pct),
                o2s(c.tensor_gmma_inst_pct),
                o2s(c.tensor_ops),
                o2s(c.dram_read_bytes),
                o2s(c.dram_write_bytes),
                o2s(c.dram_pct),
                o2s(c.l2_pct),
                o2s(c.l1_pct),
                o2s(c.l2_hit_pct),
                o2s(c.l1_hit_pct),
                o2s(c.sm_pct),
                o2s(c.memory_pct),
                o2s(c.achieved_occupancy_pct),
                o2s(c.theoretical_occupancy_pct),
                o2s(c.registers),
                o2s(c.waves_per_sm),
                o2s(c.warp_cycles_per_inst),
            ]);
        }
        files.push(("ncu_kernels.csv", s));
        let mut s = csv::line(&[
            "rank",
            "rule",
            "kernel_id",
            "kernel",
            "speedup_type",
            "speedup_pct",
            "kernel_ns",
            "est_saved_ns",
            "description",
        ]);
        for p in &r.priority {
            s += &csv::line(&[
                p.rank.to_string(),
                p.rule.clone(),
                p.kernel_id.to_string(),
                p.kernel.clone(),
                p.speedup_type.clone().unwrap_or_default(),
                p.speedup_pct.to_string(),
                o2s(p.kernel_ns),
                o2s(p.est_saved_ns),
                p.description.clone(),
            ]);
        }
        files.push(("ncu_priority.csv", s));
    }
    if !r.matrix.is_empty() {
        let mut s = csv::line(&[
            "configuration",
            "baseline",
            "time_ns",
            "sm_cycles",
            "instructions",
            "tensor_pct",
            "ipc",
            "ratio_time",
            "ratio_sm_cycles",
            "ratio_instructions",
            "ratio_tensor",
            "ratio_ipc",
        ]);
        for m in &r.matrix {
            let c = &m.input;
            s += &csv::line(&[
                c.name.clone(),
                m.is_baseline.to_string(),
                o2s(c.time_ns),
                o2s(c.sm_cycles),
                o2s(c.instructions),
                o2s(c.tensor_pct),
                o2s(c.ipc),
                o2s(m.ratios.time),
                o2s(m.ratios.sm_cycles),
                o2s(m.ratios.instructions),
                o2s(m.ratios.tensor),
                o2s(m.ratios.ipc),
            ]);
        }
        files.push(("matrix.csv", s));
        if r.matrix.iter().any(|m| !m.input.by_category.is_empty()) {
            let mut s = csv::line(&["configuration", "category", "time_ns"]);
            for m in &r.matrix {
                for (c, ns) in &m.input.by_category {
                    s += &csv::line(&[m.input.name.clone(), c.label().to_string(), format!("{ns}")]);
                }
            }
            files.push(("matrix_categories.csv", s));
        }
    }
    files
}

// ---- SVG -----------------------------------------------------------------------------------------

fn color(c: Category) -> plotters::style::RGBColor {
    use plotters::style::RGBColor;
    match c {
        Category::ConvForward => RGBColor(31, 119, 180),
        Category::ConvDgrad => RGBColor(174, 199, 232),
        Category::ConvWgrad => RGBColor(255, 127, 14),
        Category::ConvBackward => RGBColor(255, 187, 120),
        Category::Layout => RGBColor(214, 39, 40),
        Category::Normalization => RGBColor(44, 160, 44),
        Category::Elementwise => RGBColor(148, 103, 189),
        Category::GemmAttention => RGBColor(140, 86, 75),
        Category::Reduction => RGBColor(227, 119, 194),
        Category::Optimizer => RGBColor(188, 189, 34),
        Category::Memory => RGBColor(127, 127, 127),
        Category::Collective => RGBColor(255, 215, 0),
        Category::Other => RGBColor(23, 190, 207),
    }
}

fn plot_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::format(path, format!("could not draw the chart: {e}"))
}

/// The segment on top of a pass's category bars that brings the bar to the step time: step − Σ
/// calls, ns (0 when the calls exceed the step), and whether it is measured GPU idle time (the
/// pass has timestamps: gaps + outside kernels, less any kernel overlap) or only the
/// unattributed rest of a pass without timestamps. `None` without a step time.
fn rest_segment(b: &Breakdown) -> Option<(u64, bool)> {
    b.step_ns.map(|s| (s.saturating_sub(b.kernel_ns), b.idle.is_some()))
}

/// One stacked bar: time by category (ms), optionally topped by the rest of the step (ms, and
/// whether it is measured GPU idle time, see [`rest_segment`]).
struct Bar {
    name: String,
    segments: Vec<(Category, f64)>,
    rest: Option<(f64, bool)>,
}

/// Stacked category breakdown, one bar per measured pass (ms), topped by the rest of the step
/// (GPU idle for passes with timestamps, step − Σ calls for others) so that bars reach the step.
pub fn breakdown_svg(r: &Report, path: &Path) -> Result<bool> {
    let bars: Vec<Bar> = r
        .passes
        .iter()
        .filter(|p| p.measured && p.breakdown.kernel_ns > 0)
        .map(|p| Bar {
            name: p.name.clone(),
            segments: p
                .breakdown
                .by_category
                .iter()
                .filter_map(|row| Some((row.category?, row.total_ns as f64 / 1e6)))
                .collect(),
            rest: rest_segment(&p.breakdown).map(|(ns, idle)| (ns as f64 / 1e6, idle)),
        })
        .collect();
    stacked_svg(&bars, &format!("Time by category — {}", r.title), "ms (measured)", path)
}

/// Stacked category breakdown of the optimisation matrix, one bar per configuration (ms).
pub fn matrix_svg(r: &Report, path: &Path) -> Result<bool> {
    let bars: Vec<Bar> = r
        .matrix
        .iter()
        .filter(|m| !m.input.by_category.is_empty())
        .map(|m| Bar {
            name: m.input.name.clone(),
            segments: m.input.by_category.iter().map(|(c, ns)| (*c, ns / 1e6)).collect(),
            rest: None,
        })
        .collect();
    stacked_svg(&bars, "Optimization matrix: kernel time by category", "ms (measured)", path)
}

/// A legend drawn as its own panel (swatch and text per entry), beside a chart rather than over it.
fn legend_panel<DB: plotters::prelude::DrawingBackend>(
    area: &plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    entries: &[(String, plotters::style::RGBColor)],
    path: &Path,
) -> Result<()> {
    use plotters::prelude::*;
    for (i, (label, c)) in entries.iter().enumerate() {
        let y = 50 + 20 * i as i32;
        area.draw(&Rectangle::new([(6, y), (18, y + 12)], c.filled())).map_err(|e| plot_err(path, e))?;
        area.draw(&Text::new(label.clone(), (24, y), ("sans-serif", 13))).map_err(|e| plot_err(path, e))?;
    }
    Ok(())
}

/// Stacked bars, one per entry of `bars`, filling the x axis (no empty slots), names under the
/// bars, the legend in a panel on the right.
fn stacked_svg(bars: &[Bar], caption: &str, y_desc: &str, path: &Path) -> Result<bool> {
    use plotters::prelude::*;
    use plotters::style::text_anchor::{HPos, Pos, VPos};
    if bars.is_empty() {
        return Ok(false);
    }
    let total = |b: &Bar| b.segments.iter().map(|s| s.1).sum::<f64>();
    let ymax = bars.iter().map(|b| total(b) + b.rest.map_or(0.0, |r| r.0)).fold(0.0, f64::max) * 1.05;
    let n = bars.len();
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
    let root = root.titled(caption, ("sans-serif", 18)).map_err(|e| plot_err(path, e))?;
    let (left, right) = root.split_horizontally(640);
    let mut chart = ChartBuilder::on(&left)
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..n as f64, 0f64..ymax.max(1e-9))
        .map_err(|e| plot_err(path, e))?;
    chart.configure_mesh().disable_x_mesh().x_labels(0).y_desc(y_desc).draw().map_err(|e| plot_err(path, e))?;
    // Bar i spans [i + 0.1, i + 0.9]; its name is centred under it.
    let bar = |i: usize, y0: f64, y1: f64| [(i as f64 + 0.1, y0), (i as f64 + 0.9, y1)];
    for (i, b) in bars.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(i as f64 + 0.5, 0.0));
        let style = TextStyle::from(("sans-serif", 13).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
        left.draw(&Text::new(b.name.clone(), (x, y + 6), style)).map_err(|e| plot_err(path, e))?;
    }
    let mut legend: Vec<(String, RGBColor)> = Vec::new();
    for cat in Category::ALL {
        let mut rects = Vec::new();
        for (i, b) in bars.iter().enumerate() {
            let mut y0 = 0.0;
            for &(c, t) in &b.segments {
                if c == cat {
                    rects.push(Rectangle::new(bar(i, y0, y0 + t), color(cat).filled()));
                }
                y0 += t;
            }
        }
        if !rects.is_empty() {
            chart.draw_series(rects).map_err(|e| plot_err(path, e))?;
            legend.push((cat.label().to_string(), color(cat)));
        }
    }
    for (measured_idle, label, c) in [
        (true, "GPU idle (gaps + outside kernels)", RGBColor(220, 220, 220)),
        (false, "step − Σ calls (no timestamps)", RGBColor(255, 235, 170)),
    ] {
        let rects: Vec<_> = bars
            .iter()
            .enumerate()
            .filter_map(|(i, b)| {
                let (ms, is_idle) = b.rest?;
                (is_idle == measured_idle && ms > 0.0)
                    .then(|| Rectangle::new(bar(i, total(b), total(b) + ms), c.filled()))
            })
            .collect();
        if !rects.is_empty() {
            chart.draw_series(rects).map_err(|e| plot_err(path, e))?;
            legend.push((label.to_string(), c));
        }
    }
    legend_panel(&right, &legend, path)?;
    root.present().map_err(|e| plot_err(path, e))?;
    Ok(true)
}

/// One compute roof of a roofline: what it is for, and its peak (FLOP/s).
#[derive(Clone, Debug, PartialEq)]
pub struct Roof {
    pub label: String,
    pub flops: f64,
}

/// The compute roofs of `g`: FP32 (all non-matrix work), then the convolution/GEMM roof of each
/// math in `maths` (tensor cores: TF32, BF16, …), in order, each listed once; a math without
/// tensor cores on this GPU falls back to a roof already listed and adds none.
pub fn roofs(g: &Gpu, maths: &[Math]) -> Vec<Roof> {
    let mut out = vec![Roof { label: "FP32".into(), flops: g.fp32_tflops * 1e12 }];
    for &m in maths {
        let flops = g.peak_tflops(Category::ConvForward, m) * 1e12;
        if out.iter().all(|r| r.flops != flops) {
            out.push(Roof { label: format!("{} conv/GEMM", m.label().to_uppercase()), flops });
        }
    }
    out
}

/// Line colour and dash of the i-th roof: solid black, then dashed blue, dotted orange, ….
fn roof_style(i: usize) -> (plotters::style::RGBColor, Option<(u32, u32)>) {
    use plotters::style::RGBColor;
    const STYLES: [(RGBColor, Option<(u32, u32)>); 4] = [
        (RGBColor(0, 0, 0), None),
        (RGBColor(31, 90, 200), Some((10, 5))),
        (RGBColor(220, 100, 0), Some((3, 4))),
        (RGBColor(120, 40, 160), Some((14, 4))),
    ];
    STYLES[i % STYLES.len()]
}

/// Records with counted FLOPs and bytes placed on a roofline (log-log): arithmetic intensity vs
/// achieved FLOP/s. When the device is a GPU of the table its roofs ([`roofs`]) are drawn, each
/// in its own line style with its ridge point labelled; the axes span the points and the ridges.
pub fn roofline_svg(r: &Report, input: &Input, path: &Path) -> Result<bool> {
    use plotters::prelude::*;
    use plotters::style::text_anchor::{HPos, Pos, VPos};
    let mut pts: BTreeMap<Category, Vec<(f64, f64)>> = BTreeMap::new();
    for p in input.passes.iter().filter(|p| p.measured) {
        for k in &p.records {
            if let (Some(f), Some(b)) = (k.flops, k.bytes) {
                if f > 0.0 && b > 0.0 && k.duration_ns > 0 {
                    pts.entry(k.category).or_default().push((f / b, f / k.duration_ns as f64 * 1e9));
                }
            }
        }
    }
    if pts.is_empty() {
        return Ok(false);
    }
    let g = &input.device_gpu;
    let roof_list = g.as_ref().map(|g| roofs(g, &[r.math])).unwrap_or_default();
    let bw = g.as_ref().map_or(1.0, |g| g.mem_gbps * 1e9);
    let xs: Vec<f64> = pts.values().flatten().map(|p| p.0).chain(roof_list.iter().map(|rf| rf.flops / bw)).collect();
    let ys: Vec<f64> = pts.values().flatten().map(|p| p.1).chain(roof_list.iter().map(|rf| rf.flops)).collect();
    let span = |v: &[f64]| v.iter().fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    let ((xmin, xmax), (ymin, ymax)) = (span(&xs), span(&ys));
    // Room right of the highest ridge for its label, above the highest roof.
    let ridge_max = roof_list.iter().map(|rf| rf.flops / bw).fold(0.0, f64::max);
    let (xmin, xmax, ymin, ymax) = (xmin / 2.0, (xmax * 2.0).max(ridge_max * 8.0), ymin / 2.0, ymax * 3.0);
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
    let caption = match g {
        Some(g) => format!("Roofline — {} ({} datasheet roofs)", r.title, g.name),
        None => format!("Achieved FLOP/s vs intensity — {} (no roof: device not in the GPU table)", r.title),
    };
    let root = root.titled(&caption, ("sans-serif", 16)).map_err(|e| plot_err(path, e))?;
    let (left, right) = root.split_horizontally(660);
    let mut chart = ChartBuilder::on(&left)
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d((xmin..xmax).log_scale(), (ymin..ymax).log_scale())
        .map_err(|e| plot_err(path, e))?;
    chart
        .configure_mesh()
        .x_desc("arithmetic intensity, FLOP/byte (counted)")
        .y_desc("achieved FLOP/s (measured)")
        .y_label_formatter(&|y| short_si(*y))
        .draw()
        .map_err(|e| plot_err(path, e))?;
    let mut legend: Vec<(String, RGBColor)> = Vec::new();
    for (i, roof) in roof_list.iter().enumerate() {
        let ridge = roof.flops / bw;
        let line = vec![(xmin, xmin * bw), (ridge, roof.flops), (xmax, roof.flops)];
        let (c, dash) = roof_style(i);
        let style = c.stroke_width(2);
        match dash {
            None => chart.draw_series(LineSeries::new(line, style)).map(|_| ()),
            Some((on, off)) => chart.draw_series(DashedLineSeries::new(line, on, off, style)).map(|_| ()),
        }
        .map_err(|e| plot_err(path, e))?;
        // The ridge point: where this roof meets the memory-bandwidth slope.
        chart.draw_series([Circle::new((ridge, roof.flops), 4, c.filled())]).map_err(|e| plot_err(path, e))?;
        let text = format!("{} ridge {:.1} FLOP/B", roof.label.split(' ').next().unwrap_or(""), ridge);
        let (px, py) = chart.backend_coord(&(ridge, roof.flops));
        let ts = TextStyle::from(("sans-serif", 12).into_font()).color(&c).pos(Pos::new(HPos::Left, VPos::Bottom));
        left.draw(&Text::new(text, (px + 6, py - 4), ts)).map_err(|e| plot_err(path, e))?;
        legend.push((format!("{} roof {}", roof.label, short_si(roof.flops)), c));
    }
    for (cat, v) in &pts {
        let c = color(*cat);
        chart.draw_series(v.iter().map(|&(x, y)| Circle::new((x, y), 3, c.filled()))).map_err(|e| plot_err(path, e))?;
        legend.push((cat.label().to_string(), c));
    }
    legend_panel(&right, &legend, path)?;
    root.present().map_err(|e| plot_err(path, e))?;
    Ok(true)
}

// ---- writing -----------------------------------------------------------------------------------

/// The matrix configurations' kernel time by category, side by side (ms, and the ratio to the
/// baseline's time in that category), with the chart.
fn matrix_by_category(o: &mut String, m: &[MatrixRow]) {
    let with: Vec<&MatrixRow> = m.iter().filter(|r| !r.input.by_category.is_empty()).collect();
    if with.is_empty() {
        return;
    }
    let base = m.iter().find(|r| r.is_baseline).filter(|r| !r.input.by_category.is_empty());
    let time = |r: &MatrixRow, c: Category| r.input.by_category.iter().find(|x| x.0 == c).map(|x| x.1);
    let cats: Vec<Category> =
        Category::ALL.iter().copied().filter(|&c| with.iter().any(|r| time(r, c).is_some())).collect();
    let _ = writeln!(
        o,
        "### Kernel time by category per configuration
"
    );
    let rows: Vec<Vec<String>> = cats
        .iter()
        .map(|&c| {
            let mut row = vec![c.label().to_string()];
            for r in &with {
                row.push(match (time(r, c), base.and_then(|b| time(b, c))) {
                    (Some(t), Some(b)) if b > 0.0 && !r.is_baseline => format!("{} ({:.3}×)", fmt_ns(t), t / b),
                    (Some(t), _) => fmt_ns(t),
                    (None, _) => "—".into(),
                });
            }
            row
        })
        .collect();
    let mut head = vec!["category".to_string()];
    head.extend(with.iter().map(|r| md_escape(&r.input.name)));
    let head: Vec<&str> = head.iter().map(|s| s.as_str()).collect();
    md_table(o, &head, &rows);
    let _ = writeln!(o, "![kernel time by category per configuration](matrix.svg)\n");
}

/// Write the whole report into `dir` (created if needed). Returns the files written.
pub fn write(input: &Input, dir: &Path) -> Result<(Report, Vec<PathBuf>)> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut r = build(input);
    let mut written = Vec::new();
    let put = |name: &str, text: &str, written: &mut Vec<PathBuf>| -> Result<()> {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(|e| Error::io(&p, e))?;
        written.push(p);
        Ok(())
    };
    let bp = dir.join("breakdown.svg");
    if breakdown_svg(&r, &bp)? {
        written.push(bp);
    } else if r.passes.iter().any(|p| p.measured) {
        r.not_collected.push("breakdown chart: no measured call time to draw".into());
    }
    let mp = dir.join("matrix.svg");
    if matrix_svg(&r, &mp)? {
        written.push(mp);
    }
    let rp = dir.join("roofline.svg");
    if roofline_svg(&r, input, &rp)? {
        written.push(rp);
    } else if r.passes.iter().any(|p| p.measured) {
        r.not_collected.push("roofline chart: no measured call with counted FLOPs and bytes".into());
    }
    let mut md = markdown(&r);
    if !written.iter().any(|p| p.ends_with("breakdown.svg")) {
        md = md.replace("![category breakdown per pass](breakdown.svg)\n", "");
    }
    if !written.iter().any(|p| p.ends_with("roofline.svg")) {
        md = md.replace("![roofline](roofline.svg)\n", "");
    }
    if !written.iter().any(|p| p.ends_with("matrix.svg")) {
        md = md.replace("![kernel time by category per configuration](matrix.svg)\n", "");
    }
    put("report.md", &md, &mut written)?;
    for (name, text) in csv_files(&r, input) {
        put(name, &text, &mut written)?;
    }
    let json = serde_json::to_string_pretty(&r).map_err(|e| Error::format(dir.join("report.json"), e.to_string()))?;
    put("report.json", &json, &mut written)?;
    Ok((r, written))
}

/// The collectives' overlap with other kernels, one sentence.
fn comm_line(c: &CommOverlap) -> String {
    format!(
        "NCCL collectives: {} call(s), {} on the GPU timeline, {} of it ({:.1} %) while other kernels ran \
         (hidden behind compute); {} exposed.",
        c.calls,
        fmt_ns(c.comm_ns as f64),
        fmt_ns(c.hidden_ns as f64),
        c.hidden_pct,
        fmt_ns(c.comm_ns.saturating_sub(c.hidden_ns) as f64)
    )
}

/// A few lines for the terminal.
pub fn summary(r: &Report) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "{} on {}", r.title, r.device);
    for p in r.passes.iter().filter(|p| p.measured) {
        let b = &p.breakdown;
        let top: Vec<String> =
            b.by_category.iter().take(3).map(|c| format!("{} {:.0}%", c.key, c.pct_of_kernels)).collect();
        let _ = writeln!(
            o,
            "  {:<20} step {:>12}  calls {:>5}  Σ {:>12}  | {}",
            p.name,
            b.step_ns.map(|s| fmt_ns(s as f64)).unwrap_or("—".into()),
            b.records,
            fmt_ns(b.kernel_ns as f64),
            top.join(", ")
        );
        if let Some(i) = &b.idle {
            let _ = writeln!(
                o,
                "  {:<20} GPU idle: gaps {} ({}), outside kernels {}",
                "",
                fmt_ns(i.gaps_ns as f64),
                gaps(i.gaps),
                fmt_ns(i.outside_ns as f64)
            );
        }
        if let Some(c) = &b.comm {
            let _ = writeln!(o, "  {:<20} {}", "", comm_line(c));
        }
    }
    for h in r.passes.iter().filter(|h| has_counts(h)) {
        let line: Vec<String> = r
            .gpus
            .iter()
            .map(|g| format!("{} {}", g.key, fmt_ns(h.predictions.iter().map(|c| c.predicted_ns[g.key]).sum::<f64>())))
            .collect();
        let _ = writeln!(o, "  roofline bound, {} (predicted): {}", h.name, line.join(", "));
    }
    if !r.ncu_kernels.is_empty() {
        let _ = writeln!(o, "  ncu: {} kernels, {} ranked OPT rules", r.ncu_kernels.len(), r.priority.len());
        if let Some(p) = r.priority.first() {
            let _ = writeln!(o, "  top priority: {} on kernel {} ({:.1} %)", p.rule, p.kernel_id, p.speedup_pct);
        }
    }
    for n in &r.not_collected {
        let _ = writeln!(o, "  not collected: {n}");
    }
    o
}

/// True when a pass's records carry FLOP counts, so its roofline bound means something (CUPTI
/// kernel records have none: summing the byte-only calls would give a meaningless tiny bound).
fn has_counts(p: &PassReport) -> bool {
    p.predictions.iter().any(|c| c.flops > 0.0)
}
