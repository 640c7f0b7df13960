//! The device: CUDA context and the one stream every op is queued on, the cuDNN and cuBLAS
//! handles bound to it, the NVRTC-compiled kernel module, and the scratch buffers that grow only on
//! the first use of a shape (cuDNN workspace, reduction partials).
//!
//! Why one stream: the [`meddpm::Backend`] contract is a sequence of dependent ops, so a single
//! in-order stream gives every ordering for free; cudarc's per-buffer event tracking is switched
//! off (it would record two events per kernel argument). The one exception is the copy stream of
//! staged batch uploads (`Backend::stage_act`), joined to the main stream by an event.
//!
//! Libraries are loaded at run time (cudarc `dynamic-loading`), which panics when a library is
//! missing: [`Device::new`] first checks each library is loadable and turns any panic into a clear
//! `Error::Backend`. Kernels (`kernels/*.cu`, embedded with `include_str!`) are compiled once per
//! process and GPU architecture by NVRTC straight to a cubin.

use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::cublas::sys as bsys;
use cudarc::cudnn::sys as nsys;
use cudarc::driver::{result as dres, sys as dsys, CudaContext, CudaFunction, CudaSlice, CudaStream};
use cudarc::nvrtc::sys as rsys;
use meddpm::analysis::kernels::OUR_KERNELS;
use meddpm::{DType, Error, Result};

use crate::buf::{DevMem, GpuBuf};

const COMMON: (&str, &str) = ("common.cu", include_str!("../kernels/common.cu"));

/// The NVRTC sources as compilation units, each a list of files in order (common.cu and reduce.cu
/// define helpers the others use). The units compile in parallel threads into separate modules:
/// conv3d.cu's unrolled kernels take most of NVRTC's time, so it is a unit of its own.
pub(crate) const KERNEL_UNITS: &[&[(&str, &str)]] = &[
    &[
        COMMON,
        ("reduce.cu", include_str!("../kernels/reduce.cu")),
        ("groupnorm.cu", include_str!("../kernels/groupnorm.cu")),
        ("silu.cu", include_str!("../kernels/silu.cu")),
        ("elementwise.cu", include_str!("../kernels/elementwise.cu")),
        ("linear.cu", include_str!("../kernels/linear.cu")),
        ("attention.cu", include_str!("../kernels/attention.cu")),
        ("upsample.cu", include_str!("../kernels/upsample.cu")),
        ("loss.cu", include_str!("../kernels/loss.cu")),
        ("diffusion.cu", include_str!("../kernels/diffusion.cu")),
        ("sampler.cu", include_str!("../kernels/sampler.cu")),
        ("optim.cu", include_str!("../kernels/optim.cu")),
    ],
    &[
        COMMON,
        ("conv3d.cu", include_str!("../kernels/conv3d.cu")),
        ("conv3d_wgmma.cu", include_str!("../kernels/conv3d_wgmma.cu")),
    ],
];

/// Bytes of the workspace given to cuBLAS.
const BLAS_WS: usize = 32 << 20;

/// One kernel argument. Pointers are raw device addresses; `Raw` passes a `#[repr(C)]` struct by
/// value (the kernel reads `size_of` bytes from it).
#[derive(Clone, Copy)]
pub(crate) enum Arg {
    P(u64),
    I(i32),
    L(i64),
    U(u64),
    F(f32),
    D(f64),
    Raw(*const c_void),
}

/// Versions and facts read once at start-up.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub cc: (i32, i32),
    pub sms: u32,
    pub total_mem: usize,
    pub driver_version: i32,
    pub cudnn_version: usize,
    pub cublas_version: i32,
    pub nvrtc_version: (i32, i32),
}

impl DeviceInfo {
    pub fn cudnn_string(&self) -> String {
        version_string(self.cudnn_version)
    }
}

/// cuDNN 9 encodes versions as major·10000 + minor·100 + patch.
pub fn version_string(v: usize) -> String {
    format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
}

pub(crate) struct CudnnHandle(pub(crate) nsys::cudnnHandle_t);
unsafe impl Send for CudnnHandle {}
unsafe impl Sync for CudnnHandle {}
impl Drop for CudnnHandle {
    fn drop(&mut self) {
        unsafe { nsys::cudnnDestroy(self.0) };
    }
}

pub(crate) struct BlasHandle(pub(crate) bsys::cublasHandle_t);
unsafe impl Send for BlasHandle {}
unsafe impl Sync for BlasHandle {}
impl Drop for BlasHandle {
    fn drop(&mut self) {
        unsafe { bsys::cublasDestroy_v2(self.0) };
    }
}

pub(crate) struct Device {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// The side stream of staged uploads (`Backend::stage_act`): the next batch's copy runs
    /// beside the current step; the main stream waits for it by event.
    pub(crate) copy_stream: Arc<CudaStream>,
    pub(crate) cudnn: CudnnHandle,
    pub(crate) blas: BlasHandle,
    funcs: HashMap<&'static str, CudaFunction>,
    pub(crate) info: DeviceInfo,
    /// Reduction partials (f32), grown on first use of a larger shape.
    scratch: Mutex<CudaSlice<f32>>,
    /// The GroupNorm finalizers' block sums and per-group arrival counters (kernels/groupnorm.cu).
    fin: Mutex<FinWs>,
    /// cuDNN workspace (bytes), grown to the largest chosen algorithm's need.
    workspace: Mutex<CudaSlice<u8>>,
    /// cuBLAS's workspace (set with cublasSetWorkspace; kept alive here).
    _blas_ws: CudaSlice<u8>,
    /// Typed temporaries by (elements, type, slot): conversions around cuDNN and attention,
    /// created on the first use of a shape and kept (see [`Device::temp`]).
    temps: Mutex<HashMap<(usize, DType, u8), GpuBuf>>,
}

/// Most groups a GroupNorm finalizer's launch may have (one arrival counter each).
pub(crate) const FIN_MAX_GROUPS: usize = 1024;

/// The split GroupNorm finalizers' storage (kernels/groupnorm.cu, `fin_last`): the blocks' double
/// sums, and one arrival counter per group. Each launch's last block sets its counters back to 0,
/// so they are zero between kernels (and in a captured graph between replays).
pub(crate) struct FinWs {
    pub(crate) ws: CudaSlice<f64>,
    pub(crate) cnt: CudaSlice<u32>,
}

/// Check a cuDNN status. A failure's message carries cuDNN's own account of it where the library
/// keeps one (`cudnnGetLastErrorString`, cuDNN 9): for `..._EXECUTION_FAILED_CUDART` it names the
/// CUDA call that failed inside cuDNN and its error (an intermittent one in the parity tests, with
/// four test threads, is not yet explained).
pub(crate) fn cudnn_ck(st: nsys::cudnnStatus_t, what: &str) -> std::result::Result<(), String> {
    if st == nsys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    let msg = unsafe { CStr::from_ptr(nsys::cudnnGetErrorString(st)) }.to_string_lossy().into_owned();
    let mut last = String::new();
    if unsafe { nsys::cudnnGetVersion() } >= 90000 {
        let mut buf = [0 as std::ffi::c_char; 1024];
        unsafe { nsys::cudnnGetLastErrorString(buf.as_mut_ptr(), buf.len()) };
        buf[buf.len() - 1] = 0; // terminated even where the message filled the buffer
        let s = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
        if !s.trim().is_empty() {
            last = format!("; cuDNN says: {}", s.trim());
        }
    }
    Err(format!("cuDNN {what}: {st:?} ({msg}){last}"))
}

/// Check a cuBLAS status.
pub(crate) fn cublas_ck(st: bsys::cublasStatus_t, what: &str) -> std::result::Result<(), String> {
    if st == bsys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(format!("cuBLAS {what}: {st:?}"))
    }
}

/// Run `f`, turning a panic (cudarc panics when a dynamically loaded library or symbol is missing)
/// into an error message.
pub(crate) fn no_panic<T>(
    what: &str,
    f: impl FnOnce() -> std::result::Result<T, String>,
) -> std::result::Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let m = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(format!("{what}: {m}"))
        }
    }
}

/// Which of the libraries the backend needs can be loaded (name, present).
pub(crate) fn library_presence() -> Vec<(&'static str, bool)> {
    let p = |f: unsafe fn() -> bool| std::panic::catch_unwind(|| unsafe { f() }).unwrap_or(false);
    vec![
        ("cuda (driver)", p(dsys::is_culib_present)),
        ("nvrtc", p(rsys::is_culib_present)),
        ("cudnn", p(nsys::is_culib_present)),
        ("cublas", p(bsys::is_culib_present)),
        ("cupti", p(cudarc::cupti::sys::is_culib_present)),
    ]
}

/// NVRTC version (major, minor).
pub(crate) fn nvrtc_version() -> std::result::Result<(i32, i32), String> {
    let (mut a, mut b) = (0, 0);
    let st = unsafe { rsys::nvrtcVersion(&mut a, &mut b) };
    if st != rsys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcVersion: {st:?}"));
    }
    Ok((a, b))
}

/// The oldest compute capability the kernels compile for: 8.0 (Ampere). Several use `cp.async` and
/// the bf16 `mma.m16n8k16` (ptxas rejects them for sm_75 and older).
pub const MIN_CC: (i32, i32) = (8, 0);

/// Ok where a device of compute capability `cc` can run the kernels, else the message a user sees
/// instead of ptxas' (`name`: the device's name).
pub fn check_cc(cc: (i32, i32), name: &str) -> std::result::Result<(), String> {
    if cc >= MIN_CC {
        return Ok(());
    }
    Err(format!(
        "{name} has compute capability {}.{}: meddpm's CUDA kernels need {}.{} or newer (Ampere, Ada, \
         Hopper or later); run on the CPU instead (--device cpu)",
        cc.0, cc.1, MIN_CC.0, MIN_CC.1
    ))
}

/// The NVRTC target of a device of compute capability `cc`: sm_90 devices get sm_90a, whose
/// cubin has the warpgroup MMA (`conv3d_wgmma`) and runs only there; others their own sm_XY.
pub fn kernel_arch(cc: (i32, i32)) -> String {
    if cc == (9, 0) {
        "sm_90a".into()
    } else {
        format!("sm_{}{}", cc.0, cc.1)
    }
}

/// Compile all kernels for `arch` (e.g. "sm_90"): one cubin per unit of [`KERNEL_UNITS`], the units
/// in parallel threads. Public for the compile-only test.
pub fn compile_kernels(arch: &str) -> std::result::Result<Vec<Vec<u8>>, String> {
    std::thread::scope(|sc| {
        let hs: Vec<_> =
            KERNEL_UNITS.iter().enumerate().map(|(i, u)| sc.spawn(move || compile_unit(arch, i, u))).collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("NVRTC thread panicked".into()))).collect()
    })
}

fn compile_unit(arch: &str, i: usize, unit: &[(&str, &str)]) -> std::result::Result<Vec<u8>, String> {
    // `#line`: NVRTC's errors and the line info (ncu's source view) name the file and its own line
    let src: String =
        unit.iter().map(|(name, s)| format!("#line 1 \"crates/meddpm-cuda/kernels/{name}\"\n{s}\n")).collect();
    let csrc = std::ffi::CString::new(src).map_err(|e| e.to_string())?;
    let name = std::ffi::CString::new(format!("meddpm_kernels_{i}.cu")).unwrap();
    let prog = cudarc::nvrtc::result::create_program(&csrc, Some(&name)).map_err(|e| format!("nvrtc create: {e:?}"))?;
    let mut opts = vec![format!("--gpu-architecture={arch}"), "-std=c++17".into(), "-lineinfo".into()];
    let verbose = std::env::var("MEDDPM_NVRTC_VERBOSE").is_ok_and(|v| v == "1");
    if verbose {
        opts.push("--ptxas-options=-v".into());
    }
    let res = unsafe { cudarc::nvrtc::result::compile_program(prog, &opts) };
    let log = unsafe { cudarc::nvrtc::result::get_program_log(prog) }
        .map(|l| unsafe { CStr::from_ptr(l.as_ptr()) }.to_string_lossy().into_owned())
        .unwrap_or_default();
    if verbose {
        eprintln!("NVRTC log ({arch}):\n{log}");
    }
    let out = match res {
        Err(e) => Err(format!("NVRTC failed to compile the meddpm kernels for {arch}: {e:?}\n{log}")),
        Ok(()) => {
            let mut size = 0usize;
            let st = unsafe { rsys::nvrtcGetCUBINSize(prog, &mut size) };
            if st != rsys::nvrtcResult::NVRTC_SUCCESS {
                Err(format!("nvrtcGetCUBINSize: {st:?}"))
            } else {
                let mut buf = vec![0u8; size];
                let st = unsafe { rsys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut _) };
                if st != rsys::nvrtcResult::NVRTC_SUCCESS {
                    Err(format!("nvrtcGetCUBIN: {st:?}"))
                } else {
                    Ok(buf)
                }
            }
        }
    };
    unsafe { cudarc::nvrtc::result::destroy_program(prog) }.ok();
    out
}

/// A hash of our kernels' sources and the NVRTC version: names the compiled cubins on disk, and
/// keys the timed kernel-vs-cuDNN choices kept there (conv/algo_cache.rs), so a changed kernel is compiled
/// and timed again.
pub(crate) fn sources_key() -> u64 {
    use std::hash::{Hash, Hasher};
    static KEY: OnceLock<u64> = OnceLock::new();
    *KEY.get_or_init(|| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        KERNEL_UNITS.hash(&mut h);
        // (no NVRTC library, as in the CPU tests: no version; cudarc panics on the missing library)
        let present = std::panic::catch_unwind(|| unsafe { cudarc::nvrtc::sys::is_culib_present() }).unwrap_or(false);
        present.then(|| nvrtc_version().ok()).flatten().hash(&mut h);
        h.finish()
    })
}

/// Compiled cubins (one per unit): kept per process, and on disk next to the cuDNN algorithm cache
/// (keyed by a hash of the sources, the architecture and the NVRTC version) so later processes
/// skip NVRTC.
fn cubin_for(arch: &str) -> std::result::Result<Vec<Vec<u8>>, String> {
    static CACHE: OnceLock<Mutex<HashMap<String, Vec<Vec<u8>>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let mut c = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(b) = c.get(arch) {
        return Ok(b.clone());
    }
    let file = cache_dir().map(|d| {
        let key = sources_key();
        (0..KERNEL_UNITS.len()).map(|i| d.join(format!("kernels-{arch}-{key:016x}-{i}.cubin"))).collect::<Vec<_>>()
    });
    let cached: Option<Vec<Vec<u8>>> =
        file.as_ref().and_then(|fs| fs.iter().map(|f| std::fs::read(f).ok()).collect::<Option<Vec<_>>>());
    let b = match cached {
        Some(b) => b,
        None => {
            let b = compile_kernels(arch)?;
            for (f, c) in file.iter().flatten().zip(&b) {
                let _ = std::fs::create_dir_all(f.parent().unwrap_or(f));
                let tmp = f.with_extension(format!("tmp{}", std::process::id()));
                if std::fs::write(&tmp, c).is_ok() {
                    let _ = std::fs::rename(&tmp, f);
                }
            }
            b
        }
    };
    c.insert(arch.to_string(), b.clone());
    Ok(b)
}

impl Device {
    pub(crate) fn new(ordinal: usize) -> Result<Device> {
        let missing: Vec<&str> =
            library_presence().into_iter().filter(|(n, ok)| !ok && *n != "cupti").map(|(n, _)| n).collect();
        if missing.contains(&"cuda (driver)") {
            return Err(Error::Backend(
                "no CUDA device: the CUDA driver library (libcuda.so) could not be loaded".into(),
            ));
        }
        if !missing.is_empty() {
            return Err(Error::Backend(format!(
                "CUDA libraries not found: {} (searched LD_LIBRARY_PATH and the system paths; run `meddpm doctor`, \
                 and see scripts/gpu-check.sh for a working library folder)",
                missing.join(", ")
            )));
        }
        no_panic("CUDA initialisation", || Self::init(ordinal)).map_err(Error::Backend)
    }

    fn init(ordinal: usize) -> std::result::Result<Device, String> {
        let n = CudaContext::device_count().map_err(|e| format!("no CUDA device: {e}"))?;
        if n <= 0 {
            return Err("no CUDA device: the driver reports 0 devices".into());
        }
        if ordinal >= n as usize {
            return Err(format!("no CUDA device {ordinal}: the driver reports {n} device(s) (0..{})", n - 1));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| format!("no CUDA device: {e}"))?;
        // One in-order stream per backend; we order everything ourselves.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| format!("cuStreamCreate: {e}"))?;
        let copy_stream = ctx.new_stream().map_err(|e| format!("cuStreamCreate: {e}"))?;
        let cc = ctx.compute_capability().map_err(|e| e.to_string())?;
        let sms = ctx
            .attribute(dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| e.to_string())? as u32;
        let mut drv = 0;
        unsafe { dsys::cuDriverGetVersion(&mut drv) };
        let info_base = (ctx.name().unwrap_or_default(), ctx.total_mem().unwrap_or(0));
        check_cc(cc, &info_base.0)?;

        // cuDNN
        let mut h: nsys::cudnnHandle_t = std::ptr::null_mut();
        cudnn_ck(unsafe { nsys::cudnnCreate(&mut h) }, "cudnnCreate")?;
        let cudnn = CudnnHandle(h);
        cudnn_ck(unsafe { nsys::cudnnSetStream(cudnn.0, stream.cu_stream() as _) }, "cudnnSetStream")?;
        let cudnn_version = unsafe { nsys::cudnnGetVersion() };

        // cuBLAS
        let mut bh: bsys::cublasHandle_t = std::ptr::null_mut();
        cublas_ck(unsafe { bsys::cublasCreate_v2(&mut bh) }, "cublasCreate")?;
        let blas = BlasHandle(bh);
        cublas_ck(unsafe { bsys::cublasSetStream_v2(blas.0, stream.cu_stream() as _) }, "cublasSetStream")?;
        let mut cublas_version = 0;
        unsafe { bsys::cublasGetVersion_v2(blas.0, &mut cublas_version) };
        // A workspace of our own: cuBLAS then allocates nothing inside captured graphs.
        let blas_ws = stream.alloc_zeros::<u8>(BLAS_WS).map_err(|e| e.to_string())?;
        {
            use cudarc::driver::DevicePtr;
            let (p, _g) = blas_ws.device_ptr(&stream);
            cublas_ck(unsafe { bsys::cublasSetWorkspace_v2(blas.0, p as _, BLAS_WS) }, "cublasSetWorkspace")?;
        }

        // Kernels
        let nvrtc_version = nvrtc_version()?;
        let arch = kernel_arch(cc);
        let modules = cubin_for(&arch)?
            .into_iter()
            .map(|c| ctx.load_module(cudarc::nvrtc::Ptx::from_binary(c)))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| format!("loading the meddpm kernels ({arch}): {e}"))?;
        let mut funcs = HashMap::new();
        // the kernel list is the profiler's table (one source: a kernel's name and category)
        for &(k, _) in OUR_KERNELS {
            let f = modules
                .iter()
                .find_map(|m| m.load_function(k).ok())
                .ok_or_else(|| format!("kernel {k} is in none of the compiled modules"))?;
            funcs.insert(k, f);
        }
        let scratch = stream.alloc_zeros::<f32>(1 << 16).map_err(|e| e.to_string())?;
        let fin = FinWs {
            ws: stream.alloc_zeros::<f64>(1 << 12).map_err(|e| e.to_string())?,
            cnt: stream.alloc_zeros::<u32>(FIN_MAX_GROUPS).map_err(|e| e.to_string())?,
        };
        let workspace = stream.alloc_zeros::<u8>(256).map_err(|e| e.to_string())?;
        let info = DeviceInfo {
            ordinal,
            name: info_base.0,
            cc,
            sms,
            total_mem: info_base.1,
            driver_version: drv,
            cudnn_version,
            cublas_version,
            nvrtc_version,
        };
        Ok(Device {
            ctx,
            stream,
            copy_stream,
            cudnn,
            blas,
            funcs,
            info,
            scratch: Mutex::new(scratch),
            fin: Mutex::new(fin),
            workspace: Mutex::new(workspace),
            temps: Mutex::new(HashMap::new()),
            _blas_ws: blas_ws,
        })
    }

    pub(crate) fn bind(&self) {
        self.ctx.bind_to_thread().expect("cuCtxSetCurrent");
    }

    /// Device address of a buffer to read.
    pub(crate) fn ptr<M: DevMem>(&self, b: &M) -> u64 {
        b.addr(&self.stream)
    }

    /// Device address of a buffer to write.
    pub(crate) fn ptr_mut<M: DevMem>(&self, b: &mut M) -> u64 {
        b.addr(&self.stream)
    }

    /// A zeroed buffer of `len` elements of type `dt`, with a clear out-of-memory message.
    pub(crate) fn alloc(&self, len: usize, dt: DType) -> Result<GpuBuf> {
        let bytes = (len * dt.bytes()).max(4);
        let mem = self.stream.alloc_zeros::<u8>(bytes).map_err(|e| self.oom(bytes, &e.to_string()))?;
        Ok(GpuBuf::new(mem, len, dt))
    }

    /// Address of a kept temporary of `len` elements of type `dt` (slot distinguishes temporaries
    /// of one call). Created on the first request of a (len, dt, slot) and reused after: the
    /// single in-order stream makes reuse across calls safe; it lives as long as the device.
    pub(crate) fn temp(&self, len: usize, dt: DType, slot: u8) -> u64 {
        let mut g = self.temps.lock().unwrap_or_else(|e| e.into_inner());
        let b = match g.entry((len, dt, slot)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(self.alloc(len, dt).unwrap_or_else(|e| panic!("{e}")))
            }
        };
        b.addr(&self.stream)
    }

    /// dst (n elements of type `dt_dst`) ← src (type `dt_src`), or += with `accum`: the type
    /// conversion kernel (f32 ↔ bf16, round to nearest even).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn cast(&self, dst: u64, dt_dst: DType, src: u64, dt_src: DType, n: usize, accum: bool) {
        let flags = (dt_dst == DType::Bf16) as i32 | (((dt_src == DType::Bf16) as i32) << 1);
        self.launch1("cast_buf", n, &[Arg::P(dst), Arg::P(src), Arg::L(n as i64), Arg::I(flags), Arg::I(accum as i32)]);
    }

    /// Allocate `len` zeroed f32 with a clear out-of-memory message.
    pub(crate) fn alloc_f32(&self, len: usize) -> Result<CudaSlice<f32>> {
        self.stream.alloc_zeros::<f32>(len.max(1)).map_err(|e| self.oom(len * 4, &e.to_string()))
    }

    pub(crate) fn oom(&self, bytes: usize, err: &str) -> Error {
        let (free, total) = self.ctx.mem_get_info().unwrap_or((0, 0));
        Error::Backend(format!(
            "CUDA allocation of {:.1} MiB failed on {} ({:.0} MiB free of {:.0} MiB): {err}; reduce the batch size or \
             the volume size",
            bytes as f64 / 1048576.0,
            self.info.name,
            free as f64 / 1048576.0,
            total as f64 / 1048576.0
        ))
    }

    /// The reduction scratch buffer, at least `len` floats (grows only on first use of a shape).
    pub(crate) fn scratch(&self, len: usize) -> MutexGuard<'_, CudaSlice<f32>> {
        let mut g = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if g.len() < len {
            *g = self.alloc_f32(len).unwrap_or_else(|e| panic!("{e}"));
        }
        g
    }

    /// The GroupNorm finalizers' workspace, its block sums at least `doubles` long.
    pub(crate) fn fin_ws(&self, doubles: usize) -> MutexGuard<'_, FinWs> {
        let mut g = self.fin.lock().unwrap_or_else(|e| e.into_inner());
        if g.ws.len() < doubles {
            g.ws = self
                .stream
                .alloc_zeros::<f64>(doubles)
                .unwrap_or_else(|e| panic!("{}", self.oom(doubles * 8, &e.to_string())));
        }
        g
    }

    /// The cuDNN workspace, at least `bytes` long.
    pub(crate) fn workspace(&self, bytes: usize) -> MutexGuard<'_, CudaSlice<u8>> {
        let mut g = self.workspace.lock().unwrap_or_else(|e| e.into_inner());
        if g.len() < bytes {
            *g = self.stream.alloc_zeros::<u8>(bytes).unwrap_or_else(|e| panic!("{}", self.oom(bytes, &e.to_string())));
        }
        g
    }

    /// Blocks for a grid-stride elementwise kernel over `n` items (256 threads each).
    pub(crate) fn grid_for(&self, n: usize) -> u32 {
        let want = n.div_ceil(256).max(1);
        want.min(self.info.sms as usize * 16) as u32
    }

    /// Launch kernel `name` with the given grid/block and arguments.
    pub(crate) fn launch(&self, name: &str, grid: (u32, u32, u32), block: (u32, u32, u32), args: &[Arg]) {
        self.launch_shared(name, grid, block, 0, args)
    }

    /// [`Device::launch`] with `smem` bytes of dynamic shared memory (at most 48 KB).
    pub(crate) fn launch_shared(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &[Arg],
    ) {
        assert!(smem <= 227 * 1024, "kernel {name}: {smem} bytes of dynamic shared memory (227 KB at most)");
        let f = self.funcs.get(name).unwrap_or_else(|| panic!("unknown kernel {name}"));
        if smem > 48 * 1024 {
            // past 48 KB a kernel opts in (a host-side attribute, allowed during graph capture)
            use cudarc::driver::sys::CUfunction_attribute_enum as A;
            f.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
                .unwrap_or_else(|e| panic!("kernel {name}: {smem} bytes of dynamic shared memory: {e}"));
        }
        assert!(args.len() <= 24, "kernel {name}: too many arguments");
        let mut slots = [0u64; 24];
        for (s, a) in slots.iter_mut().zip(args) {
            *s = match *a {
                Arg::P(v) | Arg::U(v) => v,
                Arg::I(v) => v as u32 as u64,
                Arg::L(v) => v as u64,
                Arg::F(v) => v.to_bits() as u64,
                Arg::D(v) => v.to_bits(),
                Arg::Raw(_) => 0,
            };
        }
        let mut params: [*mut c_void; 24] = [std::ptr::null_mut(); 24];
        for (i, a) in args.iter().enumerate() {
            params[i] = match *a {
                Arg::Raw(p) => p as *mut c_void,
                _ => &mut slots[i] as *mut u64 as *mut c_void,
            };
        }
        self.bind();
        unsafe {
            dres::launch_kernel(f.cu_function(), grid, block, smem, self.stream.cu_stream(), &mut params[..args.len()])
        }
        .unwrap_or_else(|e| panic!("launching kernel {name} (grid {grid:?}, block {block:?}): {e}"));
    }

    /// 1-D grid-stride launch over `n` items.
    pub(crate) fn launch1(&self, name: &str, n: usize, args: &[Arg]) {
        if n == 0 {
            return;
        }
        self.launch(name, (self.grid_for(n), 1, 1), (256, 1, 1), args);
    }

    pub(crate) fn sync(&self) {
        self.stream.synchronize().unwrap_or_else(|e| panic!("CUDA stream synchronize: {e}"));
        self.copy_stream.synchronize().unwrap_or_else(|e| panic!("CUDA stream synchronize: {e}"));
    }
}

/// Library files mapped into this process whose name contains one of `needles`, resolved.
pub fn loaded_library_files(needles: &[&str]) -> Vec<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut out: Vec<String> = Vec::new();
    for line in maps.lines() {
        if let Some(path) = line.split_whitespace().nth(5) {
            let file = path.rsplit('/').next().unwrap_or("");
            if needles.iter().any(|n| file.starts_with(n)) && !out.iter().any(|o| o == path) {
                out.push(path.to_string());
            }
        }
    }
    out
}

/// Where meddpm-cuda keeps its caches (cuDNN algorithms, compiled kernels); None when disabled.
pub(crate) fn cache_dir() -> Option<PathBuf> {
    if std::env::var("MEDDPM_CUDNN_CACHE").map(|v| v == "0").unwrap_or(false) {
        return None;
    }
    if let Ok(d) = std::env::var("MEDDPM_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    if let Ok(d) = std::env::var("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("meddpm"));
    }
    std::env::var("HOME").ok().map(|h| PathBuf::from(h).join(".cache").join("meddpm"))
}

#[cfg(test)]
mod tests {
    /// Pre-Ampere devices get a clear message (the kernels do not compile for sm_75: ptxas rejects
    /// cp.async and the bf16 mma); Ampere and later pass.
    #[test]
    fn devices_older_than_ampere_are_refused_by_name() {
        let e = super::check_cc((7, 5), "Tesla T4").unwrap_err();
        assert!(e.contains("Tesla T4") && e.contains("7.5") && e.contains("8.0") && e.contains("--device cpu"), "{e}");
        assert!(super::check_cc((6, 1), "GTX 1080").is_err());
        for cc in [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)] {
            assert!(super::check_cc(cc, "gpu").is_ok(), "{cc:?}");
        }
    }

    /// Every kernel of the list the backend loads (`OUR_KERNELS`) is defined in the sources: its
    /// name occurs there, or it is an instance of a macro's template (`chan_stats_ndhwc##V`), and
    /// the profiler gives it its own category, never "other".
    #[test]
    fn every_listed_kernel_is_in_the_sources_with_a_category() {
        use meddpm::analysis::kernels::{classify, Category};
        let text: String = super::KERNEL_UNITS.iter().flat_map(|u| u.iter().map(|(_, s)| *s)).collect();
        let templates: Vec<&str> = text
            .split("extern \"C\" __global__ void ")
            .skip(1)
            .filter_map(|part| {
                // an optional __launch_bounds__(…) comes before the name, maybe a macro too
                let rest = match part.strip_prefix("__launch_bounds__(") {
                    Some(r) => r.split_once(')')?.1,
                    None => part,
                };
                rest.split('(').next()?.split_whitespace().last()?.split_once("##").map(|(base, _)| base)
            })
            .collect();
        assert!(templates.contains(&"chan_stats_ndhwc"), "{templates:?}");
        for &(k, c) in super::OUR_KERNELS {
            let found = text.contains(k) || templates.iter().any(|t| k.starts_with(t));
            assert!(found, "{k} is listed but defined in no kernel source");
            assert_ne!(c, Category::Other, "{k}");
            assert_eq!(classify(k), c, "{k}");
        }
    }

    /// Every `extern "C"` kernel written out in the sources (not generated by a macro) is in
    /// `OUR_KERNELS`, what the backend loads by name: one left out fails only at its first launch,
    /// on a GPU.
    #[test]
    fn the_sources_entry_points_are_in_kernel_names() {
        let mut found = 0;
        for unit in super::KERNEL_UNITS {
            for (file, src) in unit.iter() {
                for part in src.split("extern \"C\" __global__ void ").skip(1) {
                    // an optional __launch_bounds__(…) comes before the name
                    let rest = match part.strip_prefix("__launch_bounds__(") {
                        Some(r) => r.split_once(')').expect("launch bounds close").1.trim_start(),
                        None => part,
                    };
                    let name = rest.split('(').next().expect("kernel name").trim();
                    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                        continue; // a macro's template (its instances are listed by hand)
                    }
                    assert!(
                        super::OUR_KERNELS.iter().any(|(k, _)| *k == name),
                        "{file}: kernel {name} is not in OUR_KERNELS"
                    );
                    found += 1;
                }
            }
        }
        assert!(found > 40, "only {found} kernels found in the sources");
    }
}
