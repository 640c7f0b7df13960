//! meddpm-cuda: the CUDA backend of meddpm — the only crate that names cudarc types or launches
//! kernels. [`CudaBackend`] implements [`meddpm::Backend`] (crates/meddpm/src/backend.rs holds the
//! binding semantics; the CPU backend is the executable spec the parity tests compare against).
//!
//! - 3-D convolutions through cuDNN (legacy N-d API, algorithms chosen by cudnnFind once per shape)
//!   or our own kernels where they are faster (conv/: few-channel and Hopper wgmma kernels, timed
//!   per shape); cuBLAS for linear layers and the attention GEMMs; NVRTC kernels of our own
//!   (kernels/*.cu, the list in `meddpm::analysis::kernels::OUR_KERNELS`) for everything else,
//!   each supporting NCDHW and NDHWC.
//! - Which engine or fused path runs where several can: [`KernelChoices`] (choices.rs), one
//!   table, read from the environment once.
//! - Two switches: [`Precision`] (`Fp32`: FMA math everywhere; `Tf32`: tensor-op math in cuDNN
//!   and cuBLAS; `Bf16`: activations stored in bf16 ([`GpuBuf`] carries the type), bf16 cuDNN
//!   convolutions with fp32 accumulation, everything else fp32 with TF32 GEMMs) and [`Layout`]
//!   (NDHWC keeps data channels-last end to end).
//! - Libraries are loaded at run time, so this crate builds everywhere; on a machine without a GPU
//!   [`CudaBackend::new`] returns `Error::Backend("no CUDA device: ...")`.
//!
//! Modules mirror the CPU twin: conv (a folder: conv/mod.rs lists its files), groupnorm, silu,
//! linear, attention, upsample, elementwise, loss, diffusion, optim; buf (the buffer, its element
//! type, `Mode`) and device (context, stream, handles, kernels, caches) at the bottom; doctor; nccl
//! (NCCL on raw device pointers) and collective (data-parallel gradient averaging over NCCL);
//! power (board power, SM clock and energy through NVML while a benchmark runs).

// Kernel launchers mirror the trait's long argument lists.
#![allow(clippy::too_many_arguments)]

mod attention;
pub mod buf;
pub mod choices;
pub mod collective;
mod conv;
pub mod cupti;
pub mod device;
mod diffusion;
pub mod doctor;
mod elementwise;
mod groupnorm;
mod linear;
mod loss;
pub mod nccl;
mod nvtx;
mod optim;
pub mod power;
pub mod profile_steps;
mod sampler;
mod silu;
mod upsample;

use std::collections::HashMap;
use std::sync::Mutex;

use cudarc::driver::{CudaEvent, PinnedHostSlice};
use meddpm::backend::{AdamStep, DdpmCoefs, Prediction, SamplerCoefs};
use meddpm::rng::Philox;
use meddpm::{Accum, Backend, ConvShape, DType, Dims, Error, Layout, LossKind, Precision, Result};

pub use buf::GpuBuf;
use buf::Mode;
pub use choices::{KernelChoices, PathRuns};
pub use conv::Algo;
pub use device::{compile_kernels, kernel_arch, DeviceInfo};
pub use doctor::{doctor, MIN_CUDNN_TF32};

use device::Device;

/// Probe for a usable CUDA driver and device; `Err` says why not.
pub fn probe() -> Result<String, String> {
    match Device::new(0) {
        Ok(d) => Ok(format!(
            "CUDA device 0: {} (sm_{}{}, {} SMs), cuDNN {}",
            d.info.name,
            d.info.cc.0,
            d.info.cc.1,
            d.info.sms,
            d.info.cudnn_string()
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// The name and compute capability of CUDA device `ordinal`, asked of the driver alone (no
/// context, cuDNN, cuBLAS or kernels: what `--device auto` and the default precision need);
/// `Err` says why not (no driver, no such device).
pub fn gpu_identity(ordinal: usize) -> Result<meddpm::Target, String> {
    use cudarc::driver::{result, sys};
    std::panic::catch_unwind(|| {
        if !unsafe { sys::is_culib_present() } {
            return Err("no CUDA driver (libcuda) found".to_string());
        }
        result::init().map_err(|e| format!("no CUDA device: {e}"))?;
        let n = result::device::get_count().map_err(|e| format!("no CUDA device: {e}"))?.max(0) as usize;
        if ordinal >= n {
            return Err(format!("no CUDA device {ordinal}: the driver reports {n} device(s)"));
        }
        let dev = result::device::get(ordinal as i32).map_err(|e| format!("CUDA device {ordinal}: {e}"))?;
        let attr =
            |a| unsafe { result::device::get_attribute(dev, a) }.map_err(|e| format!("CUDA device {ordinal}: {e}"));
        let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let name = result::device::get_name(dev).map_err(|e| format!("CUDA device {ordinal}: {e}"))?;
        Ok(meddpm::Target::Gpu { name, cc: (major.max(0) as u32, minor.max(0) as u32) })
    })
    .unwrap_or_else(|_| Err("the CUDA driver could not be loaded".to_string()))
}

/// [`gpu_identity`] of a device the backend can run on: the CUDA libraries are found and its
/// compute capability is one our kernels support; `Err` says what is missing (`--device auto`
/// then takes the CPU).
pub fn usable_gpu(ordinal: usize) -> Result<meddpm::Target, String> {
    let missing: Vec<&str> =
        device::library_presence().into_iter().filter(|(n, ok)| !ok && *n != "cupti").map(|(n, _)| n).collect();
    if !missing.is_empty() {
        return Err(format!("CUDA libraries not found: {} (run `meddpm doctor`)", missing.join(", ")));
    }
    let t = gpu_identity(ordinal)?;
    if let meddpm::Target::Gpu { name, cc } = &t {
        device::check_cc((cc.0 as i32, cc.1 as i32), name)?;
    }
    Ok(t)
}

/// The CUDA backend: one device, one stream, one precision and layout.
pub struct CudaBackend {
    dev: Device,
    precision: Precision,
    layout: Layout,
    conv: Mutex<conv::ConvCache>,
    /// Host staging buffer of `upload_act`/`download_act` layout changes (grows once, then reused:
    /// a fresh 8 MiB `Vec` per training step cost ~10 ms of page faults on the whole-head model).
    staging: Mutex<Vec<f32>>,
    /// Page-locked buffers large uploads go through (see [`Pinned`]).
    pinned: Mutex<Pinned>,
    /// Device tables of the multi-tensor optimizer kernels (optim.rs).
    tables: Mutex<optim::Tables>,
    /// CUDA graphs of [`Backend::replay`] bodies, by key (whether `replay` captures them:
    /// `KernelChoices::graphs`).
    graphs: Mutex<HashMap<u64, Graph>>,
}

/// The state of one [`Backend::replay`] key: run once plainly (warm-up), then captured and
/// replayed; `Off` when capturing failed (the body runs plainly from then on).
enum Graph {
    Warm,
    Ready(SendGraph),
    Off,
}

/// A captured, instantiated graph. The graph and its exec are owned handles used only under the
/// backend's mutex, on the backend's stream.
struct SendGraph(cudarc::driver::CudaGraph);
unsafe impl Send for SendGraph {}

/// Page-locked host buffers for uploads of at least [`Pinned::MIN_LEN`] floats: two per length,
/// used in turn, each with an event recorded after its copy so that it is not refilled while its
/// DMA is in flight. From pageable memory the driver stages every copy itself (on the H200 the
/// whole-head training batch, two 8 MiB volumes, left the GPU idle ~6 ms per step); through
/// these the host only writes the bytes and the copy runs at PCIe speed.
struct Pinned {
    slots: Vec<PinnedSlot>,
    turn: usize,
}

struct PinnedSlot {
    len: usize,
    /// The turn of its last use: of the two buffers of a length the older is refilled, and a
    /// staged upload that finds no room evicts the least recently used buffer of another length.
    used: usize,
    /// Host address of `mem` (kept as an integer so the backend stays `Send + Sync`).
    addr: usize,
    _mem: PinnedHostSlice<f32>,
    done: CudaEvent,
}

impl Drop for Pinned {
    /// No buffer is freed while a copy still reads it.
    fn drop(&mut self) {
        for s in &self.slots {
            let _ = s.done.synchronize();
        }
    }
}

impl Pinned {
    const MIN_LEN: usize = 1 << 18;
    /// Beyond this many buffers, other lengths go the pageable way.
    const MAX_SLOTS: usize = 8;
}

impl CudaBackend {
    /// The convolution cache and switches, locked; a lock poisoned by a panic elsewhere is taken
    /// over (the cache holds choices and counters, which a test that panicked leaves usable).
    fn cache(&self) -> std::sync::MutexGuard<'_, conv::ConvCache> {
        self.conv.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `groupnorm_silu_backward_cat_in` over a concatenation `x` split at channel `ca`,
    /// with a skip conv weight of type `w`, takes the fused path (the elementwise pass writing the
    /// parts, two GEMMs onto them) rather than the trait's three steps: the weight of the
    /// activation type and no vector of the pass straddling the parts.
    pub fn cat_in_fused(&self, x: Dims, ca: usize, w: DType) -> bool {
        let act = self.precision.act_dtype();
        w == act && groupnorm::split_ok(x, ca, Mode::new(self.layout, act))
    }

    /// Whether `groupnorm_silu_backward_cat_in` over a concatenation `x` split at channel `ca`
    /// reads it from its parts (never building it): [`CudaBackend::cat_in_fused`]'s conditions in
    /// NDHWC with both parts a multiple of the sums' channels per thread.
    pub fn cat_in_parts(&self, x: Dims, ca: usize, w: DType) -> bool {
        self.cl() && self.cat_in_fused(x, ca, w) && groupnorm::parts_ok(x, ca, self.precision.act_dtype())
    }

    /// Upload through a page-locked buffer ([`Pinned`]); `false` when the copy is small, the
    /// buffers are exhausted or page-locked memory cannot be had (the caller copies directly).
    fn upload_pinned(&self, host: &[f32], dst: &mut GpuBuf) -> bool {
        self.pinned_copy(host.len(), |buf| buf.copy_from_slice(host), dst, false)
    }

    /// Fill a page-locked buffer of `n` floats with `fill` and copy it to `dst`: on the main
    /// stream, or (`side`, a staged upload) on the copy stream with the main stream made to wait
    /// for it. Plain uploads of a new length give up when the buffers are all taken (parameter
    /// uploads come in many lengths, once); staged ones evict an old length (a training batch
    /// comes every step and must never take the slow pageable way).
    fn pinned_copy(&self, n: usize, fill: impl FnOnce(&mut [f32]), dst: &mut GpuBuf, side: bool) -> bool {
        if n < Pinned::MIN_LEN || dst.dtype() != DType::F32 {
            return false;
        }
        let mut g = self.pinned.lock().unwrap_or_else(|e| e.into_inner());
        g.turn += 1;
        let turn = g.turn;
        let have = g.slots.iter().filter(|s| s.len == n).count();
        for _ in have..2 {
            if g.slots.len() >= Pinned::MAX_SLOTS {
                let lru = g.slots.iter().enumerate().filter(|(_, s)| s.len != n).min_by_key(|(_, s)| s.used);
                let Some(i) = lru.map(|(i, _)| i).filter(|_| side) else { return false };
                let old = g.slots.swap_remove(i);
                // no buffer is freed while a copy still reads it
                let _ = old.done.synchronize();
            }
            // SAFETY: the buffer is written (below) before it is read.
            let Ok(mut mem) = (unsafe { self.dev.ctx.alloc_pinned::<f32>(n) }) else { return false };
            let Ok(ptr) = mem.as_mut_ptr() else { return false };
            let Ok(done) = self.dev.ctx.new_event(None) else { return false };
            g.slots.push(PinnedSlot { len: n, used: 0, addr: ptr as usize, _mem: mem, done });
        }
        let slot = g.slots.iter_mut().filter(|s| s.len == n).min_by_key(|s| s.used).expect("two slots of this length");
        slot.used = turn;
        slot.done.synchronize().unwrap_or_else(|e| panic!("upload: waiting for a staging buffer: {e}"));
        // SAFETY: `addr` is a live page-locked allocation of `n` floats (owned by `_mem`) that no
        // copy reads any more (its event completed); the async copy below reads it until `done`.
        let buf = unsafe { std::slice::from_raw_parts_mut(slot.addr as *mut f32, n) };
        fill(buf);
        let dp = self.dev.ptr_mut(dst);
        let stream = if side { &self.dev.copy_stream } else { &self.dev.stream };
        self.dev.bind();
        unsafe { cudarc::driver::result::memcpy_htod_async(dp, &buf[..], stream.cu_stream()) }
            .unwrap_or_else(|e| panic!("upload: {e}"));
        slot.done.record(stream).unwrap_or_else(|e| panic!("upload: {e}"));
        if side {
            // everything queued on the main stream from now on sees `dst` filled
            self.dev.stream.wait(&slot.done).unwrap_or_else(|e| panic!("upload: joining the copy stream: {e}"));
        }
        true
    }

    /// Open device `ordinal` with the given math precision and activation layout.
    pub fn new(ordinal: usize, precision: Precision, layout: Layout) -> Result<Self> {
        let dev = Device::new(ordinal)?;
        if precision == Precision::Fp8 {
            meddpm::fp8::gpu_support(ordinal, dev.info.cc).map_err(Error::Backend)?;
        }
        let v = dev.info.cudnn_version;
        if precision != Precision::Fp32 && v < MIN_CUDNN_TF32 {
            return Err(Error::Backend(format!(
                "cuDNN {} was loaded, which has known wrong-result bugs for TF32 and bf16 3-D convolutions; {} needs \
                 cuDNN >= {}. Put a folder holding `libcudnn.so -> <site-packages>/nvidia/cudnn/lib/libcudnn.so.9` \
                 first in LD_LIBRARY_PATH (see scripts/gpu-check.sh and `meddpm doctor`), or use --precision fp32",
                dev.info.cudnn_string(),
                precision.name(),
                device::version_string(MIN_CUDNN_TF32)
            )));
        }
        let math = match precision {
            Precision::Fp32 => cudarc::cublas::sys::cublasMath_t::CUBLAS_DEFAULT_MATH,
            Precision::Tf32 | Precision::Bf16 | Precision::Fp8 => {
                cudarc::cublas::sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
            }
        };
        device::cublas_ck(unsafe { cudarc::cublas::sys::cublasSetMathMode(dev.blas.0, math) }, "cublasSetMathMode")
            .map_err(Error::Backend)?;
        let conv = Mutex::new(conv::ConvCache::new(&dev, layout, precision, KernelChoices::env()));
        static ANNOUNCED: std::sync::Once = std::sync::Once::new();
        ANNOUNCED.call_once(|| {
            let files = device::loaded_library_files(&["libcudnn.so"]);
            eprintln!(
                "meddpm-cuda: {} (sm_{}{}), cuDNN {} from {}",
                dev.info.name,
                dev.info.cc.0,
                dev.info.cc.1,
                dev.info.cudnn_string(),
                files.first().map(|s| s.as_str()).unwrap_or("?")
            );
        });
        Ok(CudaBackend {
            dev,
            precision,
            layout,
            conv,
            staging: Mutex::new(Vec::new()),
            pinned: Mutex::new(Pinned { slots: Vec::new(), turn: 0 }),
            tables: Mutex::new(optim::Tables::default()),
            graphs: Mutex::new(HashMap::new()),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.dev.info
    }

    /// Capture [`Backend::replay`] bodies into CUDA graphs (true, the default) or always run them
    /// plainly (false: every kernel launched by the host, e.g. so that profilers attribute each to
    /// its NVTX/CUPTI range).
    pub fn set_graphs(&self, on: bool) {
        self.cache().choices.graphs = on;
    }

    /// Whether replay bodies are captured into graphs.
    pub fn graphs(&self) -> bool {
        self.cache().choices.graphs
    }

    /// The kernel choices in force ([`KernelChoices`]: the environment's at start-up, then any
    /// [`CudaBackend::set_choices`]).
    pub fn choices(&self) -> KernelChoices {
        self.cache().choices
    }

    /// How often each of our kernel paths has run so far ([`PathRuns`], first-use timing runs
    /// aside): tests prove a path ran with it.
    pub fn runs(&self) -> PathRuns {
        self.cache().runs
    }

    /// Change the kernel choices, e.g. `be.set_choices(|c| c.wgmma = Some(true))`: for tests (a
    /// fused path against the unfused calls) and benchmarks. Decisions already timed per shape
    /// are kept.
    pub fn set_choices(&self, f: impl FnOnce(&mut KernelChoices)) {
        f(&mut self.cache().choices);
    }

    fn cl(&self) -> bool {
        self.layout == Layout::Ndhwc
    }

    /// The cuDNN algorithms chosen so far for a conv shape: [forward, backward-data, backward-filter].
    pub fn conv_algos(&self, cs: &ConvShape) -> [Option<Algo>; 3] {
        self.cache().chosen(cs)
    }

    /// Whether the latest [forward, data gradient] of `cs` ran our few-channel kernels (None: no
    /// such call yet, or not a shape of theirs).
    pub fn conv_small_used(&self, cs: &ConvShape) -> [Option<bool>; 2] {
        self.cache().small_used(cs)
    }

    /// Whether the forward of `cs` runs with the bias fused into cuDNN (None: not decided yet).
    pub fn conv_fused_bias(&self, cs: &ConvShape) -> Option<bool> {
        self.cache().fused_bias(cs)
    }

    /// Forward convolutions run per shape since the last call (which resets the counts).
    pub fn take_conv_counts(&self) -> Vec<(ConvShape, u64)> {
        let mut c = self.cache();
        c.fwd_calls.drain().collect()
    }

    /// A timing event recorded on the backend's stream now.
    pub fn record_event(&self) -> cudarc::driver::CudaEvent {
        self.dev
            .stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap_or_else(|e| panic!("cuEventRecord: {e}"))
    }

    /// Bytes of device memory (free, total).
    pub fn mem_info(&self) -> (usize, usize) {
        self.dev.ctx.mem_get_info().unwrap_or((0, 0))
    }

    /// The device's PCI bus id ("0000:19:00.0"), as NVML names devices.
    pub fn pci_bus_id(&self) -> Option<String> {
        let mut b = [0 as std::ffi::c_char; 32];
        let r = unsafe {
            cudarc::driver::sys::cuDeviceGetPCIBusId(b.as_mut_ptr(), b.len() as i32, self.dev.ctx.cu_device())
        };
        (r == cudarc::driver::sys::CUresult::CUDA_SUCCESS)
            .then(|| unsafe { std::ffi::CStr::from_ptr(b.as_ptr()) }.to_string_lossy().into_owned())
    }

    /// Sample this GPU's power, SM clock and energy every `period` until [`power::PowerMonitor::stop`]
    /// (None without NVML).
    pub fn power_monitor(&self, period: std::time::Duration) -> Option<power::PowerMonitor> {
        power::PowerMonitor::start(&self.pci_bus_id()?, period)
    }
}

/// NCDHW host data → NDHWC order.
fn to_ndhwc(src: &[f32], x: Dims, dst: &mut [f32]) {
    let (c, s) = (x.c, x.s());
    for n in 0..x.n {
        let from = &src[n * c * s..(n + 1) * c * s];
        // destination in order (one write stream: it may be write-combined page-locked memory),
        // the c source planes read in step
        for (v, px) in dst[n * s * c..(n + 1) * s * c].chunks_exact_mut(c).enumerate() {
            for (ch, o) in px.iter_mut().enumerate() {
                *o = from[ch * s + v];
            }
        }
    }
}

/// NDHWC order → NCDHW host data.
fn from_ndhwc(src: &[f32], x: Dims, dst: &mut [f32]) {
    let (c, s) = (x.c, x.s());
    for n in 0..x.n {
        for ch in 0..c {
            let to = &mut dst[(n * c + ch) * s..(n * c + ch + 1) * s];
            for (v, o) in to.iter_mut().enumerate() {
                *o = src[(n * s + v) * c + ch];
            }
        }
    }
}

/// A 5-D conv weight (Cout, Cin, k, k, k) seen as an activation (N = Cout, C = Cin, D, H, W): the
/// channels-last weight (Cout, kD, kH, kW, Cin) is exactly its NDHWC order.
fn weight_dims(shape: &[usize]) -> Option<Dims> {
    (shape.len() == 5).then(|| Dims::new(shape[0], shape[1], shape[2], shape[3], shape[4]))
}

impl CudaBackend {
    /// The fused GroupNorm+SiLU backward behind `groupnorm_silu_backward`, `_sum` and `_act`:
    /// dinp (per `Accum`), dγ += , dβ += ; with `dsum` (dinp overwritten) dinp's channel sums,
    /// from the backward's own partials where they fit (`groupnorm::can_sum`), else a pass over
    /// dinp; with `act` the recomputed forward output too.
    #[allow(clippy::too_many_arguments)]
    fn gn_silu_backward(
        &self,
        (dx, acc): (&mut GpuBuf, Accum),
        dsum: Option<&mut GpuBuf>,
        act: Option<&mut GpuBuf>,
        (dgamma, dbeta): (&mut GpuBuf, &mut GpuBuf),
        dout: &GpuBuf,
        inp: &GpuBuf,
        off: Option<&GpuBuf>,
        (mean, rstd): (&GpuBuf, &GpuBuf),
        (gamma, beta): (&GpuBuf, &GpuBuf),
        x: Dims,
        groups: usize,
    ) {
        let (dsum, sum_after) = match dsum {
            Some(s) if !groupnorm::can_sum(x, groups, self.layout) => (None, Some(s)),
            other => (other, None),
        };
        if dsum.is_some() || sum_after.is_some() {
            assert!(acc == Accum::Overwrite, "GroupNorm+SiLU backward with channel sums: dinp is overwritten");
        }
        let (dev, b, d) = (&self.dev, Some(beta), (&mut *dx, acc));
        groupnorm::backward(
            dev,
            d,
            dsum,
            act,
            dgamma,
            dbeta,
            dout,
            b,
            inp,
            off,
            mean,
            rstd,
            gamma,
            x,
            groups,
            (self.layout, None, None),
        );
        if let Some(s) = sum_after {
            self.channel_sum(s, dx, x);
        }
    }
}

impl Backend for CudaBackend {
    type Buf = GpuBuf;

    fn describe(&self) -> String {
        let i = &self.dev.info;
        format!(
            "CUDA {} (sm_{}{}, {} SMs), driver {}.{}, cuDNN {}, cuBLAS {}, NVRTC {}.{}; precision {:?}, layout {:?}",
            i.name,
            i.cc.0,
            i.cc.1,
            i.sms,
            i.driver_version / 1000,
            (i.driver_version % 1000) / 10,
            i.cudnn_string(),
            i.cublas_version,
            i.nvrtc_version.0,
            i.nvrtc_version.1,
            self.precision,
            self.layout
        )
    }
    fn layout(&self) -> Layout {
        self.layout
    }
    fn precision(&self) -> Precision {
        self.precision
    }

    fn alloc(&self, len: usize) -> Result<Self::Buf> {
        self.dev.alloc(len, DType::F32)
    }
    fn alloc_act(&self, len: usize) -> Result<Self::Buf> {
        self.dev.alloc(len, self.precision.act_dtype())
    }
    fn cast(&self, dst: &mut Self::Buf, src: &Self::Buf) {
        assert_eq!(dst.len(), src.len(), "cast: lengths {} and {}", dst.len(), src.len());
        let (d, s) = (self.dev.ptr_mut(dst), self.dev.ptr(src));
        self.dev.cast(d, dst.dtype(), s, src.dtype(), src.len(), false);
    }
    fn len(&self, b: &Self::Buf) -> usize {
        b.len()
    }
    fn upload(&self, host: &[f32], dst: &mut Self::Buf) {
        assert_eq!(host.len(), dst.len(), "upload: host {} elements, device buffer {}", host.len(), dst.len());
        if self.upload_pinned(host, dst) {
            return;
        }
        let dp = self.dev.ptr_mut(dst);
        let st = self.dev.stream.cu_stream();
        self.dev.bind();
        // From pageable memory the driver stages the bytes before returning, so the host data may
        // go away after the call.
        let r = match dst.dtype() {
            DType::F32 => unsafe { cudarc::driver::result::memcpy_htod_async(dp, host, st) },
            DType::Bf16 => {
                let bits: Vec<u16> = host.iter().map(|&v| buf::to_bf16_bits(v)).collect();
                let r = unsafe { cudarc::driver::result::memcpy_htod_async(dp, &bits[..], st) };
                self.dev.sync();
                r
            }
        };
        r.unwrap_or_else(|e| panic!("upload: {e}"));
    }
    fn download(&self, src: &Self::Buf, host: &mut [f32]) {
        assert_eq!(host.len(), src.len(), "download: host {} elements, device buffer {}", host.len(), src.len());
        let sp = self.dev.ptr(src);
        let st = self.dev.stream.cu_stream();
        self.dev.bind();
        match src.dtype() {
            DType::F32 => unsafe { cudarc::driver::result::memcpy_dtoh_async(host, sp, st) }
                .unwrap_or_else(|e| panic!("download: {e}")),
            DType::Bf16 => {
                let mut bits = vec![0u16; host.len()];
                unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut bits[..], sp, st) }
                    .unwrap_or_else(|e| panic!("download: {e}"));
                self.dev.sync();
                for (h, b) in host.iter_mut().zip(bits) {
                    *h = buf::from_bf16_bits(b);
                }
            }
        }
        self.dev.sync();
    }
    fn upload_act(&self, host_ncdhw: &[f32], x: Dims, dst: &mut Self::Buf) {
        assert_eq!(host_ncdhw.len(), x.numel(), "upload_act {x}: host length {}", host_ncdhw.len());
        // one channel: NCDHW and NDHWC are the same bytes
        if self.cl() && x.c > 1 {
            let mut t = self.staging.lock().unwrap_or_else(|e| e.into_inner());
            t.resize(x.numel(), 0.0);
            to_ndhwc(host_ncdhw, x, &mut t);
            self.upload(&t, dst);
        } else {
            self.upload(host_ncdhw, dst);
        }
    }
    fn stage_act(&self, host_ncdhw: &[f32], x: Dims, dst: &mut Self::Buf) {
        assert_eq!(host_ncdhw.len(), x.numel(), "stage_act {x}: host length {}", host_ncdhw.len());
        let cl = self.cl() && x.c > 1;
        let fill = |buf: &mut [f32]| match cl {
            true => to_ndhwc(host_ncdhw, x, buf),
            false => buf.copy_from_slice(host_ncdhw),
        };
        // the layout change is written straight into the page-locked buffer
        if !self.pinned_copy(x.numel(), fill, dst, true) {
            self.upload_act(host_ncdhw, x, dst);
        }
    }
    fn download_act(&self, src: &Self::Buf, x: Dims, host_ncdhw: &mut [f32]) {
        assert_eq!(host_ncdhw.len(), x.numel(), "download_act {x}: host length {}", host_ncdhw.len());
        if self.cl() && x.c > 1 {
            let mut t = self.staging.lock().unwrap_or_else(|e| e.into_inner());
            t.resize(x.numel(), 0.0);
            self.download(src, &mut t);
            from_ndhwc(&t, x, host_ncdhw);
        } else {
            self.download(src, host_ncdhw);
        }
    }
    fn upload_param(&self, host: &[f32], torch_shape: &[usize], dst: &mut Self::Buf) {
        let n: usize = torch_shape.iter().product();
        assert_eq!(host.len(), n, "upload_param {torch_shape:?}: host length {}", host.len());
        match (self.cl(), weight_dims(torch_shape)) {
            (true, Some(wd)) => self.upload_act(host, wd, dst),
            _ => self.upload(host, dst),
        }
    }
    fn download_param(&self, src: &Self::Buf, torch_shape: &[usize], host: &mut [f32]) {
        let n: usize = torch_shape.iter().product();
        assert_eq!(host.len(), n, "download_param {torch_shape:?}: host length {}", host.len());
        match (self.cl(), weight_dims(torch_shape)) {
            (true, Some(wd)) => self.download_act(src, wd, host),
            _ => self.download(src, host),
        }
    }
    fn zero(&self, b: &mut Self::Buf) {
        self.dev.stream.memset_zeros(b.mem_mut()).unwrap_or_else(|e| panic!("memset: {e}"));
    }
    fn copy(&self, dst: &mut Self::Buf, src: &Self::Buf) {
        assert_eq!(dst.len(), src.len(), "copy: lengths {} and {}", dst.len(), src.len());
        if dst.dtype() != src.dtype() {
            return self.cast(dst, src);
        }
        let (d, s) = (self.dev.ptr_mut(dst), self.dev.ptr(src));
        self.dev.bind();
        unsafe { cudarc::driver::result::memcpy_dtod_async(d, s, src.bytes(), self.dev.stream.cu_stream()) }
            .unwrap_or_else(|e| panic!("copy: {e}"));
    }
    fn sync(&self) {
        self.dev.sync();
    }
    fn push_range(&self, name: &str) {
        nvtx::push(name);
        cupti::range_push(name);
    }
    fn replay(&self, key: u64, body: &mut dyn FnMut()) {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        if !self.graphs() {
            return body();
        }
        let mut g = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        match g.get(&key) {
            None => {
                // first run: plain (algorithm searches, first-use allocations and timings happen here)
                g.insert(key, Graph::Warm);
                drop(g);
                body();
            }
            Some(Graph::Warm) => {
                drop(g);
                let st = &self.dev.stream;
                st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                    .unwrap_or_else(|e| panic!("cuStreamBeginCapture: {e}"));
                body();
                let graph = st.end_capture(CUgraphInstantiate_flags(0));
                let mut g = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
                match graph {
                    Ok(Some(graph)) => {
                        graph.launch().unwrap_or_else(|e| panic!("cuGraphLaunch: {e}"));
                        g.insert(key, Graph::Ready(SendGraph(graph)));
                    }
                    other => {
                        // the captured work did not run: run it plainly, and never capture this key again
                        eprintln!("meddpm-cuda: graph capture failed ({:?}); running without a graph", other.err());
                        g.insert(key, Graph::Off);
                        drop(g);
                        body();
                    }
                }
            }
            Some(Graph::Ready(graph)) => graph.0.launch().unwrap_or_else(|e| panic!("cuGraphLaunch: {e}")),
            Some(Graph::Off) => {
                drop(g);
                body();
            }
        }
    }
    fn pop_range(&self) {
        cupti::range_pop();
        nvtx::pop();
    }

    fn conv3d_forward_acc(
        &self,
        out: (&mut Self::Buf, Accum),
        inp: &Self::Buf,
        w: &Self::Buf,
        b: Option<&Self::Buf>,
        cs: ConvShape,
    ) {
        let mut cache = self.cache();
        conv::forward(&self.dev, &mut cache, out, inp, w, b, cs);
    }
    fn conv3d_forward_res(
        &self,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        w: &Self::Buf,
        b: &Self::Buf,
        z: &Self::Buf,
        cs: ConvShape,
    ) {
        let mut cache = self.cache();
        conv::forward_res(&self.dev, &mut cache, out, inp, w, b, z, cs);
    }
    fn conv3d_backward(
        &self,
        dinp: Option<(&mut Self::Buf, Accum)>,
        dw: &mut Self::Buf,
        db: Option<&mut Self::Buf>,
        dout: &Self::Buf,
        inp: &Self::Buf,
        w: &Self::Buf,
        cs: ConvShape,
    ) {
        let mut cache = self.cache();
        conv::backward(&self.dev, &mut cache, dinp, dw, db, dout, inp, w, cs);
    }
    fn conv3d_backward_data(&self, dinp: (&mut Self::Buf, Accum), dout: &Self::Buf, w: &Self::Buf, cs: ConvShape) {
        let mut cache = self.cache();
        conv::backward_data(&self.dev, &mut cache, dinp, dout, w, cs);
    }
    /// The GroupNorm backward's channel sums come from the data gradient's epilogue
    /// (`conv3d_wgmma_dgrad_gnb`) where our wgmma kernel runs it (bf16 NDHWC; with `res` where it
    /// rides in the backward's pass, with `dsum` where the backward gives it from its sums);
    /// elsewhere the trait's two calls.
    fn conv3d_backward_data_gn(
        &self,
        da: &mut Self::Buf,
        dout: &Self::Buf,
        w: &Self::Buf,
        cs: ConvShape,
        mut gn: meddpm::backend::GnSiluBack<'_, Self::Buf>,
    ) {
        let (dev, cl, x, groups) = (&self.dev, self.cl(), gn.x, gn.groups);
        assert!(x == cs.x, "conv3d_backward_data_gn: the GroupNorm over {x}, the conv's input {}", cs.x);
        assert!(gn.res.is_none() || gn.dsum.is_none(), "conv3d_backward_data_gn {x}: res and dsum together");
        let bf = [&*da, dout, gn.inp, &*gn.dinp.0].iter().all(|b| b.dtype() == meddpm::DType::Bf16);
        let eligible = {
            let c = self.cache();
            cl && bf
                && c.choices.dgrad_gn
                && gn.res.is_none_or(|r| c.choices.res_fold && r.dtype() == gn.dinp.0.dtype())
                && (gn.dsum.is_none() || groupnorm::can_sum(x, groups, self.layout))
        };
        if !eligible {
            self.conv3d_backward_data((&mut *da, Accum::Overwrite), dout, w, cs);
            return gn.calls(self, da, dout, cs.out());
        }
        // the partials (one chunk a column item of the kernel) and the finaliser's coefficients
        // in the scratch buffer, held until the backward is queued
        // (and dout's channel sums' chunks after them)
        let items = conv::wgmma::items(dev, x);
        let stride = if gn.dsum.is_some() { 3 } else { 2 };
        let npart = items * x.c * stride;
        let nys = if gn.dout_sum.is_some() { items * cs.cout * 2 } else { 0 };
        let scratch = dev.scratch(npart + x.n * groups * 2 + nys);
        let pp = dev.ptr(&*scratch);
        let ysp = if nys > 0 { pp + ((npart + x.n * groups * 2) * 4) as u64 } else { 0 };
        let sums = conv::wgmma::GnSums {
            x: dev.ptr(gn.inp),
            mean: dev.ptr(gn.ms.0),
            rstd: dev.ptr(gn.ms.1),
            gamma: dev.ptr(gn.gb.0),
            beta: dev.ptr(gn.gb.1),
            off: gn.off.map_or(0, |o| {
                assert!(o.len() == x.n * x.c && o.dtype() == meddpm::DType::F32, "conv3d_backward_data_gn {x}: offset");
                dev.ptr(o)
            }),
            groups,
            part: pp,
            x3: gn.dsum.is_some(),
            dys: ysp,
        };
        let (took, ys_took) = {
            let mut c = self.cache();
            let took = conv::backward_data_gn(dev, &mut c, da, dout, w, cs, sums);
            c.runs.res_fold += (took.0 && gn.res.is_some()) as u64;
            took
        };
        // dout's channel sums from the kernel's chunks (else a pass, below or in `calls`)
        if ys_took {
            let out = gn.dout_sum.take().expect("asked for");
            assert!(
                out.len() == x.n * cs.cout && out.dtype() == meddpm::DType::F32,
                "conv3d_backward_data_gn: dout_sum"
            );
            let (n, co, nch) = (x.n as i32, cs.cout as i32, (items / x.n) as i32);
            use device::Arg::{I, P};
            let a = [P(ysp), P(dev.ptr_mut(out)), I(n), I(co), I(nch), I(0), I(0)];
            dev.launch("chan_sum_finalize", ((x.n * cs.cout) as u32, 1, 1), (256, 1, 1), &a);
        }
        if !took {
            // cuDNN's data gradient ran: the backward takes the sums itself, in the scratch buffer
            drop(scratch);
            return gn.calls(self, da, dout, cs.out());
        }
        let pre = groupnorm::Partials { part: pp, coef: pp + (npart * 4) as u64, nchunks: items / x.n };
        let meddpm::backend::GnSiluBack { dinp, dsum, res, act, dgb, inp, off, ms, gb, dout_sum, .. } = gn;
        let ((dgamma, dbeta), (mean, rstd), (gamma, beta)) = (dgb, ms, gb);
        groupnorm::backward(
            dev,
            dinp,
            dsum,
            Some(act),
            dgamma,
            dbeta,
            da,
            Some(beta),
            inp,
            off,
            mean,
            rstd,
            gamma,
            x,
            groups,
            (self.layout, res, Some(pre)),
        );
        drop(scratch);
        if let Some(s) = dout_sum {
            self.channel_sum(s, dout, cs.out());
        }
    }

    fn groupnorm_forward(
        &self,
        out: &mut Self::Buf,
        mean: &mut Self::Buf,
        rstd: &mut Self::Buf,
        inp: &Self::Buf,
        gamma: &Self::Buf,
        beta: &Self::Buf,
        x: Dims,
        groups: usize,
    ) {
        groupnorm::forward(&self.dev, Some(out), None, mean, rstd, inp, None, gamma, beta, x, groups, self.layout);
    }
    fn groupnorm_backward(
        &self,
        dinp: (&mut Self::Buf, Accum),
        dgamma: &mut Self::Buf,
        dbeta: &mut Self::Buf,
        dout: &Self::Buf,
        inp: &Self::Buf,
        mean: &Self::Buf,
        rstd: &Self::Buf,
        gamma: &Self::Buf,
        x: Dims,
        groups: usize,
    ) {
        groupnorm::backward(
            &self.dev,
            dinp,
            None,
            None,
            dgamma,
            dbeta,
            dout,
            None,
            inp,
            None,
            mean,
            rstd,
            gamma,
            x,
            groups,
            (self.layout, None, None),
        );
    }
    fn groupnorm_stats(
        &self,
        mean: &mut Self::Buf,
        rstd: &mut Self::Buf,
        inp: &Self::Buf,
        off: Option<&Self::Buf>,
        x: Dims,
        groups: usize,
    ) {
        groupnorm::stats(&self.dev, inp, off, mean, rstd, x, groups, self.layout);
    }
    fn silu_forward(&self, out: &mut Self::Buf, inp: &Self::Buf) {
        silu::forward(&self.dev, out, inp);
    }
    fn silu_backward(&self, dinp: (&mut Self::Buf, Accum), dout: &Self::Buf, inp: &Self::Buf) {
        silu::backward(&self.dev, dinp, dout, inp);
    }
    fn groupnorm_silu_forward(
        &self,
        out: &mut Self::Buf,
        mean: &mut Self::Buf,
        rstd: &mut Self::Buf,
        inp: &Self::Buf,
        off: Option<&Self::Buf>,
        gamma: &Self::Buf,
        beta: &Self::Buf,
        x: Dims,
        groups: usize,
    ) {
        groupnorm::forward(&self.dev, None, Some(out), mean, rstd, inp, off, gamma, beta, x, groups, self.layout);
    }
    fn groupnorm_silu_conv3d_forward(
        &self,
        out: &mut Self::Buf,
        act: &mut Self::Buf,
        (mean, rstd): (&mut Self::Buf, &mut Self::Buf),
        fresh: bool,
        inp: &Self::Buf,
        (gamma, beta): (&Self::Buf, &Self::Buf),
        (w, b): (&Self::Buf, &Self::Buf),
        cs: ConvShape,
        groups: usize,
    ) {
        let fits = self.cache().gn_head_fits(cs, groups, inp.bf() == 1);
        if !fits {
            if fresh {
                self.groupnorm_silu_forward(act, mean, rstd, inp, None, gamma, beta, cs.x, groups);
            } else {
                self.groupnorm_silu_recompute(act, mean, rstd, inp, None, gamma, beta, cs.x, groups);
            }
            self.conv3d_forward(out, act, w, b, cs);
            return;
        }
        if fresh {
            groupnorm::stats(&self.dev, inp, None, mean, rstd, cs.x, groups, self.layout);
        }
        conv::gn_head_forward(&self.dev, out, inp, (mean, rstd), (gamma, beta), (w, b), cs, groups);
    }
    fn gn_conv_fusable(&self, inp: &Self::Buf, w: &Self::Buf, cs: ConvShape, add: bool, groups: usize) -> bool {
        let mut conv = self.cache();
        conv::gn_wgmma_chosen(&self.dev, &mut conv, cs, add, (inp, w), groups)
    }
    fn fused_conv_out_stats(&self) -> bool {
        self.cache().choices.conv_stats
    }
    fn groupnorm_silu_conv3d_fused(
        &self,
        out: (&mut Self::Buf, Accum),
        (inp, off): (&Self::Buf, Option<&Self::Buf>),
        (mean, rstd): (&mut Self::Buf, &mut Self::Buf),
        fresh: bool,
        gb: (&Self::Buf, &Self::Buf),
        wbz: (&Self::Buf, Option<&Self::Buf>, Option<&Self::Buf>),
        cs: ConvShape,
        groups: usize,
        ystats: Option<meddpm::backend::YStats<'_, Self::Buf>>,
    ) {
        if fresh {
            groupnorm::stats(&self.dev, inp, off, mean, rstd, cs.x, groups, self.layout);
        }
        let mut conv = self.cache();
        let ys = ystats.map(|(m, r, o)| (m, r, o, groups));
        conv::gn_wgmma_forward(&self.dev, &mut conv, out, (inp, off), None, (mean, rstd), gb, wbz, cs, groups, ys);
    }
    fn cat_conv_fusable(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        w_skip: &Self::Buf,
        cs: ConvShape,
        ca: usize,
        groups: usize,
    ) -> bool {
        let mut conv = self.cache();
        conv::cat_free_chosen(&self.dev, &mut conv, cs, (x, w, w_skip), ca, groups)
    }
    fn concat_skip_conv_stats(
        &self,
        out: &mut Self::Buf,
        parts: (&Self::Buf, &Self::Buf),
        stats: (&mut Self::Buf, &mut Self::Buf),
        wb: (&Self::Buf, &Self::Buf),
        cs: ConvShape,
        ca: usize,
        groups: usize,
    ) {
        assert!(cs.k == 1 && cs.stride == 1, "concat_skip_conv_stats {cs:?}: a 1×1×1 conv");
        groupnorm::cat_skip_stats(&self.dev, out, parts, stats, wb, cs.x, ca, cs.cout, groups);
        self.cache().runs.cat_free += 1;
    }
    fn groupnorm_silu_conv3d_fused_cat(
        &self,
        out: &mut Self::Buf,
        (a, b): (&Self::Buf, &Self::Buf),
        stats: (&Self::Buf, &Self::Buf),
        gb: (&Self::Buf, &Self::Buf),
        w: &Self::Buf,
        cs: ConvShape,
        ca: usize,
        groups: usize,
        ystats: Option<meddpm::backend::YStats<'_, Self::Buf>>,
    ) {
        let mut conv = self.cache();
        let wbz = (w, None, None);
        let ys = ystats.map(|(m, r, o)| (m, r, o, groups));
        conv::gn_wgmma_forward(
            &self.dev,
            &mut conv,
            (out, Accum::Overwrite),
            (a, None),
            Some((b, ca)),
            stats,
            gb,
            wbz,
            cs,
            groups,
            ys,
        );
    }
    fn groupnorm_silu_forward_inplace(
        &self,
        x: &mut Self::Buf,
        mean: &mut Self::Buf,
        rstd: &mut Self::Buf,
        gamma: &Self::Buf,
        beta: &Self::Buf,
        xd: Dims,
        groups: usize,
    ) {
        groupnorm::forward_inplace(&self.dev, x, mean, rstd, gamma, beta, xd, groups, self.layout);
    }
    fn concat_channels_stats(
        &self,
        out: &mut Self::Buf,
        a: &Self::Buf,
        a_bias: Option<&Self::Buf>,
        b: &Self::Buf,
        stats: (&mut Self::Buf, &mut Self::Buf),
        x: Dims,
        ca: usize,
        cb: usize,
        groups: usize,
    ) {
        groupnorm::concat_stats(&self.dev, out, a, a_bias, b, stats, x, (ca, cb), groups, self.layout);
    }
    fn groupnorm_silu_recompute_inplace(
        &self,
        x: &mut Self::Buf,
        mean: &Self::Buf,
        rstd: &Self::Buf,
        gamma: &Self::Buf,
        beta: &Self::Buf,
        xd: Dims,
        groups: usize,
    ) {
        groupnorm::recompute_inplace(&self.dev, x, mean, rstd, gamma, beta, xd, groups, self.layout);
    }
    fn groupnorm_silu_backward_inplace(
        &self,
        d: &mut Self::Buf,
        dgamma: &mut Self::Buf,
        dbeta: &mut Self::Buf,
        inp: &Self::Buf,
        mean: &Self::Buf,
        rstd: &Self::Buf,
        gamma: &Self::Buf,
        beta: &Self::Buf,
        x: Dims,
        groups: usize,
    ) {
        groupnorm::backward_inplace(
            &self.dev,
            d,
            (dgamma, dbeta),
            beta,
            inp,
            mean,
            rstd,
            gamma,
            x,
            groups,
            self.layout,
        );
    }
    fn groupnorm_silu_recompute(
        &self,
        out: &mut Self::Buf,
        mean: &Self::Buf,
        rstd: &Self::Buf,
        inp: &Self::Buf,
        off: Option<&Self::Buf>,
        gamma: &Self::Buf,
        beta: &Self::Buf,
        x: Dims,
        groups: usize,
    ) {
        groupnorm::recompute(&self.dev, out, mean, rstd, inp, off, gamma, beta, x, groups, self.layout);
    }
    fn groupnorm_silu_backward(
        &self,
        dinp: (&mut Self::Buf, Accum),
        dgamma: &mut Self::Buf,
        dbeta: &mut Self::Buf,
        dout: &Self::Buf,
        inp: &Self::Buf,
        off: Option<&Self::Buf>,
        mean: &Self::Buf,
        rstd: &Self::Buf,
        gamma: &Self::Buf,
        beta: &Self::Buf,
        x: Dims,
        groups: usize,
    ) {
        let (ms, gb) = ((mean, rstd), (gamma, beta));
        self.gn_silu_backward(dinp, None, None, (dgamma, dbeta), dout, inp, off, ms, gb, x, groups);
    }
    fn groupnorm_silu_backward_sum(
        &self,
        dinp: &mut Self::Buf,
        dsum: &mut Self::Buf,
        dgamma: &mut Self::Buf,
        dbeta: &mut Self::Buf,
        dout: &Self::Buf,
        inp: &Self::Buf,
        off: Option<&Self::Buf>,
        ms: (&Self::Buf, &Self::Buf),
        gb: (&Self::Buf, &Self::Buf),
        x: Dims,
        groups: usize,
    ) {
        let d = (dinp, Accum::Overwrite);
        self.gn_silu_backward(d, Some(dsum), None, (dgamma, dbeta), dout, inp, off, ms, gb, x, groups);
    }
    fn groupnorm_silu_backward_act(
        &self,
        dinp: (&mut Self::Buf, Accum),
        dsum: Option<&mut Self::Buf>,
        act: &mut Self::Buf,
        dgb: (&mut Self::Buf, &mut Self::Buf),
        dout: &Self::Buf,
        inp: &Self::Buf,
        off: Option<&Self::Buf>,
        ms: (&Self::Buf, &Self::Buf),
        gb: (&Self::Buf, &Self::Buf),
        x: Dims,
        groups: usize,
    ) {
        self.gn_silu_backward(dinp, dsum, Some(act), dgb, dout, inp, off, ms, gb, x, groups);
    }
    /// `res` rides in the backward's elementwise pass (`gn_bwd_apply`'s `res`: no add_assign or
    /// copy pass over dinp) where its type is dinp's; else the trait's two calls.
    fn groupnorm_silu_backward_act_res(
        &self,
        dinp: (&mut Self::Buf, Accum),
        res: &Self::Buf,
        act: &mut Self::Buf,
        dgb: (&mut Self::Buf, &mut Self::Buf),
        dout: &Self::Buf,
        inp: &Self::Buf,
        off: Option<&Self::Buf>,
        ms: (&Self::Buf, &Self::Buf),
        gb: (&Self::Buf, &Self::Buf),
        x: Dims,
        groups: usize,
    ) {
        let on = {
            let mut c = self.cache();
            let on = c.choices.res_fold && res.dtype() == dinp.0.dtype();
            c.runs.res_fold += on as u64;
            on
        };
        if !on {
            match dinp.1 {
                Accum::Add => self.add_assign(dinp.0, res),
                Accum::Overwrite => self.copy(dinp.0, res),
            }
            return self.groupnorm_silu_backward_act(
                (dinp.0, Accum::Add),
                None,
                act,
                dgb,
                dout,
                inp,
                off,
                ms,
                gb,
                x,
                groups,
            );
        }
        let (dev, b) = (&self.dev, Some(gb.1));
        let (dgamma, dbeta) = dgb;
        let (mean, rstd) = ms;
        groupnorm::backward(
            dev,
            dinp,
            None,
            Some(act),
            dgamma,
            dbeta,
            dout,
            b,
            inp,
            off,
            mean,
            rstd,
            gb.0,
            x,
            groups,
            (self.layout, Some(res), None),
        );
    }
    fn groupnorm_silu_backward_inplace_act(
        &self,
        d: &mut Self::Buf,
        x: &mut Self::Buf,
        dgb: (&mut Self::Buf, &mut Self::Buf),
        ms: (&Self::Buf, &Self::Buf),
        (gamma, beta): (&Self::Buf, &Self::Buf),
        xd: Dims,
        groups: usize,
    ) {
        groupnorm::backward_inplace_act(&self.dev, d, x, dgb, beta, ms, gamma, xd, groups, self.layout);
    }
    /// Three routes, fastest first:
    /// - from the parts (NDHWC, [`CudaBackend::cat_in_parts`]): the skip conv's weight gradient
    ///   is two GEMMs over the parts plus the bias's rank-one share; the GroupNorm+SiLU backward's
    ///   sums and elementwise pass read x from the parts (`chan_gnbwd_cat_ndhwc*`,
    ///   `gn_bwd_apply_split`) and write the parts' gradients and act = silu(GN(x)) into `x`; the
    ///   skip conv's data gradient is two GEMMs added onto the parts. The concatenation is never
    ///   built and no concatenation-sized gradient is written, read back and split.
    /// - into the parts ([`CudaBackend::cat_in_fused`]): the concatenation built into `x` and the
    ///   skip conv's weight gradient from it, then the same elementwise pass reading `x`.
    /// - else the trait's separate steps (operand types differ, or a vector would straddle the
    ///   parts).
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn groupnorm_silu_backward_cat_in(
        &self,
        d: &mut Self::Buf,
        x: &mut Self::Buf,
        cat: (&Self::Buf, Option<&Self::Buf>, &Self::Buf),
        parts: ((&mut Self::Buf, Accum), (&mut Self::Buf, Accum)),
        dgb: (&mut Self::Buf, &mut Self::Buf),
        ms: (&Self::Buf, &Self::Buf),
        (gamma, beta): (&Self::Buf, &Self::Buf),
        skip: (&Self::Buf, &Self::Buf, &Self::Buf, &mut Self::Buf, ConvShape),
        (ca, cb): (usize, usize),
        groups: usize,
    ) {
        let (dout, dsum, w, dw, cs) = skip;
        let (xd, dt) = (cs.x, x.dtype());
        let (h, hb, s) = cat;
        let typed = [d.dtype(), dout.dtype(), w.dtype(), parts.0 .0.dtype(), parts.1 .0.dtype(), h.dtype(), s.dtype()]
            .iter()
            .all(|&t| t == dt);
        let shaped = typed && ca + cb == xd.c && cs.k == 1 && cs.stride == 1;
        let f32s = [dw.dtype(), dsum.dtype()].iter().all(|&t| t == DType::F32);
        if shaped && f32s && self.cat_in_parts(xd, ca, w.dtype()) {
            conv::backward_filter_1x1_from_parts(&self.dev, dw, dout, cat, dsum, cs, ca);
            let ((ph, mh), (ps, msk)) = parts;
            let pm = ((&mut *ph, mh), (&mut *ps, msk));
            // the skip conv's data gradient in the GroupNorm+SiLU backward's pass where it fits
            let fused = {
                let mut conv = self.cache();
                let on = conv.choices.skip_apply && dt == DType::Bf16 && groupnorm::skip_apply_fits(xd.c, cs.cout, ca);
                conv.runs.skip_apply += on as u64;
                on
            };
            let skip = fused.then_some((dout, w, cs.cout));
            groupnorm::backward_act_split_from_parts(
                &self.dev, d, x, cat, pm, ca, dgb, beta, ms, gamma, xd, groups, skip,
            );
            if !fused {
                conv::backward_data_1x1_into_parts(&self.dev, (ph, ps), dout, w, cs, ca, self.layout);
            }
            return;
        }
        if !(shaped && self.cat_in_fused(xd, ca, w.dtype())) {
            let skip = (dout, dsum, w, dw, cs);
            let gb = (gamma, beta);
            return meddpm::backend::cat_in_steps(self, d, x, cat, parts, dgb, ms, gb, skip, (ca, cb), groups);
        }
        self.concat_channels_bias(x, h, hb, s, xd, ca, cb);
        self.conv3d_backward(None, dw, None, dout, x, w, cs);
        let ((ph, mh), (ps, msk)) = parts;
        let pm = ((&mut *ph, mh), (&mut *ps, msk));
        groupnorm::backward_inplace_act_split(&self.dev, d, x, pm, ca, dgb, beta, ms, gamma, xd, groups, self.layout);
        conv::backward_data_1x1_into_parts(&self.dev, (ph, ps), dout, w, cs, ca, self.layout);
    }

    fn linear_forward(
        &self,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        w: &Self::Buf,
        b: &Self::Buf,
        n: usize,
        i: usize,
        o: usize,
    ) {
        linear::forward(&self.dev, out, inp, w, b, n, i, o);
    }
    fn linear_backward(
        &self,
        dinp: Option<(&mut Self::Buf, Accum)>,
        dw: &mut Self::Buf,
        db: &mut Self::Buf,
        dout: &Self::Buf,
        inp: &Self::Buf,
        w: &Self::Buf,
        n: usize,
        i: usize,
        o: usize,
    ) {
        linear::backward(&self.dev, dinp, dw, db, dout, inp, w, n, i, o);
    }

    fn attention_forward(&self, out: &mut Self::Buf, att: &mut Self::Buf, qkv: &Self::Buf, x: Dims, heads: usize) {
        attention::forward(&self.dev, out, att, qkv, x, heads, self.layout);
    }
    fn attention_backward(
        &self,
        dqkv: &mut Self::Buf,
        datt: &mut Self::Buf,
        dout: &Self::Buf,
        qkv: &Self::Buf,
        att: &Self::Buf,
        x: Dims,
        heads: usize,
    ) {
        attention::backward(&self.dev, dqkv, datt, dout, qkv, att, x, heads, self.layout);
    }

    fn upsample_forward(&self, out: &mut Self::Buf, inp: &Self::Buf, x: Dims) {
        upsample::forward(&self.dev, out, inp, x, self.layout);
    }
    fn upsample_backward(&self, dinp: (&mut Self::Buf, Accum), dout: &Self::Buf, x: Dims) {
        upsample::backward(&self.dev, dinp, dout, x, self.layout);
    }
    /// The doubling in the conv's producer where our wgmma forward runs the conv
    /// (`conv3d_wgmma_fwd_up`, `u` unwritten); elsewhere the trait's two calls.
    #[allow(clippy::too_many_arguments)]
    fn upsample_conv3d_forward(
        &self,
        out: &mut Self::Buf,
        u: &mut Self::Buf,
        x: &Self::Buf,
        xd: Dims,
        w: &Self::Buf,
        b: Option<&Self::Buf>,
        cs: ConvShape,
    ) {
        let mut cache = self.cache();
        conv::upsample_forward(&self.dev, &mut cache, out, u, x, xd, w, b, cs);
    }
    /// The doubling written by the data gradient where our wgmma kernel runs it
    /// (`conv3d_wgmma_dgrad_up`); elsewhere the trait's two calls.
    #[allow(clippy::too_many_arguments)]
    fn upsample_conv3d_backward(
        &self,
        du: &mut Self::Buf,
        u: &mut Self::Buf,
        dw: &mut Self::Buf,
        db: Option<&mut Self::Buf>,
        dout: &Self::Buf,
        x: &Self::Buf,
        xd: Dims,
        w: &Self::Buf,
        cs: ConvShape,
    ) {
        let mut cache = self.cache();
        conv::upsample_backward(&self.dev, &mut cache, du, u, dw, db, dout, x, xd, w, cs);
    }

    fn add_assign(&self, dst: &mut Self::Buf, src: &Self::Buf) {
        elementwise::add_assign(&self.dev, dst, src);
    }
    fn scale(&self, buf: &mut Self::Buf, s: f32) {
        elementwise::scale(&self.dev, buf, s);
    }
    fn add_channel_bias(&self, x: &mut Self::Buf, bias: &Self::Buf, xd: Dims) {
        assert!(x.len() == xd.numel() && bias.len() == xd.n * xd.c, "add_channel_bias {xd}: lengths");
        buf::require_f32("add_channel_bias: bias", &[bias]);
        let mode = Mode::new(self.layout, x.dtype());
        let (xp, bp) = (self.dev.ptr_mut(x), self.dev.ptr(bias));
        elementwise::add_channel_bias(&self.dev, xp, bp, xd, mode, true);
    }
    fn add_channel_bias_to(&self, out: &mut Self::Buf, x: &Self::Buf, bias: &Self::Buf, xd: Dims) {
        assert!(
            out.len() == xd.numel() && x.len() == xd.numel() && bias.len() == xd.c,
            "add_channel_bias_to {xd}: lengths out {} x {} bias {}",
            out.len(),
            x.len(),
            bias.len()
        );
        assert_eq!(out.dtype(), x.dtype(), "add_channel_bias_to {xd}: out and x types");
        buf::require_f32("add_channel_bias_to: bias", &[bias]);
        let mode = Mode::new(self.layout, x.dtype());
        let (yp, xp, bp) = (self.dev.ptr_mut(out), self.dev.ptr(x), self.dev.ptr(bias));
        elementwise::add_channel_bias_to(&self.dev, yp, xp, bp, xd, mode, false);
    }
    fn add_bias_vectors(&self, out: &mut Self::Buf, a: &Self::Buf, b: &Self::Buf) {
        meddpm::backend::check_bias_vectors(out.len(), a.len(), b.len());
        buf::require_f32("add_bias_vectors", &[&*out, a, b]);
        // the channel-bias kernel over a (1, C, 1, 1, 1) f32 tensor
        let d = Dims { n: 1, c: a.len(), d: 1, h: 1, w: 1 };
        let (op, ap, bp) = (self.dev.ptr_mut(out), self.dev.ptr(a), self.dev.ptr(b));
        elementwise::add_channel_bias_to(&self.dev, op, ap, bp, d, Mode::new(Layout::Ncdhw, DType::F32), false);
    }
    fn add_bias_vectors_all(&self, triples: &mut [(&mut Self::Buf, &Self::Buf, &Self::Buf)]) {
        optim::add_all(&self.dev, &self.tables, triples);
    }
    fn channel_sum(&self, dbias: &mut Self::Buf, dx: &Self::Buf, xd: Dims) {
        assert_eq!(dbias.len(), xd.n * xd.c, "channel_sum {xd}: dbias length");
        buf::require_f32("channel_sum: dbias", &[dbias]);
        let out = self.dev.ptr_mut(dbias);
        elementwise::channel_sums(&self.dev, dx, xd, self.layout, elementwise::SumTo::PerSample(out));
    }
    fn bias_grad_rows(&self, db: &mut Self::Buf, rows: &Self::Buf, n: usize, c: usize) {
        linear::bias_grad_rows(&self.dev, db, rows, n, c);
    }
    fn concat_channels_bias(
        &self,
        out: &mut Self::Buf,
        a: &Self::Buf,
        a_bias: Option<&Self::Buf>,
        b: &Self::Buf,
        x: Dims,
        ca: usize,
        cb: usize,
    ) {
        elementwise::concat(&self.dev, out, a, a_bias, b, x, ca, cb, self.layout);
    }
    fn split_channels(
        &self,
        da: (&mut Self::Buf, Accum),
        db: (&mut Self::Buf, Accum),
        dout: &Self::Buf,
        x: Dims,
        ca: usize,
        cb: usize,
    ) {
        elementwise::split(&self.dev, da, db, dout, x, ca, cb, self.layout);
    }

    fn loss_forward(&self, loss: &mut Self::Buf, pred: &Self::Buf, target: &Self::Buf, kind: LossKind) {
        loss::forward(&self.dev, loss, pred, target, kind);
    }
    fn loss_backward(&self, dpred: &mut Self::Buf, pred: &Self::Buf, target: &Self::Buf, kind: LossKind, scale: f32) {
        loss::backward(&self.dev, dpred, pred, target, kind, scale);
    }

    fn randn(&self, out: &mut Self::Buf, rng: Philox, offset: u64, x: Dims) {
        diffusion::randn(&self.dev, out, rng, offset, x, self.layout);
    }
    fn q_sample(&self, xt: &mut Self::Buf, x0: &Self::Buf, eps: &Self::Buf, a: &[f32], b: &[f32], x: Dims) {
        diffusion::q_sample(&self.dev, xt, x0, eps, a, b, x);
    }
    fn q_sample_input(
        &self,
        input: &mut Self::Buf,
        (eps, _xt): (&mut Self::Buf, &mut Self::Buf),
        srcs: (&Self::Buf, &Self::Buf),
        rng: Philox,
        offset: u64,
        ab: (&[f32], &[f32]),
        x: Dims,
        cc: usize,
    ) {
        diffusion::q_sample_input(&self.dev, (input, eps), srcs, rng, offset, ab, x, cc, self.layout);
    }
    fn ddpm_step(&self, x: &mut Self::Buf, eps: &Self::Buf, z: &Self::Buf, coefs: &[DdpmCoefs], xd: Dims) {
        diffusion::ddpm_step(&self.dev, x, eps, z, coefs, xd);
    }
    fn sampler_step(
        &self,
        x: &mut Self::Buf,
        eps: &Self::Buf,
        hist: &mut [Self::Buf],
        pred: Prediction,
        clip: bool,
        coefs: &[SamplerCoefs],
        xd: Dims,
    ) {
        sampler::sampler_step(&self.dev, x, eps, hist, pred, clip, coefs, xd, self.layout);
    }

    fn adam_step(&self, p: &mut Self::Buf, g: &Self::Buf, m: &mut Self::Buf, v: &mut Self::Buf, h: AdamStep) {
        optim::adam(&self.dev, p, g, m, v, h);
    }
    fn ema_update(&self, ema: &mut Self::Buf, p: &Self::Buf, decay: f32) {
        optim::ema(&self.dev, ema, p, decay);
    }
    fn adam_step_all(
        &self,
        p: &mut [Self::Buf],
        g: &mut [Self::Buf],
        m: &mut [Self::Buf],
        v: &mut [Self::Buf],
        h: AdamStep,
        zero_grad: bool,
    ) {
        optim::adam_all(&self.dev, &self.tables, p, g, m, v, h, zero_grad);
    }
    fn ema_update_all(&self, ema: &mut [Self::Buf], p: &[Self::Buf], decay: f32) {
        optim::ema_all(&self.dev, &self.tables, ema, p, decay);
    }
    fn cast_all(&self, pairs: &mut [(&mut Self::Buf, &Self::Buf)]) {
        optim::cast_all(&self.dev, &self.tables, pairs);
    }
}
