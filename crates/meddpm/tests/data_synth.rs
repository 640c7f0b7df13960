//! Synthetic datasets (`data::synth`) on the CPU with the bundled demo model (32³) at a few
//! sampler steps: each layout (nnU-Net v2 checked as its `verify_dataset_integrity` checks it,
//! MONAI's datalist, plain folders that `meddpm train` pairs again), resume (a second run skips
//! everything and changes no file; a deleted file is made again, the same bytes), and every
//! volume made again from its manifest line, bit for bit.

use meddpm::checkpoint::{bundled, LoadHints, LoadedWeights, WeightGroup};
use meddpm::cpu::CpuBackend;
use meddpm::data::nifti::{read_volume, Volume};
use meddpm::data::synth::{read_manifest, regenerate, synthesize, Format, ModelId, Progress, SynthSpec};
use meddpm::data::{Convention, Dataset};
use meddpm::diffusion::{SamplerKind, SamplerSpec};
use meddpm::testing::scratch_dir;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn model() -> Option<(LoadedWeights, ModelId)> {
    let w = bundled::load(WeightGroup::Ema, &LoadHints::default()).unwrap();
    let id = ModelId::bundled(WeightGroup::Ema).unwrap();
    match (w, id) {
        (Some(w), Some(id)) => Some((w, id)),
        _ => {
            println!("SKIP: this build has no bundled demo model ({})", bundled::PATH);
            None
        }
    }
}

/// 3 DDPM steps, batch 2, the two built-in masks plus one new mask each, 5 pairs.
fn spec(out: &Path, format: Format) -> SynthSpec {
    SynthSpec {
        augment: 1,
        count: Some(5),
        seed: 11,
        sampler: SamplerSpec { kind: SamplerKind::Ddpm, steps: 3, eta: 0.0 },
        batch: 2,
        dataset_id: 7,
        dataset_name: "Synth".into(),
        ..SynthSpec::new(out, format)
    }
}

fn run(spec: &SynthSpec, w: &LoadedWeights, id: &ModelId) -> (meddpm::data::synth::Summary, Vec<Progress>) {
    let mut seen = Vec::new();
    let s = synthesize(&CpuBackend::new(), w, id, spec, |p| seen.push(*p)).unwrap();
    (s, seen)
}

fn bits(v: &Volume) -> Vec<u32> {
    v.data.iter().map(|x| x.to_bits()).collect()
}

/// Every file under `dir` (relative path → bytes).
fn tree(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(p.strip_prefix(dir).unwrap().to_path_buf(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// nnU-Net v2's `verify_dataset_integrity` (nnunetv2/experiment_planning), on our files: the
/// required dataset.json keys; cases = label files, each with an image per channel
/// (`<case>_<cccc>.nii.gz`); numTraining = cases; labels consecutive from 0; every label map's
/// values among them; images and label of a case with the same shape, spacing and affine; no NaN.
fn verify_nnunet(root: &Path) {
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(root.join("dataset.json")).unwrap()).unwrap();
    for k in ["labels", "channel_names", "numTraining", "file_ending"] {
        assert!(json.get(k).is_some(), "dataset.json lacks {k}: {json}");
    }
    let ending = json["file_ending"].as_str().unwrap();
    assert_eq!(ending, ".nii.gz");
    let channels = json["channel_names"].as_object().unwrap().len();
    let names = |dir: &str| -> BTreeSet<String> {
        std::fs::read_dir(root.join(dir))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(ending) && !n.starts_with('.'))
            .collect()
    };
    let images = names("imagesTr");
    let labels = names("labelsTr");
    // identifiers: image file names without `_XXXX` + ending
    let ids: BTreeSet<String> = images.iter().map(|n| n[..n.len() - ending.len() - 5].to_string()).collect();
    let label_ids: BTreeSet<String> = labels.iter().map(|n| n[..n.len() - ending.len()].to_string()).collect();
    assert_eq!(ids, label_ids, "every case needs a label file and images");
    assert_eq!(json["numTraining"].as_u64().unwrap() as usize, ids.len());
    assert_eq!(images.len(), ids.len() * channels, "one image per channel and case");
    let mut expected: Vec<i64> = json["labels"].as_object().unwrap().values().map(|v| v.as_i64().unwrap()).collect();
    expected.sort();
    assert_eq!(expected, (0..expected.len() as i64).collect::<Vec<_>>(), "labels must be 0, 1, 2, ...");
    for id in &ids {
        let seg = read_volume(root.join("labelsTr").join(format!("{id}{ending}"))).unwrap();
        for v in &seg.data {
            assert!(expected.contains(&(*v as i64)) && v.fract() == 0.0, "{id}: unexpected label {v}");
        }
        for c in 0..channels {
            let img = read_volume(root.join("imagesTr").join(format!("{id}_{c:04}{ending}"))).unwrap();
            assert!(img.data.iter().all(|v| v.is_finite()), "{id}: NaN in the image");
            assert_eq!(img.dims, seg.dims, "{id}: shape");
            assert_eq!(img.spacing, seg.spacing, "{id}: spacing");
            assert_eq!(img.affine, seg.affine, "{id}: affine (origin, direction)");
        }
    }
}

#[test]
fn nnunet_layout_passes_nnunets_integrity_checks() {
    let Some((w, id)) = model() else { return };
    let dir = scratch_dir("synth-nnunet");
    let sp = spec(&dir, Format::Nnunet);
    let (s, progress) = run(&sp, &w, &id);
    assert_eq!((s.planned, s.share, s.skipped, s.sampled), (5, 5, 0, 5));
    let root = dir.join("Dataset007_Synth");
    assert_eq!(s.root, root);
    verify_nnunet(&root);
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(root.join("dataset.json")).unwrap()).unwrap();
    assert_eq!(json["channel_names"]["0"], "T1");
    assert_eq!(json["labels"]["tumour"], 2);
    assert_eq!(json["numTraining"], 5);
    // progress: once before (nothing done), then after each batch of 2
    let done: Vec<usize> = progress.iter().map(|p| p.done).collect();
    assert_eq!(done, vec![0, 2, 4, 5]);
    // the manifest: one line per pair, the pool cycled (2 masks + 1 new each), seeds from 11
    let lines = read_manifest(&root).unwrap();
    assert_eq!(lines.len(), 5);
    assert_eq!(lines.iter().map(|l| l.seed).collect::<Vec<_>>(), vec![11, 12, 13, 14, 15]);
    assert_eq!(lines[0].augmentation, meddpm::data::synth::Augmentation::None);
    assert_ne!(lines[1].augmentation, meddpm::data::synth::Augmentation::None);
    assert_eq!(lines[0].checkpoint_hash, id.hash);
    assert_eq!(lines[0].images, vec!["imagesTr/synth_00000_0000.nii.gz".to_string()]);
    // the label of an augmented pair is its new mask, not the source mask
    let aug = read_volume(root.join(&lines[1].label)).unwrap();
    let src = read_volume(root.join(&lines[0].label)).unwrap();
    assert_ne!(bits(&aug), bits(&src));
}

#[test]
fn monai_layout_has_a_datalist_of_its_files() {
    let Some((w, id)) = model() else { return };
    let dir = scratch_dir("synth-monai");
    let sp = SynthSpec { count: Some(3), ..spec(&dir, Format::Monai) };
    run(&sp, &w, &id);
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("datalist.json")).unwrap()).unwrap();
    let training = json["training"].as_array().unwrap();
    assert_eq!(training.len(), 3);
    for t in training {
        let (img, lab) = (t["image"].as_str().unwrap(), t["label"].as_str().unwrap());
        assert!(img.starts_with("images/") && lab.starts_with("labels/"), "{t}");
        let (i, l) = (read_volume(dir.join(img)).unwrap(), read_volume(dir.join(lab)).unwrap());
        assert_eq!((i.dims, i.affine), (l.dims, l.affine));
    }
}

#[test]
fn plain_layout_is_a_meddpm_training_set() {
    let Some((w, id)) = model() else { return };
    let dir = scratch_dir("synth-plain");
    let sp = SynthSpec { count: Some(3), ..spec(&dir, Format::Plain) };
    run(&sp, &w, &id);
    let ds = Dataset::from_folders(&dir.join("masks"), &[dir.join("images")], Convention::whole_head(), [32, 32, 32])
        .unwrap();
    assert_eq!(ds.len(), 3);
    ds.validate().unwrap();
}

#[test]
fn resume_skips_finished_pairs_and_remakes_a_lost_file() {
    let Some((w, id)) = model() else { return };
    let dir = scratch_dir("synth-resume");
    let sp = SynthSpec { count: Some(3), ..spec(&dir, Format::Nnunet) };
    run(&sp, &w, &id);
    let root = sp.root();
    let before = tree(&root);
    // a second run: nothing to sample, no file touched
    let (s, _) = run(&sp, &w, &id);
    assert_eq!((s.skipped, s.sampled), (3, 0));
    assert_eq!(tree(&root), before);
    // a run killed mid-pair: one image lost, a torn manifest line; the pair is made again
    std::fs::remove_file(root.join("imagesTr/synth_00001_0000.nii.gz")).unwrap();
    let m = root.join("meddpm_manifest.jsonl");
    let mut text = std::fs::read_to_string(&m).unwrap();
    text.push_str("{\"case\":\"synth_0");
    std::fs::write(&m, text).unwrap();
    let (s, _) = run(&sp, &w, &id);
    assert_eq!((s.skipped, s.sampled), (2, 1));
    let after = tree(&root);
    let ours = |t: &BTreeMap<PathBuf, Vec<u8>>| -> BTreeMap<PathBuf, Vec<u8>> {
        t.iter().filter(|(p, _)| !p.ends_with("meddpm_manifest.jsonl")).map(|(p, b)| (p.clone(), b.clone())).collect()
    };
    assert_eq!(ours(&after), ours(&before), "the remade pair has the same bytes");
    assert_eq!(read_manifest(&root).unwrap().len(), 4, "the old line and the remade pair's line");
    // another seed into the same folder is refused, not mixed in
    let other = SynthSpec { seed: 99, ..sp.clone() };
    let err = synthesize(&CpuBackend::new(), &w, &id, &other, |_| {}).unwrap_err().to_string();
    assert!(err.contains("other settings"), "{err}");
}

#[test]
fn manifest_lines_regenerate_every_volume_bit_for_bit() {
    let Some((w, id)) = model() else { return };
    let dir = scratch_dir("synth-regen");
    // iPNDM too: a multistep sampler with history buffers; batch 3 for 4 pairs (a short batch)
    let sp = SynthSpec {
        count: Some(4),
        batch: 3,
        sampler: SamplerSpec { kind: SamplerKind::Ipndm, steps: 4, eta: 0.0 },
        ..spec(&dir, Format::Plain)
    };
    run(&sp, &w, &id);
    let be = CpuBackend::new();
    for line in read_manifest(&dir).unwrap() {
        let outs = regenerate(&be, &w, &id, &line).unwrap();
        let image = read_volume(dir.join(&line.images[0])).unwrap();
        let label = read_volume(dir.join(&line.label)).unwrap();
        assert_eq!(bits(&outs[0].volume), bits(&image), "{}: image", line.case);
        assert_eq!(bits(&outs.last().unwrap().volume), bits(&label), "{}: label", line.case);
    }
    // the wrong checkpoint is named
    let other = ModelId { hash: "0".repeat(32), ..id.clone() };
    let line = &read_manifest(&dir).unwrap()[0];
    assert!(regenerate(&be, &w, &other, line).unwrap_err().to_string().contains("was made by checkpoint"));
}
