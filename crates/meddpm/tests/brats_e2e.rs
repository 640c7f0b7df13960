//! BraTS end to end on the CPU at reduced size (issue 5): a BraTS-shaped U-Net (8 in / 4 out
//! channels, 2 res blocks per level, attention only in the middle block) at 16×16×16 is written
//! as a GaussianDiffusion-keyed state dict without any config, read back by `load_weights`
//! (config inferred from the shapes), sampled with a BraTS-convention mask, and written by
//! `data::write_sample` as the reference's `sample_brats.py` does: four modality files, each
//! rescaled to [0, 1] and crop/padded back to 240×240×155, plus the exported mask (brain label
//! dropped, labels 1 ↔ 2). The checks recompute the post-processing independently from the
//! generated tensor and torchio's `CropOrPad` bounds (pad ini = ⌈n/2⌉).

use meddpm::checkpoint::native::serialize;
use meddpm::checkpoint::torch::schedule_buffers;
use meddpm::checkpoint::{load_weights_with, write_atomic, LoadHints, WeightGroup};
use meddpm::cpu::CpuBackend;
use meddpm::data::{read_volume, write_sample, Convention, Volume};
use meddpm::diffusion::{Sampler, Schedule};
use meddpm::model::{UNet, UNetConfig};
use std::collections::HashMap;

#[test]
fn brats_model_samples_and_writes_four_modalities_like_the_reference() {
    let dir = std::env::temp_dir().join(format!("meddpm-brats-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let n = 16;
    let cfg = UNetConfig {
        depth: n,
        size: n,
        model_channels: 8,
        channel_mult: vec![1, 2, 2],
        groups: 4,
        ..UNetConfig::brats()
    };
    assert_eq!((cfg.in_channels, cfg.out_channels, cfg.num_res_blocks, cfg.attention_ds.len()), (8, 4, 2, 0));

    // Random weights (the zero-initialised output conv too, so ε̂ depends on the input).
    let be = CpuBackend::new();
    let mut net = UNet::new(&be, &cfg, 1).unwrap();
    net.init_params(&be, 11);
    let mut params = net.host_tensors(&be, false);
    for (spec, p) in net.specs.iter().zip(params.iter_mut()) {
        if spec.key.starts_with("out.2.") || spec.key.contains("out_layers.3") || spec.key.contains("proj_out") {
            p.iter_mut().enumerate().for_each(|(i, v)| *v = 0.05 * ((i * 7919 % 97) as f32 / 48.0 - 1.0));
        }
    }
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> =
        schedule_buffers(250).into_iter().map(|(k, v)| (k.to_string(), vec![v.len()], v)).collect();
    for (s, p) in net.specs.iter().zip(&params) {
        tensors.push((format!("denoise_fn.{}", s.key), s.shape.clone(), p.clone()));
    }
    let wpath = dir.join("brats_small.safetensors");
    write_atomic(&wpath, &serialize(&tensors, HashMap::new()).unwrap()).unwrap();

    let hints = LoadHints { size: Some((n, n)), num_heads: None, groups: Some(4) };
    let w = load_weights_with(&wpath, WeightGroup::Ema, &hints).unwrap();
    assert_eq!(w.cfg, cfg, "config inferred from the shapes");
    assert!(w.warnings.is_empty(), "{:?}", w.warnings);
    assert_eq!(w.params, params);

    // A preprocessed BraTS mask on the model grid: brain (4) in a ball, tumour labels 1, 2, 3.
    let mut labels = vec![0f32; n * n * n];
    for z in 0..n {
        for y in 0..n {
            for x in 0..n {
                let r2 = [x, y, z].iter().map(|&c| (c as f32 - 7.5).powi(2)).sum::<f32>();
                let l = if r2 > 49.0 {
                    0.0
                } else if r2 < 4.0 {
                    3.0
                } else if r2 < 9.0 {
                    1.0
                } else if x > 9 && r2 < 25.0 {
                    2.0
                } else {
                    4.0
                };
                labels[x + n * (y + n * z)] = l;
            }
        }
    }
    let mask = Volume::new([n, n, n], [1.0, 1.0, 1.2], labels.clone());
    let conv = Convention::brats();
    let cond = conv.cond_tensor(&mask, [n, n, n], &dir.join("mask")).unwrap();

    let mut net = UNet::new(&be, &w.cfg, 1).unwrap();
    net.set_params(&be, &w.params).unwrap();
    let sched = Schedule::cosine(10);
    let vol = Sampler::new(&be, &net).unwrap().sample(&be, &mut net, &sched, &cond, 5, |_| {}).unwrap();
    assert_eq!(vol.len(), 4 * n * n * n);
    assert!(vol.iter().all(|v| v.is_finite() && (-1.0..=1.0).contains(v)));

    let stem = dir.join("sample_0");
    let written = write_sample(&stem, &conv, &vol, 4, [n, n, n], &mask).unwrap();
    let names: Vec<String> =
        written.iter().map(|(p, _)| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(
        names,
        [
            "sample_0_t1.nii.gz",
            "sample_0_t1ce.nii.gz",
            "sample_0_t2.nii.gz",
            "sample_0_flair.nii.gz",
            "sample_0_mask.nii.gz"
        ]
    );

    // torchio CropOrPad 16 → 240 (pad 224: ini 112) and 16 → 155 (pad 139: ini 70)
    let (ox, oy, oz) = (112usize, 112usize, 70usize);
    let s = n * n * n;
    for (c, (path, _)) in written.iter().take(4).enumerate() {
        let v = read_volume(path).unwrap();
        assert_eq!(v.dims, [240, 240, 155], "{}", path.display());
        assert_eq!([v.affine[0][3], v.affine[1][3], v.affine[2][3]], [-112.0, -112.0, -70.0 * 1.2]);
        let ch = &vol[c * s..(c + 1) * s];
        let (lo, hi) = ch.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
        assert!(hi > lo, "channel {c} is constant");
        let mut inside = 0;
        for z in 0..155 {
            for y in 0..240 {
                for x in 0..240 {
                    let got = v.at(x, y, z);
                    let src = (x.checked_sub(ox), y.checked_sub(oy), z.checked_sub(oz));
                    match src {
                        (Some(a), Some(b), Some(d)) if a < n && b < n && d < n => {
                            // tensor (C, D, H, W) = (C, z, y, x)
                            let g = ch[a + n * (b + n * d)];
                            let want = ((g as f64 - lo as f64) / (hi as f64 - lo as f64)) as f32;
                            assert!((got - want).abs() <= 1e-6, "ch {c} voxel ({x},{y},{z}): {got} vs {want}");
                            inside += 1;
                        }
                        _ => assert_eq!(got, 0.0, "ch {c}: padding at ({x},{y},{z})"),
                    }
                }
            }
        }
        assert_eq!(inside, s);
    }
    // the exported mask: 4 → 0, 1 ↔ 2, 3 stays, same crop/pad
    let m = read_volume(&written[4].0).unwrap();
    assert_eq!(m.dims, [240, 240, 155]);
    for z in 0..n {
        for y in 0..n {
            for x in 0..n {
                let want = match labels[x + n * (y + n * z)] as i32 {
                    4 => 0.0,
                    1 => 2.0,
                    2 => 1.0,
                    l => l as f32,
                };
                assert_eq!(m.at(x + ox, y + oy, z + oz), want, "mask ({x},{y},{z})");
            }
        }
    }
    assert_eq!(
        m.data.iter().filter(|&&l| l != 0.0).count(),
        labels.iter().filter(|&&l| (1.0..4.0).contains(&l)).count()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
