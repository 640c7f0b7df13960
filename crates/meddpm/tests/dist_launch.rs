//! Launch environments without a cluster: torchrun-style and Slurm variables, Slurm node lists,
//! `--gpus` selections and the environment each spawned rank gets (NVLink multicast off), and the
//! local launcher's handling of a failing rank and its passing on of signals (real child
//! processes: `sh`).

use meddpm::dist::env::{expand_nodelist, first_node, slurm_default_port, DistEnv, Launcher};
use meddpm::dist::spawn::{local_rank_envs, run_local, strip_gpus_arg, GpuSelection, NO_MULTICAST_ENV};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn env(pairs: &[(&str, &str)]) -> meddpm::Result<Option<DistEnv>> {
    let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    DistEnv::from_vars(|k| m.get(k).cloned())
}

fn err(pairs: &[(&str, &str)]) -> String {
    env(pairs).unwrap_err().to_string()
}

#[test]
fn torchrun_variables() {
    let e = env(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "node7"),
        ("MASTER_PORT", "29500"),
        ("SLURM_PROCID", "0"), // torchrun's variables win
        ("SLURM_NTASKS", "8"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(
        e,
        DistEnv {
            rank: 3,
            world: 4,
            local_rank: 1,
            master_addr: "node7".into(),
            master_port: 29500,
            launcher: Launcher::Torchrun
        }
    );
    assert_eq!(env(&[]).unwrap(), None, "no launcher: a plain process");
    let full = [("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1234")];
    let without = |k: &'static str| full.iter().copied().filter(|(n, _)| *n != k).collect::<Vec<_>>();
    for k in ["WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"] {
        let e = err(&without(k));
        assert!(e.contains(k) && e.contains("not set"), "{e}");
    }
    let with = |k: &'static str, v: &'static str| {
        let mut p = without(k);
        p.push((k, v));
        p
    };
    let e = err(&with("RANK", "2"));
    assert!(e.contains("RANK is 2") && e.contains("world size is 2"), "{e}");
    let e = err(&with("MASTER_PORT", "70000"));
    assert!(e.contains("MASTER_PORT") && e.contains("70000"), "{e}");
    let e = err(&with("WORLD_SIZE", "two"));
    assert!(e.contains("WORLD_SIZE") && e.contains("\"two\""), "{e}");
    assert!(err(&with("WORLD_SIZE", "0")).contains("at least one rank"));
    // under torchrun its agent owns MASTER_PORT: the rendezvous takes the next port; an explicit
    // MEDDPM_RDZV_PORT wins over both
    let mut p = full.to_vec();
    p.push(("TORCHELASTIC_RUN_ID", "none"));
    assert_eq!(env(&p).unwrap().unwrap().master_port, 1235);
    p.push(("MEDDPM_RDZV_PORT", "4000"));
    assert_eq!(env(&p).unwrap().unwrap().master_port, 4000);
    p.pop();
    p.push(("MEDDPM_RDZV_PORT", "0"));
    assert!(err(&p).contains("MEDDPM_RDZV_PORT"));
}

#[test]
fn slurm_variables() {
    let base = [
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "16"),
        ("SLURM_STEP_NUM_TASKS", "8"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_STEP_NODELIST", "gpu[007-010]"),
        ("SLURM_JOB_NODELIST", "gpu[001-020]"),
        ("SLURM_JOB_ID", "123456"),
    ];
    let e = env(&base).unwrap().unwrap();
    assert_eq!((e.rank, e.world, e.local_rank), (5, 8, 1), "the step's task count wins over the job's");
    assert_eq!(e.master_addr, "gpu007", "first node of the step, zero padding kept");
    assert_eq!(e.master_port, 20000 + (123456 % 20000) as u16);
    assert_eq!(e.launcher, Launcher::Slurm);
    // MASTER_ADDR / MASTER_PORT override; the job node list is the fallback
    let mut p = base.to_vec();
    p.retain(|(k, _)| *k != "SLURM_STEP_NODELIST" && *k != "SLURM_STEP_NUM_TASKS");
    let e = env(&p).unwrap().unwrap();
    assert_eq!((e.world, e.master_addr.as_str()), (16, "gpu001"));
    p.extend([("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "4000")]);
    let e = env(&p).unwrap().unwrap();
    assert_eq!((e.master_addr.as_str(), e.master_port), ("10.0.0.1", 4000));
    assert_eq!(slurm_default_port(None), 29500);
    // errors name the variable
    let mut p = base.to_vec();
    p.retain(|(k, _)| *k != "SLURM_LOCALID");
    assert!(err(&p).contains("SLURM_LOCALID"));
    let mut p = base.to_vec();
    p.retain(|(k, _)| !k.contains("NODELIST"));
    assert!(err(&p).contains("SLURM_STEP_NODELIST"));
    let mut p = base.to_vec();
    p.push(("SLURM_STEP_NODELIST", "gpu[3-1]"));
    p.retain(|(k, v)| *k != "SLURM_STEP_NODELIST" || *v == "gpu[3-1]");
    let e = err(&p);
    assert!(e.contains("SLURM_STEP_NODELIST") && e.contains("backwards"), "{e}");
    // SLURM_PROCID alone (no task count) is not a distributed launch
    assert_eq!(env(&[("SLURM_PROCID", "0")]).unwrap(), None);
}

#[test]
fn slurm_node_lists() {
    let x = |s: &str| expand_nodelist(s).unwrap();
    assert_eq!(x("node1"), ["node1"]);
    assert_eq!(x("a,b,c"), ["a", "b", "c"]);
    assert_eq!(x("node[01-03,7]"), ["node01", "node02", "node03", "node7"]);
    assert_eq!(x("n[8-10]"), ["n8", "n9", "n10"]);
    assert_eq!(x("gpu-[1-2]-ib,cpu5"), ["gpu-1-ib", "gpu-2-ib", "cpu5"]);
    assert_eq!(x("r[1-2]n[09-10]"), ["r1n09", "r1n10", "r2n09", "r2n10"]);
    assert_eq!(x("a[1,3],b[2]"), ["a1", "a3", "b2"]);
    assert_eq!(first_node("rack[12-14]-node[003-004]").unwrap(), "rack12-node003");
    for bad in ["", "a,,b", "n[1-", "n]1[", "n[a-b]", "n[5-2]", "n[1-2]]", "n[[1]]", "n[]"] {
        assert!(expand_nodelist(bad).is_err(), "{bad:?} should be refused");
    }
    assert!(expand_nodelist("n[0-99999999]").unwrap_err().contains("too long"));
}

#[test]
fn gpu_selection_and_rank_environments() {
    let p = |s: &str| s.parse::<GpuSelection>();
    assert_eq!(p("2"), Ok(GpuSelection::Count(2)));
    assert_eq!(p("all"), Ok(GpuSelection::All));
    assert_eq!(p("0,2"), Ok(GpuSelection::List(vec![0, 2])));
    assert_eq!(p("3,"), Ok(GpuSelection::List(vec![3])));
    assert!(p("0").unwrap_err().contains("at least one"));
    assert!(p("1,1").unwrap_err().contains("twice"));
    assert!(p("x").unwrap_err().contains("expected a count"));
    assert_eq!(GpuSelection::All.resolve(4).unwrap(), [0, 1, 2, 3]);
    assert_eq!(GpuSelection::Count(2).resolve(4).unwrap(), [0, 1]);
    assert!(GpuSelection::Count(3).resolve(2).unwrap_err().to_string().contains("only 2"));
    assert!(GpuSelection::List(vec![0, 5]).resolve(2).unwrap_err().to_string().contains("device 5"));
    assert!(GpuSelection::All.resolve(0).is_err());

    let envs = local_rank_envs(&[1, 3], None, 4567).unwrap();
    assert_eq!(envs.len(), 2);
    for (i, e) in envs.iter().enumerate() {
        let m: HashMap<_, _> = e.iter().cloned().collect();
        assert_eq!(m["RANK"], i.to_string());
        assert_eq!(m["LOCAL_RANK"], i.to_string());
        assert_eq!(m["WORLD_SIZE"], "2");
        assert_eq!(m["MASTER_PORT"], "4567");
        assert_eq!(m["CUDA_VISIBLE_DEVICES"], "1,3", "rank i uses the i-th visible device");
        for (k, v) in NO_MULTICAST_ENV {
            assert_eq!(m[k], v, "{k} must be set in every rank");
        }
        // what a child reads back
        let d = DistEnv::from_vars(|k| m.get(k).cloned()).unwrap().unwrap();
        assert_eq!((d.rank, d.world, d.local_rank, d.master_port), (i, 2, i, 4567));
    }
    assert!(NO_MULTICAST_ENV.contains(&("NCCL_NVLS_ENABLE", "0")));
    // under the parent's CUDA_VISIBLE_DEVICES, the indices refer to its entries
    let envs = local_rank_envs(&[0, 2], Some("4,5,6"), 1).unwrap();
    assert!(envs[0].contains(&("CUDA_VISIBLE_DEVICES".to_string(), "4,6".to_string())));
    assert!(local_rank_envs(&[3], Some("4,5"), 1).unwrap_err().to_string().contains("CUDA_VISIBLE_DEVICES"));

    let args: Vec<String> =
        ["train", "--gpus", "2", "--steps", "5", "--gpus=all", "--out", "x"].iter().map(|s| s.to_string()).collect();
    assert_eq!(strip_gpus_arg(&args), ["train", "--steps", "5", "--out", "x"]);
}

#[test]
fn local_launcher_reports_the_failed_rank_and_stops_the_others() {
    let sh = std::path::Path::new("/bin/sh");
    if !sh.exists() {
        println!("skipped: no /bin/sh");
        return;
    }
    // rank 0 would run for a minute, rank 1 fails at once with status 3
    let script = vec!["-c".to_string(), "if [ \"$RANK\" = 1 ]; then exit 3; fi; exec sleep 60".to_string()];
    let envs = local_rank_envs(&[0, 1], None, 1).unwrap();
    let e = run_local(sh, &script, &envs, Duration::from_millis(300), &AtomicUsize::new(0)).unwrap_err().to_string();
    assert!(e.contains("rank 1 exited with status 3"), "{e}");
    assert!(e.contains("rank 0 killed"), "{e}");
    // every rank sees its own variables; all succeed → Ok
    let check = vec!["-c".to_string(), "[ \"$WORLD_SIZE\" = 2 ] && [ \"$NCCL_NVLS_ENABLE\" = 0 ]".to_string()];
    run_local(sh, &check, &envs, Duration::from_secs(1), &AtomicUsize::new(0)).unwrap();
}

#[test]
fn local_launcher_passes_each_signal_on_to_every_rank_once() {
    let sh = std::path::Path::new("/bin/sh");
    if !sh.exists() || !std::path::Path::new("/proc/self/stat").exists() {
        println!("skipped: no /bin/sh or /proc");
        return;
    }
    let dir = std::env::temp_dir().join(format!("meddpm-launch-signals-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // Each rank: fails (7) unless it leads its own process group (so the terminal's Ctrl-C
    // reaches the parent only); logs every SIGINT; exits 0 at the second; gives up after 20 s.
    let body = r#"set -- $(cat /proc/$$/stat); [ "$5" = "$$" ] || exit 7
n=0
trap 'n=$((n+1)); echo int >> "$OUT/$RANK.log"; [ $n -ge 2 ] && exit 0' INT
touch "$OUT/$RANK.ready"
i=0
while [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done
exit 9"#;
    let script = vec!["-c".to_string(), body.to_string()];
    let mut envs = local_rank_envs(&[0, 1], None, 1).unwrap();
    for e in &mut envs {
        e.push(("OUT".into(), dir.display().to_string()));
    }
    let forward = Arc::new(AtomicUsize::new(0));
    let signaller = {
        let (forward, dir) = (forward.clone(), dir.clone());
        std::thread::spawn(move || {
            let t0 = std::time::Instant::now();
            while !(dir.join("0.ready").exists() && dir.join("1.ready").exists()) {
                assert!(t0.elapsed() < Duration::from_secs(15), "the ranks never got ready");
                std::thread::sleep(Duration::from_millis(20));
            }
            // two signals to the parent, as a user's Ctrl-C twice; the second once every rank
            // has handled the first (two SIGINTs pending at once are one to a shell: on a loaded
            // machine a fixed pause between them was not always enough)
            forward.fetch_add(1, Ordering::SeqCst);
            let handled = |r: usize| std::fs::read_to_string(dir.join(format!("{r}.log"))).is_ok_and(|l| !l.is_empty());
            while !(handled(0) && handled(1)) {
                assert!(t0.elapsed() < Duration::from_secs(18), "the ranks never logged the first signal");
                std::thread::sleep(Duration::from_millis(20));
            }
            forward.fetch_add(1, Ordering::SeqCst);
        })
    };
    run_local(sh, &script, &envs, Duration::from_secs(1), &forward).unwrap();
    signaller.join().unwrap();
    for r in 0..2 {
        let log = std::fs::read_to_string(dir.join(format!("{r}.log"))).unwrap();
        assert_eq!(log.lines().count(), 2, "rank {r} got {log:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
