//! Micro-benchmarks of the CUDA primitives that dominate Med-DDPM at 128³: conv3d 64→64 k3
//! (forward; backward = data + filter + bias) and GroupNorm (+SiLU) at 1×64×128³, in each
//! precision × layout, plus a device-to-device copy as the bandwidth ceiling.
//!
//! Usage: bench_primitives [OUT_DIR] [ITERS]. Timing: CUDA events around each call on the
//! backend's stream, after warm-up (which includes cudnnFind); the median of ITERS (default 10).
//! TFLOP/s counts 2·MACs of the forward (backward: twice that). GB/s counts the minimum traffic
//! (each input read once, each output written once). Writes OUT_DIR/primitives.json.

use meddpm::rng::Philox;
use meddpm::{Accum, Backend, ConvShape, Dims, Layout, Precision};
use meddpm_cuda::CudaBackend;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median ms of `iters` calls of `f` after `warm` warm-up calls.
fn time(be: &CudaBackend, warm: usize, iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..warm {
        f();
    }
    be.sync();
    let mut ms = Vec::new();
    for _ in 0..iters {
        let a = be.record_event();
        f();
        let b = be.record_event();
        b.synchronize().unwrap();
        ms.push(a.elapsed_ms(&b).unwrap() as f64);
    }
    median(ms)
}

struct Row {
    name: String,
    config: String,
    ms: f64,
    tflops: Option<f64>,
    gbs: Option<f64>,
    note: String,
}

/// Whole-head U-Net (128³, 64 channels, batch 1): sampling forward and one training micro-step
/// (q_sample, forward, L1, backward) plus the Adam step, per precision × layout.
fn unet_rows(rows: &mut Vec<Row>, iters: usize) {
    use meddpm::diffusion::{TrainConfig, Trainer};
    use meddpm::model::{UNet, UNetConfig};
    let cfg = UNetConfig::whole_head();
    let t0 = std::time::Instant::now();
    let budget = std::env::var("MEDDPM_BENCH_UNET_S").ok().and_then(|v| v.parse().ok()).unwrap_or(150.0);
    for (p, l) in [
        (Precision::Tf32, Layout::Ndhwc),
        (Precision::Fp32, Layout::Ndhwc),
        (Precision::Tf32, Layout::Ncdhw),
        (Precision::Fp32, Layout::Ncdhw),
    ] {
        if t0.elapsed().as_secs_f64() > budget {
            println!("unet: time budget used, skipping {p:?}/{l:?}");
            continue;
        }
        let conf = format!("{p:?}/{l:?}").to_lowercase();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let be = CudaBackend::new(0, p, l).unwrap();
            let (free0, total) = be.mem_info();
            {
                let mut net = UNet::new(&be, &cfg, 1).unwrap();
                net.init_params(&be, 1);
                let xd = net.input_dims();
                be.randn(net.input_mut(), Philox::new(5, 5), 0, xd);
                let ms = time(&be, 2, iters, || net.forward(&be, &[100.0]));
                be.take_conv_counts();
                net.forward(&be, &[100.0]);
                let counts = be.take_conv_counts();
                let gf = meddpm::model::cost::forward_flops(&cfg).total();
                // the same convolutions one by one: how much of the forward is cuDNN
                let mut shapes = counts;
                shapes.sort_by_key(|c| std::cmp::Reverse((c.0.flops() * c.1 as f64 * 1e-6) as u64));
                let (mut conv_ms, mut conv_gf) = (0.0, 0.0);
                let mut per = Vec::new();
                for (cs, uses) in shapes {
                    let mut xin = be.alloc(cs.x.numel()).unwrap();
                    be.randn(&mut xin, Philox::new(9, 9), 0, cs.x);
                    let w = be.alloc(cs.w_len()).unwrap();
                    let b = be.alloc(cs.cout).unwrap();
                    let mut y = be.alloc(cs.out().numel()).unwrap();
                    let t = time(&be, 1, 3, || be.conv3d_forward(&mut y, &xin, &w, &b, cs));
                    conv_ms += t * uses as f64;
                    conv_gf += cs.flops() * uses as f64;
                    per.push(format!("{}->{} k{} s{} x{uses}: {t:.3} ms", cs.x, cs.cout, cs.k, cs.stride));
                }
                println!("unet {conf} conv shapes (ms per call x uses): {}", per.join("; "));
                rows.push(Row {
                    name: "unet 128^3 sampling forward".into(),
                    config: conf.clone(),
                    ms,
                    tflops: Some(gf / ms / 1e9),
                    gbs: None,
                    note: format!(
                        "convs alone {conv_ms:.1} ms ({:.0} TFLOP/s), everything else {:.1} ms",
                        conv_gf / conv_ms / 1e9,
                        ms - conv_ms
                    ),
                });
            }
            let tc = TrainConfig { batch: 1, grad_accum: 1, ..TrainConfig::default() };
            let mut tr = Trainer::new(&be, &cfg, &tc).unwrap();
            let s = cfg.depth * cfg.size * cfg.size;
            let img: Vec<f32> = (0..s).map(|i| ((i % 97) as f32 / 48.0) - 1.0).collect();
            let cond: Vec<f32> = (0..2 * s).map(|i| if (i / 1000) % 2 == 0 { 1.0 } else { -1.0 }).collect();
            let ms = time(&be, 2, iters, || {
                tr.micro_step(&be, &img, &cond);
            });
            let (free1, _) = be.mem_info();
            let gf = meddpm::model::cost::forward_flops(&cfg).train_step(&cfg);
            rows.push(Row {
                name: "unet 128^3 train micro-step (fwd+L1+bwd)".into(),
                config: conf.clone(),
                ms,
                tflops: Some(gf / ms / 1e9),
                gbs: None,
                note: format!(
                    "device memory in use {:.1} GiB of {:.0}",
                    (total - free1) as f64 / (1u64 << 30) as f64,
                    total as f64 / (1u64 << 30) as f64
                ),
            });
            let ms = time(&be, 1, iters, || tr.opt_step(&be));
            rows.push(Row {
                name: "unet adam+ema step (40.2M params)".into(),
                config: conf.clone(),
                ms,
                tflops: None,
                gbs: None,
                note: format!("memory before {:.1} GiB in use", (total - free0) as f64 / (1u64 << 30) as f64),
            });
        }));
        if r.is_err() {
            rows.push(Row {
                name: "unet".into(),
                config: conf,
                ms: f64::NAN,
                tflops: None,
                gbs: None,
                note: "FAILED (see log)".into(),
            });
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let out_dir = args.get(1).cloned().unwrap_or_else(|| ".".into());
    let iters: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(10);
    let mut rows: Vec<Row> = Vec::new();
    let x = Dims::new(1, 64, 128, 128, 128);
    let cs = ConvShape::new(x, 64, 3, 1);
    let gf = cs.flops();
    let bytes = (x.numel() * 4) as f64;
    let rng = Philox::new(1, 99);
    let mut device = String::new();
    for p in [Precision::Fp32, Precision::Tf32] {
        for l in [Layout::Ncdhw, Layout::Ndhwc] {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let be = match CudaBackend::new(0, p, l) {
                    Ok(b) => b,
                    Err(e) => {
                        eprintln!("{e}");
                        std::process::exit(2);
                    }
                };
                device = be.describe();
                let cfg = format!("{p:?}/{l:?}").to_lowercase();
                let a = || be.alloc(x.numel()).unwrap();
                let (mut xin, mut y, mut dy, mut dx) = (a(), a(), a(), a());
                be.randn(&mut xin, rng, 0, x);
                be.randn(&mut dy, rng, 1 << 30, x);
                let mut w = be.alloc(cs.w_len()).unwrap();
                be.randn(&mut w, rng, 1 << 31, Dims::new(64, 64, 3, 3, 3));
                be.scale(&mut w, 1.0 / (64.0f32 * 27.0).sqrt());
                let mut b = be.alloc(64).unwrap();
                let (mut dw, mut db) = (be.alloc(cs.w_len()).unwrap(), be.alloc(64).unwrap());
                be.randn(&mut b, rng, 1 << 32, Dims::new(1, 64, 1, 1, 1));
                let t = time(&be, 2, iters, || be.conv3d_forward(&mut y, &xin, &w, &b, cs));
                let algos = be.conv_algos(&cs);
                let note = |i: usize| {
                    algos[i]
                        .map(|a| {
                            let fused = be.conv_fused_bias(&cs);
                            format!(
                                "algo {} math {} ws {} MiB, find {:.3} ms, bias fused {fused:?}",
                                a.id,
                                a.math,
                                a.ws >> 20,
                                a.ms
                            )
                        })
                        .unwrap_or_default()
                };
                rows.push(Row {
                    name: "conv3d 64->64 k3 fwd".into(),
                    config: cfg.clone(),
                    ms: t,
                    tflops: Some(gf / t / 1e9),
                    gbs: None,
                    note: note(0),
                });
                let t = time(&be, 2, iters, || {
                    be.conv3d_backward(Some((&mut dx, Accum::Overwrite)), &mut dw, Some(&mut db), &dy, &xin, &w, cs)
                });
                let algos = be.conv_algos(&cs);
                let nb = format!(
                    "data: {} | filter: {}",
                    algos[1].map(|a| format!("algo {} math {} find {:.3} ms", a.id, a.math, a.ms)).unwrap_or_default(),
                    algos[2].map(|a| format!("algo {} math {} find {:.3} ms", a.id, a.math, a.ms)).unwrap_or_default()
                );
                rows.push(Row {
                    name: "conv3d 64->64 k3 bwd (data+filter+bias)".into(),
                    config: cfg.clone(),
                    ms: t,
                    tflops: Some(2.0 * gf / t / 1e9),
                    gbs: None,
                    note: nb,
                });

                let g = 32;
                let (mut mean, mut rstd) = (be.alloc(g).unwrap(), be.alloc(g).unwrap());
                let mut gamma = be.alloc(64).unwrap();
                let mut beta = be.alloc(64).unwrap();
                be.randn(&mut gamma, rng, 7 << 30, Dims::new(1, 64, 1, 1, 1));
                be.randn(&mut beta, rng, 8 << 30, Dims::new(1, 64, 1, 1, 1));
                let (mut dg, mut dbt) = (be.alloc(64).unwrap(), be.alloc(64).unwrap());
                let t = time(&be, 2, iters, || {
                    be.groupnorm_forward(&mut y, &mut mean, &mut rstd, &xin, &gamma, &beta, x, g)
                });
                rows.push(Row {
                    name: "groupnorm fwd 64x128^3 G32".into(),
                    config: cfg.clone(),
                    ms: t,
                    tflops: None,
                    gbs: Some(2.0 * bytes / t / 1e6),
                    note: "min traffic: read x, write y".into(),
                });
                let mut act = a();
                let t = time(&be, 2, iters, || {
                    be.groupnorm_silu_forward(&mut act, &mut mean, &mut rstd, &xin, None, &gamma, &beta, x, g)
                });
                rows.push(Row {
                    name: "groupnorm+silu fwd".into(),
                    config: cfg.clone(),
                    ms: t,
                    tflops: None,
                    gbs: Some(2.0 * bytes / t / 1e6),
                    note: "read x, write act".into(),
                });
                let t = time(&be, 2, iters, || {
                    #[rustfmt::skip]
                    be.groupnorm_silu_backward((&mut dx, Accum::Overwrite), &mut dg, &mut dbt, &dy, &xin, None, &mean, &rstd, &gamma, &beta, x, g);
                });
                rows.push(Row {
                    name: "groupnorm+silu bwd".into(),
                    config: cfg.clone(),
                    ms: t,
                    tflops: None,
                    gbs: Some(4.0 * bytes / t / 1e6),
                    note: "read dout, x, gn_out, write dx".into(),
                });
                if p == Precision::Fp32 && l == Layout::Ncdhw {
                    let t = time(&be, 2, iters, || be.copy(&mut dx, &xin));
                    rows.push(Row {
                        name: "copy d2d 512 MiB (ceiling)".into(),
                        config: "-".into(),
                        ms: t,
                        tflops: None,
                        gbs: Some(2.0 * bytes / t / 1e6),
                        note: "read + write".into(),
                    });
                    let t = time(&be, 2, iters, || be.silu_forward(&mut y, &xin));
                    rows.push(Row {
                        name: "silu fwd".into(),
                        config: cfg.clone(),
                        ms: t,
                        tflops: None,
                        gbs: Some(2.0 * bytes / t / 1e6),
                        note: String::new(),
                    });
                }
            }));
            if r.is_err() {
                rows.push(Row {
                    name: "conv3d/groupnorm".into(),
                    config: format!("{p:?}/{l:?}").to_lowercase(),
                    ms: f64::NAN,
                    tflops: None,
                    gbs: None,
                    note: "FAILED (see log)".into(),
                });
            }
        }
    }
    if std::env::var("MEDDPM_BENCH_UNET").map(|v| v != "0").unwrap_or(true) {
        unet_rows(&mut rows, iters.min(5));
    }
    // JSON
    let mut j = String::from("{\n  \"device\": ");
    j += &format!("{:?},\n  \"iters\": {iters},\n  \"rows\": [\n", device);
    for (i, r) in rows.iter().enumerate() {
        j += &format!(
            "    {{\"name\": {:?}, \"config\": {:?}, \"median_ms\": {:.4}, \"tflops\": {}, \"gbs\": {}, \"note\": {:?}}}{}\n",
            r.name,
            r.config,
            r.ms,
            r.tflops.map(|v| format!("{v:.2}")).unwrap_or("null".into()),
            r.gbs.map(|v| format!("{v:.1}")).unwrap_or("null".into()),
            r.note,
            if i + 1 < rows.len() { "," } else { "" }
        );
    }
    j += "  ]\n}\n";
    let _ = std::fs::create_dir_all(&out_dir);
    let path = std::path::Path::new(&out_dir).join("primitives.json");
    if let Err(e) = std::fs::write(&path, j) {
        eprintln!("{}: {e}", path.display());
    }
    println!("{device}");
    println!("| primitive | precision/layout | median ms | TFLOP/s | GB/s | notes |");
    println!("|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {:.3} | {} | {} | {} |",
            r.name,
            r.config,
            r.ms,
            r.tflops.map(|v| format!("{v:.1}")).unwrap_or("-".into()),
            r.gbs.map(|v| format!("{v:.0}")).unwrap_or("-".into()),
            r.note
        );
    }
}
