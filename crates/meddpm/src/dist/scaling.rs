//! `meddpm bench --gpus N`: the data-parallel training step against one GPU's, on the same ranks.
//!
//! Every rank first times plain optimizer steps on its own GPU (`Trainer::train_step`, no
//! collective: what one GPU does), then — after rank 0's state is broadcast — synced steps
//! (`Trainer::train_step_synced`: the same micro-steps plus the bucketed gradient all-reduce),
//! each bracketed by `Backend::sync`. The ranks' medians are gathered, so every rank returns the
//! same [`Scaling`]. With batch b per GPU, one GPU trains b samples per `one_ms` and W GPUs W·b
//! per `dp_ms`: speedup = W · one_ms / dp_ms, efficiency = speedup / W = one_ms / dp_ms.
//!
//! Every rank also measures its own collective over a few synced steps (the CUDA side records
//! the kernels): the all-reduce time per step, the share of it other kernels hid, and the GPU's
//! idle time per step. [`gather_rank_comm`] brings every rank's figures to every rank (rank 0
//! prints them, [`rank_table`]): a slow or starved rank shows in its own row, not only rank 0's.

use super::{broadcast_state, check_weights, GradSync};
use crate::backend::Backend;
use crate::diffusion::Trainer;
use crate::error::{Error, Result};
use serde::Serialize;
use std::time::Instant;

/// One data-parallel configuration's step times and scaling.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Scaling {
    pub world: usize,
    /// Samples per GPU and optimizer step (batch × grad_accum).
    pub samples_per_rank: usize,
    /// Each rank's median plain step on its own GPU, ms (rank order).
    pub one_gpu_ms_by_rank: Vec<f64>,
    /// Their mean: the one-GPU step time, ms.
    pub one_gpu_ms: f64,
    /// Each rank's median synced step, ms (rank order; the ranks run in lockstep).
    pub dp_ms_by_rank: Vec<f64>,
    /// The slowest rank's median synced step, ms.
    pub dp_ms: f64,
    /// Training throughput of W GPUs over one GPU's: W · one_gpu_ms / dp_ms.
    pub speedup: f64,
    /// speedup / W, %.
    pub efficiency_pct: f64,
}

impl Scaling {
    /// The figures from every rank's medians.
    pub fn from_medians(samples_per_rank: usize, one: Vec<f64>, dp: Vec<f64>) -> Result<Scaling> {
        let world = one.len();
        if world == 0 || dp.len() != world {
            return Err(Error::Config(format!("scaling: {} one-GPU and {} synced times", one.len(), dp.len())));
        }
        let one_gpu_ms = one.iter().sum::<f64>() / world as f64;
        let dp_ms = dp.iter().copied().fold(f64::NAN, f64::max);
        let speedup = world as f64 * one_gpu_ms / dp_ms;
        Ok(Scaling {
            world,
            samples_per_rank,
            one_gpu_ms_by_rank: one,
            one_gpu_ms,
            dp_ms_by_rank: dp,
            dp_ms,
            speedup,
            efficiency_pct: 100.0 * speedup / world as f64,
        })
    }
}

/// Median of `v` (NaN when empty).
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => 0.5 * (s[n / 2 - 1] + s[n / 2]),
    }
}

/// `warmup` untimed then `iters` timed runs of `step`, each between two `be.sync()`; ms.
fn timed<B: Backend>(be: &B, warmup: usize, iters: usize, mut step: impl FnMut() -> Result<f32>) -> Result<Vec<f64>> {
    let mut ms = Vec::with_capacity(iters);
    for i in 0..warmup + iters {
        be.sync();
        let t0 = Instant::now();
        let loss = step()?;
        be.sync();
        if !loss.is_finite() {
            return Err(Error::Dist(format!("the training loss is {loss} at timed step {i}")));
        }
        if i >= warmup {
            ms.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(ms)
}

/// Time one-GPU steps then synced steps on this rank (see the module doc); every rank calls it
/// at the same time with a fresh trainer. `next` supplies this rank's batches. Returns the
/// gathered figures and this rank's own step times (one GPU, synced). The ranks' weights are
/// compared by hash at the end.
pub fn measure<B: Backend>(
    be: &B,
    tr: &mut Trainer<B>,
    sync: &mut dyn GradSync<B>,
    warmup: usize,
    iters: usize,
    mut next: impl FnMut() -> Result<(Vec<f32>, Vec<f32>)>,
) -> Result<(Scaling, Vec<f64>, Vec<f64>)> {
    if iters == 0 {
        return Err(Error::Config("scaling: at least one timed step".into()));
    }
    tr.set_rank(0, 1)?;
    let one = timed(be, warmup, iters, || tr.train_step(be, &mut next))?;
    tr.set_rank(sync.rank(), sync.world())?;
    broadcast_state(sync, be, tr)?;
    let dp = timed(be, warmup, iters, || tr.train_step_synced(be, &mut next, sync))?;
    check_weights(sync, be, tr)?;
    let gather = |sync: &mut dyn GradSync<B>, v: f64| -> Result<Vec<f64>> {
        Ok(sync.all_gather_u64(be, v.to_bits())?.into_iter().map(f64::from_bits).collect())
    };
    let ones = gather(sync, median(&one))?;
    let dps = gather(sync, median(&dp))?;
    Ok((Scaling::from_medians(tr.tc.batch * tr.tc.grad_accum, ones, dps)?, one, dp))
}

/// One rank's collective figures over the synced steps `bench --gpus` records (per step).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RankComm {
    pub rank: usize,
    /// All-reduce kernel time per step, ms (None: not measured on that rank).
    pub allreduce_ms: Option<f64>,
    /// The share of it during which other kernels ran, %.
    pub hidden_pct: Option<f64>,
    /// GPU idle per step (no kernel running: gaps, and before the first / after the last), ms.
    pub idle_ms: Option<f64>,
}

/// Every rank's [`RankComm`], in rank order, on every rank; `mine` is this rank's (all-reduce
/// ms, hidden %, idle ms). Three gathers of one value each.
pub fn gather_rank_comm<B: Backend>(
    sync: &mut dyn GradSync<B>,
    be: &B,
    mine: [Option<f64>; 3],
) -> Result<Vec<RankComm>> {
    let mut cols = Vec::with_capacity(3);
    for v in mine {
        let all = sync.all_gather_u64(be, v.unwrap_or(f64::NAN).to_bits())?;
        cols.push(all.into_iter().map(f64::from_bits).map(|x| (!x.is_nan()).then_some(x)).collect::<Vec<_>>());
    }
    Ok((0..sync.world())
        .map(|r| RankComm { rank: r, allreduce_ms: cols[0][r], hidden_pct: cols[1][r], idle_ms: cols[2][r] })
        .collect())
}

/// The per-rank table of one configuration, a line per rank ("-" where not measured).
pub fn rank_table(config: &str, ranks: &[RankComm]) -> String {
    let f = |v: Option<f64>, unit: &str| v.map_or("-".to_string(), |v| format!("{v:.2}{unit}"));
    let mut t =
        format!("{:<12} {:>5} {:>15} {:>10} {:>14}\n", "config", "rank", "all-reduce ms", "hidden", "GPU idle ms");
    for r in ranks {
        t.push_str(&format!(
            "{config:<12} {:>5} {:>15} {:>10} {:>14}\n",
            r.rank,
            f(r.allreduce_ms, ""),
            f(r.hidden_pct, "%"),
            f(r.idle_ms, "")
        ));
    }
    t
}
