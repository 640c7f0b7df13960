//! The PyTorch golden files on the GPU: the same check as `meddpm/tests/golden.rs` (our PyTorch
//! re-implementation of Med-DDPM in float64 → output, L1 loss, every parameter gradient), run on
//! `CudaBackend` in fp32 with both layouts. The golden files are embedded, so the test binary
//! works on the GPU machine without the repository's testdata. Without a GPU it prints
//! "skipped: no CUDA device" and passes.

use meddpm::checkpoint::Checkpoint;
use meddpm::model::{UNet, UNetConfig};
use meddpm::testing::{compare, Tolerance};
use meddpm::{Backend, Layout, LossKind, Precision};
use meddpm_cuda::CudaBackend;

const TINY: &[u8] = include_bytes!("../../../testdata/golden/tiny.safetensors");
const HEADS2: &[u8] = include_bytes!("../../../testdata/golden/tiny_heads2.safetensors");

fn backend(layout: Layout) -> Option<CudaBackend> {
    match CudaBackend::new(0, Precision::Fp32, layout) {
        Ok(b) => Some(b),
        Err(e) if e.to_string().contains("no CUDA device") || e.to_string().contains("libraries not found") => {
            println!("skipped: no CUDA device ({e})");
            None
        }
        Err(e) => panic!("CudaBackend::new: {e}"),
    }
}

fn check(name: &str, bytes: &[u8], layout: Layout) {
    let Some(be) = backend(layout) else { return };
    // one folder per test (name and layout): the layouts' tests run on parallel threads of one
    // process, and a shared file was read by one while the other rewrote it
    let dir = std::env::temp_dir().join(format!("meddpm-golden-{}-{name}-{layout:?}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    let ck = Checkpoint::read(&path).unwrap();
    let (_, md) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let meta = md.metadata().clone().expect("golden metadata");
    let cfg: UNetConfig = serde_json::from_str(&meta["config"]).unwrap();
    let batch: usize = meta["batch"].parse().unwrap();
    let t = |k: &str| ck.tensors[k].1.clone();
    let mut net = UNet::new(&be, &cfg, batch).unwrap();
    let specs = net.specs.clone();
    net.set_params(&be, &ck.group("param", &specs).unwrap()).unwrap();
    let (xd, yd) = (net.input_dims(), net.output_dims());
    be.upload_act(&t("x"), xd, net.input_mut());
    net.forward(&be, &t("t"));
    let mut out = vec![0f32; yd.numel()];
    be.download_act(net.output(), yd, &mut out);
    compare(&format!("{name} {layout:?} out"), &out, &t("out"), Tolerance { abs: 1e-4, rel: 1e-3 }).unwrap();
    let mut eps = be.alloc(yd.numel()).unwrap();
    be.upload_act(&t("eps"), yd, &mut eps);
    let mut loss = be.alloc(1).unwrap();
    let (o, dout) = net.output_and_grad();
    be.loss_forward(&mut loss, o, &eps, LossKind::L1);
    be.loss_backward(dout, o, &eps, LossKind::L1, 1.0);
    let mut l = [0f32];
    be.download(&loss, &mut l);
    compare("loss", &l, &t("loss"), Tolerance { abs: 1e-5, rel: 1e-5 }).unwrap();
    net.zero_grads(&be);
    net.backward(&be);
    let mut failures = Vec::new();
    for (spec, g) in specs.iter().zip(net.host_tensors(&be, true)) {
        let want = t(&format!("grad.{}", spec.key));
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6) as f64;
        if let Err(e) = compare(&format!("grad.{}", spec.key), &g, &want, Tolerance { abs: 2e-3 * scale, rel: 2e-3 }) {
            failures.push(e);
        }
    }
    std::fs::remove_dir_all(dir).ok();
    assert!(failures.is_empty(), "{} gradients differ:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn golden_tiny_ncdhw() {
    check("tiny.safetensors", TINY, Layout::Ncdhw);
}

#[test]
fn golden_tiny_ndhwc() {
    check("tiny.safetensors", TINY, Layout::Ndhwc);
}

#[test]
fn golden_heads2_both_layouts() {
    check("tiny_heads2.safetensors", HEADS2, Layout::Ncdhw);
    check("tiny_heads2.safetensors", HEADS2, Layout::Ndhwc);
}
