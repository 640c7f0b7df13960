//! The run-folder loop as data-parallel ranks (`run::Session::run_ranked`), on the CPU with ranks
//! as threads (`dist::ThreadSync`) and the 8³ tiny model: a stop requested on one rank alone
//! stops every rank after the same optimizer step and rank 0 writes that step's checkpoint; a NaN
//! on one rank, or a checkpoint write that fails on rank 0, ends every rank at the same step; only
//! rank 0 writes into its folder; 2 ranks × batch 1 leave the checkpoint and loss log of one
//! process × batch 2; and rank 0's weights broadcast at the start reach the bf16 weight copies.
//! The per-step agreement, immediate and deferred: the same run, and the blocking host waits per
//! step (1 immediate, 0 deferred); the last bucket held back beside Adam gives the same bits; and
//! `dist::TcpSync` over real 127.0.0.1 sockets gives the bits of `ThreadSync`.

use meddpm::checkpoint::Checkpoint;
use meddpm::cpu::CpuBackend;
use meddpm::data::Shard;
use meddpm::diffusion::{TrainConfig, Trainer};
use meddpm::dist::rendezvous::{self, RendezvousConfig};
use meddpm::dist::{Agreement, BucketPlan, GradSync, TcpSync, ThreadSync};
use meddpm::model::UNetConfig;
use meddpm::run::losslog::{self, LossLog};
use meddpm::run::{DataSource, Faults, Outcome, Ranks, RunRecord, Session, StopFlag, Summary, CHECKPOINT};
use meddpm::testing::{compare, Tolerance};
use meddpm::{Backend, Layout, Precision};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meddpm-distsession-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tc(batch: usize, seed: u64) -> TrainConfig {
    TrainConfig { lr: 2e-3, seed, batch, grad_accum: 2, ema_start: 2, ema_every: 1, ..TrainConfig::default() }
}

fn record(dir: &Path, steps: u64, every: u64) -> RunRecord {
    RunRecord {
        out: dir.to_path_buf(),
        data: DataSource::Demo,
        convention: "whole-head".into(),
        steps,
        checkpoint_every: every,
        sample_at_end: false,
        workers: 1,
        precision: Precision::Fp32,
        layout: Layout::Ncdhw,
        pairs: Vec::new(),
    }
}

/// The batches of `shard` of the global stream: global sample g is phantom variant g mod 5.
fn batches(cfg: &UNetConfig, shard: Shard) -> impl FnMut() -> meddpm::Result<(Vec<f32>, Vec<f32>)> {
    let cfg = cfg.clone();
    let mut k = 0;
    move || {
        let (mut img, mut cond) = (Vec::new(), Vec::new());
        for _ in 0..shard.block {
            let g = shard.global(0, k);
            k += 1;
            let (i, c) = meddpm::phantom::pair(cfg.depth, cfg.size, cfg.size, (g % 5) as u32);
            img.extend(i);
            cond.extend(c);
        }
        Ok((img, cond))
    }
}

/// How one rank is set up.
#[derive(Clone)]
struct Setup {
    steps: u64,
    every: u64,
    faults: Faults,
    /// Ask this rank's stop flag after this step (as a signal would).
    stop_after: Option<u64>,
    /// Other initial weights than the run's seed gives (the other ranks' seed stays the same).
    init_seed: Option<u64>,
    precision: Precision,
    /// Run a forward before the session (fills the bf16 weight copies with this rank's weights).
    warm_forward: bool,
    agreement: Agreement,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            steps: 6,
            every: 0,
            faults: Faults::default(),
            stop_after: None,
            init_seed: None,
            precision: Precision::Fp32,
            warm_forward: false,
            agreement: Agreement::Deferred,
        }
    }
}

/// What a rank ends with: the session's result, its online weights, its collective.
struct RankEnd<S = ThreadSync> {
    summary: meddpm::Result<Summary>,
    params: Vec<Vec<f32>>,
    sync: S,
}

fn plan(cfg: &UNetConfig) -> BucketPlan {
    BucketPlan::for_unet(cfg, 4096)
}

/// `setups.len()` ranks as threads, batch 1 each, rank r in `dirs[r]`.
fn run_ranks(cfg: &UNetConfig, setups: Vec<Setup>, dirs: &[PathBuf]) -> Vec<RankEnd> {
    let syncs = ThreadSync::group(setups.len(), &plan(cfg), Duration::from_secs(60));
    run_with(cfg, setups, dirs, syncs)
}

/// [`run_ranks`] over the given collectives, one per rank.
fn run_with<S: GradSync<CpuBackend> + Send + 'static>(
    cfg: &UNetConfig,
    setups: Vec<Setup>,
    dirs: &[PathBuf],
    syncs: Vec<S>,
) -> Vec<RankEnd<S>> {
    let world = setups.len();
    let handles: Vec<_> = syncs
        .into_iter()
        .zip(setups)
        .zip(dirs.to_vec())
        .enumerate()
        .map(|(r, ((mut sync, su), dir))| {
            let cfg = cfg.clone();
            std::thread::spawn(move || {
                let be = CpuBackend::with_precision(su.precision).unwrap();
                let mut tr = Trainer::new(&be, &cfg, &tc(1, 7)).unwrap();
                if let Some(seed) = su.init_seed {
                    tr.net.init_params(&be, seed);
                }
                if su.warm_forward {
                    tr.net.forward(&be, &[3.0]);
                }
                let stop = StopFlag::new();
                let mut s = Session {
                    dir: dir.clone(),
                    record: record(&dir, su.steps, su.every),
                    log: LossLog::fresh(&dir),
                    stop: &stop,
                    faults: su.faults,
                    saved_step: None,
                };
                let ranks = Ranks { sync: &mut sync, check_every: 1, agreement: su.agreement };
                let summary = s.run_ranked(
                    &be,
                    &mut tr,
                    Some(ranks),
                    batches(&cfg, Shard::new(r, world, 1).unwrap()),
                    |step, _| {
                        if su.stop_after == Some(step) {
                            stop.request();
                        }
                    },
                );
                let params = tr
                    .net
                    .params
                    .iter()
                    .map(|b| {
                        let mut h = vec![0f32; be.len(b)];
                        be.download(b, &mut h);
                        h
                    })
                    .collect();
                RankEnd { summary, params, sync }
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

fn steps_logged(dir: &Path) -> Vec<u64> {
    let csv = dir.join(losslog::CSV);
    losslog::parse_csv(&std::fs::read_to_string(&csv).unwrap(), &csv).unwrap().iter().map(|r| r.0).collect()
}

#[test]
fn a_stop_on_one_rank_stops_every_rank_after_the_same_step_and_rank_0_saves_it() {
    let cfg = UNetConfig::tiny();
    for (asker, agreement) in
        [(0, Agreement::Immediate), (1, Agreement::Immediate), (0, Agreement::Deferred), (1, Agreement::Deferred)]
    {
        let root = scratch(&format!("stop{asker}{agreement:?}"));
        let dirs = [root.join("r0"), root.join("r1")];
        for d in &dirs {
            std::fs::create_dir_all(d).unwrap();
        }
        let mut setups = vec![Setup { steps: 1000, ..Setup::default() }; 2];
        // the request arrives once step 3's loss is known, on one rank only. Immediate: the
        // ranks learn of it with step 4's losses, and all stop there. Deferred: step 3's loss is
        // read after step 4 ran, step 5 carries the request, read after step 6 ran: all stop at 6
        setups[asker].stop_after = Some(3);
        setups[asker].agreement = agreement;
        setups[1 - asker].agreement = agreement;
        let end = if agreement == Agreement::Immediate { 4 } else { 6 };
        let ends = run_ranks(&cfg, setups, &dirs);
        let sums: Vec<&Summary> = ends.iter().map(|e| e.summary.as_ref().unwrap()).collect();
        for (r, s) in sums.iter().enumerate() {
            let got = (&s.outcome, s.end, s.saved_step);
            assert_eq!(got, (&Outcome::Stopped, end, Some(end)), "rank {r} (asker {asker}, {agreement:?})");
        }
        assert_eq!(sums[0].losses, sums[1].losses, "every rank logs the same global-batch loss");
        let ck = Checkpoint::read(&dirs[0].join(CHECKPOINT)).unwrap();
        assert_eq!((ck.step, ck.world, ck.samples), (end, 2, Some(end * 2 * 2)));
        assert_eq!(steps_logged(&dirs[0]), (1..=end).collect::<Vec<_>>());
        assert!(files_in(&dirs[1]).is_empty(), "rank 1 wrote {:?}", files_in(&dirs[1]));
        // the file holds the weights every rank ends with
        let saved = ck.group("model", &Trainer::new(&CpuBackend::new(), &cfg, &tc(1, 7)).unwrap().net.specs).unwrap();
        assert_eq!(saved, ends[1].params);
        assert_eq!(ends[0].params, ends[1].params);
    }
}

#[test]
fn a_nan_on_one_rank_ends_every_rank_at_that_step_with_the_last_good_checkpoint() {
    let cfg = UNetConfig::tiny();
    for agreement in [Agreement::Immediate, Agreement::Deferred] {
        let root = scratch(&format!("nan{agreement:?}"));
        let dirs = [root.join("r0"), root.join("r1")];
        for d in &dirs {
            std::fs::create_dir_all(d).unwrap();
        }
        // deferred, step 3's NaN is read after step 4 ran; it is still step 3 that diverged, and the
        // checkpoint of step 4 is never written
        let base = Setup { steps: 10, every: 2, agreement, ..Setup::default() };
        let setups = vec![base.clone(), Setup { faults: Faults { nan_at_step: Some(3), ..Faults::default() }, ..base }];
        let ends = run_ranks(&cfg, setups, &dirs);
        for (r, e) in ends.iter().enumerate() {
            let s = e.summary.as_ref().unwrap();
            match &s.outcome {
                Outcome::Diverged { step, reason } => {
                    assert_eq!((*step, reason.as_str()), (3, "the loss is NaN"), "rank {r}")
                }
                o => panic!("rank {r}: expected a divergence, got {o:?}"),
            }
            assert_eq!(s.saved_step, Some(2), "rank {r}");
        }
        assert_eq!(Checkpoint::read(&dirs[0].join(CHECKPOINT)).unwrap().step, 2);
        assert_eq!(steps_logged(&dirs[0]), vec![1, 2, 3]);
        assert!(files_in(&dirs[1]).is_empty());
    }
}

#[test]
fn a_failed_checkpoint_write_on_rank_0_stops_every_rank() {
    let cfg = UNetConfig::tiny();
    let root = scratch("disk");
    let dirs = [root.join("r0"), root.join("r1")];
    for d in &dirs {
        std::fs::create_dir_all(d).unwrap();
    }
    let base = Setup { steps: 10, every: 2, ..Setup::default() };
    let setups =
        vec![Setup { faults: Faults { disk_full_at_step: Some(4), ..Faults::default() }, ..base.clone() }, base];
    let ends = run_ranks(&cfg, setups, &dirs);
    let e0 = ends[0].summary.as_ref().expect_err("rank 0 fails").to_string();
    assert!(e0.contains("no space left on device") && e0.contains("step 2"), "{e0}");
    let e1 = ends[1].summary.as_ref().expect_err("rank 1 fails with it").to_string();
    assert!(e1.contains("rank 0 could not write the checkpoint of step 4"), "{e1}");
    assert_eq!(Checkpoint::read(&dirs[0].join(CHECKPOINT)).unwrap().step, 2);
}

/// The checkpoint and loss log of a run: 2 ranks × batch 1 against one process × batch 2.
#[test]
fn two_ranks_leave_the_run_folder_of_one_process_with_the_global_batch() {
    let cfg = UNetConfig::tiny();
    let root = scratch("equal");
    let dirs = [root.join("r0"), root.join("r1")];
    let single = root.join("single");
    for d in dirs.iter().chain([&single]) {
        std::fs::create_dir_all(d).unwrap();
    }
    let ends = run_ranks(&cfg, vec![Setup { every: 3, ..Setup::default() }; 2], &dirs);
    assert!(ends.iter().all(|e| e.summary.is_ok()));

    let be = CpuBackend::new();
    let mut tr = Trainer::new(&be, &cfg, &tc(2, 7)).unwrap();
    let stop = StopFlag::new();
    let mut s = Session {
        dir: single.clone(),
        record: record(&single, 6, 3),
        log: LossLog::fresh(&single),
        stop: &stop,
        faults: Faults::default(),
        saved_step: None,
    };
    s.run(&be, &mut tr, batches(&cfg, Shard::new(0, 1, 2).unwrap()), |_, _| {}).unwrap();

    let (a, b) =
        (Checkpoint::read(&dirs[0].join(CHECKPOINT)).unwrap(), Checkpoint::read(&single.join(CHECKPOINT)).unwrap());
    assert_eq!((a.step, a.samples), (b.step, b.samples));
    assert_eq!(a.tensors.keys().collect::<Vec<_>>(), b.tensors.keys().collect::<Vec<_>>());
    for (k, (_, va)) in &a.tensors {
        compare(k, va, &b.tensors[k].1, Tolerance::new(1e-5, 1e-5)).unwrap();
    }
    let rows = |d: &Path| {
        let csv = d.join(losslog::CSV);
        losslog::parse_csv(&std::fs::read_to_string(&csv).unwrap(), &csv).unwrap()
    };
    let (la, lb) = (rows(&dirs[0]), rows(&single));
    assert_eq!(la.iter().map(|r| r.0).collect::<Vec<_>>(), lb.iter().map(|r| r.0).collect::<Vec<_>>());
    let (la, lb): (Vec<f32>, Vec<f32>) = (la.iter().map(|r| r.1).collect(), lb.iter().map(|r| r.1).collect());
    compare("loss log", &la, &lb, Tolerance::new(1e-6, 1e-5)).unwrap();
}

/// bf16 (CPU emulation): rank 1 starts from other weights whose bf16 copies are already made; the
/// broadcast of rank 0's weights must refresh them, so the run equals one where both ranks
/// started from rank 0's weights.
#[test]
fn the_broadcast_refreshes_the_bf16_weight_copies() {
    let cfg = UNetConfig::tiny();
    let root = scratch("bf16");
    let run = |init1: Option<u64>, tag: &str| {
        let dirs = [root.join(format!("{tag}0")), root.join(format!("{tag}1"))];
        for d in &dirs {
            std::fs::create_dir_all(d).unwrap();
        }
        let su = Setup { steps: 2, precision: Precision::Bf16, warm_forward: true, ..Setup::default() };
        let ends = run_ranks(&cfg, vec![su.clone(), Setup { init_seed: init1, ..su }], &dirs);
        assert!(ends.iter().all(|e| e.summary.is_ok()));
        ends.into_iter().next().unwrap().params
    };
    let same = run(None, "same");
    let other = run(Some(99), "other");
    let (a, b) = (same.concat(), other.concat());
    let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(a == b, "the run whose rank 1 began from other weights differs by up to {worst:e}");
}

fn dirs_in(root: &Path, tag: &str) -> [PathBuf; 2] {
    let dirs = [root.join(format!("{tag}0")), root.join(format!("{tag}1"))];
    for d in &dirs {
        std::fs::create_dir_all(d).unwrap();
    }
    dirs
}

/// The blocking host waits per step, counted by the session: immediate, every step's agreement
/// is read before the next step is launched (1 per step); deferred, none is, except the steps
/// that write a checkpoint (5 and 10 here). Both runs are the same run, bit for bit.
#[test]
fn deferred_agreement_takes_the_blocking_wait_off_every_step_and_changes_nothing_else() {
    let cfg = UNetConfig::tiny();
    let root = scratch("waits");
    let mut results = Vec::new();
    for agreement in [Agreement::Immediate, Agreement::Deferred] {
        let dirs = dirs_in(&root, &format!("{agreement:?}"));
        let su = Setup { steps: 10, every: 5, agreement, ..Setup::default() };
        let ends = run_ranks(&cfg, vec![su; 2], &dirs);
        for (r, e) in ends.iter().enumerate() {
            let s = e.summary.as_ref().unwrap();
            assert_eq!((&s.outcome, s.end), (&Outcome::Finished, 10), "rank {r} {agreement:?}");
            let c = s.sync;
            assert_eq!(c.agreements, 10, "rank {r} {agreement:?}");
            let (blocking, deferred) = if agreement == Agreement::Immediate { (10, 0) } else { (2, 8) };
            assert_eq!((c.blocking_waits, c.deferred_reads), (blocking, deferred), "rank {r} {agreement:?}: {c:?}");
            // the steps that write no checkpoint: waits per step
            let plain = 10 - 2;
            let per_step = (c.blocking_waits - 2) as f64 / plain as f64;
            println!("{agreement:?}: {per_step} blocking host wait(s) per step ({c:?})");
        }
        assert_eq!(steps_logged(&dirs[0]), (1..=10).collect::<Vec<_>>());
        let ends: Vec<RankEnd> = ends;
        results.push((ends[0].summary.as_ref().unwrap().losses.clone(), ends[0].params.clone()));
    }
    assert_eq!(results[0].0, results[1].0, "the same losses");
    assert!(results[0].1 == results[1].1, "the same weights");
}

/// Averaging every bucket but the last, Adam on those, then the last bucket and its Adam: the
/// weights of Adam on everything at once, bit for bit (the optimizer is elementwise).
#[test]
fn holding_the_last_bucket_back_beside_adam_gives_the_same_bits() {
    let cfg = UNetConfig::tiny();
    let root = scratch("heldback");
    let mut params = Vec::new();
    for overlap in [false, true] {
        let dirs = dirs_in(&root, &format!("o{overlap}"));
        let mut syncs = ThreadSync::group(2, &plan(&cfg), Duration::from_secs(60));
        syncs.iter_mut().for_each(|s| s.overlap_last = overlap);
        let ends = run_with(&cfg, vec![Setup { steps: 4, ..Setup::default() }; 2], &dirs, syncs);
        for e in &ends {
            assert!(e.summary.is_ok());
            assert_eq!(e.sync.held_back, if overlap { 4 } else { 0 }, "steps whose last bucket was held back");
        }
        assert!(ends[0].params == ends[1].params);
        params.push(ends.into_iter().next().unwrap().params);
    }
    assert!(params[0] == params[1], "holding the last bucket back changed the weights");
}

/// Two ranks as threads, but their collective is `TcpSync` over a real rendezvous on
/// 127.0.0.1: the run of `ThreadSync`, bit for bit (both sum in rank order), with deferred
/// agreements in flight while gradients are averaged over the same connections.
#[test]
fn tcp_sync_over_real_sockets_gives_the_bits_of_thread_sync() {
    let cfg = UNetConfig::tiny();
    let root = scratch("tcp");
    let su = Setup { steps: 5, every: 3, ..Setup::default() };
    let ends = run_ranks(&cfg, vec![su.clone(); 2], &dirs_in(&root, "thread"));
    let want = ends[0].params.clone();

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let cfg_of = move |rank| RendezvousConfig {
        rank,
        world: 2,
        addr: "127.0.0.1".into(),
        port,
        config_hash: 7,
        timeout: Duration::from_secs(30),
    };
    let other = std::thread::spawn(move || rendezvous::connect(&cfg_of(1)).unwrap());
    let r0 = rendezvous::serve(listener, &cfg_of(0), Ok(Vec::new())).unwrap();
    let r1 = other.join().unwrap();
    let p = plan(&cfg);
    let t = Duration::from_secs(30);
    let syncs =
        vec![TcpSync::new(0, 2, r0.into_links(), &p, t).unwrap(), TcpSync::new(1, 2, r1.into_links(), &p, t).unwrap()];
    let dirs = dirs_in(&root, "tcp");
    let ends = run_with(&cfg, vec![su; 2], &dirs, syncs);
    for (r, e) in ends.iter().enumerate() {
        let s = e.summary.as_ref().unwrap();
        assert_eq!((&s.outcome, s.end), (&Outcome::Finished, 5), "rank {r}");
        assert_eq!(s.sync.deferred_reads, 3, "rank {r}: steps 1, 2 and 4 read after the next one: {:?}", s.sync);
        assert!(e.params == want, "rank {r}: TcpSync's weights differ from ThreadSync's");
    }
    assert_eq!(Checkpoint::read(&dirs[0].join(CHECKPOINT)).unwrap().step, 5);
}
