//! Nsight Compute CSV exports: parse, summarise per kernel, rank the guided-analysis rules.
//!
//! Two exports of one `ncu` report are understood (commands in `../shared/docs/peers.md` §D.2):
//! - the **raw page** (`ncu -i rep --page raw --csv --print-units base`): one header row of metric
//!   names, one row of units (its ID field is empty), then one row per profiled kernel;
//! - the **details page** (`ncu -i rep --page details --csv`): one row per (kernel, section,
//!   metric) and one row per guided-analysis rule result, with the columns `Rule Name, Rule Type
//!   (OPT/WRN/INF), Rule Description, Estimated Speedup Type (global/local), Estimated Speedup` (%).
//!
//! [`Counters`] pulls out the paper's axes — SM cycles, executed instructions, IPC, tensor-pipe
//! utilisation (Hopper counts HGMMA on the `hmma` pipe metric; the gmma instruction share is a
//! separate metric), instruction mix by opcode class, DRAM/L2/L1 throughput and hit rates,
//! occupancy, warp-stall reasons — preferring raw-page metric names and falling back to the
//! details page's display names where those are the same metric. A metric that was not
//! collected is `None`, and the report prints "not collected". [`priority_list`] ranks the OPT
//! rules by estimated time saved (speedup × kernel duration): the paper's priority list.
//! Metric names were checked against the real H200 exports in `testdata/ncu/` and the gh100
//! metric list in `../shared/perf/ncu/`.
//!
//! The end of the file holds what `meddpm profile` needs around an ncu run that is not the
//! process itself: the argument lists ([`base_args`], [`matrix_args`], [`command_args`],
//! [`child_filters`] with [`top_raw_names`]), and the profiled kernels as [`KernelRecord`]s
//! ([`kernel_records`]). The CLI spawns ncu and asks the CUDA backend whether NVTX is on.

use super::csv;
use super::kernels::{classify, Category, KernelRecord};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One metric cell: its unit (as printed) and its text (as printed).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Metric {
    pub unit: String,
    pub text: String,
}

impl Metric {
    /// The value in base units (ns, byte, cycle, inst, Hz, %), or `None` for empty cells,
    /// "n/a", "no data" and other non-numbers. Thousands separators are removed.
    pub fn value(&self) -> Option<f64> {
        parse_number(&self.text).map(|v| v * unit_scale(&self.unit))
    }
}

/// A number as ncu prints it ("4,070,048", "3.16", "1.2e+03"); `None` for anything else.
pub fn parse_number(text: &str) -> Option<f64> {
    let t: String = text.trim().chars().filter(|&c| c != ',').collect();
    if t.is_empty() {
        return None;
    }
    t.parse::<f64>().ok().filter(|v| v.is_finite())
}

/// Factor from a printed unit to its base unit: `usecond` → 1e3 (ns), `Mbyte` → 1e6, `Kinst` → 1e3.
/// Base and unknown units give 1.
pub fn unit_scale(unit: &str) -> f64 {
    let u = unit.trim();
    let (num, per) = match u.split_once('/') {
        Some((a, b)) => (a, Some(b)),
        None => (u, None),
    };
    let time = |t: &str| match t {
        "ns" | "nsecond" => Some(1.0),
        "us" | "usecond" => Some(1e3),
        "ms" | "msecond" => Some(1e6),
        "s" | "second" => Some(1e9),
        _ => None,
    };
    let prefixed = |t: &str| -> f64 {
        let mut cs = t.chars();
        let (Some(p), rest) = (cs.next(), cs.as_str()) else { return 1.0 };
        let base_ok = ["byte", "cycle", "inst", "hz", "sector", "warp", "thread", "request", "block", "transaction"]
            .iter()
            .any(|b| rest.eq_ignore_ascii_case(b));
        if !base_ok {
            return 1.0;
        }
        match p {
            'K' | 'k' => 1e3,
            'M' => 1e6,
            'G' => 1e9,
            'T' => 1e12,
            _ => 1.0,
        }
    };
    match per {
        // rates: scale the numerator only; a per-time denominator other than seconds is rare
        Some(d) => {
            let f = prefixed(num);
            match d {
                "second" | "s" => f,
                "usecond" => f * 1e6,
                "msecond" => f * 1e3,
                "nsecond" => f * 1e9,
                _ => f,
            }
        }
        None => time(num).unwrap_or_else(|| prefixed(num)),
    }
}

/// One row of the details page that carries a metric.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DetailMetric {
    pub section: String,
    pub name: String,
    pub unit: String,
    pub text: String,
}

/// One guided-analysis rule result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rule {
    pub section: String,
    /// Rule identifier (e.g. `CPIStall`, `UncoalescedGlobalAccess`).
    pub name: String,
    /// `OPT` (optimisation opportunity), `WRN` or `INF`.
    pub kind: String,
    pub description: String,
    /// `global` (share of the whole kernel's time) or `local` (of the part it looks at).
    pub speedup_type: Option<String>,
    /// Estimated speedup, percent of kernel time.
    pub speedup_pct: Option<f64>,
}

/// One profiled kernel launch with everything the exports said about it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NcuKernel {
    /// ncu's launch ID within the report.
    pub id: u64,
    /// Kernel name as exported (demangled by default).
    pub name: String,
    pub category: Category,
    pub block: Option<[u32; 3]>,
    pub grid: Option<[u32; 3]>,
    /// Raw-page metrics by metric name.
    pub metrics: BTreeMap<String, Metric>,
    /// Details-page metric rows.
    pub details: Vec<DetailMetric>,
    /// Details-page rule rows.
    pub rules: Vec<Rule>,
}

fn launch_dims(s: &str) -> Option<[u32; 3]> {
    let t = s.trim().trim_start_matches('(').trim_end_matches(')');
    let v: Vec<u32> = t.split(',').map(|p| p.trim().parse().ok()).collect::<Option<_>>()?;
    (v.len() == 3).then(|| [v[0], v[1], v[2]])
}

fn col(header: &[String], name: &str) -> Option<usize> {
    header.iter().position(|h| h.trim() == name)
}

fn cell(row: &[String], i: Option<usize>) -> &str {
    i.and_then(|i| row.get(i)).map(|s| s.as_str()).unwrap_or("")
}

fn new_kernel(id: u64, name: &str, block: &str, grid: &str) -> NcuKernel {
    NcuKernel {
        id,
        name: name.to_string(),
        category: classify(name),
        block: launch_dims(block),
        grid: launch_dims(grid),
        metrics: BTreeMap::new(),
        details: Vec::new(),
        rules: Vec::new(),
    }
}

/// The columns every ncu CSV page starts with; the rest are metrics (raw) or section/rule data.
const ID_COLUMNS: [&str; 11] = [
    "ID",
    "Process ID",
    "Process Name",
    "Host Name",
    "Kernel Name",
    "Context",
    "Stream",
    "Block Size",
    "Grid Size",
    "Device",
    "CC",
];

fn find_header(rows: &[Vec<String>], path: &Path, page: &str) -> Result<usize> {
    // ncu may print "==PROF==" lines or warnings before the table when stdout was captured
    rows.iter().position(|r| r.first().map(|s| s.trim()) == Some("ID") && r.iter().any(|c| c.trim() == "Kernel Name")).ok_or_else(
        || {
            Error::format(
                path,
                format!("not an Nsight Compute {page}-page CSV export: no header row starting with \"ID\" and holding \"Kernel Name\" (export with `ncu -i REPORT --page {page} --csv`)"),
            )
        },
    )
}

/// Parse a raw-page export (`--page raw --csv`, ideally `--print-units base`).
pub fn parse_raw(text: &str, path: &Path) -> Result<Vec<NcuKernel>> {
    let rows = csv::parse(text);
    let h = find_header(&rows, path, "raw")?;
    let header = &rows[h];
    let (id_c, name_c, block_c, grid_c) =
        (col(header, "ID"), col(header, "Kernel Name"), col(header, "Block Size"), col(header, "Grid Size"));
    let mut units: Option<&Vec<String>> = None;
    let mut out = Vec::new();
    for (i, row) in rows.iter().enumerate().skip(h + 1) {
        let id_text = cell(row, id_c).trim();
        if id_text.is_empty() {
            if units.is_none() {
                units = Some(row);
            }
            continue;
        }
        let id: u64 = id_text
            .parse()
            .map_err(|_| Error::format(path, format!("row {}: launch ID {id_text:?} is not a number", i + 1)))?;
        let mut k = new_kernel(id, cell(row, name_c), cell(row, block_c), cell(row, grid_c));
        for (j, name) in header.iter().enumerate() {
            if ID_COLUMNS.contains(&name.trim()) {
                continue;
            }
            let text = row.get(j).map(|s| s.trim()).unwrap_or("");
            if text.is_empty() {
                continue;
            }
            let unit = units.and_then(|u| u.get(j)).map(|s| s.trim().to_string()).unwrap_or_default();
            k.metrics.insert(name.trim().to_string(), Metric { unit, text: text.to_string() });
        }
        out.push(k);
    }
    if out.is_empty() {
        return Err(Error::format(path, "the raw-page export holds no kernel rows"));
    }
    Ok(out)
}

/// Parse a details-page export (`--page details --csv`): metric rows and rule rows per kernel.
pub fn parse_details(text: &str, path: &Path) -> Result<Vec<NcuKernel>> {
    let rows = csv::parse(text);
    let h = find_header(&rows, path, "details")?;
    let header = &rows[h];
    let c = |n: &str| col(header, n);
    let (id_c, name_c, block_c, grid_c) = (c("ID"), c("Kernel Name"), c("Block Size"), c("Grid Size"));
    let (sec_c, mname_c, unit_c, val_c) = (c("Section Name"), c("Metric Name"), c("Metric Unit"), c("Metric Value"));
    let (rname_c, rtype_c, rdesc_c, stype_c, sval_c) =
        (c("Rule Name"), c("Rule Type"), c("Rule Description"), c("Estimated Speedup Type"), c("Estimated Speedup"));
    if sec_c.is_none() || (mname_c.is_none() && rname_c.is_none()) {
        return Err(Error::format(
            path,
            "details-page export lacks the \"Section Name\" and \"Metric Name\"/\"Rule Name\" columns",
        ));
    }
    let mut out: Vec<NcuKernel> = Vec::new();
    for (i, row) in rows.iter().enumerate().skip(h + 1) {
        let id_text = cell(row, id_c).trim();
        if id_text.is_empty() {
            continue;
        }
        let id: u64 = id_text
            .parse()
            .map_err(|_| Error::format(path, format!("row {}: launch ID {id_text:?} is not a number", i + 1)))?;
        if out.last().map(|k| k.id) != Some(id) {
            match out.iter().position(|k| k.id == id) {
                Some(p) => {
                    let k = out.remove(p);
                    out.push(k);
                }
                None => out.push(new_kernel(id, cell(row, name_c), cell(row, block_c), cell(row, grid_c))),
            }
        }
        let k = out.last_mut().expect("pushed above");
        let section = cell(row, sec_c).trim().to_string();
        let rule = cell(row, rname_c).trim();
        if !rule.is_empty() {
            let st = cell(row, stype_c).trim();
            k.rules.push(Rule {
                section,
                name: rule.to_string(),
                kind: cell(row, rtype_c).trim().to_string(),
                description: cell(row, rdesc_c).trim().to_string(),
                speedup_type: (!st.is_empty()).then(|| st.to_string()),
                speedup_pct: parse_number(cell(row, sval_c)),
            });
        } else if !cell(row, mname_c).trim().is_empty() {
            k.details.push(DetailMetric {
                section,
                name: cell(row, mname_c).trim().to_string(),
                unit: cell(row, unit_c).trim().to_string(),
                text: cell(row, val_c).trim().to_string(),
            });
        }
    }
    out.sort_by_key(|k| k.id);
    if out.is_empty() {
        return Err(Error::format(path, "the details-page export holds no kernel rows"));
    }
    Ok(out)
}

/// Join raw-page and details-page kernels by launch ID (either side may be empty).
pub fn merge(raw: Vec<NcuKernel>, details: Vec<NcuKernel>) -> Vec<NcuKernel> {
    let mut out = raw;
    for d in details {
        match out.iter_mut().find(|k| k.id == d.id) {
            Some(k) => {
                k.details = d.details;
                k.rules = d.rules;
            }
            None => out.push(d),
        }
    }
    out.sort_by_key(|k| k.id);
    out
}

/// Both exports of one ncu report, as loaded from files.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct NcuData {
    pub kernels: Vec<NcuKernel>,
    pub raw_path: Option<PathBuf>,
    pub details_path: Option<PathBuf>,
}

impl NcuData {
    /// Read and parse whichever exports are given.
    pub fn load(raw: Option<&Path>, details: Option<&Path>) -> Result<Self> {
        let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| Error::io(p, e));
        let r = match raw {
            Some(p) => parse_raw(&read(p)?, p)?,
            None => Vec::new(),
        };
        let d = match details {
            Some(p) => parse_details(&read(p)?, p)?,
            None => Vec::new(),
        };
        Ok(NcuData {
            kernels: merge(r, d),
            raw_path: raw.map(Path::to_path_buf),
            details_path: details.map(Path::to_path_buf),
        })
    }

    /// The GPU the first kernel ran on, as ncu names it (`device__attribute_display_name`).
    pub fn device_name(&self) -> Option<String> {
        self.kernels.first().and_then(|k| k.metrics.get("device__attribute_display_name").map(|m| m.text.clone()))
    }
}

/// The per-kernel counters of the paper's analysis axes. `None`: not collected.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Counters {
    pub duration_ns: Option<f64>,
    /// `sm__cycles_elapsed.avg`: cycles per SM over the kernel.
    pub sm_cycles_elapsed: Option<f64>,
    /// `sm__cycles_active.avg`: cycles per SM with at least one warp resident.
    pub sm_cycles_active: Option<f64>,
    /// `smsp__inst_executed.sum`: warp-level executed instructions.
    pub instructions: Option<f64>,
    /// `sm__inst_executed.avg.per_cycle_active`: executed IPC per SM.
    pub ipc: Option<f64>,
    /// `smsp__issue_active.avg.pct_of_peak_sustained_active`: issue-slot use, %.
    pub issue_active_pct: Option<f64>,
    /// `sm__pipe_tensor_cycles_active…pct_of_peak_sustained_active`: any tensor work, %.
    pub tensor_pipe_pct: Option<f64>,
    /// `sm__pipe_tensor_op_hmma_cycles_active…`: HMMA/HGMMA pipe, % (Hopper counts wgmma here).
    pub tensor_hmma_pct: Option<f64>,
    /// `sm__inst_executed_pipe_tensor_op_gmma…`: Hopper wgmma instruction issue share, %.
    pub tensor_gmma_inst_pct: Option<f64>,
    /// Σ `sm__ops_path_tensor_src_*_dst_*.sum`: tensor-core operations (2 per multiply-add).
    pub tensor_ops: Option<f64>,
    pub dram_read_bytes: Option<f64>,
    pub dram_write_bytes: Option<f64>,
    /// DRAM throughput, % of peak.
    pub dram_pct: Option<f64>,
    /// L2 throughput, % of peak.
    pub l2_pct: Option<f64>,
    /// L1/TEX throughput, % of peak.
    pub l1_pct: Option<f64>,
    pub l2_hit_pct: Option<f64>,
    pub l1_hit_pct: Option<f64>,
    /// SOL compute (SM) throughput, %.
    pub sm_pct: Option<f64>,
    /// SOL memory throughput, %.
    pub memory_pct: Option<f64>,
    pub achieved_occupancy_pct: Option<f64>,
    pub theoretical_occupancy_pct: Option<f64>,
    pub registers: Option<f64>,
    pub waves_per_sm: Option<f64>,
    /// Warp cycles per issued instruction (the sum over stall reasons).
    pub warp_cycles_per_inst: Option<f64>,
    /// Stall reason → warps stalled per issue (`smsp__average_warps_issue_stalled_<r>_per_issue_active.ratio`).
    pub stalls: BTreeMap<String, f64>,
    /// Opcode class → executed warp instructions (`smsp__sass_inst_executed_op_<c>.sum`,
    /// `smsp__inst_executed_op_<c>.sum`).
    pub inst_mix: BTreeMap<String, f64>,
    /// Pipe → instruction issue share, % of peak (`sm__inst_executed_pipe_<p>.avg.pct_of_peak_sustained_active`).
    pub pipes: BTreeMap<String, f64>,
}

impl NcuKernel {
    /// A raw-page metric value in base units.
    pub fn metric(&self, name: &str) -> Option<f64> {
        self.metrics.get(name).and_then(Metric::value)
    }

    /// A details-page metric value by section display name and metric display name.
    pub fn detail(&self, section: &str, name: &str) -> Option<f64> {
        self.details
            .iter()
            .find(|d| d.section == section && d.name == name)
            .and_then(|d| parse_number(&d.text).map(|v| v * unit_scale(&d.unit)))
    }

    fn first(&self, raw: &[&str], detail: Option<(&str, &str)>) -> Option<f64> {
        raw.iter().find_map(|n| self.metric(n)).or_else(|| detail.and_then(|(s, n)| self.detail(s, n)))
    }

    /// The analysis counters, raw page first, details page as fallback.
    pub fn counters(&self) -> Counters {
        const SOL: &str = "GPU Speed Of Light Throughput";
        const CWA: &str = "Compute Workload Analysis";
        const MWA: &str = "Memory Workload Analysis";
        const OCC: &str = "Occupancy";
        let mut c = Counters {
            duration_ns: self.first(&["gpu__time_duration.sum"], Some((SOL, "Duration"))),
            sm_cycles_elapsed: self.first(&["sm__cycles_elapsed.avg"], None),
            sm_cycles_active: self.first(&["sm__cycles_active.avg"], Some((SOL, "SM Active Cycles"))),
            instructions: self
                .first(&["smsp__inst_executed.sum"], Some(("Instruction Statistics", "Executed Instructions"))),
            ipc: self.first(&["sm__inst_executed.avg.per_cycle_active"], Some((CWA, "Executed Ipc Active"))),
            issue_active_pct: self.first(&["smsp__issue_active.avg.pct_of_peak_sustained_active"], None),
            tensor_pipe_pct: self.first(&["sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"], None),
            tensor_hmma_pct: self
                .first(&["sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"], None),
            tensor_gmma_inst_pct: self
                .first(&["sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active"], None),
            tensor_ops: None,
            dram_read_bytes: self.first(&["dram__bytes_read.sum"], None),
            dram_write_bytes: self.first(&["dram__bytes_write.sum"], None),
            dram_pct: self.first(
                &[
                    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                ],
                Some((SOL, "DRAM Throughput")),
            ),
            l2_pct: self
                .first(&["lts__throughput.avg.pct_of_peak_sustained_elapsed"], Some((SOL, "L2 Cache Throughput"))),
            l1_pct: self
                .first(&["l1tex__throughput.avg.pct_of_peak_sustained_active"], Some((SOL, "L1/TEX Cache Throughput"))),
            l2_hit_pct: self.first(&["lts__t_sector_hit_rate.pct"], Some((MWA, "L2 Hit Rate"))),
            l1_hit_pct: self.first(&["l1tex__t_sector_hit_rate.pct"], Some((MWA, "L1/TEX Hit Rate"))),
            sm_pct: self
                .first(&["sm__throughput.avg.pct_of_peak_sustained_elapsed"], Some((SOL, "Compute (SM) Throughput"))),
            memory_pct: self.first(
                &["gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"],
                Some((SOL, "Memory Throughput")).filter(|_| self.detail_unit(SOL, "Memory Throughput") == Some("%")),
            ),
            achieved_occupancy_pct: self
                .first(&["sm__warps_active.avg.pct_of_peak_sustained_active"], Some((OCC, "Achieved Occupancy"))),
            theoretical_occupancy_pct: self
                .first(&["sm__maximum_warps_per_active_cycle_pct"], Some((OCC, "Theoretical Occupancy"))),
            registers: self
                .first(&["launch__registers_per_thread"], Some(("Launch Statistics", "Registers Per Thread"))),
            waves_per_sm: self
                .first(&["launch__waves_per_multiprocessor"], Some(("Launch Statistics", "Waves Per SM"))),
            warp_cycles_per_inst: self.first(
                &["smsp__average_warp_latency_per_inst_issued.ratio"],
                Some(("Warp State Statistics", "Warp Cycles Per Issued Instruction")),
            ),
            ..Counters::default()
        };
        let mut tensor_ops = None::<f64>;
        for (name, m) in &self.metrics {
            let Some(v) = m.value() else { continue };
            if let Some(r) = name
                .strip_prefix("smsp__average_warps_issue_stalled_")
                .and_then(|r| r.strip_suffix("_per_issue_active.ratio"))
            {
                c.stalls.insert(r.to_string(), v);
            } else if let Some(op) = name
                .strip_prefix("smsp__sass_inst_executed_op_")
                .or_else(|| name.strip_prefix("smsp__inst_executed_op_"))
                .and_then(|r| r.strip_suffix(".sum"))
            {
                c.inst_mix.entry(op.to_string()).or_insert(v);
            } else if let Some(p) = name
                .strip_prefix("sm__inst_executed_pipe_")
                .and_then(|r| r.strip_suffix(".avg.pct_of_peak_sustained_active"))
            {
                c.pipes.insert(p.to_string(), v);
            } else if let Some(t) = name.strip_prefix("sm__ops_path_tensor_src_").and_then(|r| r.strip_suffix(".sum")) {
                if t.contains("_dst_") && !t.contains('.') {
                    *tensor_ops.get_or_insert(0.0) += v;
                }
            }
        }
        c.tensor_ops = tensor_ops;
        c
    }

    fn detail_unit(&self, section: &str, name: &str) -> Option<&str> {
        self.details.iter().find(|d| d.section == section && d.name == name).map(|d| d.unit.as_str())
    }
}

/// One OPT rule result placed in the workload's priority list.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankedRule {
    pub rank: usize,
    pub rule: String,
    pub kernel_id: u64,
    pub kernel: String,
    pub category: Category,
    pub speedup_type: Option<String>,
    pub speedup_pct: f64,
    /// The kernel's duration, ns (if the duration was collected).
    pub kernel_ns: Option<f64>,
    /// speedup × kernel duration: the time this fix could save, ns.
    pub est_saved_ns: Option<f64>,
    pub description: String,
}

/// The paper's priority list: every OPT rule with an estimated speedup, ranked by estimated time
/// saved (speedup % × kernel duration) — or by the speedup itself where a duration is missing
/// (those rank after all timed ones). Ties keep export order.
pub fn priority_list(kernels: &[NcuKernel]) -> Vec<RankedRule> {
    let mut v: Vec<RankedRule> = Vec::new();
    for k in kernels {
        let dur = k.counters().duration_ns;
        for r in &k.rules {
            let Some(pct) = r.speedup_pct else { continue };
            if r.kind != "OPT" {
                continue;
            }
            v.push(RankedRule {
                rank: 0,
                rule: r.name.clone(),
                kernel_id: k.id,
                kernel: k.name.clone(),
                category: k.category,
                speedup_type: r.speedup_type.clone(),
                speedup_pct: pct,
                kernel_ns: dur,
                est_saved_ns: dur.map(|d| d * pct / 100.0),
                description: r.description.clone(),
            });
        }
    }
    v.sort_by(|a, b| match (a.est_saved_ns, b.est_saved_ns) {
        (Some(x), Some(y)) => y.total_cmp(&x),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => b.speedup_pct.total_cmp(&a.speedup_pct),
    });
    for (i, r) in v.iter_mut().enumerate() {
        r.rank = i + 1;
    }
    v
}

/// Totals of a set of kernels (one configuration of the optimisation matrix).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Totals {
    pub kernels: usize,
    pub time_ns: Option<f64>,
    /// Σ sm__cycles_elapsed.avg over kernels.
    pub sm_cycles: Option<f64>,
    /// Σ warp-level executed instructions.
    pub instructions: Option<f64>,
    /// Tensor-pipe utilisation weighted by each kernel's elapsed SM cycles, %.
    pub tensor_pct: Option<f64>,
    /// Σ instructions / Σ (active SM cycles × SM count): executed IPC per SM over the set.
    pub ipc: Option<f64>,
}

fn sum_all(v: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let mut s = 0.0;
    let mut n = 0;
    for x in v {
        s += x?;
        n += 1;
    }
    (n > 0).then_some(s)
}

/// Totals over `kernels`; a total is `None` unless every kernel has the metric.
pub fn totals(kernels: &[NcuKernel]) -> Totals {
    let cs: Vec<Counters> = kernels.iter().map(NcuKernel::counters).collect();
    let sm_cycles = sum_all(cs.iter().map(|c| c.sm_cycles_elapsed));
    let tensor_weighted = sum_all(cs.iter().map(|c| Some(c.tensor_pipe_pct? * c.sm_cycles_elapsed?)));
    // IPC per SM: inst / (active cycles per SM × SMs); the per-kernel IPC times its active cycles
    // gives the kernel's instructions per SM, so Σ(ipc·active)/Σ active is the set's IPC.
    let ipc_num = sum_all(cs.iter().map(|c| Some(c.ipc? * c.sm_cycles_active?)));
    let active = sum_all(cs.iter().map(|c| c.sm_cycles_active));
    Totals {
        kernels: kernels.len(),
        time_ns: sum_all(cs.iter().map(|c| c.duration_ns)),
        sm_cycles,
        instructions: sum_all(cs.iter().map(|c| c.instructions)),
        tensor_pct: match (tensor_weighted, sm_cycles) {
            (Some(t), Some(s)) if s > 0.0 => Some(t / s),
            _ => None,
        },
        ipc: match (ipc_num, active) {
            (Some(n), Some(a)) if a > 0.0 => Some(n / a),
            _ => None,
        },
    }
}

// ---- running ncu: arguments, kernel selection, records ---------------------------------------
//
// `meddpm profile --counters` and `meddpm profile -- COMMAND…` start `ncu` (the CLI spawns the
// process and passes in whether NVTX ranges are emitted); what to pass it and how to read its
// kernels back is decided here, without a GPU.

/// The metrics of a matrix configuration (every kernel of one training step, a few replay passes):
/// time, SM cycles, instructions, IPC and the tensor pipes (all tensor work, HMMA/HGMMA, Hopper's
/// wgmma instruction share), plus the launch configuration.
pub const MATRIX_METRICS: &str = "gpu__time_duration.sum,sm__cycles_elapsed.avg,sm__cycles_active.avg,\
smsp__inst_executed.sum,sm__inst_executed.avg.per_cycle_active,\
sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active,\
launch__registers_per_thread,launch__grid_size,launch__block_size";

/// The ncu arguments every run starts with: clocks as the application sees them, every process,
/// and `--set full` (`full`) or one or two replay passes of durations, cycles, instructions, IPC
/// and the launch configuration.
pub fn base_args(full: bool) -> Vec<String> {
    let mut v: Vec<String> = vec!["--clock-control".into(), "none".into(), "--target-processes".into(), "all".into()];
    if full {
        v.extend(["--set".into(), "full".into()]);
    } else {
        // one or two replay passes: durations, cycles, instructions, IPC, launch configuration
        v.extend([
            "--metrics".into(),
            "gpu__time_duration.sum,sm__cycles_elapsed.avg,smsp__inst_executed.sum,sm__inst_executed.avg.per_cycle_active,\
             launch__registers_per_thread,launch__grid_size,launch__block_size"
                .into(),
        ]);
    }
    v
}

/// [`base_args`] with the [`MATRIX_METRICS`] in place of the short metric list.
pub fn matrix_args() -> Vec<String> {
    let mut args = base_args(false);
    args.splice(args.len() - 1.., [MATRIX_METRICS.to_string()]);
    args
}

/// The ncu arguments for another program (`meddpm profile -- COMMAND…`): [`base_args`] plus its
/// optional NVTX range (`--nvtx-include`), kernel-name regex (`-k regex:`) and launch count (`-c`).
pub fn command_args(
    full: bool,
    nvtx_include: Option<&str>,
    kernel_regex: Option<&str>,
    launch_count: Option<usize>,
) -> Vec<String> {
    let mut args = base_args(full);
    if let Some(r) = nvtx_include {
        args.extend(["--nvtx".into(), "--nvtx-include".into(), r.to_string()]);
    }
    if let Some(k) = kernel_regex {
        args.extend(["-k".into(), format!("regex:{k}")]);
    }
    if let Some(c) = launch_count {
        args.extend(["-c".into(), c.to_string()]);
    }
    args
}

/// ncu filter arguments for a run of our own steps, and how they select (for the report): the
/// `profile/` NVTX range when the backend emits NVTX (`nvtx` is `Err(why not)` otherwise), and
/// with `top > 0` the kernels `raw_names` (mangled, as CUPTI reports them; see [`top_raw_names`]).
pub fn child_filters(nvtx: std::result::Result<(), String>, top: usize, raw_names: &[String]) -> (Vec<String>, String) {
    let mut a = Vec::new();
    let mut how = String::new();
    match nvtx {
        Ok(()) => {
            a.extend(["--nvtx".into(), "--nvtx-include".into(), "profile/".into()]);
            how.push_str("NVTX range of the recorded training and sampling step");
        }
        Err(e) => {
            how.push_str(&format!("first launches (no NVTX: {e})"));
        }
    }
    if top > 0 && !raw_names.is_empty() {
        let alts: Vec<String> = raw_names.iter().map(|n| regex_escape(n)).collect();
        a.extend([
            "--kernel-name-base".into(),
            "mangled".into(),
            "-k".into(),
            format!("regex:^({})$", alts.join("|")),
            "-c".into(),
            top.to_string(),
        ]);
        how.push_str(&format!(", the {} kernels with the most GPU time", raw_names.len()));
    }
    (a, how)
}

/// `s` with the regex metacharacters `\^$.|?*+()[]{}` escaped, for ncu's `-k regex:`.
pub fn regex_escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for ch in s.chars() {
        if "\\^$.|?*+()[]{}".contains(ch) {
            o.push('\\');
        }
        o.push(ch);
    }
    o
}

/// The raw names of the `n` kernels with the most GPU time among `(name, ns)` activities
/// (memcpy/memset left out; ties by name).
pub fn top_raw_names(acts: &[(String, u64)], n: usize) -> Vec<String> {
    let mut by: BTreeMap<&str, u64> = BTreeMap::new();
    for (name, ns) in acts {
        if name.starts_with("memcpy") || name == "memset" {
            continue;
        }
        *by.entry(name.as_str()).or_default() += ns;
    }
    let mut v: Vec<(&str, u64)> = by.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    v.into_iter().take(n).map(|(s, _)| s.to_string()).collect()
}

/// Records of the kernels ncu profiled (durations measured under replay, `--clock-control none`).
pub fn kernel_records(ks: &[NcuKernel]) -> Vec<KernelRecord> {
    ks.iter()
        .map(|k| {
            let c = k.counters();
            let mut r = KernelRecord::new(&k.name, c.duration_ns.unwrap_or(0.0).round() as u64);
            r.category = k.category;
            r.grid = k.grid;
            r.block = k.block;
            r.registers = c.registers.map(|v| v as u32);
            r
        })
        .collect()
}

/// The kernels whose launch ID is in `ids` (all of them for `None`).
pub fn select_ids(kernels: Vec<NcuKernel>, ids: Option<&[u64]>) -> Vec<NcuKernel> {
    match ids {
        Some(ids) => kernels.into_iter().filter(|k| ids.contains(&k.id)).collect(),
        None => kernels,
    }
}

/// The last `n` non-blank lines of a process's output joined by " | ", for error messages.
pub fn log_tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}
