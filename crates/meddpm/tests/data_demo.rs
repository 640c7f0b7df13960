//! The built-in demo data: the committed files are exactly what the derivation from the MNI152
//! template produces (when ../shared is present), the embedded dataset yields correct samples,
//! and the copyright notice travels with the files.
//!
//! `MEDDPM_WRITE_DEMO=1 cargo test -p meddpm --test data_demo -- --ignored write_demo_files`
//! (tools/make_demo/make_demo.sh) re-derives the files.

#![allow(clippy::needless_range_loop)] // matrices read best with explicit indices

use meddpm::data::demo;
use meddpm::data::nifti::{read_volume, write_labels, write_volume};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn mni_dir() -> Option<PathBuf> {
    let d = root().join("../shared/data/mni152");
    if d.join(demo::MNI_T1).is_file() {
        Some(d)
    } else {
        println!("SKIP: {} not found (no ../shared next to the workspace)", d.display());
        None
    }
}

#[test]
#[ignore]
fn write_demo_files() {
    if std::env::var("MEDDPM_WRITE_DEMO").as_deref() != Ok("1") {
        println!("SKIP: set MEDDPM_WRITE_DEMO=1 to rewrite testdata/demo");
        return;
    }
    let Some(mni) = mni_dir() else { panic!("the MNI152 template is needed to derive the demo") };
    let pairs = demo::derive_from_mni152(&mni).unwrap();
    let out = root().join("testdata/demo");
    for ((mask, image), (mn, inm)) in pairs.iter().zip(demo::FILES) {
        std::fs::create_dir_all(out.join(mn).parent().unwrap()).unwrap();
        std::fs::create_dir_all(out.join(inm).parent().unwrap()).unwrap();
        write_labels(out.join(mn), mask).unwrap();
        write_volume(out.join(inm), image).unwrap();
    }
    std::fs::write(out.join("NOTICE.txt"), format!("{}\n", demo::NOTICE)).unwrap();
}

#[test]
#[ignore]
fn write_mni64_files() {
    if std::env::var("MEDDPM_WRITE_DEMO").as_deref() != Ok("1") {
        println!("SKIP: set MEDDPM_WRITE_DEMO=1 to rewrite testdata/mni64");
        return;
    }
    let Some(mni) = mni_dir() else { panic!("the MNI152 template is needed to derive testdata/mni64") };
    let (t1, masks) = demo::derive_mni64(&mni).unwrap();
    let out = root().join("testdata/mni64");
    std::fs::create_dir_all(&out).unwrap();
    write_labels(out.join(demo::MNI64_T1), &t1).unwrap();
    for (m, name) in masks.iter().zip(demo::MNI64_MASKS) {
        write_labels(out.join(name), m).unwrap();
    }
    std::fs::write(out.join("NOTICE.txt"), format!("{}\n", demo::NOTICE)).unwrap();
}

#[test]
fn committed_mni64_equals_a_fresh_derivation() {
    let Some(mni) = mni_dir() else { return };
    let (t1, masks) = demo::derive_mni64(&mni).unwrap();
    let dir = root().join("testdata/mni64");
    for (want, name) in std::iter::once((&t1, demo::MNI64_T1)).chain(masks.iter().zip(demo::MNI64_MASKS)) {
        let got = read_volume(dir.join(name)).unwrap();
        assert_eq!(got.dims, want.dims, "{name}");
        assert_eq!(got.spacing, want.spacing, "{name}");
        assert_eq!(got.affine, want.affine, "{name}");
        assert!(got.data == want.data, "{name}: voxels differ from the derivation");
    }
}

#[test]
fn mni64_material_agrees_with_the_demo() {
    // the 64³ grid is the demo's cube in 3 mm voxels: 2×2×2 blocks of its T1 average to the demo's
    // lesion-free T1 (up to the rounding to integers), its masks have the lesion balls where the demo's are
    let dir = root().join("testdata/mni64");
    let t1 = read_volume(dir.join(demo::MNI64_T1)).unwrap();
    assert_eq!((t1.dims, t1.spacing), ([64; 3], [3.0; 3]));
    let demo_pairs = demo::volumes().unwrap();
    for (p, name) in demo::MNI64_MASKS.iter().enumerate() {
        let m = read_volume(dir.join(name)).unwrap();
        assert_eq!(m.dims, [64; 3]);
        let lesion = m.data.iter().filter(|&&v| v == 2.0).count();
        // lattice points within 5 voxels of a half-integer centre: 4/3·π·125 ≈ 524
        assert!((480..=560).contains(&lesion), "mask {p}: {lesion} lesion voxels");
        let c = demo::LESION_CENTRES[p].map(|v| 2 * v);
        assert_eq!(m.at(c[0], c[1], c[2]), 2.0);
        assert_eq!(m.at(c[0] + 1, c[1] + 1, c[2] + 1), 2.0);
        // same affine origin as the demo's voxel 0 up to half a demo voxel (3 mm − 1.5 mm)
        for r in 0..3 {
            assert_eq!(m.affine[r][3] + 1.5, demo_pairs[p].0.affine[r][3], "axis {r}");
        }
    }
    // far from both lesions the demo image is the block mean of the 64³ T1 (rounding: ≤ 0.5)
    let img = &demo_pairs[0].1;
    let (i, j, k) = (16, 8, 8);
    let mut s = 0.0;
    for d in 0..8 {
        s += t1.at(2 * i + (d & 1), 2 * j + (d >> 1 & 1), 2 * k + (d >> 2)) as f64;
    }
    assert!((s / 8.0 - img.at(i, j, k) as f64).abs() <= 0.5, "{} vs {}", s / 8.0, img.at(i, j, k));
}

#[test]
fn committed_demo_equals_a_fresh_derivation() {
    let Some(mni) = mni_dir() else { return };
    let derived = demo::derive_from_mni152(&mni).unwrap();
    for ((mask, image), (mn, inm)) in derived.iter().zip(demo::FILES) {
        for (want, name) in [(mask, mn), (image, inm)] {
            let file = read_volume(root().join("testdata/demo").join(name)).unwrap();
            let emb = demo::embedded(name).unwrap().unwrap();
            for got in [&file, &emb] {
                assert_eq!(got.dims, want.dims, "{name}");
                assert_eq!(got.spacing, want.spacing, "{name}");
                assert_eq!(got.affine, want.affine, "{name}");
                assert!(got.data == want.data, "{name}: voxels differ from the derivation");
            }
        }
    }
}

#[test]
fn demo_geometry_matches_the_template() {
    // Independent of the derivation code: the demo's voxel (i, j, k) centre must sit at the
    // world position of template voxel start + 6·(i, j, k) + 2.5, with the template's affine
    // (1 mm, origin (−98, −134, −72)) and the cube centred on the brain bounding box
    // [26..170] × [27..207] × [0..154] (nibabel), i.e. start = (2, 21, −19).
    let (mask, image) = &demo::volumes().unwrap()[0];
    assert_eq!(mask.dims, [32, 32, 32]);
    assert_eq!(mask.spacing, [6.0, 6.0, 6.0]);
    let start = [2.0f32, 21.0, -19.0];
    let origin = [-98.0f32, -134.0, -72.0];
    for r in 0..3 {
        assert_eq!(mask.affine[r][r], 6.0);
        assert_eq!(mask.affine[r][3], origin[r] + start[r] + 2.5, "axis {r}");
    }
    assert_eq!(image.affine, mask.affine);
}

#[test]
fn demo_labels_and_lesion() {
    for (p, (mask, image)) in demo::volumes().unwrap().iter().enumerate() {
        let count = |l: f32| mask.data.iter().filter(|&&v| v == l).count();
        let (bg, head, lesion) = (count(0.0), count(1.0), count(2.0));
        assert_eq!(bg + head + lesion, 32 * 32 * 32, "pair {p}: only labels 0, 1, 2");
        // the lesion is a ball of radius 2.5 voxels: lattice points with d² ≤ 6.25 number 81
        assert_eq!(lesion, 81, "pair {p}");
        assert!(head > 6000 && head < 12000, "pair {p}: head {head}");
        let c = demo::LESION_CENTRES[p];
        assert_eq!(mask.at(c[0], c[1], c[2]), 2.0);
        // hypointense lesion: the mean image value inside the lesion is below the brain mean
        let mean = |l: f32| {
            let v: Vec<f32> = mask.data.iter().zip(&image.data).filter(|(&m, _)| m == l).map(|(_, &i)| i).collect();
            v.iter().sum::<f32>() / v.len() as f32
        };
        assert!(mean(2.0) < 0.6 * mean(1.0), "pair {p}: lesion {} vs head {}", mean(2.0), mean(1.0));
        assert!(image.data.iter().all(|&v| (0.0..=255.0).contains(&v)));
    }
    // the two pairs differ only around the lesions
    let v = demo::volumes().unwrap();
    let diff = v[0].0.data.iter().zip(&v[1].0.data).filter(|(a, b)| a != b).count();
    assert_eq!(diff, 2 * 81);
}

#[test]
fn demo_dataset_gives_model_tensors() {
    let ds = demo::dataset();
    assert_eq!(ds.len(), 2);
    ds.validate().unwrap();
    let s = ds.get(1).unwrap();
    assert_eq!((s.image_channels, s.cond_channels, s.dims), (1, 2, [32, 32, 32]));
    assert_eq!(s.cond.iter().filter(|&&v| v == 1.0).count() + s.cond.iter().filter(|&&v| v == -1.0).count(), 2 * 32768);
    assert_eq!(s.cond[32768..].iter().filter(|&&v| v == 1.0).count(), 81);
    let (lo, hi) = s.image.iter().fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
    assert_eq!((lo, hi), (-1.0, 1.0));
    // resized demo for a 16³ model
    let small = demo::dataset_at([16, 16, 16]).unwrap().get(0).unwrap();
    assert_eq!(small.image.len(), 16 * 16 * 16);
    assert_eq!(small.cond.len(), 2 * 16 * 16 * 16);
}

#[test]
fn notice_travels_with_the_data() {
    let text = std::fs::read_to_string(root().join("testdata/demo/NOTICE.txt")).unwrap();
    assert!(text.contains("Copyright (C) 1993-2009 Louis Collins, McConnell Brain Imaging Centre"));
    assert_eq!(text.trim(), demo::NOTICE);
    // all committed fixtures stay small
    let mut total = 0u64;
    for dir in ["testdata/demo/mask", "testdata/demo/image", "testdata/nifti", "testdata/mni64"] {
        for e in std::fs::read_dir(root().join(dir)).unwrap() {
            total += e.unwrap().metadata().unwrap().len();
        }
    }
    assert!(total < 1_800_000, "fixtures take {total} bytes");
    let text = std::fs::read_to_string(root().join("testdata/mni64/NOTICE.txt")).unwrap();
    assert_eq!(text.trim(), demo::NOTICE);
}
