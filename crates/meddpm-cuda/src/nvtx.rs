//! NVTX ranges for [`crate::CudaBackend`]'s `push_range`/`pop_range` (issue 4): every U-Net block,
//! forward/backward and the profiler's `train`/`sample`/`optimizer` ranges become NVTX push/pop
//! ranges, so Nsight Compute can select one step (`ncu --nvtx --nvtx-include "train/"`) and shows
//! the range stack of every profiled kernel.
//!
//! cudarc's `nvtx` feature loads `libnvToolsExt` at run time (pip `nvidia-nvtx`, or a CUDA ≤ 12
//! toolkit). A missing library must not abort a run, so the library is probed once and every call
//! is a no-op without it ([`status`] says why); `MEDDPM_NVTX=0` turns the ranges off. NVTX itself
//! is a no-op unless a tool (ncu, nsys) is injected, so the ranges cost a few ns otherwise.

use std::sync::OnceLock;

fn probe() -> &'static Result<(), String> {
    static S: OnceLock<Result<(), String>> = OnceLock::new();
    S.get_or_init(|| {
        if std::env::var("MEDDPM_NVTX").map(|v| v == "0").unwrap_or(false) {
            return Err("turned off by MEDDPM_NVTX=0".into());
        }
        // SAFETY: only tries to dlopen the candidate library names.
        if unsafe { cudarc::nvtx::sys::is_culib_present() } {
            Ok(())
        } else {
            Err("libnvToolsExt (libnvToolsExt.so.1, pip package nvidia-nvtx) was not found on the library path".into())
        }
    })
}

/// `Ok` when NVTX ranges are emitted, else why not.
pub(crate) fn status() -> Result<(), String> {
    probe().clone()
}

/// Open a push/pop range (no-op without the library). NUL bytes in the name are dropped.
pub(crate) fn push(name: &str) {
    if probe().is_ok() {
        if name.contains('\0') {
            cudarc::nvtx::result::range_push(name.replace('\0', ""));
        } else {
            cudarc::nvtx::result::range_push(name);
        }
    }
}

/// Close the innermost range (no-op without the library).
pub(crate) fn pop() {
    if probe().is_ok() {
        cudarc::nvtx::result::range_pop();
    }
}
