//! Survey cuDNN's backend-API engine configurations for the whole-head U-Net's large
//! convolutions (bf16 NDHWC, 128³ and 64³, k = 3): each configuration's median time, against
//! the 2·MACs FLOP count (TFLOP/s). Usage: cudnn_engines [REPS] [SHAPES] where SHAPES is a
//! comma list of `cin:cout:size` (default 64:64:128,128:64:128,128:128:64,256:128:64).
//! Prints a table per shape and direction, fastest first (the plan column: the tail of cuDNN's
//! JSON for the plan, the engine and its knobs), then one summary line each.

use meddpm::{Backend, ConvShape, Dims, Layout, Precision};
use meddpm_cuda::{ConvDir, CudaBackend};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let reps: usize = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(5);
    let shapes = args.get(2).cloned().unwrap_or_else(|| "64:64:128,128:64:128,128:128:64,256:128:64".into());
    let be = match CudaBackend::new(0, Precision::Bf16, Layout::Ndhwc) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("cudnn_engines: no CUDA backend: {e}");
            std::process::exit(1);
        }
    };
    println!("{}", be.describe());
    let mut summary = Vec::new();
    for s in shapes.split(',') {
        let v: Vec<usize> = s.split(':').filter_map(|t| t.parse().ok()).collect();
        let [cin, cout, n] = v[..] else {
            eprintln!("cudnn_engines: shape {s:?} is not cin:cout:size");
            std::process::exit(2);
        };
        let cs = ConvShape::new(Dims::new(1, cin, n, n, n), cout, 3, 1);
        let flops = 2.0 * (n * n * n) as f64 * (cin * cout * 27) as f64;
        for dir in [ConvDir::Fwd, ConvDir::BwdData, ConvDir::BwdFilter] {
            let t0 = std::time::Instant::now();
            let rows = match be.conv_engine_survey(cs, dir, reps) {
                Ok(r) => r,
                Err(e) => {
                    println!("{cin}->{cout} at {n}³ {}: {e}", dir.tag());
                    continue;
                }
            };
            let mut ok: Vec<_> = rows.iter().filter_map(|r| r.ms.as_ref().ok().map(|m| (*m, r))).collect();
            ok.sort_by(|a, b| a.0.total_cmp(&b.0));
            println!(
                "\n## {cin}->{cout} at {n}³ {} ({} configurations, {} ran, {:.1} s)",
                dir.tag(),
                rows.len(),
                ok.len(),
                t0.elapsed().as_secs_f64()
            );
            println!("| ms | TFLOP/s | source | engine | workspace MiB | plan |");
            println!("|---|---|---|---|---|---|");
            for (ms, r) in &ok {
                // the plan's JSON opens with the operation graph (the same for every row); the
                // engine and its knob choices come last
                let n = r.json.chars().count();
                let j: String = r.json.chars().skip(n.saturating_sub(200)).collect();
                println!(
                    "| {ms:.3} | {:.0} | {} | {} | {:.1} | {j} |",
                    flops / (*ms as f64 * 1e-3) / 1e12,
                    r.source,
                    r.engine,
                    r.workspace as f64 / (1 << 20) as f64
                );
            }
            for r in rows.iter().filter(|r| r.ms.is_err()).take(6) {
                println!("| — | — | {} | {} | — | {} |", r.source, r.engine, r.ms.as_ref().unwrap_err());
            }
            if let (Some(best), Some(first)) = (ok.first(), rows.iter().find(|r| r.source.starts_with("A#"))) {
                summary.push(format!(
                    "{cin}->{cout} at {n}³ {}: best {:.3} ms ({}, engine {}), heuristic A#0 {}",
                    dir.tag(),
                    best.0,
                    best.1.source,
                    best.1.engine,
                    first.ms.as_ref().map(|m| format!("{m:.3} ms")).unwrap_or_else(|e| e.clone())
                ));
            }
        }
    }
    println!("\n# summary");
    for l in summary {
        println!("{l}");
    }
}
