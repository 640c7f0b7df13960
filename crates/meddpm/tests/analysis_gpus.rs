//! The GPU table against independent data (the H200 device attributes ncu recorded on the
//! project's machine; FP32 peaks from SM count × FP32 lanes × 2 × clock), and the roofline model
//! against hand calculations and against real H200 convolution timings (`../shared/perf`).

use meddpm::analysis::gpus::{check, find, gpus, predict, Math, Verdict};
use meddpm::analysis::kernels::{Category, KernelRecord};
use meddpm::analysis::ncu::NcuData;
use meddpm::shape::{ConvShape, Dims};
use std::path::Path;

#[test]
fn h200_row_matches_the_device_attributes_ncu_read() {
    let raw = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/ncu/h200_conv_raw.csv");
    let d = NcuData::load(Some(&raw), None).unwrap();
    let k = &d.kernels[0];
    let a = |n: &str| k.metric(&format!("device__attribute_{n}")).unwrap();
    assert_eq!(k.metrics["device__attribute_display_name"].text, "NVIDIA H200");
    let h = find("NVIDIA H200").unwrap();
    assert_eq!(h.key, "h200");
    assert_eq!(h.sms, Some(a("multiprocessor_count") as u32));
    assert_eq!(h.boost_mhz, Some((a("clock_rate") / 1000.0) as u32)); // kHz
    assert_eq!(h.l2_mib, Some(a("l2_cache_size") / (1u64 << 20) as f64));
    // HBM: double data rate × bus width; memory_clock_rate is in kHz
    let gbps = 2.0 * a("memory_clock_rate") * 1e3 * a("global_memory_bus_width") / 8.0 / 1e9;
    assert!((gbps / h.mem_gbps - 1.0).abs() < 0.01, "{gbps} GB/s vs datasheet {}", h.mem_gbps);
}

#[test]
fn datasheet_fp32_peaks_follow_from_sms_and_clocks() {
    // FP32 lanes per SM: Volta and A100 64, Hopper and Ada 128
    for (key, lanes) in
        [("v100", 64.0), ("a100-40", 64.0), ("a100-80", 64.0), ("h100", 128.0), ("h200", 128.0), ("l40s", 128.0)]
    {
        let g = find(key).unwrap();
        let peak = g.sms.unwrap() as f64 * lanes * 2.0 * g.boost_mhz.unwrap() as f64 * 1e6 / 1e12;
        assert!((peak / g.fp32_tflops - 1.0).abs() < 0.01, "{key}: {peak} vs {}", g.fp32_tflops);
    }
    for g in gpus() {
        // tensor cores: bf16 is twice tf32 from Ampere on (datasheet rounding: L40S 183 / 362.05, B200 1,100 / 2,250)
        if let (Some(t), Some(b)) = (g.tf32_tflops, g.bf16_tflops) {
            assert!((b / t / 2.0 - 1.0).abs() < 0.03, "{}", g.key);
        }
        assert!(!g.source.is_empty() && g.source.contains("datasheet"));
    }
    let keys: Vec<&str> = gpus().iter().map(|g| g.key).collect();
    for k in ["v100", "a100-40", "a100-80", "h100", "h200", "l40s", "b200"] {
        assert!(keys.contains(&k), "{k}");
    }
    assert_eq!(find("NVIDIA A100-SXM4-80GB").unwrap().key, "a100-80");
    assert_eq!(find("NVIDIA A100-SXM4-40GB").unwrap().key, "a100-40");
    assert_eq!(find("Tesla V100-SXM2-32GB").unwrap().key, "v100");
    assert!(find("AMD Instinct MI300X").is_none());
}

fn conv_record(cs: ConvShape, ns: u64) -> KernelRecord {
    let mut r = KernelRecord::new("conv3d_fwd", ns);
    r.flops = Some(cs.flops());
    r.bytes = Some(4.0 * (cs.x.numel() + cs.out().numel() + cs.w_len() + cs.cout) as f64);
    r
}

#[test]
fn roofline_by_hand_and_against_h200_conv_timings() {
    let h = find("h200").unwrap();
    let cs = ConvShape::new(Dims::new(1, 64, 128, 128, 128), 64, 3, 1);
    // 463.86 GFLOP on 494.5 TFLOP/s = 0.938 ms; 1.07 GB on 4.8 TB/s = 0.224 ms: compute-bound
    let r = conv_record(cs, 0);
    let tf32 = h.roofline_ns(Category::ConvForward, Math::Tf32, r.flops.unwrap(), r.bytes.unwrap());
    assert!((tf32 - 463.856_467_968e9 / 494.5e12 * 1e9).abs() < 1.0, "{tf32}");
    let fp32 = h.roofline_ns(Category::ConvForward, Math::Fp32, r.flops.unwrap(), r.bytes.unwrap());
    assert!((fp32 - 463.856_467_968e9 / 67e12 * 1e9).abs() < 1.0);
    // the same bytes as an elementwise op are memory-bound whatever the math
    let e = h.roofline_ns(Category::Elementwise, Math::Tf32, 0.0, 4.8e9);
    assert!((e - 1e6).abs() < 1e-6);
    // measured on the H200 (../shared/perf/cudarc-conv3d-probe.log): TF32 NDHWC 1.767 ms, FMA
    // NCDHW 10.646 ms — slower than the bound, as they must be
    let c = check(tf32, 1.767e6, 0.05);
    assert_eq!(c.verdict, Verdict::Consistent);
    assert!((c.efficiency - 0.5309).abs() < 1e-3, "{}", c.efficiency);
    let c = check(fp32, 10.646e6, 0.05);
    assert_eq!(c.verdict, Verdict::Consistent);
    assert!((c.efficiency - 0.6503).abs() < 1e-3, "{}", c.efficiency);
    // a "measurement" faster than physics is flagged
    assert_eq!(check(tf32, 0.5e6, 0.05).verdict, Verdict::FasterThanRoofline);
    assert_eq!(check(0.0, 1.0, 0.05).verdict, Verdict::NotComparable);
    // V100 has no TF32: its conv roof stays FP32
    let v = find("v100").unwrap();
    assert_eq!(v.peak_tflops(Category::ConvForward, Math::Tf32), 15.7);
    assert_eq!(h.peak_tflops(Category::GemmAttention, Math::Bf16), 989.5);
    assert_eq!(h.peak_tflops(Category::Normalization, Math::Bf16), 67.0);
}

#[test]
fn predictions_sum_per_record_bounds() {
    // a compute-bound conv and a memory-bound small conv in one category: bounded one by one
    let big = conv_record(ConvShape::new(Dims::new(1, 64, 64, 64, 64), 64, 3, 1), 400_000);
    let small = conv_record(ConvShape::new(Dims::new(1, 3, 64, 64, 64), 1, 1, 1), 10_000);
    let mut gn = KernelRecord::new("groupnorm_stats", 50_000);
    gn.bytes = Some(4.8e6);
    let uncounted = KernelRecord::new("mystery", 7);
    let rs = vec![big.clone(), small.clone(), gn, uncounted];
    let table = gpus();
    let p = predict(&rs, &table, Math::Tf32);
    let h = find("h200").unwrap();
    let conv = p.iter().find(|c| c.category == Category::ConvForward).unwrap();
    let by_hand = big.flops.unwrap() / 494.5e12 * 1e9 + small.bytes.unwrap() / 4.8e12 * 1e9;
    assert!((conv.predicted_ns["h200"] - by_hand).abs() < 1e-6, "{} {by_hand}", conv.predicted_ns["h200"]);
    assert_eq!((conv.counted, conv.records, conv.measured_ns), (2, 2, 410_000.0));
    let norm = p.iter().find(|c| c.category == Category::Normalization).unwrap();
    assert!((norm.predicted_ns["h200"] - 1000.0).abs() < 1e-9); // 4.8 MB at 4.8 TB/s = 1 µs
    assert!((norm.predicted_ns["v100"] - 4.8e6 / 900e9 * 1e9).abs() < 1e-6);
    let other = p.iter().find(|c| c.category == Category::Other).unwrap();
    assert_eq!((other.counted, other.predicted_ns["h200"]), (0, 0.0));
    assert_eq!(h.ridge(Category::ConvForward, Math::Tf32), 494.5e12 / 4.8e12);
}
