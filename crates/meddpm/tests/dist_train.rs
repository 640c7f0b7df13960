//! Data-parallel training on the CPU with ranks as threads (`dist::ThreadSync`, the in-process
//! stand-in for NCCL): 2 ranks × batch 1 equal 1 rank × batch 2 with the same seed over 10
//! optimizer steps (to fp32 round-off), with every gradient bucket started from inside backward;
//! the ranks' weights stay bit-identical and a divergence is caught by the hash check; the
//! checkpoint keeps the global sample position for a resume with another world size.

use meddpm::checkpoint::{save_trainer, Checkpoint};
use meddpm::cpu::CpuBackend;
use meddpm::data::Shard;
use meddpm::diffusion::{TrainConfig, Trainer};
use meddpm::dist::{broadcast_state, check_weights, BucketPlan, GradSync, ThreadSync};
use meddpm::model::UNetConfig;
use meddpm::testing::{compare, Tolerance};
use meddpm::Backend;
use std::time::Duration;

const STEPS: u64 = 10;

fn tc(batch: usize) -> TrainConfig {
    TrainConfig { lr: 2e-3, seed: 11, batch, grad_accum: 2, ema_start: 4, ema_every: 2, ..TrainConfig::default() }
}

/// The next batch of a rank reading `shard` of the global stream: global sample g is phantom
/// variant g mod 5, so different samples really differ.
fn next_batch(cfg: &UNetConfig, shard: Shard, k: &mut u64) -> (Vec<f32>, Vec<f32>) {
    let (mut img, mut cond) = (Vec::new(), Vec::new());
    for _ in 0..shard.block {
        let g = shard.global(0, *k);
        *k += 1;
        let (i, c) = meddpm::phantom::pair(cfg.depth, cfg.size, cfg.size, (g % 5) as u32);
        img.extend(i);
        cond.extend(c);
    }
    (img, cond)
}

/// What a run leaves: online weights, EMA, and the per-step losses (mean over the global batch).
struct Outcome {
    params: Vec<Vec<f32>>,
    ema: Vec<Vec<f32>>,
    losses: Vec<f32>,
}

fn host(be: &CpuBackend, bufs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    bufs.iter()
        .map(|b| {
            let mut h = vec![0f32; be.len(b)];
            be.download(b, &mut h);
            h
        })
        .collect()
}

fn single(cfg: &UNetConfig, batch: usize) -> Outcome {
    let be = CpuBackend::new();
    let mut tr = Trainer::new(&be, cfg, &tc(batch)).unwrap();
    let shard = Shard::new(0, 1, batch).unwrap();
    let mut k = 0;
    let losses = (0..STEPS).map(|_| tr.train_step(&be, || Ok(next_batch(cfg, shard, &mut k))).unwrap()).collect();
    Outcome { params: host(&be, &tr.net.params), ema: host(&be, &tr.ema), losses }
}

/// `world` ranks as threads, batch 1 each; per rank: its outcome and how many buckets started
/// inside backward and at `finish`.
fn ranks(cfg: &UNetConfig, world: usize, cap: usize) -> Vec<(Outcome, usize, usize)> {
    let plan = BucketPlan::for_unet(cfg, cap);
    let syncs = ThreadSync::group(world, &plan, Duration::from_secs(120));
    let handles: Vec<_> = syncs
        .into_iter()
        .enumerate()
        .map(|(r, mut sync)| {
            let cfg = cfg.clone();
            std::thread::spawn(move || {
                let be = CpuBackend::new();
                let mut tr = Trainer::new(&be, &cfg, &tc(1)).unwrap();
                tr.set_rank(r, world).unwrap();
                broadcast_state(&mut sync, &be, &mut tr).unwrap();
                let shard = Shard::new(r, world, 1).unwrap();
                let mut k = 0;
                let mut losses = Vec::new();
                for _ in 0..STEPS {
                    let l = tr.train_step_synced(&be, || Ok(next_batch(&cfg, shard, &mut k)), &mut sync).unwrap();
                    let all = sync.all_gather_u64(&be, l.to_bits() as u64).unwrap();
                    losses.push(all.iter().map(|&b| f32::from_bits(b as u32)).sum::<f32>() / world as f32);
                    check_weights(&mut sync, &be, &tr).unwrap();
                }
                assert_eq!(tr.samples, STEPS * 2 * world as u64, "global samples drawn");
                let out = Outcome { params: host(&be, &tr.net.params), ema: host(&be, &tr.ema), losses };
                (out, sync.started_in_backward, sync.started_at_finish)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn all_close(name: &str, a: &[Vec<f32>], b: &[Vec<f32>], tol: Tolerance) -> Result<(), String> {
    let (fa, fb): (Vec<f32>, Vec<f32>) = (a.concat(), b.concat());
    compare(name, &fa, &fb, tol).map(|_| ())
}

#[test]
fn two_ranks_of_batch_1_equal_one_rank_of_batch_2() {
    let cfg = UNetConfig::tiny();
    let reference = single(&cfg, 2);
    let plan_len = BucketPlan::for_unet(&cfg, 4096).len();
    let out = ranks(&cfg, 2, 4096);
    let tol = Tolerance::new(1e-5, 1e-5);
    for (r, (o, in_backward, at_finish)) in out.iter().enumerate() {
        assert_eq!((*in_backward, *at_finish), (STEPS as usize * plan_len, 0), "rank {r}: buckets started in backward");
        all_close(&format!("rank {r} weights vs 1×2"), &o.params, &reference.params, tol).unwrap();
        all_close(&format!("rank {r} EMA vs 1×2"), &o.ema, &reference.ema, tol).unwrap();
        compare(&format!("rank {r} losses vs 1×2"), &o.losses, &reference.losses, Tolerance::new(1e-6, 1e-5)).unwrap();
    }
    // the ranks hold the same bits
    assert!(out[0].0.params.iter().zip(&out[1].0.params).all(|(a, b)| a == b));
    assert!(out[0].0.ema.iter().zip(&out[1].0.ema).all(|(a, b)| a == b));
    // the comparison can fail: one rank with batch 1 (half the data) is far outside the tolerance
    let half = single(&cfg, 1);
    assert!(all_close("1×1 vs 1×2", &half.params, &reference.params, tol).is_err());
    // one bucket for everything (started at the end of backward) gives the same result
    let one = ranks(&cfg, 2, usize::MAX / 8);
    all_close("one bucket vs 1×2", &one[0].0.params, &reference.params, tol).unwrap();
}

#[test]
fn three_ranks_equal_one_rank_of_batch_3() {
    let cfg = UNetConfig { channel_mult: vec![1, 2], attention_ds: vec![2], ..UNetConfig::tiny() };
    let reference = single(&cfg, 3);
    let out = ranks(&cfg, 3, 1 << 20);
    for (o, ..) in &out {
        all_close("3×1 vs 1×3", &o.params, &reference.params, Tolerance::new(1e-5, 1e-5)).unwrap();
    }
}

#[test]
fn a_diverged_rank_is_caught_by_the_weight_hash() {
    let cfg = UNetConfig::tiny();
    let plan = BucketPlan::for_unet(&cfg, 1 << 20);
    let handles: Vec<_> = ThreadSync::group(2, &plan, Duration::from_secs(120))
        .into_iter()
        .enumerate()
        .map(|(r, mut sync)| {
            let cfg = cfg.clone();
            std::thread::spawn(move || {
                let be = CpuBackend::new();
                let mut tr = Trainer::new(&be, &cfg, &tc(1)).unwrap();
                tr.set_rank(r, 2).unwrap();
                let shard = Shard::new(r, 2, 1).unwrap();
                let mut k = 0;
                tr.train_step_synced(&be, || Ok(next_batch(&cfg, shard, &mut k)), &mut sync).unwrap();
                check_weights(&mut sync, &be, &tr).unwrap();
                if r == 1 {
                    // one flipped bit in one weight of rank 1
                    let mut h = vec![0f32; be.len(&tr.net.params[5])];
                    be.download(&tr.net.params[5], &mut h);
                    h[0] = f32::from_bits(h[0].to_bits() ^ 1);
                    be.upload(&h, &mut tr.net.params[5]);
                }
                check_weights(&mut sync, &be, &tr).unwrap_err().to_string()
            })
        })
        .collect();
    for h in handles {
        let e = h.join().unwrap();
        assert!(e.contains("diverged") && e.contains("rank 1") && e.contains("step 1"), "{e}");
    }
}

#[test]
fn the_checkpoint_keeps_the_global_position_for_another_world_size() {
    let cfg = UNetConfig::tiny();
    let plan = BucketPlan::for_unet(&cfg, 1 << 20);
    let dir = std::env::temp_dir().join(format!("meddpm-dist-ck-{}", std::process::id()));
    let path = dir.join("ck.safetensors");
    let handles: Vec<_> = ThreadSync::group(2, &plan, Duration::from_secs(120))
        .into_iter()
        .enumerate()
        .map(|(r, mut sync)| {
            let (cfg, path) = (cfg.clone(), path.clone());
            std::thread::spawn(move || {
                let be = CpuBackend::new();
                let mut tr = Trainer::new(&be, &cfg, &tc(1)).unwrap();
                tr.set_rank(r, 2).unwrap();
                let shard = Shard::new(r, 2, 1).unwrap();
                let mut k = 0;
                for _ in 0..3 {
                    tr.train_step_synced(&be, || Ok(next_batch(&cfg, shard, &mut k)), &mut sync).unwrap();
                }
                if r == 0 {
                    save_trainer(&path, &be, &tr).unwrap();
                }
                (tr.draws, tr.samples)
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), (6, 12), "3 steps × 2 micro-steps; × 2 ranks global samples");
    }
    let ck = Checkpoint::read(&path).unwrap();
    assert_eq!((ck.step, ck.draws, ck.samples, ck.world), (3, 6, Some(12), 2));
    // resumed as one rank: the next micro-step draws global sample 12, what rank 0 of two would
    let be = CpuBackend::new();
    let mut tr = ck.restore_trainer(&be).unwrap();
    assert_eq!((tr.samples, tr.first_sample()), (12, 12));
    tr.set_rank(1, 3).unwrap();
    assert_eq!(tr.first_sample(), 13, "rank 1 of 3 with batch 1 starts one sample later");
    assert!(tr.set_rank(3, 3).is_err());
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn a_mismatched_sync_is_refused() {
    let be = CpuBackend::new();
    let cfg = UNetConfig::tiny();
    let mut tr = Trainer::new(&be, &cfg, &tc(1)).unwrap();
    let mut syncs = ThreadSync::group(2, &BucketPlan::for_unet(&cfg, 1 << 20), Duration::from_secs(5));
    let e = tr.train_step_synced(&be, || unreachable!(), &mut syncs[0]).unwrap_err().to_string();
    assert!(e.contains("rank 0 of 1") && e.contains("rank 0 of 2"), "{e}");
}
