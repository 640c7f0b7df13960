//! Every NVRTC kernel (crates/meddpm-cuda/kernels/*.cu) compiles for Hopper (sm_90a, what an
//! H100/H200 loads, and plain sm_90) and Ampere (sm_80, the oldest GPU the backend accepts).
//!
//! Needs only libnvrtc (and the libnvrtc-builtins beside it), not a GPU, so it is no GPU test: CI
//! (.ci/run) installs NVIDIA's NVRTC wheel, puts its library folder on LD_LIBRARY_PATH and sets
//! MEDDPM_REQUIRE_NVRTC=1, so a kernel that does not compile fails CI. Without libnvrtc the test
//! fails where MEDDPM_REQUIRE_NVRTC=1 or CI=true, and elsewhere prints why it checked nothing and
//! passes (a developer's `cargo test` without the library).

fn required() -> bool {
    std::env::var("MEDDPM_REQUIRE_NVRTC").as_deref() == Ok("1") || std::env::var("CI").as_deref() == Ok("true")
}

#[test]
fn kernels_compile_with_nvrtc() {
    // cudarc panics when asked about a library it cannot load
    let present = std::panic::catch_unwind(|| unsafe { cudarc::nvrtc::sys::is_culib_present() }).unwrap_or(false);
    if !present {
        let why = "libnvrtc not found: put a folder holding libnvrtc.so.13 on LD_LIBRARY_PATH \
                   (pip install --target DIR nvidia-cuda-nvrtc==13.*; DIR/nvidia/cu13/lib)";
        assert!(!required(), "{why} (required here: MEDDPM_REQUIRE_NVRTC=1 or CI=true)");
        println!("skipped, no kernel compiled: {why}");
        return;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-pointers to live integers
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    let version = format!("{major}.{minor}");
    for arch in [meddpm_cuda::kernel_arch((9, 0)).as_str(), "sm_90", "sm_80"] {
        let t = std::time::Instant::now();
        let cubins = meddpm_cuda::compile_kernels(arch)
            .unwrap_or_else(|e| panic!("the kernels do not compile for {arch} (NVRTC {version}):\n{e}"));
        for c in &cubins {
            assert!(c.len() > 1000, "{arch}: cubin of {} bytes", c.len());
        }
        let sizes: Vec<usize> = cubins.iter().map(|c| c.len()).collect();
        println!("{arch}: cubins of {sizes:?} bytes in {:.2} s (NVRTC {version})", t.elapsed().as_secs_f64());
    }
}
