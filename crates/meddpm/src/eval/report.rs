//! The evaluation of generated volumes against real ones, as one serialisable report
//! (JSON via serde, Markdown via [`EvalReport::to_markdown`]). Used by `meddpm eval`.
//!
//! Conventions (all recorded in the report):
//! - Intensities are mapped from `intensity_range` [lo, hi] (Med-DDPM images: [-1, 1]) to [0, 1]
//!   by (v − lo)/(hi − lo) before every metric, so SSIM/MS-SSIM use data_range 1 and PSNR uses
//!   max_val 1. Values outside the range are kept (not clipped).
//! - One window size serves SSIM and MS-SSIM: the given one, or the largest odd k ≤ 11 that
//!   MONAI's MS-SSIM accepts for the volume size (7 at 128³).
//! - Pairing: with one real volume every generated volume is paired with it. With several, a
//!   generated file is paired with the real file whose stem equals its stem or is its prefix
//!   followed by '_', '-' or '.' (longest wins; `sample_3` pairs `sample_3_s0.nii.gz`). Unpaired
//!   volumes get no paired metrics (a note says so).
//! - Diversity: mean pairwise MS-SSIM among generated volumes of the same pairing group (= drawn
//!   for the same mask); lower = more diverse. With ≥ 2 real volumes, their pairwise MS-SSIM is
//!   also given (different subjects, so only a loose yardstick).
//! - The optional mask is one label map for all volumes (0 = background; Med-DDPM: 1 head/brain,
//!   2 tumour). "Inside the mask" means label ≠ 0. Per-label statistics pool the real voxels of
//!   all real volumes; each generated volume gets its own W1 and mean, summarised as a [`Stat`].
//! - Documented values instead of errors: PSNR of identical volumes is +∞ (JSON: the string
//!   "inf"); a statistic that cannot be formed (MMD with < 2 volumes per side, diversity with one
//!   sample, masked metrics with an empty mask) is absent (JSON null) and a note says why.
//!   Errors: no volumes, size mismatches, NaN/∞ voxels, volumes too small for MS-SSIM.

use serde::{Deserialize, Serialize};

use super::ssim::{ms_ssim, ms_ssim_kernel_for, ssim, MsSsimParams, SsimParams, MS_SSIM_WEIGHTS};
use super::stats::{mae, mmd_linear, psnr, sorted_f64, wasserstein1_sorted};
use super::{check_same_dims, Vol};
use crate::{Error, Result};

/// A volume with the name it is reported under (usually its file name).
#[derive(Clone, Debug)]
pub struct NamedVolume {
    pub name: String,
    pub dims: [usize; 3],
    pub data: Vec<f32>,
}

/// A label map with its name.
#[derive(Clone, Debug)]
pub struct NamedLabels {
    pub name: String,
    pub dims: [usize; 3],
    pub labels: Vec<u8>,
}

/// What the caller chooses.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalSettings {
    /// [lo, hi] mapped to [0, 1] before all metrics.
    pub intensity_range: [f64; 2],
    /// SSIM/MS-SSIM window; `None` = largest odd k ≤ 11 that fits MS-SSIM.
    pub kernel_size: Option<usize>,
}

impl Default for EvalSettings {
    fn default() -> Self {
        EvalSettings { intensity_range: [-1.0, 1.0], kernel_size: None }
    }
}

/// Summary of a list of values. `std` is the sample standard deviation (n−1; 0 when n = 1).
/// +∞ values (PSNR of identical volumes) are left out of mean/std/min/max and counted in `n_inf`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stat {
    pub n: usize,
    #[serde(with = "jf64")]
    pub mean: f64,
    #[serde(with = "jf64")]
    pub std: f64,
    #[serde(with = "jf64")]
    pub min: f64,
    #[serde(with = "jf64")]
    pub max: f64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub n_inf: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl Stat {
    /// `None` for an empty list. Values must not be NaN (callers never produce NaN).
    pub fn of(values: &[f64]) -> Option<Stat> {
        if values.is_empty() {
            return None;
        }
        let fin: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
        let n_inf = values.len() - fin.len();
        if fin.is_empty() {
            let v = values[0];
            return Some(Stat { n: values.len(), mean: v, std: 0.0, min: v, max: v, n_inf });
        }
        let k = fin.len() as f64;
        let mean = fin.iter().sum::<f64>() / k;
        let std =
            if fin.len() > 1 { (fin.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (k - 1.0)).sqrt() } else { 0.0 };
        let min = fin.iter().copied().fold(f64::INFINITY, f64::min);
        let max = fin.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        Some(Stat { n: values.len(), mean, std, min, max, n_inf })
    }
}

/// Metrics of one generated volume against its paired real volume.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PairedMetrics {
    pub generated: String,
    pub real: String,
    pub ssim: f64,
    pub ms_ssim: f64,
    #[serde(with = "jf64")]
    pub psnr_db: f64,
    pub mae: f64,
    /// Inside the mask (label ≠ 0); absent without a mask or with an empty one.
    #[serde(with = "jf64opt")]
    pub psnr_db_mask: Option<f64>,
    pub mae_mask: Option<f64>,
}

/// Summary of the paired metrics over all pairs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PairedSummary {
    pub ssim: Stat,
    pub ms_ssim: Stat,
    pub psnr_db: Stat,
    pub mae: Stat,
    pub psnr_db_mask: Option<Stat>,
    pub mae_mask: Option<Stat>,
}

/// Diversity of the samples drawn for one mask (one pairing group).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DiversityGroup {
    /// The real volume the group is paired with (None: the unpaired volumes).
    pub real: Option<String>,
    pub n_samples: usize,
    /// Pairwise MS-SSIM over the n(n−1)/2 pairs; None with < 2 samples.
    pub pairwise_ms_ssim: Option<Stat>,
}

/// MONAI linear-kernel MMD between the real and generated sets.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MmdReport {
    pub n_real: usize,
    pub n_generated: usize,
    /// MONAI's value (sums over voxels, so it scales with the volume size).
    pub mmd_linear: f64,
    /// `mmd_linear` divided by the voxel count (comparable across sizes).
    pub mmd_linear_per_voxel: f64,
}

/// Intensity statistics inside one label (None = the whole volume).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LabelReport {
    pub label: Option<u8>,
    /// Voxels of this label in one volume.
    pub n_voxels: usize,
    /// Mean intensity of the pooled real voxels (normalised scale).
    pub real_mean: f64,
    /// Mean intensity per generated volume.
    pub generated_mean: Stat,
    /// Wasserstein-1 between each generated volume's voxels and the pooled real voxels.
    pub w1: Stat,
}

/// Settings as applied.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResolvedSettings {
    pub intensity_range: [f64; 2],
    /// MS-SSIM settings (data_range is 1 after the intensity mapping); SSIM's are the same but
    /// for the window, `ssim_kernel`.
    pub ms_ssim: MsSsimParams,
    /// SSIM's window: MONAI's 11, or the largest odd size the volume holds when smaller (MS-SSIM's
    /// five scales need a smaller one: at 32³ only 1, which is no structural similarity).
    #[serde(default)]
    pub ssim_kernel: usize,
    /// PSNR max_val (1 after the intensity mapping).
    pub psnr_max_val: f64,
    /// True when the window was chosen automatically from the volume size.
    pub kernel_size_auto: bool,
}

/// The full evaluation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalReport {
    pub tool: String,
    pub settings: ResolvedSettings,
    pub dims: [usize; 3],
    pub real: Vec<String>,
    pub generated: Vec<String>,
    pub mask: Option<String>,
    /// (label, voxel count) of the mask.
    pub mask_labels: Vec<(u8, usize)>,
    pub paired: Vec<PairedMetrics>,
    pub paired_summary: Option<PairedSummary>,
    pub diversity: Vec<DiversityGroup>,
    /// Pairwise MS-SSIM among the real volumes (≥ 2 needed).
    pub real_pairwise_ms_ssim: Option<Stat>,
    pub mmd: Option<MmdReport>,
    pub labels: Vec<LabelReport>,
    pub notes: Vec<String>,
}

fn stem(name: &str) -> &str {
    let file = name.rsplit(['/', '\\']).next().unwrap_or(name);
    file.strip_suffix(".nii.gz").or_else(|| file.strip_suffix(".nii")).unwrap_or(file)
}

/// Index of the real volume a generated volume is paired with (see the module docs).
pub fn pair_index(generated: &str, reals: &[&str]) -> Option<usize> {
    if reals.len() == 1 {
        return Some(0);
    }
    let g = stem(generated);
    reals
        .iter()
        .enumerate()
        .filter(|(_, r)| {
            let r = stem(r);
            g == r || (g.starts_with(r) && matches!(g.as_bytes().get(r.len()), Some(b'_' | b'-' | b'.')))
        })
        .max_by_key(|(_, r)| stem(r).len())
        .map(|(i, _)| i)
}

fn normalise(v: &NamedVolume, lo: f64, hi: f64) -> Vec<f32> {
    let s = 1.0 / (hi - lo);
    v.data.iter().map(|&x| ((x as f64 - lo) * s) as f32).collect()
}

fn pairwise_ms_ssim(vols: &[&[f32]], dims: [usize; 3], p: &MsSsimParams) -> Result<Option<Stat>> {
    let mut vals = Vec::new();
    for i in 0..vols.len() {
        for j in i + 1..vols.len() {
            vals.push(ms_ssim(Vol { dims, data: vols[i] }, Vol { dims, data: vols[j] }, p)?);
        }
    }
    Ok(Stat::of(&vals))
}

/// How `volumes` sit in the intensity `range` the metrics map to [0, 1]: the share of voxels
/// outside it, and the values' min and max. A range most voxels fall outside (raw intensities
/// read with the default `[-1, 1]`) makes every metric meaningless.
pub fn range_fit(volumes: &[NamedVolume], range: [f64; 2]) -> (f64, [f64; 2]) {
    let (mut out, mut n) = (0usize, 0usize);
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in volumes.iter().flat_map(|v| v.data.iter()).map(|&x| x as f64) {
        n += 1;
        out += usize::from(v < range[0] || v > range[1]);
        lo = lo.min(v);
        hi = hi.max(v);
    }
    (if n == 0 { 0.0 } else { out as f64 / n as f64 }, [lo, hi])
}

/// Evaluates `generated` against `real` (see the module docs for every convention).
pub fn evaluate(
    real: &[NamedVolume],
    generated: &[NamedVolume],
    mask: Option<&NamedLabels>,
    settings: &EvalSettings,
) -> Result<EvalReport> {
    if real.is_empty() || generated.is_empty() {
        return Err(Error::data(
            "eval",
            format!("needs ≥ 1 real and ≥ 1 generated volume, got {} and {}", real.len(), generated.len()),
        ));
    }
    let [lo, hi] = settings.intensity_range;
    if !(lo.is_finite() && hi.is_finite() && hi > lo) {
        return Err(Error::Config(format!("intensity_range must be finite with lo < hi, got [{lo}, {hi}]")));
    }
    let dims = real[0].dims;
    for v in real.iter().chain(generated) {
        let vol = Vol::new(&v.name, v.dims, &v.data)?;
        check_same_dims(&v.name, dims, vol.dims)?;
        vol.check_finite(&v.name)?;
    }
    if let Some(m) = mask {
        check_same_dims(&m.name, dims, m.dims)?;
        if m.labels.len() != dims.iter().product::<usize>() {
            return Err(Error::data(&m.name, format!("{} labels for dims {:?}", m.labels.len(), m.dims)));
        }
    }

    let kernel_size_auto = settings.kernel_size.is_none();
    let smallest = *dims.iter().min().expect("3 dims");
    let (k, ssim_k) = match settings.kernel_size {
        Some(k) => (k, k),
        None => (ms_ssim_kernel_for(dims, MS_SSIM_WEIGHTS.len(), 11)?, 11.min((smallest.max(1) - 1) | 1)),
    };
    let ms = MsSsimParams {
        ssim: SsimParams { kernel_size: k, data_range: 1.0, ..SsimParams::default() },
        weights: MS_SSIM_WEIGHTS.to_vec(),
    };
    ms.validate()?;
    let ssim_p = SsimParams { kernel_size: ssim_k, ..ms.ssim.clone() };
    let mut notes = Vec::new();
    if kernel_size_auto && k < 3 {
        notes.push(format!(
            "at {}×{}×{} MS-SSIM's {} scales leave room for a {k}³ window only: MS-SSIM is not a structural \
             similarity at this size (SSIM uses a {ssim_k}³ window)",
            dims[0],
            dims[1],
            dims[2],
            MS_SSIM_WEIGHTS.len()
        ));
    }

    let rn: Vec<Vec<f32>> = real.iter().map(|v| normalise(v, lo, hi)).collect();
    let gn: Vec<Vec<f32>> = generated.iter().map(|v| normalise(v, lo, hi)).collect();
    fn vol(dims: [usize; 3], data: &[f32]) -> Vol<'_> {
        Vol { dims, data }
    }
    let fg: Option<Vec<bool>> = mask.map(|m| m.labels.iter().map(|&l| l != 0).collect());
    let fg = match fg {
        Some(f) if !f.iter().any(|&b| b) => {
            notes.push("the mask has no foreground voxels (label ≠ 0): masked PSNR/MAE are absent".into());
            None
        }
        f => f,
    };

    // Paired metrics.
    let real_names: Vec<&str> = real.iter().map(|v| v.name.as_str()).collect();
    let pairing: Vec<Option<usize>> = generated.iter().map(|g| pair_index(&g.name, &real_names)).collect();
    let mut paired = Vec::new();
    for (gi, ri) in pairing.iter().enumerate() {
        let Some(ri) = *ri else {
            notes.push(format!("{}: no real volume pairs with it by name; no paired metrics", generated[gi].name));
            continue;
        };
        let (x, y) = (vol(dims, &gn[gi]), vol(dims, &rn[ri]));
        let fgm = fg.as_deref();
        paired.push(PairedMetrics {
            generated: generated[gi].name.clone(),
            real: real[ri].name.clone(),
            ssim: ssim(x, y, &ssim_p)?,
            ms_ssim: ms_ssim(x, y, &ms)?,
            psnr_db: psnr(x, y, 1.0, None)?,
            mae: mae(x, y, None)?,
            psnr_db_mask: fgm.map(|m| psnr(x, y, 1.0, Some(m))).transpose()?,
            mae_mask: fgm.map(|m| mae(x, y, Some(m))).transpose()?,
        });
    }
    if paired.iter().any(|p| p.psnr_db.is_infinite()) {
        notes.push("some generated volume equals its real volume: PSNR = inf (left out of the mean)".into());
    }
    let paired_summary = if paired.is_empty() {
        None
    } else {
        let col = |f: &dyn Fn(&PairedMetrics) -> Option<f64>| -> Vec<f64> { paired.iter().filter_map(f).collect() };
        Some(PairedSummary {
            ssim: Stat::of(&col(&|p| Some(p.ssim))).expect("non-empty"),
            ms_ssim: Stat::of(&col(&|p| Some(p.ms_ssim))).expect("non-empty"),
            psnr_db: Stat::of(&col(&|p| Some(p.psnr_db))).expect("non-empty"),
            mae: Stat::of(&col(&|p| Some(p.mae))).expect("non-empty"),
            psnr_db_mask: Stat::of(&col(&|p| p.psnr_db_mask)),
            mae_mask: Stat::of(&col(&|p| p.mae_mask)),
        })
    };

    // Diversity per pairing group, and the real-vs-real yardstick.
    let mut groups: Vec<Option<usize>> = pairing.clone();
    groups.sort();
    groups.dedup();
    let mut diversity = Vec::new();
    for g in groups {
        let members: Vec<&[f32]> =
            pairing.iter().zip(&gn).filter(|(p, _)| **p == g).map(|(_, v)| v.as_slice()).collect();
        let stat = pairwise_ms_ssim(&members, dims, &ms)?;
        if stat.is_none() {
            notes.push(format!(
                "diversity needs ≥ 2 samples per mask; group {} has {}",
                g.map_or("(unpaired)", |r| real[r].name.as_str()),
                members.len()
            ));
        }
        diversity.push(DiversityGroup {
            real: g.map(|r| real[r].name.clone()),
            n_samples: members.len(),
            pairwise_ms_ssim: stat,
        });
    }
    let real_refs: Vec<&[f32]> = rn.iter().map(|v| v.as_slice()).collect();
    let real_pairwise_ms_ssim = pairwise_ms_ssim(&real_refs, dims, &ms)?;

    // MMD.
    let mmd = if real.len() >= 2 && generated.len() >= 2 {
        let rv: Vec<Vol> = rn.iter().map(|v| vol(dims, v)).collect();
        let gv: Vec<Vol> = gn.iter().map(|v| vol(dims, v)).collect();
        let v = mmd_linear(&rv, &gv)?;
        Some(MmdReport {
            n_real: real.len(),
            n_generated: generated.len(),
            mmd_linear: v,
            mmd_linear_per_voxel: v / rn[0].len() as f64,
        })
    } else {
        notes.push(format!(
            "MMD needs ≥ 2 real and ≥ 2 generated volumes (got {} and {}): absent",
            real.len(),
            generated.len()
        ));
        None
    };

    // Per-label intensity statistics (None = whole volume).
    let mut label_ids: Vec<Option<u8>> = vec![None];
    let mut mask_labels = Vec::new();
    if let Some(m) = mask {
        let mut counts = [0usize; 256];
        for &l in &m.labels {
            counts[l as usize] += 1;
        }
        for (l, &c) in counts.iter().enumerate().filter(|(_, &c)| c > 0) {
            mask_labels.push((l as u8, c));
            label_ids.push(Some(l as u8));
        }
    }
    let mut labels = Vec::new();
    for l in label_ids {
        let sel = |v: &[f32]| -> Vec<f32> {
            match (l, mask) {
                (Some(l), Some(m)) => v.iter().zip(&m.labels).filter(|(_, &x)| x == l).map(|(&a, _)| a).collect(),
                _ => v.to_vec(),
            }
        };
        let pooled: Vec<f32> = rn.iter().flat_map(|v| sel(v)).collect();
        let real_mean = pooled.iter().map(|&v| v as f64).sum::<f64>() / pooled.len() as f64;
        let pooled_sorted = sorted_f64(&pooled);
        let mut means = Vec::new();
        let mut w1s = Vec::new();
        for g in &gn {
            let s = sel(g);
            means.push(s.iter().map(|&v| v as f64).sum::<f64>() / s.len() as f64);
            w1s.push(wasserstein1_sorted(&sorted_f64(&s), &pooled_sorted));
        }
        labels.push(LabelReport {
            label: l,
            n_voxels: pooled.len() / rn.len(),
            real_mean,
            generated_mean: Stat::of(&means).expect("≥ 1 generated volume"),
            w1: Stat::of(&w1s).expect("≥ 1 generated volume"),
        });
    }

    Ok(EvalReport {
        tool: format!("meddpm {} eval", env!("CARGO_PKG_VERSION")),
        settings: ResolvedSettings {
            intensity_range: settings.intensity_range,
            ms_ssim: ms,
            ssim_kernel: ssim_k,
            psnr_max_val: 1.0,
            kernel_size_auto,
        },
        dims,
        real: real_names.iter().map(|s| s.to_string()).collect(),
        generated: generated.iter().map(|v| v.name.clone()).collect(),
        mask: mask.map(|m| m.name.clone()),
        mask_labels,
        paired,
        paired_summary,
        diversity,
        real_pairwise_ms_ssim,
        mmd,
        labels,
        notes,
    })
}

fn f(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 { "∞" } else { "−∞" }.into()
    } else {
        format!("{v:.4}")
    }
}

fn fo(v: Option<f64>) -> String {
    v.map_or("–".into(), f)
}

fn st(s: &Stat) -> String {
    let inf = if s.n_inf > 0 { format!(" (+{} ∞)", s.n_inf) } else { String::new() };
    format!("{} ± {}{inf}", f(s.mean), f(s.std))
}

fn sto(s: &Option<Stat>) -> String {
    s.as_ref().map_or("–".into(), st)
}

impl EvalReport {
    /// JSON (pretty). Infinite values are written as the strings "inf"/"-inf".
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("the report holds only serialisable values")
    }

    /// A human-readable report: settings, paired metrics, diversity, MMD, per-label statistics.
    pub fn to_markdown(&self) -> String {
        let s = &self.settings;
        let p = &s.ms_ssim;
        let mut o = String::new();
        let mut line = |t: String| {
            o.push_str(&t);
            o.push('\n');
        };
        line(format!("# Synthesis-quality report ({})\n", self.tool));
        line(format!(
            "- volumes: {} real, {} generated, {}×{}×{} (D×H×W){}",
            self.real.len(),
            self.generated.len(),
            self.dims[0],
            self.dims[1],
            self.dims[2],
            self.mask.as_ref().map_or(String::new(), |m| format!("; mask `{m}`"))
        ));
        line(format!(
            "- intensities mapped from [{}, {}] to [0, 1]; SSIM/MS-SSIM (MONAI definition): Gaussian window {}³ \
             (SSIM) and {}³ (MS-SSIM){}, σ {}, K1 {}, K2 {}, data_range {}; MS-SSIM weights {:?}; PSNR max_val {}",
            s.intensity_range[0],
            s.intensity_range[1],
            s.ssim_kernel,
            p.ssim.kernel_size,
            if s.kernel_size_auto { " (chosen for the size)" } else { "" },
            p.ssim.sigma,
            p.ssim.k1,
            p.ssim.k2,
            p.ssim.data_range,
            p.weights,
            s.psnr_max_val
        ));
        if !self.mask_labels.is_empty() {
            let l: Vec<String> = self.mask_labels.iter().map(|(l, c)| format!("{l}: {c}")).collect();
            line(format!("- mask voxels per label: {}", l.join(", ")));
        }
        line(String::new());
        if let Some(ps) = &self.paired_summary {
            line("## Generated vs paired real (mean ± std over pairs)\n".into());
            line("| SSIM | MS-SSIM | PSNR dB | MAE | PSNR dB (mask) | MAE (mask) |".into());
            line("|---|---|---|---|---|---|".into());
            line(format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                st(&ps.ssim),
                st(&ps.ms_ssim),
                st(&ps.psnr_db),
                st(&ps.mae),
                sto(&ps.psnr_db_mask),
                sto(&ps.mae_mask)
            ));
            line("| generated | real | SSIM | MS-SSIM | PSNR dB | MAE | PSNR dB (mask) | MAE (mask) |".into());
            line("|---|---|---|---|---|---|---|---|".into());
            for q in &self.paired {
                line(format!(
                    "| {} | {} | {} | {} | {} | {} | {} | {} |",
                    q.generated,
                    q.real,
                    f(q.ssim),
                    f(q.ms_ssim),
                    f(q.psnr_db),
                    f(q.mae),
                    fo(q.psnr_db_mask),
                    fo(q.mae_mask)
                ));
            }
            line(String::new());
        }
        line("## Diversity (pairwise MS-SSIM among samples of one mask; lower = more diverse)\n".into());
        line("| mask / paired real | samples | pairwise MS-SSIM |".into());
        line("|---|---|---|".into());
        for d in &self.diversity {
            line(format!(
                "| {} | {} | {} |",
                d.real.as_deref().unwrap_or("(unpaired)"),
                d.n_samples,
                sto(&d.pairwise_ms_ssim)
            ));
        }
        if let Some(r) = &self.real_pairwise_ms_ssim {
            line(format!("| real vs real (different subjects) | {} pairs | {} |", r.n, st(r)));
        }
        line(String::new());
        if let Some(m) = &self.mmd {
            line(format!(
                "## MMD (MONAI, linear kernel on voxels)\n\n{} real vs {} generated: {:.6e} ({:.6e} per voxel)\n",
                m.n_real, m.n_generated, m.mmd_linear, m.mmd_linear_per_voxel
            ));
        }
        line("## Intensity per label (normalised scale; W1 = Wasserstein-1 to the pooled real voxels)\n".into());
        line("| label | voxels | real mean | generated mean | W1 |".into());
        line("|---|---|---|---|---|".into());
        for l in &self.labels {
            line(format!(
                "| {} | {} | {} | {} | {} |",
                l.label.map_or("all".into(), |v| v.to_string()),
                l.n_voxels,
                f(l.real_mean),
                st(&l.generated_mean),
                st(&l.w1)
            ));
        }
        if !self.notes.is_empty() {
            line("\n## Notes\n".into());
            for n in &self.notes {
                line(format!("- {n}"));
            }
        }
        o
    }
}

/// f64 that may be ±∞: JSON number when finite, else the string "inf" / "-inf" ("nan" for NaN,
/// which the report never holds).
pub(crate) mod jf64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else if v.is_nan() {
            s.serialize_str("nan")
        } else if *v > 0.0 {
            s.serialize_str("inf")
        } else {
            s.serialize_str("-inf")
        }
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Num {
        F(f64),
        S(String),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        match Num::deserialize(d)? {
            Num::F(v) => Ok(v),
            Num::S(s) => match s.as_str() {
                "inf" => Ok(f64::INFINITY),
                "-inf" => Ok(f64::NEG_INFINITY),
                "nan" => Ok(f64::NAN),
                _ => Err(serde::de::Error::custom(format!("expected a number, \"inf\" or \"-inf\", got {s:?}"))),
            },
        }
    }
}

/// `Option<f64>` with the same encoding as `jf64` (None = null).
mod jf64opt {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            None => s.serialize_none(),
            Some(x) => super::jf64::serialize(x, s),
        }
    }

    #[derive(Deserialize)]
    struct W(#[serde(with = "super::jf64")] f64);

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
        Ok(Option::<W>::deserialize(d)?.map(|w| w.0))
    }
}
