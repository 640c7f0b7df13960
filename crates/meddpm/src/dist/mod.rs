//! Data-parallel training across processes (one per GPU), without anything CUDA-specific:
//!
//! - `env`        the launch environment: torchrun-style variables or Slurm's (node lists parsed here)
//! - `spawn`      `--gpus N|all|0,1`: spawn the local ranks, keep NVLink multicast off in each
//! - `rendezvous` rank 0 hands the NCCL unique id to the others over TCP, checking world size and
//!   config; the connections then carry heartbeats so a lost rank stops the others
//! - `buckets`    gradient buckets in the order backward finishes them (overlap with backward)
//! - `agree`      the per-step agreement of loss and stop, read after the next step is launched
//! - `tcp`        [`TcpSync`]: the collective of CPU ranks as processes, over the rendezvous links
//! - `sync`       the [`GradSync`] trait the Trainer calls, [`Solo`], the in-process [`ThreadSync`],
//!   hashes for config and weight checks
//! - `scaling`    `bench --gpus`: one GPU's step against the synced step on the same ranks
//!
//! The training loop of a rank is `run::Session::run_ranked` (stops and divergence agreed by
//! all ranks).
//!
//! The collective implementation over NCCL lives in the CUDA crate (`meddpm_cuda::collective`).
//! How ranks draw their data, timesteps and noise so that W ranks × batch b equal one rank ×
//! batch W·b is in `diffusion::train` and `data::loader::Shard`; docs/multigpu.md has the whole story.

pub mod agree;
pub mod buckets;
pub mod env;
pub mod rendezvous;
pub mod scaling;
pub mod spawn;
pub mod sync;
pub mod tcp;

pub use agree::{Agreement, SyncCounts};
pub use buckets::{BucketPlan, DEFAULT_BUCKET_BYTES};
pub use env::DistEnv;
pub use sync::{check_same, config_hash, GradSync, Solo, ThreadSync};
pub use tcp::TcpSync;

use crate::backend::Backend;
use crate::diffusion::Trainer;
use crate::error::Result;

/// Compare the online and EMA weights of every rank by hash; a clear error on every rank when
/// any rank differs. Costs one download of the weights and one tiny collective.
pub fn check_weights<B: Backend>(sync: &mut dyn GradSync<B>, be: &B, tr: &Trainer<B>) -> Result<()> {
    let h = sync::buffers_hash(be, &tr.net.params);
    let h = sync::fnv1a(h, &sync::buffers_hash(be, &tr.ema).to_le_bytes());
    check_same(sync, be, &format!("weights at step {}", tr.step), h)
}

/// Make every rank start from rank 0's weights, EMA and Adam moments. The parameters are
/// overwritten in place, so the network's low-precision weight copies are refreshed after
/// (`UNet::params_changed`; bf16 runs would otherwise compute with the old weights).
pub fn broadcast_state<B: Backend>(sync: &mut dyn GradSync<B>, be: &B, tr: &mut Trainer<B>) -> Result<()> {
    sync.broadcast(be, &mut tr.net.params)?;
    tr.net.params_changed();
    sync.broadcast(be, &mut tr.ema)?;
    sync.broadcast(be, &mut tr.adam_m)?;
    sync.broadcast(be, &mut tr.adam_v)
}
