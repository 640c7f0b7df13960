//! Data-parallel `meddpm train --device cpu` with real rank processes (RANK/WORLD_SIZE/
//! LOCAL_RANK/MASTER_ADDR/MASTER_PORT, gradients over TCP on 127.0.0.1) and the faults a cluster
//! user meets: a rank killed with SIGKILL mid-run (the other exits non-zero at once, naming it),
//! a rank that hangs (SIGSTOP: the same after `--dist-timeout`), in both cases with the last
//! checkpoint intact and resumable; a resume on another number of ranks continues the same run
//! (step, sample position, loss log); and a rendezvous port already in use is an error naming the
//! port and the variable that sets it. Every child is killed when a test ends, however it ends.

use meddpm::checkpoint::Checkpoint;
use meddpm::cpu::CpuBackend;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::meddpm;

const CKPT: &str = "checkpoint.safetensors";

fn scratch(name: &str) -> PathBuf {
    common::scratch("distranks", name)
}

/// Ranks started by a test; killed (SIGCONT first, for a stopped one) when dropped.
struct Ranks {
    children: Vec<Child>,
    logs: Vec<PathBuf>,
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.children {
            if let Ok(None) = c.try_wait() {
                signal(c.id(), "CONT");
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill").args([&format!("-{sig}"), &pid.to_string()]).stderr(Stdio::null()).status();
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The liveness timeout of the hang test (`--dist-timeout`): short, so the test is fast.
const HANG_TIMEOUT: &str = "3";
/// The other tests' timeout: long enough that a loaded machine never trips it.
const TIMEOUT: &str = "30";

fn train_args(out: &Path, steps: u64, every: u64, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = ["train", "--device", "cpu", "--no-sample"].iter().map(|s| s.to_string()).collect();
    if !extra.contains(&"--dist-timeout") {
        v.extend(["--dist-timeout".into(), TIMEOUT.into()]);
    }
    if out.join(CKPT).is_file() {
        v.extend(["--resume".into(), out.join(CKPT).to_string_lossy().into_owned()]);
    } else {
        v.extend(["--preset", "tiny", "--out"].map(String::from));
        v.push(out.to_string_lossy().into_owned());
        v.extend(["--checkpoint-every".into(), every.to_string()]);
    }
    v.extend(["--steps".into(), steps.to_string()]);
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// `world` rank processes of one run in `dir` (output in `dir/rank<r>.log`).
fn start(dir: &Path, world: usize, args: &[String], env: &[(&str, &str)]) -> Ranks {
    let port = free_port().to_string();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut r = Ranks { children: Vec::new(), logs: Vec::new() };
    for rank in 0..world {
        let log = dir.join(format!("rank{rank}.log"));
        let f = File::create(&log).unwrap();
        let (rs, ws) = (rank.to_string(), world.to_string());
        let mut env: Vec<(&str, &str)> = env.to_vec();
        env.extend([
            ("RANK", rs.as_str()),
            ("LOCAL_RANK", rs.as_str()),
            ("WORLD_SIZE", ws.as_str()),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", port.as_str()),
        ]);
        let child = meddpm(dir, &args, &env)
            .stdout(Stdio::from(f.try_clone().unwrap()))
            .stderr(Stdio::from(f))
            .spawn()
            .unwrap();
        r.children.push(child);
        r.logs.push(log);
    }
    r
}

fn log_of(r: &Ranks, rank: usize) -> String {
    std::fs::read_to_string(&r.logs[rank]).unwrap_or_default()
}

/// Wait for rank `rank` to exit (at most `limit`): its exit code.
fn wait_exit(r: &mut Ranks, rank: usize, limit: Duration) -> i32 {
    let t0 = Instant::now();
    loop {
        if let Some(s) = r.children[rank].try_wait().unwrap() {
            return s.code().unwrap_or(-1);
        }
        assert!(t0.elapsed() < limit, "rank {rank} still running after {limit:?}; its log:\n{}", log_of(r, rank));
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_for(what: &str, limit: Duration, cond: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < limit, "gave up waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The steps of a run folder's loss.csv.
fn logged(dir: &Path) -> Vec<u64> {
    let t = std::fs::read_to_string(dir.join("loss.csv")).unwrap();
    t.lines().skip(1).map(|l| l.split(',').next().unwrap().parse().unwrap()).collect()
}

/// The run's checkpoint loads and restores a trainer; its (step, samples).
fn intact(out: &Path) -> (u64, Option<u64>) {
    let ck = Checkpoint::read(&out.join(CKPT)).unwrap();
    ck.restore_trainer(&CpuBackend::new()).unwrap();
    (ck.step, ck.samples)
}

/// One process, no rank variables: resume `out` to `steps`; exit 0.
fn resume_alone(dir: &Path, out: &Path, steps: u64) {
    let args = train_args(out, steps, 0, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut c = meddpm(dir, &args, &[]);
    for k in ["RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
        c.env_remove(k);
    }
    let o = c.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.status.code(), Some(0), "resume alone failed:\n{text}");
}

/// Kill one rank outright (SIGKILL) or freeze it (SIGSTOP) once the run has a checkpoint: the
/// other exits non-zero naming it — for a kill at once (its connection closes), far within the
/// 30 s `--dist-timeout`; for a hang after the 3 s `--dist-timeout` — and the checkpoint is
/// intact and resumable.
fn lose_a_rank(sig: &str, victim: usize) {
    let dir = scratch(&format!("{sig}{victim}"));
    let out = dir.join("run");
    // slow steps (50 ms per batch) so that the signal lands inside a running step
    let timeout = if sig == "KILL" { TIMEOUT } else { HANG_TIMEOUT };
    let args = train_args(&out, 1_000_000, 5, &["--dist-timeout", timeout]);
    let mut r = start(&dir, 2, &args, &[("MEDDPM_FAULT_SLOW_STEP_MS", "50")]);
    wait_for("the first checkpoint", Duration::from_secs(120), || out.join(CKPT).is_file());
    std::thread::sleep(Duration::from_millis(150));
    let pid = r.children[victim].id();
    signal(pid, sig);
    let other = 1 - victim;
    let t0 = Instant::now();
    let code = wait_exit(&mut r, other, Duration::from_secs(60));
    let took = t0.elapsed();
    let log = log_of(&r, other);
    assert_ne!(code, 0, "rank {other} exited 0 after SIG{sig} to rank {victim}:\n{log}");
    let why = if sig == "KILL" { "closed its connection".to_string() } else { format!("sent nothing for {timeout} s") };
    assert!(log.contains(&format!("rank {victim} {why}")), "rank {other} does not name rank {victim} ({why}):\n{log}");
    if sig == "KILL" {
        assert!(took < Duration::from_secs(3), "a killed rank was noticed only after {took:?} (before the timeout)");
    } else {
        assert!(took >= Duration::from_millis(2500), "a hang was declared after {took:?}, under the 3 s timeout");
    }
    drop(r);
    let (step, _) = intact(&out);
    assert!(step >= 5 && step.is_multiple_of(5), "checkpoint of step {step}");
    assert_eq!(logged(&out), (1..=step).collect::<Vec<_>>(), "the loss log matches the checkpoint");
    resume_alone(&dir, &out, step + 2);
    assert_eq!(intact(&out).0, step + 2);
}

#[test]
fn a_rank_killed_with_sigkill_stops_the_other_at_once_naming_it_and_the_checkpoint_resumes() {
    lose_a_rank("KILL", 1);
    lose_a_rank("KILL", 0);
}

#[test]
fn a_rank_that_hangs_stops_the_other_after_the_liveness_timeout_naming_it() {
    lose_a_rank("STOP", 1);
    lose_a_rank("STOP", 0);
}

/// 2 ranks to step 4, one process to step 6, 2 ranks again to step 8: one run, whose step,
/// sample position and loss log go on where the last part left them.
#[test]
fn a_resume_on_another_number_of_ranks_continues_the_same_run() {
    let dir = scratch("resize");
    let out = dir.join("run");
    let two = |steps: u64| {
        let mut r = start(&dir, 2, &train_args(&out, steps, 2, &[]), &[]);
        for rank in 0..2 {
            let code = wait_exit(&mut r, rank, Duration::from_secs(120));
            assert_eq!(code, 0, "rank {rank}:\n{}", log_of(&r, rank));
        }
    };
    two(4);
    let (s1, n1) = intact(&out);
    let n1 = n1.unwrap();
    assert_eq!(s1, 4);
    resume_alone(&dir, &out, 6);
    let (s2, n2) = intact(&out);
    let n2 = n2.unwrap();
    // one rank draws half the samples per step that two did
    assert_eq!((s2, n2 - n1), (6, n1 / 4 * 2 / 2), "samples after the 1-rank part");
    two(8);
    let (s3, n3) = intact(&out);
    assert_eq!((s3, n3.unwrap() - n2), (8, n1 / 4 * 2), "samples after the second 2-rank part");
    assert_eq!(logged(&out), (1..=8).collect::<Vec<_>>());
}

#[test]
fn a_rendezvous_port_in_use_is_an_error_naming_the_port_and_its_variables() {
    let dir = scratch("port");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let args = train_args(&dir.join("run"), 2, 0, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let env =
        [("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", &port)];
    let o = meddpm(&dir, &args, &env).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_ne!(o.status.code(), Some(0));
    for want in [format!("port {port}"), "in use".into(), "MASTER_PORT".into(), "MEDDPM_RDZV_PORT".into()] {
        assert!(err.contains(&want), "the error does not say {want:?}: {err}");
    }
    drop(taken);
}
