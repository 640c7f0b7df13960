//! `--gpus N|all|0,1`: one machine, one process per GPU, spawned by meddpm itself. The parent
//! re-runs its own command line (without `--gpus`) once per selected GPU with the torchrun-style
//! variables set (`RANK` = `LOCAL_RANK` = i, `WORLD_SIZE`, `MASTER_ADDR` = 127.0.0.1, a free
//! `MASTER_PORT`), restricts `CUDA_VISIBLE_DEVICES` to the selected GPUs (rank i uses the i-th),
//! and keeps NVLink multicast off in every child ([`NO_MULTICAST_ENV`]). It then waits: when a
//! child fails, the others normally stop on their own within the liveness timeout (see
//! `rendezvous::Watch`); whatever is still running after a grace period is killed.
//!
//! Signals: each child runs in its own process group, so a Ctrl-C at the terminal reaches the
//! parent alone; the parent passes every SIGINT/SIGTERM it gets on to each rank as one SIGINT
//! ([`run_local`]'s `forward` count). The ranks then see exactly one signal per signal the user
//! sent — the first finishes the step and saves (every rank stops at the same step, see
//! `run::session`), a second aborts — instead of one from the terminal plus one from the parent.
//! Every rank starts with SIGINT at its default disposition, even when the parent was started
//! with it ignored (in the background of a non-interactive shell).

use crate::error::{Error, Result};
use std::path::Path;
use std::process::{Child, Command};
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Set in every rank's environment. NVLink SHARP / multicast (NVLS) can take the shared GPUs of
/// our machines out of service; these keep NCCL, PyTorch and NVSHMEM from using it.
pub const NO_MULTICAST_ENV: [(&str, &str); 3] =
    [("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")];

/// Which GPUs `--gpus` selects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuSelection {
    /// The first N devices.
    Count(usize),
    /// Every device.
    All,
    /// These device indices (at least two, or one given as `3,`).
    List(Vec<usize>),
}

impl FromStr for GpuSelection {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim();
        let usage = || format!("--gpus {s:?}: expected a count (2), 'all', or device indices (0,1)");
        if s == "all" {
            return Ok(GpuSelection::All);
        }
        if s.contains(',') {
            let mut v = Vec::new();
            for p in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                let d: usize = p.parse().map_err(|_| usage())?;
                if v.contains(&d) {
                    return Err(format!("--gpus {s:?}: device {d} is listed twice"));
                }
                v.push(d);
            }
            if v.is_empty() {
                return Err(usage());
            }
            return Ok(GpuSelection::List(v));
        }
        match s.parse::<usize>() {
            Ok(0) => Err(format!("--gpus {s:?}: at least one GPU")),
            Ok(n) => Ok(GpuSelection::Count(n)),
            Err(_) => Err(usage()),
        }
    }
}

impl GpuSelection {
    /// The device indices for a machine with `available` devices.
    pub fn resolve(&self, available: usize) -> Result<Vec<usize>> {
        if available == 0 {
            return Err(Error::Dist(
                "--gpus: no CUDA device is visible to this process (`meddpm doctor` says why)".into(),
            ));
        }
        match self {
            GpuSelection::All => Ok((0..available).collect()),
            GpuSelection::Count(n) if *n > available => Err(Error::Dist(format!(
                "--gpus {n}: only {available} CUDA device(s) are visible (CUDA_VISIBLE_DEVICES limits them)"
            ))),
            GpuSelection::Count(n) => Ok((0..*n).collect()),
            GpuSelection::List(v) => match v.iter().find(|&&d| d >= available) {
                Some(d) => Err(Error::Dist(format!(
                    "--gpus: device {d} does not exist; {available} device(s) are visible (0..{})",
                    available.saturating_sub(1)
                ))),
                None => Ok(v.clone()),
            },
        }
    }
}

/// The environment of each local rank: rank i runs on `devices[i]`. `visible` is the parent's
/// `CUDA_VISIBLE_DEVICES`, if set: then `devices` index into it (as CUDA numbers them for the
/// parent) and the children see the selected entries only.
pub fn local_rank_envs(devices: &[usize], visible: Option<&str>, port: u16) -> Result<Vec<Vec<(String, String)>>> {
    let ids: Vec<String> = match visible.map(str::trim).filter(|v| !v.is_empty()) {
        None => devices.iter().map(|d| d.to_string()).collect(),
        Some(v) => {
            let list: Vec<&str> = v.split(',').map(str::trim).collect();
            devices
                .iter()
                .map(|&d| {
                    list.get(d)
                        .map(|s| s.to_string())
                        .ok_or_else(|| Error::Dist(format!("--gpus: device {d} is not in CUDA_VISIBLE_DEVICES={v:?}")))
                })
                .collect::<Result<_>>()?
        }
    };
    let world = devices.len();
    Ok((0..world)
        .map(|i| {
            let mut e: Vec<(String, String)> = vec![
                ("RANK".into(), i.to_string()),
                ("LOCAL_RANK".into(), i.to_string()),
                ("WORLD_SIZE".into(), world.to_string()),
                ("LOCAL_WORLD_SIZE".into(), world.to_string()),
                ("MASTER_ADDR".into(), "127.0.0.1".into()),
                ("MASTER_PORT".into(), port.to_string()),
                ("CUDA_VISIBLE_DEVICES".into(), ids.join(",")),
            ];
            e.extend(NO_MULTICAST_ENV.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            e
        })
        .collect())
}

/// The command line without its `--gpus X` / `--gpus=X` (what each child runs).
pub fn strip_gpus_arg(args: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len());
    let mut skip = false;
    for a in args {
        if std::mem::take(&mut skip) {
            continue;
        }
        if a == "--gpus" {
            skip = true;
        } else if !a.starts_with("--gpus=") {
            out.push(a.clone());
        }
    }
    out
}

/// A TCP port that was free a moment ago on 127.0.0.1 (the OS picks it).
pub fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| Error::Dist(format!("finding a free port: {e}")))?;
    l.local_addr().map(|a| a.port()).map_err(|e| Error::Dist(format!("finding a free port: {e}")))
}

/// Count this process's SIGINT/SIGTERM/SIGHUP (for [`run_local`] to pass on) instead of dying
/// of them; the first prints a note. For the launcher process only: it takes over the process's
/// signals, once.
pub fn count_signals() -> Result<Arc<AtomicUsize>> {
    let signals = Arc::new(AtomicUsize::new(0));
    let counter = signals.clone();
    ctrlc::set_handler(move || {
        if counter.fetch_add(1, Ordering::SeqCst) == 0 {
            eprintln!("\nmeddpm: passing the stop on to every rank (interrupt again to abort them at once)");
        }
    })
    .map_err(|e| Error::Dist(format!("--gpus: cannot install the SIGINT/SIGTERM handler: {e}")))?;
    Ok(signals)
}

/// Send SIGINT to a child (Unix; elsewhere the ranks get the console's Ctrl-C themselves).
fn interrupt(ch: &Child) {
    #[cfg(unix)]
    {
        use nix::sys::signal::{kill, Signal};
        use nix::unistd::Pid;
        let _ = kill(Pid::from_raw(ch.id() as i32), Signal::SIGINT);
    }
    #[cfg(not(unix))]
    let _ = ch;
}

/// Run `program args` once per entry of `envs` and wait for all. The first child to fail makes
/// the others' remaining time `grace`; then they are killed. Errors name the failed rank(s).
/// Each time `forward` grows (the caller's signal handler counts the signals it received), every
/// child still running gets one SIGINT (see the module doc).
pub fn run_local(
    program: &Path,
    args: &[String],
    envs: &[Vec<(String, String)>],
    grace: Duration,
    forward: &AtomicUsize,
) -> Result<()> {
    let mut children: Vec<(usize, Child)> = Vec::new();
    let mut forwarded = forward.load(Ordering::SeqCst);
    for (rank, env) in envs.iter().enumerate() {
        let mut c = Command::new(program);
        c.args(args).envs(env.iter().map(|(k, v)| (k, v)));
        #[cfg(unix)]
        {
            use std::os::unix::process::CommandExt;
            c.process_group(0);
            // A parent started in the background by a non-interactive shell (`cmd &`, as CI
            // runners and nohup-style wrappers do) inherits SIGINT ignored, and so would every
            // rank — a shell rank could then not even trap it. The ranks get exactly the signals
            // this launcher forwards, so they start with SIGINT at its default.
            // SAFETY: between fork and exec only sigaction, which is async-signal-safe, runs.
            unsafe {
                c.pre_exec(|| {
                    use nix::sys::signal::{signal, SigHandler, Signal};
                    signal(Signal::SIGINT, SigHandler::SigDfl).map(|_| ()).map_err(std::io::Error::from)
                });
            }
        }
        match c.spawn() {
            Ok(ch) => children.push((rank, ch)),
            Err(e) => {
                for (_, ch) in &mut children {
                    let _ = ch.kill();
                    let _ = ch.wait();
                }
                return Err(Error::Dist(format!("starting rank {rank} ({}): {e}", program.display())));
            }
        }
    }
    let mut failures: Vec<String> = Vec::new();
    let mut kill_at: Option<Instant> = None;
    let mut running = children.len();
    let mut done = vec![false; children.len()];
    while running > 0 {
        let signals = forward.load(Ordering::SeqCst);
        while forwarded < signals {
            forwarded += 1;
            for (_, ch) in children.iter().enumerate().filter(|(i, _)| !done[*i]).map(|(_, c)| c) {
                interrupt(ch);
            }
        }
        for (i, (rank, ch)) in children.iter_mut().enumerate() {
            if done[i] {
                continue;
            }
            match ch.try_wait() {
                Ok(Some(st)) => {
                    done[i] = true;
                    running -= 1;
                    if !st.success() {
                        failures.push(format!("rank {rank} {}", describe_exit(st)));
                        kill_at.get_or_insert_with(|| Instant::now() + grace);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    done[i] = true;
                    running -= 1;
                    failures.push(format!("rank {rank}: cannot wait for it: {e}"));
                }
            }
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            for (i, (rank, ch)) in children.iter_mut().enumerate() {
                if !done[i] {
                    let _ = ch.kill();
                    let _ = ch.wait();
                    done[i] = true;
                    running -= 1;
                    failures.push(format!("rank {rank} killed {:.0} s after the first failure", grace.as_secs_f64()));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(Error::Dist(failures.join("; ")))
    }
}

fn describe_exit(st: std::process::ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = st.signal() {
            return format!("was killed by signal {sig}");
        }
    }
    match st.code() {
        Some(c) => format!("exited with status {c}"),
        None => "exited abnormally".into(),
    }
}
