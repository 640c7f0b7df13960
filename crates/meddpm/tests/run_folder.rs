//! Tests of `meddpm::run` (a training run as a folder) on the CPU with the 8³ tiny model:
//! the run record in checkpoints (and files without one), overrides and their notes, data sources
//! to and from flat paths, a session summary's figures, the data
//! fingerprint and its change report, the loss log across resumes and its SVG plot, and the loop's
//! safe stops by fault injection — a stop request, a NaN batch, non-finite weights, a write into
//! a real size-limited tmpfs (skipped when mounting is impossible) and an injected full disk —
//! each checking that the checkpoint on disk is the last good one and loads.

use meddpm::checkpoint::{save_trainer, trainer_bytes, Checkpoint};
use meddpm::cpu::CpuBackend;
use meddpm::data::{demo, write_labels, write_volume, Convention, Dataset, Volume};
use meddpm::diffusion::{TrainConfig, Trainer};
use meddpm::model::UNetConfig;
use meddpm::run::losslog::{self, LossLog};
use meddpm::run::{
    fingerprint, override_train, DataChanges, DataSource, Faults, Outcome, Overrides, RunRecord, Session, StopFlag,
    Summary, CHECKPOINT,
};
use meddpm::{Backend, Error, Layout, Precision};
use std::path::{Path, PathBuf};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meddpm-runfolder-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tc() -> TrainConfig {
    TrainConfig { timesteps: 6, lr: 1e-3, grad_accum: 1, ema_start: 0, ema_every: 1, ..TrainConfig::default() }
}

fn record(dir: &Path, steps: u64, every: u64) -> RunRecord {
    RunRecord {
        out: dir.to_path_buf(),
        data: DataSource::Demo,
        convention: "whole-head".into(),
        steps,
        checkpoint_every: every,
        sample_at_end: false,
        workers: 1,
        precision: Precision::Tf32,
        layout: Layout::Ndhwc,
        pairs: Vec::new(),
    }
}

/// Batches of the demo pairs at 8³, in order.
fn batches() -> impl FnMut() -> meddpm::Result<(Vec<f32>, Vec<f32>)> {
    let ds = demo::dataset_at([8, 8, 8]).unwrap();
    let mut i = 0;
    move || {
        let s = ds.get(i % ds.len())?;
        i += 1;
        Ok((s.image, s.cond))
    }
}

fn session<'a>(dir: &Path, rec: RunRecord, stop: &'a StopFlag, faults: Faults, saved: Option<u64>) -> Session<'a> {
    Session { dir: dir.to_path_buf(), record: rec, log: LossLog::fresh(dir), stop, faults, saved_step: saved }
}

fn all_finite(ck: &Checkpoint) -> bool {
    ck.tensors.values().all(|(_, v)| v.iter().all(|x| x.is_finite()))
}

fn steps_logged(dir: &Path) -> Vec<u64> {
    let csv = dir.join(losslog::CSV);
    losslog::parse_csv(&std::fs::read_to_string(&csv).unwrap(), &csv).unwrap().iter().map(|r| r.0).collect()
}

#[test]
fn record_is_stored_in_the_checkpoint_and_older_files_have_none() {
    let dir = scratch("record");
    let be = CpuBackend::new();
    let mut tr = Trainer::new(&be, &UNetConfig::tiny(), &tc()).unwrap();
    let stop = StopFlag::new();
    let mut rec = record(&dir, 2, 0);
    rec.pairs = fingerprint(&demo::dataset_at([8, 8, 8]).unwrap(), &[]).unwrap();
    let mut s = session(&dir, rec.clone(), &stop, Faults::default(), None);
    let sum = s.run(&be, &mut tr, batches(), |_, _| {}).unwrap();
    assert_eq!(sum.outcome, Outcome::Finished);
    let ck = Checkpoint::read(&dir.join(CHECKPOINT)).unwrap();
    assert_eq!(ck.step, 2);
    assert_eq!(RunRecord::from_checkpoint(&ck).unwrap(), Some(rec));

    // A checkpoint written without a record (as by meddpm before records) reads as None.
    let old = dir.join("old.safetensors");
    save_trainer(&old, &be, &tr).unwrap();
    assert_eq!(RunRecord::from_checkpoint(&Checkpoint::read(&old).unwrap()).unwrap(), None);
}

#[test]
fn overrides_give_one_note_per_changed_value() {
    let dir = scratch("overrides");
    let rec = record(&dir, 200, 100);
    let (same, notes) = rec.apply(&Overrides { steps: Some(200), ..Overrides::default() }).unwrap();
    assert_eq!((same, notes.len()), (rec.clone(), 0), "an equal value is no override");
    let o = Overrides {
        steps: Some(400),
        checkpoint_every: Some(50),
        precision: Some(Precision::Fp32),
        data: Some(DataSource::Manifest { csv: dir.join("m.csv") }),
        ..Overrides::default()
    };
    let (new, notes) = rec.apply(&o).unwrap();
    assert_eq!((new.steps, new.checkpoint_every, new.precision), (400, 50, Precision::Fp32));
    assert_eq!(new.data, DataSource::Manifest { csv: dir.join("m.csv") });
    assert_eq!(new.layout, rec.layout);
    assert_eq!(notes.len(), 4, "{notes:?}");
    assert!(notes[0].contains("--steps 400") && notes[0].contains("200"), "{notes:?}");
    assert!(notes.iter().any(|n| n.starts_with("--precision fp32") && n.ends_with("tf32")), "{notes:?}");

    // The run continues in its checkpoint's folder, with a note when that moved.
    let elsewhere = scratch("overrides-moved");
    let (here, moved) = rec.resumed_at(&elsewhere.join(CHECKPOINT)).unwrap();
    assert_eq!(here.out, elsewhere.canonicalize().unwrap());
    assert!(moved.unwrap().contains(&dir.display().to_string()));
    let (_, moved) = rec.resumed_at(&dir.join(CHECKPOINT)).unwrap();
    assert_eq!(moved, None);

    let mut t = tc();
    let notes = override_train(&mut t, Some(5e-4), Some(4), Some(1), Some(0)).unwrap();
    assert_eq!((t.lr, t.grad_accum, notes.len()), (5e-4, 4, 2));
    assert!(override_train(&mut t, None, None, Some(2), None).unwrap_err().to_string().contains("batch"));
    assert!(override_train(&mut t, None, None, None, Some(9)).unwrap_err().to_string().contains("seed"));
}

#[test]
fn data_sources_convert_to_and_from_flat_paths() {
    let (m, csv) = (PathBuf::from("masks"), PathBuf::from("pairs.csv"));
    let images = vec![PathBuf::from("t1"), PathBuf::from("t2")];
    let folders = DataSource::Folders { masks: m.clone(), images: images.clone() };
    assert_eq!(DataSource::from_paths(None, &[], None), DataSource::Demo);
    assert_eq!(DataSource::from_paths(Some(&m), &images, None), folders);
    assert_eq!(DataSource::from_paths(Some(&m), &images, Some(&csv)), folders, "the masks folder wins");
    assert_eq!(DataSource::from_paths(None, &images, Some(&csv)), DataSource::Manifest { csv: csv.clone() });
    for s in [DataSource::Demo, folders, DataSource::Manifest { csv }] {
        let (m, i, c) = s.paths();
        assert_eq!(DataSource::from_paths(m.as_deref(), &i, c.as_deref()), s);
    }
}

#[test]
fn summary_gives_steps_and_first_and_last_loss_means() {
    let sum = |losses: Vec<f32>| Summary {
        outcome: Outcome::Finished,
        start: 3,
        end: 3 + losses.len() as u64,
        losses,
        saved_step: None,
        sync: Default::default(),
    };
    let s = sum((1..=12).map(|v| v as f32).collect());
    assert_eq!(s.steps(), 12);
    assert_eq!(s.loss_means(10), (5.5, 7.5));
    assert_eq!(sum(vec![2.0, 4.0]).loss_means(10), (3.0, 3.0), "fewer steps than n");
    let (a, b) = sum(Vec::new()).loss_means(10);
    assert!(a.is_nan() && b.is_nan());
}

/// Write phantom pairs `keys` as `mask/m<k>.nii.gz`, `image/i<k>.nii.gz` under `dir`.
fn write_pairs(dir: &Path, keys: &[u32]) {
    for &k in keys {
        let (img, cond) = meddpm::phantom::pair(8, 8, 8, k);
        // cond is (label 1, label 2) in ±1: back to a label map.
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

fn folder_dataset(dir: &Path) -> Dataset {
    Dataset::from_folders(&dir.join("mask"), &[dir.join("image")], Convention::whole_head(), [8, 8, 8]).unwrap()
}

#[test]
fn data_changes_name_added_missing_and_different_pairs() {
    let dir = scratch("prints");
    std::fs::create_dir_all(dir.join("mask")).unwrap();
    std::fs::create_dir_all(dir.join("image")).unwrap();
    write_pairs(&dir, &[0, 1, 2]);
    let before = fingerprint(&folder_dataset(&dir), &[]).unwrap();
    assert_eq!(before.len(), 3);
    assert!(DataChanges::between(&before, &fingerprint(&folder_dataset(&dir), &before).unwrap()).is_empty());

    // Same bytes rewritten (new mtime): not a change.
    let i0 = dir.join("image/i0.nii.gz");
    let bytes = std::fs::read(&i0).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(&i0, &bytes).unwrap();
    let touched = fingerprint(&folder_dataset(&dir), &before).unwrap();
    assert!(DataChanges::between(&before, &touched).is_empty());

    // Pair 3 added, pair 2 gone, pair 1's image replaced by pair 0's content.
    write_pairs(&dir, &[3]);
    std::fs::remove_file(dir.join("mask/m2.nii.gz")).unwrap();
    std::fs::remove_file(dir.join("image/i2.nii.gz")).unwrap();
    std::fs::copy(&i0, dir.join("image/i1.nii.gz")).unwrap();
    let after = fingerprint(&folder_dataset(&dir), &before).unwrap();
    let c = DataChanges::between(&before, &after);
    let name = |k: &str| dir.join(k).display().to_string();
    assert_eq!(c.added, vec![name("mask/m3.nii.gz")]);
    assert_eq!(c.missing, vec![name("mask/m2.nii.gz")]);
    assert_eq!(c.different.len(), 1, "{c:?}");
    assert!(
        c.different[0].starts_with(&name("mask/m1.nii.gz")) && c.different[0].contains("i1.nii.gz content changed")
    );
    let report = c.report();
    assert_eq!(report.len(), 3, "{report:?}");
    assert!(report[0].starts_with("1 pair(s) added"));
}

#[test]
fn stop_request_saves_the_step_reached_and_a_resume_appends_the_log() {
    let dir = scratch("stop");
    let be = CpuBackend::new();
    let mut tr = Trainer::new(&be, &UNetConfig::tiny(), &tc()).unwrap();
    let stop = StopFlag::new();
    let mut s = session(&dir, record(&dir, 1000, 0), &stop, Faults::default(), None);
    // The request arrives during step 3: step 3 finishes, then the loop saves and returns.
    let sum = s
        .run(&be, &mut tr, batches(), |step, _| {
            if step == 3 {
                stop.request()
            }
        })
        .unwrap();
    assert_eq!((sum.outcome, sum.end, sum.saved_step), (Outcome::Stopped, 3, Some(3)));
    let ck = Checkpoint::read(&dir.join(CHECKPOINT)).unwrap();
    assert_eq!(ck.step, 3);
    assert_eq!(steps_logged(&dir), vec![1, 2, 3]);

    // Resume from the file: the log continues, nothing is repeated.
    let mut tr = ck.restore_trainer(&be).unwrap();
    let (log, dropped) = LossLog::open(&dir.join(losslog::CSV), tr.step).unwrap();
    assert_eq!(dropped, 0);
    let stop = StopFlag::new();
    let mut s = Session { log, ..session(&dir, record(&dir, 5, 0), &stop, Faults::default(), Some(3)) };
    let sum = s.run(&be, &mut tr, batches(), |_, _| {}).unwrap();
    assert_eq!((sum.outcome, sum.start, sum.end), (Outcome::Finished, 3, 5));
    assert_eq!(steps_logged(&dir), vec![1, 2, 3, 4, 5]);
    assert_eq!(Checkpoint::read(&dir.join(CHECKPOINT)).unwrap().step, 5);
}

#[test]
fn loss_log_drops_rows_past_the_checkpoint_it_resumes() {
    let dir = scratch("log");
    let csv = dir.join(losslog::CSV);
    std::fs::write(&csv, "step,loss\n1,0.9\n2,0.8\n3,NaN\n4,0.7\n").unwrap();
    let (log, dropped) = LossLog::open(&csv, 2).unwrap();
    assert_eq!((dropped, log.rows().len()), (2, 2));
    assert_eq!(std::fs::read_to_string(&csv).unwrap(), "step,loss\n1,0.9\n2,0.8\n");
    std::fs::write(&csv, "step,loss\n1,zero\n").unwrap();
    let e = LossLog::open(&csv, 2).unwrap_err().to_string();
    assert!(e.contains("line 2") && e.contains(&csv.display().to_string()), "{e}");
}

#[test]
fn nan_batch_stops_the_run_at_its_step_and_keeps_the_last_good_checkpoint() {
    let dir = scratch("nan");
    let be = CpuBackend::new();
    let mut tr = Trainer::new(&be, &UNetConfig::tiny(), &tc()).unwrap();
    let stop = StopFlag::new();
    let faults = Faults { nan_at_step: Some(5), ..Faults::default() };
    let mut s = session(&dir, record(&dir, 20, 2), &stop, faults, None);
    let sum = s.run(&be, &mut tr, batches(), |_, _| {}).unwrap();
    match &sum.outcome {
        Outcome::Diverged { step, reason } => assert_eq!((*step, reason.as_str()), (5, "the loss is NaN")),
        o => panic!("expected a divergence, got {o:?}"),
    }
    assert_eq!(sum.saved_step, Some(4));
    let ck = Checkpoint::read(&dir.join(CHECKPOINT)).unwrap();
    assert_eq!(ck.step, 4);
    assert!(all_finite(&ck));
    // The weights in memory really are NaN now (the injection went through the real step).
    let mut h = vec![0f32; tr.net.specs[0].numel()];
    be.download_param(&tr.net.params[0], &tr.net.specs[0].shape, &mut h);
    assert!(h.iter().any(|x| x.is_nan()));
    // The log keeps the bad row for diagnosis.
    assert_eq!(steps_logged(&dir), vec![1, 2, 3, 4, 5]);
}

#[test]
fn non_finite_weights_are_never_written() {
    let dir = scratch("nonfinite");
    let be = CpuBackend::new();
    let mut tr = Trainer::new(&be, &UNetConfig::tiny(), &tc()).unwrap();
    let path = dir.join(CHECKPOINT);
    save_trainer(&path, &be, &tr).unwrap();
    let good = std::fs::read(&path).unwrap();
    let spec = tr.net.specs[3].clone();
    let mut h = vec![0f32; spec.numel()];
    be.download_param(&tr.ema[3], &spec.shape, &mut h);
    h[1] = f32::INFINITY;
    be.upload_param(&h, &spec.shape, &mut tr.ema[3]);
    match save_trainer(&path, &be, &tr) {
        Err(Error::NonFinite(m)) => assert!(m.contains(&format!("ema.{}", spec.key)) && m.contains("inf"), "{m}"),
        r => panic!("expected NonFinite, got {r:?}"),
    }
    assert_eq!(std::fs::read(&path).unwrap(), good, "the checkpoint on disk changed");

    // In the loop: weights that go non-finite while the loss is still finite stop the run at
    // the checkpoint that would have written them.
    let stop = StopFlag::new();
    let mut s = session(&dir, record(&dir, 3, 1), &stop, Faults::default(), Some(0));
    let sum = s.run(&be, &mut tr, batches(), |_, _| {}).unwrap();
    assert!(matches!(sum.outcome, Outcome::Diverged { step: 1, .. }), "{:?}", sum.outcome);
    assert_eq!(std::fs::read(&path).unwrap(), good);
}

/// The size of the tiny model's checkpoint with `rec`.
fn checkpoint_len(rec: &RunRecord) -> usize {
    let be = CpuBackend::new();
    let tr = Trainer::new(&be, &UNetConfig::tiny(), &tc()).unwrap();
    trainer_bytes(&be, &tr, &[("run", rec.to_json())]).unwrap().len()
}

/// Run 3 steps with a checkpoint each; the write at step 2 must fail for lack of space. Checks
/// the error (the file once, the reason once, what is kept), the checkpoint of step 1 intact and
/// loadable, and no temp file left behind.
fn check_full_disk(dir: &Path, faults: Faults) {
    let be = CpuBackend::new();
    let mut tr = Trainer::new(&be, &UNetConfig::tiny(), &tc()).unwrap();
    let stop = StopFlag::new();
    let mut s = session(dir, record(dir, 3, 1), &stop, faults, None);
    let e = s.run(&be, &mut tr, batches(), |_, _| {}).unwrap_err();
    let path = dir.join(CHECKPOINT);
    match &e {
        Error::NotWritten { path: p, err, .. } => {
            assert_eq!(p, &path);
            assert_eq!(err.kind(), std::io::ErrorKind::StorageFull, "{err}");
        }
        e => panic!("expected NotWritten, got {e:?}"),
    }
    let msg = e.to_string();
    assert_eq!(msg.matches(&path.display().to_string()).count(), 1, "{msg}");
    assert!(msg.contains("checkpoint of step 2 lost; the previous checkpoint (step 1) is intact"), "{msg}");
    let ck = Checkpoint::read(&path).unwrap();
    assert_eq!(ck.step, 1);
    assert!(all_finite(&ck));
    ck.restore_trainer(&be).unwrap();
    assert!(!dir.join(format!("{CHECKPOINT}.tmp")).exists(), "temp file left behind");
    assert_eq!(steps_logged(dir), vec![1]);
}

#[test]
fn injected_full_disk_keeps_the_old_checkpoint() {
    let dir = scratch("diskfull");
    check_full_disk(&dir, Faults { disk_full_at_step: Some(2), ..Faults::default() });
}

/// Unmounts on drop.
struct Mount(PathBuf);
impl Drop for Mount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn real_full_disk_keeps_the_old_checkpoint() {
    let dir = scratch("tmpfs");
    // Room for one checkpoint, its log and plot, but not for a second checkpoint beside it.
    let len = checkpoint_len(&record(&dir, 3, 1));
    let size = len + len / 2;
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
        .arg(&dir)
        .output();
    match mounted {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            println!("skipped: cannot mount a tmpfs: {}", String::from_utf8_lossy(&o.stderr).trim());
            return;
        }
        Err(e) => {
            println!("skipped: cannot run mount: {e}");
            return;
        }
    }
    let _m = Mount(dir.clone());
    check_full_disk(&dir, Faults::default());
}

#[test]
fn loss_svg_parses_and_draws_the_loss_and_its_ema() {
    let dir = scratch("svg");
    // A decreasing loss with a spike: y must fall along the curve (SVG y grows downwards).
    let rows: Vec<(u64, f32)> =
        (1..=120u64).map(|s| (s, if s == 60 { 2.0 } else { 1.0 / (1.0 + s as f32 / 10.0) })).collect();
    let path = dir.join(losslog::SVG);
    losslog::write_svg(&path, &rows).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("loss.svg is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let lines: Vec<Vec<(f64, f64)>> = doc
        .descendants()
        .filter(|n| n.has_tag_name("polyline"))
        .map(|n| {
            n.attribute("points")
                .unwrap()
                .split_whitespace()
                .map(|p| {
                    let (x, y) = p.split_once(',').unwrap();
                    (x.parse().unwrap(), y.parse().unwrap())
                })
                .collect()
        })
        .filter(|v: &Vec<(f64, f64)>| v.len() > 2)
        .collect();
    assert_eq!(lines.len(), 2, "the loss and its EMA");
    let (raw, ema) = (&lines[0], &lines[1]);
    assert_eq!((raw.len(), ema.len()), (120, 120));
    assert!(raw.windows(2).all(|w| w[1].0 > w[0].0), "x increases with the step");
    // Pixel rows: the spike is the highest point of the raw curve; the raw curve ends lower on
    // the chart (larger y) than it starts; the EMA is smooth there (it moves less than the spike).
    let top = raw.iter().enumerate().min_by(|a, b| a.1 .1.total_cmp(&b.1 .1)).unwrap().0;
    assert_eq!(top, 59);
    assert!(raw[119].1 > raw[0].1 + 100.0);
    // At the spike the EMA moves by (1 − β) of the raw jump (its debiasing factor is ≈ 1 there).
    let beta = losslog::ema_beta(120);
    let (jump_raw, jump_ema) = (raw[58].1 - raw[59].1, ema[58].1 - ema[59].1);
    let ratio = jump_ema / jump_raw;
    assert!((ratio - (1.0 - beta)).abs() < 0.1 * (1.0 - beta), "raw {jump_raw}, EMA {jump_ema}, β {beta}");
    assert!(text.contains(&format!("EMA (β = {beta:.3})")));

    // Long logs are thinned to at most MAX_POINTS per curve.
    let long: Vec<(u64, f32)> = (1..=5000u64).map(|s| (s, 1.0 / s as f32)).collect();
    losslog::write_svg(&path, &long).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let n = text
        .split("<polyline")
        .skip(1)
        .map(|p| p.split("points=\"").nth(1).unwrap().split('"').next().unwrap().split_whitespace().count())
        .max();
    assert!(n.unwrap() <= losslog::MAX_POINTS && n.unwrap() > 1000, "{n:?}");
}

#[test]
fn ema_window_follows_the_log_length() {
    assert_eq!(losslog::ema_beta(10), 0.8);
    assert_eq!(losslog::ema_beta(2000), 1.0 - 1.0 / 40.0);
    assert_eq!(losslog::ema_beta(1_000_000), 1.0 - 1.0 / 500.0);
}

#[test]
fn ema_is_debiased() {
    let e = losslog::ema(&[2.0, 2.0, 2.0, 4.0], 0.5);
    assert!((e[0] - 2.0).abs() < 1e-12 && (e[2] - 2.0).abs() < 1e-12, "{e:?}");
    // m4 = 0.5·m3 + 0.5·4 with m3 = 2·(1 − 0.5³); divided by 1 − 0.5⁴.
    let m3 = 2.0 * (1.0 - 0.125);
    assert!((e[3] - (0.5 * m3 + 2.0) / (1.0 - 0.0625)).abs() < 1e-12);
}

#[test]
fn bundled_model_is_embedded_exactly_when_the_file_exists() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(meddpm::checkpoint::bundled::PATH);
    let bytes = meddpm::checkpoint::bundled::bytes();
    assert_eq!(bytes.is_some(), file.is_file(), "build.rs did not follow {}", file.display());
    if let Some(b) = bytes {
        assert_eq!(b, std::fs::read(&file).unwrap().as_slice());
        let w = meddpm::checkpoint::bundled::load(meddpm::checkpoint::WeightGroup::Ema, &Default::default())
            .unwrap()
            .unwrap();
        assert!(w.source.starts_with("bundled demo model"));
    } else {
        let m = meddpm::checkpoint::bundled::absent_message();
        assert!(m.contains(meddpm::checkpoint::bundled::PATH) && m.contains("--checkpoint"));
    }
}

#[test]
fn weights_load_from_bytes_as_from_the_file() {
    let dir = scratch("bytes");
    let be = CpuBackend::new();
    let tr = Trainer::new(&be, &UNetConfig::tiny(), &tc()).unwrap();
    let p = dir.join("ck.safetensors");
    save_trainer(&p, &be, &tr).unwrap();
    let g = meddpm::checkpoint::WeightGroup::Ema;
    let a = meddpm::checkpoint::load_weights(&p, g, None).unwrap();
    let b =
        meddpm::checkpoint::load_weights_from_bytes(&std::fs::read(&p).unwrap(), &p, g, &Default::default()).unwrap();
    assert_eq!((a.cfg, a.params, a.source), (b.cfg, b.params, b.source));
    let bad =
        meddpm::checkpoint::load_weights_from_bytes(b"nonsense", Path::new("x.safetensors"), g, &Default::default());
    assert!(bad.unwrap_err().to_string().contains("x.safetensors"));
}
