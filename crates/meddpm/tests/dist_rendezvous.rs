//! The TCP rendezvous with ranks as threads on loopback: success, a rank that never arrives, a
//! wrong world size, a configuration mismatch, a port in use, rank 0 failing to make its payload;
//! then the liveness watch: a rank that dies (its connection closes) or falls silent is reported
//! to the others by name, and a clean shutdown reports nothing.

use meddpm::dist::rendezvous::{bind, join, serve, Rendezvous, RendezvousConfig, WatchConfig};
use std::net::TcpListener;
use std::sync::mpsc::{channel, Receiver};
use std::thread::JoinHandle;
use std::time::Duration;

/// Generous bound on waiting for an event that must come (a hang guard, not a timing check).
const HANG: Duration = Duration::from_secs(60);

fn cfg(rank: usize, world: usize, port: u16, hash: u64, timeout_ms: u64) -> RendezvousConfig {
    RendezvousConfig {
        rank,
        world,
        addr: "127.0.0.1".into(),
        port,
        config_hash: hash,
        timeout: Duration::from_millis(timeout_ms),
    }
}

fn payload() -> Vec<u8> {
    (0..128u32).map(|i| (i * 7 + 3) as u8).collect()
}

/// Rank 0 on a fresh port (bound before the others start, so no port race), plus the port.
fn rank0(
    world: usize,
    hash: u64,
    timeout_ms: u64,
    p: Result<Vec<u8>, String>,
) -> (u16, JoinHandle<meddpm::Result<Rendezvous>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let c = cfg(0, world, port, hash, timeout_ms);
    (port, std::thread::spawn(move || serve(l, &c, p)))
}

fn other(c: RendezvousConfig) -> JoinHandle<meddpm::Result<Rendezvous>> {
    std::thread::spawn(move || join(&c, Err("only rank 0 serves".into())))
}

#[test]
fn all_ranks_get_rank_0s_payload() {
    let (port, r0) = rank0(4, 77, 20_000, Ok(payload()));
    let others: Vec<_> = (1..4).map(|r| other(cfg(r, 4, port, 77, 20_000))).collect();
    let r0 = r0.join().unwrap().unwrap();
    assert_eq!(r0.payload, payload());
    assert_eq!(r0.peers(), [1, 2, 3]);
    for (r, h) in (1..4).zip(others) {
        let x = h.join().unwrap().unwrap();
        assert_eq!((x.rank, x.world), (r, 4));
        assert_eq!(x.payload, payload());
        assert_eq!(x.peers(), [0]);
    }
}

#[test]
fn a_rank_that_never_arrives_is_named() {
    let (port, r0) = rank0(4, 1, 1500, Ok(payload()));
    let r1 = other(cfg(1, 4, port, 1, 1500));
    let r3 = other(cfg(3, 4, port, 1, 1500));
    let e0 = r0.join().unwrap().unwrap_err().to_string();
    assert!(e0.contains("timed out") && e0.contains("rank(s) 2 of 4 never arrived"), "{e0}");
    for h in [r1, r3] {
        let e = h.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("rank(s) 2 of 4 never arrived"), "the waiting ranks learn why: {e}");
    }
}

#[test]
fn rank_0_that_never_comes_is_reported_by_the_others() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l); // nobody listens there now
    let e = join(&cfg(1, 2, port, 1, 500), Err(String::new())).unwrap_err().to_string();
    assert!(e.contains("could not reach rank 0") && e.contains(&port.to_string()), "{e}");
}

#[test]
fn a_wrong_world_size_fails_every_rank() {
    let (port, r0) = rank0(2, 5, 20_000, Ok(payload()));
    let r1 = other(cfg(1, 3, port, 5, 20_000));
    let e0 = r0.join().unwrap().unwrap_err().to_string();
    let e1 = r1.join().unwrap().unwrap_err().to_string();
    assert!(e0.contains("world size 3") && e0.contains("rank 0 with 2"), "{e0}");
    assert!(e1.contains("refused") && e1.contains("world size 3"), "{e1}");
}

#[test]
fn a_configuration_mismatch_fails_every_rank() {
    let (port, r0) = rank0(3, 0xabc, 20_000, Ok(payload()));
    let r1 = other(cfg(1, 3, port, 0xabc, 20_000));
    let r2 = other(cfg(2, 3, port, 0xdef, 20_000));
    let e0 = r0.join().unwrap().unwrap_err().to_string();
    assert!(e0.contains("rank 2") && e0.contains("different configuration"), "{e0}");
    // rank 1 may have arrived before or after rank 2: either way it is told (also from the listen
    // backlog), or (arriving after rank 0 gave up) cannot reach rank 0 any more, or (connecting in
    // the instant between the backlog's last check and the listener's close) sees it close
    let e1 = r1.join().unwrap().unwrap_err().to_string();
    assert!(
        e1.contains("different configuration")
            || e1.contains("could not reach")
            || e1.contains("closed the connection"),
        "{e1}"
    );
    let e2 = r2.join().unwrap().unwrap_err().to_string();
    assert!(e2.contains("different configuration"), "{e2}");
}

#[test]
fn duplicate_ranks_are_refused() {
    let (port, r0) = rank0(3, 1, 20_000, Ok(payload()));
    let a = other(cfg(1, 3, port, 1, 20_000));
    let b = other(cfg(1, 3, port, 1, 20_000));
    let e0 = r0.join().unwrap().unwrap_err().to_string();
    assert!(e0.contains("two processes claim rank 1"), "{e0}");
    let _ = (a.join(), b.join());
}

#[test]
fn a_port_in_use_is_a_clear_error() {
    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    let e = bind("127.0.0.1", port).unwrap_err().to_string();
    assert!(e.contains("in use") && e.contains(&port.to_string()) && e.contains("MASTER_PORT"), "{e}");
    let e = join(&cfg(0, 2, port, 1, 100), Ok(payload())).unwrap_err().to_string();
    assert!(e.contains("in use"), "{e}");
}

#[test]
fn rank_0_failing_to_start_tells_the_others() {
    let (port, r0) = rank0(2, 1, 20_000, Err("NCCL could not be loaded".into()));
    let r1 = other(cfg(1, 2, port, 1, 20_000));
    let e0 = r0.join().unwrap().unwrap_err().to_string();
    let e1 = r1.join().unwrap().unwrap_err().to_string();
    assert!(e0.contains("NCCL could not be loaded"), "{e0}");
    assert!(e1.contains("rank 0 could not start: NCCL could not be loaded"), "{e1}");
}

/// A joined group of `world` ranks.
fn group(world: usize) -> Vec<Rendezvous> {
    let (port, r0) = rank0(world, 9, 20_000, Ok(payload()));
    let others: Vec<_> = (1..world).map(|r| other(cfg(r, world, port, 9, 20_000))).collect();
    let mut g = vec![r0.join().unwrap().unwrap()];
    g.extend(others.into_iter().map(|h| h.join().unwrap().unwrap()));
    g
}

fn watch(r: Rendezvous, silence_ms: u64) -> (meddpm::dist::rendezvous::Watch, Receiver<String>) {
    let (tx, rx) = channel();
    let tx = std::sync::Mutex::new(tx);
    let cfg = WatchConfig { heartbeat: Duration::from_millis(50), silence: Duration::from_millis(silence_ms) };
    let w = r.watch(cfg, move |m| tx.lock().unwrap().send(m).unwrap()).unwrap();
    (w, rx)
}

#[test]
fn a_rank_that_dies_is_reported_to_every_other_rank() {
    let mut g = group(3).into_iter();
    let (r0, r1, r2) = (g.next().unwrap(), g.next().unwrap(), g.next().unwrap());
    let (w0, rx0) = watch(r0, 30_000);
    let (w1, rx1) = watch(r1, 30_000);
    drop(r2); // rank 2's process "dies": its connection closes without a goodbye
    let m0 = rx0.recv_timeout(HANG).expect("rank 0 must notice");
    assert!(m0.contains("rank 2 closed its connection without finishing"), "{m0}");
    // rank 1 has no connection to rank 2: rank 0 passes the news on
    let m1 = rx1.recv_timeout(HANG).expect("rank 1 must be told");
    assert!(m1.contains("rank 0 reports: rank 2 closed its connection"), "{m1}");
    assert!(rx0.try_recv().is_err(), "reported once");
    drop((w0, w1));
}

#[test]
fn a_silent_rank_is_reported_after_the_silence_timeout() {
    let mut g = group(2).into_iter();
    let (r0, r1) = (g.next().unwrap(), g.next().unwrap());
    let (w0, rx0) = watch(r0, 400);
    // rank 1 keeps its connection open but sends nothing (a frozen process)
    let m = rx0.recv_timeout(HANG).expect("rank 0 must notice the silence");
    assert!(m.contains("rank 1 sent nothing"), "{m}");
    drop((w0, r1));
}

#[test]
fn a_clean_shutdown_reports_nothing() {
    let mut g = group(3).into_iter();
    let (r0, r1, r2) = (g.next().unwrap(), g.next().unwrap(), g.next().unwrap());
    let (w0, rx0) = watch(r0, 30_000);
    let (w1, rx1) = watch(r1, 30_000);
    let (w2, rx2) = watch(r2, 30_000);
    std::thread::sleep(Duration::from_millis(200)); // a few heartbeats flow
                                                    // ranks finish in any order
    w1.close();
    w0.close();
    w2.close();
    for rx in [rx0, rx1, rx2] {
        assert!(rx.try_recv().is_err(), "no rank was reported lost");
    }
}
