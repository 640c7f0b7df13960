//! Kernel records: the name → category classifier on real kernel names (PyTorch's H200 profile
//! tables, the cudarc conv3d probe's CUPTI list, ncu exports) and on our NVRTC kernel names; the
//! demangler; the breakdown tables against hand-computed sums; the GPU idle time (busy, gaps,
//! outside, overlap, where the GPU waits) on a hand-drawn timeline; NCCL kernels as collectives
//! and their time hidden behind other kernels on a hand-drawn two-stream timeline; the PyTorch
//! table import against sums read off `../shared/perf` by hand.

use meddpm::analysis::breakdown::{breakdown, idle, GapRow, IDLE_GAPS, IDLE_OUTSIDE, IDLE_OVERLAP, IDLE_SPAN_EXCESS};
use meddpm::analysis::kernels::{classify, demangle, short_name, Category, KernelRecord, OUR_KERNELS};
use meddpm::analysis::torch::parse_table;
use std::path::{Path, PathBuf};

use Category::*;

#[test]
fn cudnn_and_pytorch_names_from_the_h200_profiles() {
    // (name as it appears — truncated where the table truncates — , category by hand)
    let cases: &[(&str, Category)] = &[
        ("void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float>(long, float, fl...", Normalization),
        ("void at::native::(anonymous namespace)::ComputeInternalGradientsCUDAKernel<float>(long,...", Normalization),
        ("void at::native::(anonymous namespace)::ComputeFusedParamsCUDAKernel<float>(long, long,...", Normalization),
        ("sm90_xmma_wgrad_indexed_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize64x64x32...", ConvWgrad),
        ("sm80_xmma_wgrad_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize64x64x6...", ConvWgrad),
        ("sm80_xmma_wgrad_implicit_gemm_indexed_wo_smem_tf32f32_tf32f32_f32_nhwckrsc_nhwc_tilesiz...", ConvWgrad),
        ("sm90_xmma_fprop_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x64x32_warpgr...", ConvForward),
        ("sm80_xmma_fprop_implicit_gemm_f32f32_f32f32_f32_nchwkcrs_nchw_tilesize256x64x8_stage3_w...", ConvForward),
        ("sm80_xmma_fprop_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize128x128...", ConvForward),
        ("sm90_xmma_dgrad_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x64x32_warpgr...", ConvDgrad),
        ("sm90_xmma_dgrad_implicit_gemm_indexed_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize256x64x3...", ConvDgrad),
        ("void cudnn::engines_precompiled::nchwToNhwcKernel<float, float, float, false, true, (cu...", Layout),
        ("void cudnn::engines_precompiled::nhwcToNchwKernel<float, float, float, true, false, (cu...", Layout),
        ("void tensorTransformGeneric<float, float, float, true, false, false, (cudnnKernelDataTy...", Layout),
        ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::nati...", Elementwise),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, s...", Elementwise),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::si...", Elementwise),
        ("void at::native::(anonymous namespace)::upsample_trilinear3d_backward_out_frame<float, ...", Elementwise),
        ("void at::native::(anonymous namespace)::upsample_trilinear3d_out_frame<float, float>(in...", Elementwise),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wra...", Reduction),
        ("sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n_tilesize128x128x32_warpgroupsize1x1x1_execute_se...", GemmAttention),
        ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_256x64_16x4_nn_align4>(cutlass_80_t...", GemmAttention),
        ("std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int, float, float, fl...", GemmAttention),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForwardReg<float, float, float, at:...", GemmAttention),
        ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 9, false, false>(...", GemmAttention),
        ("Memcpy DtoD (Device -> Device)", Memory),
        ("Memset (Device)", Memory),
        // CUPTI names from the cudarc probe (mangled and cut at 100 characters)
        ("_Z25implicit_convolveNd_sgemmIfLi3ELi1024ELi5ELi5ELi3ELi3ELi3ELi1ELb0ELb0ELb1EEviiiPKT_iPS0_S2_20kernel_convNd", ConvForward),
        ("_ZN8internal5gemvx6kernelIii6float2S2_S2_S2_Lb1ELb1ELb1ELb0ELi7ELb0E18cublasGemvParamsExIi30cublasGemvTensorSt", GemmAttention),
        ("_ZN8internal24region_transform_ABC_valIiLi32ELi32ELb0ENS_18TransformParamsABCI6float2NS_23TiledMatrixStridedBa", GemmAttention),
        ("_Z17gemv2T_kernel_valIii6float2S0_S0_S0_Li128ELi16ELi2ELi2ELb0ELb0E18cublasGemvParamsExIi30cublasGemvTensorStr", GemmAttention),
        ("_Z18fft3d_r2c_16x16x16Iff6float2EvPT1_PT_4int3S5_S5_S5_S5_b", ConvForward),
        ("_ZN5cudnn19engines_precompiled16nchwToNhwcKernelIfffLb0ELb1EL21cudnnKernelDataType_t2EEEvNS0_18nchw2nhwc_param", Layout),
        ("_ZN5cudnn19engines_precompiled20convertTensor_kernelI13__nv_bfloat16ffL21cudnnKernelDataType_t0EEEvT1_PKT_S4_P", Layout),
        ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize256x64x32_warpgroupsize1x1x1_g1_execu", ConvForward),
        // ncu's demangled names
        ("void implicit_convolveNd_sgemm<float, 3, 1024, 5, 5, 3, 3, 3, 1, 0, 0, 1>(int, int, int, const T1 *, int, T1 *, const T1 *, kernel_convNd_params, unsigned long long, int, float, float, int, const T1 *, const T1 *, bool, bool)", ConvForward),
        ("void cudnn::nchwToNhwcKernel<float, float, float, 0, 1, 2>(cudnn::nchw2nhwc_params_t<T3>, const T1 *, T2 *)", Layout),
        // other generations (peers.md §D.4)
        ("volta_scudnn_128x32_3dconv_fprop_small_nn_v1", ConvForward),
        ("cutlass3x_sm100_tensorop_conv3d_fprop_f32_ndhwc_ndhwc_ndhwc", ConvForward),
        ("void cudnn::detail::dgrad_engine<float, 128, 6, 8, 3, 3, 5, true>(int, int, int)", ConvDgrad),
        ("void cudnn::detail::wgrad_alg0_engine<float, 128, 6, 7, 3, 3, 5, false, 512>(int)", ConvWgrad),
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 4, 64, 64>(...)", Elementwise),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::FusedAdamMathFunctor<float, 4>>(...)", Optimizer),
    ];
    for (name, want) in cases {
        assert_eq!(classify(name), *want, "{name}");
    }
}

#[test]
fn our_nvrtc_kernel_names() {
    let cases: &[(&str, Category)] = &[
        ("conv3d_fwd_k3", ConvForward),
        ("conv3d_dgrad_k3", ConvDgrad),
        ("conv3d_wgrad_k3", ConvWgrad),
        ("groupnorm_stats", Normalization),
        ("groupnorm_apply_silu", Normalization),
        ("groupnorm_silu_bwd", Normalization),
        ("silu_fwd", Elementwise),
        ("silu_bwd", Elementwise),
        ("upsample_trilinear_fwd", Elementwise),
        ("upsample_trilinear_bwd", Elementwise),
        ("concat_channels", Elementwise),
        ("split_channels", Elementwise),
        ("adam_step", Optimizer),
        ("ema_update", Optimizer),
        ("adam_multi", Optimizer),
        ("ema_multi", Optimizer),
        ("cast_multi", Layout),
        ("add_multi", Elementwise),
        ("loss_l1_fwd", Reduction),
        ("loss_l1_bwd", Elementwise),
        ("randn_philox", Elementwise),
        ("q_sample", Elementwise),
        ("ddpm_step", Elementwise),
        ("softmax_rows", GemmAttention),
        ("channel_sum", Reduction),
        ("channel_sum_partial", Reduction),
        ("add_assign", Elementwise),
        ("add_channel_bias", Elementwise),
        ("scale_inplace", Elementwise),
        ("transpose_ncdhw_to_ndhwc", Layout),
        ("linear_fwd", GemmAttention),
        ("mystery_kernel", Other),
    ];
    for (name, want) in cases {
        assert_eq!(classify(name), *want, "{name}");
    }
}

#[test]
fn every_meddpm_cuda_kernel_has_its_hand_picked_category() {
    // OUR_KERNELS is the one list (meddpm-cuda loads these names; its tests hold it to the sources)
    for (name, want) in OUR_KERNELS {
        assert_eq!(classify(name), *want, "{name}");
        // as CUPTI records them: the plain extern "C" name goes through the demangler unchanged
        let r = KernelRecord::new(name, 1);
        assert_eq!((r.name.as_str(), r.category), (*name, *want));
    }
    // none "other", and each name once
    assert!(OUR_KERNELS.iter().all(|(_, c)| *c != Other));
    let mut names: Vec<&str> = OUR_KERNELS.iter().map(|(n, _)| *n).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), OUR_KERNELS.len(), "a kernel listed twice");
    // names that only resemble ours still go through the heuristics
    assert_eq!(classify("chan_stats_ncdhw_v2"), Other);
    assert_eq!(classify("void gn_apply<float>(float const*)"), Normalization);
}

#[test]
fn demangling() {
    assert_eq!(demangle("_Z3addPfPKfi"), "add(float*, float const*, int)");
    let d = demangle("_ZN5cudnn19engines_precompiled16nchwToNhwcKernelIfffLb0ELb1EEEvPKT_PT0_");
    assert!(
        d.starts_with("void cudnn::engines_precompiled::nchwToNhwcKernel<float, float, float, false, true>("),
        "{d}"
    );
    assert_eq!(classify(&d), Layout);
    // plain NVRTC names and names cut short by a profiler come back unchanged
    assert_eq!(demangle("groupnorm_stats"), "groupnorm_stats");
    let cut = "_ZN5cudnn19engines_precompiled16nchwToNhwcKernelIfffLb0ELb1EL21cudnn";
    assert_eq!(demangle(cut), cut);
    let r = KernelRecord::new(cut, 5);
    assert_eq!((r.name.as_str(), r.category), (cut, Layout));
    assert_eq!(short_name(&d, 200), "cudnn::engines_precompiled::nchwToNhwcKernel<float, float, float, false, true>");
}

fn rec(name: &str, ns: u64, range: &str, flops: Option<f64>, bytes: Option<f64>) -> KernelRecord {
    let mut r = KernelRecord::new(name, ns);
    r.range = Some(range.to_string());
    r.flops = flops;
    r.bytes = bytes;
    r
}

#[test]
fn breakdown_tables_match_hand_sums() {
    let rs = vec![
        rec("conv3d_fwd_k3", 2_000_000, "train/forward/input_blocks.1.0", Some(4.0e11), Some(1.0e9)),
        rec("conv3d_fwd_k3", 1_000_000, "train/forward/input_blocks.2.0", Some(2.0e11), Some(0.5e9)),
        rec("groupnorm_stats", 500_000, "train/forward/input_blocks.1.0", None, Some(2.0e9)),
        rec("silu_fwd", 250_000, "train/forward/input_blocks.1.0", None, None),
        rec("adam_step", 250_000, "train/optimizer", None, Some(1.0e9)),
    ];
    let b = breakdown("step", &rs, Some(5_000_000), 10);
    assert_eq!(b.kernel_ns, 4_000_000);
    assert_eq!(b.unattributed_ns(), Some(1_000_000));
    assert_eq!(b.idle, None, "CPU-style records carry no timestamps");
    assert!(b.idle_rows().is_empty());
    let conv = &b.by_category[0];
    assert_eq!((conv.key.as_str(), conv.calls, conv.total_ns), ("conv forward", 2, 3_000_000));
    assert!((conv.pct_of_kernels - 75.0).abs() < 1e-9);
    assert!((conv.pct_of_step.unwrap() - 60.0).abs() < 1e-9);
    // 6e11 FLOP in 3 ms = 200 TFLOP/s; 1.5e9 B in 3 ms = 500 GB/s
    assert!((conv.tflops.unwrap() - 200.0).abs() < 1e-9, "{:?}", conv.tflops);
    assert!((conv.gbps.unwrap() - 500.0).abs() < 1e-9);
    let silu = b.by_category.iter().find(|r| r.category == Some(Elementwise)).unwrap();
    assert_eq!((silu.flops, silu.tflops, silu.gbps), (None, None, None));
    let gn = b.by_category.iter().find(|r| r.category == Some(Normalization)).unwrap();
    // bytes on every call, FLOPs on none: 2e9 B in 0.5 ms = 4000 GB/s
    assert_eq!((gn.flops, gn.tflops, gn.bytes), (None, None, Some(2.0e9)));
    assert!((gn.gbps.unwrap() - 4000.0).abs() < 1e-9);
    let blk = &b.by_block[0];
    assert_eq!((blk.key.as_str(), blk.calls, blk.total_ns), ("input_blocks.1.0", 3, 2_750_000));
    // silu has neither count, groupnorm no FLOPs: the block shows no partial sums
    assert_eq!((blk.flops, blk.bytes, blk.tflops, blk.gbps), (None, None, None, None));
    let blk2 = b.by_block.iter().find(|r| r.key == "input_blocks.2.0").unwrap();
    assert_eq!((blk2.flops, blk2.bytes), (Some(2.0e11), Some(0.5e9)));
    assert!((blk2.tflops.unwrap() - 200.0).abs() < 1e-9 && (blk2.gbps.unwrap() - 500.0).abs() < 1e-9);
    assert_eq!(b.by_block.iter().find(|r| r.key == "(outside blocks)").unwrap().total_ns, 250_000);
    let ph: Vec<(&str, u64)> = b.by_phase.iter().map(|r| (r.key.as_str(), r.total_ns)).collect();
    assert_eq!(ph, vec![("train/forward", 3_750_000), ("train/optimizer", 250_000)]);
    assert_eq!((b.top[0].key.as_str(), b.top[0].calls), ("conv3d_fwd_k3", 2));
}

/// The H200 report's defect: a 16-byte memset was the only byte-counted call of a block of conv
/// kernels, and the block showed "bytes 16, GB/s 0.0".
#[test]
fn a_memset_alone_does_not_give_a_block_its_bytes() {
    let mut rs = vec![
        rec("sm90_xmma_fprop_implicit_gemm_tf32", 3_000_000, "train/forward/output_blocks.9.0", None, None),
        rec("Memset (Device)", 1_000, "train/forward/output_blocks.9.0", None, Some(16.0)),
    ];
    rs.push(rec("Memset (Device)", 3_000, "train", None, Some(48.0)));
    let b = breakdown("cupti", &rs, None, 5);
    let blk = b.by_block.iter().find(|r| r.key == "output_blocks.9.0").unwrap();
    assert_eq!((blk.bytes, blk.gbps, blk.flops, blk.tflops), (None, None, None, None));
    // the memset category has a count on every call: 64 B in 4 µs = 0.016 GB/s
    let mem = b.by_category.iter().find(|r| r.category == Some(Memory)).unwrap();
    assert_eq!(mem.bytes, Some(64.0));
    assert!((mem.gbps.unwrap() - 0.016).abs() < 1e-12, "{:?}", mem.gbps);
}

/// A kernel record with a GPU start timestamp.
fn at(name: &str, start: u64, ns: u64, range: &str) -> KernelRecord {
    let mut r = rec(name, ns, range, None, None);
    r.start_ns = Some(start);
    r
}

/// A hand-drawn timeline (ns, records deliberately out of order):
///
/// ```text
///  100      350 400 450 500   650 670 700      1000    1100 1150 1200   1300      1500 = step
///   [ conv A      )                                                              (step from 0)
///            [silu B )            overlap A∩B = 50
///                        [ gn_apply C     )
///                               [mem D)        D inside C: overlap 20
///                                                [adam E )
///                                                          [ema F)
///                                                                [scale G)      G starts at F's end
/// ```
///
/// busy = 350 + 200 + 100 + 50 + 100 = 800; span = 1300 − 100 = 1200; gaps = 50 (before C) + 300
/// (before E) + 50 (before F) = 400 = span − busy; outside = 1500 − 1200 = 300 (100 before A, 200
/// after G); Σ durations = 300+100+200+20+100+50+100 = 870; overlap = 870 − 800 = 70.
fn timeline() -> Vec<KernelRecord> {
    vec![
        at("adam_step", 1000, 100, "train/optimizer"),
        at("conv3d_fwd_k3", 100, 300, "train/forward/input_blocks.1.0"),
        at("gn_apply", 500, 200, "train/forward/middle_block.0"),
        at("silu_fwd", 350, 100, "train/forward/input_blocks.1.0"),
        at("Memset (Device)", 650, 20, "train/forward/middle_block.0"),
        at("ema_update", 1150, 50, "train/optimizer"),
        at("scale_buf", 1200, 100, "train/optimizer"),
    ]
}

fn gap(key: &str, gaps: usize, total_ns: u64, largest_ns: u64, step: u64) -> GapRow {
    GapRow { key: key.into(), gaps, total_ns, largest_ns, pct_of_step: 100.0 * total_ns as f64 / step as f64 }
}

#[test]
fn idle_time_of_a_hand_drawn_timeline() {
    let rs = timeline();
    let b = breakdown("cupti", &rs, Some(1500), 10);
    assert_eq!(b.kernel_ns, 870);
    let i = b.idle.as_ref().expect("every record has a timestamp and the step is known");
    assert_eq!((i.busy_ns, i.span_ns, i.gaps_ns, i.outside_ns, i.overlap_ns, i.gaps), (800, 1200, 400, 300, 70, 3));
    // each gap charged to the kernel after it: C (middle_block.0, 50), E and F (optimizer, 300 + 50)
    assert_eq!(
        i.by_range,
        vec![gap("train/optimizer", 2, 350, 300, 1500), gap("train/forward/middle_block.0", 1, 50, 50, 1500)]
    );
    assert_eq!(i.by_phase, vec![gap("train/optimizer", 2, 350, 300, 1500), gap("train/forward", 1, 50, 50, 1500)]);
    // the by-category table with its idle rows covers the step exactly
    let rows = b.idle_rows();
    let keyed: Vec<(&str, Option<usize>, i64)> = rows.iter().map(|r| (r.key.as_str(), r.count, r.ns)).collect();
    assert_eq!(keyed, vec![(IDLE_GAPS, Some(3), 400), (IDLE_OUTSIDE, None, 300), (IDLE_OVERLAP, None, -70)]);
    let pct: f64 = b.by_category.iter().map(|r| r.pct_of_step.unwrap()).sum::<f64>()
        + rows.iter().map(|r| r.pct_of_step).sum::<f64>();
    assert!((pct - 100.0).abs() < 1e-9, "{pct}");
    assert!((rows[0].pct_of_step - 400.0 / 15.0).abs() < 1e-12);
    // record order does not matter
    let mut rev = rs.clone();
    rev.reverse();
    assert_eq!(breakdown("cupti", &rev, Some(1500), 10).idle, b.idle);
}

#[test]
fn idle_needs_every_timestamp_and_a_step() {
    let mut rs = timeline();
    assert_eq!(breakdown("no step", &rs, None, 5).idle, None);
    assert_eq!(idle(&[], 1000), None);
    rs[3].start_ns = None;
    assert_eq!(breakdown("one missing", &rs, Some(1500), 5).idle, None);
    // JSON written before the field existed still loads (serde default: no timestamp)
    let old = r#"{"name":"k","duration_ns":5,"grid":null,"block":null,"registers":null,"shared_mem":null,
        "range":null,"category":"elementwise","flops":null,"bytes":null}"#;
    let r: KernelRecord = serde_json::from_str(old).unwrap();
    assert_eq!((r.start_ns, r.duration_ns), (None, 5));
}

/// A step shorter than the kernel span (clocks that disagree): outside clamps at 0 and a
/// correction row keeps the table summing to the step.
#[test]
fn span_longer_than_the_step() {
    let b = breakdown("short step", &timeline(), Some(1000), 10);
    let i = b.idle.as_ref().unwrap();
    assert_eq!((i.outside_ns, i.span_ns, i.gaps_ns), (0, 1200, 400));
    let rows = b.idle_rows();
    assert_eq!(rows.last().map(|r| (r.key.as_str(), r.ns)), Some((IDLE_SPAN_EXCESS, -200)));
    let pct: f64 = b.by_category.iter().map(|r| r.pct_of_step.unwrap()).sum::<f64>()
        + rows.iter().map(|r| r.pct_of_step).sum::<f64>();
    assert!((pct - 100.0).abs() < 1e-9, "{pct}");
}

fn shared() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/perf");
    if p.is_dir() {
        Some(p)
    } else {
        eprintln!("skip: {} not found (the team's shared folder)", p.display());
        None
    }
}

fn category_ms(rs: &[KernelRecord], c: Category) -> (f64, usize) {
    let v: Vec<&KernelRecord> = rs.iter().filter(|r| r.category == c).collect();
    (v.iter().map(|r| r.duration_ns as f64).sum::<f64>() / 1e6, v.len())
}

#[test]
fn pytorch_h200_tables_by_category() {
    let Some(dir) = shared() else { return };
    let p = dir.join("pytorch-h200-profile-default-sample.txt");
    let rs = parse_table(&std::fs::read_to_string(&p).unwrap(), &p).unwrap();
    // sums of the "Self CUDA" column read off the table by hand
    let (ms, n) = category_ms(&rs, Normalization); // RowwiseMoments 34.107 (39 calls) + ComputeFusedParams 0.067583 (39)
    assert!((ms - 34.174583).abs() < 1e-6 && n == 78, "{ms} {n}");
    let (ms, n) = category_ms(&rs, Layout); // nchwToNhwc 4.278 + 0.007968, nhwcToNchw 2.600, tensorTransformGeneric 0.009056
    assert!((ms - 6.895024).abs() < 1e-6, "{ms} {n}");
    let (ms, _) = category_ms(&rs, Memory); // Memcpy DtoD 1.247 + Memset 0.025664
    assert!((ms - 1.272664).abs() < 1e-6, "{ms}");
    assert!(rs.iter().all(|r| r.category != Other || r.name.contains("init_device_workspace")), "unclassified rows");
    let p = dir.join("pytorch-h200-profile-default-train.txt");
    let rs = parse_table(&std::fs::read_to_string(&p).unwrap(), &p).unwrap();
    // wgrad rows: 29.131 + 19.431 + 5.714 + 2.174 + 1.383 + 1.039 + 0.287835 + 0.251389 ms
    let (ms, n) = category_ms(&rs, ConvWgrad);
    assert!((ms - 59.411224).abs() < 1e-6, "{ms}");
    assert_eq!(n, 12 + 4 + 1 + 6 + 7 + 1 + 11 + 2);
    // layout: nchwToNhwc 13.783 (250) + 0.855579 (10), nhwcToNchw 6.586 (129)
    let (ms, n) = category_ms(&rs, Layout);
    assert!((ms - 21.224579).abs() < 1e-6 && n == 389, "{ms} {n}");
    let b = breakdown("train", &rs, None, 5);
    assert_eq!(b.top[0].category, Some(Normalization));
}

#[test]
fn nccl_kernels_are_collectives() {
    for n in [
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "void ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)",
        "_Z29ncclDevKernel_Broadcast_RING_LL24ncclDevKernelArgsStorageILm4096EE",
        "ncclDevKernel_AllGather_RING_LL",
        "NCCLDEVKERNEL_SENDRECV",
    ] {
        assert_eq!(classify(n), Collective, "{n}");
    }
    // names that merely reduce or copy stay where they were
    assert_eq!(classify("reduce_kernel_sum"), Reduction);
    assert_eq!(classify("memcpy DtoD"), Memory);
}

/// A hand-drawn two-stream timeline: backward kernels on the compute stream, NCCL all-reduces on
/// the comm stream.
#[test]
fn collective_time_hidden_behind_other_kernels() {
    let at = |name: &str, start: u64, ns: u64| {
        let mut r = KernelRecord::new(name, ns);
        r.start_ns = Some(start);
        r
    };
    let rs = vec![
        at("conv3d_wgrad_small1", 0, 100),                      // compute 0..100
        at("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 50, 100), // comm 50..150: 50 hidden
        at("silu_bwd", 120, 60),                                // compute 120..180
        at("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 140, 10), // comm 140..150 (inside the first)
        at("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 300, 40), // comm 300..340: exposed
        at("adam_step", 400, 10),
    ];
    let c = breakdown("dp", &rs, Some(500), 10).comm.expect("NCCL records with timestamps");
    // comm union = 50..150 ∪ 300..340 = 140 ns; covered: 50..100 and 120..150 = 80 ns
    assert_eq!((c.calls, c.comm_ns, c.hidden_ns), (3, 140, 80));
    assert!((c.hidden_pct - 100.0 * 80.0 / 140.0).abs() < 1e-9);
    let coll = breakdown("dp", &rs, Some(500), 10);
    let row = coll.by_category.iter().find(|r| r.key == "NCCL collective").expect("a category row");
    assert_eq!((row.calls, row.total_ns), (3, 150));
    // no collective, or a record without a timestamp: no figure
    assert_eq!(breakdown("one gpu", &rs[..1], Some(500), 10).comm, None);
    let mut no_ts = rs.clone();
    no_ts[2].start_ns = None;
    assert_eq!(breakdown("cpu", &no_ts, Some(500), 10).comm, None);
}
