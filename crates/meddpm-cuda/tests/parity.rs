//! Parity of every CUDA primitive with the CPU reference (`meddpm::cpu::CpuBackend`, the
//! executable spec), on several shapes including odd ones (5×6×7, channel counts that are not
//! multiples of 32), in both layouts and both precisions, forward and backward; then the whole
//! U-Net forward/backward and one full training step from one seed.
//!
//! Inputs are fresh Philox normals; outputs the backends accumulate into (`dw`, `db`, `Accum::Add`
//! inputs) start from random values so that "+=" and "=" are told apart. Host data crosses in
//! NCDHW / PyTorch layouts, so a layout bug shows as an O(1) error.
//!
//! Tolerances (|gpu − cpu| ≤ abs + rel·|cpu|, with abs a fraction of the reference's RMS):
//! - exact-arithmetic plumbing (concat, split, copy, bias adds, upsample, q_sample): 1e-6
//! - fp32 elementwise with transcendental functions (SiLU, DDPM step, sampler step, Adam, EMA): 1e-5
//! - fp32 reductions (GroupNorm, channel sums, losses, softmax): 1e-4
//! - fp32 (FMA) convolutions and GEMMs: 1e-4 (different summation orders over up to 1728 terms)
//! - TF32 convolutions and GEMMs: 1e-2 (10-bit mantissa inputs: ~5e-4 typical relative error)
//! - randn: identical bits except ≤ 1 ulp where CUDA's and the host's double log/cos differ
//! - whole U-Net and one training step: per element 2e-3 (fp32) / 0.5 (TF32) of the RMS, and a
//!   relative L2 error of the whole tensor ≤ 2e-4 (fp32) / 0.15 (TF32). The fp32 configurations
//!   check the semantics tightly; TF32 rounding compounds through the network (a GroupNorm weight's
//!   gradient was seen 6 % off in relative L2), so there the check only catches gross errors.
//!
//! Every test needs a CUDA GPU and is `#[ignore]`d: a plain `cargo test` reports them as ignored;
//! `scripts/gpu/run.sh check` runs the prebuilt binary with `--include-ignored` on the GPU machine,
//! and there a missing or unusable GPU fails the tests.

use meddpm::cpu::CpuBackend;
use meddpm::testing::{compare, randn_f32, Tolerance};
use meddpm::{Accum, Backend, ConvShape, Dims, Layout, LossKind, Precision};
use meddpm_cuda::CudaBackend;

mod common;
use common::{check_forward_acc, check_small_path, Buf};

type Cpu = CpuBackend;

/// The four GPU configurations. Every test here is `#[ignore]`d, so a plain `cargo test` reports
/// it as ignored; asked for with `--include-ignored`, it fails on a machine without a usable GPU
/// (rather than passing without having checked anything).
fn gpus() -> Vec<CudaBackend> {
    let mut v = Vec::new();
    for p in [Precision::Fp32, Precision::Tf32] {
        for l in [Layout::Ncdhw, Layout::Ndhwc] {
            v.push(CudaBackend::new(0, p, l).unwrap_or_else(|e| panic!("CudaBackend::new({p:?}, {l:?}): {e}")));
        }
    }
    v
}

fn name(g: &CudaBackend) -> String {
    format!("{:?}/{:?}", g.precision(), g.layout())
}

fn rms(v: &[f32]) -> f64 {
    (v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / v.len().max(1) as f64).sqrt()
}

/// Tolerance with abs = frac·rms(want) (plus a tiny floor) and rel = frac.
fn tol(want: &[f32], frac: f64) -> Tolerance {
    Tolerance::new(frac * rms(want) + 1e-30, frac)
}

/// Matrix-engine tolerance for the backend's precision.
fn mm_frac(g: &CudaBackend) -> f64 {
    match g.precision() {
        Precision::Fp32 => 1e-4,
        Precision::Tf32 => 1e-2,
        Precision::Bf16 | Precision::Fp8 => unreachable!("bf16 and fp8 have their own parity tests"),
    }
}

fn check(what: &str, got: &[f32], want: &[f32], frac: f64) {
    compare(what, got, want, tol(want, frac)).unwrap_or_else(|e| panic!("{e}"));
}

// ---- host <-> device helpers -------------------------------------------------------------

fn act(g: &CudaBackend, host: &[f32], x: Dims) -> <CudaBackend as Backend>::Buf {
    let mut b = g.alloc(x.numel()).unwrap();
    g.upload_act(host, x, &mut b);
    b
}
fn raw(g: &CudaBackend, host: &[f32]) -> <CudaBackend as Backend>::Buf {
    let mut b = g.alloc(host.len()).unwrap();
    g.upload(host, &mut b);
    b
}
fn param(g: &CudaBackend, host: &[f32], shape: &[usize]) -> <CudaBackend as Backend>::Buf {
    let mut b = g.alloc(host.len()).unwrap();
    g.upload_param(host, shape, &mut b);
    b
}
fn get_act(g: &CudaBackend, b: &<CudaBackend as Backend>::Buf, x: Dims) -> Vec<f32> {
    let mut h = vec![0f32; x.numel()];
    g.download_act(b, x, &mut h);
    h
}
fn get_raw(g: &CudaBackend, b: &<CudaBackend as Backend>::Buf) -> Vec<f32> {
    let mut h = vec![0f32; b.len()];
    g.download(b, &mut h);
    h
}
fn get_param(g: &CudaBackend, b: &<CudaBackend as Backend>::Buf, shape: &[usize]) -> Vec<f32> {
    let mut h = vec![0f32; b.len()];
    g.download_param(b, shape, &mut h);
    h
}

fn rnd(len: usize, stream: u64, scale: f32) -> Vec<f32> {
    randn_f32(4242, stream, len, scale)
}

const ODD: Dims = Dims::new(2, 5, 5, 6, 7);

// ---- memory and layout ---------------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn upload_download_roundtrip_and_layout() {
    let gs = gpus();
    for g in &gs {
        let x = Dims::new(2, 3, 4, 5, 6);
        let h = rnd(x.numel(), 1, 1.0);
        let b = act(g, &h, x);
        assert_eq!(get_act(g, &b, x), h, "{}: act round trip", name(g));
        let raw_dev = get_raw(g, &b);
        // in NDHWC the raw buffer holds channels last
        let (n, c, s) = (1, 2, 17);
        let want = h[(n * x.c + c) * x.s() + s];
        let got = match g.layout() {
            Layout::Ncdhw => raw_dev[(n * x.c + c) * x.s() + s],
            Layout::Ndhwc => raw_dev[(n * x.s() + s) * x.c + c],
        };
        assert_eq!(got, want, "{}: memory layout", name(g));
        let shape = [4, 3, 3, 3, 3];
        let w = rnd(4 * 3 * 27, 2, 1.0);
        let wb = param(g, &w, &shape);
        assert_eq!(get_param(g, &wb, &shape), w, "{}: param round trip", name(g));
        let mut z = raw(g, &w);
        g.zero(&mut z);
        assert!(get_raw(g, &z).iter().all(|&v| v == 0.0));
        let mut c2 = g.alloc(w.len()).unwrap();
        g.copy(&mut c2, &wb);
        assert_eq!(get_param(g, &c2, &shape), w);
    }
}

/// Large uploads go through the backend's two page-locked buffers per length, used in turn: five
/// uploads queued back to back (so buffers are refilled while earlier copies may be in flight),
/// of two lengths, must all arrive intact; a 1-channel activation skips the layout change.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn large_uploads_through_pinned_buffers() {
    let gs = gpus();
    for g in &gs {
        let (n1, n2) = (1 << 18, (1 << 18) + 5);
        let hosts: Vec<Vec<f32>> = (0..5).map(|i| rnd(if i % 3 == 2 { n2 } else { n1 }, 500 + i, 1.0)).collect();
        let mut bufs: Vec<_> = hosts.iter().map(|h| g.alloc(h.len()).unwrap()).collect();
        for (h, b) in hosts.iter().zip(bufs.iter_mut()) {
            g.upload(h, b);
        }
        for (i, (h, b)) in hosts.iter().zip(&bufs).enumerate() {
            assert!(get_raw(g, b) == *h, "{}: pinned upload {i} differs", name(g));
        }
        let x = Dims::new(1, 1, 64, 64, 65);
        let h = rnd(x.numel(), 510, 1.0);
        assert_eq!(get_act(g, &act(g, &h, x), x), h, "{}: 1-channel activation", name(g));
    }
}

/// Staged uploads (`Backend::stage_act`, the trainer's next batch) run on a side stream beside
/// queued work: queued after a long chain of kernels, each must still arrive intact (both
/// layouts, through the page-locked path and the small direct one), and work queued after the
/// call must see it, also when that work starts at once; a buffer staged into again (next turn)
/// must hold the new data.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn staged_uploads_overlap_and_are_ordered() {
    let gs = gpus();
    for g in &gs {
        let x = Dims::new(1, 2, 64, 64, 65); // 2 channels: the layout change happens on the host
        let small = Dims::new(1, 2, 3, 4, 5);
        let (busy, mut busy_out) = (raw(g, &rnd(1 << 24, 540, 1.0)), g.alloc(1 << 24).unwrap());
        for turn in 0..3u64 {
            // keep the main stream busy (a few ms), so the side copy runs beside queued work
            for _ in 0..200 {
                g.silu_forward(&mut busy_out, &busy);
            }
            let (h, hs) = (rnd(x.numel(), 520 + turn, 1.0), rnd(small.numel(), 530 + turn, 1.0));
            let (mut d, mut ds) = (g.alloc(x.numel()).unwrap(), g.alloc(small.numel()).unwrap());
            g.stage_act(&h, x, &mut d);
            g.stage_act(&hs, small, &mut ds);
            // main-stream work after the call reads what was staged
            let mut c = g.alloc(x.numel()).unwrap();
            g.copy(&mut c, &d);
            assert!(get_act(g, &c, x) == h, "{}: staged upload, turn {turn}", name(g));
            assert!(get_act(g, &ds, small) == hs, "{}: small staged upload, turn {turn}", name(g));
        }
        // an idle main stream and a large copy (tens of ms over PCIe): a device copy queued right
        // after the call must still wait for it (without the event join it would read zeros)
        let big = Dims::new(1, 1, 256, 256, 512);
        let hb = rnd(big.numel(), 550, 1.0);
        let (mut d, mut c) = (g.alloc(big.numel()).unwrap(), g.alloc(big.numel()).unwrap());
        g.sync();
        g.stage_act(&hb, big, &mut d);
        g.copy(&mut c, &d);
        assert!(get_raw(g, &c) == hb, "{}: a copy queued after a staged upload ran before it", name(g));
    }
}

// ---- convolution ---------------------------------------------------------------------------

fn conv_case(gs: &[CudaBackend], cs: ConvShape, with_dinp: Option<Accum>, seed: u64) {
    let cpu = Cpu::new();
    let o = cs.out();
    let k = cs.k;
    let wshape = [cs.cout, cs.x.c, k, k, k];
    let fan = (cs.x.c * k * k * k) as f32;
    let x = rnd(cs.x.numel(), seed, 1.0);
    let w = rnd(cs.w_len(), seed + 1, 1.0 / fan.sqrt());
    let b = rnd(cs.cout, seed + 2, 0.5);
    let dy = rnd(o.numel(), seed + 3, 1.0);
    let dw0 = rnd(cs.w_len(), seed + 4, 1.0);
    let db0 = rnd(cs.cout, seed + 5, 1.0);
    let dx0 = rnd(cs.x.numel(), seed + 6, 1.0);
    // CPU reference
    let mut y_c = vec![0f32; o.numel()];
    cpu.conv3d_forward(&mut y_c, &x, &w, &b, cs);
    let (mut dw_c, mut db_c, mut dx_c) = (dw0.clone(), db0.clone(), dx0.clone());
    cpu.conv3d_backward(with_dinp.map(|a| (&mut dx_c, a)), &mut dw_c, Some(&mut db_c), &dy, &x, &w, cs);
    for g in gs {
        let (xg, wg, bg, dyg) = (act(g, &x, cs.x), param(g, &w, &wshape), raw(g, &b), act(g, &dy, o));
        // our few-channel kernels forbidden (cuDNN), forced (where the shape is theirs; the
        // Cout = 1 forward in NDHWC as GEMM + tap sum, then the direct FMA kernel), timed
        for (small, gemm) in [(Some(false), true), (Some(true), true), (Some(true), false), (None, true)] {
            g.set_choices(|c| c.small_conv = small);
            g.set_choices(|c| c.small_gemm = gemm);
            let tag = format!(
                "conv {} -> {} k{} s{} {:?} small {small:?} gemm {gemm} [{}]",
                cs.x,
                cs.cout,
                k,
                cs.stride,
                with_dinp,
                name(g)
            );
            // both bias paths: cuDNN-fused (where the algorithm allows it) and our bias kernel
            for mode in [Some(true), Some(false), None] {
                g.set_choices(|c| c.fused_bias = mode);
                let mut yg = g.alloc(o.numel()).unwrap();
                g.conv3d_forward(&mut yg, &xg, &wg, &bg, cs);
                check(&format!("{tag} y (fused bias {mode:?})"), &get_act(g, &yg, o), &y_c, mm_frac(g));
            }
            // Cin or Cout not a multiple of 4: also through the zero-padded shape (forced on, off,
            // timed); twice each, so the reused padding scratch is exercised
            for pad in [Some(true), Some(false), None] {
                g.set_choices(|c| c.conv_pad = pad);
                for rep in 0..2 {
                    let mut yg = g.alloc(o.numel()).unwrap();
                    g.conv3d_forward(&mut yg, &xg, &wg, &bg, cs);
                    check(&format!("{tag} y (padded {pad:?}, rep {rep})"), &get_act(g, &yg, o), &y_c, mm_frac(g));
                }
            }
            g.set_choices(|c| c.conv_pad = None);
            // the GEMM route's slabs: at least 8 planes each, so D > 8 runs several
            g.set_choices(|c| c.small_gemm_budget = 1);
            let mut yg = g.alloc(o.numel()).unwrap();
            g.conv3d_forward(&mut yg, &xg, &wg, &bg, cs);
            check(&format!("{tag} y (slabs of 8 planes)"), &get_act(g, &yg, o), &y_c, mm_frac(g));
            g.set_choices(|c| c.small_gemm_budget = 64 << 20);
            check_small_path(g, cs, small, 0, &tag, false);
            // twice: the second call uses the cached algorithm and must accumulate the same way;
            // a third time without the bias gradient (db None: db untouched, the rest the same)
            for rep in 0..3 {
                let with_db = rep < 2;
                let (mut dwg, mut dbg, mut dxg) = (param(g, &dw0, &wshape), raw(g, &db0), act(g, &dx0, cs.x));
                let db_arg = with_db.then_some(&mut dbg);
                g.conv3d_backward(with_dinp.map(|a| (&mut dxg, a)), &mut dwg, db_arg, &dyg, &xg, &wg, cs);
                // compare the increments (dw0 is O(1), the gradient may be much larger or smaller)
                let inc = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(p, q)| p - q).collect::<Vec<f32>>();
                let dw_g = get_param(g, &dwg, &wshape);
                check(&format!("{tag} dw+= (rep {rep})"), &inc(&dw_g, &dw0), &inc(&dw_c, &dw0), mm_frac(g));
                if with_db {
                    check(&format!("{tag} db+= (rep {rep})"), &get_raw(g, &dbg), &db_c, 1e-4);
                } else {
                    assert_eq!(get_raw(g, &dbg), db0, "{tag}: db None must leave the buffer alone");
                }
                let dx_g = get_act(g, &dxg, cs.x);
                if with_dinp.is_some() {
                    check(&format!("{tag} dx (rep {rep})"), &inc(&dx_g, &dx0), &inc(&dx_c, &dx0), mm_frac(g));
                    if with_dinp == Some(Accum::Overwrite) {
                        check(&format!("{tag} dx overwrite (rep {rep})"), &dx_g, &dx_c, mm_frac(g));
                    }
                    check_small_path(g, cs, small, 1, &tag, false);
                } else {
                    assert_eq!(dx_g, dx0, "{tag}: dinp None must leave the buffer alone");
                }
            }
            // the data gradient alone (`conv3d_backward_data`: the U-Net runs it before the
            // weight gradient where the GroupNorm backward recomputes the conv's input)
            if let Some(a) = with_dinp {
                let inc = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(p, q)| p - q).collect::<Vec<f32>>();
                let mut dxd = act(g, &dx0, cs.x);
                g.conv3d_backward_data((&mut dxd, a), &dyg, &wg, cs);
                check(
                    &format!("{tag} dx (data only)"),
                    &inc(&get_act(g, &dxd, cs.x), &dx0),
                    &inc(&dx_c, &dx0),
                    mm_frac(g),
                );
                check_small_path(g, cs, small, 1, &tag, false);
            }
        }
        g.set_choices(|c| c.small_conv = None); // the defaults
        g.set_choices(|c| c.small_gemm = true);
        let y0 = rnd(o.numel(), seed + 7, 1.0);
        let tag = format!("conv {} -> {} k{} s{} [{}]", cs.x, cs.cout, k, cs.stride, name(g));
        check_forward_acc(
            g,
            &cpu,
            cs,
            (&x, &w, &b, &y0),
            (&xg, &wg, &bg),
            &|h| act(g, h, o),
            &|b| get_act(g, b, o),
            &|what, got, want| check(what, got, want, mm_frac(g)),
            &tag,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn conv3d_parity() {
    let gs = gpus();
    let cases = [
        (ConvShape::new(ODD, 7, 3, 1), Some(Accum::Overwrite)),
        (ConvShape::new(ODD, 7, 3, 2), Some(Accum::Add)),
        (ConvShape::new(ODD, 6, 1, 1), Some(Accum::Add)),
        (ConvShape::new(Dims::new(1, 3, 9, 10, 11), 40, 3, 1), None), // first conv: Cin = 3
        (ConvShape::new(Dims::new(1, 40, 9, 10, 11), 1, 3, 1), Some(Accum::Overwrite)), // last conv: Cout = 1
        (ConvShape::new(Dims::new(2, 3, 7, 6, 5), 1, 3, 2), Some(Accum::Add)), // both padded, batch 2
        (ConvShape::new(Dims::new(1, 64, 12, 12, 12), 64, 3, 1), Some(Accum::Add)), // tensor-core shapes
        (ConvShape::new(Dims::new(1, 64, 12, 12, 12), 64, 3, 2), Some(Accum::Overwrite)),
        (ConvShape::new(Dims::new(2, 96, 6, 6, 6), 192, 1, 1), Some(Accum::Overwrite)),
        // our few-output-channel weight gradient (kernels/conv3d.cu): 2 channel groups in NDHWC
        // (70 = 64 + 6), several chunks, Cout 2 and 4, batch 2
        (ConvShape::new(Dims::new(2, 70, 7, 9, 6), 4, 3, 1), Some(Accum::Add)),
        (ConvShape::new(Dims::new(1, 64, 17, 18, 19), 2, 3, 1), Some(Accum::Overwrite)),
        // our few-channel forward and data gradient: Cout 1, 3, 4 (W = 8: the 4-voxel vector
        // accesses), batch 2, Cin past one 64-channel weight chunk; Cin 1, 2, 4 with Cout past one
        // 64-channel block, Cout not a multiple of 8, and Cin = Cout = 4
        (ConvShape::new(Dims::new(2, 40, 7, 6, 5), 1, 3, 1), Some(Accum::Add)),
        (ConvShape::new(Dims::new(2, 40, 7, 6, 5), 4, 3, 1), Some(Accum::Overwrite)),
        (ConvShape::new(Dims::new(1, 40, 5, 6, 8), 3, 3, 1), Some(Accum::Add)),
        (ConvShape::new(Dims::new(1, 130, 4, 5, 6), 1, 3, 1), Some(Accum::Add)),
        (ConvShape::new(Dims::new(2, 2, 5, 6, 8), 20, 3, 1), Some(Accum::Add)),
        (ConvShape::new(Dims::new(1, 1, 4, 5, 6), 130, 3, 1), Some(Accum::Overwrite)),
        (ConvShape::new(Dims::new(1, 4, 6, 5, 7), 4, 3, 1), Some(Accum::Overwrite)),
        // Cout = 1 in NDHWC through GEMM + tap sum: batch 2, three slabs of planes (19 = 8 + 8 + 3)
        (ConvShape::new(Dims::new(2, 24, 19, 6, 7), 1, 3, 1), Some(Accum::Overwrite)),
    ];
    for (i, (cs, acc)) in cases.into_iter().enumerate() {
        conv_case(&gs, cs, acc, 100 + 10 * i as u64);
    }
}

/// f32 rounded to TF32 (10 mantissa bits), to nearest with ties away from zero: PTX's
/// `cvt.rna.tf32.f32`, which `conv3d_wgmma_wgrad_tf32` applies to both operands.
fn rna_tf32(v: f32) -> f32 {
    f32::from_bits(v.to_bits().wrapping_add(0x1000) & 0xffff_e000)
}

/// The wide convs' TF32 weight gradient on the warpgroup MMA (`conv3d_wgmma_wgrad_tf32`, forced
/// on; TF32 NDHWC), added onto a dW holding values: runs of tiles that cross planes and samples
/// (batch 2), two input groups and two output slices (Cin 128, Cout 128), 16 × 8 tiles cut by H
/// and W, a single plane. Operands already TF32 (rounding them is then the identity): the
/// products are exact and only the f32 summation order differs from the fp32 CPU reference, so
/// within 1e-4 — a wrong tap, channel or voxel is O(1). Operands as drawn: within the TF32
/// tolerance of the CPU (1e-2), and agreeing with cuDNN's TF32 weight gradient (kernel switched
/// off) within it. The run counter proves each was this kernel; fp32 (exact FMA sums) and NCDHW
/// never take it.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn wgmma_wgrad_tf32_parity() {
    let gs = gpus();
    let (g, cpu) = (&gs[3], Cpu::new());
    assert_eq!((g.precision(), g.layout()), (Precision::Tf32, Layout::Ndhwc));
    let cases =
        [(Dims::new(2, 64, 6, 40, 20), 64), (Dims::new(1, 128, 9, 33, 17), 128), (Dims::new(1, 64, 1, 20, 24), 64)];
    for o in &gs {
        o.set_choices(|c| c.wgmma = Some(true));
    }
    for (i, (xd, co)) in cases.into_iter().enumerate() {
        let cs = ConvShape::new(xd, co, 3, 1);
        let seed = 7900 + 10 * i as u64;
        let od = cs.out();
        let wshape = [co, xd.c, 3, 3, 3];
        let w = rnd(cs.w_len(), seed + 1, 1.0 / ((xd.c * 27) as f32).sqrt());
        let dw0 = rnd(cs.w_len(), seed + 3, 50.0);
        for rounded in [true, false] {
            let r = |v: Vec<f32>| if rounded { v.into_iter().map(rna_tf32).collect() } else { v };
            let (x, dy) = (r(rnd(xd.numel(), seed, 1.0)), r(rnd(od.numel(), seed + 2, 1.0)));
            let tag =
                format!("wgmma wgrad tf32 {xd} -> {co}{} [{}]", if rounded { " (TF32 operands)" } else { "" }, name(g));
            let mut want = dw0.clone();
            cpu.conv3d_backward(None, &mut want, None, &dy, &x, &w, cs);
            let (xg, wg, dyg) = (act(g, &x, xd), param(g, &w, &wshape), act(g, &dy, od));
            let runs = g.runs().wgmma_wgrad;
            let mut dwg = param(g, &dw0, &wshape);
            g.conv3d_backward(None, &mut dwg, None, &dyg, &xg, &wg, cs);
            if g.runs().wgmma_wgrad == runs {
                println!("skipped: conv3d_wgmma_wgrad_tf32 needs an sm_90 GPU ({})", name(g));
                for o in &gs {
                    o.set_choices(|c| c.wgmma = None);
                }
                return;
            }
            assert_eq!(g.runs().wgmma_wgrad - runs, 1, "{tag}: one run");
            let got = get_param(g, &dwg, &wshape);
            let grad = |v: &[f32]| v.iter().zip(&dw0).map(|(a, b)| a - b).collect::<Vec<_>>();
            // the gradient itself (dW0's values, 50x larger, would hide its errors)
            check(&format!("{tag} dw (+= onto dW)"), &grad(&got), &grad(&want), if rounded { 1e-4 } else { 1e-2 });
            if !rounded {
                g.set_choices(|c| c.wgmma_wgrad = false);
                let mut dwc = param(g, &dw0, &wshape);
                g.conv3d_backward(None, &mut dwc, None, &dyg, &xg, &wg, cs);
                g.set_choices(|c| c.wgmma_wgrad = true);
                assert_eq!(g.runs().wgmma_wgrad - runs, 1, "{tag}: cuDNN's run did not take the kernel");
                check(&format!("{tag} dw vs cuDNN's TF32"), &grad(&get_param(g, &dwc, &wshape)), &grad(&got), 1e-2);
            }
        }
        // the other three configurations never run it (fp32: exact sums; NCDHW: no kernel)
        for o in &gs[..3] {
            let (xo, wo, dyo) = (
                act(o, &rnd(xd.numel(), seed, 1.0), xd),
                param(o, &w, &wshape),
                act(o, &rnd(od.numel(), seed + 2, 1.0), od),
            );
            let mut dwo = param(o, &dw0, &wshape);
            o.conv3d_backward(None, &mut dwo, None, &dyo, &xo, &wo, cs);
            assert_eq!(o.runs().wgmma_wgrad, 0, "{}: conv3d_wgmma_wgrad* must not run", name(o));
        }
    }
    for o in &gs {
        o.set_choices(|c| c.wgmma = None);
    }
}

// ---- GroupNorm and SiLU ----------------------------------------------------------------------

fn groupnorm_case(gs: &[CudaBackend], x: Dims, groups: usize, fused: bool, acc: Accum, seed: u64) {
    let cpu = Cpu::new();
    // a non-zero mean per channel checks the variance computation against cancellation
    let mut xin = rnd(x.numel(), seed, 1.5);
    for (i, v) in xin.iter_mut().enumerate() {
        *v += ((i / x.s()) % x.c) as f32 * 0.7 - 3.0;
    }
    let gamma = rnd(x.c, seed + 1, 1.0);
    let beta = rnd(x.c, seed + 2, 1.0);
    let dy = rnd(x.numel(), seed + 3, 1.0);
    let (dg0, db0, dx0) = (rnd(x.c, seed + 4, 1.0), rnd(x.c, seed + 5, 1.0), rnd(x.numel(), seed + 6, 1.0));
    let ng = x.n * groups;
    let (mut y_c, mut a_c, mut m_c, mut r_c) =
        (vec![0f32; x.numel()], vec![0f32; x.numel()], vec![0f32; ng], vec![0f32; ng]);
    let (mut dg_c, mut db_c, mut dx_c) = (dg0.clone(), db0.clone(), dx0.clone());
    if fused {
        cpu.groupnorm_silu_forward(&mut a_c, &mut m_c, &mut r_c, &xin, None, &gamma, &beta, x, groups);
        #[rustfmt::skip]
        cpu.groupnorm_silu_backward((&mut dx_c, acc), &mut dg_c, &mut db_c, &dy, &xin, None, &m_c, &r_c, &gamma, &beta, x, groups);
    } else {
        cpu.groupnorm_forward(&mut y_c, &mut m_c, &mut r_c, &xin, &gamma, &beta, x, groups);
        cpu.groupnorm_backward((&mut dx_c, acc), &mut dg_c, &mut db_c, &dy, &xin, &m_c, &r_c, &gamma, x, groups);
    }
    for g in gs {
        let tag = format!("groupnorm{} {x} G{groups} {acc:?} [{}]", if fused { "+silu" } else { "" }, name(g));
        let (xg, gg, bg, dyg) = (act(g, &xin, x), raw(g, &gamma), raw(g, &beta), act(g, &dy, x));
        let (mut yg, mut ag, mut mg, mut rg) =
            (g.alloc(x.numel()).unwrap(), g.alloc(x.numel()).unwrap(), g.alloc(ng).unwrap(), g.alloc(ng).unwrap());
        let (mut dgg, mut dbg, mut dxg) = (raw(g, &dg0), raw(g, &db0), act(g, &dx0, x));
        if fused {
            g.groupnorm_silu_forward(&mut ag, &mut mg, &mut rg, &xg, None, &gg, &bg, x, groups);
            #[rustfmt::skip]
            g.groupnorm_silu_backward((&mut dxg, acc), &mut dgg, &mut dbg, &dyg, &xg, None, &mg, &rg, &gg, &bg, x, groups);
            check(&format!("{tag} silu out"), &get_act(g, &ag, x), &a_c, 1e-4);
            // the backward's recomputation from the saved statistics: the forward's output, bit for bit
            let mut a2 = g.alloc(x.numel()).unwrap();
            g.groupnorm_silu_recompute(&mut a2, &mg, &rg, &xg, None, &gg, &bg, x, groups);
            assert!(get_act(g, &a2, x) == get_act(g, &ag, x), "{tag}: recompute differs from the forward");
            // in place (the decoder ResBlocks over their skip concatenation): the same kernels,
            // so bit for bit the out-of-place results
            let (mut xi, mut mi, mut ri) = (act(g, &xin, x), g.alloc(ng).unwrap(), g.alloc(ng).unwrap());
            g.groupnorm_silu_forward_inplace(&mut xi, &mut mi, &mut ri, &gg, &bg, x, groups);
            assert!(get_act(g, &xi, x) == get_act(g, &ag, x), "{tag}: in-place forward differs");
            let mut xr = act(g, &xin, x);
            g.groupnorm_silu_recompute_inplace(&mut xr, &mg, &rg, &gg, &bg, x, groups);
            assert!(get_act(g, &xr, x) == get_act(g, &ag, x), "{tag}: in-place recompute differs");
            assert!(get_raw(g, &mi) == get_raw(g, &mg) && get_raw(g, &ri) == get_raw(g, &rg), "{tag}: in-place stats");
            // the statistics alone (the core the trait's provided forwards are made of): the
            // forward's statistics kernels, so bit for bit its saved ones, with and without an offset
            let (mut ms, mut rs) = (g.alloc(ng).unwrap(), g.alloc(ng).unwrap());
            g.groupnorm_stats(&mut ms, &mut rs, &xg, None, x, groups);
            assert!(get_raw(g, &ms) == get_raw(g, &mg) && get_raw(g, &rs) == get_raw(g, &rg), "{tag}: groupnorm_stats");
            let offg = raw(g, &rnd(x.n * x.c, seed + 9, 2.0));
            let (mut ao, mut mo, mut ro) = (g.alloc(x.numel()).unwrap(), g.alloc(ng).unwrap(), g.alloc(ng).unwrap());
            g.groupnorm_silu_forward(&mut ao, &mut mo, &mut ro, &xg, Some(&offg), &gg, &bg, x, groups);
            g.groupnorm_stats(&mut ms, &mut rs, &xg, Some(&offg), x, groups);
            assert!(get_raw(g, &ms) == get_raw(g, &mo) && get_raw(g, &rs) == get_raw(g, &ro), "{tag}: stats, offset");
            let (mut dgo, mut dbo, mut dxo) = (raw(g, &dg0), raw(g, &db0), g.alloc(x.numel()).unwrap());
            #[rustfmt::skip]
            g.groupnorm_silu_backward((&mut dxo, Accum::Overwrite), &mut dgo, &mut dbo, &dyg, &xg, None, &mg, &rg, &gg, &bg, x, groups);
            let (mut dgi, mut dbi, mut di) = (raw(g, &dg0), raw(g, &db0), act(g, &dy, x));
            g.groupnorm_silu_backward_inplace(&mut di, &mut dgi, &mut dbi, &xg, &mg, &rg, &gg, &bg, x, groups);
            assert!(get_act(g, &di, x) == get_act(g, &dxo, x), "{tag}: in-place backward differs");
            assert!(
                get_raw(g, &dgi) == get_raw(g, &dgo) && get_raw(g, &dbi) == get_raw(g, &dbo),
                "{tag}: in-place dgamma/dbeta"
            );
            // in place with the recomputation riding along (x := silu(GN(x)))
            let (up, down) = (&|v: &[f32]| act(g, v, x), &|b: &Buf| get_act(g, b, x));
            let (upr, downr) = (&|v: &[f32]| raw(g, v), &|b: &Buf| get_raw(g, b));
            let want = (&down(&dxo)[..], &down(&ag)[..], &downr(&dgo)[..], &downr(&dbo)[..]);
            let dev = ((&mg, &rg), (&gg, &bg));
            common::check_gn_inplace_act(
                g,
                (x, groups),
                (&xin, &dy),
                (&dg0, &db0),
                dev,
                want,
                (up, down),
                (upr, downr),
                &tag,
            );
            // an identity skip's gradient folded into the pass (res), against the two calls
            let res = rnd(x.numel(), seed + 8, 1.0);
            let host = (&xin[..], &dy[..], &dx0[..], &res[..]);
            common::check_res_fold(g, (x, groups), host, (&dg0, &db0), dev, (up, down), (upr, downr), &tag);
            // with a per-(n, c) input offset (the ResBlock's time embedding folded in)
            let off: Vec<f32> = rnd(x.n * x.c, seed + 7, 2.0);
            let (up, down) = (&|v: &[f32]| act(g, v, x), &|b: &Buf| get_act(g, b, x));
            let (upr, downr) = (&|v: &[f32]| raw(g, v), &|b: &Buf| get_raw(g, b));
            let host = (&xin[..], &dy[..], &dx0[..]);
            let chk = &|w: &str, got: &[f32], want: &[f32]| check(w, got, want, 2e-4);
            let ops = (&gamma[..], &beta[..], &off[..]);
            common::check_gn_offset(g, &cpu, (x, groups, acc, 0.0), host, ops, (up, down), (upr, downr), chk, &name(g));
        } else {
            g.groupnorm_forward(&mut yg, &mut mg, &mut rg, &xg, &gg, &bg, x, groups);
            g.groupnorm_backward((&mut dxg, acc), &mut dgg, &mut dbg, &dyg, &xg, &mg, &rg, &gg, x, groups);
            check(&format!("{tag} out"), &get_act(g, &yg, x), &y_c, 1e-4);
        }
        check(&format!("{tag} mean"), &get_raw(g, &mg), &m_c, 1e-5);
        check(&format!("{tag} rstd"), &get_raw(g, &rg), &r_c, 1e-4);
        check(&format!("{tag} dx"), &get_act(g, &dxg, x), &dx_c, 2e-4);
        check(&format!("{tag} dgamma+="), &get_raw(g, &dgg), &dg_c, 1e-4);
        check(&format!("{tag} dbeta+="), &get_raw(g, &dbg), &db_c, 1e-4);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn groupnorm_parity() {
    let gs = gpus();
    let cases = [
        (Dims::new(2, 40, 5, 6, 7), 8, false, Accum::Overwrite),
        (Dims::new(2, 40, 5, 6, 7), 8, true, Accum::Add),
        (Dims::new(1, 64, 24, 20, 18), 32, true, Accum::Overwrite), // several chunks in both layouts
        (Dims::new(1, 96, 9, 9, 9), 32, false, Accum::Add),
        (Dims::new(1, 512, 4, 4, 4), 32, true, Accum::Overwrite), // widest decoder concat
        (Dims::new(3, 8, 3, 3, 3), 4, true, Accum::Add),
        (Dims::new(1, 16, 64, 64, 64), 8, true, Accum::Add), // ~1024 chunks in NDHWC, 256 per channel in NCDHW
        (Dims::new(2, 32, 40, 40, 40), 32, false, Accum::Overwrite),
        (Dims::new(1, 576, 3, 4, 5), 32, true, Accum::Add), // decoder concat wider than 512
        (Dims::new(3, 320, 2, 3, 4), 1, true, Accum::Add),  // gn_bwd_finalize in rounds: 960 items a group
        // the finalizers split over blocks (kernels/groupnorm.cu fin_last): 1024 chunks in NDHWC,
        // 2 blocks a group of 4 channels (2 samples), 4 a group of 6 channels (padded to 8: 32 thread
        // rows; the statistics finalizer has 42)
        (Dims::new(2, 128, 32, 32, 32), 32, true, Accum::Add),
        (Dims::new(1, 192, 32, 32, 32), 32, false, Accum::Overwrite),
    ];
    for (i, (x, groups, fused, acc)) in cases.into_iter().enumerate() {
        groupnorm_case(&gs, x, groups, fused, acc, 300 + 10 * i as u64);
    }
}

/// A decoder block's input gradient delivered to its concatenation's parts in one call, against
/// the three calls it replaces (`common::check_gn_cat_in`).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn gn_cat_in_parity() {
    let gs = gpus();
    for g in &gs {
        let (up, down) = (|v: &[f32], d: Dims| act(g, v, d), |b: &Buf, d: Dims| get_act(g, b, d));
        let (upr, downr) = (|v: &[f32]| raw(g, v), |b: &Buf| get_raw(g, b));
        let upw = |v: &[f32], shape: &[usize]| param(g, v, shape);
        let tol = mm_frac(g).max(1e-5);
        common::check_gn_cat_in(g, &rnd, (&up, &down), (&upr, &downr), &upw, &check, tol, &name(g));
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn silu_parity() {
    let gs = gpus();
    let cpu = Cpu::new();
    let n = ODD.numel();
    let x = rnd(n, 1, 3.0);
    let dy = rnd(n, 2, 1.0);
    let d0 = rnd(n, 3, 1.0);
    let mut y = vec![0f32; n];
    cpu.silu_forward(&mut y, &x);
    for acc in [Accum::Overwrite, Accum::Add] {
        let mut dx = d0.clone();
        cpu.silu_backward((&mut dx, acc), &dy, &x);
        for g in &gs {
            let (xg, dyg) = (raw(g, &x), raw(g, &dy));
            let mut yg = g.alloc(n).unwrap();
            g.silu_forward(&mut yg, &xg);
            check(&format!("silu [{}]", name(g)), &get_raw(g, &yg), &y, 1e-5);
            let mut dxg = raw(g, &d0);
            g.silu_backward((&mut dxg, acc), &dyg, &xg);
            check(&format!("silu bwd {acc:?} [{}]", name(g)), &get_raw(g, &dxg), &dx, 1e-5);
        }
    }
}

// ---- linear and attention ----------------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn linear_parity() {
    let gs = gpus();
    let cpu = Cpu::new();
    // up to 8 rows one launch each way (kernels/linear.cu linear_rows_*), 9 on cuBLAS
    let cases = [
        (2, 64, 256, Some(Accum::Overwrite)),
        (3, 37, 19, Some(Accum::Add)),
        (1, 256, 256, None),
        (8, 300, 70, Some(Accum::Add)),
        (9, 40, 33, Some(Accum::Overwrite)),
    ];
    for (n, i, o, acc) in cases {
        let x = rnd(n * i, 1, 1.0);
        let w = rnd(o * i, 2, 1.0 / (i as f32).sqrt());
        let b = rnd(o, 3, 1.0);
        let dy = rnd(n * o, 4, 1.0);
        let (dw0, db0, dx0) = (rnd(o * i, 5, 1.0), rnd(o, 6, 1.0), rnd(n * i, 7, 1.0));
        let mut y = vec![0f32; n * o];
        cpu.linear_forward(&mut y, &x, &w, &b, n, i, o);
        let (mut dw, mut db, mut dx) = (dw0.clone(), db0.clone(), dx0.clone());
        cpu.linear_backward(acc.map(|a| (&mut dx, a)), &mut dw, &mut db, &dy, &x, &w, n, i, o);
        for g in &gs {
            let tag = format!("linear {n}x{i}->{o} {acc:?} [{}]", name(g));
            let (xg, wg, bg, dyg) = (raw(g, &x), raw(g, &w), raw(g, &b), raw(g, &dy));
            let mut yg = g.alloc(n * o).unwrap();
            g.linear_forward(&mut yg, &xg, &wg, &bg, n, i, o);
            check(&format!("{tag} y"), &get_raw(g, &yg), &y, mm_frac(g));
            let (mut dwg, mut dbg, mut dxg) = (raw(g, &dw0), raw(g, &db0), raw(g, &dx0));
            g.linear_backward(acc.map(|a| (&mut dxg, a)), &mut dwg, &mut dbg, &dyg, &xg, &wg, n, i, o);
            check(&format!("{tag} dw+="), &get_raw(g, &dwg), &dw, mm_frac(g));
            check(&format!("{tag} db+="), &get_raw(g, &dbg), &db, 1e-5);
            check(&format!("{tag} dx"), &get_raw(g, &dxg), &dx, mm_frac(g));
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn attention_parity() {
    let gs = gpus();
    let cpu = Cpu::new();
    // softmax paths: rows in registers (T % 4 == 0; 256 threads, or 512 for 12,544 keys), the
    // general kernel with its shared-memory row cache (105 keys) and without (12,289 keys)
    let cases = [
        (Dims::new(2, 12, 3, 4, 5), 1),
        (Dims::new(1, 64, 4, 4, 4), 2),
        (Dims::new(1, 256, 8, 8, 8), 1),
        (Dims::new(1, 6, 3, 5, 7), 1),
        (Dims::new(1, 8, 16, 16, 49), 1),
        (Dims::new(1, 4, 1, 1, 12289), 1),
    ];
    for (x, heads) in cases {
        let q3 = x.with_c(3 * x.c);
        let qkv = rnd(q3.numel(), 1, 1.0);
        let dy = rnd(x.numel(), 2, 1.0);
        let t = x.s();
        let alen = x.n * heads * t * t;
        let (mut out, mut att) = (vec![0f32; x.numel()], vec![0f32; alen]);
        cpu.attention_forward(&mut out, &mut att, &qkv, x, heads);
        let (mut dqkv, mut datt) = (vec![0f32; q3.numel()], vec![0f32; alen]);
        cpu.attention_backward(&mut dqkv, &mut datt, &dy, &qkv, &att, x, heads);
        for g in &gs {
            let tag = format!("attention {x} heads {heads} [{}]", name(g));
            let (qg, dyg) = (act(g, &qkv, q3), act(g, &dy, x));
            let (mut og, mut ag) = (g.alloc(x.numel()).unwrap(), g.alloc(alen).unwrap());
            g.attention_forward(&mut og, &mut ag, &qg, x, heads);
            check(&format!("{tag} att"), &get_raw(g, &ag), &att, mm_frac(g).max(1e-4));
            check(&format!("{tag} out"), &get_act(g, &og, x), &out, mm_frac(g));
            let (mut dqg, mut dag) = (raw(g, &rnd(q3.numel(), 9, 1.0)), g.alloc(alen).unwrap());
            g.attention_backward(&mut dqg, &mut dag, &dyg, &qg, &ag, x, heads);
            check(&format!("{tag} dqkv"), &get_act(g, &dqg, q3), &dqkv, mm_frac(g) * 2.0);
        }
    }
}

// ---- resampling and plumbing ---------------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn upsample_parity() {
    let gs = gpus();
    let cpu = Cpu::new();
    for x in [
        ODD,
        Dims::new(1, 3, 1, 2, 3),
        Dims::new(1, 64, 8, 8, 8),
        Dims::new(1, 16, 3, 1, 5),
        Dims::new(1, 128, 1, 2, 97),
        Dims::new(1, 256, 1, 2, 60),
        Dims::new(1, 1028, 1, 1, 2),
    ] {
        // odd D, H, W, D = 1, H = 1; the forward per voxel for the last two (its four rows of f32
        // past 227 KB of shared memory; 257 channel vectors a voxel, past the 256 threads of a
        // block), the backward per voxel for the 97- and 60-wide ones (two rows of f32 past 48 KB)
        let u = x.up2();
        let xin = rnd(x.numel(), 1, 1.0);
        let dy = rnd(u.numel(), 2, 1.0);
        let d0 = rnd(x.numel(), 3, 1.0);
        let mut y = vec![0f32; u.numel()];
        cpu.upsample_forward(&mut y, &xin, x);
        for acc in [Accum::Overwrite, Accum::Add] {
            let mut dx = d0.clone();
            cpu.upsample_backward((&mut dx, acc), &dy, x);
            for g in &gs {
                let mut yg = g.alloc(u.numel()).unwrap();
                g.upsample_forward(&mut yg, &act(g, &xin, x), x);
                check(&format!("upsample {x} [{}]", name(g)), &get_act(g, &yg, u), &y, 1e-6);
                let mut dxg = act(g, &d0, x);
                g.upsample_backward((&mut dxg, acc), &act(g, &dy, u), x);
                check(&format!("upsample bwd {x} {acc:?} [{}]", name(g)), &get_act(g, &dxg, x), &dx, 1e-6);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn plumbing_parity() {
    let gs = gpus();
    let cpu = Cpu::new();
    let x = ODD;
    let (ca, cb) = (3, 4);
    let (xa, xb, xo) = (x.with_c(ca), x.with_c(cb), x.with_c(ca + cb));
    let a = rnd(xa.numel(), 1, 1.0);
    let b = rnd(xb.numel(), 2, 1.0);
    let dout = rnd(xo.numel(), 3, 1.0);
    let bias = rnd(x.n * x.c, 4, 1.0);
    let xs = rnd(x.numel(), 5, 1.0);
    let mut cat = vec![0f32; xo.numel()];
    cpu.concat_channels(&mut cat, &a, &b, x, ca, cb);
    // with a bias on the first part (the upsampling conv's, `concat_channels_bias`)
    let abias = rnd(ca, 16, 1.0);
    let mut catb = vec![0f32; xo.numel()];
    cpu.concat_channels_bias(&mut catb, &a, Some(&abias), &b, x, ca, cb);
    let (da0, db0) = (rnd(xa.numel(), 6, 1.0), rnd(xb.numel(), 7, 1.0));
    let (mut da, mut db) = (da0.clone(), db0.clone());
    cpu.split_channels((&mut da, Accum::Add), (&mut db, Accum::Overwrite), &dout, x, ca, cb);
    let mut xb_c = xs.clone();
    cpu.add_channel_bias(&mut xb_c, &bias, x);
    // out = x + bias[c] out of place
    let bias_c = rnd(x.c, 10, 1.0);
    let mut xbc_c = vec![0f32; x.numel()];
    cpu.add_channel_bias_to(&mut xbc_c, &xs, &bias_c, x);
    let mut cs = vec![0f32; x.n * x.c];
    cpu.channel_sum(&mut cs, &xs, x);
    let big = Dims::new(2, 68, 16, 17, 18);
    let xbig = rnd(big.numel(), 8, 1.0);
    let mut cs_big = vec![0f32; big.n * big.c];
    cpu.channel_sum(&mut cs_big, &xbig, big);
    let mut added = xs.clone();
    cpu.add_assign(&mut added, &xb_c);
    let mut scaled = xs.clone();
    cpu.scale(&mut scaled, -0.37);
    for g in &gs {
        let t = name(g);
        let mut catg = g.alloc(xo.numel()).unwrap();
        g.concat_channels(&mut catg, &act(g, &a, xa), &act(g, &b, xb), x, ca, cb);
        check(&format!("concat [{t}]"), &get_act(g, &catg, xo), &cat, 1e-6);
        g.concat_channels_bias(&mut catg, &act(g, &a, xa), Some(&raw(g, &abias)), &act(g, &b, xb), x, ca, cb);
        check(&format!("concat + a bias [{t}]"), &get_act(g, &catg, xo), &catb, 1e-6);
        let (mut dag, mut dbg) = (act(g, &da0, xa), act(g, &db0, xb));
        g.split_channels((&mut dag, Accum::Add), (&mut dbg, Accum::Overwrite), &act(g, &dout, xo), x, ca, cb);
        check(&format!("split a (add) [{t}]"), &get_act(g, &dag, xa), &da, 1e-6);
        check(&format!("split b (overwrite) [{t}]"), &get_act(g, &dbg, xb), &db, 1e-6);
        let mut xg = act(g, &xs, x);
        g.add_channel_bias(&mut xg, &raw(g, &bias), x);
        check(&format!("add_channel_bias [{t}]"), &get_act(g, &xg, x), &xb_c, 1e-6);
        let mut og = act(g, &rnd(x.numel(), 13, 1.0), x);
        g.add_channel_bias_to(&mut og, &act(g, &xs, x), &raw(g, &bias_c), x);
        check(&format!("add_channel_bias_to [{t}]"), &get_act(g, &og, x), &xbc_c, 1e-6);
        common::check_bias_vector_ops(g, &cpu, &rnd, &t);
        let (up, down) = (|v: &[f32], d: Dims| act(g, v, d), |b: &Buf, d: Dims| get_act(g, b, d));
        let (upr, downr) = (|v: &[f32]| raw(g, v), |b: &Buf| get_raw(g, b));
        common::check_concat_stats(g, &cpu, &rnd, (&up, &down), (&upr, &downr), &check, (1e-6, 1e-5), &t);
        let mut csg = raw(g, &rnd(x.n * x.c, 9, 1.0));
        g.channel_sum(&mut csg, &act(g, &xs, x), x);
        check(&format!("channel_sum [{t}]"), &get_raw(g, &csg), &cs, 1e-5);
        let mut csg = g.alloc(big.n * big.c).unwrap();
        g.channel_sum(&mut csg, &act(g, &xbig, big), big);
        check(&format!("channel_sum {big} [{t}]"), &get_raw(g, &csg), &cs_big, 1e-5);
        let mut ag = act(g, &xs, x);
        g.add_assign(&mut ag, &xg);
        check(&format!("add_assign [{t}]"), &get_act(g, &ag, x), &added, 1e-6);
        let mut sg = act(g, &xs, x);
        g.scale(&mut sg, -0.37);
        check(&format!("scale [{t}]"), &get_act(g, &sg, x), &scaled, 1e-6);
    }
}

// ---- loss, diffusion, optimiser ------------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn loss_parity() {
    let gs = gpus();
    let cpu = Cpu::new();
    let x = Dims::new(2, 1, 20, 21, 22);
    let p = rnd(x.numel(), 1, 1.0);
    let mut t = rnd(x.numel(), 2, 1.0);
    t[5] = p[5]; // a zero difference: L1's gradient there is 0
    for kind in [LossKind::L1, LossKind::L2] {
        let mut l = vec![0f32; 1];
        cpu.loss_forward(&mut l, &p, &t, kind);
        let mut d = vec![0f32; x.numel()];
        cpu.loss_backward(&mut d, &p, &t, kind, 0.25);
        for g in &gs {
            let (pg, tg) = (act(g, &p, x), act(g, &t, x));
            let mut lg = g.alloc(1).unwrap();
            g.loss_forward(&mut lg, &pg, &tg, kind);
            check(&format!("loss {kind:?} [{}]", name(g)), &get_raw(g, &lg), &l, 1e-5);
            let mut dg = g.alloc(x.numel()).unwrap();
            g.loss_backward(&mut dg, &pg, &tg, kind, 0.25);
            check(&format!("loss bwd {kind:?} [{}]", name(g)), &get_act(g, &dg, x), &d, 1e-6);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn randn_matches_cpu_philox() {
    let gs = gpus();
    let cpu = Cpu::new();
    let x = Dims::new(2, 3, 17, 18, 19);
    let rng = meddpm::rng::Philox::new(0xDEAD_BEEF_1234, 7);
    let offset = (1u64 << 33) + 5; // exercises the counter's high word
    let mut want = vec![0f32; x.numel()];
    cpu.randn(&mut want, rng, offset, x);
    for g in &gs {
        let mut b = g.alloc(x.numel()).unwrap();
        g.randn(&mut b, rng, offset, x);
        let got = get_act(g, &b, x);
        let mut differ = 0usize;
        for (i, (&a, &w)) in got.iter().zip(&want).enumerate() {
            if a.to_bits() != w.to_bits() {
                differ += 1;
                let ulps = (a.to_bits() as i64 - w.to_bits() as i64).abs();
                assert!(ulps <= 1, "randn [{}] element {i}: gpu {a:e} cpu {w:e} ({ulps} ulp)", name(g));
            }
        }
        println!("randn [{}]: {differ} of {} draws differ by 1 ulp, the rest are bit-identical", name(g), got.len());
        assert!(differ * 10_000 <= got.len(), "too many 1-ulp differences: {differ}");
    }
}

/// The training input in one pass (CUDA's q_sample_input) against the CPU's three calls (randn,
/// q_sample, concat_channels): the draws as `randn_matches_cpu_philox` allows (a rare 1-ulp
/// difference), x_t within f32 rounding, the condition channels copied exactly; 18 samples (two
/// launches), two image channels (the layouts' index maps).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn q_sample_input_parity() {
    let gs = gpus();
    let cpu = Cpu::new();
    let (x, cc) = (Dims::new(18, 2, 3, 4, 5), 3);
    let (xi, xc) = (x.with_c(x.c + cc), x.with_c(cc));
    let x0 = rnd(x.numel(), 1, 0.8);
    let cond = rnd(xc.numel(), 2, 1.0);
    let a: Vec<f32> = (0..x.n).map(|i| 0.99 - 0.05 * i as f32).collect();
    let b: Vec<f32> = a.iter().map(|v| (1.0 - v * v).max(0.0).sqrt()).collect();
    let rng = meddpm::rng::Philox::new(0x5EED, 3);
    let offset = (1u64 << 32) + 11;
    let (mut inp, mut eps, mut xt) = (vec![0f32; xi.numel()], vec![0f32; x.numel()], vec![0f32; x.numel()]);
    cpu.q_sample_input(&mut inp, (&mut eps, &mut xt), (&x0, &cond), rng, offset, (&a, &b), x, cc);
    for g in &gs {
        let (x0g, cg) = (act(g, &x0, x), act(g, &cond, xc));
        let (mut ig, mut eg, mut tg) =
            (g.alloc(xi.numel()).unwrap(), g.alloc(x.numel()).unwrap(), g.alloc(x.numel()).unwrap());
        g.q_sample_input(&mut ig, (&mut eg, &mut tg), (&x0g, &cg), rng, offset, (&a, &b), x, cc);
        let tag = name(g);
        let ge = get_act(g, &eg, x);
        let far = ge.iter().zip(&eps).filter(|(p, q)| (p.to_bits() as i64 - q.to_bits() as i64).abs() > 1).count();
        assert_eq!(far, 0, "q_sample_input [{tag}]: draws more than 1 ulp from the CPU's");
        let gi = get_act(g, &ig, xi);
        check(&format!("q_sample_input [{tag}] input"), &gi, &inp, 1e-6);
        let cond_got: Vec<f32> =
            (0..x.n).flat_map(|n| gi[(n * xi.c + x.c) * x.s()..(n + 1) * xi.c * x.s()].to_vec()).collect();
        assert!(cond_got == cond, "q_sample_input [{tag}]: condition channels not copied exactly");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn diffusion_parity() {
    let gs = gpus();
    let cpu = Cpu::new();
    let x = Dims::new(18, 1, 3, 4, 5); // more than 16 samples: two launches
    let x0 = rnd(x.numel(), 1, 0.8);
    let eps = rnd(x.numel(), 2, 1.0);
    let z = rnd(x.numel(), 3, 1.0);
    let a: Vec<f32> = (0..x.n).map(|i| 0.99 - 0.05 * i as f32).collect();
    let b: Vec<f32> = a.iter().map(|v| (1.0 - v * v).sqrt()).collect();
    let coefs: Vec<meddpm::backend::DdpmCoefs> = (0..x.n)
        .map(|i| meddpm::backend::DdpmCoefs {
            recip: 1.0 + 0.1 * i as f32,
            recipm1: 0.3 + 0.02 * i as f32,
            coef1: 0.2,
            coef2: 0.7,
            sigma: if i == 0 { 0.0 } else { 0.1 },
        })
        .collect();
    let mut xt = vec![0f32; x.numel()];
    cpu.q_sample(&mut xt, &x0, &eps, &a, &b, x);
    let mut xs = x0.clone();
    cpu.ddpm_step(&mut xs, &eps, &z, &coefs, x);
    for g in &gs {
        let (x0g, eg, zg) = (act(g, &x0, x), act(g, &eps, x), act(g, &z, x));
        let mut xtg = g.alloc(x.numel()).unwrap();
        g.q_sample(&mut xtg, &x0g, &eg, &a, &b, x);
        check(&format!("q_sample [{}]", name(g)), &get_act(g, &xtg, x), &xt, 1e-6);
        let mut xsg = act(g, &x0, x);
        g.ddpm_step(&mut xsg, &eg, &zg, &coefs, x);
        check(&format!("ddpm_step [{}]", name(g)), &get_act(g, &xsg, x), &xs, 1e-5);
    }
}

/// `sampler_step` (every sampler's update) in both layouts: data / noise prediction, with and
/// without clipping, with 0, 1 and 3 history buffers, more than 16 samples (two launches), C = 2
/// (the noise index must be the logical NCDHW one in NDHWC too), zero coefficients that skip a
/// term, and per-sample noise streams; then the x_T draw (only cz) over a NaN x.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn sampler_step_parity() {
    use meddpm::backend::{Prediction, SamplerCoefs};
    use meddpm::rng::Philox;
    let gs = gpus();
    let cpu = Cpu::new();
    let x = Dims::new(18, 2, 3, 4, 5);
    let x0 = rnd(x.numel(), 11, 1.2);
    let eps = rnd(x.numel(), 12, 1.0);
    let hist0: Vec<Vec<f32>> = (0..3).map(|k| rnd(x.numel(), 13 + k, 1.0)).collect();
    let coefs: Vec<SamplerCoefs> = (0..x.n)
        .map(|i| SamplerCoefs {
            recip: 1.0 + 0.05 * i as f32,
            recipm1: 0.4 + 0.03 * i as f32,
            cx: if i % 5 == 3 { 0.0 } else { 0.8 },
            cd: 0.3 - 0.01 * i as f32,
            ch: [0.2, if i % 4 == 1 { 0.0 } else { -0.15 }, 0.05],
            cz: if i % 3 == 0 { 0.0 } else { 0.1 },
            noise: Philox::new(100 + i as u64, 3),
            offset: (i as u64 + 1) * 7919 + (1 << 33),
        })
        .collect();
    for nh in [0usize, 1, 3] {
        for pred in [Prediction::Data, Prediction::Noise] {
            for clip in [false, true] {
                let mut xs = x0.clone();
                let mut hs: Vec<Vec<f32>> = hist0[..nh].to_vec();
                cpu.sampler_step(&mut xs, &eps, &mut hs, pred, clip, &coefs, x);
                for g in &gs {
                    let what = format!("sampler_step nh={nh} {pred:?} clip={clip} [{}]", name(g));
                    let mut xg = act(g, &x0, x);
                    let eg = act(g, &eps, x);
                    let mut hg: Vec<_> = hist0[..nh].iter().map(|h| act(g, h, x)).collect();
                    g.sampler_step(&mut xg, &eg, &mut hg, pred, clip, &coefs, x);
                    check(&what, &get_act(g, &xg, x), &xs, 1e-5);
                    for (k, (hgk, hk)) in hg.iter().zip(&hs).enumerate() {
                        check(&format!("{what} history {k}"), &get_act(g, hgk, x), hk, 1e-5);
                    }
                }
            }
        }
    }
    let only_z: Vec<SamplerCoefs> =
        coefs.iter().map(|c| SamplerCoefs { cx: 0.0, cd: 0.0, ch: [0.0; 3], cz: 1.0, ..*c }).collect();
    let nan = vec![f32::NAN; x.numel()];
    let mut want = nan.clone();
    cpu.sampler_step(&mut want, &eps, &mut [], Prediction::Data, true, &only_z, x);
    assert!(want.iter().all(|v| v.is_finite()));
    for g in &gs {
        let mut xg = act(g, &nan, x);
        let eg = act(g, &eps, x);
        g.sampler_step(&mut xg, &eg, &mut [], Prediction::Data, true, &only_z, x);
        let got = get_act(g, &xg, x);
        for (i, (&a, &w)) in got.iter().zip(&want).enumerate() {
            let ulps = (a.to_bits() as i64 - w.to_bits() as i64).abs();
            assert!(ulps <= 1, "sampler_step x_T [{}] element {i}: gpu {a:e} cpu {w:e}", name(g));
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn optimiser_parity() {
    let gs = gpus();
    let cpu = Cpu::new();
    let n = 1000;
    let p0 = rnd(n, 1, 1.0);
    let grad = rnd(n, 2, 0.1);
    let m0 = rnd(n, 3, 0.01);
    let v0: Vec<f32> = rnd(n, 4, 0.01).iter().map(|v| v * v).collect();
    let h = meddpm::backend::AdamStep { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, t: 7 };
    let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
    cpu.adam_step(&mut p, &grad, &mut m, &mut v, h);
    let mut ema = p0.clone();
    cpu.ema_update(&mut ema, &grad, 0.995);
    for g in &gs {
        let (mut pg, mut mg, mut vg) = (raw(g, &p0), raw(g, &m0), raw(g, &v0));
        g.adam_step(&mut pg, &raw(g, &grad), &mut mg, &mut vg, h);
        let dp = |q: &[f32]| q.iter().zip(&p0).map(|(a, b)| a - b).collect::<Vec<f32>>();
        check(&format!("adam update [{}]", name(g)), &dp(&get_raw(g, &pg)), &dp(&p), 1e-4);
        check(&format!("adam m [{}]", name(g)), &get_raw(g, &mg), &m, 1e-5);
        check(&format!("adam v [{}]", name(g)), &get_raw(g, &vg), &v, 1e-5);
        let mut eg = raw(g, &p0);
        g.ema_update(&mut eg, &raw(g, &grad), 0.995);
        check(&format!("ema [{}]", name(g)), &get_raw(g, &eg), &ema, 1e-6);
    }
}

// ---- whole network ----------------------------------------------------------------------------------

/// Whole-network tolerance: per element `frac`·rms (and relative `frac`), and for the whole
/// tensor ‖gpu − cpu‖ / ‖cpu‖ ≤ `l2`. TF32 rounding compounds through ~40 layers and GroupNorms:
/// single elements can move by several % of the tensor's RMS while the tensor as a whole stays
/// within about 1 %; a layout or indexing bug moves both by O(1).
fn net_tol(g: &CudaBackend) -> (f64, f64) {
    match g.precision() {
        Precision::Fp32 => (2e-3, 2e-4),
        Precision::Tf32 => (0.5, 0.15),
        Precision::Bf16 | Precision::Fp8 => unreachable!("bf16 and fp8 have their own parity tests"),
    }
}

fn net_frac(g: &CudaBackend) -> f64 {
    net_tol(g).0
}

fn check_net(what: &str, got: &[f32], want: &[f32], g: &CudaBackend) {
    let (frac, l2) = net_tol(g);
    check(what, got, want, frac);
    let rel = meddpm::testing::rel_l2(got, want);
    println!("  relative L2 error {rel:.2e} (limit {l2:.0e})");
    assert!(rel <= l2, "{what}: relative L2 error {rel:.3e} > {l2:.0e}");
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn unet_forward_backward_parity() {
    use meddpm::model::{UNet, UNetConfig};
    let gs = gpus();
    let cpu = Cpu::new();
    let cfg = UNetConfig::tiny();
    let batch = 2;
    let mut net_c = UNet::new(&cpu, &cfg, batch).unwrap();
    let host: Vec<Vec<f32>> =
        net_c.specs.iter().enumerate().map(|(i, s)| rnd(s.numel(), 1000 + i as u64, 0.2)).collect();
    net_c.set_params(&cpu, &host).unwrap();
    let xin = rnd(net_c.input_dims().numel(), 11, 1.0);
    let r = rnd(net_c.output_dims().numel(), 12, 1.0);
    let t = [3.0f32, 171.0];
    cpu.upload(&xin, net_c.input_mut());
    net_c.forward(&cpu, &t);
    let out_c = net_c.output().clone();
    cpu.upload(&r, net_c.output_and_grad().1);
    net_c.zero_grads(&cpu);
    net_c.backward(&cpu);
    let grads_c = net_c.host_tensors(&cpu, true);
    for g in &gs {
        let mut net = UNet::new(g, &cfg, batch).unwrap();
        net.set_params(g, &host).unwrap();
        let (xd, od) = (net.input_dims(), net.output_dims());
        g.upload_act(&xin, xd, net.input_mut());
        net.forward(g, &t);
        let out = get_act(g, net.output(), od);
        check_net(&format!("unet tiny forward [{}]", name(g)), &out, &out_c, g);
        g.upload_act(&r, od, net.output_and_grad().1);
        net.zero_grads(g);
        net.backward(g);
        let grads = net.host_tensors(g, true);
        for ((s, gg), gc) in net.specs.iter().zip(&grads).zip(&grads_c) {
            check_net(&format!("unet tiny grad {} [{}]", s.key, name(g)), gg, gc, g);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn one_training_step_parity() {
    use meddpm::diffusion::{TrainConfig, Trainer};
    use meddpm::model::UNetConfig;
    let gs = gpus();
    let cpu = Cpu::new();
    let cfg = UNetConfig::tiny();
    let tc = TrainConfig { lr: 1e-3, seed: 17, batch: 2, grad_accum: 1, ..TrainConfig::default() };
    let (mut img, mut cond) = (Vec::new(), Vec::new());
    for v in 0..tc.batch as u32 {
        let (i, c) = meddpm::phantom::pair(cfg.depth, cfg.size, cfg.size, v);
        img.extend(i);
        cond.extend(c);
    }
    let mut tr_c = Trainer::new(&cpu, &cfg, &tc).unwrap();
    // random (not zero-initialised) weights so that every gradient is non-trivial
    let host: Vec<Vec<f32>> =
        tr_c.net.specs.iter().enumerate().map(|(i, s)| rnd(s.numel(), 2000 + i as u64, 0.2)).collect();
    tr_c.net.set_params(&cpu, &host).unwrap();
    let loss_c = tr_c.micro_step(&cpu, &img, &cond);
    let grads_c = tr_c.net.host_tensors(&cpu, true);
    tr_c.opt_step(&cpu);
    let params_c = tr_c.net.host_tensors(&cpu, false);
    for g in &gs {
        let mut tr = Trainer::new(g, &cfg, &tc).unwrap();
        tr.net.set_params(g, &host).unwrap();
        let loss = tr.micro_step(g, &img, &cond);
        check(&format!("train step loss [{}]", name(g)), &[loss], &[loss_c], net_tol(g).1);
        let grads = tr.net.host_tensors(g, true);
        for ((s, gg), gc) in tr.net.specs.iter().zip(&grads).zip(&grads_c) {
            check_net(&format!("train step grad {} [{}]", s.key, name(g)), gg, gc, g);
        }
        tr.opt_step(g);
        let params = tr.net.host_tensors(g, false);
        // Adam's first step moves each weight by about ±lr·sign(g); compare the moves where the
        // gradient is clearly larger than the gradient tolerance (below it the sign is noise).
        for (i, s) in tr.net.specs.iter().enumerate() {
            let (mut got, mut want) = (Vec::new(), Vec::new());
            let floor = (3.0 * net_frac(g) * rms(&grads_c[i])) as f32 + 1e-7;
            for j in 0..s.numel() {
                if grads_c[i][j].abs() > floor {
                    got.push(params[i][j] - host[i][j]);
                    want.push(params_c[i][j] - host[i][j]);
                }
            }
            check(&format!("train step update {} [{}]", s.key, name(g)), &got, &want, net_frac(g));
        }
    }
}

// ---- multi-tensor optimizer and graph replay ---------------------------------------------------------

/// The one-launch optimizer ops against the CPU's per-tensor ones, on tensors whose sizes straddle
/// the kernels' 4096-element blocks (the table lookup of each block).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn multi_tensor_optimizer_parity() {
    let gs = gpus();
    let cpu = Cpu::new();
    let sizes = [1usize, 4095, 4096, 4097, 10_000, 3];
    let host = |s: u64| sizes.iter().enumerate().map(|(i, &n)| rnd(n, s + i as u64, 1.0)).collect::<Vec<_>>();
    let (p0, g0, m0) = (host(10), host(20), host(30));
    let v0: Vec<Vec<f32>> = host(40).into_iter().map(|v| v.iter().map(|x| x * x).collect()).collect();
    let h = meddpm::backend::AdamStep { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, t: 3 };
    let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
    let mut g = g0.clone();
    cpu.adam_step_all(&mut p, &mut g, &mut m, &mut v, h, true);
    assert!(g.iter().all(|t| t.iter().all(|&x| x == 0.0)), "CPU zeroes the gradients");
    let e0 = host(50);
    let mut e = e0.clone();
    cpu.ema_update_all(&mut e, &p, 0.995);
    for gb in &gs {
        let up = |v: &[Vec<f32>]| v.iter().map(|h| raw(gb, h)).collect::<Vec<_>>();
        let down = |v: &[<CudaBackend as Backend>::Buf]| v.iter().map(|b| get_raw(gb, b)).collect::<Vec<_>>();
        let (mut pg, mut gg, mut mg, mut vg) = (up(&p0), up(&g0), up(&m0), up(&v0));
        gb.adam_step_all(&mut pg, &mut gg, &mut mg, &mut vg, h, true);
        for (i, ((a, b), n)) in down(&pg).iter().zip(&p).zip(sizes).enumerate() {
            let inc = |x: &[f32]| x.iter().zip(&p0[i]).map(|(a, b)| a - b).collect::<Vec<f32>>();
            check(&format!("adam_step_all p[{i}] ({n}) [{}]", name(gb)), &inc(a), &inc(b), 1e-4);
        }
        for (i, (a, b)) in down(&mg).iter().zip(&m).enumerate() {
            check(&format!("adam_step_all m[{i}] [{}]", name(gb)), a, b, 1e-5);
        }
        for (i, (a, b)) in down(&vg).iter().zip(&v).enumerate() {
            check(&format!("adam_step_all v[{i}] [{}]", name(gb)), a, b, 1e-5);
        }
        assert!(down(&gg).iter().all(|t| t.iter().all(|&x| x == 0.0)), "gradients zeroed [{}]", name(gb));
        let mut eg = up(&e0);
        gb.ema_update_all(&mut eg, &pg, 0.995);
        for (i, (a, b)) in down(&eg).iter().zip(&e).enumerate() {
            check(&format!("ema_update_all [{i}] [{}]", name(gb)), a, b, 1e-6);
        }
        gb.ema_update_all(&mut eg, &pg, 0.0);
        assert_eq!(down(&eg), down(&pg), "decay 0 copies exactly [{}]", name(gb));
        // type conversion of every tensor in one launch
        let mut lo: Vec<_> = sizes.iter().map(|&n| gb.alloc_act(n).unwrap()).collect();
        let mut pairs: Vec<_> = lo.iter_mut().zip(&pg).collect();
        gb.cast_all(&mut pairs);
        assert_eq!(down(&lo), down(&pg), "cast_all to the same type [{}]", name(gb));
    }
}

/// U-Net passes replayed as CUDA graphs give what plain launches give: the same outputs for new
/// inputs and timesteps each call (the graph reads the buffers the host filled), the same
/// gradients, and after an optimizer step and a swap to the EMA weights (a second buffer set).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn graph_replay_matches_plain_launches() {
    use meddpm::diffusion::{TrainConfig, Trainer};
    use meddpm::model::UNetConfig;
    let gs = gpus();
    let cfg = UNetConfig::tiny();
    let tc = TrainConfig { lr: 1e-4, seed: 5, batch: 2, grad_accum: 1, ema_start: 0, ..TrainConfig::default() };
    let (mut img, mut cond) = (Vec::new(), Vec::new());
    for v in 0..tc.batch as u32 {
        let (i, c) = meddpm::phantom::pair(cfg.depth, cfg.size, cfg.size, v);
        img.extend(i);
        cond.extend(c);
    }
    for g in &gs {
        // the same conv paths on both backends: no per-shape timing that could choose differently
        // (bias unfused, padding on, our few-channel kernels wherever a shape is theirs)
        let pin = |b: &CudaBackend| {
            b.set_choices(|c| c.fused_bias = Some(false));
            b.set_choices(|c| c.conv_pad = Some(true));
            b.set_choices(|c| c.small_conv = Some(true));
        };
        g.set_graphs(true);
        pin(g);
        let run = |be: &CudaBackend| {
            let mut tr = Trainer::new(be, &cfg, &tc).unwrap();
            let mut out = Vec::new();
            for step in 0..4 {
                // 4 micro-steps: warm-up, capture, two replays; each with its own t and noise
                let loss = tr.micro_step(be, &img, &cond);
                out.push(vec![loss]);
                out.extend(tr.net.host_tensors(be, true));
                tr.opt_step(be);
                if step == 2 {
                    // the EMA weights: another buffer set, its own graphs
                    let x = rnd(tr.net.input_dims().numel(), 77, 1.0);
                    let t = vec![31.0f32; tc.batch];
                    let o = tr.with_ema(|net| {
                        be.upload_act(&x, net.input_dims(), net.input_mut());
                        for _ in 0..3 {
                            net.forward(be, &t);
                        }
                        get_act(be, net.output(), net.output_dims())
                    });
                    out.push(o);
                }
            }
            out
        };
        // the plain backend is made after the graphed one has run: it reads the cuDNN algorithms
        // that one found from the disk cache, so both run the same conv paths (made first, on a
        // fresh cache, it found its own, and a near-tied different algorithm once put one weight
        // gradient element of a TF32 run just past the tolerance)
        let a = run(g);
        let plain = CudaBackend::new(0, g.precision(), g.layout()).unwrap();
        plain.set_graphs(false);
        pin(&plain);
        let b = run(&plain);
        assert_eq!(a.len(), b.len());
        // a replay of stale inputs, timesteps or weights differs by O(1); the tolerance only absorbs
        // non-deterministic cuDNN reductions amplified over four steps
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            check(&format!("graph replay vs plain, tensor {i} [{}]", name(g)), x, y, mm_frac(g));
        }
        g.set_choices(|c| c.fused_bias = None);
        g.set_choices(|c| c.conv_pad = None);
        g.set_choices(|c| c.small_conv = None);
    }
}

/// The power monitor (NVML) reads the GPU the backend runs on: a PCI bus id NVML knows, readings
/// every few ms while kernels run, an energy counter that moved, a clock within the device's range.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu/run.sh check runs it with --include-ignored"]
fn power_monitor_reads_the_gpu() {
    let gs = gpus();
    let g = &gs[0];
    let bus = g.pci_bus_id().expect("cuDeviceGetPCIBusId");
    let parts: Vec<&str> = bus.split([':', '.']).collect();
    assert!(
        parts.len() == 4 && parts.iter().all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_hexdigit())),
        "PCI bus id {bus}"
    );
    let m = g.power_monitor(std::time::Duration::from_millis(5)).expect("NVML (libnvidia-ml.so.1) on a GPU machine");
    // ~0.3 s of work: elementwise passes over a 64 MiB buffer
    let n = 16 << 20;
    let x = raw(g, &vec![1.0f32; n]);
    let mut y = raw(g, &vec![0.0f32; n]);
    let t0 = std::time::Instant::now();
    while t0.elapsed().as_secs_f64() < 0.3 {
        for _ in 0..20 {
            g.add_assign(&mut y, &x);
        }
        g.sync();
    }
    let p = m.stop().expect("readings");
    println!("power monitor over {:.2} s: {}", p.seconds, p.line(1));
    assert!(p.samples >= 10, "{} readings in {:.2} s", p.samples, p.seconds);
    let max = p.sm_mhz_max_clock.expect("max SM clock");
    assert!(
        p.sm_mhz_min > 0 && p.sm_mhz_median <= max,
        "SM clock {} .. {} of {max} MHz",
        p.sm_mhz_min,
        p.sm_mhz_median
    );
    // over 0.3 s of work the counter (updated every ~0.1 s or faster on recent GPUs) moves
    let mean = p.mean_power_w.expect("mean power from the energy counter");
    assert!(mean > 10.0 && p.max_power_w > 10.0, "power {mean} W mean, {} W max", p.max_power_w);
    assert!(p.energy_j.is_some_and(|e| e > 0.0));
    assert!(p.power_limit_w.is_some_and(|l| l > 50.0), "power limit {:?}", p.power_limit_w);
    assert!((0.0..=100.0).contains(&p.power_capped_pct));
}
