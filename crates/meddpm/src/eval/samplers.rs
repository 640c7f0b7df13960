//! The sampler study: quality against wall time per volume for every sampler and step count
//! (`scripts/gpu/samplers.sh` runs it; `meddpm eval-samplers` calls [`write_study`]).
//!
//! Inputs, one folder per (sampler, steps) under a root: `timing.json` (a [`SampleTiming`], what
//! `meddpm sample` saves next to its volumes), `quality/eval.json` (`meddpm eval` of the volumes
//! against the real volume of their mask) and optionally `agreement/eval.json` (`meddpm eval` of
//! the volumes against the reference's volumes of the same seeds, paired by file name; the
//! reference is ancestral DDPM with all T steps, "DDPM-250" for Med-DDPM).
//! Outputs: `samplers.md` (table + verdicts), `samplers.csv`, `samplers.svg`.
//!
//! Verdict rule: a metric of a row is *within DDPM-T's spread* when its mean differs from the
//! DDPM-T row's mean by at most that row's standard deviation over seeds (pairs for
//! diversity); the table names every metric that is not. Wall time per volume is the batch time
//! divided by its volumes, averaged over the batches after the first when there are several
//! (the first carries the one-time start: cuDNN algorithm search, kernel loading).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::report::{EvalReport, Stat};
use crate::checkpoint::write_atomic;
use crate::diffusion::{SamplerKind, SamplerSpec};
use crate::{Error, Result};

/// One volume of a timed batch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimedVolume {
    /// The first file written for it.
    pub file: String,
    pub mask: String,
    pub seed: u64,
}

/// One network batch: its volumes and the wall time from the first noise draw to the volumes on
/// the host.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BatchTiming {
    pub seconds: f64,
    pub volumes: Vec<TimedVolume>,
}

/// What `meddpm sample` records about a run (`<out>_timing.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SampleTiming {
    pub tool: String,
    pub device: String,
    pub sampler: SamplerSpec,
    /// The schedule's T.
    pub timesteps: usize,
    /// Volumes per network batch.
    pub batch: usize,
    pub batches: Vec<BatchTiming>,
    /// Processes (GPUs) that sampled in parallel (`sample --gpus`, [`SampleTiming::merge`]); their
    /// batches are interleaved, each rank's first batch among the first `ranks`. Absent: 1.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub ranks: usize,
}

fn one() -> usize {
    1
}
fn is_one(n: &usize) -> bool {
    *n == 1
}

impl SampleTiming {
    pub fn volumes(&self) -> usize {
        self.batches.iter().map(|b| b.volumes.len()).sum()
    }

    /// Wall seconds per volume (see the module docs; with several ranks: per GPU, the first
    /// batch of every rank left out); NaN without volumes.
    pub fn seconds_per_volume(&self) -> f64 {
        let first = self.ranks.max(1);
        let steady = if self.batches.len() > first { &self.batches[first..] } else { &self.batches[..] };
        let per: Vec<f64> =
            steady.iter().filter(|b| !b.volumes.is_empty()).map(|b| b.seconds / b.volumes.len() as f64).collect();
        if per.is_empty() {
            f64::NAN
        } else {
            per.iter().sum::<f64>() / per.len() as f64
        }
    }

    /// The timings of ranks that sampled disjoint volumes of one command in parallel, as one:
    /// their batches interleaved (every rank's first, then every rank's second, …), `ranks` set,
    /// the device line naming them. None without parts.
    pub fn merge(parts: Vec<SampleTiming>) -> Option<SampleTiming> {
        let first = parts.first()?.clone();
        let devices: Vec<&str> = parts.iter().map(|p| p.device.as_str()).collect();
        let device = if devices.iter().all(|d| *d == devices[0]) {
            format!("{} × {}", parts.len(), devices[0])
        } else {
            devices.join(" + ")
        };
        let longest = parts.iter().map(|p| p.batches.len()).max().unwrap_or(0);
        let batches = (0..longest).flat_map(|i| parts.iter().filter_map(move |p| p.batches.get(i).cloned())).collect();
        Some(SampleTiming { device, batches, ranks: parts.iter().map(|p| p.ranks.max(1)).sum(), ..first })
    }
}

/// One (sampler, steps) of the study as read from its folder.
#[derive(Clone, Debug)]
pub struct StudyRun {
    pub dir: PathBuf,
    pub timing: SampleTiming,
    pub quality: EvalReport,
    pub agreement: Option<EvalReport>,
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let s = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&s).map_err(|e| Error::format(path, format!("not the expected JSON: {e}")))
}

impl StudyRun {
    /// Reads `dir/timing.json`, `dir/quality/eval.json` and, when present, `dir/agreement/eval.json`.
    pub fn read(dir: &Path) -> Result<Self> {
        let agreement = dir.join("agreement/eval.json");
        Ok(StudyRun {
            dir: dir.to_path_buf(),
            timing: read_json(&dir.join("timing.json"))?,
            quality: read_json(&dir.join("quality/eval.json"))?,
            agreement: if agreement.is_file() { Some(read_json(&agreement)?) } else { None },
        })
    }
}

/// Every sub-folder of `root` that holds a `timing.json`, in sampler order then by steps.
pub fn read_runs(root: &Path) -> Result<Vec<StudyRun>> {
    let mut runs = Vec::new();
    for e in std::fs::read_dir(root).map_err(|e| Error::io(root, e))? {
        let p = e.map_err(|e| Error::io(root, e))?.path();
        if p.join("timing.json").is_file() {
            runs.push(StudyRun::read(&p)?);
        }
    }
    if runs.is_empty() {
        return Err(Error::data(root, "no run folders (sub-folders with a timing.json) found"));
    }
    sort_runs(&mut runs);
    Ok(runs)
}

fn kind_rank(k: SamplerKind) -> usize {
    SamplerKind::ALL.iter().position(|&x| x == k).unwrap_or(usize::MAX)
}

fn sort_runs(runs: &mut [StudyRun]) {
    runs.sort_by(|a, b| {
        let (sa, sb) = (&a.timing.sampler, &b.timing.sampler);
        (kind_rank(sa.kind), sa.steps, a.dir.clone()).cmp(&(kind_rank(sb.kind), sb.steps, b.dir.clone()))
    });
}

/// The metrics of one run that the table and the verdict use: (name, mean, spread).
fn metrics(r: &StudyRun) -> Vec<(String, Option<Stat>)> {
    let q = &r.quality;
    let ps = q.paired_summary.as_ref();
    let mut m: Vec<(String, Option<Stat>)> = vec![
        ("SSIM".into(), ps.map(|p| p.ssim.clone())),
        ("MS-SSIM".into(), ps.map(|p| p.ms_ssim.clone())),
        ("PSNR dB".into(), ps.map(|p| p.psnr_db.clone())),
        ("PSNR dB (mask)".into(), ps.and_then(|p| p.psnr_db_mask.clone())),
    ];
    for l in &q.labels {
        let name = l.label.map_or("W1 all".to_string(), |v| format!("W1 label {v}"));
        m.push((name, Some(l.w1.clone())));
    }
    m.push(("diversity (pairwise MS-SSIM)".into(), q.diversity.first().and_then(|d| d.pairwise_ms_ssim.clone())));
    m
}

/// The reference row: ancestral DDPM with all T steps.
fn reference(runs: &[StudyRun]) -> Option<&StudyRun> {
    runs.iter().find(|r| r.timing.sampler.kind == SamplerKind::Ddpm && r.timing.sampler.steps == r.timing.timesteps)
}

/// Metrics of `r` outside the reference's seed-to-seed spread (see the module docs).
pub fn outside_spread(r: &StudyRun, reference: &StudyRun) -> Vec<String> {
    let refm = metrics(reference);
    metrics(r)
        .into_iter()
        .zip(refm)
        .filter_map(|((name, s), (_, rs))| match (s, rs) {
            (Some(s), Some(rs)) if s.mean.is_finite() && rs.mean.is_finite() => {
                ((s.mean - rs.mean).abs() > rs.std).then_some(name)
            }
            _ => None,
        })
        .collect()
}

fn f4(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.4}")
    } else if v > 0.0 {
        "∞".into()
    } else {
        "–".into()
    }
}

fn st(s: &Option<Stat>) -> String {
    s.as_ref().map_or("–".into(), |s| format!("{} ± {}", f4(s.mean), f4(s.std)))
}

/// Agreement with DDPM-T (same seeds): paired PSNR, SSIM and MMD per voxel.
fn agreement(r: &StudyRun) -> (Option<Stat>, Option<Stat>, Option<f64>) {
    match &r.agreement {
        Some(a) => {
            let ps = a.paired_summary.as_ref();
            (ps.map(|p| p.psnr_db.clone()), ps.map(|p| p.ssim.clone()), a.mmd.as_ref().map(|m| m.mmd_linear_per_voxel))
        }
        None => (None, None, None),
    }
}

/// "DDPM-T" with the runs' T.
fn ref_name(runs: &[StudyRun]) -> String {
    format!("DDPM-{}", runs.first().map_or(250, |r| r.timing.timesteps))
}

/// The Markdown report: one row per run, then the verdict against DDPM-T.
pub fn markdown(runs: &[StudyRun]) -> String {
    let mut o = String::new();
    let rn = ref_name(runs);
    let _ = writeln!(o, "# Samplers: quality against wall time per volume\n");
    if let Some(r) = runs.first() {
        let t = &r.timing;
        let _ = writeln!(
            o,
            "- device: {}; schedule T = {}; {} volume(s) per run; tool: {}",
            t.device,
            t.timesteps,
            t.volumes(),
            t.tool
        );
        let _ = writeln!(o, "- real volume(s): {}", r.quality.real.join(", "));
        if let Some(m) = &r.quality.mask {
            let _ = writeln!(o, "- mask: {m}");
        }
    }
    let _ = writeln!(
        o,
        "- quality: `meddpm eval` against the real volume (mean ± std over seeds); W1 per label on the \
         [0, 1] scale; diversity = mean pairwise MS-SSIM among seeds (lower = more diverse)"
    );
    let _ = writeln!(
        o,
        "- agreement: `meddpm eval` against {rn}'s volume of the same seed (ancestral DDPM, all steps); \
         MMD per voxel between the two sets"
    );
    let _ = writeln!(o, "- s/volume: batch wall time / volumes, mean over batches after the first\n");
    let names: Vec<String> = runs.first().map(|r| metrics(r).into_iter().map(|m| m.0).collect()).unwrap_or_default();
    let _ = write!(o, "| sampler | steps | s/volume |");
    for n in &names {
        let _ = write!(o, " {n} |");
    }
    let _ = writeln!(o, " PSNR dB vs {rn} | SSIM vs {rn} | MMD/voxel vs {rn} |");
    let _ = writeln!(o, "|{}", "---|".repeat(3 + names.len() + 3));
    for r in runs {
        let s = &r.timing.sampler;
        let label = if s.kind == SamplerKind::Ddim { format!("ddim η={}", s.eta) } else { s.kind.to_string() };
        let _ = write!(o, "| {label} | {} | {} |", s.steps, f4(r.timing.seconds_per_volume()));
        for (_, m) in metrics(r) {
            let _ = write!(o, " {} |", st(&m));
        }
        let (p, q, mmd) = agreement(r);
        let _ = writeln!(o, " {} | {} | {} |", st(&p), st(&q), mmd.map_or("–".into(), |v| format!("{v:.3e}")));
    }
    let _ = writeln!(o, "\n## Within {rn}'s seed-to-seed spread?\n");
    match reference(runs) {
        None => {
            let _ = writeln!(o, "No DDPM row with all T steps: no verdict.");
        }
        Some(refr) => {
            let _ = writeln!(o, "| sampler | steps | s/volume | metrics outside the spread |");
            let _ = writeln!(o, "|---|---|---|---|");
            for r in runs {
                let s = &r.timing.sampler;
                let out = outside_spread(r, refr);
                let verdict = if out.is_empty() { "none: within on every metric".into() } else { out.join(", ") };
                let _ = writeln!(o, "| {} | {} | {} | {verdict} |", s.kind, s.steps, f4(r.timing.seconds_per_volume()));
            }
        }
    }
    o
}

/// CSV: one row per run, means and standard deviations as separate columns.
pub fn csv(runs: &[StudyRun]) -> String {
    let mut o = String::new();
    let names: Vec<String> = runs.first().map(|r| metrics(r).into_iter().map(|m| m.0).collect()).unwrap_or_default();
    let _ = write!(o, "sampler,steps,eta,seconds_per_volume,volumes");
    for n in &names {
        let _ = write!(o, ",{n} mean,{n} std");
    }
    let _ = writeln!(o, ",psnr_vs_ddpm250,ssim_vs_ddpm250,mmd_per_voxel_vs_ddpm250");
    let num = |v: Option<f64>| v.map_or(String::new(), |v| if v.is_finite() { format!("{v}") } else { "inf".into() });
    for r in runs {
        let s = &r.timing.sampler;
        let _ = write!(o, "{},{},{},{},{}", s.kind, s.steps, s.eta, r.timing.seconds_per_volume(), r.timing.volumes());
        for (_, m) in metrics(r) {
            let _ = write!(o, ",{},{}", num(m.as_ref().map(|s| s.mean)), num(m.as_ref().map(|s| s.std)));
        }
        let (p, q, mmd) = agreement(r);
        let _ = writeln!(o, ",{},{},{}", num(p.map(|s| s.mean)), num(q.map(|s| s.mean)), num(mmd));
    }
    o
}

fn color(k: SamplerKind) -> plotters::style::RGBColor {
    use plotters::style::RGBColor;
    match k {
        SamplerKind::Ddpm => RGBColor(31, 119, 180),
        SamplerKind::Ddim => RGBColor(255, 127, 14),
        SamplerKind::DpmSolverPp => RGBColor(44, 160, 44),
        SamplerKind::Ipndm => RGBColor(214, 39, 40),
    }
}

/// Points (seconds per volume, value, steps) per sampler kind for one metric; non-finite dropped.
type Series = Vec<(SamplerKind, Vec<(f64, f64, usize)>)>;

fn series(runs: &[StudyRun], value: &dyn Fn(&StudyRun) -> Option<f64>) -> Series {
    SamplerKind::ALL
        .iter()
        .map(|&k| {
            let pts = runs
                .iter()
                .filter(|r| r.timing.sampler.kind == k)
                .filter_map(|r| {
                    let (x, y) = (r.timing.seconds_per_volume(), value(r)?);
                    (x.is_finite() && x > 0.0 && y.is_finite()).then_some((x, y, r.timing.sampler.steps))
                })
                .collect();
            (k, pts)
        })
        .filter(|(_, p): &(SamplerKind, Vec<_>)| !p.is_empty())
        .collect()
}

/// Quality against wall time per volume (log x), one line per sampler, points labelled with
/// their step count: left, PSNR inside the mask against the real volume (whole-volume PSNR
/// without a mask); right, PSNR against DDPM-T's volume of the same seed (when measured).
pub fn svg(runs: &[StudyRun]) -> Result<String> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| Error::Config(format!("drawing the sampler chart: {e}"));
    let real = |r: &StudyRun| {
        let p = r.quality.paired_summary.as_ref()?;
        Some(p.psnr_db_mask.as_ref().unwrap_or(&p.psnr_db).mean)
    };
    let agree = |r: &StudyRun| Some(r.agreement.as_ref()?.paired_summary.as_ref()?.psnr_db.mean);
    let agree_title = format!("PSNR vs {}, same seed (dB)", ref_name(runs));
    let panels: Vec<(&str, Series)> = vec![
        ("PSNR vs the real volume (dB; inside the mask)", series(runs, &real)),
        (&agree_title, series(runs, &agree)),
    ];
    let panels: Vec<(&str, Series)> = panels.into_iter().filter(|(_, s)| !s.is_empty()).collect();
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (520 * panels.len().max(1) as u32, 440)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let areas = root.split_evenly((1, panels.len().max(1)));
        for ((title, ser), area) in panels.iter().zip(areas) {
            let pts: Vec<(f64, f64)> = ser.iter().flat_map(|(_, p)| p.iter().map(|&(x, y, _)| (x, y))).collect();
            let (x0, x1) = pts.iter().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
            let (y0, y1) = pts.iter().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
            let pad = ((y1 - y0) * 0.1).max(0.5);
            let mut chart = ChartBuilder::on(&area)
                .caption(*title, ("sans-serif", 15))
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(50)
                .build_cartesian_2d((x0 / 1.5..x1 * 1.5).log_scale(), y0 - pad..y1 + pad)
                .map_err(|e| err(&e))?;
            chart.configure_mesh().x_desc("wall time per volume, s (log)").y_desc("dB").draw().map_err(|e| err(&e))?;
            for (k, p) in ser {
                let c = color(*k);
                let mut line: Vec<(f64, f64)> = p.iter().map(|&(x, y, _)| (x, y)).collect();
                line.sort_by(|a, b| a.0.total_cmp(&b.0));
                chart
                    .draw_series(LineSeries::new(line, c.stroke_width(2)))
                    .map_err(|e| err(&e))?
                    .label(k.name())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], c.stroke_width(2)));
                chart
                    .draw_series(p.iter().map(|&(x, y, s)| {
                        EmptyElement::at((x, y))
                            + Circle::new((0, 0), 3, c.filled())
                            + Text::new(format!("{s}"), (4, -12), ("sans-serif", 11).into_font())
                    }))
                    .map_err(|e| err(&e))?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::LowerRight)
                .background_style(WHITE.mix(0.9))
                .border_style(BLACK)
                .draw()
                .map_err(|e| err(&e))?;
        }
        root.present().map_err(|e| err(&e))?;
    }
    Ok(out)
}

/// Writes `samplers.md`, `samplers.csv` and `samplers.svg` into `out` (atomically); returns them.
pub fn write_study(runs: &[StudyRun], out: &Path) -> Result<Vec<PathBuf>> {
    let files = [
        (out.join("samplers.md"), markdown(runs)),
        (out.join("samplers.csv"), csv(runs)),
        (out.join("samplers.svg"), svg(runs)?),
    ];
    for (p, s) in &files {
        write_atomic(p, s.as_bytes())?;
    }
    Ok(files.into_iter().map(|(p, _)| p).collect())
}
