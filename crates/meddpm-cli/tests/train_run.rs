//! End-to-end tests of `meddpm train` as a process (tiny preset, CPU): a run is a folder that
//! `--resume` continues, and it stops safely. Faults are real where a test can make them real:
//! SIGINT / SIGTERM sent to the child with `kill`, a second signal during the step, and NaN /
//! full-disk injection through the documented `MEDDPM_FAULT_*` variables (`meddpm::run::session`).
//! Also: error messages name a missing file and the OS reason once.

use meddpm::checkpoint::{save_trainer, Checkpoint};
use meddpm::cpu::CpuBackend;
use meddpm::data::{write_labels, write_volume, Volume};
use meddpm::diffusion::{TrainConfig, Trainer};
use meddpm::model::UNetConfig;
use meddpm::run::RunRecord;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{meddpm, run};

fn scratch(name: &str) -> PathBuf {
    common::scratch("trainrun", name)
}

fn tiny(out: &Path, steps: u64, every: u64) -> Vec<String> {
    ["train", "--preset", "tiny", "--device", "cpu", "--no-sample", "--out", out.to_str().unwrap()]
        .iter()
        .map(|s| s.to_string())
        .chain(["--steps".into(), steps.to_string(), "--checkpoint-every".into(), every.to_string()])
        .collect()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// The optimizer steps in a run folder's loss.csv.
fn logged(dir: &Path) -> Vec<u64> {
    let t = std::fs::read_to_string(dir.join("loss.csv")).unwrap();
    t.lines().skip(1).map(|l| l.split(',').next().unwrap().parse().unwrap()).collect()
}

fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < Duration::from_secs(300), "gave up waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn kill(child: &Child, sig: &str) {
    let ok = Command::new("kill").args([&format!("-{sig}"), &child.id().to_string()]).status().unwrap();
    assert!(ok.success(), "kill -{sig} failed");
}

/// Start a long tiny run in `dir/run`, wait for its first periodic checkpoint, send `sig`, and
/// check the safe stop: exit 0, "stopped at step N", a checkpoint of step N that loads, N rows in
/// loss.csv, and the resume command. Returns (N, resume command).
fn stop_with(dir: &Path, sig: &str) -> (u64, String) {
    let out = dir.join("run");
    let mut child = meddpm(dir, &strs(&tiny(&out, 1_000_000, 5)), &[])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the first checkpoint", || out.join("checkpoint.safetensors").is_file());
    kill(&child, sig);
    let status = child.wait().unwrap();
    let mut stdout = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut stdout).unwrap();
    assert_eq!(status.code(), Some(0), "exit status after SIG{sig}; stdout:\n{stdout}");
    let line = stdout.lines().find(|l| l.starts_with("stopped at step ")).expect("a 'stopped at step' line");
    let n: u64 = line["stopped at step ".len()..].split_whitespace().next().unwrap().parse().unwrap();
    assert!(n >= 5, "{line}");
    let ck = Checkpoint::read(&out.join("checkpoint.safetensors")).unwrap();
    assert_eq!(ck.step, n, "the checkpoint is not of the step printed");
    ck.restore_trainer(&CpuBackend::new()).unwrap();
    assert_eq!(logged(&out), (1..=n).collect::<Vec<_>>());
    let cmd = stdout.lines().find_map(|l| l.strip_prefix("resume with: ")).expect("a resume command").to_string();
    (n, cmd)
}

#[test]
fn sigint_finishes_the_step_saves_and_prints_a_working_resume_command() {
    let dir = scratch("sigint");
    let (n, cmd) = stop_with(&dir, "INT");
    let out = dir.join("run").canonicalize().unwrap();
    let words = shlex::split(&cmd).unwrap();
    assert_eq!(words[..3], ["meddpm", "train", "--resume"], "{cmd}");
    assert_eq!(Path::new(&words[3]), out.join("checkpoint.safetensors"));
    // Run it, from another directory, with a nearer step target than the recorded million.
    let elsewhere = scratch("sigint-elsewhere");
    let target = (n + 2).to_string();
    let mut args: Vec<&str> = words[1..].iter().map(String::as_str).collect();
    args.extend(["--steps", &target]);
    let (code, stdout, stderr) = run(&elsewhere, &args, &[]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stderr.contains(&format!("note: --steps {target} overrides the run's 1000000")), "{stderr}");
    assert!(stdout.contains(&format!("steps {n} → {target}")), "{stdout}");
    assert_eq!(Checkpoint::read(&out.join("checkpoint.safetensors")).unwrap().step, n + 2);
    assert_eq!(logged(&out), (1..=n + 2).collect::<Vec<_>>(), "loss.csv appended, not restarted");
    assert!(!elsewhere.join("runs").exists(), "the resumed run wrote into the working directory");
}

#[test]
fn sigterm_finishes_the_step_and_saves() {
    let dir = scratch("sigterm");
    let (_, cmd) = stop_with(&dir, "TERM");
    assert!(cmd.ends_with("--device cpu"), "the device chosen is part of the resume command: {cmd}");
}

#[test]
fn a_second_signal_aborts_at_once_and_the_previous_checkpoint_stays_intact() {
    // Every step is made slow (the batch fetches inside it sleep 1 s each), so the first signal,
    // sent right after a checkpoint appears, lands in a running step and the second one arrives
    // while that step is still finishing. (Without it the demo step took ~0.1 s and the first
    // signal could fall between steps: the run then stopped before the second came.)
    let dir = scratch("abort");
    let out = dir.join("run");
    let args =
        ["train", "--preset", "tiny", "--device", "cpu", "--no-sample", "--steps", "1000", "--checkpoint-every", "1"];
    let mut child = meddpm(&dir, &args, &[("MEDDPM_FAULT_SLOW_STEP_MS", "1000")])
        .args(["--out", out.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the first checkpoint", || out.join("checkpoint.safetensors").is_file());
    // past the checkpoint's loss-log writes, well inside the next (2 s) step
    std::thread::sleep(Duration::from_millis(200));
    kill(&child, "INT");
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while !line.starts_with("stop requested") {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "stderr closed before the stop message");
    }
    kill(&child, "INT");
    let status = child.wait().unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    assert_eq!(status.code(), Some(meddpm::run::stop::ABORT_STATUS), "{rest}");
    assert!(rest.contains("aborted at once; the checkpoint of step"), "{rest}");
    assert!(rest.contains("resume with: meddpm train --resume"), "the abort names the resume command: {rest}");
    let mut stdout = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut stdout).unwrap();
    assert!(!stdout.contains("resume with"), "{stdout}");
    let ck = Checkpoint::read(&out.join("checkpoint.safetensors")).unwrap();
    assert!(ck.step >= 1);
    ck.restore_trainer(&CpuBackend::new()).unwrap();
}

#[test]
fn nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint() {
    let dir = scratch("nan");
    let out = dir.join("run");
    let (code, stdout, stderr) = run(&dir, &strs(&tiny(&out, 10, 2)), &[("MEDDPM_FAULT_NAN_AT_STEP", "5")]);
    assert_eq!(code, 2, "{stdout}\n{stderr}");
    assert!(stderr.contains("test fault injection armed: NaN image batch at step 5"), "{stderr}");
    assert!(
        stderr.contains("training diverged at step 5: the loss is NaN; the last good checkpoint (step 4) is kept"),
        "{stderr}"
    );
    let ck = Checkpoint::read(&out.join("checkpoint.safetensors")).unwrap();
    assert_eq!(ck.step, 4);
    assert!(ck.tensors.values().all(|(_, v)| v.iter().all(|x| x.is_finite())));
    // Resuming redoes step 5 (the NaN row is dropped from the log) and reaches the target.
    let ckp = out.join("checkpoint.safetensors");
    let (code, _, stderr) = run(&dir, &["train", "--resume", ckp.to_str().unwrap(), "--device", "cpu"], &[]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("1 row(s) past step 4 dropped"), "{stderr}");
    assert_eq!(logged(&out), (1..=10).collect::<Vec<_>>());
}

#[test]
fn full_disk_gives_a_clear_error_and_keeps_the_old_checkpoint() {
    let dir = scratch("disk");
    let out = dir.join("run");
    let (code, stdout, stderr) = run(&dir, &strs(&tiny(&out, 10, 2)), &[("MEDDPM_FAULT_DISK_FULL_AT_STEP", "4")]);
    assert_eq!(code, 2, "{stdout}\n{stderr}");
    let ck = out.canonicalize().unwrap().join("checkpoint.safetensors");
    let msg = stderr.lines().find(|l| l.starts_with("error: ")).unwrap();
    assert_eq!(
        msg,
        format!(
            "error: {} not written: no space left on device (injected); checkpoint of step 4 lost; the previous \
             checkpoint (step 2) is intact",
            ck.display()
        )
    );
    assert_eq!(Checkpoint::read(&ck).unwrap().step, 2);
    assert!(!out.join("checkpoint.safetensors.tmp").exists());
}

/// Write phantom pairs `keys` under `dir/mask`, `dir/image`.
fn write_pairs(dir: &Path, keys: &[u32]) {
    std::fs::create_dir_all(dir.join("mask")).unwrap();
    std::fs::create_dir_all(dir.join("image")).unwrap();
    for &k in keys {
        let (img, cond) = meddpm::phantom::pair(8, 8, 8, k);
        let labels: Vec<f32> = (0..512)
            .map(|i| {
                if cond[512 + i] > 0.0 {
                    2.0
                } else if cond[i] > 0.0 {
                    1.0
                } else {
                    0.0
                }
            })
            .collect();
        write_labels(dir.join(format!("mask/m{k}.nii.gz")), &Volume::new([8; 3], [1.0; 3], labels)).unwrap();
        write_volume(dir.join(format!("image/i{k}.nii.gz")), &Volume::new([8; 3], [1.0; 3], img)).unwrap();
    }
}

#[test]
fn resume_continues_in_the_checkpoint_folder_on_the_recorded_data_and_reports_changes() {
    let dir = scratch("resume");
    let data = dir.join("data");
    write_pairs(&data, &[0, 1, 2]);
    let out = dir.join("run");
    let mut args = tiny(&out, 3, 0);
    args.extend(["--masks".into(), "data/mask".into(), "--images".into(), "data/image".into()]);
    // Relative data paths, in `dir`.
    let (code, stdout, stderr) = run(&dir, &strs(&args), &[]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    let ck = out.join("checkpoint.safetensors");
    let rec = RunRecord::from_checkpoint(&Checkpoint::read(&ck).unwrap()).unwrap().unwrap();
    assert_eq!(rec.pairs.len(), 3);
    assert_eq!((rec.steps, rec.checkpoint_every, rec.sample_at_end), (3, 0, false));

    // Change the data: one pair added, one removed, one image rewritten with other content.
    write_pairs(&data, &[3]);
    std::fs::remove_file(data.join("mask/m2.nii.gz")).unwrap();
    std::fs::remove_file(data.join("image/i2.nii.gz")).unwrap();
    std::fs::copy(data.join("image/i0.nii.gz"), data.join("image/i1.nii.gz")).unwrap();

    // Resume from elsewhere, by the checkpoint alone (plus a step target).
    let elsewhere = scratch("resume-elsewhere");
    let (code, stdout, stderr) =
        run(&elsewhere, &["train", "--resume", ck.to_str().unwrap(), "--device", "cpu", "--steps", "5"], &[]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    let d = data.canonicalize().unwrap();
    assert!(stdout.contains(&format!("3 pairs from masks {}", d.join("mask").display())), "{stdout}");
    let warn = stderr.find("warning: the data changed since the checkpoint (step 3):").expect(&stderr);
    let report = &stderr[warn..];
    assert!(report.contains(&format!("1 pair(s) added: {}", d.join("mask/m3.nii.gz").display())), "{report}");
    assert!(report.contains(&format!("1 pair(s) missing: {}", d.join("mask/m2.nii.gz").display())), "{report}");
    assert!(report.contains("1 pair(s) different") && report.contains("i1.nii.gz content changed"), "{report}");
    assert!(stdout.find("steps 3 → 5").unwrap() < stdout.find("done:").unwrap());
    assert!(!elsewhere.join("runs").exists(), "the resumed run did not stay in its folder");
    assert_eq!(logged(&out), vec![1, 2, 3, 4, 5]);
    // The record now holds the data as trained on: a second resume reports nothing.
    let (code, _, stderr) =
        run(&elsewhere, &["train", "--resume", ck.to_str().unwrap(), "--device", "cpu", "--steps", "6"], &[]);
    assert_eq!(code, 0, "{stderr}");
    assert!(!stderr.contains("data changed"), "{stderr}");
    // --config cannot re-plan a recorded run.
    let (code, _, stderr) = run(&elsewhere, &["train", "--resume", ck.to_str().unwrap(), "--config", "x.toml"], &[]);
    assert_eq!(code, 2);
    assert!(stderr.contains("records its run"), "{stderr}");
}

#[test]
fn a_checkpoint_without_a_run_record_resumes_as_before_with_a_note() {
    let dir = scratch("old");
    let be = CpuBackend::new();
    let tc = TrainConfig { lr: 2e-4, ..TrainConfig::default() };
    let mut tr = Trainer::new(&be, &UNetConfig::tiny(), &tc).unwrap();
    tr.step = 2;
    tr.draws = 4;
    let ck = dir.join("old.safetensors");
    save_trainer(&ck, &be, &tr).unwrap();
    let out = dir.join("new");
    let (code, stdout, stderr) = run(
        &dir,
        &["train", "--resume", ck.to_str().unwrap(), "--device", "cpu", "--no-sample", "--steps", "3", "--out", "new"],
        &[],
    );
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stderr.contains("has no run record (written by an older meddpm)"), "{stderr}");
    assert!(stdout.contains("steps 2 → 3") && stdout.contains("built-in demo pairs"), "{stdout}");
    let c = Checkpoint::read(&out.join("checkpoint.safetensors")).unwrap();
    assert_eq!(c.step, 3);
    assert!(RunRecord::from_checkpoint(&c).unwrap().is_some(), "the continued run records itself");
}

/// The whole message printed for a missing file names it once and gives the OS reason once.
fn assert_named_once(stderr: &str, path: &str) {
    let reason = std::io::Error::from(std::io::ErrorKind::NotFound).to_string();
    let reason = reason.split(" (os error").next().unwrap(); // "entity not found" vs the OS text
    let line = stderr.lines().find(|l| l.starts_with("error: ")).unwrap_or_else(|| panic!("{stderr}"));
    assert_eq!(line.matches(path).count(), 1, "{line}");
    let os = "No such file or directory";
    assert!(line.contains(os) || line.contains(reason), "{line}");
    assert_eq!(line.matches(os).count(), 1, "{line}");
}

#[test]
fn a_missing_file_is_named_once_with_its_reason_once() {
    let dir = scratch("missing");
    let m = dir.join("no-masks");
    let i = dir.join("no-images");
    let (code, _, stderr) = run(
        &dir,
        &[
            "train",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--masks",
            m.to_str().unwrap(),
            "--images",
            i.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(code, 2);
    assert_named_once(&stderr, m.to_str().unwrap());
    let ck = dir.join("none.safetensors");
    let (code, _, stderr) = run(&dir, &["sample", "--device", "cpu", "--checkpoint", ck.to_str().unwrap()], &[]);
    assert_eq!(code, 2);
    assert_named_once(&stderr, ck.to_str().unwrap());
    let (code, _, stderr) = run(&dir, &["train", "--device", "cpu", "--resume", ck.to_str().unwrap()], &[]);
    assert_eq!(code, 2);
    assert_named_once(&stderr, ck.to_str().unwrap());
}

#[test]
fn sample_without_a_checkpoint_uses_the_bundled_model_or_says_there_is_none() {
    let dir = scratch("bundled");
    let (code, stdout, stderr) = run(&dir, &["sample", "--device", "cpu", "--steps", "2", "--out", "s"], &[]);
    if meddpm::checkpoint::bundled::bytes().is_some() {
        assert_eq!(code, 0, "{stderr}");
        assert!(stdout.contains("weights: bundled demo model"), "{stdout}");
        assert!(dir.join("s.nii.gz").is_file() && dir.join("s.png").is_file());
    } else {
        assert_eq!(code, 2);
        assert!(
            stderr.contains("no --checkpoint given") && stderr.contains("without a bundled demo model"),
            "{stderr}"
        );
    }
}

/// A run with batch > 1 samples its end-of-run volume too (the training network's batch is
/// padded with copies of the one condition; unpadded, sampling fails with "condition has 1024
/// values, the model expects 2048").
#[test]
fn a_batch_of_two_trains_and_samples_at_the_end() {
    let dir = scratch("batch2");
    let out = dir.join("run");
    let args = ["train", "--preset", "tiny", "--device", "cpu", "--steps", "2", "--batch", "2", "--out"];
    let (code, stdout, stderr) = run(&dir, &[&args[..], &[out.to_str().unwrap()]].concat(), &[]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    let sampled: Vec<&str> = stdout.lines().filter(|l| l.starts_with("sample:")).collect();
    assert!(!sampled.is_empty(), "no sample written:\n{stdout}");
    for l in sampled {
        let p = l.trim_start_matches("sample:").trim();
        assert!(Path::new(p).is_file(), "{p} missing");
    }
}
