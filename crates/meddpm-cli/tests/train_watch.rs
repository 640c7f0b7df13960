//! What `meddpm train` shows of a run as it goes (tiny preset, CPU, a few steps): the first line
//! names the precision and why (the device's default, a flag, or a resumed run's own), and
//! `--preview-every` writes previews and `progress.html` without changing the training: the loss
//! log is the same bit for bit with previews on and off, a resume keeps the earlier previews, and
//! `auto` states the spacing it chose and what the previews cost.

use std::path::{Path, PathBuf};

mod common;
use common::run;

fn scratch(name: &str) -> PathBuf {
    common::scratch("trainwatch", name)
}

/// `train` of the tiny model on the CPU into `dir/out` for `steps` steps, plus `more` flags.
fn train(dir: &Path, out: &str, steps: u64, more: &[&str]) -> (i32, String, String) {
    let steps = steps.to_string();
    let args = ["train", "--preset", "tiny", "--device", "cpu", "--no-sample", "--out", out, "--steps", &steps];
    run(dir, &[&args[..], more].concat(), &[])
}

fn previews(run_dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(run_dir.join("previews"))
        .map(|rd| rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn the_first_line_says_which_precision_and_why() {
    let dir = scratch("precision");
    let (code, stdout, stderr) = train(&dir, "run", 1, &["--preview-every", "0"]);
    assert_eq!(code, 0, "{stderr}");
    let first = stdout.lines().next().unwrap_or_default();
    assert!(first.starts_with("meddpm train on CPU reference"), "{first}");
    assert!(
        first.ends_with("precision fp32 (default on the CPU: the fp32 reference; bf16 there only emulates a GPU)"),
        "{first}"
    );
    // a resume keeps the run's own, a flag wins over it
    let ck = dir.join("run/checkpoint.safetensors");
    let ck = ck.to_str().unwrap();
    let (code, stdout, stderr) = run(&dir, &["train", "--resume", ck, "--steps", "2", "--preview-every", "0"], &[]);
    assert_eq!(code, 0, "{stderr}");
    let first = stdout.lines().next().unwrap_or_default();
    assert!(first.ends_with("precision fp32 (the resumed run's own)"), "{first}");
    let (code, stdout, stderr) =
        run(&dir, &["train", "--resume", ck, "--steps", "3", "--precision", "bf16", "--preview-every", "0"], &[]);
    assert_eq!(code, 0, "{stderr}");
    let first = stdout.lines().next().unwrap_or_default();
    assert!(first.contains("bf16-emulating") && first.ends_with("precision bf16 (asked: --precision)"), "{first}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn previews_leave_training_unchanged_and_a_resume_keeps_them() {
    let dir = scratch("every");
    let (code, stdout, stderr) = train(&dir, "on", 4, &["--preview-every", "2"]);
    assert_eq!(code, 0, "{stderr}");
    let on = dir.join("on");
    assert_eq!(previews(&on), ["step_000002.png", "step_000004.png"]);
    assert!(stdout.contains("previews: 2 in "), "{stdout}");
    let page = std::fs::read_to_string(on.join("progress.html")).unwrap();
    for src in ["loss.svg", "previews/step_000002.png", "previews/step_000004.png"] {
        assert!(page.contains(&format!("src=\"{src}\"")), "progress.html shows {src}: {page}");
    }
    // the PNG's IHDR: mask | sample side by side, three planes of ≥ 128 pixels each
    let png = std::fs::read(on.join("previews/step_000004.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    let be32 = |o: usize| u32::from_be_bytes([png[o], png[o + 1], png[o + 2], png[o + 3]]);
    assert!(be32(16) >= 2 * 128 && be32(20) >= 3 * 128, "{} × {}", be32(16), be32(20));

    // off: no previews, no page, and exactly the same losses
    let (code, stdout, stderr) = train(&dir, "off", 4, &["--preview-every", "0"]);
    assert_eq!(code, 0, "{stderr}");
    let off = dir.join("off");
    assert!(previews(&off).is_empty() && !off.join("progress.html").exists());
    assert!(!stdout.contains("preview"), "{stdout}");
    let csv = |d: &Path| std::fs::read_to_string(d.join("loss.csv")).unwrap();
    assert_eq!(csv(&on), csv(&off), "previews must not change the training");

    // a resume adds its previews to the earlier ones
    let ck = on.join("checkpoint.safetensors");
    let (code, _, stderr) =
        run(&dir, &["train", "--resume", ck.to_str().unwrap(), "--steps", "6", "--preview-every", "2"], &[]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(previews(&on), ["step_000002.png", "step_000004.png", "step_000006.png"]);
    let page = std::fs::read_to_string(on.join("progress.html")).unwrap();
    assert_eq!(page.matches("<figure>").count(), 3, "{page}");

    // a new run in the same folder replaces the old run's previews
    let (code, _, stderr) = train(&dir, "on", 3, &["--preview-every", "3"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(previews(&on), ["step_000003.png"]);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn auto_times_steps_then_states_the_spacing_and_the_cost() {
    let dir = scratch("auto");
    let (code, stdout, stderr) = train(&dir, "run", 8, &[]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("spacing auto"), "{stdout}");
    // the first preview comes after the first step and five timed ones
    assert_eq!(previews(&dir.join("run"))[0], "step_000006.png");
    let spacing = stdout.lines().find(|l| l.starts_with("preview spacing: ")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(spacing.contains("a preview") && spacing.contains("% of this session's training"), "{spacing}");
    let cost = stdout.lines().find(|l| l.starts_with("previews: ") && l.contains("% of the training time"));
    assert!(cost.is_some(), "{stdout}");
    std::fs::remove_dir_all(&dir).ok();
}
