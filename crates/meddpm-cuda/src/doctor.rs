//! `meddpm doctor`: which GPU, driver and libraries this process would use, and where each library
//! file was found, with versions. The cuDNN trap: a system
//! folder may hold an old cuDNN under the unversioned name `libcudnn.so`, which cudarc's loader
//! tries first; this report shows the file actually mapped into the process and warns when its
//! version has known wrong-result bugs for TF32 / bf16 3-D convolutions.

use std::fmt::Write;

use crate::choices::KernelChoices;
use crate::device::{library_presence, no_panic, Device};

/// Oldest cuDNN the backend accepts for TF32 3-D convolutions (9.10.2–9.15 have known wrong-result
/// bugs for some TF32 3-D convs, 9.8–9.14 for bf16 ones; PyTorch re-enabled them from 9.15).
pub const MIN_CUDNN_TF32: usize = 91500;

/// Files named like `prefix*` in the LD_LIBRARY_PATH folders (for libraries we do not load, e.g. NCCL).
fn find_on_library_path(prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    for dir in path.split(':').filter(|d| !d.is_empty()) {
        if let Ok(rd) = std::fs::read_dir(dir) {
            let mut names: Vec<String> = rd
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(prefix))
                .collect();
            names.sort();
            for n in names {
                out.push(format!("{dir}/{n}"));
            }
        }
    }
    out
}

/// The whole report as text (never panics).
pub fn doctor() -> String {
    let mut r = String::new();
    let _ = writeln!(r, "meddpm doctor (CUDA backend, cudarc 0.19, dynamic loading)");
    let _ = writeln!(r, "LD_LIBRARY_PATH = {}", std::env::var("LD_LIBRARY_PATH").unwrap_or_else(|_| "(unset)".into()));
    let _ = writeln!(r, "libraries loadable by name:");
    for (name, ok) in library_presence() {
        let _ = writeln!(r, "  {name:14} {}", if ok { "found" } else { "NOT FOUND" });
    }
    let _ = write!(r, "kernel choices (environment; crates/meddpm-cuda/src/choices.rs):\n{}", KernelChoices::env());
    match Device::new(0) {
        Err(e) => {
            let _ = writeln!(r, "device: {e}");
        }
        Ok(dev) => {
            let i = &dev.info;
            let n = cudarc::driver::CudaContext::device_count().unwrap_or(0);
            let _ = writeln!(r, "devices: {n}");
            let _ = writeln!(
                r,
                "device 0: {} (sm_{}{}), {} SMs, {:.1} GiB",
                i.name,
                i.cc.0,
                i.cc.1,
                i.sms,
                i.total_mem as f64 / (1u64 << 30) as f64
            );
            let _ = writeln!(r, "driver: CUDA {}.{}", i.driver_version / 1000, (i.driver_version % 1000) / 10);
            let _ = writeln!(r, "cuDNN: {} ({})", i.cudnn_string(), i.cudnn_version);
            if i.cudnn_version < MIN_CUDNN_TF32 {
                let _ = writeln!(
                    r,
                    "  WARNING: cuDNN {} has known wrong-result bugs for TF32/bf16 3-D convolutions; the backend \
                     refuses --precision tf32 with it. Put a folder holding `libcudnn.so -> <site-packages>/nvidia/\
                     cudnn/lib/libcudnn.so.9` (9.15 or newer) first in LD_LIBRARY_PATH (scripts/gpu-check.sh does).",
                    i.cudnn_string()
                );
            }
            let _ = writeln!(r, "cuBLAS: {}", i.cublas_version);
            let _ = writeln!(r, "NVRTC: {}.{}", i.nvrtc_version.0, i.nvrtc_version.1);
            let cupti = no_panic("cupti", || {
                let mut v = 0u32;
                unsafe { cudarc::cupti::sys::cuptiGetVersion(&mut v) };
                Ok(v)
            });
            let _ = writeln!(r, "CUPTI API: {}", cupti.map(|v| v.to_string()).unwrap_or_else(|e| e));
        }
    }
    let _ = writeln!(r, "library files mapped into this process:");
    for f in crate::device::loaded_library_files(&[
        "libcuda.",
        "libcudnn",
        "libcublas",
        "libnvrtc",
        "libcupti",
        "libnvidia-ptxjit",
    ]) {
        let real = std::fs::canonicalize(&f).map(|p| p.display().to_string()).unwrap_or_default();
        if real.is_empty() || real == f {
            let _ = writeln!(r, "  {f}");
        } else {
            let _ = writeln!(r, "  {f} -> {real}");
        }
    }
    // cuBLAS and cuBLASLt must come from one release: libcublas.so (unversioned, e.g. from
    // /usr/local/cuda) pulls libcublasLt.so.13 from whichever folder comes first.
    let dir = |f: &str| std::path::Path::new(f).parent().map(|d| d.to_path_buf());
    let blas = crate::device::loaded_library_files(&["libcublas."]);
    let lt = crate::device::loaded_library_files(&["libcublasLt."]);
    if let (Some(b), Some(l)) = (blas.first(), lt.first()) {
        if dir(b) != dir(l) {
            let _ = writeln!(
                r,
                "  NOTE: libcublas and libcublasLt come from different folders ({b} and {l}); put a folder with \
                 consistent `libcublas.so`/`libcublasLt.so` links first in LD_LIBRARY_PATH if results look wrong"
            );
        }
    }
    let nccl = find_on_library_path("libnccl");
    let _ = writeln!(
        r,
        "NCCL on LD_LIBRARY_PATH: {}",
        if nccl.is_empty() { "none (not needed for one GPU)".to_string() } else { nccl.join(", ") }
    );
    // loads libnccl (as multi-GPU training would) and reports its version and file
    let _ = writeln!(r, "{}", crate::nccl::doctor_line());
    let _ = writeln!(
        r,
        "CUDA devices visible: {} (`--gpus` spawns one rank per device)",
        crate::collective::device_count()
    );
    r
}
