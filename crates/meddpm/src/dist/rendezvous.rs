//! The TCP rendezvous: rank 0 hands an opaque payload (the 128-byte NCCL unique id) to every other
//! rank over `MASTER_ADDR:MASTER_PORT`, after checking that all of them agree on the world size
//! and the run configuration (a hash). This is the only networking meddpm writes; every collective
//! afterwards is NCCL's.
//!
//! Protocol (little-endian): a rank r ≥ 1 connects (retrying until the deadline: rank 0 may start
//! later) and sends `MAGIC | rank u32 | world u32 | config hash u64`. Rank 0 waits until ranks
//! 1..W−1 have all arrived, then answers each `0 | len u32 | payload`; on any problem it answers
//! `1 | len u32 | message` to every rank that came and returns the same error itself:
//! a rank that never arrives (the error lists the missing ranks), a wrong world size, a config
//! mismatch, a duplicate or out-of-range rank, a port already in use.
//!
//! The connections then stay open as a liveness channel ([`Rendezvous::watch`]): heartbeats both
//! ways, a goodbye byte at a clean end. A rank whose process dies closes its sockets, so its peer
//! learns it at once (rank 0 passes the news on to the others), and a silent peer is declared lost
//! after a timeout. This is what turns a killed rank into a clear error on the others instead of an
//! NCCL collective that waits forever.

use crate::error::{Error, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"MDPMRDZ1";
const HELLO_LEN: usize = 24;
/// Largest payload or message accepted (the NCCL id is 128 bytes).
const MAX_MSG: u32 = 1 << 16;

/// Everything a rank needs to join.
#[derive(Clone, Debug)]
pub struct RendezvousConfig {
    pub rank: usize,
    pub world: usize,
    /// Rank 0's host (`MASTER_ADDR`) and port (`MASTER_PORT`).
    pub addr: String,
    pub port: u16,
    /// Hash of everything every rank must agree on (see `dist::config_hash`).
    pub config_hash: u64,
    /// How long rank 0 waits for the others (and they for rank 0).
    pub timeout: Duration,
}

impl RendezvousConfig {
    /// The configuration of the rank `env` describes (rank, world, `MASTER_ADDR`/`MASTER_PORT`).
    pub fn of(env: &super::DistEnv, config_hash: u64, timeout: Duration) -> Self {
        RendezvousConfig {
            rank: env.rank,
            world: env.world,
            addr: env.master_addr.clone(),
            port: env.master_port,
            config_hash,
            timeout,
        }
    }

    fn endpoint(&self) -> String {
        format!("{}:{}", self.addr, self.port)
    }
    /// Ranks ≥ 1 wait this much longer than rank 0, so that rank 0's verdict reaches them.
    fn grace(&self) -> Duration {
        self.timeout.min(Duration::from_secs(10)) + Duration::from_millis(500)
    }
}

/// A joined rank: the payload from rank 0 and the open connections (rank 0: to every other rank;
/// others: to rank 0).
#[derive(Debug)]
pub struct Rendezvous {
    pub rank: usize,
    pub world: usize,
    pub payload: Vec<u8>,
    links: Vec<(usize, TcpStream)>,
}

fn err(m: impl Into<String>) -> Error {
    Error::Dist(m.into())
}

fn write_msg(s: &mut TcpStream, status: u8, body: &[u8]) -> std::io::Result<()> {
    let mut b = Vec::with_capacity(5 + body.len());
    b.push(status);
    b.extend((body.len() as u32).to_le_bytes());
    b.extend(body);
    s.write_all(&b)
}

fn read_msg(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut h = [0u8; 5];
    s.read_exact(&mut h)?;
    let len = u32::from_le_bytes([h[1], h[2], h[3], h[4]]);
    if len > MAX_MSG {
        return Err(std::io::Error::new(ErrorKind::InvalidData, format!("message of {len} bytes")));
    }
    let mut body = vec![0u8; len as usize];
    s.read_exact(&mut body)?;
    Ok((h[0], body))
}

/// The address rank 0 listens on: the loopback address itself when MASTER_ADDR is one (tests,
/// one machine), else every interface of MASTER_ADDR's family (a host name may resolve to an
/// address that is not bound locally, e.g. Debian's 127.0.1.1).
fn listen_addr(addr: &str, port: u16) -> Result<SocketAddr> {
    let resolved = (addr, port)
        .to_socket_addrs()
        .map_err(|e| err(format!("cannot resolve MASTER_ADDR {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| err(format!("MASTER_ADDR {addr:?} resolves to no address")))?;
    Ok(match resolved.ip() {
        ip if ip.is_loopback() => resolved,
        IpAddr::V4(_) => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
        IpAddr::V6(_) => SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port),
    })
}

/// Rank 0's listening socket, with a clear error when the port is taken.
pub fn bind(addr: &str, port: u16) -> Result<TcpListener> {
    let a = listen_addr(addr, port)?;
    TcpListener::bind(a).map_err(|e| {
        if e.kind() == ErrorKind::AddrInUse {
            err(format!(
                "rendezvous port {port} on {a} is in use (another run, or a leftover process): set MASTER_PORT (or \
                 MEDDPM_RDZV_PORT, which overrides it) to a free port"
            ))
        } else {
            err(format!("rendezvous: cannot listen on {a}: {e}"))
        }
    })
}

/// Join the run: rank 0 binds `addr:port` and serves `payload` (or, when it failed to make one,
/// its error to everyone); other ranks connect and receive it.
pub fn join(cfg: &RendezvousConfig, payload: std::result::Result<Vec<u8>, String>) -> Result<Rendezvous> {
    if cfg.rank == 0 {
        let l = bind(&cfg.addr, cfg.port)?;
        serve(l, cfg, payload)
    } else {
        connect(cfg)
    }
}

/// After a failed rendezvous: ranks already connected but not yet accepted (in the listen
/// backlog) are told the reason too. Closing the listener would reset their connections, and they
/// would only learn that rank 0 went away. Their hello is read first, so that closing sends a
/// clean end of stream after the message rather than a reset that could discard it.
fn tell_backlog(listener: &TcpListener, msg: &str) {
    while let Ok((mut s, _)) = listener.accept() {
        let _ = s.set_nonblocking(false);
        let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
        let mut h = [0u8; HELLO_LEN];
        let _ = s.read_exact(&mut h);
        let _ = write_msg(&mut s, 1, msg.as_bytes());
    }
}

/// Rank 0 on an already bound listener (tests bind port 0 and hand the port to the others).
pub fn serve(
    listener: TcpListener,
    cfg: &RendezvousConfig,
    payload: std::result::Result<Vec<u8>, String>,
) -> Result<Rendezvous> {
    assert_eq!(cfg.rank, 0, "serve is rank 0's side");
    let endpoint = listener.local_addr().map(|a| a.to_string()).unwrap_or_else(|_| cfg.endpoint());
    let deadline = Instant::now() + cfg.timeout;
    listener.set_nonblocking(true).map_err(|e| err(format!("rendezvous listener: {e}")))?;
    let mut arrived: Vec<Option<(TcpStream, SocketAddr)>> = (0..cfg.world).map(|_| None).collect();
    // Tell every rank that came what went wrong, and fail with the same words.
    let fail = |arrived: &mut Vec<Option<(TcpStream, SocketAddr)>>, extra: Option<&mut TcpStream>, msg: String| {
        for (s, _) in arrived.iter_mut().flatten() {
            let _ = write_msg(s, 1, msg.as_bytes());
        }
        if let Some(s) = extra {
            let _ = write_msg(s, 1, msg.as_bytes());
        }
        tell_backlog(&listener, &msg);
        err(msg)
    };
    let mut count = 1;
    while count < cfg.world {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<String> =
                (1..cfg.world).filter(|&r| arrived[r].is_none()).map(|r| r.to_string()).collect();
            return Err(fail(
                &mut arrived,
                None,
                format!(
                    "rendezvous timed out after {:.0} s on {endpoint}: rank(s) {} of {} never arrived (not started, \
                     crashed, or given another MASTER_ADDR/MASTER_PORT)",
                    cfg.timeout.as_secs_f64(),
                    missing.join(", "),
                    cfg.world
                ),
            ));
        }
        let (mut s, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(fail(&mut arrived, None, format!("rendezvous on {endpoint}: accept failed: {e}"))),
        };
        // a connection that sends no valid hello in time is dropped, not fatal (a port scanner)
        let _ = s.set_nonblocking(false);
        let _ = s.set_read_timeout(Some((deadline - now).max(Duration::from_millis(100)).min(Duration::from_secs(5))));
        let mut h = [0u8; HELLO_LEN];
        if s.read_exact(&mut h).is_err() || &h[..8] != MAGIC {
            let _ = write_msg(&mut s, 1, b"not a meddpm rendezvous hello (different meddpm version?)");
            continue;
        }
        let rank = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes")) as usize;
        let world = u32::from_le_bytes(h[12..16].try_into().expect("4 bytes")) as usize;
        let hash = u64::from_le_bytes(h[16..24].try_into().expect("8 bytes"));
        let problem = if world != cfg.world {
            Some(format!(
                "rank {rank} (from {peer}) was started with world size {world}, rank 0 with {}: every rank needs the same \
                 WORLD_SIZE",
                cfg.world
            ))
        } else if rank == 0 || rank >= cfg.world {
            Some(format!("a process at {peer} claims rank {rank}; ranks 1..{} are expected", cfg.world - 1))
        } else if let Some((_, first)) = &arrived[rank] {
            Some(format!("two processes claim rank {rank} ({first} and {peer})"))
        } else if hash != cfg.config_hash {
            Some(format!(
                "rank {rank} (from {peer}) has a different configuration than rank 0 (hash {hash:016x} vs {:016x}): every \
                 rank must get the same model, training and data options and the same checkpoint",
                cfg.config_hash
            ))
        } else {
            None
        };
        if let Some(p) = problem {
            return Err(fail(&mut arrived, Some(&mut s), p));
        }
        arrived[rank] = Some((s, peer));
        count += 1;
    }
    let payload = match payload {
        Ok(p) => p,
        Err(m) => return Err(fail(&mut arrived, None, format!("rank 0 could not start: {m}"))),
    };
    if payload.len() > MAX_MSG as usize {
        return Err(fail(&mut arrived, None, format!("payload of {} bytes is too large", payload.len())));
    }
    let mut links = Vec::new();
    for (r, a) in arrived.into_iter().enumerate() {
        if let Some((mut s, peer)) = a {
            write_msg(&mut s, 0, &payload)
                .map_err(|e| err(format!("rendezvous: sending to rank {r} ({peer}): {e}")))?;
            let _ = s.set_read_timeout(None);
            let _ = s.set_nodelay(true);
            links.push((r, s));
        }
    }
    Ok(Rendezvous { rank: 0, world: cfg.world, payload, links })
}

/// A rank ≥ 1: connect to rank 0 (retrying until the deadline), introduce itself, get the payload.
pub fn connect(cfg: &RendezvousConfig) -> Result<Rendezvous> {
    assert!(cfg.rank > 0, "connect is the side of ranks >= 1");
    let endpoint = cfg.endpoint();
    let deadline = Instant::now() + cfg.timeout;
    let addrs: Vec<SocketAddr> = (cfg.addr.as_str(), cfg.port)
        .to_socket_addrs()
        .map_err(|e| err(format!("cannot resolve MASTER_ADDR {:?}: {e}", cfg.addr)))?
        .collect();
    let mut last = String::from("no address");
    let mut s = 'outer: loop {
        for a in &addrs {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(50));
            match TcpStream::connect_timeout(a, left.min(Duration::from_secs(2))) {
                Ok(s) => break 'outer s,
                Err(e) => last = e.to_string(),
            }
        }
        if Instant::now() >= deadline {
            return Err(err(format!(
                "rank {}: could not reach rank 0 at {endpoint} within {:.0} s (last error: {last}); is rank 0 running, \
                 and do all ranks have the same MASTER_ADDR and MASTER_PORT?",
                cfg.rank,
                cfg.timeout.as_secs_f64()
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut hello = Vec::with_capacity(HELLO_LEN);
    hello.extend(MAGIC);
    hello.extend((cfg.rank as u32).to_le_bytes());
    hello.extend((cfg.world as u32).to_le_bytes());
    hello.extend(cfg.config_hash.to_le_bytes());
    s.write_all(&hello).map_err(|e| err(format!("rank {}: sending to rank 0 at {endpoint}: {e}", cfg.rank)))?;
    // wait for rank 0's verdict: it may wait its whole timeout for late ranks, then answers
    let _ = s.set_read_timeout(Some(cfg.timeout + cfg.grace()));
    match read_msg(&mut s) {
        Ok((0, payload)) => {
            let _ = s.set_read_timeout(None);
            let _ = s.set_nodelay(true);
            Ok(Rendezvous { rank: cfg.rank, world: cfg.world, payload, links: vec![(0, s)] })
        }
        Ok((_, msg)) => {
            Err(err(format!("rank {}: rank 0 refused the run: {}", cfg.rank, String::from_utf8_lossy(&msg))))
        }
        Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::TimedOut => Err(err(format!(
            "rank {}: connected to rank 0 at {endpoint}, but it sent no answer within {:.0} s",
            cfg.rank,
            (cfg.timeout + cfg.grace()).as_secs_f64()
        ))),
        Err(e) => Err(err(format!(
            "rank {}: rank 0 at {endpoint} closed the connection during the rendezvous ({e}): it failed or was stopped",
            cfg.rank
        ))),
    }
}

/// Liveness settings: how often to send a heartbeat, and how long a silent peer is tolerated.
#[derive(Clone, Copy, Debug)]
pub struct WatchConfig {
    pub heartbeat: Duration,
    pub silence: Duration,
}

impl Default for WatchConfig {
    fn default() -> Self {
        WatchConfig { heartbeat: Duration::from_secs(2), silence: Duration::from_secs(60) }
    }
}

const HEARTBEAT: u8 = b'H';
const BYE: u8 = b'B';
const LOST: u8 = b'L';

/// The running liveness watch of one rank (see the module docs). Dropping it without
/// [`Watch::close`] stops it quietly as well.
pub struct Watch {
    stop: Arc<AtomicBool>,
    writers: Arc<Mutex<Vec<(usize, TcpStream)>>>,
    wake: Option<Sender<()>>,
    threads: Vec<JoinHandle<()>>,
}

impl Rendezvous {
    /// Ranks this one holds a connection to.
    pub fn peers(&self) -> Vec<usize> {
        self.links.iter().map(|(r, _)| *r).collect()
    }

    /// The open connections themselves (rank 0: to every other rank; others: to rank 0), for a
    /// collective that runs over them instead of a watch (`dist::TcpSync`, CPU ranks).
    pub fn into_links(self) -> Vec<(usize, TcpStream)> {
        self.links
    }

    /// Start watching the peers. `on_lost` is called once, from a watch thread, with a message
    /// naming the lost rank (a closed connection, silence, or rank 0's report that another rank
    /// was lost). Typical use: abort the NCCL communicator and exit the process with that message.
    pub fn watch(self, cfg: WatchConfig, on_lost: impl Fn(String) + Send + Sync + 'static) -> Result<Watch> {
        let stop = Arc::new(AtomicBool::new(false));
        let fired = Arc::new(AtomicBool::new(false));
        let me = self.rank;
        let mut writers = Vec::new();
        for (r, s) in &self.links {
            let w = s.try_clone().map_err(|e| err(format!("liveness link to rank {r}: {e}")))?;
            // a peer that stopped reading must not block the heartbeat (or `close`) for ever
            let _ = w.set_write_timeout(Some(cfg.silence.max(Duration::from_secs(1))));
            writers.push((*r, w));
        }
        let writers = Arc::new(Mutex::new(writers));
        let on_lost = Arc::new(on_lost);
        let mut threads = Vec::new();
        for (peer, mut s) in self.links {
            s.set_read_timeout(Some(cfg.silence)).map_err(|e| err(format!("liveness link to rank {peer}: {e}")))?;
            let (stop, fired, writers, on_lost) = (stop.clone(), fired.clone(), writers.clone(), on_lost.clone());
            let h = std::thread::Builder::new()
                .name(format!("meddpm-watch-{peer}"))
                .spawn(move || {
                    let lost = |msg: String| {
                        if stop.load(Ordering::SeqCst) || fired.swap(true, Ordering::SeqCst) {
                            return;
                        }
                        // rank 0 tells the others who was lost before giving up itself
                        if me == 0 {
                            let mut w = writers.lock().unwrap_or_else(|e| e.into_inner());
                            for (r, ws) in w.iter_mut().filter(|(r, _)| *r != peer) {
                                let _ = write_lost(ws, &msg).map_err(|e| eprintln!("telling rank {r}: {e}"));
                            }
                        }
                        on_lost(msg);
                    };
                    let mut b = [0u8; 1];
                    loop {
                        match s.read(&mut b) {
                            Ok(1) if b[0] == HEARTBEAT => continue,
                            Ok(1) if b[0] == BYE => return,
                            Ok(1) if b[0] == LOST => {
                                let msg = read_lost(&mut s).unwrap_or_else(|e| format!("(unreadable report: {e})"));
                                return lost(format!("rank {peer} reports: {msg}"));
                            }
                            Ok(1) => return lost(format!("rank {peer} sent an unknown liveness byte {:#04x}", b[0])),
                            Ok(_) => {
                                return lost(format!(
                                    "rank {peer} closed its connection without finishing: it crashed or was killed"
                                ))
                            }
                            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::TimedOut => {
                                return lost(format!(
                                    "rank {peer} sent nothing for {:.0} s: its host is unreachable or the process is \
                                     frozen",
                                    cfg.silence.as_secs_f64()
                                ))
                            }
                            Err(e) => {
                                return lost(format!("rank {peer}: connection failed ({e}): it crashed or was killed"))
                            }
                        }
                    }
                })
                .map_err(|e| err(format!("starting the liveness watch: {e}")))?;
            threads.push(h);
        }
        let (wake, sleeper) = channel::<()>();
        {
            let (stop, writers) = (stop.clone(), writers.clone());
            let h = std::thread::Builder::new()
                .name("meddpm-heartbeat".into())
                .spawn(move || loop {
                    match sleeper.recv_timeout(cfg.heartbeat) {
                        Err(RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let mut w = writers.lock().unwrap_or_else(|e| e.into_inner());
                    for (_, s) in w.iter_mut() {
                        let _ = s.write_all(&[HEARTBEAT]);
                    }
                })
                .map_err(|e| err(format!("starting the heartbeat: {e}")))?;
            threads.push(h);
        }
        Ok(Watch { stop, writers, wake: Some(wake), threads })
    }
}

fn write_lost(s: &mut TcpStream, msg: &str) -> std::io::Result<()> {
    let mut b = vec![LOST];
    b.extend((msg.len() as u32).to_le_bytes());
    b.extend(msg.as_bytes());
    s.write_all(&b)
}

fn read_lost(s: &mut TcpStream) -> std::io::Result<String> {
    let mut n = [0u8; 4];
    s.read_exact(&mut n)?;
    let n = u32::from_le_bytes(n).min(MAX_MSG);
    let mut b = vec![0u8; n as usize];
    s.read_exact(&mut b)?;
    Ok(String::from_utf8_lossy(&b).into_owned())
}

impl Watch {
    /// A clean end: say goodbye to every peer and stop watching.
    pub fn close(mut self) {
        self.shutdown(true);
    }

    fn shutdown(&mut self, bye: bool) {
        if self.stop.swap(true, Ordering::SeqCst) {
            return;
        }
        self.wake.take();
        let mut w = self.writers.lock().unwrap_or_else(|e| e.into_inner());
        for (_, s) in w.iter_mut() {
            if bye {
                let _ = s.write_all(&[BYE]);
            }
            let _ = s.shutdown(Shutdown::Both);
        }
        drop(w);
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.shutdown(false);
    }
}
