//! `bench --gpus`'s measurement (`dist::scaling`) on the CPU with ranks as threads: every rank
//! returns the same gathered figures, built from each rank's own medians by the stated formulas,
//! with the requested number of timed steps, and the ranks end with the same weights (the synced
//! phase really averaged). Every rank's collective figures reach every rank in rank order, and
//! rank 0's table has a row per rank. No assertion on how fast anything is.

use meddpm::cpu::CpuBackend;
use meddpm::diffusion::{TrainConfig, Trainer};
use meddpm::dist::scaling::{gather_rank_comm, measure, median, rank_table, RankComm, Scaling};
use meddpm::dist::{BucketPlan, ThreadSync};
use meddpm::model::UNetConfig;
use meddpm::Backend;
use std::time::Duration;

#[test]
fn figures_follow_from_the_medians() {
    let s = Scaling::from_medians(2, vec![100.0, 110.0], vec![120.0, 125.0]).unwrap();
    assert_eq!((s.world, s.one_gpu_ms, s.dp_ms), (2, 105.0, 125.0));
    assert!((s.speedup - 2.0 * 105.0 / 125.0).abs() < 1e-12);
    assert!((s.efficiency_pct - 100.0 * 105.0 / 125.0).abs() < 1e-12);
    assert!(Scaling::from_medians(1, vec![1.0], vec![]).is_err());
    assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
    assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
}

#[test]
fn two_thread_ranks_measure_the_same_scaling() {
    let cfg = UNetConfig::tiny();
    let tc = TrainConfig { batch: 1, grad_accum: 1, lr: 1e-3, ..TrainConfig::default() };
    let syncs = ThreadSync::group(2, &BucketPlan::for_unet(&cfg, 4096), Duration::from_secs(60));
    let handles: Vec<_> = syncs
        .into_iter()
        .enumerate()
        .map(|(r, mut sync)| {
            let (cfg, tc) = (cfg.clone(), tc.clone());
            std::thread::spawn(move || {
                let be = CpuBackend::new();
                let mut tr = Trainer::new(&be, &cfg, &tc).unwrap();
                let mut k = 0u32;
                let next = || {
                    k += 1;
                    Ok(meddpm::phantom::pair(cfg.depth, cfg.size, cfg.size, (k + 3 * r as u32) % 5))
                };
                let (s, one, dp) = measure(&be, &mut tr, &mut sync, 1, 3, next).unwrap();
                let mut w = vec![0f32; be.len(&tr.net.params[5])];
                be.download(&tr.net.params[5], &mut w);
                (s, one, dp, w, tr.step)
            })
        })
        .collect();
    let out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(out[0].0, out[1].0, "every rank returns the gathered figures");
    let s = &out[0].0;
    assert_eq!((s.world, s.samples_per_rank), (2, 1));
    for (r, (_, one, dp, _, steps)) in out.iter().enumerate() {
        assert_eq!((one.len(), dp.len()), (3, 3), "rank {r}: timed steps");
        assert_eq!(s.one_gpu_ms_by_rank[r], median(one), "rank {r}");
        assert_eq!(s.dp_ms_by_rank[r], median(dp), "rank {r}");
        assert_eq!(*steps, 8, "rank {r}: 4 one-GPU + 4 synced optimizer steps");
    }
    assert_eq!(s.dp_ms, s.dp_ms_by_rank.iter().copied().fold(0.0, f64::max));
    assert!((s.speedup - 2.0 * s.one_gpu_ms / s.dp_ms).abs() < 1e-12);
    assert_eq!(out[0].3, out[1].3, "the synced phase leaves both ranks with the same weights");
}

/// Three thread ranks, each with its own figures (rank 1 measured no idle time): all of them get
/// every rank's, in rank order, and the table shows each rank's own numbers.
#[test]
fn every_ranks_collective_figures_are_gathered_in_rank_order() {
    let cfg = UNetConfig::tiny();
    let syncs = ThreadSync::group(3, &BucketPlan::for_unet(&cfg, 4096), Duration::from_secs(60));
    let handles: Vec<_> = syncs
        .into_iter()
        .enumerate()
        .map(|(r, mut sync)| {
            std::thread::spawn(move || {
                let be = CpuBackend::new();
                let idle = if r == 1 { None } else { Some(0.25 * r as f64) };
                gather_rank_comm(&mut sync, &be, [Some(1.0 + r as f64), Some(50.0 + 10.0 * r as f64), idle]).unwrap()
            })
        })
        .collect();
    let out: Vec<Vec<RankComm>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let want: Vec<RankComm> = (0..3)
        .map(|r| RankComm {
            rank: r,
            allreduce_ms: Some(1.0 + r as f64),
            hidden_pct: Some(50.0 + 10.0 * r as f64),
            idle_ms: if r == 1 { None } else { Some(0.25 * r as f64) },
        })
        .collect();
    for (r, got) in out.iter().enumerate() {
        assert_eq!(got, &want, "rank {r}");
    }
    let t = rank_table("bf16 ndhwc", &out[0]);
    let lines: Vec<&str> = t.lines().collect();
    assert_eq!(lines.len(), 4, "{t}");
    assert!(lines[2].split_whitespace().collect::<Vec<_>>() == ["bf16", "ndhwc", "1", "2.00", "60.00%", "-"], "{t}");
    assert!(lines[3].ends_with("0.50"), "{t}");
}
