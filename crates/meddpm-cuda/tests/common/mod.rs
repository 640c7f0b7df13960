//! Helpers shared by the GPU parity test binaries (parity.rs, parity_bf16.rs): which convolution
//! path, ours or cuDNN, a conv shape must have taken.

use meddpm::ConvShape;
use meddpm_cuda::CudaBackend;

/// Which of our few-channel direct kernels (kernels/conv3d.cu) a conv shape may run through,
/// decided by hand from the shape: [forward (Cin ≤ 4 or Cout ≤ 4), data gradient (Cout ≤ 4)];
/// 3×3×3 stride 1 only.
pub fn small_expected(cs: ConvShape) -> [bool; 2] {
    let direct = cs.k == 3 && cs.stride == 1;
    [direct && (cs.x.c <= 4 || cs.cout <= 4), direct && cs.cout <= 4]
}

/// After a call with our few-channel kernels forced on/off (`small`), the path the backend reports
/// for direction `i` (0 forward, 1 data gradient) is the forced one where the shape is theirs.
pub fn check_small_path(g: &CudaBackend, cs: ConvShape, small: Option<bool>, i: usize, tag: &str) {
    let used = g.conv_small_used(&cs)[i];
    let what = format!("{tag}: {} ran ours: {used:?}", ["forward", "data gradient"][i]);
    match (small_expected(cs)[i], small) {
        (false, _) => assert_eq!(used, None, "{what}"),
        (true, Some(f)) => assert_eq!(used, Some(f), "{what}"),
        (true, None) => assert!(used.is_some(), "{what}"), // timed: either path
    }
}
