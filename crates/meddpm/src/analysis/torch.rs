//! Import of PyTorch profiler kernel tables (`prof.key_averages().table(sort_by="self_cuda_time_total")`),
//! so the reference implementation's runtime lands in the same categories as ours
//! (`../shared/perf/pytorch-h200-profile-default-{train,sample}.txt` are such tables).
//!
//! A table row aggregates `# of Calls` launches of one kernel; it becomes that many
//! [`KernelRecord`]s of `Self CUDA / calls` each (the total is kept to the nanosecond). Names in
//! these tables are cut at 90 characters ("..."); the classifier copes with that.

use super::kernels::KernelRecord;
use crate::error::{Error, Result};
use std::path::Path;

fn parse_time_ns(s: &str) -> Option<f64> {
    let s = s.trim();
    let (num, scale) = if let Some(v) = s.strip_suffix("ms") {
        (v, 1e6)
    } else if let Some(v) = s.strip_suffix("us") {
        (v, 1e3)
    } else if let Some(v) = s.strip_suffix("ns") {
        (v, 1.0)
    } else if let Some(v) = s.strip_suffix('s') {
        (v, 1e9)
    } else {
        return None;
    };
    num.trim().parse::<f64>().ok().map(|v| v * scale)
}

/// Parse a key_averages table. Rows without CUDA time (CPU-only ops) are skipped.
pub fn parse_table(text: &str, path: &Path) -> Result<Vec<KernelRecord>> {
    let lines: Vec<&str> = text.lines().collect();
    let header = lines.iter().position(|l| l.contains("Self CUDA") && l.contains("# of Calls")).ok_or_else(|| {
        Error::format(path, "not a PyTorch profiler table: no header with \"Self CUDA\" and \"# of Calls\"")
    })?;
    let h = lines[header];
    let name_end = h.find("Name").map(|i| i + 4).ok_or_else(|| Error::format(path, "header has no \"Name\" column"))?;
    let cols: Vec<&str> = h[name_end..].split("  ").map(str::trim).filter(|s| !s.is_empty()).collect();
    let self_cuda = cols.iter().position(|c| *c == "Self CUDA");
    let calls = cols.iter().position(|c| *c == "# of Calls");
    let (Some(self_cuda), Some(calls)) = (self_cuda, calls) else {
        return Err(Error::format(path, "header lacks \"Self CUDA\" or \"# of Calls\""));
    };
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate().skip(header + 1) {
        if l.starts_with("---")
            || l.trim().is_empty()
            || l.starts_with("Self CPU time total")
            || l.starts_with("Self CUDA time total")
        {
            continue;
        }
        if l.len() <= name_end || !l.is_char_boundary(name_end) {
            continue;
        }
        let name = l[..name_end].trim();
        let fields: Vec<&str> = l[name_end..].split_whitespace().collect();
        if fields.len() != cols.len() {
            return Err(Error::format(
                path,
                format!("line {}: {} columns after the name, the header has {}", i + 1, fields.len(), cols.len()),
            ));
        }
        let Some(total) = parse_time_ns(fields[self_cuda]) else { continue };
        let n: u64 = fields[calls].parse().map_err(|_| {
            Error::format(path, format!("line {}: call count {:?} is not a number", i + 1, fields[calls]))
        })?;
        if n == 0 || total <= 0.0 {
            continue;
        }
        let total = total.round() as u64;
        for j in 0..n {
            // spread the rounding remainder so the row total is exact
            let d = total / n + u64::from(j < total % n);
            out.push(KernelRecord::new(name, d));
        }
    }
    Ok(out)
}
