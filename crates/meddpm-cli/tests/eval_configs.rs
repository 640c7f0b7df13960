//! Tests of `meddpm eval-configs` (`src/evalcfg.rs`) on the CPU only, as CI runs them.
//!
//! A tiny model (8³, `UNetConfig::tiny()`) is trained for a few steps on the built-in demo pairs
//! with `meddpm::diffusion::Trainer` and saved with `meddpm::checkpoint::save_trainer`; the
//! command then samples it. Checks against independent computations: a sample redrawn here with
//! `Sampler` and its PSNR/MAE/mean against the real image computed by hand; which configurations
//! run and which are reported as skipped (`--device cpu`, and `--device auto` without CUDA); the
//! comparison of several configurations. The verdict rule and the metrics on synthetic values
//! are tested with the library (`crates/meddpm/tests/eval_configs.rs`).

#[allow(dead_code, unused_imports, unused_macros)]
#[path = "../src/args.rs"]
mod args;
#[allow(dead_code)]
#[path = "../src/evalcfg.rs"]
mod evalcfg;

use clap::Parser;
use evalcfg::{parse_config, Config, EvalConfigsArgs};
use meddpm::checkpoint::{save_trainer, Checkpoint};
use meddpm::cpu::CpuBackend;
use meddpm::diffusion::{Sampler, Schedule, TrainConfig, Trainer};
use meddpm::eval::configs::{self, Metrics};
use meddpm::model::{UNet, UNetConfig};
use meddpm::{Layout, Precision};
use std::path::{Path, PathBuf};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    a: EvalConfigsArgs,
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meddpm-evalcfg-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

const T: usize = 6;

/// A tiny whole-head model trained for 4 optimizer steps on the demo pairs at 8³.
fn tiny_checkpoint(dir: &Path) -> PathBuf {
    let be = CpuBackend::new();
    let cfg = UNetConfig::tiny();
    let tc =
        TrainConfig { timesteps: T, lr: 1e-3, grad_accum: 1, ema_start: 0, ema_every: 1, ..TrainConfig::default() };
    let mut tr = Trainer::new(&be, &cfg, &tc).unwrap();
    let ds = meddpm::data::demo::dataset_at([8, 8, 8]).unwrap();
    let mut i = 0;
    for _ in 0..4 {
        tr.train_step(&be, || {
            let s = ds.get(i % ds.len())?;
            i += 1;
            Ok((s.image, s.cond))
        })
        .unwrap();
    }
    let p = dir.join("tiny.safetensors");
    save_trainer(&p, &be, &tr).unwrap();
    p
}

fn args(ck: &Path, out: &Path, extra: &[&str]) -> EvalConfigsArgs {
    let mut v = vec!["x", "--checkpoint", ck.to_str().unwrap(), "--out", out.to_str().unwrap()];
    v.extend_from_slice(extra);
    Cli::try_parse_from(v).unwrap().a
}

fn json(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("eval_configs.json")).unwrap()).unwrap()
}

#[test]
fn cpu_run_reports_and_matches_an_independent_sample() {
    let dir = scratch("cpu");
    let ck = tiny_checkpoint(&dir);
    let out = dir.join("out");
    let a = args(&ck, &out, &["--device", "cpu", "--configs", "fp32/ncdhw,tf32/ndhwc", "--seeds", "3", "--seed", "5"]);
    evalcfg::run(&a).unwrap();
    for f in ["eval_configs.json", "eval_configs.md", "panel_pair0.png", "panel_pair1.png"] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    let r = json(&out);
    assert_eq!(r["baseline"], "cpu");
    assert_eq!(r["timesteps"], T);
    assert_eq!(r["seeds"], serde_json::json!([5, 6, 7]));
    let confs = r["configurations"].as_array().unwrap();
    let names: Vec<&str> = confs.iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["cpu", "fp32/ncdhw", "tf32/ndhwc"]);
    assert_eq!(confs[0]["status"], "baseline");
    for c in &confs[1..] {
        assert_eq!(c["status"], "skipped");
        assert!(c["skip_reason"].as_str().unwrap().contains("--device cpu"), "{c}");
    }
    // The baseline against itself: identical volumes.
    for ag in confs[0]["agreement"].as_array().unwrap() {
        assert_eq!(ag["max_abs_diff"], 0.0);
        assert_eq!(ag["psnr_db"], "inf");
    }
    // 8³: SSIM window 7 (largest odd ≤ 8), no MS-SSIM.
    assert_eq!(r["settings"]["ssim"]["kernel_size"], 7);
    assert!(r["settings"]["ms_ssim_kernel"].is_null());
    assert!(r["settings"]["ms_ssim_note"].as_str().unwrap().contains("too small"));
    let md = std::fs::read_to_string(out.join("eval_configs.md")).unwrap();
    assert!(md.contains("skipped") && md.contains("MS-SSIM") && md.contains("| real |"), "{md}");

    // Redraw pair 1, seed 6 here and compute PSNR, MAE and the background mean by hand.
    let ckp = Checkpoint::read(&ck).unwrap();
    let cfg = ckp.unet.clone().unwrap();
    let be = CpuBackend::new();
    let mut net = UNet::new(&be, &cfg, 1).unwrap();
    let specs = net.specs.clone();
    net.set_params(&be, &ckp.group("ema", &specs).unwrap()).unwrap();
    let s = meddpm::data::demo::dataset_at([8, 8, 8]).unwrap().get(1).unwrap();
    let mut sampler = Sampler::new(&be, &net).unwrap();
    let v = sampler.sample(&be, &mut net, &Schedule::cosine(T), &s.cond, 6, |_| {}).unwrap();
    let n = v.len() as f64;
    let d: Vec<f64> = v.iter().zip(&s.image).map(|(&g, &r)| (g as f64 - r as f64) / 2.0).collect();
    let mse = d.iter().map(|x| x * x).sum::<f64>() / n;
    let want_psnr = -10.0 * mse.log10();
    let want_mae = d.iter().map(|x| x.abs()).sum::<f64>() / n;
    // Background: neither condition channel is above the midpoint 0 of {−1, +1} (at 8³ the
    // resized condition has fractional values, some exactly 0: those count as background).
    let bg: Vec<f64> = (0..v.len())
        .filter(|&i| s.cond[i] <= 0.0 && s.cond[v.len() + i] <= 0.0)
        .map(|i| (v[i] as f64 + 1.0) / 2.0)
        .collect();
    assert!(bg.len() > 10 && bg.len() < v.len() - 10, "{} background voxels", bg.len());
    let want_bg = bg.iter().sum::<f64>() / bg.len() as f64;
    let q = confs[0]["quality"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["pair"] == 1 && q["seed"] == 6)
        .expect("pair 1 seed 6");
    let get = |name: &str| -> f64 {
        q["metrics"].as_array().unwrap().iter().find(|m| m[0] == name).unwrap()[1].as_f64().unwrap()
    };
    assert!((get("psnr_db") - want_psnr).abs() < 1e-4, "psnr {} vs {want_psnr}", get("psnr_db"));
    assert!((get("mae") - want_mae).abs() < 1e-6, "mae {} vs {want_mae}", get("mae"));
    assert!((get("mean_label0") - want_bg).abs() < 1e-6, "bg mean {} vs {want_bg}", get("mean_label0"));

    // Spread: std over the 3 seeds of the baseline's PSNR for pair 1, by hand.
    let ps: Vec<f64> = confs[0]["quality"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|q| q["pair"] == 1)
        .map(|q| q["metrics"].as_array().unwrap().iter().find(|m| m[0] == "psnr_db").unwrap()[1].as_f64().unwrap())
        .collect();
    assert_eq!(ps.len(), 3);
    let m = ps.iter().sum::<f64>() / 3.0;
    let sd = (ps.iter().map(|p| (p - m).powi(2)).sum::<f64>() / 2.0).sqrt();
    let sp = r["spread"].as_array().unwrap().iter().find(|s| s["pair"] == 1 && s["metric"] == "psnr_db").unwrap();
    assert!((sp["stat"]["std"].as_f64().unwrap() - sd).abs() < 1e-9);

    // Without CUDA, --device auto runs only the CPU reference and lists the GPU ones as skipped.
    if meddpm_cuda::probe().is_ok() {
        eprintln!("skip: a CUDA device is present, so --device auto would run the GPU configurations");
    } else {
        let out2 = dir.join("auto");
        evalcfg::run(&args(&ck, &out2, &["--seeds", "2", "--pairs", "0"])).unwrap();
        let r = json(&out2);
        assert_eq!(r["baseline"], "cpu");
        let confs = r["configurations"].as_array().unwrap();
        assert_eq!(confs.len(), 7, "cpu + the six GPU configurations (fp32, tf32, bf16 × two layouts)");
        assert!(confs[1..]
            .iter()
            .all(|c| c["status"] == "skipped" && c["skip_reason"].as_str().unwrap().contains("CUDA")));
        assert!(!out2.join("panel_pair1.png").exists());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dir = scratch("bad");
    let ck = tiny_checkpoint(&dir);
    let out = dir.join("out");
    let e = evalcfg::run(&args(&ck, &out, &["--device", "cpu", "--pairs", "0,5"])).unwrap_err();
    assert!(format!("{e:#}").contains("has 2 pairs"), "{e:#}");
    let e = Cli::try_parse_from(["x", "--checkpoint", "c", "--out", "o", "--seeds", "0"]).err().unwrap().to_string();
    assert!(e.contains("--seeds") && e.contains("from 1 to 1000"), "{e}");
    let e = evalcfg::run(&args(&ck, &out, &["--device", "cpu", "--kernel-size", "9"])).unwrap_err();
    assert!(format!("{e:#}").contains("--kernel-size 9"), "{e:#}");
    let e = evalcfg::run(&args(&dir.join("missing.safetensors"), &out, &["--device", "cpu"])).unwrap_err();
    assert!(format!("{e:#}").contains("missing.safetensors"), "{e:#}");
    assert!(Cli::try_parse_from(["x", "--checkpoint", "c", "--out", "o", "--configs", "fp16/ncdhw"]).is_err());
    assert!(Cli::try_parse_from(["x", "--checkpoint", "c", "--out", "o", "--device", "gpu"]).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn configuration_names_parse() {
    assert_eq!(parse_config("cpu"), Ok(Config::Cpu));
    assert_eq!(parse_config("TF32/NDHWC"), Ok(Config::Cuda(Precision::Tf32, Layout::Ndhwc)));
    assert_eq!(parse_config("fp32/ncdhw"), Ok(Config::Cuda(Precision::Fp32, Layout::Ncdhw)));
    assert_eq!(parse_config("bf16/ndhwc"), Ok(Config::Cuda(Precision::Bf16, Layout::Ndhwc)));
    for bad in ["", "gpu", "fp32", "fp32/", "fp16/ndhwc", "tf32/nchw", "fp32/ncdhw/x"] {
        assert!(parse_config(bad).is_err(), "{bad}");
    }
    for c in ["cpu", "fp32/ncdhw", "tf32/ncdhw", "fp32/ndhwc", "tf32/ndhwc", "bf16/ncdhw", "bf16/ndhwc"] {
        assert_eq!(parse_config(c).unwrap().name(), c);
    }
}

/// The comparison path the GPU takes (several configurations, `meddpm::eval::configs::compare_runs`),
/// fed with CPU samples: a copy of
/// the baseline shifted by 1e-4 must agree to 1e-4 and stay within spread; a copy scaled by 0.5
/// must fall outside.
#[test]
fn several_configurations_compare_against_the_baseline() {
    let dir = scratch("cmp");
    let ck = tiny_checkpoint(&dir);
    let a = args(&ck, &dir.join("out"), &["--device", "cpu"]);
    let ckp = Checkpoint::read(&ck).unwrap();
    let cfg = ckp.unet.clone().unwrap();
    let (pairs, _) = configs::load_pairs(a.masks.as_deref(), a.images.as_deref(), &a.pairs, &cfg, [-1.0, 1.0]).unwrap();
    let be = CpuBackend::new();
    let mut net = UNet::new(&be, &cfg, 1).unwrap();
    let specs = net.specs.clone();
    net.set_params(&be, &ckp.group("ema", &specs).unwrap()).unwrap();
    let mut sampler = Sampler::new(&be, &net).unwrap();
    let seeds = [0u64, 1, 2];
    let base: Vec<Vec<Vec<f32>>> = pairs
        .iter()
        .map(|p| {
            seeds
                .iter()
                .map(|&s| sampler.sample(&be, &mut net, &Schedule::cosine(T), &p.cond, s, |_| {}).unwrap())
                .collect()
        })
        .collect();
    let map = |f: &dyn Fn(f32) -> f32| -> Vec<Vec<Vec<f32>>> {
        base.iter().map(|p| p.iter().map(|v| v.iter().map(|&x| f(x)).collect()).collect()).collect()
    };
    let run = |name: &str, samples| configs::Run {
        name: name.into(),
        backend: "test".into(),
        seconds: 0.0,
        seconds_per_sample: 0.0,
        samples,
    };
    let runs = vec![run("base", base.clone()), run("shift", map(&|x| x + 1e-4)), run("half", map(&|x| 0.5 * x))];
    let (m, _) = Metrics::new([8, 8, 8], None).unwrap();
    let (reps, spread) = configs::compare_runs(&runs, &pairs, &seeds, &m, [-1.0, 1.0]).unwrap();
    assert_eq!(reps.len(), 3);
    assert_eq!(reps[0].status, "baseline");
    assert!(reps[0].verdict.is_none());
    assert_eq!(spread.len(), 2 * (1 + 4 + 2 * pairs[0].info.labels.len()));
    let shift = &reps[1];
    assert_eq!(shift.agreement.len(), 6);
    for ag in &shift.agreement {
        assert!((ag.max_abs_diff - 1e-4).abs() < 2e-6, "{ag:?}"); // f32 rounding of x + 1e-4
        assert!((ag.psnr_db - 86.02).abs() < 0.1, "{ag:?}"); // −10·log10((0.5e-4)²)
    }
    let v = shift.verdict.as_ref().unwrap();
    assert!(v.within_spread, "{v:?}");
    let v = reps[2].verdict.as_ref().unwrap();
    assert!(!v.within_spread && v.worst_ratio > 1.0, "{v:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
