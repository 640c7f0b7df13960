//! Data-parallel wiring for `train` and `sample`: `--gpus` spawns the local ranks
//! (`meddpm::dist::spawn`) and passes the user's signals on to them, and one rank's set-up under
//! `--gpus`, torchrun or Slurm: its GPU (`cuda:LOCAL_RANK`), the rendezvous that hands out rank
//! 0's NCCL unique id after checking world size and configuration, the liveness watch (a lost rank
//! stops this one), the NCCL gradient sync; then the usual training loop (`run::train_on`, which
//! runs `meddpm::run::Session::run_ranked`). For `sample`, the merge of the ranks' timing files;
//! for `bench --gpus`, a rank's measurement (`meddpm::dist::scaling`) per precision × layout.
//! Glue only: the logic lives in `meddpm::dist`, `meddpm::run` and `meddpm_cuda::{nccl, collective}`.

use crate::run::{open_dataset, start_trainer, train_on, BackendArgs, Device, Plan, RankCtx, RunConfig, TrainArgs};
use anyhow::{bail, Context, Result};
use meddpm::analysis::breakdown::{comm_overlap, CommOverlap};
use meddpm::diffusion::TrainConfig;
use meddpm::dist::rendezvous::{self, RendezvousConfig, Watch, WatchConfig};
use meddpm::dist::spawn::{count_signals, free_port, local_rank_envs, run_local, strip_gpus_arg, GpuSelection};
use meddpm::dist::{config_hash, BucketPlan, DistEnv, DEFAULT_BUCKET_BYTES};
use meddpm::eval::samplers::SampleTiming;
use meddpm::model::UNetConfig;
use meddpm::{Backend, Layout, Precision};
use meddpm_cuda::collective::{exit_on_lost, CommSlot, NcclSync};
use meddpm_cuda::cupti;
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

/// The rendezvous of this rank: rank 0 makes `n` NCCL unique ids (one per communicator the ranks
/// will open) and hands them out once every rank arrived with the same `hash`; then the liveness
/// watch (a lost peer aborts the communicator in the returned slot and exits).
fn join(env: &DistEnv, hash: u64, timeout: Duration, n: usize) -> Result<(Vec<UniqueId>, Watch, CommSlot)> {
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
    let len = rdv.payload.len() / n.max(1);
    let ids = rdv.payload.chunks(len.max(1)).map(UniqueId::from_bytes).collect::<meddpm::Result<Vec<_>>>()?;
    if ids.len() != n {
        bail!("rank {}: the rendezvous brought {} NCCL id(s), {n} expected", env.rank, ids.len());
    }
    let slot = CommSlot::default();
    let watch = rdv.watch(WatchConfig::default(), exit_on_lost(slot.clone(), env.rank))?;
    Ok((ids, watch, slot))
}

/// One data-parallel training rank (see the module docs).
pub fn train_rank(a: &TrainArgs, env: DistEnv, plan: Plan) -> Result<()> {
    let be = rank_backend(&plan.backend, &env)?;
    let (tr, started) = start_trainer(&be, a, plan)?;
    let pairs = open_dataset(&started.run, &tr.net.cfg)?.len();
    let hash = config_hash(&Agreement {
        unet: &tr.net.cfg,
        train: &tr.tc,
        step: tr.step,
        samples: tr.samples,
        run: &started.run,
        pairs,
        precision: started.backend.precision(),
        layout: started.backend.layout(),
    });
    let timeout = Duration::from_secs(a.dist_timeout.max(1));
    let (ids, watch, slot) = join(&env, hash, timeout, 1)?;
    let plan = BucketPlan::for_unet(&tr.net.cfg, DEFAULT_BUCKET_BYTES);
    let mut sync = NcclSync::new(&be, &ids[0], env.rank, env.world, plan, timeout, Some(&slot))?;
    // once the session ended alike on every rank, leave the group with a goodbye: what follows
    // (rank 0's report and sample, an agreed divergence's error) must not look like a lost peer
    let watch = std::sync::Mutex::new(Some(watch));
    let close = || {
        if let Some(w) = watch.lock().unwrap_or_else(|e| e.into_inner()).take() {
            w.close();
        }
    };
    let ctx = RankCtx { sync: &mut sync, check_every: a.check_every, agreed_end: Box::new(close) };
    let r = train_on(&be, started, tr, Some(ctx));
    let open = watch.lock().unwrap_or_else(|e| e.into_inner()).take();
    match (r, open) {
        (Ok(()), w) => {
            if let Some(w) = w {
                w.close();
            }
            Ok(())
        }
        (Err(e), None) => Err(e.context(format!("rank {} of {}", env.rank, env.world))),
        (Err(e), Some(w)) => {
            // a failure during the session, maybe caused by a lost peer: let the watch name it
            // (it exits the process)
            std::thread::sleep(meddpm_cuda::collective::WATCH_GRACE);
            // dropping the watch without a goodbye stops the other ranks too
            drop(w);
            Err(e.context(format!("rank {} of {}", env.rank, env.world)))
        }
    }
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

/// Synced steps of `bench --gpus` whose kernel timeline rank 0 records (CUPTI) for the overlap.
const COMM_STEPS: usize = 3;

/// One rank of `bench --gpus`: for each precision × layout, a fresh backend, trainer (batch 1,
/// no accumulation) and NCCL communicator; one-GPU steps, then synced steps
/// (`meddpm::dist::scaling::measure`), then [`COMM_STEPS`] synced steps under CUPTI on rank 0 for
/// how much of the all-reduce other kernels hide (`analysis::breakdown::comm_overlap`). Rank 0
/// prints the table and writes `--json`.
pub fn bench_rank(a: &crate::bench::BenchArgs, env: DistEnv) -> Result<()> {
    use crate::bench::{host_data, BenchDevice, Lay};
    use meddpm::dist::scaling::{measure, Scaling};
    if a.device == BenchDevice::Cpu {
        bail!("bench: --device cpu has no data-parallel mode; --gpus and RANK/WORLD_SIZE need CUDA devices");
    }
    let cfg = crate::bench::model(a)?;
    let configs: Vec<(Precision, Layout, String)> = a
        .precision
        .iter()
        .flat_map(|&p| {
            a.layout.iter().map(move |&l| {
                let layout = match l {
                    Lay::Ncdhw => Layout::Ncdhw,
                    Lay::Ndhwc => Layout::Ndhwc,
                };
                (p.precision(), layout, format!("{} {}", p.precision().name(), crate::bench::lay_name(l)))
            })
        })
        .collect();
    let hash = config_hash(&(&cfg, configs.iter().map(|c| &c.2).collect::<Vec<_>>(), a.iters, a.warmup));
    let timeout = Duration::from_secs(a.dist_timeout.max(1));
    let (ids, watch, slot) = join(&env, hash, timeout, configs.len())?;
    let lead = env.rank == 0;
    let tc = TrainConfig { batch: 1, grad_accum: 1, ..TrainConfig::default() };
    let mut rows: Vec<(String, Scaling, Option<CommOverlap>)> = Vec::new();
    for ((p, l, name), id) in configs.iter().zip(&ids) {
        let be = CudaBackend::new(env.local_rank, *p, *l)
            .with_context(|| format!("rank {}: opening cuda:{} (LOCAL_RANK)", env.rank, env.local_rank))?;
        if lead {
            eprintln!("bench: {name} on {} rank(s): {}", env.world, be.describe());
        }
        let mut tr = meddpm::diffusion::Trainer::new(&be, &cfg, &tc)?;
        let plan = BucketPlan::for_unet(&cfg, DEFAULT_BUCKET_BYTES);
        let mut sync = NcclSync::new(&be, id, env.rank, env.world, plan, timeout, Some(&slot))?;
        let img = tr.net.output_dims();
        let cd = tr.net.input_dims().with_c(cfg.cond_channels());
        let seed = 10 * env.rank as u64;
        let (image, cond) = (host_data(img.numel(), seed + 1), host_data(cd.numel(), seed + 2));
        let (s, _, _) = measure(&be, &mut tr, &mut sync, a.warmup, a.iters, || Ok((image.clone(), cond.clone())))
            .with_context(|| format!("rank {}: {name}", env.rank))?;
        // Then a few more synced steps on every rank (the collectives must match), rank 0's under
        // CUPTI: how much of the all-reduce kernels' time other kernels ran beside them.
        let collector = if lead { Some(cupti::Collector::start()) } else { None };
        for _ in 0..COMM_STEPS {
            tr.train_step_synced(&be, || Ok((image.clone(), cond.clone())), &mut sync)
                .with_context(|| format!("rank {}: {name}: overlap steps", env.rank))?;
        }
        be.sync();
        let comm = collector.map(|c| {
            let records: Vec<_> = c?.finish()?.activities.iter().map(|a| a.to_record()).collect();
            comm_overlap(&records).ok_or_else(|| "no NCCL kernel in the CUPTI timeline".to_string())
        });
        if lead {
            eprintln!(
                "bench: {name}: one GPU {:.2} ms, {} GPUs {:.2} ms per step: {:.2}× the throughput, {:.1} % efficiency",
                s.one_gpu_ms, s.world, s.dp_ms, s.speedup, s.efficiency_pct
            );
            match &comm {
                Some(Ok(c)) => eprintln!(
                    "bench: {name}: all-reduce kernels {:.2} ms per step, {:.1} % of it with other kernels running \
                     (CUPTI on rank 0, {COMM_STEPS} steps)",
                    c.comm_ns as f64 / 1e6 / COMM_STEPS as f64,
                    c.hidden_pct
                ),
                Some(Err(e)) => eprintln!("bench: {name}: all-reduce overlap not measured: {e}"),
                None => {}
            }
        }
        rows.push((name.clone(), s, comm.and_then(|c| c.ok())));
    }
    watch.close();
    if !lead {
        return Ok(());
    }
    println!(
        "\n{:<12} {:>6} {:>12} {:>12} {:>9} {:>11} {:>15}",
        "config", "GPUs", "1 GPU ms", "N GPUs ms", "speedup", "efficiency", "all-reduce hid"
    );
    for (name, s, c) in &rows {
        let hid = c.as_ref().map_or("-".to_string(), |c| format!("{:.1}%", c.hidden_pct));
        println!(
            "{name:<12} {:>6} {:>12.2} {:>12.2} {:>8.2}× {:>10.1}% {hid:>15}",
            s.world, s.one_gpu_ms, s.dp_ms, s.speedup, s.efficiency_pct
        );
    }
    println!(
        "step = one optimizer step, batch 1 per GPU, median of {} after {} warm-up (CUDA-synchronised); 1 GPU: the \
         same ranks training alone first (mean of their medians); speedup = N · (1 GPU ms) / (N GPUs ms).",
        a.iters, a.warmup
    );
    if let Some(path) = &a.json {
        #[derive(serde::Serialize)]
        struct Row<'a> {
            config: &'a str,
            #[serde(flatten)]
            scaling: &'a Scaling,
            /// All-reduce kernel time and the part of it other kernels ran beside (rank 0, CUPTI).
            comm_ns: Option<u64>,
            comm_hidden_ns: Option<u64>,
            comm_hidden_pct: Option<f64>,
        }
        let rows: Vec<Row> = rows
            .iter()
            .map(|(c, s, o)| Row {
                config: c,
                scaling: s,
                comm_ns: o.as_ref().map(|o| o.comm_ns),
                comm_hidden_ns: o.as_ref().map(|o| o.hidden_ns),
                comm_hidden_pct: o.as_ref().map(|o| o.hidden_pct),
            })
            .collect();
        let rep = serde_json::json!({ "model": cfg, "iters": a.iters, "warmup": a.warmup, "rows": rows });
        meddpm::checkpoint::write_atomic(path, serde_json::to_string_pretty(&rep)?.as_bytes())?;
        eprintln!("bench: wrote {}", path.display());
    }
    Ok(())
}
