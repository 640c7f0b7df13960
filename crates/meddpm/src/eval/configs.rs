//! The verdict and report of `meddpm eval-configs` (does a speed switch — TF32, channels-last,
//! bf16, the GPU itself — change what the model generates?), kept free of any backend so it is
//! testable on the CPU: the report types (JSON as written to `eval_configs.json`), the quality
//! and agreement metrics per sample ([`Metrics`]), the within-spread rule ([`verdict`]) and the
//! Markdown table ([`to_markdown`]); the pairs to sample ([`load_pairs`]) and the comparison of
//! the configurations' samples with the baseline's ([`compare_runs`]: quality, agreement, the
//! baseline's seed spread, verdicts). The CLI (`crates/meddpm-cli/src/evalcfg.rs`) samples every
//! configuration and wires these together.
//!
//! Metric definitions are `meddpm eval`'s (MONAI's, see [`super`]): images in [−1, 1] are mapped
//! to [0, 1] first ([`norm`]), so SSIM uses data_range 1 and PSNR max_val 1. MS-SSIM is computed
//! only where 5 scales fit a window of at least 3 (every axis ≥ 48 voxels).

use std::path::Path;

use serde::Serialize;

use super::report::Stat;
use super::ssim::{ms_ssim_kernel_for, MsSsimParams, SsimParams, MS_SSIM_WEIGHTS};
use super::{mae, ms_ssim, psnr, ssim, wasserstein1, Vol};
use crate::data::{Convention, Dataset, Volume};
use crate::model::UNetConfig;
use crate::{Error, Result};

/// One mask/image pair as evaluated.
#[derive(Clone, Debug, Serialize)]
pub struct PairInfo {
    pub index: usize,
    pub mask: String,
    pub image: String,
    /// (label, voxels) at model size.
    pub labels: Vec<(u8, usize)>,
    /// Mean real intensity per label (normalised [0, 1] scale), same order as `labels`.
    pub real_mean: Vec<f64>,
}

/// Metric settings as applied.
#[derive(Clone, Debug, Serialize)]
pub struct Settings {
    /// Mapped to [0, 1] before every metric.
    pub intensity_range: [f64; 2],
    pub ssim: SsimParams,
    /// MS-SSIM window, or None when the volume is too small (see `ms_ssim_note`).
    pub ms_ssim_kernel: Option<usize>,
    pub ms_ssim_note: Option<String>,
    pub psnr_max_val: f64,
}

/// Sample of configuration vs baseline sample, same mask and seed.
#[derive(Clone, Debug, Serialize)]
pub struct Agreement {
    pub pair: usize,
    pub seed: u64,
    /// Max |Δ| in model units ([−1, 1] images).
    pub max_abs_diff: f64,
    /// PSNR of the two volumes on the [0, 1] scale ("inf" when identical).
    #[serde(serialize_with = "super::report::jf64::serialize")]
    pub psnr_db: f64,
    pub ssim: f64,
}

/// Quality metrics of one sample against its real image.
#[derive(Clone, Debug, Serialize)]
pub struct Quality {
    pub pair: usize,
    pub seed: u64,
    /// (metric, value), the same names in the same order for every sample of a pair.
    pub metrics: Vec<(String, f64)>,
}

/// Per-configuration verdict.
#[derive(Clone, Debug, Serialize)]
pub struct Verdict {
    pub within_spread: bool,
    /// Largest max_k |q_k − q_k(baseline)| / σ over masks and metrics.
    #[serde(serialize_with = "super::report::jf64::serialize")]
    pub worst_ratio: f64,
    pub worst_metric: String,
    pub worst_pair: usize,
}

/// Everything measured for one configuration.
#[derive(Clone, Debug, Serialize)]
pub struct ConfigReport {
    pub name: String,
    /// "baseline", "ran" or "skipped".
    pub status: String,
    pub skip_reason: Option<String>,
    pub backend: Option<String>,
    /// Wall time of the configuration: backend start, weight upload, all samples.
    pub seconds: Option<f64>,
    pub seconds_per_sample: Option<f64>,
    pub agreement: Vec<Agreement>,
    pub quality: Vec<Quality>,
    /// None for the baseline, for skipped configurations and with K < 2.
    pub verdict: Option<Verdict>,
}

/// The baseline's seed-to-seed spread of one metric for one mask.
#[derive(Clone, Debug, Serialize)]
pub struct Spread {
    pub pair: usize,
    pub metric: String,
    pub stat: Stat,
}

/// The whole report.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub tool: String,
    pub checkpoint: String,
    pub checkpoint_step: u64,
    pub weights: String,
    pub model: UNetConfig,
    pub parameters: usize,
    pub timesteps: usize,
    pub seeds: Vec<u64>,
    pub pairs: Vec<PairInfo>,
    pub settings: Settings,
    pub baseline: String,
    pub verdict_rule: String,
    pub configurations: Vec<ConfigReport>,
    pub spread: Vec<Spread>,
    pub notes: Vec<String>,
}

/// Maps values on `[lo, hi]` to [0, 1] (the scale every metric here works on).
pub fn norm(v: &[f32], [lo, hi]: [f64; 2]) -> Vec<f32> {
    v.iter().map(|&x| ((x as f64 - lo) / (hi - lo)) as f32).collect()
}

/// Labels from a condition tensor (cond_ch, D, H, W): the channel whose value is strictly above
/// the midpoint of (lo, hi), highest value winning, else 0 (a voxel exactly at the midpoint, as
/// linear resizing can make, is background). Channel c is label c + 1 (whole-head convention).
pub fn labels_from_cond(cond: &[f32], channels: usize, lo: f32, hi: f32) -> Vec<u8> {
    let n = cond.len() / channels;
    let mid = 0.5 * (lo + hi);
    (0..n)
        .map(|i| {
            let mut best = (0u8, mid);
            for c in 0..channels {
                let v = cond[c * n + i];
                if v > best.1 {
                    best = ((c + 1) as u8, v);
                }
            }
            best.0
        })
        .collect()
}

/// Names of the quality metrics for a pair whose mask holds `labels`, in the order
/// [`Metrics::quality`] returns the values.
pub fn metric_names(labels: &[(u8, usize)], with_ms: bool) -> Vec<String> {
    let mut m = vec!["ssim".to_string()];
    if with_ms {
        m.push("ms_ssim".into());
    }
    m.extend(["psnr_db", "psnr_db_mask", "mae", "mae_mask"].map(String::from));
    m.extend(labels.iter().map(|(l, _)| format!("mean_label{l}")));
    m.extend(labels.iter().map(|(l, _)| format!("w1_label{l}")));
    m
}

/// The metric definitions shared by the whole run.
pub struct Metrics {
    pub dims: [usize; 3],
    pub ssim: SsimParams,
    pub ms: Option<MsSsimParams>,
}

impl Metrics {
    /// SSIM window `kernel` (default 11, shrunk to the smallest axis; a given one must be in
    /// 1..=smallest axis); MS-SSIM only with a window ≥ 3 at 5 scales. Returns the note
    /// explaining an absent MS-SSIM.
    pub fn new(dims: [usize; 3], kernel: Option<usize>) -> Result<(Self, Option<String>)> {
        let smallest = *dims.iter().min().expect("3 dims");
        let k = match kernel {
            Some(k) => {
                if k == 0 || k > smallest {
                    return Err(Error::Config(format!(
                        "SSIM window {k}: must be in 1..={smallest} for volumes of {dims:?} (D,H,W)"
                    )));
                }
                k
            }
            None => {
                let k = 11.min(smallest);
                if k % 2 == 0 {
                    k - 1
                } else {
                    k
                }
            }
        };
        let ssim = SsimParams { kernel_size: k, data_range: 1.0, ..SsimParams::default() };
        ssim.validate()?;
        let (ms, note) = match ms_ssim_kernel_for(dims, MS_SSIM_WEIGHTS.len(), k) {
            Ok(km) if km >= 3 => {
                let ms = MsSsimParams {
                    ssim: SsimParams { kernel_size: km, ..ssim.clone() },
                    weights: MS_SSIM_WEIGHTS.to_vec(),
                };
                let note =
                    (km < k).then(|| format!("MS-SSIM uses window {km}: the largest that 5 scales allow at {dims:?}"));
                (Some(ms), note)
            }
            _ => (
                None,
                Some(format!(
                    "MS-SSIM not computed: {}×{}×{} is too small for 5 scales with a window of at least 3 (every axis \
                     needs ≥ 48 voxels; MONAI's check would allow only a 1-voxel window here, which is no structural \
                     similarity)",
                    dims[0], dims[1], dims[2]
                )),
            ),
        };
        Ok((Metrics { dims, ssim, ms }, note))
    }

    /// Quality of one generated volume `g` (normalised) against the real `r` (normalised).
    pub fn quality(&self, g: &[f32], r: &[f32], labels: &[u8], present: &[(u8, usize)]) -> Result<Vec<f64>> {
        let (x, y) = (Vol::new("generated", self.dims, g)?, Vol::new("real", self.dims, r)?);
        let fg: Vec<bool> = labels.iter().map(|&l| l != 0).collect();
        let mut out = vec![ssim(x, y, &self.ssim)?];
        if let Some(ms) = &self.ms {
            out.push(ms_ssim(x, y, ms)?);
        }
        let any_fg = fg.iter().any(|&b| b);
        out.push(psnr(x, y, 1.0, None)?);
        out.push(if any_fg { psnr(x, y, 1.0, Some(&fg))? } else { f64::NAN });
        out.push(mae(x, y, None)?);
        out.push(if any_fg { mae(x, y, Some(&fg))? } else { f64::NAN });
        let sel =
            |v: &[f32], l: u8| -> Vec<f32> { v.iter().zip(labels).filter(|(_, &m)| m == l).map(|(&a, _)| a).collect() };
        for &(l, n) in present {
            out.push(sel(g, l).iter().map(|&v| v as f64).sum::<f64>() / n as f64);
        }
        for &(l, _) in present {
            out.push(wasserstein1(&sel(g, l), &sel(r, l))?);
        }
        Ok(out)
    }

    /// Agreement of a configuration's volume with the baseline's (both normalised).
    pub fn agreement(&self, c: &[f32], b: &[f32], range: [f64; 2]) -> Result<(f64, f64, f64)> {
        let (x, y) = (Vol::new("configuration", self.dims, c)?, Vol::new("baseline", self.dims, b)?);
        x.check_finite("configuration sample")?;
        let max = c.iter().zip(b).map(|(&p, &q)| (p as f64 - q as f64).abs()).fold(0.0, f64::max);
        Ok((max * (range[1] - range[0]), psnr(x, y, 1.0, None)?, ssim(x, y, &self.ssim)?))
    }
}

/// max over masks and metrics of max_k |q_k(config) − q_k(baseline)| / σ(baseline), with σ the
/// baseline's sample std over seeds. 0/0 = 0; x/0 = ∞. None with fewer than 2 seeds.
pub fn verdict(config: &[Quality], baseline: &[Quality], spread: &[Spread], seeds: usize) -> Option<Verdict> {
    if seeds < 2 {
        return None;
    }
    let mut worst = Verdict { within_spread: true, worst_ratio: 0.0, worst_metric: String::new(), worst_pair: 0 };
    for sp in spread {
        let mut dmax = 0.0f64;
        for (c, b) in config.iter().zip(baseline).filter(|(c, _)| c.pair == sp.pair) {
            let get = |q: &Quality| q.metrics.iter().find(|(m, _)| *m == sp.metric).map(|(_, v)| *v);
            if let (Some(x), Some(y)) = (get(c), get(b)) {
                if x.is_finite() && y.is_finite() {
                    dmax = dmax.max((x - y).abs());
                }
            }
        }
        let ratio = if dmax == 0.0 {
            0.0
        } else if sp.stat.std > 0.0 {
            dmax / sp.stat.std
        } else {
            f64::INFINITY
        };
        if ratio > worst.worst_ratio || worst.worst_metric.is_empty() {
            worst.worst_ratio = ratio;
            worst.worst_metric = sp.metric.clone();
            worst.worst_pair = sp.pair;
        }
    }
    worst.within_spread = worst.worst_ratio <= 1.0;
    Some(worst)
}

fn fmt(v: f64, digits: usize) -> String {
    if v.is_nan() {
        "—".into()
    } else if v.is_infinite() {
        if v > 0.0 { "∞" } else { "−∞" }.into()
    } else {
        format!("{v:.digits$}")
    }
}

/// Mean of a metric over every sample of a configuration (NaN when absent).
fn mean_metric(q: &[Quality], name: &str) -> f64 {
    let v: Vec<f64> = q
        .iter()
        .filter_map(|q| q.metrics.iter().find(|(m, _)| m == name).map(|(_, v)| *v))
        .filter(|v| !v.is_nan())
        .collect();
    if v.is_empty() {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// The Markdown report.
pub fn to_markdown(r: &Report) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let m = &r.model;
    let _ = writeln!(s, "# meddpm eval-configs\n");
    let _ = writeln!(
        s,
        "- checkpoint: `{}` (step {}, {} weights); model {}×{}×{}, {} base channels, mult {:?}, {} parameters",
        r.checkpoint,
        r.checkpoint_step,
        r.weights,
        m.depth,
        m.size,
        m.size,
        m.model_channels,
        m.channel_mult,
        r.parameters
    );
    let _ = writeln!(
        s,
        "- sampling: {} ancestral DDPM steps; seeds {:?} per mask; masks: {}",
        r.timesteps,
        r.seeds,
        r.pairs.iter().map(|p| format!("pair {} (`{}`)", p.index, p.mask)).collect::<Vec<_>>().join(", ")
    );
    let _ = writeln!(
        s,
        "- metrics: intensities [{}, {}] → [0, 1]; SSIM Gaussian window {} (σ {}); MS-SSIM: {}; PSNR max 1",
        r.settings.intensity_range[0],
        r.settings.intensity_range[1],
        r.settings.ssim.kernel_size,
        r.settings.ssim.sigma,
        match (r.settings.ms_ssim_kernel, &r.settings.ms_ssim_note) {
            (Some(k), _) => format!("5 scales, window {k}"),
            (None, Some(n)) => n.trim_start_matches("MS-SSIM ").to_string(),
            (None, None) => "not computed".into(),
        }
    );
    let _ = writeln!(s, "- baseline: **{}**; verdict rule: {}", r.baseline, r.verdict_rule);
    let cols: Vec<&str> = r.configurations.iter().filter(|c| c.status != "skipped").map(|c| c.name.as_str()).collect();
    let _ = writeln!(
        s,
        "- panels `panel_pair<i>.png` (seed {}): mask | real | {}\n",
        r.seeds.first().copied().unwrap_or(0),
        cols.join(" | ")
    );

    let _ = writeln!(s, "## Verdict and agreement with the baseline (same mask, same seed)\n");
    let _ = writeln!(
        s,
        "| configuration | backend | s / sample | max \\|Δ\\| | min PSNR dB | min SSIM | worst max\\|Δq\\|/σ (metric, pair) | verdict |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for c in &r.configurations {
        if c.status == "skipped" {
            let _ = writeln!(
                s,
                "| {} | — | — | — | — | — | — | skipped: {} |",
                c.name,
                c.skip_reason.as_deref().unwrap_or("")
            );
            continue;
        }
        let maxd = c.agreement.iter().map(|a| a.max_abs_diff).fold(0.0, f64::max);
        let minp = c.agreement.iter().map(|a| a.psnr_db).fold(f64::INFINITY, f64::min);
        let mins = c.agreement.iter().map(|a| a.ssim).fold(f64::INFINITY, f64::min);
        let maxd_s = format!("{maxd:.3e}");
        let (worst, verdict) = match (&c.verdict, c.status.as_str()) {
            (_, "baseline") => ("—".to_string(), "baseline".to_string()),
            (Some(v), _) => (
                format!("{} ({}, pair {})", fmt(v.worst_ratio, 3), v.worst_metric, v.worst_pair),
                if v.within_spread { "**within spread**".into() } else { "**outside spread**".into() },
            ),
            (None, _) => ("—".into(), "no spread (K < 2)".into()),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            c.name,
            c.backend.as_deref().unwrap_or(""),
            c.seconds_per_sample.map_or("—".into(), |v| fmt(v, 2)),
            maxd_s,
            fmt(minp, 1),
            fmt(mins, 6),
            worst,
            verdict
        );
    }

    // Quality table: metrics common to every pair.
    let mut names: Vec<String> = Vec::new();
    if let Some(c) = r.configurations.first() {
        for q in &c.quality {
            for (n, _) in &q.metrics {
                if !names.contains(n) {
                    names.push(n.clone());
                }
            }
        }
    }
    let _ = writeln!(s, "\n## Quality against the real image (mean over masks × seeds)\n");
    let _ = writeln!(s, "| configuration | {} |", names.join(" | "));
    let _ = writeln!(s, "|---|{}", "---|".repeat(names.len()));
    for c in r.configurations.iter().filter(|c| c.status != "skipped") {
        let cells: Vec<String> = names.iter().map(|n| fmt(mean_metric(&c.quality, n), 4)).collect();
        let _ = writeln!(s, "| {} | {} |", c.name, cells.join(" | "));
    }
    let real_cells: Vec<String> = names
        .iter()
        .map(|n| match n.strip_prefix("mean_label").and_then(|l| l.parse::<u8>().ok()) {
            Some(l) => {
                let v: Vec<f64> = r
                    .pairs
                    .iter()
                    .filter_map(|p| p.labels.iter().position(|x| x.0 == l).map(|i| p.real_mean[i]))
                    .collect();
                fmt(v.iter().sum::<f64>() / v.len().max(1) as f64, 4)
            }
            None => "—".into(),
        })
        .collect();
    let _ = writeln!(s, "| real | {} |", real_cells.join(" | "));

    let _ = writeln!(
        s,
        "\n## Seed-to-seed spread of the baseline ({}; mean ± std over {} seeds)\n",
        r.baseline,
        r.seeds.len()
    );
    let _ = writeln!(
        s,
        "| metric | {} |",
        r.pairs.iter().map(|p| format!("pair {}", p.index)).collect::<Vec<_>>().join(" | ")
    );
    let _ = writeln!(s, "|---|{}", "---|".repeat(r.pairs.len()));
    for n in &names {
        let cells: Vec<String> = r
            .pairs
            .iter()
            .map(|p| {
                r.spread
                    .iter()
                    .find(|sp| sp.pair == p.index && sp.metric == *n)
                    .map_or("—".into(), |sp| format!("{} ± {}", fmt(sp.stat.mean, 4), fmt(sp.stat.std, 4)))
            })
            .collect();
        let _ = writeln!(s, "| {n} | {} |", cells.join(" | "));
    }
    if !r.notes.is_empty() {
        let _ = writeln!(s, "\n## Notes\n");
        for n in &r.notes {
            let _ = writeln!(s, "- {n}");
        }
    }
    s
}

/// A mask/image pair at model size plus the native volumes for the panel.
pub struct PairData {
    pub info: PairInfo,
    pub cond: Vec<f32>,
    /// Real image at model size, [0, 1].
    pub real: Vec<f32>,
    /// Label per voxel at model size.
    pub labels: Vec<u8>,
    pub mask_vol: Volume,
    pub real_vol: Volume,
}

/// The pairs `indices` to sample, at model size: from mask and image folders (paired by the digits
/// in file names, whole-head conventions), or without them the built-in demo pairs; with a
/// description of the source.
pub fn load_pairs(
    masks: Option<&Path>,
    images: Option<&Path>,
    indices: &[usize],
    cfg: &UNetConfig,
    range: [f64; 2],
) -> Result<(Vec<PairData>, String)> {
    let size = [cfg.depth, cfg.size, cfg.size];
    let mut conv = Convention::whole_head();
    conv.num_labels = cfg.cond_channels() + 1;
    let (ds, source) = match (masks, images) {
        (Some(m), Some(i)) => {
            (Dataset::from_folders(m, &[i.to_path_buf()], conv, size)?, format!("{} with {}", m.display(), i.display()))
        }
        _ => {
            if cfg.cond_channels() != 2 {
                return Err(Error::Config(format!(
                    "the built-in demo masks have 2 condition channels, the model {}; give masks and images",
                    cfg.cond_channels()
                )));
            }
            (crate::data::demo::dataset_at(size)?, "built-in demo pairs".to_string())
        }
    };
    if indices.is_empty() {
        return Err(Error::Config("give at least one pair index".into()));
    }
    let mut out = Vec::new();
    for &i in indices {
        if i >= ds.len() {
            return Err(Error::Config(format!(
                "pair {i}: the dataset ({source}) has {} pairs (indices 0..{})",
                ds.len(),
                ds.len()
            )));
        }
        let sample = ds.get(i)?;
        let (mask_vol, images) = ds.load(i)?;
        let (lo, hi) = ds.convention().cond_values();
        let labels = labels_from_cond(&sample.cond, sample.cond_channels, lo, hi);
        let real = norm(&sample.image, range);
        let mut counts = [0usize; 256];
        for &l in &labels {
            counts[l as usize] += 1;
        }
        let present: Vec<(u8, usize)> =
            counts.iter().enumerate().filter(|(_, &c)| c > 0).map(|(l, &c)| (l as u8, c)).collect();
        let real_mean = present
            .iter()
            .map(|&(l, n)| {
                real.iter().zip(&labels).filter(|(_, &m)| m == l).map(|(&v, _)| v as f64).sum::<f64>() / n as f64
            })
            .collect();
        let pair = &ds.pairs()[i];
        out.push(PairData {
            info: PairInfo {
                index: i,
                mask: pair.mask.name().display().to_string(),
                image: pair.images[0].name().display().to_string(),
                labels: present,
                real_mean,
            },
            cond: sample.cond,
            real,
            labels,
            mask_vol,
            real_vol: images.into_iter().next().expect("whole-head: one image"),
        });
    }
    Ok((out, source))
}

/// `samples[pair][seed]`: one host volume per mask and seed.
pub type Samples = Vec<Vec<Vec<f32>>>;

/// The samples of one configuration that ran: `samples[pair][seed]`, host (1, D, H, W).
pub struct Run {
    pub name: String,
    pub backend: String,
    pub seconds: f64,
    pub seconds_per_sample: f64,
    pub samples: Samples,
}

/// Quality, agreement with `runs[0]` (the baseline), the baseline's spread and the verdicts.
pub fn compare_runs(
    runs: &[Run],
    pairs: &[PairData],
    seeds: &[u64],
    metrics: &Metrics,
    range: [f64; 2],
) -> Result<(Vec<ConfigReport>, Vec<Spread>)> {
    let dims = metrics.dims;
    let mut configurations = Vec::new();
    let mut all_quality: Vec<Vec<Quality>> = Vec::new();
    for (ci, r) in runs.iter().enumerate() {
        let mut quality = Vec::new();
        let mut agreement = Vec::new();
        for (pi, p) in pairs.iter().enumerate() {
            let names = metric_names(&p.info.labels, metrics.ms.is_some());
            for (k, &seed) in seeds.iter().enumerate() {
                let what = format!("{} sample (pair {}, seed {seed})", r.name, p.info.index);
                let g = norm(&r.samples[pi][k], range);
                Vol::new(&what, dims, &g)?.check_finite(&what)?;
                let vals = metrics.quality(&g, &p.real, &p.labels, &p.info.labels)?;
                quality.push(Quality { pair: p.info.index, seed, metrics: names.iter().cloned().zip(vals).collect() });
                let b = norm(&runs[0].samples[pi][k], range);
                let (max_abs_diff, psnr_db, ssim) = metrics.agreement(&g, &b, range)?;
                agreement.push(Agreement { pair: p.info.index, seed, max_abs_diff, psnr_db, ssim });
            }
        }
        all_quality.push(quality.clone());
        configurations.push(ConfigReport {
            name: r.name.clone(),
            status: if ci == 0 { "baseline".into() } else { "ran".into() },
            skip_reason: None,
            backend: Some(r.backend.clone()),
            seconds: Some(r.seconds),
            seconds_per_sample: Some(r.seconds_per_sample),
            agreement,
            quality,
            verdict: None,
        });
    }
    let mut spread = Vec::new();
    for p in pairs {
        for name in metric_names(&p.info.labels, metrics.ms.is_some()) {
            let vals: Vec<f64> = all_quality[0]
                .iter()
                .filter(|q| q.pair == p.info.index)
                .filter_map(|q| q.metrics.iter().find(|(m, _)| *m == name).map(|(_, v)| *v))
                .filter(|v| !v.is_nan())
                .collect();
            if let Some(stat) = Stat::of(&vals) {
                spread.push(Spread { pair: p.info.index, metric: name, stat });
            }
        }
    }
    for ci in 1..configurations.len() {
        configurations[ci].verdict = verdict(&all_quality[ci], &all_quality[0], &spread, seeds.len());
    }
    Ok((configurations, spread))
}
