//! The CPU profile path end to end: `Timed<CpuBackend>` forwards every call unchanged (bit-equal
//! outputs), records every call under its `pass/phase/block` range, and its FLOP counts agree
//! with the analytic model `model::cost` computed from the topology; the null backend counts the
//! full 128³ model; the report folder is written with and without optional inputs. Also the small
//! pieces `meddpm profile` assembles its input from: the median, the preset line, summed passes.

use meddpm::analysis::csv;
use meddpm::analysis::kernels::Category;
use meddpm::analysis::matrix::ConfigInput;
use meddpm::analysis::ncu::NcuData;
use meddpm::analysis::profile::{profile_unet, Options};
use meddpm::analysis::report::{self, Input, Pass};
use meddpm::analysis::timed::{NullBackend, Timed};
use meddpm::cpu::CpuBackend;
use meddpm::model::{cost, UNet, UNetConfig};
use meddpm::shape::{ConvShape, Dims};
use meddpm::Backend;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Forward, L1 loss against a target, backward: all parameter gradients, flattened. (The
/// output conv is zero-initialised as in Med-DDPM, so the forward output alone would be zeros.)
fn gradients<B: Backend>(be: &B, cfg: &UNetConfig) -> Vec<f32> {
    let mut net = UNet::new(be, cfg, 1).unwrap();
    net.init_params(be, 7);
    let d = net.input_dims();
    let x: Vec<f32> = (0..d.numel()).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
    be.upload_act(&x, d, net.input_mut());
    net.forward(be, &[123.0]);
    let od = net.output_dims();
    let y: Vec<f32> = (0..od.numel()).map(|i| ((i * 13 % 29) as f32 / 14.0) - 1.0).collect();
    let mut target = be.alloc(od.numel()).unwrap();
    be.upload_act(&y, od, &mut target);
    let (out, dout) = net.output_and_grad();
    be.loss_backward(dout, out, &target, meddpm::LossKind::L1, 1.0);
    net.backward(be);
    net.host_tensors(be, true).concat()
}

#[test]
fn timed_forwards_every_call_unchanged() {
    let cfg = UNetConfig::tiny();
    let plain = gradients(&CpuBackend::new(), &cfg);
    let timed = Timed::new(CpuBackend::new());
    let wrapped = gradients(&timed, &cfg);
    assert_eq!(
        plain.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        wrapped.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    assert!(plain.iter().any(|&v| v != 0.0));
    let rs = timed.take_records();
    assert!(rs.iter().any(|r| r.category == Category::ConvForward));
    assert!(rs.iter().any(|r| r.category == Category::ConvBackward));
    assert!(timed.take_records().is_empty(), "take_records clears");
}

/// In bf16 the wrapper must reach the inner backend's activation buffers and its rounding cast of
/// the conv weights (`alloc_act`, `cast`): a per-call bf16 profile measures the bf16 program.
#[test]
fn timed_forwards_every_call_unchanged_in_bf16() {
    let cfg = UNetConfig::tiny();
    let plain = gradients(&CpuBackend::bf16(), &cfg);
    let timed = Timed::new(CpuBackend::bf16());
    let wrapped = gradients(&timed, &cfg);
    assert_eq!(
        plain.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        wrapped.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    let rs = timed.take_records();
    assert!(rs.iter().any(|r| r.name == "cast"), "the weight casts are recorded as casts");
}

fn flops_in(p: &Pass, phase: &str) -> f64 {
    p.records.iter().filter(|r| r.phase().as_deref() == Some(phase)).filter_map(|r| r.flops).sum()
}

#[test]
fn cpu_profile_of_the_tiny_model() {
    let cfg = UNetConfig::tiny();
    let be = Timed::new(CpuBackend::new());
    let passes = profile_unet(&be, &cfg, &Options::default()).unwrap();
    assert_eq!(passes.len(), 2);
    let (tr, sa) = (&passes[0], &passes[1]);
    assert_eq!((tr.name.as_str(), sa.name.as_str()), ("train step", "sampling step"));
    for p in &passes {
        let sum: u64 = p.records.iter().map(|r| r.duration_ns).sum();
        assert!(p.measured && sum > 0 && sum <= p.step_ns.unwrap(), "{}: Σ {sum} vs step {:?}", p.name, p.step_ns);
        assert!(p.records.iter().all(|r| r.range.is_some()), "every call of {} is inside its pass range", p.name);
        // the kept repetition is the median of the three recorded ones
        let mut reps = p.repeats.clone();
        reps.sort();
        assert_eq!((reps.len(), Some(reps[1])), (3, p.step_ns));
    }
    // phases and blocks
    let phases: BTreeSet<String> = tr.records.iter().filter_map(|r| r.phase()).collect();
    let want: BTreeSet<String> =
        ["train", "train/forward", "train/backward", "train/optimizer"].iter().map(|s| s.to_string()).collect();
    assert_eq!(phases, want);
    let fwd_blocks: BTreeSet<&str> = tr
        .records
        .iter()
        .filter(|r| r.phase().as_deref() == Some("train/forward"))
        .filter_map(|r| r.block_name())
        .collect();
    let bwd_blocks: BTreeSet<&str> = tr
        .records
        .iter()
        .filter(|r| r.phase().as_deref() == Some("train/backward"))
        .filter_map(|r| r.block_name())
        .collect();
    // a skip concatenation is built in forward by the ResBlock that reads it (with its GroupNorm
    // statistics), and that block delivers its parts' gradients in backward
    // (`groupnorm_silu_backward_cat_in`): no work in a range of its own either way
    assert!(fwd_blocks.iter().chain(&bwd_blocks).all(|b| !b.ends_with(".cat")));
    assert_eq!(fwd_blocks, bwd_blocks);
    for b in ["time_embed", "input_blocks.0.0", "middle_block.1", "output_blocks.0.0", "out"] {
        assert!(fwd_blocks.contains(b), "{b} in {fwd_blocks:?}");
    }
    // FLOPs counted per call agree with the analytic model (spec §8): forward = model::cost
    let f = cost::forward_flops(&cfg);
    assert!(
        (flops_in(tr, "train/forward") / f.total() - 1.0).abs() < 1e-12,
        "{} vs {}",
        flops_in(tr, "train/forward"),
        f.total()
    );
    assert!((flops_in(sa, "sample/forward") / f.total() - 1.0).abs() < 1e-12);
    // backward = 2 × forward, less the input conv's and the first time-embedding linear's input
    // gradients (neither exists): cost::train_step counts the first, we subtract the second
    let lin0 = 2.0 * (cfg.model_channels * cfg.emb_dim()) as f64;
    let fb = flops_in(tr, "train/forward") + flops_in(tr, "train/backward");
    assert!((fb / (f.train_step(&cfg) - lin0) - 1.0).abs() < 1e-12, "{fb}");
    let cats: BTreeSet<Category> = tr.records.iter().map(|r| r.category).collect();
    for c in [
        Category::ConvForward,
        Category::ConvBackward,
        Category::ConvWgrad,
        Category::Normalization,
        Category::Elementwise,
        Category::GemmAttention,
        Category::Reduction,
        Category::Optimizer,
        Category::Memory,
    ] {
        assert!(cats.contains(&c), "{c:?} missing from {cats:?}");
    }
    // the op names are what the classifier would say too (except the one-call conv backward)
    for r in &tr.records {
        if !matches!(r.category, Category::ConvBackward | Category::Memory) {
            assert_eq!(meddpm::analysis::kernels::classify(&r.name), r.category, "{}", r.name);
        }
    }
}

#[test]
fn null_backend_counts_the_whole_head_model() {
    let cfg = UNetConfig::whole_head();
    let be = Timed::new(NullBackend::default());
    let o = Options { warmup: 0, repeats: 1, measured: false, ..Options::default() };
    let passes = profile_unet(&be, &cfg, &o).unwrap();
    let f = cost::forward_flops(&cfg);
    assert!((flops_in(&passes[1], "sample/forward") / f.total() - 1.0).abs() < 1e-12);
    assert!(passes.iter().all(|p| !p.measured && p.step_ns.is_none()));
    // the input conv 3 → 64 at 128³: bytes of input, output, weights and bias, by hand
    let first = passes[1].records.iter().find(|r| r.name == "conv3d_forward").unwrap();
    let s = 128usize.pow(3);
    assert_eq!(first.bytes, Some(4.0 * (3 * s + 64 * s + 64 * 3 * 27 + 64) as f64));
    assert_eq!(first.flops, Some(ConvShape::new(Dims::new(1, 3, 128, 128, 128), 64, 3, 1).flops()));
    assert_eq!(first.block_name(), Some("input_blocks.0.0"));
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meddpm-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn report_folder_with_every_section() {
    let cfg = UNetConfig::tiny();
    let be = Timed::new(CpuBackend::new());
    let mut passes = profile_unet(&be, &cfg, &Options::default()).unwrap();
    let nb = Timed::new(NullBackend::default());
    let o = Options {
        warmup: 0,
        repeats: 1,
        measured: false,
        label: " (whole-head, counted)".into(),
        ..Options::default()
    };
    passes.extend(profile_unet(&nb, &UNetConfig::whole_head(), &o).unwrap());
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/ncu");
    let ncu = NcuData::load(Some(&fx.join("h200_conv_raw.csv")), Some(&fx.join("h200_conv_details.csv"))).unwrap();
    let pick = |ids: &[u64]| ncu.kernels.iter().filter(|k| ids.contains(&k.id)).cloned().collect::<Vec<_>>();
    let matrix = vec![
        ConfigInput::from_ncu("fp32 NCDHW", &pick(&[0])),
        ConfigInput::from_ncu("TF32 NCDHW", &pick(&[5, 6, 7, 8])),
    ];
    let input = Input {
        title: "tiny on CPU".into(),
        device: be.describe(),
        config: "tiny".into(),
        passes,
        ncu: Some(ncu),
        matrix,
        top_n: 10,
        ..Input::default()
    };
    let dir = tmp("report");
    let (r, files) = report::write(&input, &dir).unwrap();
    let names: BTreeSet<String> = files.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    for f in [
        "report.md",
        "report.json",
        "kernels.csv",
        "breakdown.csv",
        "roofline.csv",
        "gpus.csv",
        "ncu_kernels.csv",
        "ncu_priority.csv",
        "matrix.csv",
        "breakdown.svg",
        "roofline.svg",
        "matrix.svg",
        "matrix_categories.csv",
    ] {
        assert!(names.contains(f), "{f} not written: {names:?}");
    }
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    for s in [
        "## train step",
        "## sampling step",
        "### By block",
        "## Across GPUs",
        "Priority list",
        "TheoreticalOccupancy",
        "## Optimization matrix",
        "TF32 NCDHW",
        "### Kernel time by category per configuration",
        "| conv forward | 4.070 ms | 338.0 µs (0.083×) |",
        "| layout conversion | — | 78.4 µs |",
        "![kernel time by category per configuration](matrix.svg)",
    ] {
        assert!(md.contains(s), "report.md lacks {s:?}");
    }
    assert!(md.contains("not a GPU of the table"), "the CPU run cannot be checked against a GPU prediction");
    assert!(std::fs::read_to_string(dir.join("breakdown.svg")).unwrap().contains("<svg"));
    // breakdown.csv: the category rows of each measured pass add up to its Σ of calls
    let rows = csv::parse(&std::fs::read_to_string(dir.join("breakdown.csv")).unwrap());
    for p in r.passes.iter().filter(|p| p.measured) {
        let s: u64 =
            rows.iter().filter(|x| x[0] == p.name && x[1] == "category").map(|x| x[5].parse::<u64>().unwrap()).sum();
        assert_eq!(s, p.breakdown.kernel_ns);
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(json["passes"].as_array().unwrap().len(), 4);
    assert_eq!(json["priority"][0]["rule"], "TheoreticalOccupancy");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn report_without_inputs_says_what_is_missing() {
    let input = Input {
        title: "nothing".into(),
        device: "none".into(),
        not_collected: vec!["GPU kernel timeline: no CUDA device".into()],
        top_n: 5,
        ..Input::default()
    };
    let dir = tmp("empty");
    let (_, files) = report::write(&input, &dir).unwrap();
    assert!(files.iter().all(|f| !f.ends_with("breakdown.svg")));
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(md.contains("not collected: no Nsight Compute export was given"), "{md}");
    assert!(md.contains("- GPU kernel timeline: no CUDA device"));
    assert!(md.contains("needs at least two configurations"));
    assert!(md.contains("## GPU table (datasheet)"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A pass whose records carry no FLOP counts (as CUPTI kernel records) gets no roofline bound:
/// summing only its byte-counted copies would print a meaningless microsecond "bound".
#[test]
fn passes_without_flop_counts_get_no_roofline() {
    use meddpm::analysis::kernels::KernelRecord;
    let mut copy = KernelRecord::new("memcpy HtoD", 2_000);
    copy.bytes = Some(1e6);
    let mut conv = KernelRecord::new("sm90_xmma_fprop_implicit_gemm_tf32", 2_000_000);
    conv.flops = Some(4.6e11);
    conv.bytes = Some(1e9);
    let pass = |name: &str, records: Vec<KernelRecord>| Pass {
        name: name.into(),
        records,
        step_ns: Some(3_000_000),
        measured: true,
        repeats: vec![3_000_000],
        plain_step_ns: None,
        power: None,
    };
    let input = Input {
        title: "t".into(),
        device: "d".into(),
        passes: vec![
            pass("cupti pass", vec![KernelRecord::new("sm90_xmma_fprop_x", 2_000_000), copy]),
            pass("counted pass", vec![conv]),
        ],
        top_n: 5,
        ..Input::default()
    };
    let r = report::build(&input);
    let s = report::summary(&r);
    assert!(!s.contains("roofline bound, cupti pass"), "{s}");
    assert!(s.contains("roofline bound, counted pass"), "{s}");
    let md = report::markdown(&r);
    assert!(md.contains("No roofline: the records of this pass carry no FLOP counts"), "{md}");
}

/// A CUPTI-like pass (records with GPU start timestamps) next to a per-call pass without them:
/// the report splits the first one's step into kernels, gaps and time outside kernels (category
/// table, summary, "where the GPU waits", breakdown.csv, report.json, the chart), and keeps
/// step − Σ calls for the second; the first one's clock and power line.
#[test]
fn report_of_a_pass_with_gpu_timestamps() {
    use meddpm::analysis::kernels::KernelRecord;
    use meddpm::analysis::power::PowerSummary;
    let at = |name: &str, start: u64, ns: u64, range: &str| {
        let mut r = KernelRecord::new(name, ns);
        r.start_ns = Some(start);
        r.range = Some(range.into());
        r
    };
    // a 10 µs step, kernels at [1, 4) [3.5, 4.5) [5, 7) [7, 8) µs; by hand: busy 3.5 + 2 + 1 =
    // 6.5 µs, span 8 − 1 = 7 µs, one gap of 0.5 µs (before gn_apply; adam_step starts as gn_apply
    // ends), outside 10 − 7 = 3 µs, overlap Σ 7 − busy 6.5 = 0.5 µs
    let cupti = vec![
        at("conv3d_fwd_k3", 1_000, 3_000, "train/forward/input_blocks.1.0"),
        at("silu_fwd", 3_500, 1_000, "train/forward/input_blocks.1.0"),
        at("gn_apply", 5_000, 2_000, "train/forward/middle_block.0"),
        at("adam_step", 7_000, 1_000, "train/optimizer"),
    ];
    let mut synced = KernelRecord::new("conv3d_forward", 6_000);
    synced.flops = Some(1e9);
    synced.bytes = Some(1e6);
    let pass = |name: &str, records: Vec<KernelRecord>, step: u64| Pass {
        name: name.into(),
        records,
        step_ns: Some(step),
        measured: true,
        repeats: vec![step],
        plain_step_ns: None,
        power: None,
    };
    // clock and power over the pass's two steps (one plain, one recorded): 2.0 J a step
    let power = PowerSummary {
        samples: 40,
        seconds: 0.4,
        energy_j: Some(4.0),
        mean_power_w: Some(10.0),
        max_power_w: 11.0,
        sm_mhz_median: 1785,
        sm_mhz_min: 1590,
        sm_mhz_max_clock: Some(1980),
        power_limit_w: Some(700.0),
        power_capped_pct: 100.0,
        thermal_pct: 0.0,
    };
    let input = Input {
        title: "t".into(),
        device: "d".into(),
        passes: vec![
            Pass { plain_step_ns: Some(8_000), power: Some(power), ..pass("cupti step", cupti, 10_000) },
            pass("synced step", vec![synced], 8_000),
        ],
        top_n: 5,
        ..Input::default()
    };
    let dir = tmp("idle");
    let (r, files) = report::write(&input, &dir).unwrap();
    let i = r.passes[0].breakdown.idle.as_ref().unwrap();
    assert_eq!((i.busy_ns, i.span_ns, i.gaps_ns, i.outside_ns, i.overlap_ns), (6_500, 7_000, 500, 3_000, 500));
    assert!(r.passes[1].breakdown.idle.is_none());
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    // summary: gaps and outside for the CUPTI pass, step − Σ calls (2 µs) for the synced one
    assert!(
        md.contains(
            "| cupti step | measured | 4 | 10.0 µs | 10.0 µs – 10.0 µs (1 runs) | 8.0 µs (+25.0 %) | 7.0 µs | 500 ns | 3.0 µs | — |"
        ),
        "{md}"
    );
    assert!(
        md.contains("| synced step | measured | 1 | 8.0 µs | 8.0 µs – 8.0 µs (1 runs) | — | 6.0 µs | — | — | 2.0 µs |"),
        "{md}"
    );
    // the power line of the pass that has one (two steps: the plain and the recorded one), none for the other
    assert!(
        md.contains(
            "- cupti step: SM clock 1785 MHz median (min 1590, max 1980), 10 W mean (limit 700 W), 2.0 J a step, \
             power cap on in 100 % of 40 readings"
        ),
        "{md}"
    );
    assert!(!md.contains("- synced step: SM clock"), "{md}");
    // category table: idle rows, overlap correction, the step row
    assert!(md.contains("| GPU idle: gaps between kernels | 1 gap | 500 ns | — | 5.0 % |"), "{md}");
    assert!(md.contains("| GPU idle: before first / after last kernel | — | 3.0 µs | — | 30.0 % |"), "{md}");
    assert!(md.contains("| kernel overlap (concurrent time counted twice above) | — | -500 ns | — | -5.0 % |"), "{md}");
    assert!(md.contains("| **step** | 4 | 10.0 µs | — | 100.0 % |"), "{md}");
    assert!(md.contains("### Where the GPU waits"), "{md}");
    assert!(md.contains("| train/forward/middle_block.0 | 1 | 500 ns | 500 ns | 5.0 % |"), "{md}");
    // breakdown.csv: category and idle rows of the CUPTI pass sum to 100 % of the step
    let rows = csv::parse(&std::fs::read_to_string(dir.join("breakdown.csv")).unwrap());
    let pct: f64 = rows
        .iter()
        .filter(|x| x[0] == "cupti step" && (x[1] == "category" || x[1] == "idle"))
        .map(|x| x[7].parse::<f64>().unwrap())
        .sum();
    assert!((pct - 100.0).abs() < 1e-9, "{pct}");
    let ns: i64 = rows
        .iter()
        .filter(|x| x[0] == "cupti step" && (x[1] == "category" || x[1] == "idle"))
        .map(|x| x[5].parse::<i64>().unwrap())
        .sum();
    assert_eq!(ns, 10_000);
    let w = rows.iter().find(|x| x[0] == "cupti step" && x[1] == "idle_range").unwrap();
    assert_eq!(
        (w[2].as_str(), w[4].as_str(), w[5].as_str(), w[12].as_str()),
        ("train/forward/middle_block.0", "1", "500", "500")
    );
    assert!(rows.iter().all(|x| x[0] != "synced step" || !x[1].starts_with("idle")));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(json["passes"][0]["breakdown"]["idle"]["gaps_ns"], 500);
    assert!(json["passes"][1]["breakdown"]["idle"].is_null());
    assert_eq!(json["passes"][0]["power"]["sm_mhz_median"], 1785);
    assert!(json["passes"][1]["power"].is_null());
    assert!(files.iter().any(|f| f.ends_with("breakdown.svg")));
    let svg = std::fs::read_to_string(dir.join("breakdown.svg")).unwrap();
    assert!(svg.contains("GPU idle (gaps + outside kernels)") && svg.contains("step − Σ calls (no timestamps)"));
    let kcsv = csv::parse(&std::fs::read_to_string(dir.join("kernels.csv")).unwrap());
    assert_eq!(kcsv[0].last().map(|s| s.as_str()), Some("start_ns"));
    assert_eq!(kcsv[1].last().map(|s| s.as_str()), Some("1000"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// CUPTI records with registers, shared memory and block sizes on a GPU of the table get the
/// occupancy table: each top kernel's longest call, its resident blocks and what limits them
/// (numbers from real H200 launches); without a device of the
/// table, or without the launch details, the section is left out.
#[test]
fn report_lists_the_theoretical_occupancy_of_the_top_kernels() {
    use meddpm::analysis::gpus::find;
    use meddpm::analysis::kernels::KernelRecord;
    use meddpm::analysis::occupancy::Limiter;
    let launch = |name: &str, ns: u64, regs: u32, smem: u32, threads: u32| {
        let mut r = KernelRecord::new(name, ns);
        (r.registers, r.shared_mem, r.block) = (Some(regs), Some(smem), Some([threads, 1, 1]));
        r.range = Some("train/backward/output_blocks.9.0".into());
        r
    };
    let records = vec![
        // the split pass before the change (121 registers) and its short call (ignored: shorter)
        launch("gn_bwd_apply_split", 900_000, 121, 0, 256),
        launch("gn_bwd_apply_split", 10_000, 64, 0, 256),
        launch("chan_gnbwd3_ndhwc8", 200_000, 64, 32_768, 256),
        launch("gn_apply", 140_000, 56, 0, 256),
        KernelRecord::new("gn_stats_finalize", 5_000), // no launch details: no row
    ];
    let pass = Pass {
        name: "train step".into(),
        records,
        step_ns: Some(1_300_000),
        measured: true,
        repeats: vec![1_300_000],
        plain_step_ns: None,
        power: None,
    };
    let input = Input {
        title: "t".into(),
        device: "d".into(),
        device_gpu: find("h200"),
        passes: vec![pass],
        top_n: 10,
        ..Input::default()
    };
    let r = report::build(&input);
    let occ: Vec<_> = r.passes[0]
        .occupancy
        .iter()
        .map(|o| (o.kernel.as_str(), o.registers, o.occupancy.blocks_per_sm, o.occupancy.pct, o.occupancy.limiter))
        .collect();
    assert_eq!(
        occ,
        [
            ("gn_bwd_apply_split", 121, 2, 25.0, Limiter::Registers),
            ("chan_gnbwd3_ndhwc8", 64, 4, 50.0, Limiter::Registers),
            ("gn_apply", 56, 4, 50.0, Limiter::Registers),
        ]
    );
    let md = report::markdown(&r);
    assert!(md.contains("### Occupancy of the top kernels (theoretical)"), "{md}");
    assert!(md.contains("| gn_bwd_apply_split | 121 | 0 | 256 | 2 | 25.0 % | registers |"), "{md}");
    assert!(md.contains("| chan_gnbwd3_ndhwc8 | 64 | 32.0 KiB | 256 | 4 | 50.0 % | registers |"), "{md}");
    // not a GPU of the table: no limits, no section
    let r = report::build(&Input { device_gpu: None, ..input });
    assert!(r.passes[0].occupancy.is_empty());
    assert!(!report::markdown(&r).contains("### Occupancy"));
}

#[test]
fn profile_input_pieces() {
    use meddpm::analysis::gpus::Math;
    use meddpm::analysis::kernels::KernelRecord;
    use meddpm::analysis::profile::{median, preset_config};
    use meddpm::Precision;
    assert_eq!(median(vec![]), None);
    assert_eq!(median(vec![7]), Some(7));
    assert_eq!(median(vec![9, 1, 5]), Some(5));
    assert_eq!(median(vec![4, 1, 3, 2]), Some(3), "the upper median of an even count");
    assert_eq!(
        preset_config("tiny", &UNetConfig::tiny()),
        "preset tiny (8×8×8, 8 base channels, channel_mult [1, 2, 2]), batch 1"
    );
    let p = Pass::summed("PyTorch t".into(), vec![KernelRecord::new("a", 1_000), KernelRecord::new("b", 2_500)]);
    assert_eq!((p.name.as_str(), p.step_ns, p.measured, p.records.len()), ("PyTorch t", Some(3_500), true, 2));
    assert!(p.repeats.is_empty() && p.plain_step_ns.is_none());
    assert_eq!(Pass::summed("none".into(), Vec::new()).step_ns, Some(0));
    let maths: Vec<Math> = Precision::ALL.iter().map(|&p| Math::from(p)).collect();
    // fp8 has bf16's roof until it runs on a GPU
    assert_eq!(maths, [Math::Fp32, Math::Tf32, Math::Bf16, Math::Bf16]);
}
