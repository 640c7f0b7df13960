//! The CPU U-Net against PyTorch: golden files written by `tools/reference/make_golden.py` (our
//! PyTorch re-implementation of the reference Med-DDPM network, run in float64) hold weights,
//! input, timesteps, target ε, output, L1 loss and every parameter gradient. The Rust engine
//! (float32) must reproduce the output, the loss and all gradients within the stated tolerance,
//! and the 13 schedule buffers of the reference `GaussianDiffusion`.

use meddpm::checkpoint::Checkpoint;
use meddpm::cpu::CpuBackend;
use meddpm::diffusion::schedule::{Schedule, BUFFER_NAMES};
use meddpm::model::{UNet, UNetConfig};
use meddpm::testing::{
    check_rel_l2_set, compare, rel_l2, L2Bounds, Tolerance, GOLDEN_BF16, GOLDEN_FP8, GOLDEN_FP8_OUT,
};
use meddpm::{Backend, LossKind};
use std::path::PathBuf;

fn golden(name: &str) -> (Checkpoint, UNetConfig, usize) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/golden").join(name);
    let ck =
        Checkpoint::read(&path).unwrap_or_else(|e| panic!("golden file missing ({e}); see tools/reference/README.md"));
    let bytes = std::fs::read(&path).unwrap();
    let (_, md) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = md.metadata().clone().expect("golden metadata");
    let cfg: UNetConfig = serde_json::from_str(&meta["config"]).expect("config metadata");
    let batch: usize = meta["batch"].parse().unwrap();
    (ck, cfg, batch)
}

fn tensor<'a>(ck: &'a Checkpoint, k: &str) -> &'a [f32] {
    &ck.tensors.get(k).unwrap_or_else(|| panic!("golden file lacks {k}")).1
}

/// The golden file's network run on `be`: the output, the L1 loss and every parameter gradient
/// (state-dict key, values).
type Run = (Vec<f32>, f32, Vec<(String, Vec<f32>)>);

/// With `golden_dout` the backward starts from the golden output's loss gradient,
/// sign(out − ε)/numel, instead of our own output's: in reduced precision the output moves by
/// ~1e-2 and L1's sign() flips wherever |out − ε| is that small (0.3 % of the elements flip the
/// tiny_heads2 model's gradients by 0.11 relative L2), which says nothing about the backward.
fn run(be: &CpuBackend, ck: &Checkpoint, cfg: &UNetConfig, batch: usize, golden_dout: bool) -> Run {
    let mut net = UNet::new(be, cfg, batch).unwrap();
    let specs = net.specs.clone();
    net.set_params(be, &ck.group("param", &specs).unwrap()).unwrap();
    let t = tensor(ck, "t").to_vec();
    be.upload_act(tensor(ck, "x"), net.input_dims(), net.input_mut());
    net.forward(be, &t);
    let mut out = vec![0f32; net.output_dims().numel()];
    be.download(net.output(), &mut out);
    let eps = tensor(ck, "eps");
    let mut eps_buf = be.alloc(eps.len()).unwrap();
    be.upload(eps, &mut eps_buf);
    let mut loss = be.alloc(1).unwrap();
    let (o, dout) = net.output_and_grad();
    be.loss_forward(&mut loss, o, &eps_buf, LossKind::L1);
    if golden_dout {
        be.loss_backward(dout, &tensor(ck, "out").to_vec(), &eps_buf, LossKind::L1, 1.0);
    } else {
        be.loss_backward(dout, o, &eps_buf, LossKind::L1, 1.0);
    }
    net.zero_grads(be);
    net.backward(be);
    let grads = specs.iter().map(|s| s.key.clone()).zip(net.host_tensors(be, true)).collect();
    (out, loss[0], grads)
}

fn check(name: &str) {
    let (ck, cfg, batch) = golden(name);
    let (out, loss, grads) = run(&CpuBackend::new(), &ck, &cfg, batch, false);
    // float32 engine vs float64 PyTorch: errors come from f32 rounding through ~30 layers
    compare("out", &out, tensor(&ck, "out"), Tolerance { abs: 1e-4, rel: 1e-3 }).unwrap();
    compare("loss", &[loss], tensor(&ck, "loss"), Tolerance { abs: 1e-5, rel: 1e-5 }).unwrap();
    let mut failures = Vec::new();
    for (key, g) in &grads {
        let want = tensor(&ck, &format!("grad.{key}"));
        // L1's sign() makes gradients piecewise; tolerance scaled to the tensor's magnitude
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        if let Err(e) = compare(&format!("grad.{key}"), g, want, Tolerance { abs: 2e-3 * scale as f64, rel: 2e-3 }) {
            failures.push(e);
        }
    }
    assert!(failures.is_empty(), "{} gradients differ:\n{}", failures.len(), failures.join("\n"));
}

/// The CPU's bf16 emulation (f32 arithmetic, bf16 rounding wherever the GPU stores bf16) against
/// the float64 golden file: whole-tensor bounds, as for the GPU's bf16 network
/// (`meddpm-cuda/tests/golden.rs` uses the same bounds): bf16 rounding flips compound layer by
/// layer, so single elements move by more than their tensor's RMS; a layout, index or weight bug
/// moves whole tensors by O(1).
fn check_bf16(name: &str) {
    check_lowp(name, CpuBackend::bf16(), GOLDEN_BF16);
}

/// The CPU's fp8 emulation (bf16 as above, E4M3 operands in the wide 3×3×3 convs' forward)
/// against the float64 golden file: the same whole-tensor check with fp8's bounds, and the
/// output's relative L2 error within [`GOLDEN_FP8_OUT`]. Both models have wide convs (16
/// channels in and out), so the quantisation is exercised.
fn check_fp8(name: &str) {
    let out_err = check_lowp(name, CpuBackend::fp8(), GOLDEN_FP8);
    assert!(out_err <= GOLDEN_FP8_OUT, "{name} fp8 emulation: output rel L2 {out_err:.3e} > {GOLDEN_FP8_OUT:.0e}");
}

/// `be` (a bf16 or fp8 emulation) against the golden file within `bounds`; the output's
/// relative L2 error.
fn check_lowp(name: &str, be: CpuBackend, bounds: L2Bounds) -> f64 {
    let (ck, cfg, batch) = golden(name);
    let (out, loss, grads) = run(&be, &ck, &cfg, batch, true);
    let out_err = rel_l2(&out, tensor(&ck, "out"));
    let mut all = vec![("out".to_string(), out, tensor(&ck, "out").to_vec())];
    all.extend(grads.into_iter().map(|(k, g)| {
        let want = tensor(&ck, &format!("grad.{k}")).to_vec();
        (format!("grad.{k}"), g, want)
    }));
    // the loss is a mean over the output: its rounding errors average out
    let p = be.precision().name();
    compare(&format!("loss ({p})"), &[loss], tensor(&ck, "loss"), Tolerance { abs: 0.0, rel: 1e-3 }).unwrap();
    check_rel_l2_set(&format!("{name} {p} emulation"), &all, bounds).unwrap();
    out_err
}

#[test]
fn tiny_unet_matches_pytorch() {
    check("tiny.safetensors");
}

#[test]
fn multihead_two_resblock_unet_matches_pytorch() {
    check("tiny_heads2.safetensors");
}

#[test]
fn tiny_unet_bf16_emulation_near_pytorch() {
    check_bf16("tiny.safetensors");
}

#[test]
fn multihead_two_resblock_unet_bf16_emulation_near_pytorch() {
    check_bf16("tiny_heads2.safetensors");
}

#[test]
fn tiny_unet_fp8_emulation_near_pytorch() {
    check_fp8("tiny.safetensors");
}

#[test]
fn multihead_two_resblock_unet_fp8_emulation_near_pytorch() {
    check_fp8("tiny_heads2.safetensors");
}

#[test]
fn schedule_buffers_match_pytorch() {
    let (ck, _, _) = golden("tiny.safetensors");
    let s = Schedule::cosine(250);
    for name in BUFFER_NAMES {
        let ours = s.buffer(name).unwrap();
        compare(name, &ours, tensor(&ck, &format!("sched.{name}")), Tolerance { abs: 1e-6, rel: 1e-5 }).unwrap();
    }
}
