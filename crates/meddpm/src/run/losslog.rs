//! A run's loss log: `loss.csv` (`step,loss`, one row per optimizer step) and `loss.svg` beside
//! it (the loss and its exponential moving average against the step), both rewritten atomically
//! at each checkpoint.
//!
//! The log belongs to the run, not to one process: a resumed run appends to it. Rows past the
//! checkpoint a run resumes from (steps a crash or a divergence did after the last checkpoint,
//! which the resumed run will redo) are dropped when the log is opened ([`LossLog::open`]), so
//! every step appears once.
//!
//! The plot's EMA is debiased (as Adam's moments): m_t = β·m_{t−1} + (1−β)·x_t, shown as
//! m_t / (1 − β^t), with β = 1 − 1/window and the window a fiftieth of the log (5 to 500 steps,
//! [`ema_beta`]) so that the curve neither lags a short demo run nor stays noisy over a long one;
//! non-finite losses are left out of the plot (they stay in the CSV).
//! Logs longer than [`MAX_POINTS`] are drawn as means of equal runs of steps (the EMA is
//! computed on every step first).

use crate::checkpoint::write_atomic;
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// CSV file name in the run folder.
pub const CSV: &str = "loss.csv";
/// SVG file name in the run folder.
pub const SVG: &str = "loss.svg";
/// The plotted EMA's β for a log of `n` finite rows: 1 − 1/window, window = n/50 in 5..=500.
pub fn ema_beta(n: usize) -> f64 {
    1.0 - 1.0 / (n / 50).clamp(5, 500) as f64
}
/// Most points drawn per series.
pub const MAX_POINTS: usize = 2000;

/// The rows of a run's loss log, kept in memory and written to `loss.csv` / `loss.svg`.
#[derive(Clone, Debug)]
pub struct LossLog {
    csv: PathBuf,
    rows: Vec<(u64, f32)>,
}

/// Parse `step,loss` rows (header `step,loss`; blank lines skipped).
pub fn parse_csv(text: &str, path: &Path) -> Result<Vec<(u64, f32)>> {
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || (i == 0 && line == "step,loss") {
            continue;
        }
        let row = line
            .split_once(',')
            .and_then(|(s, l)| Some((s.trim().parse::<u64>().ok()?, l.trim().parse::<f32>().ok()?)));
        match row {
            Some(r) => rows.push(r),
            None => return Err(Error::format(path, format!("line {}: expected `step,loss`, got `{line}`", i + 1))),
        }
    }
    Ok(rows)
}

impl LossLog {
    /// An empty log for a new run in `dir` (an older `loss.csv` there is replaced at the first
    /// [`flush`](Self::flush)).
    pub fn fresh(dir: &Path) -> LossLog {
        LossLog { csv: dir.join(CSV), rows: Vec::new() }
    }

    /// The log of a run resumed at optimizer step `step` from `csv` (missing: empty). Rows past
    /// `step` are dropped and the file rewritten at once; returns the log and how many rows were
    /// dropped.
    pub fn open(csv: &Path, step: u64) -> Result<(LossLog, usize)> {
        let rows = match std::fs::read_to_string(csv) {
            Ok(t) => parse_csv(&t, csv)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(Error::io(csv, e)),
        };
        let n = rows.len();
        let mut log = LossLog { csv: csv.to_path_buf(), rows };
        log.rows.retain(|&(s, _)| s <= step);
        let dropped = n - log.rows.len();
        if dropped > 0 {
            log.write_csv()?;
        }
        Ok((log, dropped))
    }

    /// Write to `dir` from now on (a resumed run moved with `--out`); the rows come along.
    pub fn move_to(&mut self, dir: &Path) {
        self.csv = dir.join(CSV);
    }

    pub fn csv_path(&self) -> &Path {
        &self.csv
    }
    pub fn svg_path(&self) -> PathBuf {
        self.csv.with_file_name(SVG)
    }
    pub fn rows(&self) -> &[(u64, f32)] {
        &self.rows
    }

    pub fn push(&mut self, step: u64, loss: f32) {
        self.rows.push((step, loss));
    }

    fn write_csv(&self) -> Result<()> {
        let mut s = String::with_capacity(16 * (self.rows.len() + 1));
        s.push_str("step,loss\n");
        for (step, loss) in &self.rows {
            s.push_str(&format!("{step},{loss}\n"));
        }
        write_atomic(&self.csv, s.as_bytes())
    }

    /// Write `loss.csv` and redraw `loss.svg` (both atomic).
    pub fn flush(&self) -> Result<()> {
        self.write_csv()?;
        write_svg(&self.svg_path(), &self.rows)
    }
}

/// The debiased EMA (β = `beta`) of `values`, one per value.
pub fn ema(values: &[f64], beta: f64) -> Vec<f64> {
    let mut m = 0.0;
    let mut pow = 1.0;
    values
        .iter()
        .map(|&x| {
            m = beta * m + (1.0 - beta) * x;
            pow *= beta;
            m / (1.0 - pow)
        })
        .collect()
}

/// Means of `pts` over equal runs so that at most `max` points remain (x and y averaged).
fn thin(pts: &[(f64, f64)], max: usize) -> Vec<(f64, f64)> {
    if pts.len() <= max {
        return pts.to_vec();
    }
    let k = pts.len().div_ceil(max);
    pts.chunks(k)
        .map(|c| {
            let n = c.len() as f64;
            (c.iter().map(|p| p.0).sum::<f64>() / n, c.iter().map(|p| p.1).sum::<f64>() / n)
        })
        .collect()
}

/// Draw the loss and its EMA against the step as an SVG file (atomic). With no finite row the
/// chart has axes and a caption but no curve.
pub fn write_svg(path: &Path, rows: &[(u64, f32)]) -> Result<()> {
    use plotters::prelude::*;
    let pts: Vec<(f64, f64)> = rows.iter().filter(|(_, l)| l.is_finite()).map(|&(s, l)| (s as f64, l as f64)).collect();
    let beta = ema_beta(pts.len());
    let smooth: Vec<(f64, f64)> = {
        let e = ema(&pts.iter().map(|p| p.1).collect::<Vec<_>>(), beta);
        pts.iter().zip(e).map(|(p, e)| (p.0, e)).collect()
    };
    let k = pts.len().div_ceil(MAX_POINTS).max(1);
    let (raw, smooth) = (thin(&pts, MAX_POINTS), thin(&smooth, MAX_POINTS));
    let (x0, x1) = match (pts.first(), pts.last()) {
        (Some(a), Some(b)) if b.0 > a.0 => (a.0, b.0),
        (Some(a), _) => (a.0 - 0.5, a.0 + 0.5),
        _ => (0.0, 1.0),
    };
    let y1 = raw.iter().map(|p| p.1).fold(0.0f64, f64::max).max(1e-6) * 1.05;
    let err = |e: &dyn std::fmt::Display| Error::format(path, format!("could not draw the loss curve: {e}"));
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (820, 480)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let last = rows.last().map(|r| format!(", step {}", r.0)).unwrap_or_default();
        let mut chart = ChartBuilder::on(&root)
            .caption(format!("training loss{last}"), ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(x0..x1, 0.0..y1)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("optimizer step")
            .y_desc("loss")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .draw()
            .map_err(|e| err(&e))?;
        let light = RGBColor(150, 180, 220);
        let raw_label = if k > 1 { format!("loss (mean of {k} steps)") } else { "loss".to_string() };
        chart
            .draw_series(LineSeries::new(raw, light.stroke_width(1)))
            .map_err(|e| err(&e))?
            .label(raw_label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], light.stroke_width(2)));
        let dark = RGBColor(200, 60, 20);
        chart
            .draw_series(LineSeries::new(smooth, dark.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(format!("EMA (β = {beta:.3})"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], dark.stroke_width(2)));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    write_atomic(path, svg.as_bytes())
}
