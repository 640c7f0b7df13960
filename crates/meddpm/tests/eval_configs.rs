//! The verdict and metrics of `meddpm eval-configs` (`meddpm::eval::configs`) on synthetic
//! values with closed-form answers, no model needed: which SSIM/MS-SSIM windows a size allows, the
//! agreement of a constant offset, the within-spread rule, labels from a condition tensor and the
//! Markdown of a small report; the pairs to sample (built-in demo pairs at the tiny model's size).

use meddpm::eval::configs::{
    labels_from_cond, metric_names, norm, to_markdown, verdict, ConfigReport, Metrics, PairInfo, Quality, Report,
    Settings, Spread,
};
use meddpm::eval::report::Stat;
use meddpm::model::UNetConfig;

#[test]
fn ms_ssim_only_where_the_size_allows() {
    let (m, note) = Metrics::new([32, 32, 32], None).unwrap();
    assert_eq!(m.ssim.kernel_size, 11);
    assert!(m.ms.is_none() && note.unwrap().contains("32×32×32"));
    let (m, _) = Metrics::new([64, 64, 64], None).unwrap();
    assert_eq!(m.ms.unwrap().ssim.kernel_size, 3); // 5 scales: every axis ≥ 16·k
    let (m, note) = Metrics::new([128, 128, 128], None).unwrap();
    assert_eq!(m.ms.unwrap().ssim.kernel_size, 7); // MONAI at 128³, as `meddpm eval`
    assert!(note.unwrap().contains("window 7"));
    let (m, note) = Metrics::new([176, 192, 192], None).unwrap();
    assert_eq!(m.ms.unwrap().ssim.kernel_size, 11);
    assert!(note.is_none());
}

#[test]
fn agreement_of_a_constant_offset_has_closed_forms() {
    let dims = [12, 12, 12];
    let (m, _) = Metrics::new(dims, Some(5)).unwrap();
    let n = 12 * 12 * 12;
    let b: Vec<f32> = (0..n).map(|i| 0.25 + 0.5 * ((i * 7919) % 101) as f32 / 101.0).collect();
    let c: Vec<f32> = b.iter().map(|v| v + 0.01).collect();
    let (maxd, psnr, ssim) = m.agreement(&c, &b, [-1.0, 1.0]).unwrap();
    assert!((maxd - 0.02).abs() < 1e-6, "{maxd}"); // 0.01 on [0,1] is 0.02 in model units
    assert!((psnr - 40.0).abs() < 1e-3, "{psnr}"); // −10·log10(0.01²)
    assert!(ssim < 1.0 && ssim > 0.99, "{ssim}");
    let (maxd, psnr, ssim) = m.agreement(&b, &b, [-1.0, 1.0]).unwrap();
    assert_eq!((maxd, psnr), (0.0, f64::INFINITY));
    assert!((ssim - 1.0).abs() < 1e-12, "{ssim}");
}

fn q(pair: usize, seed: u64, v: f64) -> Quality {
    Quality { pair, seed, metrics: vec![("psnr_db".into(), v)] }
}

#[test]
fn verdict_rule() {
    let base = vec![q(0, 0, 1.0), q(0, 1, 2.0), q(0, 2, 3.0)];
    let spread = vec![Spread { pair: 0, metric: "psnr_db".into(), stat: Stat::of(&[1.0, 2.0, 3.0]).unwrap() }];
    assert_eq!(spread[0].stat.std, 1.0);
    let near = vec![q(0, 0, 1.5), q(0, 1, 2.0), q(0, 2, 2.75)];
    let v = verdict(&near, &base, &spread, 3).unwrap();
    assert!(v.within_spread && (v.worst_ratio - 0.5).abs() < 1e-12, "{v:?}");
    let far = vec![q(0, 0, 1.0), q(0, 1, 2.0), q(0, 2, 5.0)];
    let v = verdict(&far, &base, &spread, 3).unwrap();
    assert!(!v.within_spread && (v.worst_ratio - 2.0).abs() < 1e-12 && v.worst_metric == "psnr_db", "{v:?}");
    assert!(verdict(&near, &base, &spread, 1).is_none());
    // Zero spread: equal values are within, any difference is not.
    let flat = vec![Spread { pair: 0, metric: "psnr_db".into(), stat: Stat::of(&[2.0, 2.0, 2.0]).unwrap() }];
    let same = vec![q(0, 0, 2.0), q(0, 1, 2.0), q(0, 2, 2.0)];
    assert!(verdict(&same, &same, &flat, 3).unwrap().within_spread);
    let off = vec![q(0, 0, 2.0), q(0, 1, 2.0), q(0, 2, 2.1)];
    assert!(!verdict(&off, &same, &flat, 3).unwrap().within_spread);
}

#[test]
fn a_bad_window_is_a_config_error() {
    for k in [0, 9] {
        let e = Metrics::new([8, 8, 8], Some(k)).err().expect("window outside 1..=8");
        assert!(matches!(e, meddpm::Error::Config(_)) && e.to_string().contains(&format!("window {k}")), "{e}");
    }
}

#[test]
fn labels_follow_the_condition_channel_above_the_midpoint() {
    // Two channels over 4 voxels, values in {−1, +1}: background, label 1, label 2, and a voxel
    // exactly at the midpoint (0) in both channels (background).
    let cond = [-1.0, 1.0, -1.0, 0.0, -1.0, -1.0, 1.0, 0.0];
    assert_eq!(labels_from_cond(&cond, 2, -1.0, 1.0), [0, 1, 2, 0]);
    // Both above the midpoint: the higher value wins.
    assert_eq!(labels_from_cond(&[0.5, 0.9], 2, -1.0, 1.0), [2]);
    assert_eq!(norm(&[-1.0, 0.0, 1.0], [-1.0, 1.0]), [0.0, 0.5, 1.0]);
    let names = metric_names(&[(0, 10), (2, 5)], false);
    assert_eq!(
        names,
        ["ssim", "psnr_db", "psnr_db_mask", "mae", "mae_mask", "mean_label0", "mean_label2", "w1_label0", "w1_label2"]
    );
    assert_eq!(metric_names(&[], true)[..2], ["ssim", "ms_ssim"]);
}

#[test]
fn report_serialises_infinities_as_strings_and_renders_markdown() {
    let (m, note) = Metrics::new([8, 8, 8], None).unwrap();
    let quality = vec![q(0, 0, 20.0), q(0, 1, 22.0)];
    let spread = vec![Spread { pair: 0, metric: "psnr_db".into(), stat: Stat::of(&[20.0, 22.0]).unwrap() }];
    let conf = |name: &str, status: &str| ConfigReport {
        name: name.into(),
        status: status.into(),
        skip_reason: (status == "skipped").then(|| "no CUDA device".into()),
        backend: (status != "skipped").then(|| "cpu".into()),
        seconds: None,
        seconds_per_sample: None,
        agreement: Vec::new(),
        quality: if status == "skipped" { Vec::new() } else { quality.clone() },
        verdict: None,
    };
    let mut ran = conf("tf32/ncdhw", "ran");
    ran.verdict = verdict(&quality, &quality, &spread, 2);
    ran.agreement = vec![meddpm::eval::configs::Agreement {
        pair: 0,
        seed: 0,
        max_abs_diff: 0.0,
        psnr_db: f64::INFINITY,
        ssim: 1.0,
    }];
    let r = Report {
        tool: "test".into(),
        checkpoint: "ck.safetensors".into(),
        checkpoint_step: 7,
        weights: "ema".into(),
        model: UNetConfig::tiny(),
        parameters: 1,
        timesteps: 6,
        seeds: vec![0, 1],
        pairs: vec![PairInfo {
            index: 0,
            mask: "m".into(),
            image: "i".into(),
            labels: vec![(0, 512)],
            real_mean: vec![0.5],
        }],
        settings: Settings {
            intensity_range: [-1.0, 1.0],
            ssim: m.ssim.clone(),
            ms_ssim_kernel: None,
            ms_ssim_note: note,
            psnr_max_val: 1.0,
        },
        baseline: "cpu".into(),
        verdict_rule: "rule".into(),
        configurations: vec![conf("cpu", "baseline"), ran, conf("fp32/ndhwc", "skipped")],
        spread,
        notes: vec!["a note".into()],
    };
    let j = serde_json::to_value(&r).unwrap();
    assert_eq!(j["configurations"][1]["agreement"][0]["psnr_db"], "inf");
    assert_eq!(j["configurations"][1]["verdict"]["worst_ratio"], 0.0);
    assert_eq!(j["configurations"][1]["verdict"]["within_spread"], true);
    let md = to_markdown(&r);
    assert!(md.starts_with("# meddpm eval-configs\n"), "{md}");
    assert!(md.contains("| fp32/ndhwc | — | — | — | — | — | — | skipped: no CUDA device |"), "{md}");
    assert!(md.contains("**within spread**") && md.contains("| ∞ |") && md.contains("- a note"), "{md}");
    assert!(md.contains("| psnr_db | 21.0000 ± 1.4142 |"), "{md}");
}

/// The pairs to sample come at model size with their labels and real-image means, and bad
/// requests are clear errors: no index, an index past the dataset, demo masks for a model with
/// other condition channels.
#[test]
fn pairs_load_at_model_size_and_bad_requests_are_errors() {
    use meddpm::eval::configs::load_pairs;
    let cfg = UNetConfig::tiny();
    let (pairs, source) = load_pairs(None, None, &[1, 0], &cfg, [-1.0, 1.0]).unwrap();
    assert_eq!(source, "built-in demo pairs");
    assert_eq!(pairs.iter().map(|p| p.info.index).collect::<Vec<_>>(), vec![1, 0]);
    let n = cfg.depth * cfg.size * cfg.size;
    for p in &pairs {
        assert_eq!((p.real.len(), p.labels.len(), p.cond.len()), (n, n, 2 * n));
        assert!(p.real.iter().all(|v| (0.0..=1.0).contains(v)), "real image on [0, 1]");
        // every label present is counted, and its mean is that of the real image under it
        assert_eq!(p.info.labels.iter().map(|&(_, c)| c).sum::<usize>(), n);
        for (&(l, c), &m) in p.info.labels.iter().zip(&p.info.real_mean) {
            let s: f64 = p.real.iter().zip(&p.labels).filter(|(_, &x)| x == l).map(|(&v, _)| v as f64).sum();
            assert!((s / c as f64 - m).abs() < 1e-9, "label {l}");
        }
    }
    let e = load_pairs(None, None, &[], &cfg, [-1.0, 1.0]).err().expect("an error").to_string();
    assert!(e.contains("at least one pair"), "{e}");
    let e = load_pairs(None, None, &[0, 7], &cfg, [-1.0, 1.0]).err().expect("an error").to_string();
    assert!(e.contains("pair 7") && e.contains("has 2 pairs"), "{e}");
    let seven = UNetConfig { in_channels: 8, ..UNetConfig::tiny() }; // 7 condition channels
    let e = load_pairs(None, None, &[0], &seven, [-1.0, 1.0]).err().expect("an error").to_string();
    assert!(e.contains("2 condition channels, the model 7"), "{e}");
}
