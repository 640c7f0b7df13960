//! The NVRTC kernels compile for Hopper (sm_90a, what an H100/H200 loads; sm_90) and Ampere (sm_80). Needs only libnvrtc, not a GPU,
//! so it also runs on a CPU machine that has the NVRTC library on LD_LIBRARY_PATH (e.g. from the
//! `nvidia-cuda-nvrtc` wheel); elsewhere it prints a skip reason and passes.

#[test]
fn kernels_compile_with_nvrtc() {
    let present = std::panic::catch_unwind(|| unsafe { cudarc::nvrtc::sys::is_culib_present() }).unwrap_or(false);
    if !present {
        println!("skipped: libnvrtc not found (set LD_LIBRARY_PATH to a folder holding libnvrtc.so.13)");
        return;
    }
    for arch in [meddpm_cuda::kernel_arch((9, 0)).as_str(), "sm_90", "sm_80"] {
        let t = std::time::Instant::now();
        let cubins = meddpm_cuda::compile_kernels(arch).unwrap_or_else(|e| panic!("{e}"));
        for c in &cubins {
            assert!(c.len() > 1000, "{arch}: cubin of {} bytes", c.len());
        }
        let sizes: Vec<usize> = cubins.iter().map(|c| c.len()).collect();
        println!("{arch}: cubins of {sizes:?} bytes in {:.2} s", t.elapsed().as_secs_f64());
    }
}
