//! Data-parallel wiring for `train` and `sample`: `--gpus` spawns the local ranks
//! (`meddpm::dist::spawn`), and one rank's set-up under `--gpus`, torchrun or Slurm: its GPU
//! (`cuda:LOCAL_RANK`), the rendezvous that hands out rank 0's NCCL unique id after checking world
//! size and configuration, the liveness watch (a lost rank stops this one), the NCCL gradient sync;
//! then the usual training loop (`run::train_on`). Glue only: the logic lives in `meddpm::dist` and
//! `meddpm_cuda::{nccl, collective}`.

use crate::run::{make_trainer, open_dataset, train_on, BackendArgs, Device, RankCtx, RunConfig, TrainArgs};
use anyhow::{bail, Context, Result};
use meddpm::diffusion::TrainConfig;
use meddpm::dist::rendezvous::{self, RendezvousConfig, WatchConfig};
use meddpm::dist::spawn::{free_port, local_rank_envs, run_local, strip_gpus_arg, GpuSelection};
use meddpm::dist::{config_hash, BucketPlan, DistEnv, DEFAULT_BUCKET_BYTES};
use meddpm::model::UNetConfig;
use meddpm::{Layout, Precision};
use meddpm_cuda::collective::{exit_on_lost, CommSlot, NcclSync};
use meddpm_cuda::nccl::UniqueId;
use meddpm_cuda::CudaBackend;
use std::time::Duration;

/// `--gpus`: run this same command once per selected GPU, as ranks 0..N−1, and wait for them.
pub fn launch_local(sel: &GpuSelection) -> Result<()> {
    let devices = sel.resolve(meddpm_cuda::collective::device_count())?;
    let port = free_port()?;
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let envs = local_rank_envs(&devices, visible.as_deref(), port)?;
    let args = strip_gpus_arg(&std::env::args().skip(1).collect::<Vec<_>>());
    let exe = std::env::current_exe().context("finding the meddpm executable to start the ranks")?;
    println!("meddpm: {} rank(s) on GPU(s) {devices:?}, rendezvous on 127.0.0.1:{port}", devices.len());
    run_local(&exe, &args, &envs, Duration::from_secs(60))?;
    Ok(())
}

/// The CUDA backend of a rank: device `LOCAL_RANK` (of those the launcher made visible).
pub fn rank_backend(b: &BackendArgs, env: &DistEnv) -> Result<CudaBackend> {
    match b.device {
        Device::Cpu => bail!(
            "rank {} of {}: data-parallel runs use one CUDA device per rank; --device cpu cannot be combined with \
             RANK/WORLD_SIZE or Slurm tasks",
            env.rank,
            env.world
        ),
        Device::Cuda(i) if i != 0 && i != env.local_rank => {
            eprintln!(
                "note: rank {}: --device cuda:{i} is ignored; ranks use cuda:LOCAL_RANK = cuda:{}",
                env.rank, env.local_rank
            )
        }
        _ => {}
    }
    CudaBackend::new(env.local_rank, b.precision(), b.layout())
        .with_context(|| format!("rank {}: opening cuda:{} (LOCAL_RANK)", env.rank, env.local_rank))
}

/// Everything every rank must agree on before training together.
#[derive(serde::Serialize)]
struct Agreement<'a> {
    unet: &'a UNetConfig,
    train: &'a TrainConfig,
    step: u64,
    samples: u64,
    run: &'a RunConfig,
    pairs: usize,
    precision: Precision,
    layout: Layout,
}

/// One data-parallel training rank (see the module docs).
pub fn train_rank(a: &TrainArgs, env: DistEnv, unet: UNetConfig, tc: TrainConfig, run: RunConfig) -> Result<()> {
    let be = rank_backend(&a.backend, &env)?;
    let tr = make_trainer(&be, a, &unet, &tc)?;
    let pairs = open_dataset(&run, &tr.net.cfg)?.len();
    let hash = config_hash(&Agreement {
        unet: &tr.net.cfg,
        train: &tr.tc,
        step: tr.step,
        samples: tr.samples,
        run: &run,
        pairs,
        precision: a.backend.precision(),
        layout: a.backend.layout(),
    });
    let timeout = Duration::from_secs(a.dist_timeout.max(1));
    // rank 0 makes the NCCL id; if it cannot, the others hear why instead of waiting
    let payload = if env.rank == 0 {
        UniqueId::new().map(|id| id.0.to_vec()).map_err(|e| e.to_string())
    } else {
        Err(String::new())
    };
    let rdv = rendezvous::join(
        &RendezvousConfig {
            rank: env.rank,
            world: env.world,
            addr: env.master_addr.clone(),
            port: env.master_port,
            config_hash: hash,
            timeout,
        },
        payload,
    )?;
    let id = UniqueId::from_bytes(&rdv.payload)?;
    let slot = CommSlot::default();
    let watch = rdv.watch(WatchConfig::default(), exit_on_lost(slot.clone(), env.rank))?;
    let plan = BucketPlan::for_unet(&tr.net.cfg, DEFAULT_BUCKET_BYTES);
    let mut sync = NcclSync::new(&be, &id, env.rank, env.world, plan, timeout, Some(&slot))?;
    let r = train_on(&be, tr, run, Some(RankCtx { sync: &mut sync, check_every: a.check_every }));
    match r {
        Ok(()) => {
            watch.close();
            Ok(())
        }
        Err(e) => {
            // a failure caused by a lost peer: let the watch name it (it exits the process)
            std::thread::sleep(meddpm_cuda::collective::WATCH_GRACE);
            // dropping the watch without a goodbye stops the other ranks too
            Err(e.context(format!("rank {} of {}", env.rank, env.world)))
        }
    }
}
