//! Datasets: pairing masks and images by the digits in file names (like the reference) or by a
//! CSV manifest, tensors from `get`, and every bad input refused by `validate` with one error
//! naming the file.

use meddpm::data::dataset::{pair_key, Dataset};
use meddpm::data::nifti::{write_labels, write_volume, Volume};
use meddpm::data::Convention;
use std::path::{Path, PathBuf};

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meddpm-ds-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// 8×6×4 mask: label 1 in x ≥ 2, label 2 at x ≥ 6 and y ≥ 4; image = x + 10y + 100z + k.
fn mask_vol() -> Volume {
    let mut d = Vec::new();
    for _z in 0..4 {
        for y in 0..6 {
            for x in 0..8 {
                d.push(if x >= 6 && y >= 4 {
                    2.0
                } else if x >= 2 {
                    1.0
                } else {
                    0.0
                });
            }
        }
    }
    Volume::new([8, 6, 4], [2.0; 3], d)
}

fn image_vol(k: f32) -> Volume {
    let mut d = Vec::new();
    for z in 0..4 {
        for y in 0..6 {
            for x in 0..8 {
                d.push(x as f32 + 10.0 * y as f32 + 100.0 * z as f32 + k);
            }
        }
    }
    Volume::new([8, 6, 4], [2.0; 3], d)
}

/// masks/, images/ with pairs named mask_<n>.nii.gz / img_<n>.nii.gz.
fn make_folders(tag: &str, ids: &[&str]) -> (PathBuf, PathBuf, PathBuf) {
    let root = tempdir(tag);
    let (m, i) = (root.join("masks"), root.join("images"));
    std::fs::create_dir_all(&m).unwrap();
    std::fs::create_dir_all(&i).unwrap();
    for (k, id) in ids.iter().enumerate() {
        write_labels(m.join(format!("mask_{id}.nii.gz")), &mask_vol()).unwrap();
        write_volume(i.join(format!("img_{id}.nii.gz")), &image_vol(k as f32)).unwrap();
    }
    (root, m, i)
}

fn err_of(r: meddpm::Result<impl std::fmt::Debug>) -> String {
    r.expect_err("expected an error").to_string()
}

#[test]
fn pair_keys_follow_the_reference_digits() {
    assert_eq!(pair_key(Path::new("a/sample_0.nii.gz")).unwrap(), "0");
    assert_eq!(pair_key(Path::new("msk_12.nii")).unwrap(), "12");
    assert_eq!(pair_key(Path::new("img_012.nii.gz")).unwrap(), "12", "int() drops leading zeros");
    assert_eq!(pair_key(Path::new("BraTS2021_00529_seg.nii.gz")).unwrap(), "202100529");
    assert_eq!(pair_key(Path::new("BraTS2021_00529_t1ce.nii.gz")).unwrap(), "202100529");
    assert_eq!(pair_key(Path::new("BraTS2021_00529_t1.nii.gz")).unwrap(), "202100529");
    assert_eq!(pair_key(Path::new("BraTS-GLI-00001-000-t2f.nii.gz")).unwrap(), "1000");
    assert_eq!(pair_key(Path::new("s1_a2.nii.gz")).unwrap(), "12", "all digits, concatenated");
    assert!(pair_key(Path::new("mask.nii.gz")).is_none());
}

#[test]
fn folders_pair_and_give_tensors() {
    let (root, m, i) = make_folders("ok", &["2", "10", "1"]);
    let ds = Dataset::from_folders(&m, std::slice::from_ref(&i), Convention::whole_head(), [4, 6, 8]).unwrap();
    assert_eq!(ds.len(), 3);
    ds.validate().unwrap();
    // sorted by mask file name: mask_1, mask_10, mask_2 — each with its own image
    let names: Vec<String> =
        ds.pairs().iter().map(|p| p.images[0].name().file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["img_1.nii.gz", "img_10.nii.gz", "img_2.nii.gz"]);
    let s = ds.get(0).unwrap();
    assert_eq!((s.image_channels, s.cond_channels, s.dims, s.index), (1, 2, [4, 6, 8], 0));
    // cond channel 0 = label 1, channel 1 = label 2, at tensor (c, z, y, x)
    let at = |c: usize, z: usize, y: usize, x: usize| s.cond[((c * 4 + z) * 6 + y) * 8 + x];
    assert_eq!(at(0, 3, 0, 2), 1.0);
    assert_eq!(at(0, 3, 5, 7), -1.0);
    assert_eq!(at(1, 3, 5, 7), 1.0);
    assert_eq!(at(1, 0, 0, 0), -1.0);
    // image min 0 (voxel 0) → −1, max 7+50+300 → +1, linear in between
    let img = |z: usize, y: usize, x: usize| s.image[(z * 6 + y) * 8 + x];
    assert_eq!(img(0, 0, 0), -1.0);
    assert_eq!(img(3, 5, 7), 1.0);
    assert!((img(1, 2, 3) - ((123.0 / 357.0) * 2.0 - 1.0)).abs() < 1e-6);
    // a manifest listing the same files in another order
    let csv = root.join("list.csv");
    std::fs::write(
        &csv,
        "mask,image\n# comment\nmasks/mask_2.nii.gz, images/img_2.nii.gz\n\nmasks/mask_1.nii.gz,images/img_1.nii.gz\n",
    )
    .unwrap();
    let ds2 = Dataset::open(&csv, &[], Convention::whole_head(), [4, 6, 8]).unwrap();
    assert_eq!(ds2.len(), 2);
    assert_eq!(ds2.get(1).unwrap().image, ds.get(0).unwrap().image);
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn pairing_problems_name_the_file() {
    // an image without a mask
    let (root, m, i) = make_folders("orphan", &["1", "2"]);
    write_volume(i.join("img_3.nii.gz"), &image_vol(0.0)).unwrap();
    let e = err_of(Dataset::from_folders(&m, std::slice::from_ref(&i), Convention::whole_head(), [4, 6, 8]));
    assert!(e.contains("img_3.nii.gz") && e.contains("no mask"), "{e}");
    // a mask without an image
    std::fs::remove_file(i.join("img_3.nii.gz")).unwrap();
    write_labels(m.join("mask_4.nii.gz"), &mask_vol()).unwrap();
    let e = err_of(Dataset::from_folders(&m, std::slice::from_ref(&i), Convention::whole_head(), [4, 6, 8]));
    assert!(e.contains("mask_4.nii.gz") && e.contains("no image"), "{e}");
    // two files with the same number
    std::fs::remove_file(m.join("mask_4.nii.gz")).unwrap();
    write_volume(i.join("img_01.nii.gz"), &image_vol(0.0)).unwrap();
    let e = err_of(Dataset::from_folders(&m, std::slice::from_ref(&i), Convention::whole_head(), [4, 6, 8]));
    assert!(e.contains("img_01.nii.gz") && e.contains("img_1.nii.gz") && e.contains("ambiguous"), "{e}");
    std::fs::remove_file(i.join("img_01.nii.gz")).unwrap();
    // a name without digits
    write_labels(m.join("mask.nii.gz"), &mask_vol()).unwrap();
    let e = err_of(Dataset::from_folders(&m, std::slice::from_ref(&i), Convention::whole_head(), [4, 6, 8]));
    assert!(e.contains("mask.nii.gz") && e.contains("no digits"), "{e}");
    std::fs::remove_file(m.join("mask.nii.gz")).unwrap();
    // empty and missing folders
    let empty = root.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::write(empty.join("README.txt"), "not a volume").unwrap();
    let e = err_of(Dataset::from_folders(&empty, std::slice::from_ref(&i), Convention::whole_head(), [4, 6, 8]));
    assert!(e.contains("empty") && e.contains("no .nii"), "{e}");
    let e = err_of(Dataset::from_folders(
        &root.join("nope"),
        std::slice::from_ref(&i),
        Convention::whole_head(),
        [4, 6, 8],
    ));
    assert!(e.contains("nope"), "{e}");
    // wrong number of image folders for the convention
    let e = err_of(Dataset::from_folders(&m, std::slice::from_ref(&i), Convention::brats(), [4, 6, 8]));
    assert!(e.contains("needs 4"), "{e}");
    // manifest problems
    let csv = root.join("bad.csv");
    std::fs::write(&csv, "mask,image\nmasks/mask_1.nii.gz,images/missing.nii.gz\n").unwrap();
    let e = err_of(Dataset::from_manifest(&csv, Convention::whole_head(), [4, 6, 8]));
    assert!(e.contains("missing.nii.gz") && e.contains("line 2"), "{e}");
    std::fs::write(&csv, "image,mask\n").unwrap();
    let e = err_of(Dataset::from_manifest(&csv, Convention::whole_head(), [4, 6, 8]));
    assert!(e.contains("bad.csv") && e.contains("header"), "{e}");
    std::fs::write(&csv, "mask,image\n").unwrap();
    let e = err_of(Dataset::from_manifest(&csv, Convention::whole_head(), [4, 6, 8]));
    assert!(e.contains("bad.csv") && e.contains("no pairs"), "{e}");
    std::fs::remove_dir_all(&root).ok();
}

/// `validate` must refuse the dataset, naming `file` and saying `needle`.
fn assert_invalid(m: &Path, i: &Path, file: &str, needle: &str) {
    let ds = Dataset::from_folders(m, &[i.to_path_buf()], Convention::whole_head(), [4, 6, 8]).unwrap();
    let e = err_of(ds.validate());
    assert!(e.contains(file) && e.contains(needle), "expected `{file}` and `{needle}` in: {e}");
}

#[test]
fn validate_refuses_bad_pairs_up_front() {
    let (root, m, i) = make_folders("validate", &["1", "2", "3"]);
    // mismatched shapes
    let small = Volume::new([8, 6, 3], [2.0; 3], vec![0.0; 8 * 6 * 3]);
    write_volume(i.join("img_2.nii.gz"), &small).unwrap();
    assert_invalid(&m, &i, "img_2.nii.gz", "[8, 6, 3]");
    write_volume(i.join("img_2.nii.gz"), &image_vol(0.0)).unwrap();
    // NaN voxel
    let mut nan = image_vol(0.0);
    nan.data[17] = f32::NAN;
    std::fs::write(i.join("img_3.nii.gz"), b"").unwrap();
    write_volume(i.join("img_3.nii.gz"), &nan).unwrap();
    assert_invalid(&m, &i, "img_3.nii.gz", "NaN");
    write_volume(i.join("img_3.nii.gz"), &image_vol(0.0)).unwrap();
    // label out of range
    let mut lab = mask_vol();
    lab.data[5] = 3.0;
    write_labels(m.join("mask_1.nii.gz"), &lab).unwrap();
    assert_invalid(&m, &i, "mask_1.nii.gz", "outside the labels 0..=2");
    // non-integer label
    lab.data[5] = 0.5;
    write_volume(m.join("mask_1.nii.gz"), &lab).unwrap();
    assert_invalid(&m, &i, "mask_1.nii.gz", "value 0.5");
    write_labels(m.join("mask_1.nii.gz"), &mask_vol()).unwrap();
    // truncated gzip
    let bytes = std::fs::read(m.join("mask_3.nii.gz")).unwrap();
    std::fs::write(m.join("mask_3.nii.gz"), &bytes[..bytes.len() - 30]).unwrap();
    assert_invalid(&m, &i, "mask_3.nii.gz", "gzip");
    // non-3-D
    let flat = Volume::new([8, 6, 1], [1.0; 3], vec![0.0; 48]);
    write_labels(m.join("mask_3.nii.gz"), &flat).unwrap();
    assert_invalid(&m, &i, "img_3.nii.gz", "[8, 6, 4]");
    // several problems: the first is reported with a count of the rest
    write_labels(m.join("mask_3.nii.gz"), &mask_vol()).unwrap();
    std::fs::write(i.join("img_1.nii.gz"), b"junk").unwrap();
    std::fs::write(i.join("img_3.nii.gz"), b"junk").unwrap();
    assert_invalid(&m, &i, "img_1.nii.gz", "and 1 more");
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn brats_folders_stack_modalities_and_one_hot_four_labels() {
    let root = tempdir("brats");
    let mods = ["t1", "t1ce", "t2", "flair"];
    let mut folders = Vec::new();
    for (k, m) in mods.iter().enumerate() {
        let d = root.join(m);
        std::fs::create_dir_all(&d).unwrap();
        for case in ["00529", "01306"] {
            // modality k has value k·0.25 − 0.5 everywhere but voxel 0 (−1) and voxel 1 (+1)
            let mut v = vec![k as f32 * 0.25 - 0.5; 8 * 6 * 4];
            v[0] = -1.0;
            v[1] = 1.0;
            write_volume(d.join(format!("BraTS2021_{case}_{m}.nii.gz")), &Volume::new([8, 6, 4], [1.0; 3], v)).unwrap();
        }
        folders.push(d);
    }
    let seg_dir = root.join("seg");
    std::fs::create_dir_all(&seg_dir).unwrap();
    for case in ["00529", "01306"] {
        // labels 0..4 by x: x = 0,1 → 0; 2 → 1; 3 → 2; 4 → 3; 5..7 → 4
        let mut v = Vec::new();
        for _z in 0..4 {
            for _y in 0..6 {
                for x in 0..8 {
                    v.push([0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 4.0, 4.0][x]);
                }
            }
        }
        write_labels(seg_dir.join(format!("BraTS2021_{case}_seg.nii.gz")), &Volume::new([8, 6, 4], [1.0; 3], v))
            .unwrap();
    }
    let ds = Dataset::from_folders(&seg_dir, &folders, Convention::brats(), [4, 6, 8]).unwrap();
    assert_eq!(ds.len(), 2);
    ds.validate().unwrap();
    let s = ds.get(1).unwrap();
    assert_eq!((s.image_channels, s.cond_channels), (4, 4));
    let n = 4 * 6 * 8;
    for (k, modality) in mods.iter().enumerate() {
        // used as stored (already in [−1, 1]): channel k is modality k
        assert_eq!(s.image[k * n + 2], k as f32 * 0.25 - 0.5, "modality {modality}");
        assert_eq!(s.image[k * n], -1.0);
        // condition channel k = label k+1, values {0, 1}
        let ones: Vec<usize> = (0..8).filter(|&x| s.cond[k * n + x] == 1.0).collect();
        assert_eq!(ones, if k < 3 { vec![k + 2] } else { vec![5, 6, 7] }, "label {}", k + 1);
        assert!(s.cond[k * n..(k + 1) * n].iter().all(|&v| v == 0.0 || v == 1.0));
    }
    std::fs::remove_dir_all(&root).ok();
}
