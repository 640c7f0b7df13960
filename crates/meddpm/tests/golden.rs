//! The CPU U-Net against PyTorch: golden files written by `tools/reference/make_golden.py` (our
//! PyTorch re-implementation of the reference Med-DDPM network, run in float64) hold weights,
//! input, timesteps, target ε, output, L1 loss and every parameter gradient. The Rust engine
//! (float32) must reproduce the output, the loss and all gradients within the stated tolerance,
//! and the 13 schedule buffers of the reference `GaussianDiffusion`.

use meddpm::checkpoint::Checkpoint;
use meddpm::cpu::CpuBackend;
use meddpm::diffusion::schedule::{Schedule, BUFFER_NAMES};
use meddpm::model::{UNet, UNetConfig};
use meddpm::testing::{compare, Tolerance};
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

fn check(name: &str) {
    let (ck, cfg, batch) = golden(name);
    let be = CpuBackend::new();
    let mut net = UNet::new(&be, &cfg, batch).unwrap();
    let specs = net.specs.clone();
    net.set_params(&be, &ck.group("param", &specs).unwrap()).unwrap();
    let t = tensor(&ck, "t").to_vec();
    be.upload(tensor(&ck, "x"), net.input_mut());
    net.forward(&be, &t);
    let mut out = vec![0f32; net.output_dims().numel()];
    be.download(net.output(), &mut out);
    // float32 engine vs float64 PyTorch: errors come from f32 rounding through ~30 layers
    compare("out", &out, tensor(&ck, "out"), Tolerance { abs: 1e-4, rel: 1e-3 }).unwrap();
    let eps = tensor(&ck, "eps");
    let mut eps_buf = be.alloc(eps.len()).unwrap();
    be.upload(eps, &mut eps_buf);
    let mut loss = be.alloc(1).unwrap();
    let (o, dout) = net.output_and_grad();
    be.loss_forward(&mut loss, o, &eps_buf, LossKind::L1);
    be.loss_backward(dout, o, &eps_buf, LossKind::L1, 1.0);
    compare("loss", &loss, tensor(&ck, "loss"), Tolerance { abs: 1e-5, rel: 1e-5 }).unwrap();
    net.zero_grads(&be);
    net.backward(&be);
    let grads = net.host_tensors(&be, true);
    let mut failures = Vec::new();
    for (spec, g) in specs.iter().zip(&grads) {
        let want = tensor(&ck, &format!("grad.{}", spec.key));
        // L1's sign() makes gradients piecewise; tolerance scaled to the tensor's magnitude
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        if let Err(e) =
            compare(&format!("grad.{}", spec.key), g, want, Tolerance { abs: 2e-3 * scale as f64, rel: 2e-3 })
        {
            failures.push(e);
        }
    }
    assert!(failures.is_empty(), "{} gradients differ:\n{}", failures.len(), failures.join("\n"));
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
fn schedule_buffers_match_pytorch() {
    let (ck, _, _) = golden("tiny.safetensors");
    let s = Schedule::cosine(250);
    for name in BUFFER_NAMES {
        let ours = s.buffer(name).unwrap();
        compare(name, &ours, tensor(&ck, &format!("sched.{name}")), Tolerance { abs: 1e-6, rel: 1e-5 }).unwrap();
    }
}
