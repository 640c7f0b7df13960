//! The CPU's fp8 emulation (`CpuBackend::fp8`) against its spec (`meddpm::fp8`): a wide 3×3×3
//! conv's forward is the fp32 conv of the E4M3-quantised bf16 operands (input per tensor, weight
//! per output channel), bias added in f32, output rounded to bf16 — bit for bit; every other conv,
//! and every backward, is the bf16 emulation's, bit for bit; the CLI's way in refuses fp8.

use meddpm::backend::round_bf16;
use meddpm::cpu::CpuBackend;
use meddpm::fp8::{self, Fp8Format};
use meddpm::{Accum, Backend, ConvShape, Dims, Precision};

/// Deterministic values of varied magnitude (several binades, both signs).
fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let t = (i as f32 * 0.7311 + seed as f32 * 1.37).sin();
            scale * t * (1.0 + 3.0 * ((i * 7 + seed as usize) % 5) as f32)
        })
        .collect()
}

/// Forward of `be` on shape `cs` with bias: the output.
fn forward(be: &CpuBackend, cs: ConvShape, x: &[f32], w: &[f32], b: &[f32]) -> Vec<f32> {
    let out_dims = cs.out();
    let mut out = vec![0.0; out_dims.numel()];
    be.conv3d_forward_acc((&mut out, Accum::Overwrite), &x.to_vec(), &w.to_vec(), Some(&b.to_vec()), cs);
    out
}

/// The operands of `cs` (input, weight, bias).
fn operands(cs: ConvShape, seed: u32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let wlen = cs.cout * cs.x.c * cs.k * cs.k * cs.k;
    let mut w = values(wlen, seed + 1, 0.02);
    // one output channel of much larger weights: per-channel scales must keep the others precise
    w[..wlen / cs.cout].iter_mut().for_each(|v| *v *= 300.0);
    (values(cs.x.numel(), seed, 0.5), w, values(cs.cout, seed + 2, 0.1))
}

#[test]
fn wide_conv_forward_is_the_fp32_conv_of_quantised_operands() {
    // odd sizes, channels just at and above the threshold
    for (c, cout, n) in [(16, 16, 1), (17, 19, 2), (32, 24, 1)] {
        let cs = ConvShape::new(Dims::new(n, c, 5, 6, 7), cout, 3, 1);
        assert!(fp8::conv_runs_fp8(&cs));
        let (x, w, b) = operands(cs, c as u32);
        let got = forward(&CpuBackend::fp8(), cs, &x, &w, &b);
        // the spec composed by hand
        let xb: Vec<f32> = x.iter().map(|&v| round_bf16(v)).collect();
        let wb: Vec<f32> = w.iter().map(|&v| round_bf16(v)).collect();
        let (mut xq, mut wq) = (Vec::new(), Vec::new());
        let s = fp8::quantize_tensor_into(&mut xq, &xb, Fp8Format::E4M3);
        fp8::quantize_channels_into(&mut wq, &wb, cout, Fp8Format::E4M3);
        assert_eq!(s, fp8::pow2_scale(fp8::amax(&xb), Fp8Format::E4M3));
        let want: Vec<f32> = forward(&CpuBackend::new(), cs, &xq, &wq, &b).into_iter().map(round_bf16).collect();
        assert_eq!(got, want, "{cs:?}: fp8 forward is not the spec's");
        // and the quantisation is there: fp8 differs from bf16, by far less than the output
        let bf = forward(&CpuBackend::bf16(), cs, &x, &w, &b);
        let rel = meddpm::testing::rel_l2(&got, &bf);
        assert!(rel > 1e-3 && rel < 0.1, "{cs:?}: fp8 vs bf16 rel L2 {rel:.2e}");
    }
}

#[test]
fn other_convs_and_every_backward_run_as_bf16() {
    let x = |c| Dims::new(2, c, 6, 5, 7);
    let shapes = [
        ConvShape::new(x(3), 16, 3, 1),  // the first conv (few channels in)
        ConvShape::new(x(16), 1, 3, 1),  // the last conv (one out)
        ConvShape::new(x(15), 32, 3, 1), // just under the threshold
        ConvShape::new(x(16), 24, 1, 1), // a 1×1 skip
        ConvShape::new(x(16), 16, 3, 2), // a downsampler
    ];
    for cs in shapes {
        assert!(!fp8::conv_runs_fp8(&cs));
        let (xi, w, b) = operands(cs, 7);
        assert_eq!(forward(&CpuBackend::fp8(), cs, &xi, &w, &b), forward(&CpuBackend::bf16(), cs, &xi, &w, &b));
    }
    // a wide conv's backward (data, weight and bias gradients) is bf16's
    let cs = ConvShape::new(x(16), 17, 3, 1);
    let (xi, w, _) = operands(cs, 3);
    let dy = values(cs.out().numel(), 9, 0.1);
    let grads = |be: CpuBackend| {
        let (mut dx, mut dw, mut db) = (vec![0.0; xi.len()], vec![0.0; w.len()], vec![0.0; cs.cout]);
        be.conv3d_backward(Some((&mut dx, Accum::Overwrite)), &mut dw, Some(&mut db), &dy, &xi, &w, cs);
        let mut dx2 = vec![0.0; xi.len()];
        be.conv3d_backward_data((&mut dx2, Accum::Overwrite), &dy, &w, cs);
        (dx, dw, db, dx2)
    };
    assert_eq!(grads(CpuBackend::fp8()), grads(CpuBackend::bf16()));
}

#[test]
fn the_emulation_says_what_it_is_and_the_cli_way_in_refuses_fp8() {
    let be = CpuBackend::fp8();
    assert_eq!(be.precision(), Precision::Fp8);
    assert_eq!(Precision::Fp8.act_dtype(), meddpm::DType::Bf16);
    assert!(be.describe().contains("fp8"), "{}", be.describe());
    let e = CpuBackend::with_precision(Precision::Fp8).unwrap_err().to_string();
    assert!(e.contains("--precision fp8") && e.contains("CPU") && e.contains("bf16"), "{e}");
    assert_eq!("FP8".parse::<Precision>().unwrap(), Precision::Fp8);
}
