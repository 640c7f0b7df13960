//! The command line's contract with its user, driving the real binary: every input is checked
//! (a bad value is exit 2 with one line naming the input and what was expected, no panic, and
//! no file created or changed), nothing changes the user's data silently, outputs are never
//! clobbered, a run folder is locked, and messages say what runs and what to do.

use meddpm::checkpoint::save_trainer;
use meddpm::cpu::CpuBackend;
use meddpm::data::{write_labels, write_volume, Volume};
use meddpm::diffusion::{TrainConfig, Trainer};
use meddpm::model::UNetConfig;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime};

mod common;

fn scratch(name: &str) -> PathBuf {
    common::scratch("contract", name)
}

fn run(cwd: &Path, args: &[&str]) -> (i32, String, String) {
    common::run(cwd, args, &[])
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Every file under `dir` with its length and modification time.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, (u64, SystemTime)> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let m = e.metadata().unwrap();
            out.insert(e.path(), (m.len(), m.modified().unwrap()));
            if m.is_dir() {
                todo.push(e.path());
            }
        }
    }
    out
}

/// An 8³ label mask (head 1, a tumour 2) of `n`³ voxels.
fn mask(n: usize) -> Volume {
    let c = n as f32 / 2.0;
    let data = (0..n * n * n)
        .map(|i| {
            let (x, y, z) = ((i % n) as f32, ((i / n) % n) as f32, (i / (n * n)) as f32);
            let r = ((x - c).powi(2) + (y - c).powi(2) + (z - c).powi(2)).sqrt();
            if r < n as f32 / 6.0 {
                2.0
            } else if r < n as f32 / 2.5 {
                1.0
            } else {
                0.0
            }
        })
        .collect();
    Volume::new([n, n, n], [1.0; 3], data)
}

/// An `n`³ raw-intensity image (0..255).
fn image(n: usize) -> Volume {
    Volume::new([n, n, n], [1.0; 3], (0..n * n * n).map(|i| (i * 37 % 256) as f32).collect())
}

/// The inputs the tests use, in `dir/in`: a tiny (8³, T = 250) checkpoint, masks of 8³ and 9³,
/// a raw image given where a mask belongs, a truncated checkpoint, a 9³ training pair.
struct Inputs {
    ck: PathBuf,
    mask8: PathBuf,
    mask9: PathBuf,
    image8: PathBuf,
    truncated: PathBuf,
    pairs9: (PathBuf, PathBuf),
}

fn inputs(dir: &Path) -> Inputs {
    let d = dir.join("in");
    std::fs::create_dir_all(&d).unwrap();
    let be = CpuBackend::new();
    let tr = Trainer::new(&be, &UNetConfig::tiny(), &TrainConfig::default()).unwrap();
    let ck = d.join("tiny.safetensors");
    save_trainer(&ck, &be, &tr).unwrap();
    let bytes = std::fs::read(&ck).unwrap();
    let truncated = d.join("cut.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let (mask8, mask9, image8) = (d.join("mask8.nii.gz"), d.join("mask9.nii.gz"), d.join("image8.nii.gz"));
    write_labels(&mask8, &mask(8)).unwrap();
    write_labels(&mask9, &mask(9)).unwrap();
    write_volume(&image8, &image(8)).unwrap();
    let (pm, pi) = (d.join("masks9"), d.join("images9"));
    std::fs::create_dir_all(&pm).unwrap();
    std::fs::create_dir_all(&pi).unwrap();
    write_labels(pm.join("pair_1.nii.gz"), &mask(9)).unwrap();
    write_volume(pi.join("pair_1.nii.gz"), &image(9)).unwrap();
    Inputs { ck, mask8, mask9, image8, truncated, pairs9: (pm, pi) }
}

/// Every subcommand fed bad values (zero, negative, huge, wrong file kind, wrong size,
/// missing): exit 2, the error on one line naming the input and what was expected, no panic,
/// no file created or changed.
#[test]
fn bad_values_are_refused_with_one_line_and_nothing_written() {
    let dir = scratch("table");
    let i = inputs(&dir);
    let s = |p: &PathBuf| p.to_str().unwrap().to_string();
    let (ck, m8, m9, img, cut) = (s(&i.ck), s(&i.mask8), s(&i.mask9), s(&i.image8), s(&i.truncated));
    let (pm, pi) = (s(&i.pairs9.0), s(&i.pairs9.1));
    let missing = s(&dir.join("in/missing.safetensors"));
    std::fs::write(dir.join("taken.nii.gz"), b"user data").unwrap();
    #[rustfmt::skip]
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec!["train", "--steps", "0"], vec!["--steps", "must be a whole number ≥ 1"]),
        (vec!["train", "--steps", "-5"], vec!["--steps", "≥ 1"]),
        (vec!["train", "--steps", "99999999999999999999999"], vec!["--steps", "≥ 1"]),
        (vec!["train", "--lr", "-1"], vec!["--lr", "(0, 1]"]),
        (vec!["train", "--lr", "0"], vec!["--lr", "(0, 1]"]),
        (vec!["train", "--lr", "nan"], vec!["--lr", "(0, 1]"]),
        (vec!["train", "--batch", "0"], vec!["--batch", "from 1 to 1024"]),
        (vec!["train", "--batch", "100000"], vec!["--batch", "from 1 to 1024"]),
        (vec!["train", "--grad-accum", "-2"], vec!["--grad-accum", "from 1 to 1024"]),
        (vec!["train", "--checkpoint-every", "-1"], vec!["--checkpoint-every", "≥ 0"]),
        (vec!["train", "--seed", "-1"], vec!["--seed", "≥ 0"]),
        (vec!["train", "--preview-every", "-1"], vec!["--preview-every", "auto, 0 (off) or a whole number"]),
        (vec!["train", "--preview-every", "soon"], vec!["--preview-every", "auto, 0 (off) or a whole number"]),
        (vec!["train", "--dist-timeout", "0"], vec!["--dist-timeout", "≥ 1"]),
        (vec!["train", "--masks", &pm, "--images", &pi], vec!["--masks", "--preset"]),
        (vec!["train", "--preset", "tiny", "--device", "cpu", "--masks", &pm, "--images", &pi],
         vec!["pair_1.nii.gz", "9×9×9", "8×8×8", "--resize"]),
        (vec!["train", "--preset", "tiny", "--device", "cpu", "--masks", "no-such-dir", "--images", "x"],
         vec!["no-such-dir"]),
        (vec!["train", "--resume", &missing], vec!["missing.safetensors"]),
        (vec!["sample", "--timesteps", "0"], vec!["--timesteps", "from 1 to 100000"]),
        (vec!["sample", "--device", "cpu", "--checkpoint", &ck, "--timesteps", "1"], vec!["--timesteps 1", "T = 250", "--steps"]),
        (vec!["sample", "--steps", "-3"], vec!["--steps", "from 1 to 100000"]),
        (vec!["sample", "--num-samples", "0"], vec!["--num-samples", "from 1 to 1000000"]),
        (vec!["sample", "--batch", "-1"], vec!["--batch", "from 1 to 1024"]),
        (vec!["sample", "--eta", "2"], vec!["--eta", "[0, 1]"]),
        (vec!["sample", "--depth", "0", "--size", "8"], vec!["--depth", "from 1 to 1024"]),
        (vec!["sample", "--device", "cpu", "--checkpoint", &ck, "--mask", &m9], vec!["mask9.nii.gz", "9×9×9", "8×8×8", "--resize"]),
        (vec!["sample", "--device", "cpu", "--checkpoint", &ck, "--mask", &img], vec!["image8.nii.gz", "image rather than a label mask"]),
        (vec!["sample", "--device", "cpu", "--checkpoint", &missing, "--mask", &m8], vec!["missing.safetensors", "No such file"]),
        (vec!["sample", "--device", "cpu", "--checkpoint", &cut, "--mask", &m8], vec!["cut.safetensors", "truncated"]),
        (vec!["sample", "--device", "cpu", "--checkpoint", &ck, "--mask", &m8, "--out", "taken"], vec!["taken.nii.gz exists", "--overwrite"]),
        (vec!["sample", "--device", "nowhere"], vec!["--device", "auto, cpu, cuda or cuda:N"]),
        (vec!["sample", "--device", "cpu", "--checkpoint", &ck, "--mask", &m8, "--precision", "fp8"],
         vec!["--precision fp8", "CPU", "bf16"]),
        (vec!["train", "--preset", "tiny", "--device", "cpu", "--precision", "fp8", "--steps", "1", "--out", "f8"],
         vec!["--precision fp8", "CPU", "bf16"]),
        (vec!["bench", "--device", "cpu", "--precision", "fp8", "--preset", "tiny", "--iters", "1"],
         vec!["--precision fp8", "CPU"]),
        (vec!["eval-configs", "--checkpoint", &ck, "--configs", "cpu-tf32", "--out", "ec"], vec!["cpu-tf32", "cpu-fp8"]),
        (vec!["info", "--preset", "huge"], vec!["--preset", "huge"]),
        (vec!["convert", &ck, "x.pt"], vec!["x.pt", "*.safetensors"]),
        (vec!["convert", &missing, "x.safetensors"], vec!["missing.safetensors"]),
        (vec!["convert", &ck, "x.safetensors", "--heads", "0"], vec!["--heads", "from 1 to 64"]),
        (vec!["eval", "--real", &img, "--generated", &img, "--out", "ev"], vec!["--range -1,1", "fall outside", "--range auto"]),
        (vec!["eval", "--real", &img, "--generated", &img, "--out", "ev", "--kernel-size", "0"], vec!["--kernel-size", "from 1 to 99"]),
        (vec!["eval", "--real", &missing, "--generated", &img, "--out", "ev"], vec!["--real", "missing.safetensors"]),
        (vec!["eval-configs", "--checkpoint", &ck, "--seeds", "0", "--out", "ec"], vec!["--seeds", "from 1 to 1000"]),
        (vec!["eval-configs", "--checkpoint", &ck, "--timesteps", "1", "--out", "ec"], vec!["--timesteps", "from 2 to 100000"]),
        (vec!["masks", "--input", &m8, "--output", "mo", "--num-scales", "0"], vec!["--num-scales", "from 1 to 1000"]),
        (vec!["masks", "--input", &m8, "--output", "mo", "--shift-step", "-1"], vec!["--shift-step", "from 1 to 1000"]),
        (vec!["masks", "--input", &m8, "--output", "mo", "--scale-start", "0"], vec!["--scale-start", "(0, 100]"]),
        (vec!["masks", "--input", &missing, "--output", "mo"], vec!["missing.safetensors"]),
        (vec!["lesion-pairs", "--t1", &missing, "--masks", &m8, "--out", "lp"], vec!["missing.safetensors"]),
        (vec!["lesion-pairs", "--t1", &img, "--masks", &m8, "--out", "lp", "--rim", "-1"], vec!["--rim", "[0, 100]"]),
        (vec!["preview", "--mask", &m8, "--through-label", "300", "-o", "p.png"], vec!["--through-label", "from 0 to 255"]),
        (vec!["view", &missing, "-o", "v.html"], vec!["missing.safetensors"]),
        (vec!["bench", "--device", "cpu", "--iters", "0"], vec!["--iters", "from 1 to 100000"]),
        (vec!["profile", "--repeats", "0"], vec!["--repeats", "from 1 to 10000"]),
        (vec!["eval-samplers", "--runs", "no-runs", "--out", "es"], vec!["no-runs"]),
        (vec!["synthesize", "--count", "0"], vec!["--count", "from 1 to 10000000"]),
        (vec!["synthesize", "--steps", "-3"], vec!["--steps", "from 1 to 100000"]),
        (vec!["synthesize", "--batch", "0"], vec!["--batch", "from 1 to 1024"]),
        (vec!["synthesize", "--augment", "-1"], vec!["--augment", "from 0 to 1000"]),
        (vec!["synthesize", "--dataset-id", "1000"], vec!["--dataset-id", "from 1 to 999"]),
        (vec!["synthesize", "--tumour-label", "300"], vec!["--tumour-label", "from 0 to 255"]),
        (vec!["synthesize", "--eta", "2"], vec!["--eta", "[0, 1]"]),
        (vec!["synthesize", "--device", "cpu", "--checkpoint", &ck, "--masks", &m8, "--timesteps", "1", "--out", "sy"],
         vec!["--timesteps 1", "T = 250", "--steps"]),
        (vec!["synthesize", "--device", "cpu", "--checkpoint", &missing, "--masks", &m8, "--out", "sy"],
         vec!["missing.safetensors"]),
        (vec!["synthesize", "--device", "cpu", "--checkpoint", &ck, "--masks", &m9, "--out", "sy"],
         vec!["mask9.nii.gz", "9×9×9", "8×8×8"]),
    ];
    for (args, want) in &cases {
        let before = snapshot(&dir);
        let (code, stdout, stderr) = run(&dir, args);
        assert_eq!(code, 2, "{args:?}: exit {code}\n{stdout}\n{stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error")).collect();
        assert_eq!(errors.len(), 1, "{args:?}: one error line\n{stderr}");
        for w in want {
            assert!(errors[0].contains(w), "{args:?}: {w:?} not in {:?}", errors[0]);
        }
        assert!(!errors[0].contains(" { "), "{args:?}: a debug struct: {}", errors[0]);
        assert_eq!(snapshot(&dir), before, "{args:?}: files created or changed");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `sample` refuses to overwrite, `--overwrite` replaces, and every path written is printed;
/// a mask of another size is resampled with `--resize` only, and the output is on its grid.
#[test]
fn sample_never_clobbers_and_prints_what_it_wrote() {
    let dir = scratch("sample");
    let i = inputs(&dir);
    let base = ["sample", "--device", "cpu", "--checkpoint", i.ck.to_str().unwrap(), "--steps", "2"];
    let with = |extra: &[&'static str]| -> Vec<String> { base.iter().chain(extra).map(|s| s.to_string()).collect() };
    let with = |extra: &[&'static str], mask: &Path| -> Vec<String> {
        let mut v = with(extra);
        v.extend(["--mask".to_string(), mask.to_str().unwrap().to_string()]);
        v
    };
    let m8 = &i.mask8;
    let (code, stdout, stderr) = run(&dir, &strs(&with(&["--out", "s"], m8)));
    assert_eq!(code, 0, "{stderr}");
    for f in ["s.nii.gz", "s.png", "s.html", "s_timing.json"] {
        assert!(dir.join(f).is_file(), "{f}");
        assert!(stdout.contains(f), "{f} not printed: {stdout}");
    }
    let before = snapshot(&dir);
    let (code, _, stderr) = run(&dir, &strs(&with(&["--out", "s"], m8)));
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("s.nii.gz exists") && stderr.contains("--overwrite"), "{stderr}");
    assert_eq!(snapshot(&dir), before, "nothing replaced");
    let (code, _, stderr) = run(&dir, &strs(&with(&["--out", "s", "--overwrite"], m8)));
    assert_eq!(code, 0, "{stderr}");
    // a 9³ mask for the 8³ model: resampled when asked, written on the mask's grid
    let (code, _, stderr) = run(&dir, &strs(&with(&["--out", "r", "--resize"], &i.mask9)));
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(meddpm::data::read_volume(dir.join("r.nii.gz")).unwrap().dims, [9, 9, 9]);
    std::fs::remove_dir_all(&dir).ok();
}

/// A second run into a locked folder fails at once naming the holder's PID; the lock of a
/// killed run does not block the next one.
#[test]
fn a_run_folder_is_locked_while_a_run_writes_it() {
    let dir = scratch("lock");
    let args = ["train", "--preset", "tiny", "--device", "cpu", "--no-sample", "--steps", "1000", "--out", "run"];
    let mut first = common::meddpm(&dir, &args, &[])
        .env("MEDDPM_FAULT_SLOW_STEP_MS", "500")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !dir.join("run/.meddpm.lock").is_file()
        || std::fs::read_to_string(dir.join("run/.meddpm.lock")).unwrap().trim().is_empty()
    {
        assert!(t0.elapsed() < Duration::from_secs(60), "the first run never locked its folder");
        std::thread::sleep(Duration::from_millis(50));
    }
    let before = std::fs::metadata(dir.join("run/.meddpm.lock")).unwrap().len();
    let (code, _, stderr) =
        run(&dir, &["train", "--preset", "tiny", "--device", "cpu", "--steps", "1", "--out", "run"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains(&format!("PID {}", first.id())) && stderr.contains("run folder"), "{stderr}");
    assert_eq!(std::fs::metadata(dir.join("run/.meddpm.lock")).unwrap().len(), before);
    // SIGKILL: no chance to clean up; the OS drops the lock with the process
    first.kill().unwrap();
    first.wait().unwrap();
    let args = ["train", "--preset", "tiny", "--device", "cpu", "--no-sample", "--steps", "1", "--out", "run"];
    let (code, stdout, stderr) = run(&dir, &[&args[..], &["--checkpoint-every", "0"]].concat());
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("checkpoint at the end only"), "--checkpoint-every 0 is said: {stdout}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `masks` names its files readably: `<stem>_scale<s>` and `<stem>_shift<dx>_<dy>_<dz>`.
#[test]
fn masks_get_readable_names() {
    let dir = scratch("masks");
    let m = dir.join("demo_0.nii.gz");
    write_labels(&m, &mask(16)).unwrap();
    let args = ["masks", "--input", m.to_str().unwrap(), "--output", "o", "--min-voxels", "1", "--shift-range", "2"];
    let (code, _, stderr) = run(&dir, &[&args[..], &["--shift-step", "2"]].concat());
    assert_eq!(code, 0, "{stderr}");
    let names = |d: &str| -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(dir.join(d)).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        v.sort();
        v
    };
    let scaled = names("o/scaled");
    assert!(scaled.contains(&"demo_0_scale1.05.nii.gz".to_string()), "{scaled:?}");
    assert!(scaled.contains(&"demo_0_scale2.00.nii.gz".to_string()), "{scaled:?}");
    assert!(names("o/shifted").contains(&"demo_0_shift-2_0_2.nii.gz".to_string()));
    std::fs::remove_dir_all(&dir).ok();
}

/// `eval` at 32³ uses a real SSIM window and says which windows it used.
#[test]
fn eval_picks_an_ssim_window_that_fits_and_says_so() {
    let dir = scratch("eval");
    let n = 32;
    let v = |k: usize| {
        Volume::new([n, n, n], [1.0; 3], (0..n * n * n).map(|i| ((i * (7 + k)) % 200) as f32 / 100.0 - 1.0).collect())
    };
    write_volume(dir.join("real.nii.gz"), &v(0)).unwrap();
    write_volume(dir.join("gen.nii.gz"), &v(1)).unwrap();
    let (code, stdout, stderr) =
        run(&dir, &["eval", "--real", "real.nii.gz", "--generated", "gen.nii.gz", "--out", "ev", "--no-panel"]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("window 11³ (SSIM) and 1³ (MS-SSIM)"), "{stdout}");
    assert!(stdout.contains("MS-SSIM is not a structural similarity at this size"), "{stdout}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The device and bench lines describe the CPU as it runs; `info`'s header lines up with its
/// columns; `convert` says what it wrote; `train` on a missing GPU does not announce a GPU demo.
#[test]
fn messages_describe_what_runs() {
    let dir = scratch("messages");
    let i = inputs(&dir);
    let (code, stdout, stderr) =
        run(&dir, &["bench", "--device", "cpu", "--preset", "tiny", "--iters", "1", "--warmup", "0"]);
    assert_eq!(code, 0, "{stderr}");
    assert!(!stdout.contains("CUDA") && !stdout.contains("cudaMemGetInfo"), "{stdout}");
    assert!(stderr.contains("direct 3×3×3") || stderr.contains("no FMA"), "{stderr}");
    assert!(!stderr.contains("im2col + gemm"), "{stderr}");

    let (code, stdout, _) = run(&dir, &["info", "--preset", "tiny"]);
    assert_eq!(code, 0);
    let lines: Vec<&str> = stdout.lines().collect();
    let h = lines.iter().position(|l| l.contains("planned memory")).unwrap();
    let width = |l: &str| l.chars().count();
    assert_eq!(width(lines[h]), width(lines[h + 1]), "header and row end in the same column:\n{stdout}");

    let (code, stdout, stderr) = run(&dir, &["convert", i.ck.to_str().unwrap(), "plain.safetensors"]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("wrote plain.safetensors (safetensors state dict)"), "{stdout}");

    if meddpm_cuda::probe().is_err() {
        let (code, stdout, _) = run(&dir, &["train", "--device", "cuda", "--out", "gpu"]);
        assert_ne!(code, 0);
        assert!(!stdout.contains("demo on the GPU"), "{stdout}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
