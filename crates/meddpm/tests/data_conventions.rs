//! Med-DDPM's data conventions on real files: the reference repository's whole-head mask
//! (../shared/data/medddpm, 128³, labels 0/1/2) and the MNI152 T1 (../shared/data/mni152).
//! Expected numbers come from nibabel/numpy (label counts, tumour voxel coordinates) or are
//! recomputed here voxel by voxel through `Volume::at`, independently of the library's
//! buffer arithmetic. BraTS preprocessing is checked on synthetic volumes with known answers.

use meddpm::data::convention::{
    brats_export_mask, brats_postprocess_image, brats_preprocess, crop_or_pad, Convention, ImageScaling, MaskResize,
    BRATS_ORIGINAL_XYZ,
};
use meddpm::data::nifti::{read_volume, Volume};
use std::path::{Path, PathBuf};

fn shared(rel: &str) -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data").join(rel);
    if p.is_file() {
        Some(p)
    } else {
        println!("SKIP: {} not found (no ../shared next to the workspace)", p.display());
        None
    }
}

const S: usize = 128 * 128 * 128;

/// Tensor index of (c, z, y, x) in (C, D, H, W) = (C, Z, Y, X) at 128³.
fn t(c: usize, z: usize, y: usize, x: usize) -> usize {
    ((c * 128 + z) * 128 + y) * 128 + x
}

#[test]
fn whole_head_mask_becomes_two_pm1_channels_in_zyx_order() {
    let Some(path) = shared("medddpm/whole_head_mask_sample_0.nii.gz") else { return };
    let mask = read_volume(&path).unwrap();
    assert_eq!(mask.dims, [128, 128, 128]);
    assert_eq!(mask.spacing, [1.5, 1.5, 1.5]);
    let conv = Convention::whole_head();
    let cond = conv.cond_tensor(&mask, [128, 128, 128], &path).unwrap();
    assert_eq!(cond.len(), 2 * S);
    // value set {−1, +1}
    assert!(cond.iter().all(|&v| v == -1.0 || v == 1.0));
    // label counts (nibabel: 968189 background, 1128520 head, 443 tumour)
    let plus = |c: usize| cond[c * S..(c + 1) * S].iter().filter(|&&v| v == 1.0).count();
    assert_eq!(plus(0), 1_128_520, "channel 0 = label 1 (head)");
    assert_eq!(plus(1), 443, "channel 1 = label 2 (tumour)");
    // channels are exclusive and background is where both are −1
    let both_off = (0..S).filter(|&i| cond[i] == -1.0 && cond[S + i] == -1.0).count();
    assert_eq!(both_off, 968_189);
    assert!((0..S).all(|i| !(cond[i] == 1.0 && cond[S + i] == 1.0)));
    // axis order: tumour voxels (x, y, z) from numpy's argwhere (x fastest is NIfTI's order)
    for (x, y, z) in [(38, 15, 53), (39, 13, 51), (48, 16, 58), (41, 15, 50)] {
        assert_eq!(cond[t(1, z, y, x)], 1.0, "tumour at NIfTI ({x},{y},{z}) → tensor [1,{z},{y},{x}]");
        assert_eq!(cond[t(0, z, y, x)], -1.0);
    }
    // the transposed reading (x and z swapped) is not tumour: the order really matters here
    assert_eq!(cond[t(1, 38, 15, 53)], -1.0);
    assert_eq!(cond[t(1, 41, 15, 50)], -1.0);
    // tumour z range is 50..=60 (numpy): every D-slice outside it has no tumour
    for z in 0..128 {
        let n = (0..128 * 128).filter(|&i| cond[S + z * 128 * 128 + i] == 1.0).count();
        assert_eq!(n > 0, (50..=60).contains(&z), "D slice {z}");
    }
    // head voxel at the centre, background at the corner
    assert_eq!(cond[t(0, 64, 64, 64)], 1.0);
    assert_eq!(cond[t(0, 0, 0, 0)], -1.0);
}

#[test]
fn mask_resize_linear_is_fractional_and_nearest_stays_binary() {
    let Some(path) = shared("medddpm/whole_head_mask_sample_0.nii.gz") else { return };
    let mask = read_volume(&path).unwrap();
    let n = 64 * 64 * 64;
    let lin = Convention::whole_head().cond_tensor(&mask, [64, 64, 64], &path).unwrap();
    assert_eq!(lin.len(), 2 * n);
    assert!(lin.iter().all(|&v| (-1.0..=1.0).contains(&v)));
    assert!(lin.iter().any(|&v| v > -1.0 && v < 1.0), "linear resize gives fractional edges");
    // 2× downsampling with align_corners=False averages each 2×2×2 block exactly
    let (x, y, z) = (20usize, 7usize, 26usize);
    let mut want = 0.0;
    for dz in 0..2 {
        for dy in 0..2 {
            for dx in 0..2 {
                let l = mask.at(2 * x + dx, 2 * y + dy, 2 * z + dz);
                want += if l == 2.0 { 1.0 } else { -1.0 };
            }
        }
    }
    assert_eq!(lin[n + (z * 64 + y) * 64 + x], want / 8.0);
    // tumour mass is conserved by block averaging: Σ(v+1)/2 over the channel = 443/8
    let mass: f64 = lin[n..].iter().map(|&v| (v as f64 + 1.0) / 2.0).sum();
    assert!((mass - 443.0 / 8.0).abs() < 1e-3, "{mass}");
    let conv = Convention { mask_resize: MaskResize::Nearest, ..Convention::whole_head() };
    let near = conv.cond_tensor(&mask, [64, 64, 64], &path).unwrap();
    assert!(near.iter().all(|&v| v == -1.0 || v == 1.0));
    // nearest picks source voxel 2j+1 on each axis
    for (x, y, z) in [(20, 7, 26), (5, 60, 33), (32, 32, 32)] {
        let l = mask.at(2 * x + 1, 2 * y + 1, 2 * z + 1);
        assert_eq!(near[(z * 64 + y) * 64 + x], if l == 1.0 { 1.0 } else { -1.0 });
    }
}

#[test]
fn labels_out_of_range_are_refused() {
    let Some(path) = shared("medddpm/whole_head_mask_sample_0.nii.gz") else { return };
    let mask = read_volume(&path).unwrap();
    let conv = Convention { num_labels: 2, ..Convention::whole_head() };
    let err = conv.cond_tensor(&mask, [128, 128, 128], &path).unwrap_err().to_string();
    assert!(err.contains("whole_head_mask_sample_0.nii.gz") && err.contains("443 voxel(s)"), "{err}");
    // and more labels than present is fine: channel 3 is all −1
    let conv = Convention { num_labels: 4, ..Convention::whole_head() };
    let cond = conv.cond_tensor(&mask, [128, 128, 128], &path).unwrap();
    assert_eq!(cond.len(), 3 * S);
    assert!(cond[2 * S..].iter().all(|&v| v == -1.0));
}

#[test]
fn mni_t1_image_scaling_global_and_per_slice() {
    let Some(path) = shared("mni152/mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz") else { return };
    let t1 = read_volume(&path).unwrap();
    let [nx, ny, nz] = t1.dims;
    assert_eq!(t1.dims, [197, 233, 189]);
    let dhw = [nz, ny, nx];
    // global: uint8 0..255 → 2v/255 − 1
    let g = Convention::whole_head().image_tensor(std::slice::from_ref(&t1), dhw, &path).unwrap();
    let (mut lo, mut hi) = (f32::MAX, f32::MIN);
    for z in 0..nz {
        for y in 0..ny {
            for x in 0..nx {
                let v = t1.at(x, y, z);
                lo = lo.min(v);
                hi = hi.max(v);
            }
        }
    }
    assert_eq!((lo, hi), (0.0, 255.0));
    for (x, y, z) in [(98, 116, 94), (60, 100, 80), (0, 0, 0), (150, 200, 30)] {
        let want = (t1.at(x, y, z) as f64 / 255.0 * 2.0 - 1.0) as f32;
        assert_eq!(g[(z * ny + y) * nx + x], want, "({x},{y},{z})");
    }
    // per-slice (the reference's MinMaxScaler on (X·Y, Z)): each z slice on its own
    let conv = Convention::whole_head_reference();
    let p = conv.image_tensor(std::slice::from_ref(&t1), dhw, &path).unwrap();
    let mut constant_slices = 0;
    for z in 0..nz {
        let (mut a, mut b) = (f32::MAX, f32::MIN);
        for y in 0..ny {
            for x in 0..nx {
                a = a.min(t1.at(x, y, z));
                b = b.max(t1.at(x, y, z));
            }
        }
        let slice = &p[z * nx * ny..(z + 1) * nx * ny];
        if a == b {
            constant_slices += 1;
            assert!(slice.iter().all(|&v| v == -1.0), "constant slice {z} → −1");
            continue;
        }
        let smin = slice.iter().cloned().fold(f32::MAX, f32::min);
        let smax = slice.iter().cloned().fold(f32::MIN, f32::max);
        assert_eq!((smin, smax), (-1.0, 1.0), "slice {z} spans [−1, 1]");
        let (x, y) = (98, 116);
        let want = (((t1.at(x, y, z) - a) as f64 / (b - a) as f64) * 2.0 - 1.0) as f32;
        assert!((slice[y * nx + x] - want).abs() <= 1e-6, "slice {z}");
    }
    // the template's top slices are empty (brain ends at z = 154, numpy)
    assert_eq!(constant_slices, nz - 155);
    // a slice with a dim maximum is stretched: per-slice differs from global there
    let z = 120;
    assert!(t1.at(98, 116, z) > 0.0);
    let i = (z * ny + 116) * nx + 98;
    assert_ne!(p[i], g[i]);
    // resize to 64³ keeps the range
    let small = Convention { image_scaling: ImageScaling::Global, ..Convention::whole_head() }
        .image_tensor(std::slice::from_ref(&t1), [64, 64, 64], &path)
        .unwrap();
    assert_eq!(small.len(), 64 * 64 * 64);
    assert!(small.iter().all(|&v| (-1.0..=1.0).contains(&v)));
}

#[test]
fn outputs_go_back_to_the_mask_grid_with_its_affine() {
    let Some(path) = shared("medddpm/whole_head_mask_sample_0.nii.gz") else { return };
    let (cond, mask) = meddpm::data::load_condition(&path, &Convention::whole_head(), [64, 64, 64]).unwrap();
    assert_eq!(cond.len(), 2 * 64 * 64 * 64);
    assert_eq!(mask.dims, [128, 128, 128]);
    // a generated 64³ tensor: a ramp along W (= NIfTI x)
    let tensor: Vec<f32> = (0..64 * 64 * 64).map(|i| (i % 64) as f32).collect();
    let out = Convention::whole_head().output_volumes(&tensor, 1, [64, 64, 64], &mask);
    assert_eq!(out.len(), 1);
    let v = &out[0];
    assert_eq!(v.dims, mask.dims);
    assert_eq!(v.affine, mask.affine);
    assert_eq!(v.spacing, mask.spacing);
    // x ramp upsampled 2×: voxel x samples (x + 0.5)/2 − 0.5, clamped
    assert_eq!(v.at(0, 5, 9), 0.0);
    assert_eq!(v.at(1, 5, 9), 0.25);
    assert_eq!(v.at(2, 77, 100), 0.75);
    assert_eq!(v.at(127, 0, 0), 63.0);
}

fn synthetic(dims: [usize; 3], f: impl Fn(usize, usize, usize) -> f32) -> Volume {
    let mut data = Vec::with_capacity(dims[0] * dims[1] * dims[2]);
    for z in 0..dims[2] {
        for y in 0..dims[1] {
            for x in 0..dims[0] {
                data.push(f(x, y, z));
            }
        }
    }
    Volume::new(dims, [1.0; 3], data)
}

#[test]
fn brats_preprocess_cond_and_postprocess() {
    let full = BRATS_ORIGINAL_XYZ; // 240×240×155
                                   // "brain": a box [60, 180) × [50, 190) × [20, 140), intensities 100 + x; background 0
    let inside =
        |x: usize, y: usize, z: usize| (60..180).contains(&x) && (50..190).contains(&y) && (20..140).contains(&z);
    let t1 = synthetic(full, |x, y, z| if inside(x, y, z) { 100.0 + x as f32 } else { 0.0 });
    let t2 = synthetic(full, |x, y, z| if inside(x, y, z) { 50.0 } else { 10.0 });
    // seg: 1 in a small cube, 2 next to it, 4 (ET) next; 0 elsewhere
    let seg = synthetic(full, |x, y, z| match (x, y, z) {
        (100..104, 100..104, 70..74) => 1.0,
        (104..108, 100..104, 70..74) => 2.0,
        (108..112, 100..104, 70..74) => 4.0,
        _ => 0.0,
    });
    let name = Path::new("case_0001");
    let (imgs, s) = brats_preprocess(&[t1.clone(), t1.clone(), t2.clone(), t1.clone()], &seg, name).unwrap();
    assert_eq!(s.dims, [192, 192, 144]);
    // crop 48 → 24 + 24 in x and y, 11 → 6 + 5 in z: model voxel (i, j, k) = raw (i+24, j+24, k+6)
    assert_eq!(s.at(100 - 24, 100 - 24, 70 - 6), 1.0);
    assert_eq!(s.at(104 - 24, 100 - 24, 70 - 6), 2.0);
    assert_eq!(s.at(108 - 24, 100 - 24, 70 - 6), 3.0, "ET 4 → 3");
    assert_eq!(s.at(150 - 24, 150 - 24, 100 - 6), 4.0, "brain where T1 > −1 and seg 0");
    assert_eq!(s.at(10, 10, 10), 0.0, "background stays 0");
    // T1 rescaled over the cropped volume: min 0 → −1, max 100+179 → +1
    let t1p = &imgs[0];
    assert_eq!(t1p.at(10, 10, 10), -1.0);
    assert_eq!(t1p.at(179 - 24, 100, 100), 1.0);
    // T2: background 10 → −1, brain 50 → +1
    assert_eq!(imgs[2].at(150 - 24, 150 - 24, 100 - 6), 1.0);
    // world position preserved by the crop
    assert_eq!(t1p.affine[0][3], 24.0);
    assert_eq!(t1p.affine[2][3], 6.0);
    // counts per condition channel ({0, 1}, labels 1..4)
    let conv = Convention::brats();
    let cond = conv.cond_tensor(&s, [144, 192, 192], name).unwrap();
    let n = 192 * 192 * 144;
    assert_eq!(cond.len(), 4 * n);
    assert!(cond.iter().all(|&v| v == 0.0 || v == 1.0));
    let ones = |c: usize| cond[c * n..(c + 1) * n].iter().filter(|&&v| v == 1.0).count();
    assert_eq!([ones(0), ones(1), ones(2)], [64, 64, 64]);
    assert_eq!(ones(3), 120 * 140 * 120 - 3 * 64);
    // image tensor: 4 modalities, as-is
    let img = conv.image_tensor(&imgs, [144, 192, 192], name).unwrap();
    assert_eq!(img.len(), 4 * n);
    assert_eq!(&img[..n], &t1p.data[..]);
    // post-processing: [0, 1] and back to 240×240×155 at the original position
    let back = brats_postprocess_image(t1p);
    assert_eq!(back.dims, full);
    assert_eq!(back.affine[0][3], 0.0);
    for (x, y, z) in [(100, 100, 70), (179, 60, 130), (60, 189, 20)] {
        let want = (t1.at(x, y, z) - 0.0) / 279.0; // rescale01 of the cropped T1 (min 0, max 279)
        assert!((back.at(x, y, z) - want).abs() < 1e-6, "({x},{y},{z})");
    }
    assert_eq!(back.at(0, 0, 0), 0.0, "padding");
    // exported mask: brain dropped, 1 ↔ 2, original grid
    let m = brats_export_mask(&s);
    assert_eq!(m.dims, full);
    assert_eq!(m.at(100, 100, 70), 2.0);
    assert_eq!(m.at(104, 100, 70), 1.0);
    assert_eq!(m.at(108, 100, 70), 3.0);
    assert_eq!(m.at(150, 150, 100), 0.0);
    // a too-small volume is padded, not cropped
    let small = synthetic([100, 100, 100], |_, _, _| 5.0);
    let p = crop_or_pad(&small, [192, 192, 144], 0.0);
    assert_eq!(p.at(46, 46, 22), 5.0);
    assert_eq!(p.at(45, 46, 22), 0.0);
}
