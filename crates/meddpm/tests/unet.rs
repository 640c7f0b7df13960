//! Whole-network tests on the CPU reference: the U-Net's backward against finite differences
//! (every parameter tensor, through directional derivatives), training that learns, exact resume,
//! sampling invariants, and checkpoint errors.

use meddpm::checkpoint::{save_trainer, Checkpoint};
use meddpm::cpu::CpuBackend;
use meddpm::diffusion::{Sampler, Schedule, TrainConfig, Trainer};
use meddpm::model::{UNet, UNetConfig};
use meddpm::rng::Philox;
use meddpm::{Backend, LossKind};

fn rand(n: usize, stream: u64, scale: f32) -> Vec<f32> {
    let r = Philox::new(99, stream);
    (0..n).map(|i| scale * r.normal(i as u64)).collect()
}

/// L = Σ r·UNet(x, t) for fixed random r.
fn objective(be: &CpuBackend, net: &mut UNet<CpuBackend>, x: &[f32], t: &[f32], r: &[f32]) -> f64 {
    be.upload(x, net.input_mut());
    net.forward(be, t);
    let mut out = vec![0f32; r.len()];
    be.download(net.output(), &mut out);
    out.iter().zip(r).map(|(&o, &w)| o as f64 * w as f64).sum()
}

/// Bound on the relative error (|analytic − numeric| / max(|numeric|, |analytic|, 1)).
const TOL: f64 = 1e-2;

/// Every parameter tensor's gradient against a central difference along a random direction.
fn gradcheck(cfg: &UNetConfig, batch: usize) {
    let be = CpuBackend::new();
    let mut net = UNet::new(&be, cfg, batch).unwrap();
    // random weights everywhere (zero-initialised convs would hide gradient bugs)
    let host: Vec<Vec<f32>> =
        net.specs.iter().enumerate().map(|(i, s)| rand(s.numel(), 1000 + i as u64, 0.3)).collect();
    net.set_params(&be, &host).unwrap();
    let x = rand(net.input_dims().numel(), 1, 1.0);
    let r = rand(net.output_dims().numel(), 2, 1.0);
    let t: Vec<f32> = (0..batch).map(|i| [7.0, 201.0, 0.0][i % 3]).collect();
    objective(&be, &mut net, &x, &t, &r);
    {
        let (_, dout) = net.output_and_grad();
        be.upload(&r, dout);
    }
    net.zero_grads(&be);
    net.backward(&be);
    let grads = net.host_tensors(&be, true);
    let mut worst = (0.0f64, String::new());
    for (i, spec) in net.specs.clone().iter().enumerate() {
        let v = rand(spec.numel(), 5000 + i as u64, 1.0);
        let analytic: f64 = grads[i].iter().zip(&v).map(|(&g, &d)| g as f64 * d as f64).sum();
        // Fourth-order central difference, (8(L(h) − L(−h)) − (L(2h) − L(−2h))) / 12h: the
        // truncation error is O(h⁴), so h can be large enough that the f32 forward's rounding
        // noise in L (~1e-4 here), divided by the step, stays far below the bound. (A plain
        // central difference at h = 2e-3 was noise-bound: ±4 % on the emb_layers biases.)
        let h = 1e-2f64;
        let mut at = |s: f64| {
            let mut p = host.clone();
            p[i] = host[i].iter().zip(&v).map(|(&a, &d)| (a as f64 + s * h * d as f64) as f32).collect();
            net.set_params(&be, &p).unwrap();
            objective(&be, &mut net, &x, &t, &r)
        };
        let (l1, lm1, l2, lm2) = (at(1.0), at(-1.0), at(2.0), at(-2.0));
        let numeric = (8.0 * (l1 - lm1) - (l2 - lm2)) / (12.0 * h);
        let err = (analytic - numeric).abs() / (numeric.abs().max(analytic.abs()).max(1.0));
        if err > worst.0 {
            worst = (err, spec.key.clone());
        }
        assert!(err < TOL, "{}: analytic {analytic} numeric {numeric} (rel err {err})", spec.key);
    }
    println!("worst relative error {:.2e} at {}", worst.0, worst.1);
}

#[test]
fn unet_backward_matches_finite_differences() {
    gradcheck(&UNetConfig::tiny(), 2);
}

#[test]
fn unet_backward_multihead_two_resblocks_noncubic() {
    let cfg = UNetConfig {
        depth: 8,
        size: 4,
        channel_mult: vec![1, 2],
        num_res_blocks: 2,
        attention_ds: vec![1, 2],
        num_heads: 2,
        ..UNetConfig::tiny()
    };
    gradcheck(&cfg, 1);
}

fn tc(seed: u64) -> TrainConfig {
    TrainConfig { lr: 2e-3, seed, ema_start: 4, ema_every: 2, ..TrainConfig::default() }
}

fn phantom_batch(cfg: &UNetConfig) -> (Vec<f32>, Vec<f32>) {
    meddpm::phantom::pair(cfg.depth, cfg.size, cfg.size, 1)
}

#[test]
fn tiny_model_overfits_one_pair() {
    let be = CpuBackend::new();
    let cfg = UNetConfig::tiny();
    let mut tr = Trainer::new(&be, &cfg, &tc(3)).unwrap();
    let (img, cond) = phantom_batch(&cfg);
    let losses: Vec<f32> = (0..120).map(|_| tr.train_step(&be, || Ok((img.clone(), cond.clone()))).unwrap()).collect();
    let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
    let (first, last) = (mean(&losses[..10]), mean(&losses[110..]));
    println!("L1 loss {first:.4} → {last:.4}");
    // ε ~ N(0,1) has E|ε| ≈ 0.80: an untrained net sits there; learning must clearly beat it
    assert!(first > 0.7, "an untrained net predicts ~0: {first}");
    assert!(last < 0.75 * first, "loss did not fall: {first} → {last}");
}

/// The fill-style batch source (`micro_step_ahead_fill`; bench and profile copy into it) trains bit
/// for bit as the owned-vector one, with a different batch every step, and hands the source the
/// same host buffers every time after the first (nothing allocated per step).
#[test]
fn fill_batches_train_as_owned_batches_and_reuse_buffers() {
    let be = CpuBackend::new();
    let cfg = UNetConfig::tiny();
    let (img, cond) = phantom_batch(&cfg);
    // batch k: the phantom scaled by 1 + k/8
    let batch = |k: usize| (img.iter().map(|v| v * (1.0 + k as f32 / 8.0)).collect::<Vec<f32>>(), cond.clone());
    let mut a = Trainer::new(&be, &cfg, &tc(7)).unwrap();
    let mut ka = 0;
    let mut next = || {
        ka += 1;
        Ok(batch(ka - 1))
    };
    let la: Vec<f32> = (0..4).map(|_| a.micro_step_ahead(&be, &mut next).unwrap()).collect();
    let mut b = Trainer::new(&be, &cfg, &tc(7)).unwrap();
    let (mut kb, mut seen) = (0, Vec::new());
    let mut fill = |i: &mut Vec<f32>, c: &mut Vec<f32>| {
        let (bi, bc) = batch(kb);
        kb += 1;
        i.resize(bi.len(), 0.0);
        i.copy_from_slice(&bi);
        c.clone_from(&bc);
        seen.push((i.as_ptr() as usize, c.as_ptr() as usize));
        Ok(())
    };
    let lb: Vec<f32> = (0..4).map(|_| b.micro_step_ahead_fill(&be, &mut fill).unwrap()).collect();
    assert_eq!(la.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), lb.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    assert_eq!((ka, kb), (5, 5), "one batch ahead: four steps fetch five batches");
    assert!(seen[1..].iter().all(|p| *p == seen[1]), "host buffers reallocated between steps: {seen:?}");
    let (sa, sb) = (all_state(&be, &a), all_state(&be, &b));
    for (i, (x, y)) in sa.iter().zip(&sb).enumerate() {
        assert!(x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()), "tensor {i} differs");
    }
}

fn all_state(be: &CpuBackend, tr: &Trainer<CpuBackend>) -> Vec<Vec<f32>> {
    let mut v = tr.net.host_tensors(be, false);
    for bufs in [&tr.ema, &tr.adam_m, &tr.adam_v] {
        v.extend(bufs.iter().cloned());
    }
    v
}

#[test]
fn resume_is_bit_identical() {
    let be = CpuBackend::new();
    let cfg = UNetConfig::tiny();
    let (img, cond) = phantom_batch(&cfg);
    let mut next = || Ok((img.clone(), cond.clone()));
    let mut a = Trainer::new(&be, &cfg, &tc(5)).unwrap();
    for _ in 0..6 {
        a.train_step(&be, &mut next).unwrap();
    }
    let mut b = Trainer::new(&be, &cfg, &tc(5)).unwrap();
    for _ in 0..3 {
        b.train_step(&be, &mut next).unwrap();
    }
    let dir = std::env::temp_dir().join(format!("meddpm-resume-{}", std::process::id()));
    let path = dir.join("ck.safetensors");
    save_trainer(&path, &be, &b).unwrap();
    drop(b);
    let mut c = Checkpoint::read(&path).unwrap().restore_trainer(&be).unwrap();
    assert_eq!((c.step, c.draws), (3, 6));
    for _ in 0..3 {
        c.train_step(&be, &mut next).unwrap();
    }
    let (sa, sc) = (all_state(&be, &a), all_state(&be, &c));
    assert_eq!(sa.len(), sc.len());
    for (i, (x, y)) in sa.iter().zip(&sc).enumerate() {
        assert!(x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()), "tensor {i} differs after resume");
    }
    // the EMA really moved away from a plain copy after ema_start
    assert!(a.ema.iter().zip(&a.net.params).any(|(e, p)| e != p));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn sampling_is_deterministic_and_clamped() {
    let be = CpuBackend::new();
    let cfg = UNetConfig::tiny();
    let mut net = UNet::new(&be, &cfg, 1).unwrap();
    net.init_params(&be, 1);
    let host: Vec<Vec<f32>> = net.specs.iter().enumerate().map(|(i, s)| rand(s.numel(), 77 + i as u64, 0.1)).collect();
    net.set_params(&be, &host).unwrap();
    let (_, cond) = phantom_batch(&cfg);
    let sched = Schedule::cosine(20);
    let mut s = Sampler::new(&be, &net).unwrap();
    let mut steps = 0;
    let v1 = s.sample(&be, &mut net, &sched, &cond, 9, |_| steps += 1).unwrap();
    let v2 = s.sample(&be, &mut net, &sched, &cond, 9, |_| {}).unwrap();
    let v3 = s.sample(&be, &mut net, &sched, &cond, 10, |_| {}).unwrap();
    assert_eq!(steps, 20);
    assert_eq!(v1, v2);
    assert_ne!(v1, v3);
    assert!(v1.iter().all(|v| (-1.0..=1.0).contains(v)), "final x̂₀ is clamped");
    assert!(v1.iter().any(|&v| v.abs() > 0.05));
    let bad = s.sample(&be, &mut net, &sched, &cond[1..], 9, |_| {});
    assert!(bad.unwrap_err().to_string().contains("condition has"));
}

#[test]
fn checkpoint_errors_name_the_problem() {
    let be = CpuBackend::new();
    let dir = std::env::temp_dir().join(format!("meddpm-ckerr-{}", std::process::id()));
    let path = dir.join("tiny.safetensors");
    let tr =
        Trainer::new(&be, &UNetConfig::tiny(), &TrainConfig { loss: LossKind::L1, ..TrainConfig::default() }).unwrap();
    save_trainer(&path, &be, &tr).unwrap();
    let ck = Checkpoint::read(&path).unwrap();
    // a different model: every difference is listed
    let other = UNetConfig { model_channels: 16, ..UNetConfig::tiny() };
    let specs = meddpm::model::param_specs(&other);
    let e = ck.group("ema", &specs).unwrap_err().to_string();
    assert!(e.contains("wrong shape") && e.contains("time_embed.0.weight") && e.contains("expected [64, 16]"), "{e}");
    let brats = meddpm::model::param_specs(&UNetConfig::brats());
    let e = ck.group("model", &brats).unwrap_err().to_string();
    assert!(e.contains("missing") && e.contains("tiny.safetensors"), "{e}");
    // truncated file: a clear format error, and the original is untouched by a failed read
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let e = Checkpoint::read(&cut).err().unwrap().to_string();
    assert!(e.contains("cut.safetensors") && e.contains("safetensors"), "{e}");
    let e = Checkpoint::read(&dir.join("nope.safetensors")).err().unwrap().to_string();
    assert!(e.contains("nope.safetensors"), "{e}");
    // no temp file is left behind by a save
    assert!(!dir.join("tiny.safetensors.tmp").exists());
    std::fs::remove_dir_all(dir).ok();
}

/// `train_step` stages each batch one micro-step ahead (the GPU uploads it beside the running
/// step); the batches must still be used in order, each exactly once, and the result must be
/// bit-identical to plain micro-steps on the same sequence — also when the batches differ.
#[test]
fn staged_batches_are_used_in_order() {
    let be = CpuBackend::new();
    let cfg = UNetConfig::tiny();
    let (img, cond) = phantom_batch(&cfg);
    let batch = |k: usize| -> (Vec<f32>, Vec<f32>) {
        let s = 1.0 + 0.25 * k as f32;
        (img.iter().map(|v| v * s).collect(), cond.iter().map(|v| v * s).collect())
    };
    let mut a = Trainer::new(&be, &cfg, &tc(9)).unwrap();
    let mut fetched = 0;
    let mut next = || {
        fetched += 1;
        Ok(batch(fetched - 1))
    };
    let la: Vec<f32> = (0..3).map(|_| a.train_step(&be, &mut next).unwrap()).collect();
    // 3 steps × grad_accum 2 batches used, and one more staged for the next step
    assert_eq!(fetched, 7);
    assert!(a.is_staged());
    let mut b = Trainer::new(&be, &cfg, &tc(9)).unwrap();
    let mut lb = Vec::new();
    for s in 0..3 {
        let mut sum = 0.0;
        for m in 0..2 {
            let (i, c) = batch(2 * s + m);
            sum += b.micro_step(&be, &i, &c);
        }
        b.opt_step(&be);
        lb.push(sum / 2.0);
    }
    assert_eq!(la, lb);
    assert_eq!(all_state(&be, &a), all_state(&be, &b));
    // a wrong-sized batch is an error naming what was expected, not a panic
    let err = a.stage(&be, &img[1..], &cond).unwrap_err().to_string();
    assert!(err.contains("image") && err.contains(&img.len().to_string()), "{err}");
}

/// The in-place GroupNorm+SiLU pair the decoder ResBlocks run over their skip concatenation
/// gives bit for bit what the out-of-place pair gives (CPU, both precisions' rounding modes).
#[test]
fn groupnorm_silu_in_place_equals_out_of_place() {
    use meddpm::{Accum, Dims};
    for bf16 in [false, true] {
        let be = if bf16 { CpuBackend::bf16() } else { CpuBackend::new() };
        let (x, groups) = (Dims::new(2, 12, 3, 4, 5), 4);
        let r = |len: usize, s: u64| -> Vec<f32> {
            rand(len, s, 1.0).iter().map(|&v| meddpm::backend::round_bf16(v)).collect()
        };
        let (xin, gamma, beta, dy) = (r(x.numel(), 1), rand(x.c, 2, 1.0), rand(x.c, 3, 1.0), r(x.numel(), 4));
        let (mut a, mut m, mut s) = (vec![0f32; x.numel()], vec![0f32; 2 * groups], vec![0f32; 2 * groups]);
        be.groupnorm_silu_forward(&mut a, &mut m, &mut s, &xin, None, &gamma, &beta, x, groups);
        let (mut xi, mut mi, mut si) = (xin.clone(), vec![0f32; 2 * groups], vec![0f32; 2 * groups]);
        be.groupnorm_silu_forward_inplace(&mut xi, &mut mi, &mut si, &gamma, &beta, x, groups);
        assert!(xi == a && mi == m && si == s, "bf16 {bf16}: forward in place");
        // the backward's in-place recomputation from the saved statistics
        let mut xr = xin.clone();
        be.groupnorm_silu_recompute_inplace(&mut xr, &m, &s, &gamma, &beta, x, groups);
        assert!(xr == a, "bf16 {bf16}: recompute in place");
        let (mut dx, mut dg, mut db) = (vec![7f32; x.numel()], vec![0.5f32; x.c], vec![0.25f32; x.c]);
        #[rustfmt::skip]
        be.groupnorm_silu_backward((&mut dx, Accum::Overwrite), &mut dg, &mut db, &dy, &xin, None, &m, &s, &gamma, &beta, x, groups);
        let (mut di, mut dgi, mut dbi) = (dy.clone(), vec![0.5f32; x.c], vec![0.25f32; x.c]);
        be.groupnorm_silu_backward_inplace(&mut di, &mut dgi, &mut dbi, &xin, &m, &s, &gamma, &beta, x, groups);
        assert!(di == dx && dgi == dg && dbi == db, "bf16 {bf16}: backward in place");
        assert!(dx.iter().any(|&v| v != 7.0));
    }
}

/// The skip concatenation built with its GroupNorm statistics (`concat_channels_stats`, the
/// decoder ResBlock's forward) is the plain concatenation, and its statistics are bit for bit those
/// the in-place GroupNorm+SiLU forward of that concatenation saves (CPU, both rounding modes).
#[test]
fn concat_with_statistics_equals_concat_then_groupnorm() {
    use meddpm::Dims;
    for bf16 in [false, true] {
        let be = if bf16 { CpuBackend::bf16() } else { CpuBackend::new() };
        let (x, ca, cb, groups) = (Dims::new(2, 0, 3, 4, 5), 4, 8, 3);
        let xo = x.with_c(ca + cb);
        let r = |len: usize, s: u64| -> Vec<f32> {
            rand(len, s, 1.0).iter().map(|&v| meddpm::backend::round_bf16(v + 2.0)).collect()
        };
        let (a, b, abias) = (r(x.with_c(ca).numel(), 1), r(x.with_c(cb).numel(), 2), rand(ca, 3, 1.0));
        let (gamma, beta) = (rand(xo.c, 4, 1.0), rand(xo.c, 5, 1.0));
        let (mut cat, mut m, mut s) = (vec![0f32; xo.numel()], vec![0f32; 2 * groups], vec![0f32; 2 * groups]);
        be.concat_channels_stats(&mut cat, &a, Some(&abias), &b, (&mut m, &mut s), x, ca, cb, groups);
        let mut want = vec![0f32; xo.numel()];
        be.concat_channels_bias(&mut want, &a, Some(&abias), &b, x, ca, cb);
        assert!(cat == want, "bf16 {bf16}: the concatenation");
        let (mut mi, mut si) = (vec![0f32; 2 * groups], vec![0f32; 2 * groups]);
        be.groupnorm_silu_forward_inplace(&mut want, &mut mi, &mut si, &gamma, &beta, xo, groups);
        assert!(m == mi && s == si, "bf16 {bf16}: statistics {m:?} {s:?} vs {mi:?} {si:?}");
        // and the in-place recompute from them gives the in-place forward's output
        be.groupnorm_silu_recompute_inplace(&mut cat, &m, &s, &gamma, &beta, xo, groups);
        assert!(cat == want, "bf16 {bf16}: recompute in place from the concatenation's statistics");
    }
}

/// GroupNorm+SiLU with a per-(n, c) input offset (the ResBlock's time embedding, folded in) is
/// GroupNorm+SiLU of the materialised sum, summed in f32 and not rounded: bit for bit in fp32;
/// in bf16 mode the same as an fp32 sum fed to the bf16 backend (only outputs are rounded). The
/// recompute and the backward take the same offset.
#[test]
fn groupnorm_silu_input_offset_is_the_unrounded_sum() {
    use meddpm::{Accum, Dims};
    for bf16 in [false, true] {
        let be = if bf16 { CpuBackend::bf16() } else { CpuBackend::new() };
        let (x, groups) = (Dims::new(2, 12, 3, 4, 5), 4);
        let (xin, off, gamma, beta) =
            (rand(x.numel(), 1, 1.0), rand(x.n * x.c, 5, 3.0), rand(x.c, 2, 1.0), rand(x.c, 3, 1.0));
        let dy = rand(x.numel(), 4, 1.0);
        let mut sum = xin.clone();
        meddpm::cpu::CpuBackend::new().add_channel_bias(&mut sum, &off, x);
        let ng = x.n * groups;
        let run = |inp: &Vec<f32>, o: Option<&Vec<f32>>| {
            let (mut a, mut m, mut s, mut a2) =
                (vec![0f32; x.numel()], vec![0f32; ng], vec![0f32; ng], vec![0f32; x.numel()]);
            be.groupnorm_silu_forward(&mut a, &mut m, &mut s, inp, o, &gamma, &beta, x, groups);
            be.groupnorm_silu_recompute(&mut a2, &m, &s, inp, o, &gamma, &beta, x, groups);
            let (mut dx, mut dg, mut db) = (vec![0.5f32; x.numel()], vec![0f32; x.c], vec![0f32; x.c]);
            #[rustfmt::skip]
            be.groupnorm_silu_backward((&mut dx, Accum::Add), &mut dg, &mut db, &dy, inp, o, &m, &s, &gamma, &beta, x, groups);
            (a, m, s, a2, dx, dg, db)
        };
        let (got, want) = (run(&xin, Some(&off)), run(&sum, None));
        assert!(got == want, "bf16 {bf16}: the offset differs from the materialised sum");
        // and the offset matters: without it the output differs
        assert!(run(&xin, None).0 != want.0);
    }
}
