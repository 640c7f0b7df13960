//! `meddpm synthesize` as the built binary on the CPU with the bundled demo model: an nnU-Net
//! dataset in two batches, the rerun that skips every pair, a folder made with other settings
//! refused (exit code 2), and the MONAI layout. The layouts themselves are checked in the
//! engine's `tests/data_synth.rs`. Skips (saying so) on a build without the bundled model.

use std::path::PathBuf;
use std::process::{Command, Output};

fn meddpm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_meddpm")).args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn ready() -> bool {
    if meddpm::checkpoint::bundled::bytes().is_none() {
        println!("SKIP: no bundled demo model");
        return false;
    }
    true
}

fn scratch(name: &str) -> PathBuf {
    meddpm::testing::scratch_dir(&format!("cli-synth-{name}"))
}

#[test]
fn synthesize_nnunet_resumes_and_refuses_other_settings() {
    if !ready() {
        return;
    }
    let dir = scratch("nnunet");
    let out = dir.to_str().unwrap();
    let args = |seed: &'static str| {
        vec![
            "synthesize",
            "--device",
            "cpu",
            "--format",
            "nnunet",
            "--count",
            "3",
            "--augment",
            "1",
            "--steps",
            "2",
            "--batch",
            "2",
            "--seed",
            seed,
            "--dataset-id",
            "4",
            "--dataset-name",
            "Cli",
            "--out",
            out,
        ]
    };
    let o = meddpm(&args("0"));
    assert!(o.status.success(), "{}", text(&o));
    let root = dir.join("Dataset004_Cli");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(root.join("dataset.json")).unwrap()).unwrap();
    assert_eq!(json["numTraining"], 3);
    assert!(
        root.join("imagesTr/synth_00002_0000.nii.gz").is_file() && root.join("labelsTr/synth_00002.nii.gz").is_file()
    );
    assert_eq!(std::fs::read_to_string(root.join("meddpm_manifest.jsonl")).unwrap().lines().count(), 3);
    let again = meddpm(&args("0"));
    assert!(
        again.status.success() && text(&again).contains("0 made") && text(&again).contains("3 already there"),
        "{}",
        text(&again)
    );
    let other = meddpm(&args("9"));
    assert_eq!(other.status.code(), Some(2), "{}", text(&other));
    assert!(text(&other).contains("other settings"), "{}", text(&other));
}

#[test]
fn synthesize_monai_writes_a_datalist() {
    if !ready() {
        return;
    }
    let dir = scratch("monai");
    let o = meddpm(&[
        "synthesize",
        "--device",
        "cpu",
        "--format",
        "monai",
        "--count",
        "2",
        "--steps",
        "2",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("datalist.json")).unwrap()).unwrap();
    assert_eq!(json["training"].as_array().unwrap().len(), 2);
}
