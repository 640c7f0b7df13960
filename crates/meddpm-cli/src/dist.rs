//! Data-parallel wiring shared by `train`, `sample` and `bench`: `--gpus` spawns the local
//! ranks (`meddpm::dist::spawn`) and passes the user's signals on to them; a rank's GPU
//! (`cuda:LOCAL_RANK`); the rendezvous that hands out rank 0's NCCL unique ids after checking
//! world size and configuration, with the liveness watch (a lost rank stops this one); and the
//! sampling ranks' timing files; and CPU ranks (`train --device cpu` under RANK/WORLD_SIZE),
//! whose gradients go over the rendezvous links (`meddpm::dist::TcpSync`). The commands' rank
//! bodies are theirs (`train::train_rank`, `bench::bench_rank`). Glue only: the logic lives in
//! `meddpm::dist` and `meddpm_cuda::{nccl, collective}`.

use crate::args::{BackendArgs, Device};
use anyhow::{bail, Context, Result};
use meddpm::dist::rendezvous::{self, RendezvousConfig, Watch, WatchConfig};
use meddpm::dist::spawn::{count_signals, free_port, local_rank_envs, run_local, strip_gpus_arg, GpuSelection};
use meddpm::dist::{BucketPlan, DistEnv, TcpSync, DEFAULT_BUCKET_BYTES};
use meddpm::eval::samplers::SampleTiming;
use meddpm_cuda::collective::{exit_on_lost, CommSlot};
use meddpm_cuda::nccl::UniqueId;
use meddpm_cuda::CudaBackend;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Set in the ranks `--gpus` starts: the selection, so that a rank can print the command that
/// resumes the run the same way.
pub const GPUS_ENV: &str = "MEDDPM_GPUS";

/// `--gpus`: run this same command once per selected GPU, as ranks 0..N−1, pass SIGINT/SIGTERM
/// on to them, and wait for them. Returns the number of ranks.
pub fn launch_local(sel: &GpuSelection) -> Result<usize> {
    let devices = sel.resolve(meddpm_cuda::collective::device_count())?;
    let port = free_port()?;
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let mut envs = local_rank_envs(&devices, visible.as_deref(), port)?;
    let raw = std::env::args().skip(1).collect::<Vec<_>>();
    let given = raw
        .iter()
        .position(|a| a == "--gpus")
        .and_then(|i| raw.get(i + 1).cloned())
        .or_else(|| raw.iter().find_map(|a| a.strip_prefix("--gpus=").map(str::to_string)))
        .unwrap_or_else(|| devices.len().to_string());
    for e in &mut envs {
        e.push((GPUS_ENV.into(), given.clone()));
    }
    let args = strip_gpus_arg(&raw);
    let exe = std::env::current_exe().context("finding the meddpm executable to start the ranks")?;
    // The ranks run in their own process groups: the terminal's Ctrl-C comes here, and each
    // signal goes on to every rank exactly once.
    let signals = count_signals()?;
    println!("meddpm: {} rank(s) on GPU(s) {devices:?}, rendezvous on 127.0.0.1:{port}", devices.len());
    run_local(&exe, &args, &envs, Duration::from_secs(60), &signals)?;
    Ok(devices.len())
}

/// The backend of a CPU rank (bf16 emulated when asked; TF32 is the fp32 reference there).
pub fn cpu_rank_backend(b: &BackendArgs) -> Result<meddpm::cpu::CpuBackend> {
    let p = match b.precision() {
        meddpm::Precision::Bf16 => meddpm::Precision::Bf16,
        meddpm::Precision::Fp32 | meddpm::Precision::Tf32 => meddpm::Precision::Fp32,
        // refused on the CPU, with the same message as a single CPU run
        meddpm::Precision::Fp8 => meddpm::Precision::Fp8,
    };
    Ok(meddpm::cpu::CpuBackend::with_precision(p)?)
}

/// The rendezvous of a CPU rank (same checks as a GPU rank's), then its collective over the
/// rendezvous links: a peer that dies or stays silent for `timeout` inside a collective is an
/// error naming it.
pub fn join_cpu(env: &DistEnv, hash: u64, timeout: Duration, unet: &meddpm::model::UNetConfig) -> Result<TcpSync> {
    let rdv = rendezvous::join(&RendezvousConfig::of(env, hash, timeout), Ok(Vec::new()))?;
    let plan = BucketPlan::for_unet(unet, DEFAULT_BUCKET_BYTES);
    Ok(TcpSync::new(env.rank, env.world, rdv.into_links(), &plan, timeout)?)
}

/// The CUDA backend of a rank: device `LOCAL_RANK` (of those the launcher made visible).
pub fn rank_backend(b: &BackendArgs, env: &DistEnv) -> Result<CudaBackend> {
    match b.device {
        Device::Cpu => bail!(
            "rank {} of {}: this command's data-parallel ranks use one CUDA device each; --device cpu cannot be \
             combined with RANK/WORLD_SIZE or Slurm tasks here (only `meddpm train` runs CPU ranks)",
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

/// The rendezvous of this rank: rank 0 makes `n` NCCL unique ids (one per communicator the ranks
/// will open) and hands them out once every rank arrived with the same `hash`; then the liveness
/// watch (a lost peer aborts the communicator in the returned slot and exits).
pub fn join(env: &DistEnv, hash: u64, timeout: Duration, n: usize) -> Result<(Vec<UniqueId>, Watch, CommSlot)> {
    // rank 0 makes the NCCL ids; if it cannot, the others hear why instead of waiting
    let payload = if env.rank == 0 {
        (0..n)
            .map(|_| UniqueId::new().map(|id| id.0.to_vec()))
            .collect::<meddpm::Result<Vec<_>>>()
            .map(|v| v.concat())
            .map_err(|e| e.to_string())
    } else {
        Err(String::new())
    };
    let rdv = rendezvous::join(&RendezvousConfig::of(env, hash, timeout), payload)?;
    let len = rdv.payload.len() / n.max(1);
    let ids = rdv.payload.chunks(len.max(1)).map(UniqueId::from_bytes).collect::<meddpm::Result<Vec<_>>>()?;
    if ids.len() != n {
        bail!("rank {}: the rendezvous brought {} NCCL id(s), {n} expected", env.rank, ids.len());
    }
    let slot = CommSlot::default();
    let watch = rdv.watch(WatchConfig::default(), exit_on_lost(slot.clone(), env.rank))?;
    Ok((ids, watch, slot))
}

/// Where a sampling rank writes its timing: `<out>_timing.json` alone, `<out>_timing_rank<r>.json`
/// as rank r of several (the ranks' volume files are disjoint; their timings are merged by
/// [`merge_timing`] under `--gpus`).
pub fn timing_path(out: &Path, rank: usize, world: usize) -> PathBuf {
    if world > 1 {
        PathBuf::from(format!("{}_timing_rank{rank}.json", out.display()))
    } else {
        PathBuf::from(format!("{}_timing.json", out.display()))
    }
}

/// After `sample --gpus`: the ranks' timing files as one `<out>_timing.json` (every rank's
/// batches; the device line names the ranks), the rank files removed. A rank that had no
/// volume wrote none.
pub fn merge_timing(out: &Path, world: usize) -> Result<()> {
    let mut parts = Vec::new();
    for r in 0..world {
        let p = timing_path(out, r, world);
        if !p.is_file() {
            continue;
        }
        let s = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        let t: SampleTiming =
            serde_json::from_str(&s).with_context(|| format!("{}: not a timing file", p.display()))?;
        parts.push((p, t));
    }
    let Some(merged) = SampleTiming::merge(parts.iter().map(|(_, t)| t.clone()).collect()) else {
        bail!("sample --gpus: no rank wrote a timing file ({})", timing_path(out, 0, world).display());
    };
    let path = timing_path(out, 0, 1);
    meddpm::checkpoint::write_atomic(&path, serde_json::to_string_pretty(&merged)?.as_bytes())?;
    for (p, _) in &parts {
        let _ = std::fs::remove_file(p);
    }
    println!(
        "{} volume(s) on {} rank(s): {:.3} s/volume per GPU; timing: {}",
        merged.volumes(),
        parts.len(),
        merged.seconds_per_volume(),
        path.display()
    );
    Ok(())
}
