//! The metrics in `meddpm::eval` against independent computations: a brute-force (non-separable)
//! SSIM, closed forms for constant volumes, W1 and MMD, and the documented behaviour on bad
//! input (errors, never panics or NaN). MONAI agreement itself is in `eval_reference.rs`.

use meddpm::eval::report::{evaluate, pair_index, EvalSettings, NamedLabels, NamedVolume};
use meddpm::eval::ssim::{
    avg_pool2, gaussian_1d, ms_ssim, ms_ssim_detail, ms_ssim_kernel_for, ms_ssim_min_dim, ssim, ssim_and_cs,
    MsSsimParams, SsimParams,
};
use meddpm::eval::stats::{mae, mmd_linear, mse, psnr, wasserstein1};
use meddpm::eval::{labels_from_f32, Vol};

/// Deterministic pseudo-random values in [0, 1) (an LCG; independent of the code under test).
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32
        })
        .collect()
}

/// A smooth-plus-noise volume and a perturbed copy.
fn pair(dims: [usize; 3], seed: u64) -> (Vec<f32>, Vec<f32>) {
    let [d, h, w] = dims;
    let n1 = noise(d * h * w, seed);
    let n2 = noise(d * h * w, seed + 7);
    let mut a = Vec::new();
    let mut b = Vec::new();
    for z in 0..d {
        for y in 0..h {
            for x in 0..w {
                let i = (z * h + y) * w + x;
                let s = ((z as f32 * 0.4).sin() * (y as f32 * 0.3).cos() + (x as f32 * 0.25).sin()) * 0.25 + 0.5;
                a.push(s + 0.1 * n1[i]);
                b.push(0.9 * s + 0.05 + 0.1 * n2[i]);
            }
        }
    }
    (a, b)
}

/// SSIM by the textbook definition: full 3D window sums at every valid position, f64.
fn brute_ssim(dims: [usize; 3], x: &[f32], y: &[f32], p: &SsimParams) -> (f64, f64) {
    let [d, h, w] = dims;
    let k = p.kernel_size;
    let g1 = {
        let c = (k as f64 - 1.0) / 2.0;
        let g: Vec<f64> = (0..k).map(|i| (-(i as f64 - c).powi(2) / (2.0 * p.sigma * p.sigma)).exp()).collect();
        let s: f64 = g.iter().sum();
        g.into_iter().map(|v| v / s).collect::<Vec<_>>()
    };
    let (c1, c2) = ((p.k1 * p.data_range).powi(2), (p.k2 * p.data_range).powi(2));
    let (mut ss, mut cs, mut n) = (0.0, 0.0, 0.0);
    for z in 0..=d - k {
        for yy in 0..=h - k {
            for xx in 0..=w - k {
                let mut m = [0.0f64; 5];
                for a in 0..k {
                    for b in 0..k {
                        for c in 0..k {
                            let wgt = g1[a] * g1[b] * g1[c];
                            let i = ((z + a) * h + yy + b) * w + xx + c;
                            let (u, v) = (x[i] as f64, y[i] as f64);
                            m[0] += wgt * u;
                            m[1] += wgt * v;
                            m[2] += wgt * u * u;
                            m[3] += wgt * v * v;
                            m[4] += wgt * u * v;
                        }
                    }
                }
                let (sx, sy, sxy) = (m[2] - m[0] * m[0], m[3] - m[1] * m[1], m[4] - m[0] * m[1]);
                let c = (2.0 * sxy + c2) / (sx + sy + c2);
                ss += (2.0 * m[0] * m[1] + c1) / (m[0] * m[0] + m[1] * m[1] + c1) * c;
                cs += c;
                n += 1.0;
            }
        }
    }
    (ss / n, cs / n)
}

#[test]
fn ssim_matches_brute_force_window() {
    for (dims, k, dr) in [([9, 10, 11], 5, 1.0), ([7, 12, 8], 3, 2.0), ([11, 11, 13], 11, 1.0), ([4, 5, 6], 1, 1.0)] {
        let (a, b) = pair(dims, 3);
        let p = SsimParams { kernel_size: k, data_range: dr, ..SsimParams::default() };
        let got = ssim_and_cs(Vol::new("a", dims, &a).unwrap(), Vol::new("b", dims, &b).unwrap(), &p).unwrap();
        let (ws, wc) = brute_ssim(dims, &a, &b, &p);
        assert!((got.ssim - ws).abs() < 1e-12, "{dims:?} k{k}: ssim {} vs brute {ws}", got.ssim);
        assert!((got.cs - wc).abs() < 1e-12, "{dims:?} k{k}: cs {} vs brute {wc}", got.cs);
        // symmetric in its arguments
        let rev = ssim(Vol::new("b", dims, &b).unwrap(), Vol::new("a", dims, &a).unwrap(), &p).unwrap();
        assert!((rev - got.ssim).abs() < 1e-12);
    }
}

#[test]
fn gaussian_window_is_monais() {
    // MONAI: offsets (1-k)/2 .. (k-1)/2, exp(-(d/σ)²/2), normalised.
    let g = gaussian_1d(7, 1.5);
    let raw: Vec<f64> = (-3..=3).map(|d| (-(d as f64 / 1.5).powi(2) / 2.0).exp()).collect();
    let s: f64 = raw.iter().sum();
    for (a, b) in g.iter().zip(&raw) {
        assert!((a - b / s).abs() < 1e-15);
    }
    // even sizes are centred between voxels, as in MONAI's arange((1-k)/2, (1+k)/2)
    let g4 = gaussian_1d(4, 1.5);
    assert!((g4[0] - g4[3]).abs() < 1e-15 && (g4[1] - g4[2]).abs() < 1e-15 && g4[1] > g4[0]);
}

#[test]
fn constant_volumes_have_closed_forms() {
    // σ = 0 → cs = 1, ssim = luminance; MS-SSIM = Π 1^w · lum^w_last (pooling keeps constants).
    let dims = [32, 33, 35];
    let n = dims.iter().product();
    for (a, b, dr) in [(0.25f32, 0.5f32, 1.0), (0.0, 0.0, 1.0), (-0.5, 0.75, 2.0), (0.3, 0.3, 1.0)] {
        let (va, vb) = (vec![a; n], vec![b; n]);
        let p = SsimParams { kernel_size: 3, data_range: dr, ..SsimParams::default() };
        let c1 = (0.01 * dr).powi(2);
        let (a, b) = (a as f64, b as f64);
        let lum = (2.0 * a * b + c1) / (a * a + b * b + c1);
        let x = Vol::new("a", dims, &va).unwrap();
        let y = Vol::new("b", dims, &vb).unwrap();
        let r = ssim_and_cs(x, y, &p).unwrap();
        assert!((r.cs - 1.0).abs() < 1e-12 && (r.ssim - lum).abs() < 1e-12, "{a} {b}: {r:?} vs {lum}");
        let ms = MsSsimParams { ssim: SsimParams { kernel_size: 2, ..p.clone() }, ..MsSsimParams::default() };
        let v = ms_ssim(x, y, &ms).unwrap();
        let want = lum.max(0.0).powf(0.1333); // MONAI's relu: a negative luminance term gives 0
        assert!((v - want).abs() < 1e-12, "{a} {b}: MS-SSIM {v} vs {want}");
    }
}

#[test]
fn identical_volumes() {
    let dims = [48, 50, 49];
    let (a, _) = pair(dims, 11);
    let v = Vol::new("a", dims, &a).unwrap();
    assert!((ssim(v, v, &SsimParams::default()).unwrap() - 1.0).abs() < 1e-12);
    assert!((ms_ssim(v, v, &MsSsimParams::with_kernel(3)).unwrap() - 1.0).abs() < 1e-12);
    assert_eq!(psnr(v, v, 1.0, None).unwrap(), f64::INFINITY);
    assert_eq!(mae(v, v, None).unwrap(), 0.0);
}

#[test]
fn ms_ssim_is_the_weighted_product_of_per_scale_terms() {
    let dims = [49, 51, 48];
    let (a, b) = pair(dims, 5);
    let (x, y) = (Vol::new("a", dims, &a).unwrap(), Vol::new("b", dims, &b).unwrap());
    let p = MsSsimParams::with_kernel(3);
    let det = ms_ssim_detail(x, y, &p).unwrap();
    assert_eq!(det.dims, vec![[49, 51, 48], [24, 25, 24], [12, 12, 12], [6, 6, 6], [3, 3, 3]]);
    // scale 0 equals plain SSIM/CS at full resolution
    let s0 = ssim_and_cs(x, y, &p.ssim).unwrap();
    assert_eq!(det.scales[0], s0);
    let w = &p.weights;
    let want: f64 =
        (0..4).map(|i| det.scales[i].cs.max(0.0).powf(w[i])).product::<f64>() * det.scales[4].ssim.powf(w[4]);
    assert!((det.value - want).abs() < 1e-15);
    // scale 1 equals SSIM of the pooled volumes, pooled independently here
    let pool = |v: &[f32]| -> Vec<f32> {
        let [d, h, wd] = dims;
        let mut o = Vec::new();
        for z in 0..d / 2 {
            for yy in 0..h / 2 {
                for xx in 0..wd / 2 {
                    let mut s = 0.0f64;
                    for (dz, dy, dx) in (0..8).map(|k| (k >> 2, (k >> 1) & 1, k & 1)) {
                        s += v[((2 * z + dz) * h + 2 * yy + dy) * wd + 2 * xx + dx] as f64;
                    }
                    o.push((s / 8.0) as f32);
                }
            }
        }
        o
    };
    let (pa, pb) = (pool(&a), pool(&b));
    let s1 =
        ssim_and_cs(Vol::new("pa", [24, 25, 24], &pa).unwrap(), Vol::new("pb", [24, 25, 24], &pb).unwrap(), &p.ssim)
            .unwrap();
    assert!((s1.cs - det.scales[1].cs).abs() < 1e-6, "{s1:?} vs {:?}", det.scales[1]);
    // f32 rounding of the pooled copy
}

#[test]
fn avg_pool_floors_odd_sizes() {
    let v: Vec<f64> = (0..3 * 3 * 5).map(|i| i as f64).collect();
    let (d, o) = avg_pool2([3, 3, 5], &v);
    assert_eq!(d, [1, 1, 2]);
    // block z∈{0,1}, y∈{0,1}, x∈{0,1}: indices 0,1,5,6,15,16,20,21
    assert_eq!(o[0], [0, 1, 5, 6, 15, 16, 20, 21].iter().sum::<i32>() as f64 / 8.0);
    assert_eq!(o[1], (2 + 3 + 7 + 8 + 17 + 18 + 22 + 23) as f64 / 8.0);
}

#[test]
fn kernel_choice_and_size_limits() {
    assert_eq!(ms_ssim_min_dim(7, 5), 112);
    assert_eq!(ms_ssim_min_dim(11, 5), 176);
    assert_eq!(ms_ssim_min_dim(3, 1), 3);
    assert_eq!(ms_ssim_kernel_for([128, 128, 128], 5, 11).unwrap(), 7);
    assert_eq!(ms_ssim_kernel_for([176, 180, 200], 5, 11).unwrap(), 11);
    assert_eq!(ms_ssim_kernel_for([128, 111, 128], 5, 11).unwrap(), 5);
    assert!(ms_ssim_kernel_for([15, 64, 64], 5, 11).is_err());
    let z = vec![0.0f32; 111 * 112 * 112];
    let v = Vol::new("z", [111, 112, 112], &z).unwrap();
    let e = ms_ssim(v, v, &MsSsimParams::with_kernel(7)).unwrap_err().to_string();
    assert!(e.contains("too small") && e.contains("112"), "{e}");
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let dims = [16, 16, 16];
    let (a, b) = pair(dims, 1);
    let x = Vol::new("a", dims, &a).unwrap();
    // size mismatch, wrong length, empty
    let c = vec![0.5f32; 16 * 16 * 15];
    let y = Vol::new("c", [16, 16, 15], &c).unwrap();
    for e in [
        ssim(x, y, &SsimParams::default()).unwrap_err(),
        ms_ssim(x, y, &MsSsimParams::default()).unwrap_err(),
        psnr(x, y, 1.0, None).unwrap_err(),
        mae(x, y, None).unwrap_err(),
        mmd_linear(&[x, x], &[y, y]).unwrap_err(),
    ] {
        assert!(e.to_string().contains("mismatch"), "{e}");
    }
    assert!(Vol::new("short", dims, &a[..100]).unwrap_err().to_string().contains("short"));
    assert!(Vol::new("empty", [0, 4, 4], &[]).unwrap_err().to_string().contains("empty"));
    // NaN / ∞ are reported with their position
    let mut bad = b.clone();
    bad[(3 * 16 + 4) * 16 + 5] = f32::NAN;
    let yb = Vol::new("b", dims, &bad).unwrap();
    for e in [
        ssim(x, yb, &SsimParams::default()).unwrap_err(),
        psnr(x, yb, 1.0, None).unwrap_err(),
        mae(x, yb, None).unwrap_err(),
        mmd_linear(&[x, x], &[yb, yb]).unwrap_err(),
    ] {
        assert!(e.to_string().contains("z=3, y=4, x=5"), "{e}");
    }
    bad[0] = f32::INFINITY;
    assert!(wasserstein1(&bad, &a).is_err());
    // window larger than the volume, invalid parameters
    let small = vec![0.0f32; 8 * 8 * 8];
    let s = Vol::new("s", [8, 8, 8], &small).unwrap();
    assert!(ssim(s, s, &SsimParams::default()).unwrap_err().to_string().contains("window"));
    for p in [
        SsimParams { data_range: 0.0, ..SsimParams::default() },
        SsimParams { k1: 0.0, ..SsimParams::default() },
        SsimParams { sigma: f64::NAN, ..SsimParams::default() },
        SsimParams { kernel_size: 0, ..SsimParams::default() },
    ] {
        assert!(ssim(x, x, &p).is_err(), "{p:?}");
    }
    let neg = MsSsimParams { weights: vec![0.5, -0.5], ..MsSsimParams::with_kernel(3) };
    assert!(ms_ssim(x, x, &neg).is_err());
    assert!(ms_ssim(x, x, &MsSsimParams { weights: vec![], ..MsSsimParams::with_kernel(3) }).is_err());
    assert!(psnr(x, x, 0.0, None).is_err());
    // masks: wrong size, empty
    assert!(mae(x, x, Some(&[true; 10])).is_err());
    assert!(mae(x, x, Some(&vec![false; 4096])).unwrap_err().to_string().contains("no voxels"));
    // MMD needs two per side; W1 needs samples
    assert!(mmd_linear(&[x], &[x, x]).unwrap_err().to_string().contains("≥ 2"));
    assert!(wasserstein1(&[], &a).is_err());
    // labels
    assert_eq!(labels_from_f32("m", &[0.0, 1.0, 2.0004]).unwrap(), vec![0, 1, 2]);
    assert!(labels_from_f32("m", &[0.5]).is_err());
    assert!(labels_from_f32("m", &[-1.0]).is_err());
    assert!(labels_from_f32("m", &[f32::NAN]).is_err());
}

#[test]
fn psnr_mae_closed_forms() {
    let dims = [4, 5, 6];
    let z = vec![0.0f32; 120];
    let mut t = vec![0.1f32; 120];
    let (x, y) = (Vol::new("z", dims, &z).unwrap(), Vol::new("t", dims, &t).unwrap());
    let d = 0.1f32 as f64;
    assert!((mse(x, y, None).unwrap() - d * d).abs() < 1e-15);
    assert!((psnr(x, y, 1.0, None).unwrap() - (-10.0 * (d * d).log10())).abs() < 1e-12);
    assert!((psnr(x, y, 2.0, None).unwrap() - (20.0 * 2f64.log10() - 10.0 * (d * d).log10())).abs() < 1e-12);
    // inside a mask only the selected voxels count
    t[0] = 0.9;
    let y = Vol::new("t", dims, &t).unwrap();
    let mut m = vec![true; 120];
    m[0] = false;
    assert!((mae(x, y, Some(&m)).unwrap() - d).abs() < 1e-15);
    assert!((mae(x, y, None).unwrap() - (119.0 * d + 0.9f32 as f64) / 120.0).abs() < 1e-15);
}

#[test]
fn wasserstein_closed_forms() {
    let u: Vec<f32> = (0..1000).map(|i| i as f32 * 0.001).collect();
    let v: Vec<f32> = u.iter().map(|x| x + 0.25).collect();
    // shift: W1 = |c| (up to the f32 rounding of the shifted values)
    assert!((wasserstein1(&u, &v).unwrap() - 0.25).abs() < 1e-6);
    assert_eq!(wasserstein1(&[0.0], &[1.0]).unwrap(), 1.0);
    assert_eq!(wasserstein1(&[0.0, 1.0], &[0.0]).unwrap(), 0.5);
    assert_eq!(wasserstein1(&[3.0, 1.0, 2.0], &[2.0, 3.0, 1.0]).unwrap(), 0.0);
    // scipy docs example: wasserstein_distance([0, 1, 3], [5, 6, 8]) = 5
    assert!((wasserstein1(&[0.0, 1.0, 3.0], &[5.0, 6.0, 8.0]).unwrap() - 5.0).abs() < 1e-12);
    // different sizes: [0,1] vs [0,0,0,1]: F differs by 1/4 over [0,1)
    assert!((wasserstein1(&[0.0, 1.0], &[0.0, 0.0, 0.0, 1.0]).unwrap() - 0.25).abs() < 1e-15);
}

#[test]
fn mmd_closed_form_for_constant_sets() {
    // real: m copies of a, generated: n copies of b → MMD = N·(a − b)² (unbiased terms are exact).
    let n = 60;
    let dims = [3, 4, 5];
    let (a, b) = (vec![0.3f32; n], vec![0.7f32; n]);
    let va = Vol::new("a", dims, &a).unwrap();
    let vb = Vol::new("b", dims, &b).unwrap();
    let (a64, b64) = (0.3f32 as f64, 0.7f32 as f64);
    let want = n as f64 * (a64 - b64).powi(2);
    let got = mmd_linear(&[va, va, va], &[vb, vb]).unwrap();
    assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    assert!(mmd_linear(&[va, va], &[va, va]).unwrap().abs() < 1e-12);
}

fn nv(name: &str, dims: [usize; 3], data: Vec<f32>) -> NamedVolume {
    NamedVolume { name: name.into(), dims, data }
}

#[test]
fn pairing_by_file_name() {
    let reals = ["a/sample_1.nii.gz", "a/sample_10.nii.gz", "b/sample_2.nii"];
    assert_eq!(pair_index("out/sample_1_s0.nii.gz", &reals), Some(0));
    assert_eq!(pair_index("out/sample_10-3.nii.gz", &reals), Some(1));
    assert_eq!(pair_index("sample_2.nii.gz", &reals), Some(2));
    assert_eq!(pair_index("sample_3_s0.nii.gz", &reals), None);
    assert_eq!(pair_index("sample_100.nii.gz", &reals), None);
    assert_eq!(pair_index("anything.nii.gz", &reals[..1]), Some(0));
}

#[test]
fn report_end_to_end() {
    let dims = [16, 18, 20];
    let n: usize = dims.iter().product();
    let (r, g1) = pair(dims, 21);
    let (_, g2) = pair(dims, 22);
    // [-1, 1] data like Med-DDPM: map r ∈ [0,1] to 2r − 1
    let to_pm = |v: &[f32]| v.iter().map(|x| 2.0 * x - 1.0).collect::<Vec<f32>>();
    let real = vec![nv("real.nii.gz", dims, to_pm(&r))];
    let gens =
        vec![nv("g1.nii.gz", dims, to_pm(&g1)), nv("g2.nii.gz", dims, to_pm(&g2)), nv("same.nii.gz", dims, to_pm(&r))];
    let labels: Vec<u8> = (0..n).map(|i| (i % 3) as u8).collect();
    let mask = NamedLabels { name: "mask.nii.gz".into(), dims, labels: labels.clone() };
    let rep = evaluate(&real, &gens, Some(&mask), &EvalSettings::default()).unwrap();

    // MS-SSIM's window for 16 voxels: 16 // 16 = 1 > k − 1 → k = 1 (and a note says it means
    // nothing); SSIM keeps MONAI's 11, which fits
    assert_eq!(rep.settings.ms_ssim.ssim.kernel_size, 1);
    assert_eq!(rep.settings.ssim_kernel, 11);
    assert!(rep.notes.iter().any(|n| n.contains("not a structural similarity")), "{:?}", rep.notes);
    assert!(rep.settings.kernel_size_auto);
    assert_eq!(rep.paired.len(), 3);
    // metrics are computed on [0,1]-mapped intensities: compare with direct calls on r, g1
    let (x, y) = (Vol::new("g", dims, &g1).unwrap(), Vol::new("r", dims, &r).unwrap());
    let p = &rep.paired[0];
    let ms = MsSsimParams::with_kernel(1);
    assert!((p.ssim - ssim(x, y, &MsSsimParams::with_kernel(11).ssim).unwrap()).abs() < 1e-6);
    assert!((p.ms_ssim - ms_ssim(x, y, &ms).unwrap()).abs() < 1e-6);
    assert!((p.mae - mae(x, y, None).unwrap()).abs() < 1e-6);
    let fg: Vec<bool> = labels.iter().map(|&l| l != 0).collect();
    assert!((p.mae_mask.unwrap() - mae(x, y, Some(&fg)).unwrap()).abs() < 1e-6);
    // the copy of the real volume: PSNR = inf, excluded from the mean, written as "inf"
    assert_eq!(rep.paired[2].psnr_db, f64::INFINITY);
    let ps = rep.paired_summary.as_ref().unwrap();
    assert_eq!(ps.psnr_db.n_inf, 1);
    assert!(ps.psnr_db.mean.is_finite());
    assert_eq!(rep.diversity.len(), 1);
    assert_eq!(rep.diversity[0].pairwise_ms_ssim.as_ref().unwrap().n, 3);
    assert!(rep.mmd.is_none() && rep.notes.iter().any(|n| n.contains("MMD")));
    assert_eq!(rep.mask_labels, vec![(0, n.div_ceil(3)), (1, n / 3), (2, n / 3)]);
    assert_eq!(rep.labels.len(), 4); // whole volume + labels 0, 1, 2
                                     // W1 of the exact copy is 0
    assert_eq!(rep.labels[0].w1.min, 0.0);

    let json = rep.to_json();
    assert!(json.contains("\"psnr_db\": \"inf\""), "{json}");
    assert!(!json.contains("NaN"));
    let back: meddpm::eval::EvalReport = serde_json::from_str(&json).unwrap();
    assert_eq!(back.paired[2].psnr_db, f64::INFINITY);
    assert_eq!(back.paired[0], rep.paired[0]);
    let md = rep.to_markdown();
    for s in ["MS-SSIM", "Diversity", "Wasserstein", "∞", "| 2 |"] {
        assert!(md.contains(s), "markdown lacks {s}:\n{md}");
    }

    // errors: size mismatch names the file; NaN names the voxel; nothing to compare
    let wrong = vec![nv("small.nii.gz", [16, 18, 19], vec![0.0; 16 * 18 * 19])];
    let e = evaluate(&real, &wrong, None, &EvalSettings::default()).unwrap_err().to_string();
    assert!(e.contains("small.nii.gz") && e.contains("mismatch"), "{e}");
    let mut nan = to_pm(&g1);
    nan[7] = f32::NAN;
    let e = evaluate(&real, &[nv("nan.nii.gz", dims, nan)], None, &EvalSettings::default()).unwrap_err().to_string();
    assert!(e.contains("nan.nii.gz") && e.contains("x=7"), "{e}");
    assert!(evaluate(&real, &[], None, &EvalSettings::default()).is_err());
    let bad_range = EvalSettings { intensity_range: [1.0, 1.0], kernel_size: None };
    assert!(evaluate(&real, &gens, None, &bad_range).is_err());
    let tiny = vec![nv("t.nii.gz", [8, 8, 8], vec![0.0; 512])];
    assert!(evaluate(&tiny, &tiny, None, &EvalSettings::default()).unwrap_err().to_string().contains("too small"));
}

#[test]
fn report_with_constant_volumes_and_empty_foreground() {
    // constant volumes and an all-background mask: documented values, no NaN anywhere
    let dims = [16, 16, 16];
    let n = 4096;
    let real = vec![nv("r1.nii.gz", dims, vec![0.0; n]), nv("r2.nii.gz", dims, vec![0.5; n])];
    let gens = vec![nv("r1_a.nii.gz", dims, vec![0.0; n]), nv("r2_a.nii.gz", dims, vec![-1.0; n])];
    let mask = NamedLabels { name: "m".into(), dims, labels: vec![0; n] };
    let rep = evaluate(&real, &gens, Some(&mask), &EvalSettings::default()).unwrap();
    let json = rep.to_json();
    assert!(!json.to_lowercase().contains("nan"), "{json}");
    assert!(rep.paired.iter().all(|p| p.psnr_db_mask.is_none()));
    assert!(rep.notes.iter().any(|n| n.contains("no foreground")));
    assert!(rep.mmd.is_some());
    assert_eq!(rep.diversity.len(), 2); // one group per real, one sample each
    assert!(rep.diversity.iter().all(|d| d.pairwise_ms_ssim.is_none()));
    assert!(
        (rep.real_pairwise_ms_ssim.as_ref().unwrap().mean - {
            let (a, b, c1) = (0.5f64, 0.75f64, 1e-4);
            ((2.0 * a * b + c1) / (a * a + b * b + c1)).powf(0.1333)
        })
        .abs()
            < 1e-12
    );
}
