//! `meddpm sample` with the sampler options, run as the built binary on the CPU: two masks and
//! two seeds each in batches of 3 give the very volumes of batch-1 runs; the timing file lists
//! them; bad sampler settings are clear errors (exit code 2).

use meddpm::checkpoint::save_trainer;
use meddpm::cpu::CpuBackend;
use meddpm::data::{read_volume, write_labels};
use meddpm::diffusion::{SamplerKind, TrainConfig, Trainer};
use meddpm::eval::samplers::SampleTiming;
use meddpm::model::UNetConfig;
use std::path::{Path, PathBuf};
use std::process::Command;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meddpm-samplers-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A tiny model (8³) trained for 3 steps on the demo pairs, and two of their masks as files.
fn fixtures(dir: &Path) -> (PathBuf, Vec<PathBuf>) {
    let be = CpuBackend::new();
    let tc = TrainConfig { timesteps: 20, lr: 1e-3, grad_accum: 1, ..TrainConfig::default() };
    let mut tr = Trainer::new(&be, &UNetConfig::tiny(), &tc).unwrap();
    let ds = meddpm::data::demo::dataset_at([8, 8, 8]).unwrap();
    for i in 0..3 {
        tr.train_step(&be, || {
            let s = ds.get(i % ds.len())?;
            Ok((s.image, s.cond))
        })
        .unwrap();
    }
    let ck = dir.join("tiny.safetensors");
    save_trainer(&ck, &be, &tr).unwrap();
    let masks = (0..2)
        .map(|i| {
            let p = dir.join(format!("mask{i}.nii.gz"));
            write_labels(&p, &ds.condition(i).unwrap().1).unwrap();
            p
        })
        .collect();
    (ck, masks)
}

fn meddpm(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_meddpm")).args(args).output().unwrap()
}

#[test]
fn batched_cli_sampling_matches_batch_one_and_records_timing() {
    let dir = scratch("cli");
    let (ck, masks) = fixtures(&dir);
    let (m0, m1) = (masks[0].to_str().unwrap(), masks[1].to_str().unwrap());
    let run = |batch: &str, out: &Path| {
        let o = meddpm(&[
            "sample",
            "--checkpoint",
            ck.to_str().unwrap(),
            "--device",
            "cpu",
            "--timesteps",
            "20",
            "--sampler",
            "ddim",
            "--eta",
            "0.3",
            "--steps",
            "5",
            "--mask",
            m0,
            m1,
            "--num-samples",
            "2",
            "--seed",
            "4",
            "--batch",
            batch,
            "--resize",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    let (b3, b1) = (dir.join("b3/s"), dir.join("b1/s"));
    let log = run("3", &b3);
    assert!(log.contains("ddim 5 steps eta 0.3") && log.contains("3 per batch"), "{log}");
    run("1", &b1);
    for m in ["mask0", "mask1"] {
        for k in 0..2 {
            let name = format!("s_{m}_{k}.nii.gz");
            let a = read_volume(b3.with_file_name(&name)).unwrap();
            let b = read_volume(b1.with_file_name(&name)).unwrap();
            assert!(a.data == b.data, "{name}: batch 3 vs batch 1");
            assert!(b3.with_file_name(format!("s_{m}_{k}.png")).is_file());
        }
    }
    let a = read_volume(b3.with_file_name("s_mask0_0.nii.gz")).unwrap();
    let b = read_volume(b3.with_file_name("s_mask1_0.nii.gz")).unwrap();
    assert!(a.data != b.data, "different masks, different volumes");

    let t: SampleTiming =
        serde_json::from_str(&std::fs::read_to_string(dir.join("b3/s_timing.json")).unwrap()).unwrap();
    assert_eq!((t.sampler.kind, t.sampler.steps, t.sampler.eta), (SamplerKind::Ddim, 5, 0.3));
    assert_eq!((t.batch, t.timesteps, t.volumes(), t.batches.len()), (3, 20, 4, 2));
    let seeds: Vec<u64> = t.batches.iter().flat_map(|b| b.volumes.iter().map(|v| v.seed)).collect();
    assert_eq!(seeds, [4, 5, 4, 5]);
    assert!(
        t.batches[0].volumes[2].file.ends_with("s_mask1_0.nii.gz")
            && t.batches[0].volumes[2].mask.ends_with("mask1.nii.gz")
    );
    assert!(t.seconds_per_volume() > 0.0);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_sampler_settings_are_clear_errors() {
    let dir = scratch("bad");
    let (ck, _) = fixtures(&dir);
    let out = dir.join("x");
    for (extra, want) in [
        (&["--sampler", "ipndm", "--eta", "0.5"][..], "eta (0.5) applies to ddim only, not ipndm"),
        (&["--sampler", "ddim", "--steps", "21"][..], "21 steps: must be between 1 and the schedule's 20 timesteps"),
        (&["--sampler", "ddim", "--eta", "2"][..], "--eta <ETA>': must be a number in [0, 1]"),
        (&["--batch", "0"][..], "--batch <BATCH>': must be a whole number from 1 to 1024"),
    ] {
        let mut args =
            vec!["sample", "--checkpoint", ck.to_str().unwrap(), "--device", "cpu", "--timesteps", "20", "--out"];
        args.push(out.to_str().unwrap());
        args.extend_from_slice(extra);
        let o = meddpm(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(want), "{extra:?}: {err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
