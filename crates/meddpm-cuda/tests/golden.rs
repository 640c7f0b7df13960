//! The PyTorch golden files on the GPU: the same checks as `meddpm/tests/golden.rs` (our PyTorch
//! re-implementation of Med-DDPM in float64 → output, L1 loss, every parameter gradient), run on
//! `CudaBackend` in every precision with both layouts: fp32 element by element with the CPU's
//! tolerances; TF32 and bf16 by whole-tensor relative L2 error (`GOLDEN_TF32`, `GOLDEN_BF16` in
//! `meddpm::testing`, the bf16 bounds shared with the CPU's bf16 emulation), their backward
//! started from the golden output's loss gradient. The golden files are embedded, so the test
//! binary works on the GPU machine without the repository's testdata. The tests need a CUDA GPU and
//! are `#[ignore]`d (a plain `cargo test` reports them as ignored); `scripts/gpu/run.sh check` runs
//! the binary with `--include-ignored`, and there a missing GPU fails them.

use meddpm::checkpoint::Checkpoint;
use meddpm::cpu::CpuBackend;
use meddpm::model::{UNet, UNetConfig};
use meddpm::testing::{check_rel_l2_set, compare, Tolerance, GOLDEN_BF16, GOLDEN_TF32};
use meddpm::{Backend, Layout, LossKind, Precision};
use meddpm_cuda::CudaBackend;

const TINY: &[u8] = include_bytes!("../../../testdata/golden/tiny.safetensors");
const HEADS2: &[u8] = include_bytes!("../../../testdata/golden/tiny_heads2.safetensors");

fn backend(precision: Precision, layout: Layout) -> CudaBackend {
    CudaBackend::new(0, precision, layout)
        .unwrap_or_else(|e| panic!("CudaBackend::new({precision:?}, {layout:?}): {e}"))
}

fn check(name: &str, bytes: &[u8], precision: Precision, layout: Layout) {
    let be = backend(precision, layout);
    let fp32 = precision == Precision::Fp32;
    // one folder per test (name and layout): the layouts' tests run on parallel threads of one
    // process, and a shared file was read by one while the other rewrote it
    let dir =
        std::env::temp_dir().join(format!("meddpm-golden-{}-{name}-{precision:?}-{layout:?}", std::process::id()));
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
    let tag = format!("{name} {precision:?} {layout:?}");
    if fp32 {
        compare(&format!("{tag} out"), &out, &t("out"), Tolerance { abs: 1e-4, rel: 1e-3 }).unwrap();
    }
    let mut eps = be.alloc(yd.numel()).unwrap();
    be.upload_act(&t("eps"), yd, &mut eps);
    let mut loss = be.alloc(1).unwrap();
    let (o, dout) = net.output_and_grad();
    be.loss_forward(&mut loss, o, &eps, LossKind::L1);
    if fp32 {
        be.loss_backward(dout, o, &eps, LossKind::L1, 1.0);
    } else {
        // the golden output's loss gradient (meddpm/tests/golden.rs says why), by the CPU's loss
        let mut d = vec![0f32; yd.numel()];
        CpuBackend::new().loss_backward(&mut d, &t("out"), &t("eps"), LossKind::L1, 1.0);
        be.upload_act(&d, yd, dout);
    }
    let mut l = [0f32];
    be.download(&loss, &mut l);
    let loss_rel = if fp32 { 1e-5 } else { 1e-3 };
    compare(&format!("{tag} loss"), &l, &t("loss"), Tolerance { abs: 1e-5, rel: loss_rel }).unwrap();
    net.zero_grads(&be);
    net.backward(&be);
    let grads = net.host_tensors(&be, true);
    std::fs::remove_dir_all(dir).ok();
    if !fp32 {
        let mut all = vec![("out".to_string(), out, t("out"))];
        all.extend(specs.iter().zip(grads).map(|(s, g)| (format!("grad.{}", s.key), g, t(&format!("grad.{}", s.key)))));
        let bounds = if precision == Precision::Bf16 { GOLDEN_BF16 } else { GOLDEN_TF32 };
        check_rel_l2_set(&tag, &all, bounds).unwrap();
        return;
    }
    let mut failures = Vec::new();
    for (spec, g) in specs.iter().zip(grads) {
        let want = t(&format!("grad.{}", spec.key));
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6) as f64;
        if let Err(e) = compare(&format!("grad.{}", spec.key), &g, &want, Tolerance { abs: 2e-3 * scale, rel: 2e-3 }) {
            failures.push(e);
        }
    }
    assert!(failures.is_empty(), "{} gradients differ:\n{}", failures.len(), failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn golden_tiny_ncdhw() {
    check("tiny.safetensors", TINY, Precision::Fp32, Layout::Ncdhw);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn golden_tiny_ndhwc() {
    check("tiny.safetensors", TINY, Precision::Fp32, Layout::Ndhwc);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn golden_heads2_both_layouts() {
    check("tiny_heads2.safetensors", HEADS2, Precision::Fp32, Layout::Ncdhw);
    check("tiny_heads2.safetensors", HEADS2, Precision::Fp32, Layout::Ndhwc);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn golden_tf32_both_models_both_layouts() {
    for l in [Layout::Ncdhw, Layout::Ndhwc] {
        check("tiny.safetensors", TINY, Precision::Tf32, l);
        check("tiny_heads2.safetensors", HEADS2, Precision::Tf32, l);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn golden_bf16_both_models_both_layouts() {
    for l in [Layout::Ncdhw, Layout::Ndhwc] {
        check("tiny.safetensors", TINY, Precision::Bf16, l);
        check("tiny_heads2.safetensors", HEADS2, Precision::Bf16, l);
    }
}
