//! The bf16 mode of the engine, on the CPU (runs in CI): the rounding helper, the CPU backend's
//! bf16 emulation (values stored where the GPU stores bf16 are bf16-representable; the result stays
//! close to fp32), the refresh of the conv weight copies after every parameter change, and the
//! memory plan's bf16 classes.

use meddpm::backend::round_bf16;
use meddpm::cpu::CpuBackend;
use meddpm::diffusion::{TrainConfig, Trainer};
use meddpm::model::{UNet, UNetConfig};
use meddpm::testing::randn_f32;
use meddpm::{Backend, Precision};

fn representable(v: &[f32]) -> bool {
    v.iter().all(|&x| x.to_bits() & 0xffff == 0 || x.is_nan())
}

#[test]
fn round_bf16_is_round_to_nearest_even() {
    assert_eq!(round_bf16(1.0), 1.0);
    assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0, "tie rounds to even (down)");
    assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 1.0 / 64.0, "tie rounds to even (up)");
    assert_eq!(round_bf16(1.0 + 1.0 / 256.0 + 1e-6), 1.0 + 1.0 / 128.0, "above the tie rounds up");
    assert_eq!(round_bf16(-2.0 - 1.0 / 128.0 - 1e-6), -2.0 - 1.0 / 64.0, "sign-symmetric");
    assert_eq!(round_bf16(f32::MAX), f32::INFINITY, "overflow rounds to infinity");
    assert_eq!(round_bf16(f32::NEG_INFINITY), f32::NEG_INFINITY);
    assert!(round_bf16(f32::NAN).is_nan());
    assert_eq!(round_bf16(1e-40).to_bits() & 0xffff, 0, "subnormals keep 7 mantissa bits");
    // the relative error of a normal value is at most half a bf16 ulp: 2^-8 of the binade
    for v in randn_f32(1, 1, 10_000, 100.0) {
        let r = round_bf16(v);
        assert!(((r - v) / v).abs() <= 1.0 / 256.0, "{v} -> {r}");
        assert_eq!(r.to_bits() & 0xffff, 0);
    }
}

fn tiny_net(be: &CpuBackend, batch: usize) -> (UNet<CpuBackend>, Vec<Vec<f32>>) {
    let cfg = UNetConfig::tiny();
    let mut net = UNet::new(be, &cfg, batch).unwrap();
    let host: Vec<Vec<f32>> =
        net.specs.iter().enumerate().map(|(i, s)| randn_f32(9, 100 + i as u64, s.numel(), 0.2)).collect();
    net.set_params(be, &host).unwrap();
    (net, host)
}

#[test]
fn cpu_bf16_emulation_stores_bf16_and_stays_close_to_fp32() {
    let (bf, fp) = (CpuBackend::bf16(), CpuBackend::new());
    assert_eq!(bf.precision(), Precision::Bf16);
    let (mut nb, _) = tiny_net(&bf, 2);
    let (mut nf, _) = tiny_net(&fp, 2);
    let x = randn_f32(9, 1, nb.input_dims().numel(), 1.0);
    bf.upload(&x, nb.input_mut());
    fp.upload(&x, nf.input_mut());
    nb.forward(&bf, &[5.0, 200.0]);
    nf.forward(&fp, &[5.0, 200.0]);
    // every activation the GPU would store as bf16 is bf16-representable here
    for (i, l) in nb.layers.iter().enumerate().take(nb.layers.len() - 1).skip(1) {
        assert!(representable(nb.layer_output(i)), "layer {} output is not bf16", l.name);
    }
    // ... and the emulation does change the result, but only by bf16-sized amounts
    let (o, f) = (nb.output(), nf.output());
    let num: f64 = o.iter().zip(f).map(|(&a, &b)| (a as f64 - b as f64).powi(2)).sum::<f64>().sqrt();
    let den: f64 = f.iter().map(|&b| (b as f64).powi(2)).sum::<f64>().sqrt();
    let rel = num / den;
    assert!(rel > 1e-5 && rel < 0.05, "bf16 vs fp32 relative L2 {rel:e}");
    // the fp32 reference stores f32 (not everything is representable in bf16)
    assert!((1..nf.layers.len() - 1).any(|i| !representable(nf.layer_output(i))));
}

/// The attention core in bf16 mode stores what the GPU's bf16 path stores: the probabilities, dZ
/// and dqkv are bf16 values, the probabilities computed from bf16-rounded logits (so they differ
/// from the rounded fp32 probabilities somewhere), and the result stays close to fp32.
#[test]
fn cpu_bf16_attention_rounds_logits_probabilities_and_gradients() {
    use meddpm::cpu::attention;
    use meddpm::Dims;
    let (bf, fp) = (CpuBackend::bf16(), CpuBackend::new());
    let x = Dims::new(1, 16, 4, 4, 4);
    let t = x.s();
    let qkv: Vec<f32> = randn_f32(5, 1, 3 * x.numel(), 2.0).into_iter().map(round_bf16).collect();
    let dout: Vec<f32> = randn_f32(5, 2, x.numel(), 1.0).into_iter().map(round_bf16).collect();
    let run = |be: &CpuBackend| {
        let (mut out, mut att) = (vec![0f32; x.numel()], vec![0f32; t * t]);
        be.attention_forward(&mut out, &mut att, &qkv, x, 1);
        let (mut dqkv, mut datt) = (vec![0f32; qkv.len()], vec![0f32; t * t]);
        be.attention_backward(&mut dqkv, &mut datt, &dout, &qkv, &att, x, 1);
        (out, att, dqkv, datt)
    };
    let (ob, ab, db, zb) = run(&bf);
    let (of, af, df, _) = run(&fp);
    for (what, v) in [("out", &ob), ("att", &ab), ("dqkv", &db), ("dZ", &zb)] {
        assert!(representable(v), "bf16 attention {what} is not bf16");
    }
    // P from rounded logits, not just rounded P: some probability differs from round(P_fp32)
    let mut plain = vec![0f32; t * t];
    attention::attention_forward(&mut vec![0f32; x.numel()], &mut plain, &qkv, x, 1, |_| {});
    assert!(ab.iter().zip(&plain).any(|(&a, &p)| a != round_bf16(p)), "logits were not rounded");
    for (what, b, f) in [("out", &ob, &of), ("att", &ab, &af), ("dqkv", &db, &df)] {
        let num: f64 = b.iter().zip(f.iter()).map(|(&a, &c)| (a as f64 - c as f64).powi(2)).sum::<f64>().sqrt();
        let den: f64 = f.iter().map(|&c| (c as f64).powi(2)).sum::<f64>().sqrt();
        assert!(num / den < 0.05, "bf16 attention {what}: relative L2 {:e} vs fp32", num / den);
    }
}

/// The conv weight copies follow every parameter change: after an optimizer step (and inside
/// `with_ema`) a network's output equals that of a fresh network given the same weights.
#[test]
fn bf16_weight_copies_are_refreshed_after_updates() {
    let be = CpuBackend::bf16();
    let cfg = UNetConfig::tiny();
    let tc = TrainConfig {
        lr: 1e-2,
        seed: 3,
        batch: 1,
        grad_accum: 1,
        ema_start: 0,
        ema_every: 1,
        ..TrainConfig::default()
    };
    let mut tr = Trainer::new(&be, &cfg, &tc).unwrap();
    let (img, cond) = meddpm::phantom::pair(cfg.depth, cfg.size, cfg.size, 0);
    for _ in 0..2 {
        tr.micro_step(&be, &img, &cond);
        tr.opt_step(&be);
    }
    let x = randn_f32(9, 2, tr.net.input_dims().numel(), 1.0);
    let out_of = |net: &mut UNet<CpuBackend>| {
        be.upload(&x, net.input_mut());
        net.forward(&be, &[17.0]);
        net.output().clone()
    };
    let fresh = |w: Vec<Vec<f32>>| {
        let mut n = UNet::new(&be, &cfg, 1).unwrap();
        n.set_params(&be, &w).unwrap();
        n
    };
    let online = out_of(&mut tr.net);
    assert_eq!(online, out_of(&mut fresh(tr.net.host_tensors(&be, false))), "online weights after Adam");
    let ema_host: Vec<Vec<f32>> = tr.ema.to_vec();
    let ema_out = tr.with_ema(out_of);
    assert_eq!(ema_out, out_of(&mut fresh(ema_host)), "EMA weights inside with_ema");
    assert_ne!(ema_out, online, "EMA and online weights differ after two steps");
    assert_eq!(out_of(&mut tr.net), online, "online weights again after with_ema");
}

#[test]
fn bf16_memory_plan_halves_activation_storage() {
    let cfg = UNetConfig::tiny();
    let a = UNet::new(&CpuBackend::new(), &cfg, 2).unwrap().mem;
    let b = UNet::new(&CpuBackend::bf16(), &cfg, 2).unwrap().mem;
    assert_eq!(b.outputs * 2, a.outputs);
    assert_eq!(b.grads * 2, a.grads);
    assert_eq!(b.io, a.io, "the network's input and output stay f32");
    assert_eq!(b.params, a.params, "parameters and gradients stay f32");
    assert_eq!(a.lowp, 0);
    assert!(b.lowp > 0 && b.lowp < b.params / 2, "bf16 conv weight copies: {} bytes", b.lowp);
    assert!(b.total() < a.total());
}
