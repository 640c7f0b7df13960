//! Nsight Compute CSV parsing on the real H200 exports in `testdata/ncu/` (values asserted here
//! were read from the CSV files by hand), the priority list, the optimisation matrix built from
//! them, and robustness to exports that lack metrics, use scaled units or are not ncu exports.
//! Also what `meddpm profile` builds around an ncu run without a GPU: the argument lists, the
//! top-kernel regex, ncu kernels as records, `--matrix` values and the CUDA matrix inputs.

use meddpm::analysis::kernels::{Category, KernelRecord};
use meddpm::analysis::matrix::{config_name, from_cuda_runs, matrix, ConfigInput, MatrixSpec, CUDA_CONFIGS};
use meddpm::analysis::ncu::{
    base_args, child_filters, command_args, kernel_records, log_tail, matrix_args, parse_details, parse_raw,
    priority_list, regex_escape, select_ids, top_raw_names, unit_scale, NcuData, NcuKernel, MATRIX_METRICS,
};
use meddpm::shape::{ConvShape, Dims};
use meddpm::{Layout, Precision};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/ncu").join(name)
}

fn load() -> NcuData {
    NcuData::load(Some(&fixture("h200_conv_raw.csv")), Some(&fixture("h200_conv_details.csv"))).unwrap()
}

fn close(a: Option<f64>, b: f64) -> bool {
    a.is_some_and(|a| (a - b).abs() <= 1e-9 * b.abs().max(1.0))
}

#[test]
fn raw_page_counters_of_the_fma_conv_kernel() {
    let d = load();
    let ids: Vec<u64> = d.kernels.iter().map(|k| k.id).collect();
    assert_eq!(ids, vec![0, 2, 5, 6, 7, 8]);
    let k = &d.kernels[0];
    assert!(k.name.starts_with("void implicit_convolveNd_sgemm<float, 3, 1024,"), "{}", k.name);
    assert_eq!(k.category, Category::ConvForward);
    assert_eq!((k.block, k.grid), (Some([8, 8, 1]), Some([8192, 2, 1])));
    let c = k.counters();
    assert!(close(c.duration_ns, 4_070_048.0), "{:?}", c.duration_ns);
    assert!(close(c.sm_cycles_elapsed, 8_058_843.30));
    assert!(close(c.sm_cycles_active, 7_954_754.75));
    assert!(close(c.instructions, 3_321_309_782.0));
    assert!(close(c.ipc, 3.16));
    assert!(close(c.issue_active_pct, 79.08));
    assert!(close(c.tensor_pipe_pct, 1.35));
    assert!(close(c.tensor_gmma_inst_pct, 0.0));
    assert!(close(c.dram_read_bytes, 134_733_824.0));
    assert!(close(c.dram_write_bytes, 56_837_632.0));
    assert!(close(c.dram_pct, 0.98));
    assert!(close(c.l2_pct, 11.93));
    assert!(close(c.l1_pct, 53.25));
    assert!(close(c.l2_hit_pct, 93.60));
    assert!(close(c.l1_hit_pct, 59.39));
    assert!(close(c.sm_pct, 78.06));
    assert!(close(c.achieved_occupancy_pct, 48.14));
    assert!(close(c.registers, 63.0));
    assert!(close(c.waves_per_sm, 7.76));
    assert!(close(c.warp_cycles_per_inst, 9.74));
    // warp stalls, instruction mix and pipes
    assert!(close(c.stalls.get("not_selected").copied(), 3.26));
    assert!(close(c.stalls.get("math_pipe_throttle").copied(), 1.41));
    assert!(close(c.stalls.get("gmma").copied(), 0.0));
    assert!(close(c.inst_mix.get("global_ld").copied(), 56_036_352.0));
    assert!(close(c.inst_mix.get("shared_ld").copied(), 113_246_208.0));
    assert!(close(c.inst_mix.get("branch").copied(), 65_117_190.0));
    assert!(close(c.pipes.get("alu").copied(), 46.75));
    assert!(close(c.pipes.get("fma").copied(), 41.05));
    // the FMA kernel issues no tensor-core FLOPs
    assert!(close(c.tensor_ops, 0.0));
}

#[test]
fn tf32_kernel_tensor_ops_equal_our_conv_flop_count() {
    let d = load();
    let k = d.kernels.iter().find(|k| k.id == 7).unwrap();
    assert!(k.name.starts_with("sm80_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nchw"), "{}", k.name);
    let c = k.counters();
    assert!(close(c.tensor_pipe_pct, 55.64));
    assert!(close(c.tensor_hmma_pct, 55.64));
    // the probe ran conv3d 3x3x3, C=K=64, 64³: our count and the hardware's agree exactly
    let cs = ConvShape::new(Dims::new(1, 64, 64, 64, 64), 64, 3, 1);
    assert_eq!(c.tensor_ops, Some(cs.flops()));
    assert_eq!(cs.flops(), 57_982_058_496.0);
    // achieved rate from our count and the measured duration vs ncu's own per-second counter
    let ours = cs.flops() / (c.duration_ns.unwrap() * 1e-9);
    let theirs = k.metric("sm__ops_path_tensor_src_tf32_dst_fp32.sum.per_second").unwrap();
    assert!((ours / theirs - 1.0).abs() < 1e-6, "{ours} vs {theirs}");
    // layout kernels around it
    let cats: Vec<Category> = d.kernels.iter().map(|k| k.category).collect();
    use Category::*;
    assert_eq!(cats, vec![ConvForward, ConvForward, Layout, Layout, ConvForward, Layout]);
}

#[test]
fn details_page_rules_and_fallback_metrics() {
    let p = fixture("h200_conv_details.csv");
    let ks = parse_details(&std::fs::read_to_string(&p).unwrap(), &p).unwrap();
    assert_eq!(ks.len(), 6);
    let k0 = &ks[0];
    assert_eq!(k0.rules.len(), 10);
    let r = k0.rules.iter().find(|r| r.name == "UncoalescedGlobalAccess").unwrap();
    assert_eq!((r.kind.as_str(), r.speedup_type.as_deref(), r.speedup_pct), ("OPT", Some("global"), Some(6.246)));
    assert_eq!(r.section, "SourceCounters");
    let inf = k0.rules.iter().find(|r| r.name == "SOLFPRoofline").unwrap();
    assert_eq!((inf.kind.as_str(), inf.speedup_pct), ("INF", None));
    // with only the details page the counters come from display names (same metrics)
    let c = k0.counters();
    assert!(close(c.duration_ns, 4_070_048.0));
    assert!(close(c.sm_cycles_active, 7_954_754.75));
    assert!(close(c.instructions, 3_321_309_782.0));
    assert!(close(c.ipc, 3.16));
    assert!(close(c.l2_hit_pct, 93.60));
    assert!(close(c.achieved_occupancy_pct, 48.14));
    assert!(close(c.theoretical_occupancy_pct, 50.0));
    assert!(close(c.registers, 63.0));
    assert!(close(c.memory_pct, 52.56));
    // ... and what only the raw page has is "not collected"
    assert_eq!((c.sm_cycles_elapsed, c.tensor_pipe_pct, c.dram_read_bytes), (None, None, None));
    assert!(c.stalls.is_empty() && c.inst_mix.is_empty());
    let k7 = ks.iter().find(|k| k.id == 7).unwrap();
    let r = k7.rules.iter().find(|r| r.name == "SharedMemoryConflicts").unwrap();
    assert_eq!(r.speedup_pct, Some(31.35));
}

#[test]
fn priority_list_ranks_by_estimated_time_saved() {
    let d = load();
    let p = priority_list(&d.kernels);
    assert_eq!(p.len(), 41); // OPT rules with a speedup, counted in the CSV by hand
                             // speedup % × duration, by hand: 50 % × 4,070,048 ns; 39.42 % × 4,070,048; 33.45 % × 4,070,048
    let top: Vec<(u64, &str, f64)> =
        p.iter().take(3).map(|r| (r.kernel_id, r.rule.as_str(), r.est_saved_ns.unwrap())).collect();
    assert_eq!((top[0].0, top[0].1), (0, "TheoreticalOccupancy"));
    assert!((top[0].2 - 2_035_024.0).abs() < 1e-3);
    assert_eq!((top[1].0, top[1].1), (0, "MemoryCacheAccessPattern"));
    assert!((top[1].2 - 1_604_412.921_6).abs() < 1e-3);
    assert_eq!((top[2].0, top[2].1), (0, "CPIStall"));
    assert_eq!(p[3].rule, "TheoreticalOccupancy");
    assert_eq!((p[3].kernel_id, p[3].speedup_pct), (2, 87.5));
    assert!(p.windows(2).all(|w| w[0].est_saved_ns >= w[1].est_saved_ns));
    assert_eq!(p.iter().map(|r| r.rank).collect::<Vec<_>>(), (1..=41).collect::<Vec<_>>());
}

#[test]
fn matrix_fma_ncdhw_vs_tf32_ncdhw_from_the_exports() {
    // baseline: the FMA implicit-GEMM conv (ID 0); TF32 path for the same conv: input transform
    // (5), filter transform (6), TF32 tensor-core conv (7), output transform back (8)
    let d = load();
    let pick = |ids: &[u64]| -> Vec<NcuKernel> { d.kernels.iter().filter(|k| ids.contains(&k.id)).cloned().collect() };
    let rows = matrix(
        &[ConfigInput::from_ncu("fp32 NCDHW", &pick(&[0])), ConfigInput::from_ncu("TF32 NCDHW", &pick(&[5, 6, 7, 8]))],
        0,
    );
    let t = &rows[1];
    // hand sums: time (39,584 + 3,680 + 337,984 + 35,136) / 4,070,048
    assert!((t.ratios.time.unwrap() - 416_384.0 / 4_070_048.0).abs() < 1e-12);
    // SM cycles (75,592.03 + 7,615.45 + 607,383.58 + 69,124.36) / 8,058,843.30
    assert!((t.ratios.sm_cycles.unwrap() - 759_715.42 / 8_058_843.30).abs() < 1e-9);
    // instructions (15,205,248 + 172,672 + 94,429,184 + 16,188,288) / 3,321,309,782
    assert!((t.ratios.instructions.unwrap() - 125_995_392.0 / 3_321_309_782.0).abs() < 1e-12);
    // tensor pipe weighted by SM cycles: (0.70·75,592.03 + 0.13·7,615.45 + 55.64·607,383.58 + 0·69,124.36) / 759,715.42
    let tw = (0.70 * 75_592.03 + 0.13 * 7_615.45 + 55.64 * 607_383.58) / 759_715.42;
    assert!((t.input.tensor_pct.unwrap() - tw).abs() < 1e-9, "{:?} {tw}", t.input.tensor_pct);
    // IPC weighted by active cycles: Σ ipc·active / Σ active
    let ipc = (1.61 * 71_341.42 + 0.45 * 2_883.96 + 1.23 * 581_499.74 + 1.87 * 65_516.65)
        / (71_341.42 + 2_883.96 + 581_499.74 + 65_516.65);
    assert!((t.input.ipc.unwrap() - ipc).abs() < 1e-9);
    assert!((t.ratios.ipc.unwrap() - ipc / 3.16).abs() < 1e-9);
    assert!((t.ratios.tensor.unwrap() - tw / 1.35).abs() < 1e-9);
    assert!(rows[0].is_baseline && rows[0].ratios.time == Some(1.0));
    // time by category: the FMA conv alone; the TF32 conv (7) and the three layout transforms
    assert_eq!(rows[0].input.by_category, vec![(Category::ConvForward, 4_070_048.0)]);
    assert_eq!(
        t.input.by_category,
        vec![(Category::ConvForward, 337_984.0), (Category::Layout, 39_584.0 + 3_680.0 + 35_136.0)]
    );
}

#[test]
fn robust_to_missing_metrics_units_and_foreign_files() {
    let p = Path::new("mini.csv");
    // a targeted pass with few metrics, scaled units, "n/a", an ncu banner before the table
    let text = "==PROF== Disconnected from process 1\n\
        \"ID\",\"Process ID\",\"Process Name\",\"Host Name\",\"Kernel Name\",\"Context\",\"Stream\",\"Block Size\",\"Grid Size\",\"Device\",\"CC\",\"gpu__time_duration.sum\",\"dram__bytes_read.sum\",\"sm__inst_executed.avg.per_cycle_active\"\n\
        \"\",\"\",\"\",\"\",\"\",\"\",\"\",\"\",\"\",\"\",\"\",\"usecond\",\"Mbyte\",\"inst/cycle\"\n\
        \"3\",\"1\",\"a\",\"h\",\"groupnorm_stats\",\"1\",\"7\",\"(256, 1, 1)\",\"(32, 1, 1)\",\"0\",\"9.0\",\"1,234.5\",\"2.5\",\"n/a\"\n";
    let ks = parse_raw(text, p).unwrap();
    assert_eq!(ks.len(), 1);
    let c = ks[0].counters();
    assert_eq!(ks[0].category, Category::Normalization);
    assert!(close(c.duration_ns, 1_234_500.0), "{:?}", c.duration_ns);
    assert!(close(c.dram_read_bytes, 2.5e6));
    assert_eq!((c.ipc, c.sm_cycles_elapsed, c.tensor_pipe_pct), (None, None, None));
    assert!(priority_list(&ks).is_empty());
    assert_eq!(
        (unit_scale("msecond"), unit_scale("Gbyte/second"), unit_scale("%"), unit_scale("Kinst")),
        (1e6, 1e9, 1.0, 1e3)
    );
    // not an ncu export: the error names the file and what was expected
    let e = parse_raw("a,b,c\n1,2,3\n", Path::new("bench.csv")).unwrap_err().to_string();
    assert!(e.contains("bench.csv") && e.contains("Nsight Compute raw-page"), "{e}");
    let e = NcuData::load(Some(Path::new("/nonexistent/raw.csv")), None).unwrap_err().to_string();
    assert!(e.contains("/nonexistent/raw.csv"), "{e}");
    let e =
        parse_raw("\"ID\",\"Kernel Name\",\"x\"\n\"\",\"\",\"\"\n", Path::new("empty.csv")).unwrap_err().to_string();
    assert!(e.contains("no kernel rows"), "{e}");
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn ncu_argument_lists() {
    let short = "gpu__time_duration.sum,sm__cycles_elapsed.avg,smsp__inst_executed.sum,\
                 sm__inst_executed.avg.per_cycle_active,launch__registers_per_thread,launch__grid_size,\
                 launch__block_size";
    assert_eq!(
        base_args(false),
        strings(&["--clock-control", "none", "--target-processes", "all", "--metrics", short])
    );
    assert_eq!(base_args(true), strings(&["--clock-control", "none", "--target-processes", "all", "--set", "full"]));
    let m = matrix_args();
    assert_eq!(m[..5], base_args(false)[..5]);
    assert_eq!((m.len(), m[5].as_str()), (6, MATRIX_METRICS));
    assert!(MATRIX_METRICS.contains(",sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,"));
    // a command: base, then NVTX range, kernel regex, launch count in that order
    let c = command_args(false, Some("forward/"), Some("conv.*"), Some(3));
    assert_eq!(c[..6], base_args(false)[..]);
    assert_eq!(c[6..], strings(&["--nvtx", "--nvtx-include", "forward/", "-k", "regex:conv.*", "-c", "3"])[..]);
    assert_eq!(command_args(true, None, None, None), base_args(true));
}

#[test]
fn child_filters_select_the_profile_range_and_the_top_kernels() {
    let (a, how) = child_filters(Ok(()), 0, &[]);
    assert_eq!(a, strings(&["--nvtx", "--nvtx-include", "profile/"]));
    assert_eq!(how, "NVTX range of the recorded training and sampling step");
    let names = strings(&["_Z4convPf", "k<1>(x)"]);
    let (a, how) = child_filters(Err("no libnvToolsExt".into()), 6, &names);
    assert_eq!(a, strings(&["--kernel-name-base", "mangled", "-k", r"regex:^(_Z4convPf|k<1>\(x\))$", "-c", "6"]));
    assert_eq!(how, "first launches (no NVTX: no libnvToolsExt), the 2 kernels with the most GPU time");
    // top > 0 but no names (nothing recorded): no kernel filter
    assert_eq!(child_filters(Ok(()), 6, &[]).0.len(), 3);
}

#[test]
fn regex_escape_and_top_kernels() {
    assert_eq!(regex_escape(r"a.b*c[1]{2}(x)|^$?+\"), r"a\.b\*c\[1\]\{2\}\(x\)\|\^\$\?\+\\");
    assert_eq!(regex_escape("void f<int>"), "void f<int>");
    let acts = vec![
        ("b".to_string(), 5),
        ("memcpy HtoD".to_string(), 100),
        ("a".to_string(), 3),
        ("memset".to_string(), 50),
        ("c".to_string(), 7),
        ("a".to_string(), 4),
    ];
    // Σ per name (a: 7, b: 5, c: 7), ties by name, copies and sets left out
    assert_eq!(top_raw_names(&acts, 2), strings(&["a", "c"]));
    assert_eq!(top_raw_names(&acts, 10), strings(&["a", "c", "b"]));
    assert!(top_raw_names(&[], 3).is_empty());
}

#[test]
fn ncu_kernels_as_records_and_by_id() {
    let d = load();
    assert_eq!(d.device_name().as_deref(), Some("NVIDIA H200"));
    assert_eq!(NcuData::default().device_name(), None);
    let r = kernel_records(&d.kernels);
    assert_eq!(r.len(), 6);
    assert_eq!(r[0].duration_ns, 4_070_048);
    assert_eq!((r[0].category, r[0].block, r[0].grid), (Category::ConvForward, Some([8, 8, 1]), Some([8192, 2, 1])));
    assert_eq!(r[0].registers, d.kernels[0].counters().registers.map(|v| v as u32));
    assert!(r[0].registers.is_some() && r[0].start_ns.is_none());
    let ids = |ks: Vec<NcuKernel>| ks.iter().map(|k| k.id).collect::<Vec<_>>();
    assert_eq!(ids(select_ids(d.kernels.clone(), Some(&[2, 7, 99]))), vec![2, 7]);
    assert_eq!(ids(select_ids(d.kernels.clone(), None)), vec![0, 2, 5, 6, 7, 8]);
    assert!(select_ids(d.kernels, Some(&[99])).is_empty());
}

#[test]
fn log_tail_keeps_the_last_non_blank_lines() {
    assert_eq!(log_tail("a\n\nb\n  \nc\nd\n", 3), "b | c | d");
    assert_eq!(log_tail("only\n", 4), "only");
    assert_eq!(log_tail("", 2), "");
}

#[test]
fn matrix_option_values() {
    assert_eq!(MatrixSpec::parse("cuda"), Ok(MatrixSpec::Cuda));
    assert_eq!(
        MatrixSpec::parse("tf32=out/raw.csv"),
        Ok(MatrixSpec::Ncu { name: "tf32".into(), path: "out/raw.csv".into(), ids: None })
    );
    assert_eq!(
        MatrixSpec::parse("b=C:/x/raw.csv:0, 2,5"),
        Ok(MatrixSpec::Ncu { name: "b".into(), path: "C:/x/raw.csv".into(), ids: Some(vec![0, 2, 5]) })
    );
    // a trailing part that is not a list of IDs belongs to the path
    assert_eq!(
        MatrixSpec::parse("b=raw.csv:x"),
        Ok(MatrixSpec::Ncu { name: "b".into(), path: "raw.csv:x".into(), ids: None })
    );
    for bad in ["foo", "=raw.csv", "a=", "a=:1"] {
        assert_eq!(
            MatrixSpec::parse(bad),
            Err(format!(
                "'{bad}' is not NAME=RAW.csv or NAME=RAW.csv:ID,ID,… (or no value: the four CUDA configurations)"
            )),
            "{bad}"
        );
    }
}

#[test]
fn cuda_matrix_inputs_baseline_first() {
    let names: Vec<String> = CUDA_CONFIGS.iter().map(|&(p, l)| config_name(p, l)).collect();
    assert_eq!(names, ["fp32-ncdhw", "tf32-ncdhw", "fp32-ndhwc", "tf32-ndhwc", "bf16-ncdhw", "bf16-ndhwc"]);
    let rec = |c: Category, ns: u64| {
        let mut r = KernelRecord::new("k", ns);
        r.category = c;
        r
    };
    let runs = vec![
        // the requested configuration first, as `profile --device cuda --matrix` records it
        (Precision::Bf16, Layout::Ndhwc, Some(vec![rec(Category::ConvForward, 30), rec(Category::Layout, 10)])),
        (Precision::Fp32, Layout::Ndhwc, None),
        (Precision::Tf32, Layout::Ncdhw, Some(vec![rec(Category::ConvForward, 70)])),
        (Precision::Fp32, Layout::Ncdhw, Some(vec![rec(Category::ConvForward, 100)])),
    ];
    let ncu = vec![
        (
            "fp32-ndhwc".to_string(),
            ConfigInput { name: "fp32-ndhwc".into(), time_ns: Some(5.0), sm_cycles: Some(9.0), ..Default::default() },
        ),
        (
            "tf32-ncdhw".to_string(),
            ConfigInput { name: "tf32-ncdhw".into(), time_ns: Some(1e9), ipc: Some(2.0), ..Default::default() },
        ),
    ];
    let m = from_cuda_runs(runs, &ncu);
    assert_eq!(
        m.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
        ["fp32-ncdhw", "tf32-ncdhw", "fp32-ndhwc", "bf16-ndhwc"]
    );
    // no counters: CUPTI time only
    assert_eq!(
        m[0],
        ConfigInput {
            name: "fp32-ncdhw".into(),
            time_ns: Some(100.0),
            by_category: vec![(Category::ConvForward, 100.0)],
            ..Default::default()
        }
    );
    // counters and CUPTI: the CUPTI time replaces ncu's replayed one, the counters stay
    assert_eq!((m[1].time_ns, m[1].ipc), (Some(70.0), Some(2.0)));
    // counters, no CUPTI records: ncu's values as they are
    assert_eq!(m[2], ncu[0].1);
    assert_eq!(m[3].time_ns, Some(40.0));
    assert_eq!(m[3].by_category, vec![(Category::ConvForward, 30.0), (Category::Layout, 10.0)]);
}
