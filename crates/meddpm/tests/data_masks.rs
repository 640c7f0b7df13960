//! Mask augmentation (the reference's `mask_generator.ipynb`): tumour scaling and shifting on
//! synthetic masks whose answers are known in closed form, and on the reference's own mask.

use meddpm::data::masks::{centroid, linspace, scale_tumour, shift_grid, shift_tumour, Labels};
use meddpm::data::nifti::{read_volume, Volume};
use std::path::Path;

/// 20³ mask: head ball of radius 8 at (10, 10, 10); tumour cube [8, 12)³ (64 voxels, centroid 9.5).
fn mask() -> Volume {
    let mut d = Vec::new();
    for z in 0..20 {
        for y in 0..20 {
            for x in 0..20 {
                let r2 = (x as f32 - 10.0).powi(2) + (y as f32 - 10.0).powi(2) + (z as f32 - 10.0).powi(2);
                let tumour = (8..12).contains(&x) && (8..12).contains(&y) && (8..12).contains(&z);
                d.push(if tumour {
                    2.0
                } else if r2 <= 64.0 {
                    1.0
                } else {
                    0.0
                });
            }
        }
    }
    Volume::new([20, 20, 20], [1.0; 3], d)
}

fn count(v: &Volume, l: f32) -> usize {
    v.data.iter().filter(|&&x| x == l).count()
}

#[test]
fn linspace_matches_numpy() {
    let s = linspace(2.0, 0.5, 20);
    assert_eq!(s.len(), 20);
    assert_eq!(s[0], 2.0);
    assert_eq!(s[19], 0.5);
    // numpy: np.linspace(2.0, 0.5, 20)[1] == 1.9210526315789473
    assert_eq!(format!("{:?}", s[1]), "1.9210526315789473");
    assert_eq!(shift_grid(40, 10).len(), 9 * 9 * 9);
}

#[test]
fn scaling_about_the_centroid() {
    let m = mask();
    let labels = Labels::default();
    assert_eq!(centroid(&m, 2.0), Some([9.5, 9.5, 9.5]));
    // ×2: voxel p is tumour iff round-half-up((p − 9.5)/2 + 9.5) ∈ [8, 12), i.e. p ∈ [6.5−0.5.., ..)
    let s2 = scale_tumour(&m, 2.0, labels, 30).unwrap();
    let want: Vec<usize> = (0..20)
        .filter(|&p| {
            let q = ((p as f64 - 9.5) / 2.0 + 9.5 + 0.5).floor();
            (8.0..12.0).contains(&q)
        })
        .collect();
    assert_eq!(want, (6..14).collect::<Vec<_>>());
    assert_eq!(count(&s2, 2.0), 8 * 8 * 8);
    assert_eq!(s2.at(6, 6, 6), 2.0);
    assert_eq!(s2.at(13, 13, 13), 2.0);
    assert_eq!(s2.at(5, 9, 9), 1.0);
    // head + tumour voxels are conserved: head was restored where the tumour shrank/grew
    assert_eq!(count(&s2, 1.0) + count(&s2, 2.0), count(&m, 1.0) + count(&m, 2.0));
    // ×0.5: 2×2×2 = 8 voxels < 30 → dropped; kept with a lower minimum
    assert!(scale_tumour(&m, 0.5, labels, 30).is_none());
    let s05 = scale_tumour(&m, 0.5, labels, 8).unwrap();
    assert_eq!(count(&s05, 2.0), 8);
    assert_eq!(s05.at(8, 8, 8), 1.0, "old tumour site refilled with head");
    // no tumour → nothing
    let none = m.like(m.data.iter().map(|&v| if v == 2.0 { 1.0 } else { v }).collect());
    assert!(scale_tumour(&none, 1.5, labels, 1).is_none());
}

#[test]
fn shifting_keeps_half_inside_the_head() {
    let m = mask();
    let labels = Labels::default();
    let s = shift_tumour(&m, [3, 0, 0], labels).unwrap();
    // tumour cube moved to x ∈ [11, 15): the part on old head voxels is x ∈ [12, 15) (x = 11
    // was tumour, which the notebook does not count as head) → 3·4·4 = 48 ≥ 32 kept
    assert_eq!(count(&s, 2.0), 48);
    assert_eq!(s.at(11, 9, 9), 1.0);
    assert_eq!(s.at(12, 9, 9), 2.0);
    assert_eq!(s.at(14, 8, 11), 2.0);
    assert_eq!(s.at(9, 9, 9), 1.0, "old site refilled");
    // a shift by 4 along y lands entirely on head: all 64 kept
    assert_eq!(count(&shift_tumour(&m, [0, 4, 0], labels).unwrap(), 2.0), 64);
    // along x by d: the kept part is the tumour voxels landing on old head voxels, counted
    // here directly; the shift is kept iff that is at least half of the 64 voxels
    for d in 3..=10i64 {
        let landed = (8..12)
            .flat_map(|x| (8..12).flat_map(move |y| (8..12).map(move |z| (x + d as usize, y, z))))
            .filter(|&(x, y, z)| x < 20 && m.at(x, y, z) == 1.0)
            .count();
        match shift_tumour(&m, [d, 0, 0], labels) {
            Some(v) => {
                assert!(landed * 2 >= 64, "d = {d}: kept with {landed}");
                assert_eq!(count(&v, 2.0), landed, "d = {d}");
            }
            None => assert!(landed * 2 < 64, "d = {d}: refused with {landed}"),
        }
    }
    assert!(shift_tumour(&m, [9, 0, 0], labels).is_none(), "17 of 64 land in the head");
    // off the volume entirely
    assert!(shift_tumour(&m, [40, 0, 0], labels).is_none());
}

#[test]
fn reference_mask_augmentations() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/medddpm/whole_head_mask_sample_0.nii.gz");
    if !p.is_file() {
        println!("SKIP: {} not found (no ../shared next to the workspace)", p.display());
        return;
    }
    let m = read_volume(&p).unwrap();
    let labels = Labels::default();
    let c = centroid(&m, 2.0).unwrap();
    // numpy: tumour voxel mean (42.9503386, 15.83972912, 54.59593679)
    for (a, want) in c.iter().zip([42.9503386, 15.83972912, 54.59593679]) {
        assert!((a - want).abs() < 1e-6, "{c:?}");
    }
    let kept: Vec<(f64, usize)> = linspace(2.0, 0.5, 20)
        .into_iter()
        .filter_map(|s| scale_tumour(&m, s, labels, 30).map(|v| (s, count(&v, 2.0))))
        .collect();
    // volume scales roughly with s³ (443 voxels at s = 1)
    let (s0, n0) = kept[0];
    assert_eq!(s0, 2.0);
    assert!((n0 as f64 / 443.0 - 8.0).abs() < 1.5, "{n0}");
    assert!(kept.iter().all(|&(_, n)| n >= 30));
    // even ×0.5 keeps ≈ 443/8 ≥ 30 voxels: all 20 scales are kept
    assert_eq!(kept.len(), 20);
    assert!((kept[19].1 as f64 / (443.0 / 8.0) - 1.0).abs() < 0.3, "{:?}", kept[19]);
    // shifts: some kept, some refused, and the old site is always head
    let mut ok = 0;
    for sh in shift_grid(40, 20) {
        if let Some(v) = shift_tumour(&m, sh, labels) {
            ok += 1;
            assert!(count(&v, 2.0) * 2 >= 443);
            if sh != [0, 0, 0] {
                assert_eq!(v.at(41, 15, 50), 1.0);
            }
        }
    }
    assert!(ok > 1 && ok < 125, "{ok}");
}
