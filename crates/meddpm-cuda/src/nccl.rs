//! NCCL bindings on raw device pointers: communicator from a unique id, all-reduce (sum/avg),
//! broadcast and all-gather of `count` elements of a [`DType`] on a given `CUstream`, group calls,
//! abort. Built on cudarc's `nccl` feature, which loads libnccl at run time like the other CUDA
//! libraries; nothing here knows the backend's buffer type (callers pass `u64` device addresses).
//!
//! Loading: cudarc looks for `libnccl.so` (and `libnccl.so.13`, `.12`, … `.1`) but not for
//! `libnccl.so.2`, the only name pip's `nvidia-nccl-cu*` wheels ship. [`load`] checks first and,
//! when NCCL is missing, says which file it found on `LD_LIBRARY_PATH` and the link to make
//! (scripts/gpu/multigpu.sh makes it), instead of cudarc's panic.
//!
//! Threading: every call on a communicator must come from a thread whose current CUDA context is
//! the communicator's device (the backend's calls bind it). [`Comm::abort`] may be called from any
//! thread while another is blocked in a collective: that is how a lost peer unblocks a rank.

use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use cudarc::driver::sys::CUstream;
use cudarc::nccl::sys;
use meddpm::{Error, Result};

/// Bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;

/// Element types of the collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    Bf16,
    /// For gathering hashes and counters.
    U64,
}

impl DType {
    fn raw(self) -> sys::ncclDataType_t {
        match self {
            DType::F32 => sys::ncclDataType_t::ncclFloat32,
            DType::Bf16 => sys::ncclDataType_t::ncclBfloat16,
            DType::U64 => sys::ncclDataType_t::ncclUint64,
        }
    }
    pub fn bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
            DType::U64 => 8,
        }
    }
}

/// Reductions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the number of ranks (NCCL ≥ 2.10).
    Avg,
}

fn nccl_err(what: &str, r: sys::ncclResult_t) -> Error {
    // SAFETY: ncclGetErrorString returns a static string for any result code.
    let msg = unsafe { CStr::from_ptr(sys::ncclGetErrorString(r)) }.to_string_lossy().into_owned();
    Error::Backend(format!("NCCL {what}: {r:?} ({msg})"))
}

fn ck(what: &str, r: sys::ncclResult_t) -> Result<()> {
    if r == sys::ncclResult_t::ncclSuccess {
        Ok(())
    } else {
        Err(nccl_err(what, r))
    }
}

/// NCCL's version code as "major.minor.patch" (codes ≥ 2.9 are major·10000 + minor·100 + patch).
pub fn version_string(code: i32) -> String {
    if code >= 10000 {
        format!("{}.{}.{}", code / 10000, (code / 100) % 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, (code / 100) % 10, code % 100)
    }
}

/// Files named `libnccl.so*` in the LD_LIBRARY_PATH folders.
fn nccl_files_on_path() -> Vec<String> {
    let mut out = Vec::new();
    for dir in std::env::var("LD_LIBRARY_PATH").unwrap_or_default().split(':').filter(|d| !d.is_empty()) {
        if let Ok(rd) = std::fs::read_dir(dir) {
            let mut names: Vec<String> = rd
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("libnccl.so"))
                .collect();
            names.sort();
            out.extend(names.into_iter().map(|n| format!("{dir}/{n}")));
        }
    }
    out
}

/// Load libnccl (once per process) and return its version code; a clear error when it is missing.
pub fn load() -> Result<i32> {
    static LOADED: OnceLock<std::result::Result<i32, String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let present = std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
            if !present {
                let names = cudarc::get_lib_name_candidates("nccl");
                let found = nccl_files_on_path();
                let hint = match found.first() {
                    Some(f) => format!(
                        "{f} is on LD_LIBRARY_PATH, but cudarc does not look for that name: put a folder holding a link \
                         `libnccl.so -> {f}` first in LD_LIBRARY_PATH (scripts/gpu/multigpu.sh does)"
                    ),
                    None => "no libnccl.so* is on LD_LIBRARY_PATH: install NCCL (e.g. pip's nvidia-nccl-cu13) and put \
                             its lib folder, with a `libnccl.so` link to `libnccl.so.2`, on LD_LIBRARY_PATH"
                        .to_string(),
                };
                return Err(format!("NCCL could not be loaded (tried {}): {hint}", names.join(", ")));
            }
            let r = std::panic::catch_unwind(|| {
                let mut v = 0;
                // SAFETY: the library is loaded; ncclGetVersion writes one int.
                let r = unsafe { sys::ncclGetVersion(&mut v) };
                (r, v)
            });
            match r {
                Ok((sys::ncclResult_t::ncclSuccess, v)) => Ok(v),
                Ok((r, _)) => Err(nccl_err("ncclGetVersion", r).to_string()),
                Err(_) => Err("NCCL: the loaded libnccl has no ncclGetVersion symbol".to_string()),
            }
        })
        .clone()
        .map_err(Error::Backend)
}

/// The id rank 0 creates and every rank passes to [`Comm::init`] (128 opaque bytes; it names a
/// socket on rank 0's host that NCCL's own bootstrap uses).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId(pub [u8; UNIQUE_ID_BYTES]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({:02x?}…)", &self.0[..8])
    }
}

impl UniqueId {
    /// A fresh id (rank 0 only).
    pub fn new() -> Result<UniqueId> {
        load()?;
        let mut id = sys::ncclUniqueId { internal: [0; UNIQUE_ID_BYTES] };
        // SAFETY: NCCL is loaded; the id is a plain 128-byte struct.
        ck("ncclGetUniqueId", unsafe { sys::ncclGetUniqueId(&mut id) })?;
        Ok(UniqueId(id.internal.map(|c| c as u8)))
    }

    /// An id received from rank 0 (checks the length).
    pub fn from_bytes(b: &[u8]) -> Result<UniqueId> {
        let a: [u8; UNIQUE_ID_BYTES] = b.try_into().map_err(|_| {
            Error::Backend(format!("NCCL unique id: {} bytes received, {UNIQUE_ID_BYTES} expected", b.len()))
        })?;
        Ok(UniqueId(a))
    }

    fn raw(&self) -> sys::ncclUniqueId {
        sys::ncclUniqueId { internal: self.0.map(|b| b as _) }
    }
}

/// One rank's NCCL communicator.
pub struct Comm {
    raw: sys::ncclComm_t,
    rank: usize,
    world: usize,
    aborted: AtomicBool,
}

// SAFETY: an NCCL communicator may be used from any thread (one at a time for collectives, which
// `&self` users order themselves); `abort` is documented as callable concurrently.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Comm {
    /// Join the communicator of `world` ranks as `rank`. Every rank must call this (it blocks until
    /// all have), each with its device's CUDA context current on the calling thread.
    pub fn init(id: &UniqueId, rank: usize, world: usize) -> Result<Comm> {
        load()?;
        if rank >= world {
            return Err(Error::Backend(format!("NCCL: rank {rank} of {world}")));
        }
        if std::env::var("NCCL_NVLS_ENABLE").as_deref() != Ok("0") {
            eprintln!(
                "meddpm-cuda: warning: NCCL_NVLS_ENABLE is not 0; NVLink multicast must stay off on shared machines \
                 (meddpm train --gpus sets it for its ranks)"
            );
        }
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: NCCL is loaded; `raw` receives the communicator.
        ck("ncclCommInitRank", unsafe { sys::ncclCommInitRank(&mut raw, world as i32, id.raw(), rank as i32) })?;
        Ok(Comm { raw, rank, world, aborted: AtomicBool::new(false) })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world(&self) -> usize {
        self.world
    }

    fn live(&self, what: &str) -> Result<()> {
        if self.aborted.load(Ordering::SeqCst) {
            Err(Error::Backend(format!("NCCL {what}: the communicator was aborted")))
        } else {
            Ok(())
        }
    }

    /// `recv[i] = op over ranks of send[i]` for `count` elements (in place when `send == recv`).
    ///
    /// # Safety
    /// `send` and `recv` are device addresses of at least `count` elements of `dt` on this
    /// communicator's device, alive until the collective has run on `stream`.
    pub unsafe fn all_reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dt: DType,
        op: ReduceOp,
        stream: CUstream,
    ) -> Result<()> {
        self.live("all-reduce")?;
        let op = match op {
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        };
        ck(
            "ncclAllReduce",
            sys::ncclAllReduce(send as *const c_void, recv as *mut c_void, count, dt.raw(), op, self.raw, stream as _),
        )
    }

    /// `recv = send of rank `root`` on every rank (`send` is read on the root only).
    ///
    /// # Safety
    /// As [`Comm::all_reduce`].
    pub unsafe fn broadcast(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dt: DType,
        root: usize,
        stream: CUstream,
    ) -> Result<()> {
        self.live("broadcast")?;
        ck(
            "ncclBroadcast",
            sys::ncclBroadcast(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dt.raw(),
                root as i32,
                self.raw,
                stream as _,
            ),
        )
    }

    /// `recv[r·count ..][..count] = send of rank r`.
    ///
    /// # Safety
    /// `send` holds `count` elements, `recv` `count · world`; otherwise as [`Comm::all_reduce`].
    pub unsafe fn all_gather(&self, send: u64, recv: u64, count: usize, dt: DType, stream: CUstream) -> Result<()> {
        self.live("all-gather")?;
        ck(
            "ncclAllGather",
            sys::ncclAllGather(send as *const c_void, recv as *mut c_void, count, dt.raw(), self.raw, stream as _),
        )
    }

    /// An asynchronous error of this communicator (a failed network peer, a NCCL-internal error).
    pub fn async_error(&self) -> Result<()> {
        self.live("status")?;
        let mut r = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator; writes one result code.
        ck("ncclCommGetAsyncError", unsafe { sys::ncclCommGetAsyncError(self.raw, &mut r) })?;
        match r {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
            r => Err(nccl_err("asynchronous error", r)),
        }
    }

    /// Abort: unblocks collectives waiting for a peer that is gone, frees the communicator. Safe
    /// to call from another thread, more than once; every later call on it fails.
    pub fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: first and only abort of a live communicator.
            unsafe { sys::ncclCommAbort(self.raw) };
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if !self.aborted.load(Ordering::SeqCst) {
            // SAFETY: a live communicator, destroyed once.
            unsafe { sys::ncclCommDestroy(self.raw) };
        }
    }
}

/// Run `f` between `ncclGroupStart` and `ncclGroupEnd`: its collectives are launched together
/// (NCCL fuses them). The group is ended even when `f` fails.
pub fn group<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    load()?;
    // SAFETY: NCCL is loaded.
    ck("ncclGroupStart", unsafe { sys::ncclGroupStart() })?;
    let r = f();
    // SAFETY: matches the start above.
    let end = ck("ncclGroupEnd", unsafe { sys::ncclGroupEnd() });
    let r = r?;
    end.map(|_| r)
}

/// One line for `meddpm doctor`: NCCL's version and file, or why it cannot be loaded.
pub fn doctor_line() -> String {
    match load() {
        Ok(v) => {
            let files = crate::device::loaded_library_files(&["libnccl"]);
            format!(
                "NCCL: {} ({}), {}",
                version_string(v),
                v,
                files.first().map(String::as_str).unwrap_or("file not found in /proc/self/maps")
            )
        }
        Err(e) => format!("NCCL: not available (needed for --gpus and multi-process training only): {e}"),
    }
}
