//! [`TcpSync`]: the collective of CPU ranks that are separate processes (`meddpm train --device
//! cpu` under RANK/WORLD_SIZE), over the TCP connections the rendezvous opened. On the GPU every
//! collective is NCCL's; this exists so that data parallelism — and the faults a cluster user
//! meets, a rank killed or hung mid-step — run and are tested with real processes on any machine.
//!
//! A star through rank 0: for an all-reduce each rank sends its bucket to rank 0, which sums the
//! ranks' buckets in rank order, scales by 1/W and sends the result back (every rank gets the same
//! bits); gathers and broadcasts go the same way. Messages are framed `kind u8 | len u32 |
//! payload` and kept per kind, so a deferred agreement (`dist::agree`) can be in flight while the
//! next step's gradients are averaged over the same connection.
//!
//! Faults: a peer whose process dies closes its connection, so the next read fails at once and
//! the error names the rank ("closed its connection ... crashed or was killed"); a peer that sends
//! nothing for `timeout` (`--dist-timeout`; a hung or stopped process) is named the same way.
//! Rank 0 tells every other rank what it saw before failing, so they name the lost rank too.

use super::buckets::{BucketCursor, BucketPlan};
use super::sync::{as_range, Gather, GradSync};
use crate::backend::Backend;
use crate::error::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::ops::Range;
use std::time::Duration;

const REDUCE: u8 = 1;
const BCAST: u8 = 2;
const GATHER: u8 = 3;
const AGREE: u8 = 4;
const ABORT: u8 = 5;
/// Largest frame accepted (a bucket is at most a few tens of MiB).
const MAX_FRAME: u32 = 1 << 30;

/// Data-parallel collectives of CPU ranks over TCP (see the module doc).
pub struct TcpSync {
    rank: usize,
    world: usize,
    /// Rank 0: a connection to every other rank, in rank order; others: the one to rank 0.
    links: Vec<(usize, TcpStream)>,
    /// Frames that arrived while another kind was awaited, per (peer, kind), oldest first.
    stash: HashMap<(usize, u8), VecDeque<Vec<u8>>>,
    timeout: Duration,
    plan: BucketPlan,
    cursor: BucketCursor,
    error: Option<Error>,
    /// The first failure: every later collective fails with it at once.
    failed: Option<String>,
    /// Rank 0: its own value of the agreement in flight.
    agree_own: Option<u64>,
    /// Hold the last bucket back in [`GradSync::finish_early`].
    pub overlap_last: bool,
}

fn put_frame(s: &mut TcpStream, kind: u8, body: &[u8]) -> std::io::Result<()> {
    let mut h = [0u8; 5];
    h[0] = kind;
    h[1..].copy_from_slice(&(body.len() as u32).to_le_bytes());
    s.write_all(&h)?;
    s.write_all(body)
}

fn get_frame(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut h = [0u8; 5];
    s.read_exact(&mut h)?;
    let len = u32::from_le_bytes([h[1], h[2], h[3], h[4]]);
    if len > MAX_FRAME {
        return Err(std::io::Error::new(ErrorKind::InvalidData, format!("a frame of {len} bytes")));
    }
    let mut b = vec![0u8; len as usize];
    s.read_exact(&mut b)?;
    Ok((h[0], b))
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn bytes_of_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn u64s(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
}

impl TcpSync {
    /// Rank `rank` of `world` over `links` (from `Rendezvous::into_links`), bucketing gradients by
    /// `plan`. A peer silent for `timeout` inside a collective is declared lost.
    pub fn new(
        rank: usize,
        world: usize,
        mut links: Vec<(usize, TcpStream)>,
        plan: &BucketPlan,
        timeout: Duration,
    ) -> Result<TcpSync> {
        links.sort_by_key(|(r, _)| *r);
        let want: Vec<usize> = if rank == 0 { (1..world).collect() } else { vec![0] };
        if links.iter().map(|(r, _)| *r).collect::<Vec<_>>() != want {
            return Err(Error::Dist(format!(
                "rank {rank} of {world}: connections to ranks {:?}, expected {want:?}",
                links.iter().map(|(r, _)| *r).collect::<Vec<_>>()
            )));
        }
        for (r, s) in &links {
            let set = s
                .set_read_timeout(Some(timeout))
                .and_then(|()| s.set_write_timeout(Some(timeout)))
                .and_then(|()| s.set_nodelay(true));
            set.map_err(|e| Error::Dist(format!("rank {rank}: the connection to rank {r}: {e}")))?;
        }
        Ok(TcpSync {
            rank,
            world,
            links,
            stash: HashMap::new(),
            timeout,
            plan: plan.clone(),
            cursor: BucketCursor::new(plan),
            error: None,
            failed: None,
            agree_own: None,
            overlap_last: true,
        })
    }

    /// The error of a failed read from or write to `peer`, in words that name it; rank 0 passes
    /// it on to the other ranks.
    fn lost(&mut self, peer: usize, e: std::io::Error) -> Error {
        let msg = match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => format!(
                "rank {peer} sent nothing for {:.0} s (--dist-timeout): it hangs (stopped, deadlocked) or its host \
                 is unreachable",
                self.timeout.as_secs_f64()
            ),
            ErrorKind::UnexpectedEof
            | ErrorKind::ConnectionReset
            | ErrorKind::BrokenPipe
            | ErrorKind::ConnectionAborted => {
                format!("rank {peer} closed its connection without finishing: it crashed or was killed")
            }
            _ => format!("rank {peer}: connection failed ({e}): it crashed or was killed"),
        };
        self.fail(msg)
    }

    /// Record the first failure; rank 0 tells the others.
    fn fail(&mut self, msg: String) -> Error {
        if self.failed.is_none() {
            if self.rank == 0 {
                for (_, s) in &mut self.links {
                    let _ = put_frame(s, ABORT, msg.as_bytes());
                }
            }
            self.failed = Some(msg.clone());
        }
        Error::Dist(format!("rank {}: {msg}", self.rank))
    }

    fn check(&self) -> Result<()> {
        match &self.failed {
            Some(m) => Err(Error::Dist(format!("rank {}: {m}", self.rank))),
            None => Ok(()),
        }
    }

    fn link(&mut self, peer: usize) -> &mut TcpStream {
        let i = self.links.iter().position(|(r, _)| *r == peer).expect("a link to every peer");
        &mut self.links[i].1
    }

    fn send(&mut self, peer: usize, kind: u8, body: &[u8]) -> Result<()> {
        self.check()?;
        let r = put_frame(self.link(peer), kind, body);
        r.map_err(|e| self.lost(peer, e))
    }

    /// The next frame of `kind` from `peer` (frames of other kinds are kept for later).
    fn recv(&mut self, peer: usize, kind: u8) -> Result<Vec<u8>> {
        self.check()?;
        if let Some(b) = self.stash.get_mut(&(peer, kind)).and_then(VecDeque::pop_front) {
            return Ok(b);
        }
        loop {
            let got = get_frame(self.link(peer));
            match got {
                Err(e) => return Err(self.lost(peer, e)),
                Ok((ABORT, m)) => {
                    let m = format!("rank {peer} reports: {}", String::from_utf8_lossy(&m));
                    return Err(self.fail(m));
                }
                Ok((k, b)) if k == kind => return Ok(b),
                Ok((k, b)) => self.stash.entry((peer, k)).or_default().push_back(b),
            }
        }
    }

    /// Every rank's `v` through rank 0, as frames of `kind`.
    fn gather_own(&mut self, kind: u8, v: u64) -> Result<Vec<u64>> {
        if self.rank == 0 {
            self.hub_gather(kind, v)
        } else {
            self.send(0, kind, &v.to_le_bytes())?;
            self.gathered(kind)
        }
    }

    /// Rank 0: the others' values of `kind` after its own `v`, sent back to every rank.
    fn hub_gather(&mut self, kind: u8, v: u64) -> Result<Vec<u64>> {
        {
            let mut all = vec![v];
            for peer in 1..self.world {
                let b = self.recv(peer, kind)?;
                match u64s(&b)[..] {
                    [x] => all.push(x),
                    _ => return Err(self.fail(format!("rank {peer} sent {} bytes for a gather, 8 expected", b.len()))),
                }
            }
            let body: Vec<u8> = all.iter().flat_map(|x| x.to_le_bytes()).collect();
            for peer in 1..self.world {
                self.send(peer, kind, &body)?;
            }
            Ok(all)
        }
    }

    /// A rank ≥ 1: the gathered values rank 0 sends.
    fn gathered(&mut self, kind: u8) -> Result<Vec<u64>> {
        let b = self.recv(0, kind)?;
        let all = u64s(&b);
        if all.len() != self.world {
            return Err(self.fail(format!("rank 0 sent {} gathered values, {} expected", all.len(), self.world)));
        }
        Ok(all)
    }

    /// The average over ranks of `host` (summed in rank order, times 1/W), in place.
    fn all_reduce_host(&mut self, host: &mut [f32]) -> Result<()> {
        if self.rank == 0 {
            for peer in 1..self.world {
                let b = self.recv(peer, REDUCE)?;
                if b.len() != 4 * host.len() {
                    let m = format!(
                        "rank {peer} reduces {} elements, rank 0 {}: the ranks' models differ",
                        b.len() / 4,
                        host.len()
                    );
                    return Err(self.fail(m));
                }
                for (a, x) in host.iter_mut().zip(f32s(&b)) {
                    *a += x;
                }
            }
            let inv = 1.0 / self.world as f32;
            host.iter_mut().for_each(|a| *a *= inv);
            let body = bytes_of_f32(host);
            for peer in 1..self.world {
                self.send(peer, REDUCE, &body)?;
            }
        } else {
            self.send(0, REDUCE, &bytes_of_f32(host))?;
            let b = self.recv(0, REDUCE)?;
            if b.len() != 4 * host.len() {
                let m = format!("rank 0 sent {} averaged elements, {} expected", b.len() / 4, host.len());
                return Err(self.fail(m));
            }
            host.copy_from_slice(&f32s(&b));
        }
        Ok(())
    }

    fn reduce_bucket<B: Backend>(&mut self, be: &B, k: usize, grads: &mut [B::Buf]) -> Result<()> {
        let params = self.plan.buckets[k].params.clone();
        let mut host = Vec::new();
        let mut tmp = Vec::new();
        for &p in &params {
            tmp.resize(be.len(&grads[p]), 0f32);
            be.download(&grads[p], &mut tmp);
            host.extend_from_slice(&tmp);
        }
        self.all_reduce_host(&mut host)?;
        let mut off = 0;
        for &p in &params {
            let n = be.len(&grads[p]);
            be.upload(&host[off..off + n], &mut grads[p]);
            off += n;
        }
        Ok(())
    }

    fn reduce_buckets<B: Backend>(&mut self, be: &B, ks: Range<usize>, grads: &mut [B::Buf]) {
        for k in ks {
            if self.error.is_none() {
                if let Err(e) = self.reduce_bucket(be, k, grads) {
                    self.error = Some(e);
                }
            }
        }
    }
}

impl<B: Backend> GradSync<B> for TcpSync {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn layer_done(&mut self, be: &B, layer: usize, grads: &mut [B::Buf]) {
        let ks = self.cursor.layer_done(layer);
        self.reduce_buckets(be, ks, grads);
    }
    fn finish_early(&mut self, be: &B, grads: &mut [B::Buf]) -> Result<Option<Range<usize>>> {
        let n = self.plan.buckets.len();
        let held = match self.plan.buckets.last().and_then(|b| as_range(&b.params)) {
            Some(r) if self.overlap_last && n > 1 => r,
            _ => return GradSync::<B>::finish(self, be, grads).map(|()| None),
        };
        let ks = self.cursor.rest_but(n - 1);
        self.reduce_buckets(be, ks, grads);
        match self.error.take() {
            Some(e) => {
                self.cursor.rest();
                Err(e)
            }
            None => Ok(Some(held)),
        }
    }
    fn finish(&mut self, be: &B, grads: &mut [B::Buf]) -> Result<()> {
        let ks = self.cursor.rest();
        self.reduce_buckets(be, ks, grads);
        self.error.take().map_or(Ok(()), Err)
    }
    fn broadcast(&mut self, be: &B, bufs: &mut [B::Buf]) -> Result<()> {
        for b in bufs.iter_mut() {
            let mut host = vec![0f32; be.len(b)];
            if self.rank == 0 {
                be.download(b, &mut host);
                let body = bytes_of_f32(&host);
                for peer in 1..self.world {
                    self.send(peer, BCAST, &body)?;
                }
            } else {
                let got = self.recv(0, BCAST)?;
                if got.len() != 4 * host.len() {
                    let m = format!(
                        "broadcast: rank 0 sent {} elements, rank {} expects {}",
                        got.len() / 4,
                        self.rank,
                        host.len()
                    );
                    return Err(self.fail(m));
                }
                be.upload(&f32s(&got), b);
            }
        }
        Ok(())
    }
    fn all_gather_u64(&mut self, _: &B, v: u64) -> Result<Vec<u64>> {
        self.gather_own(GATHER, v)
    }
    fn start_gather_u64(&mut self, _: &B, v: u64) -> Result<Gather> {
        if self.agree_own.is_some() {
            return Err(Error::Dist(format!(
                "rank {}: a second deferred gather started before the first was read",
                self.rank
            )));
        }
        if self.rank == 0 {
            self.check()?;
        } else {
            self.send(0, AGREE, &v.to_le_bytes())?;
        }
        self.agree_own = Some(v);
        Ok(Gather { ready: None })
    }
    fn wait_gather_u64(&mut self, _: &B, t: Gather) -> Result<Vec<u64>> {
        if let Some(all) = t.ready {
            return Ok(all);
        }
        let Some(v) = self.agree_own.take() else {
            return Err(Error::Dist(format!("rank {}: a deferred gather was read but never started", self.rank)));
        };
        if self.rank == 0 {
            self.hub_gather(AGREE, v)
        } else {
            self.gathered(AGREE)
        }
    }
}
