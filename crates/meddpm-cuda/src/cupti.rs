//! In-process GPU kernel timeline through CUPTI's Activity API: a safe wrapper that enables
//! `CONCURRENT_KERNEL` (plus `MEMCPY`, `MEMSET`), hands CUPTI 8 MiB buffers, flushes them, and
//! returns one [`Activity`] per kernel / copy / fill with its mangled name (demangled by
//! [`Activity::to_record`]), GPU start/end (ns), grid, block, registers, static + dynamic shared
//! memory and correlation id.
//!
//! **Range attribution.** Each activity gets the innermost backend range (`push_range`/`pop_range`,
//! the same names as the NVTX ranges) that was open on the host when its launch was issued:
//! 1. primary: every `push_range` during a collection pushes a CUPTI *external correlation id*
//!    (kind `CUSTOM0`, one id per range instance) and `pop_range` pops it; CUPTI then emits an
//!    `EXTERNAL_CORRELATION` record (external id ↔ correlation id) for each API call made inside,
//!    and the kernel's correlation id finds its range — exact, independent of GPU timing;
//! 2. fallback: `push_range`/`pop_range` also record host CUPTI timestamps; the `DRIVER`/`RUNTIME`
//!    API record of a launch (same correlation id) gives its host start time, which falls into the
//!    innermost open range interval.
//!
//! NVTX `MARKER` activity was not used: it needs CUPTI injected as the NVTX tool
//! (`NVTX_INJECTION64_PATH`), which conflicts with running the same binary under ncu.
//!
//! **Unavailable or busy.** Without `libcupti` on the library path, or when another profiler owns
//! the profiling interface (Nsight Compute / Systems inject themselves through
//! `CUDA_INJECTION64_PATH`, and CUPTI allows one subscriber), [`Collector::start`] returns an error
//! string saying so; nothing else changes and callers report "not collected". The callbacks are
//! registered once per process; one collection runs at a time.

use meddpm::analysis::kernels::KernelRecord;
use std::alloc::{alloc, dealloc, Layout};
use std::collections::HashMap;
use std::mem::offset_of;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard, OnceLock};

use cudarc::cupti::result::{self as cr, activity as ca};
use cudarc::cupti::sys;
use sys::CUpti_ActivityKind as K;

/// What an [`Activity`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivityKind {
    Kernel,
    Memcpy,
    Memset,
}

/// One GPU activity record.
#[derive(Clone, Debug, PartialEq)]
pub struct Activity {
    pub kind: ActivityKind,
    /// Kernel: CUPTI's (mangled) name; copies: `memcpy HtoD` etc.; fills: `memset`.
    pub name: String,
    pub start_ns: u64,
    pub end_ns: u64,
    pub grid: Option<[u32; 3]>,
    pub block: Option<[u32; 3]>,
    pub registers: Option<u32>,
    pub static_shared: Option<u32>,
    pub dynamic_shared: Option<u32>,
    /// Bytes copied or filled (copies and fills only).
    pub bytes: Option<u64>,
    pub correlation_id: u32,
    pub stream_id: u32,
    /// The innermost backend range open at launch, as the full path `train/forward/input_blocks.1.0`.
    pub range: Option<String>,
}

impl Activity {
    pub fn duration_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns)
    }

    /// The analysis record: demangled, classified, with grid/block/registers/shared memory and range.
    pub fn to_record(&self) -> KernelRecord {
        let mut k = KernelRecord::new(&self.name, self.duration_ns());
        k.grid = self.grid;
        k.block = self.block;
        k.registers = self.registers;
        k.shared_mem = match (self.static_shared, self.dynamic_shared) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
        };
        k.range = self.range.clone();
        k.start_ns = Some(self.start_ns);
        if let Some(b) = self.bytes {
            k.bytes = Some(b as f64);
        }
        k
    }
}

/// What one collection returned.
#[derive(Clone, Debug, Default)]
pub struct Collection {
    /// Every activity, ordered by GPU start time.
    pub activities: Vec<Activity>,
    /// Records CUPTI reported as dropped (buffers full).
    pub dropped: usize,
    /// Activities attributed through external correlation, through the timestamp fallback, and not at all.
    pub by_correlation: usize,
    pub by_timestamp: usize,
    pub unattributed: usize,
    /// Optional activity kinds that could not be enabled (e.g. `EXTERNAL_CORRELATION: …`).
    pub warnings: Vec<String>,
}

// ---- shared state (the buffer-complete callback may run on a CUPTI worker thread) -------------

#[derive(Default)]
struct Shared {
    /// Open ranges: (name, external id pushed, interval index).
    stack: Vec<(String, bool, Option<usize>)>,
    /// Range paths of this collection; external id = index + 1.
    paths: Vec<String>,
    /// Host intervals (start, end, path index) of this collection; end = u64::MAX while open.
    intervals: Vec<(u64, u64, usize)>,
    raw: Vec<Activity>,
    ext: HashMap<u32, u64>,
    api_start: HashMap<u32, u64>,
    dropped: usize,
}

static SHARED: LazyLock<Mutex<Shared>> = LazyLock::new(|| Mutex::new(Shared::default()));
/// Set once CUPTI was initialised: from then on ranges are tracked.
static TRACKING: AtomicBool = AtomicBool::new(false);
/// A collection is running.
static COLLECTING: AtomicBool = AtomicBool::new(false);

fn shared() -> MutexGuard<'static, Shared> {
    SHARED.lock().unwrap_or_else(|e| e.into_inner())
}

const BUF_SIZE: usize = 8 << 20;
const BUF_ALIGN: usize = 8;
const EXT_KIND: sys::CUpti_ExternalCorrelationKind =
    sys::CUpti_ExternalCorrelationKind::CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0;

fn err(e: cr::CuptiError) -> String {
    format!("{:?}", e.0)
}

fn timestamp() -> u64 {
    let mut t = 0u64;
    // SAFETY: writes one u64.
    let _ = unsafe { cr::get_timestamp(&mut t) };
    t
}

unsafe extern "C" fn buffer_requested(buffer: *mut *mut u8, size: *mut usize, max_num_records: *mut usize) {
    let layout = Layout::from_size_align(BUF_SIZE, BUF_ALIGN).expect("constant layout");
    // SAFETY: CUPTI passes valid out-pointers; the buffer is freed in buffer_completed.
    unsafe {
        let p = alloc(layout);
        *buffer = p;
        *size = if p.is_null() { 0 } else { BUF_SIZE };
        *max_num_records = 0;
    }
}

/// Read a `T` at byte offset `off` of a record (records are packed: unaligned reads).
///
/// # Safety
/// `rec + off .. + size_of::<T>()` must lie inside the record.
unsafe fn rd<T: Copy>(rec: *const u8, off: usize) -> T {
    unsafe { std::ptr::read_unaligned(rec.add(off) as *const T) }
}

fn dims(x: i32, y: i32, z: i32) -> Option<[u32; 3]> {
    (x > 0 && y > 0 && z > 0).then_some([x as u32, y as u32, z as u32])
}

fn memcpy_name(kind: u8) -> &'static str {
    match kind {
        1 => "memcpy HtoD",
        2 => "memcpy DtoH",
        8 => "memcpy DtoD",
        9 => "memcpy HtoH",
        10 => "memcpy PtoP",
        3..=7 => "memcpy array",
        _ => "memcpy",
    }
}

/// Decode one record into the shared state. Fields are read by offset from the bindgen structs
/// of CUDA 13 (`CUpti_ActivityKernel10`, `Memcpy6`, `Memset4`, `API`, `ExternalCorrelation`);
/// only fields of the stable leading part of each struct are read, and enum-typed fields are never
/// materialised as Rust enums.
///
/// # Safety
/// `rec` points to a complete CUPTI activity record.
unsafe fn decode(rec: *const u8, s: &mut Shared) {
    let kind: u32 = unsafe { rd(rec, 0) };
    if kind == K::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL as u32 || kind == K::CUPTI_ACTIVITY_KIND_KERNEL as u32 {
        type R = sys::CUpti_ActivityKernel10;
        unsafe {
            let name_ptr: *const std::ffi::c_char = rd(rec, offset_of!(R, name));
            let name = if name_ptr.is_null() {
                "?".to_string()
            } else {
                std::ffi::CStr::from_ptr(name_ptr).to_string_lossy().into_owned()
            };
            let g = |o| rd::<i32>(rec, o);
            s.raw.push(Activity {
                kind: ActivityKind::Kernel,
                name,
                start_ns: rd(rec, offset_of!(R, start)),
                end_ns: rd(rec, offset_of!(R, end)),
                grid: dims(g(offset_of!(R, gridX)), g(offset_of!(R, gridY)), g(offset_of!(R, gridZ))),
                block: dims(g(offset_of!(R, blockX)), g(offset_of!(R, blockY)), g(offset_of!(R, blockZ))),
                registers: Some(rd::<u16>(rec, offset_of!(R, registersPerThread)) as u32),
                static_shared: Some(g(offset_of!(R, staticSharedMemory)).max(0) as u32),
                dynamic_shared: Some(g(offset_of!(R, dynamicSharedMemory)).max(0) as u32),
                bytes: None,
                correlation_id: rd(rec, offset_of!(R, correlationId)),
                stream_id: rd(rec, offset_of!(R, streamId)),
                range: None,
            });
        }
    } else if kind == K::CUPTI_ACTIVITY_KIND_MEMCPY as u32 {
        type R = sys::CUpti_ActivityMemcpy6;
        unsafe {
            s.raw.push(Activity {
                kind: ActivityKind::Memcpy,
                name: memcpy_name(rd(rec, offset_of!(R, copyKind))).to_string(),
                start_ns: rd(rec, offset_of!(R, start)),
                end_ns: rd(rec, offset_of!(R, end)),
                grid: None,
                block: None,
                registers: None,
                static_shared: None,
                dynamic_shared: None,
                bytes: Some(rd(rec, offset_of!(R, bytes))),
                correlation_id: rd(rec, offset_of!(R, correlationId)),
                stream_id: rd(rec, offset_of!(R, streamId)),
                range: None,
            });
        }
    } else if kind == K::CUPTI_ACTIVITY_KIND_MEMSET as u32 {
        type R = sys::CUpti_ActivityMemset4;
        unsafe {
            s.raw.push(Activity {
                kind: ActivityKind::Memset,
                name: "memset".to_string(),
                start_ns: rd(rec, offset_of!(R, start)),
                end_ns: rd(rec, offset_of!(R, end)),
                grid: None,
                block: None,
                registers: None,
                static_shared: None,
                dynamic_shared: None,
                bytes: Some(rd(rec, offset_of!(R, bytes))),
                correlation_id: rd(rec, offset_of!(R, correlationId)),
                stream_id: rd(rec, offset_of!(R, streamId)),
                range: None,
            });
        }
    } else if kind == K::CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION as u32 {
        type R = sys::CUpti_ActivityExternalCorrelation;
        unsafe {
            let ek: u32 = rd(rec, offset_of!(R, externalKind));
            if ek == EXT_KIND as u32 {
                s.ext.insert(rd(rec, offset_of!(R, correlationId)), rd(rec, offset_of!(R, externalId)));
            }
        }
    } else if kind == K::CUPTI_ACTIVITY_KIND_DRIVER as u32 || kind == K::CUPTI_ACTIVITY_KIND_RUNTIME as u32 {
        type R = sys::CUpti_ActivityAPI;
        unsafe {
            s.api_start.insert(rd(rec, offset_of!(R, correlationId)), rd(rec, offset_of!(R, start)));
        }
    }
}

unsafe extern "C" fn buffer_completed(
    ctx: cudarc::driver::sys::CUcontext,
    stream_id: u32,
    buffer: *mut u8,
    _size: usize,
    valid_size: usize,
) {
    if buffer.is_null() {
        return;
    }
    {
        let mut s = shared();
        let mut rec: *mut sys::CUpti_Activity = std::ptr::null_mut();
        // SAFETY: CUPTI hands back a buffer it filled; get_next_record walks its records.
        while unsafe { ca::get_next_record(buffer, valid_size, &mut rec) }.is_ok() {
            unsafe { decode(rec as *const u8, &mut s) };
        }
        let mut dropped = 0usize;
        // SAFETY: out-pointer to a usize.
        if unsafe { ca::get_num_dropped_records(ctx, stream_id, &mut dropped) }.is_ok() {
            s.dropped += dropped;
        }
    }
    let layout = Layout::from_size_align(BUF_SIZE, BUF_ALIGN).expect("constant layout");
    // SAFETY: allocated in buffer_requested with this layout.
    unsafe { dealloc(buffer, layout) };
}

/// A profiler injected into this process (ncu, nsys set these), if any.
fn injected_profiler() -> Option<String> {
    ["CUDA_INJECTION64_PATH", "NVTX_INJECTION64_PATH"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()).map(|s| format!("{v}={s}")))
}

/// Load CUPTI, claim it (subscribe) and register the buffer callbacks, once per process.
fn init() -> Result<(), String> {
    static INIT: OnceLock<Result<(), String>> = OnceLock::new();
    INIT.get_or_init(|| {
        if let Some(p) = injected_profiler() {
            return Err(format!(
                "CUPTI is busy: another profiler is attached to this process ({p}); run without ncu/nsys for the timeline"
            ));
        }
        // SAFETY: only tries to dlopen the candidate library names.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcupti was not found on the library path (CUDA toolkit extras/CUPTI/lib64 or \
                        /usr/local/cuda/lib64, or pip nvidia-cuda-cupti's nvidia/cu13/lib): add its folder to \
                        LD_LIBRARY_PATH"
                .into());
        }
        let mut sub: sys::CUpti_SubscriberHandle = std::ptr::null_mut();
        // SAFETY: out-pointer; no callback function (we only claim CUPTI, as NVIDIA's samples do).
        if let Err(e) = unsafe { cr::subscribe(&mut sub, None, std::ptr::null_mut()) } {
            return Err(if e.0 == sys::CUptiResult::CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED {
                "CUPTI is busy: another CUPTI client or profiler (Nsight Compute/Systems) holds it".to_string()
            } else {
                format!("CUPTI could not be initialised (cuptiSubscribe: {})", err(e))
            });
        }
        ca::register_callbacks(Some(buffer_requested), Some(buffer_completed))
            .map_err(|e| format!("cuptiActivityRegisterCallbacks: {}", err(e)))?;
        TRACKING.store(true, Ordering::SeqCst);
        Ok(())
    })
    .clone()
}

/// `Ok` when CUPTI can be used in this process, else why not (initialises it on first call).
pub fn available() -> Result<(), String> {
    init()
}

/// `Ok` when the backend emits NVTX ranges to a tool that asks for them, else why not.
pub fn nvtx_status() -> Result<(), String> {
    crate::nvtx::status()
}

/// Whether a tool (ncu, nsys) receives this process's NVTX ranges.
pub fn nvtx_tool_attached() -> bool {
    crate::nvtx::tool_attached()
}

/// Called by `CudaBackend::push_range`.
pub(crate) fn range_push(name: &str) {
    if !TRACKING.load(Ordering::Relaxed) {
        return;
    }
    let collecting = COLLECTING.load(Ordering::SeqCst);
    let id = if collecting {
        let mut s = shared();
        let mut path: Vec<&str> = s.stack.iter().map(|e| e.0.as_str()).collect();
        path.push(name);
        let p = path.join("/");
        s.paths.push(p);
        Some(s.paths.len())
    } else {
        None
    };
    // CUPTI calls outside our lock (its worker thread may be waiting for it in buffer_completed)
    let pushed = id.is_some_and(|id| ca::push_external_correlation_id(EXT_KIND, id as u64).is_ok());
    let ts = if id.is_some() { timestamp() } else { 0 };
    let mut s = shared();
    let iv = id.map(|id| {
        s.intervals.push((ts, u64::MAX, id - 1));
        s.intervals.len() - 1
    });
    s.stack.push((name.to_string(), pushed, iv));
}

/// Called by `CudaBackend::pop_range`.
pub(crate) fn range_pop() {
    if !TRACKING.load(Ordering::Relaxed) {
        return;
    }
    let e = shared().stack.pop();
    if let Some((_, pushed, iv)) = e {
        if pushed {
            let mut last = 0u64;
            // SAFETY: out-pointer to a u64.
            let _ = unsafe { ca::pop_external_correlation_id(EXT_KIND, &mut last) };
        }
        if let Some(i) = iv {
            let ts = timestamp();
            if let Some(v) = shared().intervals.get_mut(i) {
                v.1 = ts;
            }
        }
    }
}

/// Attribute activities to ranges (see the module docs): by external correlation id, else by the
/// launching API call's host time inside the innermost open interval. Returns (by correlation, by
/// timestamp, unattributed).
fn attribute(
    acts: &mut [Activity],
    ext: &HashMap<u32, u64>,
    api_start: &HashMap<u32, u64>,
    paths: &[String],
    intervals: &[(u64, u64, usize)],
) -> (usize, usize, usize) {
    let (mut a, mut b, mut c) = (0, 0, 0);
    for act in acts.iter_mut() {
        if let Some(p) = ext.get(&act.correlation_id).and_then(|&id| paths.get((id as usize).wrapping_sub(1))) {
            act.range = Some(p.clone());
            a += 1;
            continue;
        }
        let inner = api_start.get(&act.correlation_id).and_then(|&t| {
            intervals.iter().filter(|iv| iv.0 <= t && t <= iv.1).max_by_key(|iv| iv.0).and_then(|iv| paths.get(iv.2))
        });
        match inner {
            Some(p) => {
                act.range = Some(p.clone());
                b += 1;
            }
            None => c += 1,
        }
    }
    (a, b, c)
}

const REQUIRED: [K; 1] = [K::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL];
const OPTIONAL: [K; 5] = [
    K::CUPTI_ACTIVITY_KIND_MEMCPY,
    K::CUPTI_ACTIVITY_KIND_MEMSET,
    K::CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION,
    K::CUPTI_ACTIVITY_KIND_DRIVER,
    K::CUPTI_ACTIVITY_KIND_RUNTIME,
];

/// A running collection. Start it, run the work (with its ranges), synchronise the device, then
/// [`Collector::finish`].
pub struct Collector {
    warnings: Vec<String>,
    enabled: Vec<K>,
}

impl Collector {
    /// Enable the activity kinds. Errors when CUPTI is unavailable or busy, or a collection runs.
    pub fn start() -> Result<Collector, String> {
        init()?;
        if COLLECTING.swap(true, Ordering::SeqCst) {
            return Err("a CUPTI collection is already running in this process".into());
        }
        {
            let mut s = shared();
            s.paths.clear();
            s.intervals.clear();
            s.raw.clear();
            s.ext.clear();
            s.api_start.clear();
            s.dropped = 0;
        }
        let mut c = Collector { warnings: Vec::new(), enabled: Vec::new() };
        for k in REQUIRED {
            if let Err(e) = ca::enable(k) {
                c.disable_all();
                COLLECTING.store(false, Ordering::SeqCst);
                return Err(format!("CUPTI could not enable {k:?}: {}", err(e)));
            }
            c.enabled.push(k);
        }
        for k in OPTIONAL {
            match ca::enable(k) {
                Ok(()) => c.enabled.push(k),
                Err(e) => c.warnings.push(format!("{k:?} not enabled: {}", err(e))),
            }
        }
        Ok(c)
    }

    fn disable_all(&mut self) {
        for k in self.enabled.drain(..) {
            let _ = ca::disable(k);
        }
    }

    /// Flush CUPTI's buffers and return the records since [`Collector::start`]. Synchronise the
    /// device first, or kernels still running are missing.
    pub fn finish(mut self) -> Result<Collection, String> {
        self.disable_all();
        let flag = sys::CUpti_ActivityFlag::CUPTI_ACTIVITY_FLAG_FLUSH_FORCED as u32;
        let flushed = ca::flush_all(flag).map_err(|e| format!("cuptiActivityFlushAll: {}", err(e)));
        COLLECTING.store(false, Ordering::SeqCst);
        let mut s = shared();
        let mut acts = std::mem::take(&mut s.raw);
        let ext = std::mem::take(&mut s.ext);
        let api = std::mem::take(&mut s.api_start);
        let paths = std::mem::take(&mut s.paths);
        let intervals = std::mem::take(&mut s.intervals);
        // interval indices held by ranges still open are void now
        for e in s.stack.iter_mut() {
            e.2 = None;
        }
        let dropped = std::mem::take(&mut s.dropped);
        drop(s);
        flushed?;
        acts.sort_by_key(|a| (a.start_ns, a.correlation_id));
        let (by_correlation, by_timestamp, unattributed) = attribute(&mut acts, &ext, &api, &paths, &intervals);
        Ok(Collection {
            activities: acts,
            dropped,
            by_correlation,
            by_timestamp,
            unattributed,
            warnings: std::mem::take(&mut self.warnings),
        })
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        if !self.enabled.is_empty() {
            self.disable_all();
            COLLECTING.store(false, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meddpm::analysis::kernels::Category;

    fn act(corr: u32, name: &str) -> Activity {
        Activity {
            kind: ActivityKind::Kernel,
            name: name.into(),
            start_ns: 100,
            end_ns: 350,
            grid: Some([4, 2, 1]),
            block: Some([128, 1, 1]),
            registers: Some(40),
            static_shared: Some(1024),
            dynamic_shared: Some(2048),
            bytes: None,
            correlation_id: corr,
            stream_id: 7,
            range: None,
        }
    }

    #[test]
    fn attribution_prefers_correlation_then_innermost_interval() {
        let paths: Vec<String> = ["train", "train/forward", "train/forward/input_blocks.1.0"].map(String::from).into();
        // host intervals: train [0,1000], forward [10,500], block [20,100]
        let intervals = vec![(0, 1000, 0), (10, 500, 1), (20, 100, 2)];
        let mut acts = vec![act(1, "a"), act(2, "b"), act(3, "c"), act(4, "d"), act(5, "e")];
        let ext: HashMap<u32, u64> = [(1, 3), (2, 1)].into_iter().collect();
        // corr 3 launched at t=50 (inside the block), 4 at t=700 (train only), 5 never seen
        let api: HashMap<u32, u64> = [(3, 50), (4, 700), (1, 999)].into_iter().collect();
        let n = attribute(&mut acts, &ext, &api, &paths, &intervals);
        assert_eq!(n, (2, 2, 1));
        let r: Vec<Option<&str>> = acts.iter().map(|a| a.range.as_deref()).collect();
        assert_eq!(
            r,
            vec![
                Some("train/forward/input_blocks.1.0"),
                Some("train"),
                Some("train/forward/input_blocks.1.0"),
                Some("train"),
                None
            ]
        );
    }

    #[test]
    fn record_conversion_demangles_and_sums_shared_memory() {
        let mut a = act(1, "_Z15groupnorm_statsPKfPfi");
        a.range = Some("sample/forward/out".into());
        let k = a.to_record();
        assert_eq!(k.name, "groupnorm_stats(float const*, float*, int)");
        assert_eq!(k.category, Category::Normalization);
        assert_eq!((k.duration_ns, k.start_ns), (250, Some(100)));
        assert_eq!(k.shared_mem, Some(3072));
        assert_eq!((k.grid, k.block, k.registers), (Some([4, 2, 1]), Some([128, 1, 1]), Some(40)));
        assert_eq!(k.block_name(), Some("out"));
        let mut m = act(2, "memcpy HtoD");
        m.kind = ActivityKind::Memcpy;
        m.bytes = Some(4096);
        assert_eq!(m.to_record().category, Category::Memory);
    }

    #[test]
    fn record_offsets_match_the_cuda13_layouts() {
        // the leading fields read from the records (CUPTI headers, CUDA 13)
        type R = sys::CUpti_ActivityKernel10;
        assert_eq!(offset_of!(R, registersPerThread), 6);
        assert_eq!(offset_of!(R, start), 16);
        assert_eq!(offset_of!(R, end), 24);
        assert_eq!(offset_of!(R, gridX), 52);
        assert_eq!(offset_of!(R, correlationId), 92);
        assert_eq!(offset_of!(sys::CUpti_ActivityAPI, correlationId), 32);
        assert_eq!(offset_of!(sys::CUpti_ActivityExternalCorrelation, correlationId), 16);
    }

    #[test]
    fn without_cupti_start_fails_with_a_reason() {
        // On a machine with libcupti and a GPU this may succeed; then finishing must work too.
        match Collector::start() {
            Ok(c) => {
                let col = c.finish().expect("flush");
                assert!(col.activities.iter().all(|a| a.end_ns >= a.start_ns));
            }
            Err(e) => {
                eprintln!("CUPTI not available here: {e}");
                assert!(!e.is_empty());
            }
        }
        // ranges are harmless either way
        range_push("x");
        range_pop();
    }
}
