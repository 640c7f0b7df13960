//! meddpm-cuda: the only crate that names cudarc types or launches kernels. Libraries are loaded
//! at run time, so this crate builds everywhere and reports "no CUDA device" where there is none.

/// Probe for a usable CUDA driver and device; `Err` says why not.
pub fn probe() -> Result<String, String> {
    // cudarc panics when libcuda cannot be loaded; keep that panic's message off the terminal.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(|| cudarc::driver::CudaContext::new(0));
    std::panic::set_hook(hook);
    match r {
        Ok(Ok(ctx)) => Ok(format!("CUDA device 0: {}", ctx.name().unwrap_or_default())),
        Ok(Err(e)) => Err(format!("no CUDA device: {e}")),
        Err(_) => Err("no CUDA device: the CUDA driver library could not be loaded".into()),
    }
}
