//! Data-parallel gradient averaging on GPUs: [`NcclSync`] implements `meddpm::dist::GradSync`
//! for [`CudaBackend`] on top of `nccl.rs`, plus the helpers a rank process needs (device count,
//! abort-and-exit when a peer is lost).
//!
//! Overlap with backward: the Trainer reports each layer whose backward has been queued
//! (`UNet::backward_with`). When that completes a bucket of the plan (`dist::buckets`), an event is
//! recorded on the compute stream and a second stream (the comm stream) waits for it, packs the
//! bucket's gradients into one flat buffer, all-reduces it with `ncclAvg` and unpacks it — while
//! the compute stream goes on with the layers before it (the 128³ levels come last in backward).
//! [`NcclSync::finish`] queues what is left, makes the compute stream wait for the comm stream,
//! and waits on the host with a timeout, so a peer that hangs becomes an error instead of a
//! stuck process.
//!
//! Gradients are reduced in fp32 in every precision: the master weights and their gradients are
//! fp32 buffers, the all-reduce then adds exactly what the single-GPU run would add (the 2 × 1 ==
//! 1 × 2 check holds to fp32 round-off), and at 160 MB per step over NVLink the bytes are not what
//! limits the step. `nccl::DType::Bf16` exists for a future reduction of bf16 gradients.
//!
//! Status: compiled here, not yet run on a GPU (see tests/multigpu.rs and scripts/gpu/multigpu.sh).
//! The one place that takes a device address of the backend's buffers is [`dev_ptr`], which
//! asserts that they store f32.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use meddpm::dist::buckets::{BucketCursor, BucketPlan};
use meddpm::dist::GradSync;
use meddpm::{Error, Result};

use crate::buf::{require_f32, GpuBuf};
use crate::nccl::{self, Comm, DType, ReduceOp, UniqueId};
use crate::CudaBackend;

/// Exit status of a rank that stops because another rank was lost.
pub const EXIT_PEER_LOST: i32 = 3;

/// How long a rank whose collective failed waits before exiting with that error: a failure
/// caused by a dead peer is normally followed within milliseconds by the liveness watch's verdict,
/// which names the lost rank (and exits with [`EXIT_PEER_LOST`]).
pub const WATCH_GRACE: Duration = Duration::from_secs(2);

/// Number of CUDA devices visible to this process (0 without a driver).
pub fn device_count() -> usize {
    std::panic::catch_unwind(|| {
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return 0;
        }
        cudarc::driver::CudaContext::device_count().map(|n| n.max(0) as usize).unwrap_or(0)
    })
    .unwrap_or(0)
}

/// The device address of a backend buffer (the only code here that knows `Buf`'s type). Every
/// buffer a collective touches — parameters, their gradients, EMA and Adam moments — is f32 in
/// every precision (`alloc`, not `alloc_act`); anything else is a bug, and the f32 element count
/// and `DType::F32` of the NCCL calls below rely on it.
fn dev_ptr(be: &CudaBackend, b: &mut GpuBuf) -> u64 {
    require_f32("NCCL collective", &[b]);
    be.dev.ptr_mut(b)
}

fn elems(b: &GpuBuf) -> usize {
    b.len()
}

fn drv(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Backend(format!("{what}: {e}"))
}

/// Where the abort hook finds the communicator once it exists (the liveness watch starts before
/// the communicator: a rank can be lost during NCCL's own initialisation too).
pub type CommSlot = Arc<Mutex<Option<Arc<Comm>>>>;

/// The `on_lost` action of a rank process (`Rendezvous::watch`): print the reason, abort the
/// communicator if there is one (which frees collectives stuck waiting for the lost peer), and
/// exit with [`EXIT_PEER_LOST`] — also when the abort itself does not return within 10 s.
pub fn exit_on_lost(slot: CommSlot, rank: usize) -> impl Fn(String) + Send + Sync + 'static {
    move |msg| {
        eprintln!("error: rank {rank}: stopping because a peer was lost: {msg}");
        let comm = slot.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(c) = comm {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                c.abort();
                let _ = tx.send(());
            });
            if rx.recv_timeout(Duration::from_secs(10)).is_err() {
                eprintln!("error: rank {rank}: ncclCommAbort did not return within 10 s; exiting anyway");
            }
        }
        std::process::exit(EXIT_PEER_LOST);
    }
}

/// [`meddpm::dist::GradSync`] over NCCL (see the module docs).
pub struct NcclSync {
    comm: Arc<Comm>,
    plan: BucketPlan,
    cursor: BucketCursor,
    /// The comm stream.
    side: Arc<CudaStream>,
    /// One flat buffer of the largest bucket (buckets run one after another on `side`).
    flat: CudaSlice<f32>,
    /// Per bucket: "its gradients are queued" on the compute stream.
    ready: Vec<CudaEvent>,
    /// "Every bucket of this step is averaged" on the comm stream.
    done: CudaEvent,
    gather_send: CudaSlice<u64>,
    gather_recv: CudaSlice<u64>,
    timeout: Duration,
    error: Option<Error>,
}

impl NcclSync {
    /// Join the communicator (`id` from rank 0 through the rendezvous) on `be`'s device and plan
    /// the buckets. Every rank calls this at the same time. `timeout` bounds each wait for a
    /// collective (then the communicator is aborted and the step fails).
    pub fn new(
        be: &CudaBackend,
        id: &UniqueId,
        rank: usize,
        world: usize,
        plan: BucketPlan,
        timeout: Duration,
        slot: Option<&CommSlot>,
    ) -> Result<NcclSync> {
        be.dev.bind();
        let comm = Arc::new(Comm::init(id, rank, world)?);
        if let Some(s) = slot {
            *s.lock().unwrap_or_else(|e| e.into_inner()) = Some(comm.clone());
        }
        let ctx = &be.dev.ctx;
        let side = ctx.new_stream().map_err(drv("creating the NCCL stream"))?;
        let flat = be.dev.alloc_f32(plan.max_numel().max(1))?;
        let ready = (0..plan.len()).map(|_| ctx.new_event(None)).collect::<std::result::Result<Vec<_>, _>>();
        let ready = ready.map_err(drv("creating events"))?;
        let done = ctx.new_event(None).map_err(drv("creating events"))?;
        let gather_send = be.dev.stream.alloc_zeros::<u64>(1).map_err(drv("allocating"))?;
        let gather_recv = be.dev.stream.alloc_zeros::<u64>(world).map_err(drv("allocating"))?;
        be.dev.sync();
        Ok(NcclSync {
            comm,
            cursor: BucketCursor::new(&plan),
            plan,
            side,
            flat,
            ready,
            done,
            gather_send,
            gather_recv,
            timeout,
            error: None,
        })
    }

    pub fn comm(&self) -> &Arc<Comm> {
        &self.comm
    }

    /// Queue bucket `k` on the comm stream, after the compute stream's work so far.
    fn start_bucket(&mut self, be: &CudaBackend, k: usize, grads: &mut [GpuBuf]) -> Result<()> {
        let ev = &self.ready[k];
        ev.record(&be.dev.stream).map_err(drv("recording a gradient event"))?;
        self.side.wait(ev).map_err(drv("ordering the NCCL stream"))?;
        let side = self.side.cu_stream();
        let flat = be.dev.ptr_mut(&mut self.flat);
        let params = self.plan.buckets[k].params.clone();
        let mut off = 0u64;
        let mut spans = Vec::with_capacity(params.len());
        for &p in &params {
            let n = elems(&grads[p]);
            let g = dev_ptr(be, &mut grads[p]);
            // SAFETY: both ranges are live device allocations of n floats (flat holds the bucket).
            unsafe { cudarc::driver::result::memcpy_dtod_async(flat + off * 4, g, n * 4, side) }
                .map_err(drv("packing a gradient bucket"))?;
            spans.push((g, off, n));
            off += n as u64;
        }
        // SAFETY: `flat` holds `off` floats on this device; the comm stream orders the copies.
        unsafe { self.comm.all_reduce(flat, flat, off as usize, DType::F32, ReduceOp::Avg, side) }?;
        for (g, o, n) in spans {
            // SAFETY: as above, back into the gradient buffers.
            unsafe { cudarc::driver::result::memcpy_dtod_async(g, flat + o * 4, n * 4, side) }
                .map_err(drv("unpacking a gradient bucket"))?;
        }
        Ok(())
    }

    /// Wait on the host for `ev`, failing after the timeout or on an NCCL error (then the
    /// communicator is aborted: this rank cannot take part in collectives any more).
    fn wait(&self, ev: &CudaEvent, what: &str) -> Result<()> {
        let t0 = Instant::now();
        loop {
            match ev.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(Error::Backend(format!("{what}: CUDA error {e}"))),
            }
            if let Err(e) = self.comm.async_error() {
                self.comm.abort();
                return Err(Error::Dist(format!("{what}: {e}")));
            }
            if t0.elapsed() > self.timeout {
                self.comm.abort();
                return Err(Error::Dist(format!(
                    "{what} did not complete within {:.0} s: another rank is stuck or gone; NCCL communicator aborted",
                    self.timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Queue a broadcast or gather on the compute stream and wait for it with the timeout.
    fn wait_compute(&self, be: &CudaBackend, what: &str) -> Result<()> {
        let ev = be.dev.stream.record_event(None).map_err(drv(what))?;
        self.wait(&ev, what)
    }
}

impl GradSync<CudaBackend> for NcclSync {
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn world(&self) -> usize {
        self.comm.world()
    }

    fn layer_done(&mut self, be: &CudaBackend, layer: usize, grads: &mut [GpuBuf]) {
        for k in self.cursor.layer_done(layer) {
            if self.error.is_none() {
                if let Err(e) = self.start_bucket(be, k, grads) {
                    self.error = Some(e);
                }
            }
        }
    }

    fn finish(&mut self, be: &CudaBackend, grads: &mut [GpuBuf]) -> Result<()> {
        for k in self.cursor.rest() {
            if self.error.is_none() {
                if let Err(e) = self.start_bucket(be, k, grads) {
                    self.error = Some(e);
                }
            }
        }
        if let Some(e) = self.error.take() {
            self.comm.abort();
            return Err(e);
        }
        self.done.record(&self.side).map_err(drv("recording the all-reduce event"))?;
        be.dev.stream.wait(&self.done).map_err(drv("ordering the compute stream"))?;
        self.wait(&self.done, "gradient all-reduce")
    }

    fn broadcast(&mut self, be: &CudaBackend, bufs: &mut [GpuBuf]) -> Result<()> {
        be.dev.bind();
        let stream = be.dev.stream.cu_stream();
        let comm = self.comm.clone();
        nccl::group(|| {
            for b in bufs.iter_mut() {
                let n = elems(b);
                let p = dev_ptr(be, b);
                // SAFETY: a live buffer of n floats on this device, in place.
                unsafe { comm.broadcast(p, p, n, DType::F32, 0, stream) }?;
            }
            Ok(())
        })?;
        self.wait_compute(be, "parameter broadcast")
    }

    fn all_gather_u64(&mut self, be: &CudaBackend, v: u64) -> Result<Vec<u64>> {
        be.dev.bind();
        let stream = &be.dev.stream;
        stream.memcpy_htod(&[v], &mut self.gather_send).map_err(drv("all-gather upload"))?;
        let (s, r) = (dev_ptr_u64(be, &mut self.gather_send), dev_ptr_u64(be, &mut self.gather_recv));
        // SAFETY: send holds 1 u64, recv `world` u64s, on this device.
        unsafe { self.comm.all_gather(s, r, 1, DType::U64, stream.cu_stream()) }?;
        self.wait_compute(be, "hash all-gather")?;
        let mut out = vec![0u64; self.comm.world()];
        stream.memcpy_dtoh(&self.gather_recv, &mut out).map_err(drv("all-gather download"))?;
        stream.synchronize().map_err(drv("all-gather download"))?;
        Ok(out)
    }
}

fn dev_ptr_u64(be: &CudaBackend, b: &mut CudaSlice<u64>) -> u64 {
    use cudarc::driver::DevicePtrMut;
    let (p, _g) = b.device_ptr_mut(&be.dev.stream);
    p
}
