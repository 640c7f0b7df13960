//! 3-D convolution through cuDNN's legacy N-d API: forward, backward-data, backward-filter, for
//! the cubic kernels k ∈ {1, 3}, stride 1 or 2 and padding (k−1)/2 that Med-DDPM uses.
//! Semantics: `Backend::conv3d_forward` / `conv3d_backward` (torch.nn.Conv3d, cross-correlation).
//!
//! - Layouts: NCDHW activations with (Cout, Cin, k, k, k) weights, or NDHWC activations with
//!   (Cout, k, k, k, Cin) weights (cuDNN's NHWC filter format), expressed through tensor strides.
//! - Precision: `Fp32` sets `CUDNN_FMA_MATH` (no tensor cores, true fp32) and only accepts
//!   algorithms cuDNN reports as FMA; `Tf32` sets `CUDNN_TENSOR_OP_MATH`; `Bf16` runs bf16 tensors
//!   (x, w, y) with fp32 accumulation and `CUDNN_TENSOR_OP_MATH` (with the default math type the
//!   legacy API picks a 30 TFLOP/s non-tensor-core kernel for bf16, ../shared/perf).
//! - Operand types: the compute type is bf16 under `Bf16`, else f32. An operand of the other type
//!   (the network's f32 input and output, an f32 weight) is converted through a kept temporary;
//!   under `Bf16` the weight gradient is written by cuDNN in bf16 into a temporary and added to the
//!   f32 gradient, and the bias gradient is summed from the output gradient as given.
//! - Algorithms are chosen by `cudnnFind*AlgorithmEx` (timed on the real buffers) once per shape,
//!   kept in a per-backend map and in an on-disk cache per GPU and cuDNN version
//!   (`$MEDDPM_CACHE_DIR`, else `$XDG_CACHE_HOME/meddpm`, else `~/.cache/meddpm`;
//!   `MEDDPM_CUDNN_CACHE=0` disables it). The workspace grows to the chosen algorithm's need.
//!   The timed choice between our wide-conv kernels (`conv3d_wgmma_*`) and cuDNN per shape is
//!   kept in the same file (keyed by a hash of our kernels' sources), so every later process
//!   runs the same kernels.
//! - Bias: fused into cuDNN (`cudnnConvolutionBiasActivationForward`, identity activation) when the
//!   algorithm is IMPLICIT_PRECOMP_GEMM and timing on first use says it is faster, else our
//!   `add_channel_bias` kernel; under bf16 the fused call takes the bias rounded to bf16 (cuDNN
//!   wants it in the output's type; PyTorch's autocast rounds a conv bias the same way). The same
//!   call adds a residual tensor z (`forward_res`, `Backend::conv3d_forward_res`): y = conv + z + b
//!   in one pass instead of our bias kernel writing z + b and the conv adding onto it (β = 1).
//!   The bias gradient is our `chan_sum_*` reduction.
//! - Channel padding: a forward whose Cin or Cout is not a multiple of 4 (the first conv, Cin = 3;
//!   the last, Cout = 1) can run through the shape padded with zeros to a multiple of 8, which
//!   cuDNN runs on tensor cores; timed against the plain call on first use (`MEDDPM_CONV_PAD=0/1`
//!   forbids/forces it). The padded sums are the same sums (the extra terms are exact zeros).
//! - Few-channel convs (3×3×3, stride 1): the forward of Cin ≤ 4 convs (the first conv, 3 → 64),
//!   the forward and data gradient of Cout ≤ 4 convs (the last, 64 → 1 or 4) can run through our
//!   direct kernels (kernels/conv3d.cu: f32 FMA sums, operands read in their own types, no
//!   conversions), where cuDNN is slow (a generic 12 TFLOP/s kernel for 3 → 64 in bf16, layout
//!   conversions around the last conv). By default both are timed on first use of a shape and
//!   direction and the faster is kept (`MEDDPM_SMALL_CONV=1` forces ours, `=0` forbids them;
//!   [`crate::CudaBackend::set_small_conv`] in tests; `MEDDPM_CONV_LOG=1` prints the times). On the
//!   H200 the timing keeps ours for all three in bf16, and cuDNN for the TF32 forward of 3 → 64
//!   (0.76 vs 1.34 ms). Until 2026-12-01 every timed choice here (this one, the fused bias, the
//!   channel padding) measured with events created without timing, so each fell to its first
//!   option (cuDNN, separate bias, plain shape); the A/B of docs/perf/h200-2026-11-30d/small-conv-ab/
//!   that made ours the fixed default compared against that. The weight gradient of Cout ≤ 4 convs
//!   is always ours (`small_cout_wgrad`).

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;

use cudarc::cudnn::sys as nsys;
use meddpm::{Accum, ConvShape, DType, Dims, Layout, Precision};

use crate::buf::{require_f32, GpuBuf};
use crate::device::{cudnn_ck, Arg, Device};

/// Milliseconds that `f`'s work takes on the stream, between two events with timing enabled
/// (cudarc's `record_event(None)` creates them with timing disabled, which made every such
/// measurement fail until 2026-12-01 and each timed choice fall to its first option).
fn stream_ms(dev: &Device, f: impl FnOnce()) -> f32 {
    let ev =
        || dev.stream.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).expect("cuEventRecord");
    let e0 = ev();
    f();
    let e1 = ev();
    e1.synchronize().expect("cuEventSynchronize");
    e0.elapsed_ms(&e1).expect("cuEventElapsedTime")
}

/// `MEDDPM_CONV_LOG=1`: print the per-shape choices made by timing (bias fused into cuDNN or not,
/// our few-channel kernels or cuDNN, channel-padded shape or not) with both times.
fn conv_log() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MEDDPM_CONV_LOG").is_ok_and(|v| v != "0"))
}

/// A kernel choice forced by the environment variable `name`: "1" forces it (Some(true)), "0"
/// forbids it (Some(false)), anything else or unset leaves it to timing (None).
fn env_force(name: &str) -> Option<bool> {
    match std::env::var(name).as_deref() {
        Ok("1") => Some(true),
        Ok("0") => Some(false),
        _ => None,
    }
}

/// Largest workspace `cudnnFind` may try (bytes, default 2 GiB, at most a quarter of the free
/// memory); `MEDDPM_CUDNN_WS_MIB` overrides.
fn find_ws_limit() -> usize {
    std::env::var("MEDDPM_CUDNN_WS_MIB").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(2048) << 20
}

struct TensorDesc(nsys::cudnnTensorDescriptor_t);
struct FilterDesc(nsys::cudnnFilterDescriptor_t);
struct ConvDesc(nsys::cudnnConvolutionDescriptor_t);
struct ActDesc(nsys::cudnnActivationDescriptor_t);
unsafe impl Send for ActDesc {}
impl Drop for ActDesc {
    fn drop(&mut self) {
        unsafe { nsys::cudnnDestroyActivationDescriptor(self.0) };
    }
}
unsafe impl Send for TensorDesc {}
unsafe impl Send for FilterDesc {}
unsafe impl Send for ConvDesc {}
impl Drop for TensorDesc {
    fn drop(&mut self) {
        unsafe { nsys::cudnnDestroyTensorDescriptor(self.0) };
    }
}
impl Drop for FilterDesc {
    fn drop(&mut self) {
        unsafe { nsys::cudnnDestroyFilterDescriptor(self.0) };
    }
}
impl Drop for ConvDesc {
    fn drop(&mut self) {
        unsafe { nsys::cudnnDestroyConvolutionDescriptor(self.0) };
    }
}

fn ck(st: nsys::cudnnStatus_t, what: &str) {
    cudnn_ck(st, what).unwrap_or_else(|e| panic!("{e}"));
}

/// cuDNN's data type for a storage type.
fn cudnn_type(dt: DType) -> nsys::cudnnDataType_t {
    match dt {
        DType::F32 => nsys::cudnnDataType_t::CUDNN_DATA_FLOAT,
        DType::Bf16 => nsys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
    }
}

/// The type convolutions compute in (their tensors' storage type) under a precision.
pub(crate) fn compute_type(p: Precision) -> DType {
    p.act_dtype()
}

fn tensor_desc(d: meddpm::Dims, layout: Layout, dt: DType) -> TensorDesc {
    let mut t = std::ptr::null_mut();
    ck(unsafe { nsys::cudnnCreateTensorDescriptor(&mut t) }, "cudnnCreateTensorDescriptor");
    let (n, c, dd, h, w) = (d.n as i32, d.c as i32, d.d as i32, d.h as i32, d.w as i32);
    let dims = [n, c, dd, h, w];
    let strides = match layout {
        Layout::Ncdhw => [c * dd * h * w, dd * h * w, h * w, w, 1],
        Layout::Ndhwc => [dd * h * w * c, 1, h * w * c, w * c, c],
    };
    ck(
        unsafe { nsys::cudnnSetTensorNdDescriptor(t, cudnn_type(dt), 5, dims.as_ptr(), strides.as_ptr()) },
        &format!("cudnnSetTensorNdDescriptor {d}"),
    );
    TensorDesc(t)
}

/// The bias as a (1, C, 1, 1, 1) tensor (same in both layouts), of the output's type.
fn bias_desc(c: usize, dt: DType) -> TensorDesc {
    let mut t = std::ptr::null_mut();
    ck(unsafe { nsys::cudnnCreateTensorDescriptor(&mut t) }, "cudnnCreateTensorDescriptor");
    let dims = [1, c as i32, 1, 1, 1];
    let strides = [c as i32, 1, 1, 1, 1];
    ck(
        unsafe { nsys::cudnnSetTensorNdDescriptor(t, cudnn_type(dt), 5, dims.as_ptr(), strides.as_ptr()) },
        "cudnnSetTensorNdDescriptor (bias)",
    );
    TensorDesc(t)
}

fn identity_desc() -> ActDesc {
    let mut a = std::ptr::null_mut();
    ck(unsafe { nsys::cudnnCreateActivationDescriptor(&mut a) }, "cudnnCreateActivationDescriptor");
    ck(
        unsafe {
            nsys::cudnnSetActivationDescriptor(
                a,
                nsys::cudnnActivationMode_t::CUDNN_ACTIVATION_IDENTITY,
                nsys::cudnnNanPropagation_t::CUDNN_PROPAGATE_NAN,
                0.0,
            )
        },
        "cudnnSetActivationDescriptor",
    );
    ActDesc(a)
}

fn filter_desc(cs: &ConvShape, layout: Layout, dt: DType) -> FilterDesc {
    let mut f = std::ptr::null_mut();
    ck(unsafe { nsys::cudnnCreateFilterDescriptor(&mut f) }, "cudnnCreateFilterDescriptor");
    let k = cs.k as i32;
    let dims = [cs.cout as i32, cs.x.c as i32, k, k, k];
    let fmt = match layout {
        Layout::Ncdhw => nsys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
        Layout::Ndhwc => nsys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
    };
    ck(
        unsafe { nsys::cudnnSetFilterNdDescriptor(f, cudnn_type(dt), fmt, 5, dims.as_ptr()) },
        "cudnnSetFilterNdDescriptor",
    );
    FilterDesc(f)
}

fn conv_desc(cs: &ConvShape, math: nsys::cudnnMathType_t) -> ConvDesc {
    let mut c = std::ptr::null_mut();
    ck(unsafe { nsys::cudnnCreateConvolutionDescriptor(&mut c) }, "cudnnCreateConvolutionDescriptor");
    let p = cs.pad() as i32;
    let s = cs.stride as i32;
    let (pad, stride, dil) = ([p; 3], [s; 3], [1i32; 3]);
    ck(
        unsafe {
            nsys::cudnnSetConvolutionNdDescriptor(
                c,
                3,
                pad.as_ptr(),
                stride.as_ptr(),
                dil.as_ptr(),
                nsys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                nsys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            )
        },
        "cudnnSetConvolutionNdDescriptor",
    );
    ck(unsafe { nsys::cudnnSetConvolutionMathType(c, math) }, "cudnnSetConvolutionMathType");
    ConvDesc(c)
}

/// Which of the three convolution computations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Dir {
    Fwd,
    BwdData,
    BwdFilter,
}

impl Dir {
    fn tag(self) -> &'static str {
        match self {
            Dir::Fwd => "fwd",
            Dir::BwdData => "bwd_data",
            Dir::BwdFilter => "bwd_filter",
        }
    }
}

/// A chosen algorithm: cuDNN's algorithm id, the math type it ran with, workspace bytes, and the
/// time cudnnFind measured (ms; negative when it came from the disk cache).
#[derive(Clone, Copy, Debug)]
pub struct Algo {
    pub id: u32,
    pub math: u32,
    pub ws: usize,
    pub ms: f32,
}

fn math_of(m: u32) -> nsys::cudnnMathType_t {
    use nsys::cudnnMathType_t::*;
    match m {
        0 => CUDNN_DEFAULT_MATH,
        1 => CUDNN_TENSOR_OP_MATH,
        2 => CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION,
        _ => CUDNN_FMA_MATH,
    }
}

fn fwd_algo(id: u32) -> nsys::cudnnConvolutionFwdAlgo_t {
    assert!(id < 8, "cuDNN forward algorithm id {id} out of range");
    unsafe { std::mem::transmute::<u32, nsys::cudnnConvolutionFwdAlgo_t>(id) }
}
fn bwd_data_algo(id: u32) -> nsys::cudnnConvolutionBwdDataAlgo_t {
    assert!(id < 6, "cuDNN backward-data algorithm id {id} out of range");
    unsafe { std::mem::transmute::<u32, nsys::cudnnConvolutionBwdDataAlgo_t>(id) }
}
fn bwd_filter_algo(id: u32) -> nsys::cudnnConvolutionBwdFilterAlgo_t {
    assert!(id < 7, "cuDNN backward-filter algorithm id {id} out of range");
    unsafe { std::mem::transmute::<u32, nsys::cudnnConvolutionBwdFilterAlgo_t>(id) }
}

/// Descriptors for one convolution shape; one conv descriptor per direction because each may run
/// with a different math type.
struct Plan {
    x: TensorDesc,
    y: TensorDesc,
    w: FilterDesc,
    bias: TensorDesc,
    conv: [ConvDesc; 3],
    algo: [Option<Algo>; 3],
    /// Forward with the bias fused into cuDNN (cudnnConvolutionBiasActivationForward, identity
    /// activation, only with IMPLICIT_PRECOMP_GEMM) rather than conv + our bias kernel; decided by
    /// timing both on first use, separately for the plain forward ([0]) and the one that adds a
    /// residual tensor z in the same call ([1], `forward_res`).
    fused_bias: [Option<bool>; 2],
}

fn idx(d: Dir) -> usize {
    match d {
        Dir::Fwd => 0,
        Dir::BwdData => 1,
        Dir::BwdFilter => 2,
    }
}

/// Per-backend convolution state: plans per shape and the on-disk algorithm cache.
pub(crate) struct ConvCache {
    layout: Layout,
    precision: Precision,
    plans: HashMap<ConvShape, Plan>,
    /// Forward calls per shape since the last reset (for per-layer benchmarks).
    pub(crate) fwd_calls: HashMap<ConvShape, u64>,
    /// Some(f): always (f = true) or never fuse the bias into cuDNN where possible; None: time it.
    pub(crate) force_fused_bias: Option<bool>,
    /// Some(f): always (f = true) or never run Cin/Cout not divisible by 4 through the
    /// channel-padded shape; None: time both on first use.
    pub(crate) force_pad: Option<bool>,
    /// Channel-padded forward state per original shape.
    pads: HashMap<ConvShape, Pad>,
    /// Some(f): always (f = true) or never run our few-channel kernels where they apply
    /// (`small_fwd_kind`, `small_dgrad`; the default is Some(true)); None: time them against
    /// cuDNN on first use.
    pub(crate) force_small: Option<bool>,
    /// bf16 only: the few-channel forward of Cin ≤ 8 and data gradient of Cout ≤ 4 on the tensor
    /// cores (`conv3d_fwd_small_cin_mma`, `conv3d_dgrad_small_cout_mma`) where the other side is
    /// a multiple of 8 up to 64, and the Cout = 1 and 4 weight gradients' stage 1
    /// (`conv3d_wgrad_small{1,4}_mma`) where Cin is a multiple of 16; false: the FMA kernels
    /// (`MEDDPM_SMALL_MMA=0`, A/B benchmarks).
    pub(crate) small_mma: bool,
    /// The output head GN → SiLU → Conv3 (Cout ≤ 4, 64 bf16 channels, NDHWC, with `small_mma` in
    /// bf16) as one pass, `conv3d_fwd_gn_small_cout` (true, the default), or GroupNorm+SiLU then
    /// the conv (`MEDDPM_FUSED_HEAD=0`, A/B benchmarks).
    pub(crate) fused_head: bool,
    /// The forward of Cout = 1 convs in NDHWC as a GEMM plus tap sum (`small_cout_gemm`, the
    /// default) rather than the direct FMA kernel (`MEDDPM_SMALL_GEMM=0`, A/B benchmarks). On the
    /// H200 the whole-head output conv takes 0.35 instead of 0.76 ms; BraTS' 64 → 4 conv gained
    /// nothing that way (58.75–59.10 vs 58.72 ms per forward, +0.12 GiB), so Cout 2–4 stay direct.
    pub(crate) small_gemm: bool,
    /// Bytes of tap products per slab of `small_cout_gemm` (64 MiB; tests make it small to run
    /// several slabs).
    pub(crate) small_gemm_budget: usize,
    /// Some(f): always (f = true) or never run the wide 3×3×3 convs (Cin, Cout multiples of 64,
    /// bf16 NDHWC, sm_90) through `conv3d_wgmma_*` (`conv_wgmma`); None (the default): time them
    /// against cuDNN on first use of a shape and direction. `MEDDPM_WGMMA=0/1`.
    pub(crate) force_wgmma: Option<bool>,
    /// Per (shape, direction, accumulated): whether `conv3d_wgmma_*` timed faster than cuDNN.
    wgmma: HashMap<(ConvShape, Dir, bool, bool), bool>,
    /// Convolutions (forward or data gradient) `conv3d_wgmma_*` computed, timing runs aside (tests).
    pub(crate) wgmma_runs: u64,
    /// The ResBlocks' GroupNorm+SiLU → conv as `conv3d_wgmma_fwd_gn` where the conv runs on
    /// `conv3d_wgmma` (true, the default), or the two calls (`MEDDPM_WGMMA_GN=0`, A/B benchmarks;
    /// docs/perf/h200-2026-12-02c).
    pub(crate) wgmma_gn: bool,
    /// Of `wgmma_runs`, those with the GroupNorm+SiLU prologue (tests).
    pub(crate) wgmma_gn_runs: u64,
    /// `conv3d_wgmma_*` with 64 input channels load (and transform) each input plane once for the
    /// three output planes that read it (true, the default), or once per output plane
    /// (`MEDDPM_WGMMA_REUSE=0`, A/B benchmarks).
    pub(crate) wgmma_reuse: bool,
    /// Data gradients with a result of 128k channels on `conv3d_wgmma_dgrad2`, both 64-channel
    /// slices in one block on the same staged dy planes (true, the default), or a block a slice
    /// (`conv3d_wgmma_dgrad`; `MEDDPM_WGMMA_DUAL=0`, A/B benchmarks).
    pub(crate) wgmma_dual: bool,
    /// Of `wgmma_runs`, the data gradients `conv3d_wgmma_dgrad2` computed (tests).
    pub(crate) wgmma_dual_runs: u64,
    /// The weight gradients of the wide convs may run on `conv3d_wgmma_wgrad` (true, the default:
    /// timed against cuDNN's as the other directions, or forced by `force_wgmma`), or never
    /// (`MEDDPM_WGMMA_WGRAD=0`, A/B benchmarks).
    pub(crate) wgmma_wgrad: bool,
    /// Weight gradients `conv3d_wgmma_wgrad` computed, timing runs aside (tests).
    pub(crate) wgmma_wgrad_runs: u64,
    /// The decoder ResBlocks without their concatenation stored (the skip conv and the
    /// statistics from the parts, `cat_skip_stats_ndhwc`; in_layers' conv reading the parts)
    /// where in_layers' conv runs on `conv3d_wgmma_fwd_gn` (true, the default), or the
    /// concatenation built (`MEDDPM_CAT_FREE=0`, A/B benchmarks).
    pub(crate) cat_free: bool,
    /// Calls of `cat_skip_stats_ndhwc` (tests).
    pub(crate) cat_free_runs: u64,
    /// The GroupNorm statistics of a fused conv's output from its epilogue where the model asks
    /// (true, the default: `Backend::fused_conv_out_stats`), or a statistics pass
    /// (`MEDDPM_CONV_STATS=0`, A/B benchmarks and the bit-for-bit tests).
    pub(crate) conv_stats: bool,
    /// `conv3d_wgmma_fwd_gn` calls that took their output's statistics (tests).
    pub(crate) wgmma_ystats_runs: u64,
    /// A decoder ResBlock's backward from the parts adds its skip conv's data gradient in the
    /// GroupNorm+SiLU backward's pass (`gn_bwd_apply_split_skip`, true, the default) or runs it as
    /// GEMMs onto the parts after (`MEDDPM_SKIP_APPLY=0`, A/B benchmarks).
    pub(crate) skip_apply: bool,
    /// Calls of `gn_bwd_apply_split_skip` (tests).
    pub(crate) skip_apply_runs: u64,
    /// An identity-skip ResBlock's skip gradient rides in the GroupNorm+SiLU backward's pass
    /// (true, the default: `Backend::groupnorm_silu_backward_act_res`, `gn_bwd_apply`'s res) or is
    /// an add_assign / copy pass before it (`MEDDPM_RES_FOLD=0`, A/B benchmarks and tests).
    pub(crate) res_fold: bool,
    /// Backward passes that took the skip gradient in (tests).
    pub(crate) res_fold_runs: u64,
    /// A ResBlock's conv data gradient, where our wgmma kernel runs it, also takes the following
    /// GroupNorm+SiLU backward's channel sums in its epilogue (true, the default:
    /// `conv3d_wgmma_dgrad_gnb`, `Backend::conv3d_backward_data_gn`) or leaves them to the
    /// backward's own pass over dx (`MEDDPM_DGRAD_GN=0`, A/B benchmarks and tests).
    pub(crate) dgrad_gn: bool,
    /// Data gradients that took the sums (tests).
    pub(crate) dgrad_gn_runs: u64,
    /// The Upsample's conv, where our wgmma kernels run it, computes the trilinear doubling of its
    /// input in the forward's producer and writes it in the data gradient's for the weight
    /// gradient (true, the default: `conv3d_wgmma_fwd_up` / `_dgrad_up`,
    /// `Backend::upsample_conv3d_forward` / `_backward`) or reads it from an upsampling pass
    /// (`MEDDPM_UP_CONV=0`, A/B benchmarks and tests).
    pub(crate) up_conv: bool,
    /// Calls of `conv3d_wgmma_fwd_up` and `conv3d_wgmma_dgrad_up` (tests).
    pub(crate) up_conv_runs: u64,
    /// Per (shape, direction): whether our few-channel kernel timed faster.
    small: HashMap<(ConvShape, Dir), bool>,
    /// Per (shape, direction): whether the latest call ran our few-channel kernel; absent where
    /// the latest call's configuration had none for the shape.
    small_used: HashMap<(ConvShape, Dir), bool>,
    identity: ActDesc,
    disk: HashMap<String, Algo>,
    disk_path: Option<PathBuf>,
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

fn key(dir: Dir, cs: &ConvShape, layout: Layout, precision: Precision) -> String {
    let x = cs.x;
    format!(
        "{} {:?} {:?} {}x{}x{}x{}x{} {} {} {}",
        dir.tag(),
        layout,
        precision,
        x.n,
        x.c,
        x.d,
        x.h,
        x.w,
        cs.cout,
        cs.k,
        cs.stride
    )
    .to_lowercase()
    .replace(' ', "_")
}

/// The disk cache's key of a timed choice between our `kind` of kernel and cuDNN for (dir, cs)
/// (accumulated where `add`): the sources' hash in it, so a changed kernel is timed again.
fn choice_key(kind: &str, dir: Dir, cs: &ConvShape, (layout, precision): (Layout, Precision), add: bool) -> String {
    let acc = if add { "_add" } else { "" };
    format!("choice-{kind}-{:016x}_{}{acc}", crate::device::sources_key(), key(dir, cs, layout, precision))
}

/// One line of the disk cache: key, algorithm id, math type, workspace bytes.
fn disk_line(k: &str, a: &Algo) -> String {
    format!("{k} {} {} {}\n", a.id, a.math, a.ws)
}

/// The disk cache's lines (`disk_line`); others (a torn last line, an older format) are skipped.
fn parse_disk(text: &str) -> HashMap<String, Algo> {
    let mut disk = HashMap::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() == 4 {
            if let (Ok(id), Ok(math), Ok(ws)) = (f[1].parse(), f[2].parse(), f[3].parse()) {
                disk.insert(f[0].to_string(), Algo { id, math, ws, ms: -1.0 });
            }
        }
    }
    disk
}

impl ConvCache {
    pub(crate) fn new(dev: &Device, layout: Layout, precision: Precision) -> ConvCache {
        let disk_path = cache_dir().map(|d| {
            let gpu: String = dev.info.name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect();
            d.join(format!(
                "cudnn-algos-{gpu}-sm{}{}-cudnn{}.txt",
                dev.info.cc.0, dev.info.cc.1, dev.info.cudnn_version
            ))
        });
        let disk = disk_path
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .map_or_else(HashMap::new, |t| parse_disk(&t));
        ConvCache {
            layout,
            precision,
            plans: HashMap::new(),
            fwd_calls: HashMap::new(),
            // MEDDPM_CONV_PAD=0/1 forbids/forces the channel padding (A/B benchmarks)
            force_pad: std::env::var("MEDDPM_CONV_PAD").ok().map(|v| v != "0"),
            // MEDDPM_FUSED_BIAS=0/1 forbids/forces the bias (and residual) in cuDNN's call
            force_fused_bias: std::env::var("MEDDPM_FUSED_BIAS").ok().map(|v| v != "0"),
            pads: HashMap::new(),
            // our few-channel kernels timed against cuDNN per shape by default; MEDDPM_SMALL_CONV=1
            // forces them, =0 forbids them (A/B benchmarks)
            force_small: env_force("MEDDPM_SMALL_CONV"),
            small_mma: std::env::var("MEDDPM_SMALL_MMA").map_or(true, |v| v != "0"),
            fused_head: std::env::var("MEDDPM_FUSED_HEAD").map_or(true, |v| v != "0"),
            small_gemm: std::env::var("MEDDPM_SMALL_GEMM").map_or(true, |v| v != "0"),
            small_gemm_budget: 64 << 20,
            force_wgmma: env_force("MEDDPM_WGMMA"),
            wgmma: HashMap::new(),
            wgmma_runs: 0,
            wgmma_gn: std::env::var("MEDDPM_WGMMA_GN").map_or(true, |v| v != "0"),
            wgmma_gn_runs: 0,
            wgmma_reuse: std::env::var("MEDDPM_WGMMA_REUSE").map_or(true, |v| v != "0"),
            wgmma_dual: std::env::var("MEDDPM_WGMMA_DUAL").map_or(true, |v| v != "0"),
            wgmma_dual_runs: 0,
            wgmma_wgrad: std::env::var("MEDDPM_WGMMA_WGRAD").map_or(true, |v| v != "0"),
            wgmma_wgrad_runs: 0,
            cat_free: std::env::var("MEDDPM_CAT_FREE").map_or(true, |v| v != "0"),
            cat_free_runs: 0,
            conv_stats: std::env::var("MEDDPM_CONV_STATS").map_or(true, |v| v != "0"),
            wgmma_ystats_runs: 0,
            skip_apply: std::env::var("MEDDPM_SKIP_APPLY").map_or(true, |v| v != "0"),
            skip_apply_runs: 0,
            res_fold: std::env::var("MEDDPM_RES_FOLD").map_or(true, |v| v != "0"),
            res_fold_runs: 0,
            dgrad_gn: std::env::var("MEDDPM_DGRAD_GN").map_or(true, |v| v != "0"),
            dgrad_gn_runs: 0,
            up_conv: std::env::var("MEDDPM_UP_CONV").map_or(true, |v| v != "0"),
            up_conv_runs: 0,
            small: HashMap::new(),
            small_used: HashMap::new(),
            identity: identity_desc(),
            disk,
            disk_path,
        }
    }

    /// Whether the tensor-core few-channel kernels run (`small_mma`, bf16 precision only).
    fn mma_on(&self) -> bool {
        self.small_mma && self.precision == Precision::Bf16
    }

    /// Whether [`gn_head_forward`] takes the output head of `cs` (`groups` GroupNorm groups) with
    /// a bf16 input: `fused_head` on, the tensor-core few-channel kernels on, NDHWC, 64 input
    /// channels, Cout ≤ 4, 3×3×3 stride 1.
    pub(crate) fn gn_head_fits(&self, cs: ConvShape, groups: usize, x_bf16: bool) -> bool {
        self.fused_head
            && self.mma_on()
            && self.layout == Layout::Ndhwc
            && x_bf16
            && cs.x.c == 64
            && (1..=4).contains(&cs.cout)
            && cs.k == 3
            && cs.stride == 1
            && groups > 0
            && 64 % groups == 0
    }

    fn plan(&mut self, cs: ConvShape) -> &mut Plan {
        let (layout, precision) = (self.layout, self.precision);
        self.plans.entry(cs).or_insert_with(|| {
            let math = match precision {
                Precision::Fp32 => nsys::cudnnMathType_t::CUDNN_FMA_MATH,
                Precision::Tf32 | Precision::Bf16 => nsys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
            };
            let dt = compute_type(precision);
            Plan {
                x: tensor_desc(cs.x, layout, dt),
                y: tensor_desc(cs.out(), layout, dt),
                w: filter_desc(&cs, layout, dt),
                bias: bias_desc(cs.cout, dt),
                conv: [conv_desc(&cs, math), conv_desc(&cs, math), conv_desc(&cs, math)],
                algo: [None, None, None],
                fused_bias: [None, None],
            }
        })
    }

    fn remember(&mut self, k: String, a: Algo) {
        if let Some(p) = &self.disk_path {
            let line = disk_line(&k, &a);
            let _ = std::fs::create_dir_all(p.parent().unwrap_or(p));
            if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(p) {
                let _ = f.write_all(line.as_bytes());
            }
        }
        self.disk.insert(k, a);
    }

    /// A timed kernel choice (`choice_key`) an earlier process kept in the disk cache.
    fn disk_choice(&self, k: &str) -> Option<bool> {
        self.disk.get(k).map(|a| a.id == 1)
    }

    /// Keep a timed kernel choice in the disk cache (a line like an algorithm's: id 1 = ours).
    fn remember_choice(&mut self, k: String, on: bool) {
        self.remember(k, Algo { id: on as u32, math: 0, ws: 0, ms: -1.0 });
    }

    /// The algorithm for (dir, cs): from the plan, the disk cache, or cudnnFind on the given
    /// buffers (x, w, y device addresses; the output one is overwritten by Find).
    fn algo(&mut self, dev: &Device, dir: Dir, cs: ConvShape, x: u64, w: u64, y: u64) -> Algo {
        if let Some(a) = self.plan(cs).algo[idx(dir)] {
            return a;
        }
        let k = key(dir, &cs, self.layout, self.precision);
        let precision = self.precision;
        let cached = self.disk.get(&k).copied();
        let plan = self.plan(cs);
        let a = match cached {
            Some(mut a) => {
                ck(unsafe { nsys::cudnnSetConvolutionMathType(plan.conv[idx(dir)].0, math_of(a.math)) }, "math type");
                a.ws = ws_size(dev, plan, dir, a.id);
                a
            }
            None => {
                let a = find(dev, plan, dir, precision, x, w, y, &cs);
                ck(unsafe { nsys::cudnnSetConvolutionMathType(plan.conv[idx(dir)].0, math_of(a.math)) }, "math type");
                a
            }
        };
        self.plan(cs).algo[idx(dir)] = Some(a);
        if cached.is_none() {
            self.remember(k, a);
        }
        a
    }

    /// Whether the forward of `cs` fuses its bias into cuDNN (None: not decided yet).
    pub(crate) fn fused_bias(&self, cs: &ConvShape) -> Option<bool> {
        self.plans.get(cs).and_then(|p| p.fused_bias[0])
    }

    /// Whether the latest forward and data gradient of `cs` ran our few-channel kernels (None: no
    /// such call yet, or the shape is not one of theirs).
    pub(crate) fn small_used(&self, cs: &ConvShape) -> [Option<bool>; 2] {
        [Dir::Fwd, Dir::BwdData].map(|d| self.small_used.get(&(*cs, d)).copied())
    }

    /// The algorithms chosen so far (for benchmarks and describe()).
    pub(crate) fn chosen(&self, cs: &ConvShape) -> [Option<Algo>; 3] {
        self.plans.get(cs).map(|p| p.algo).unwrap_or([None, None, None])
    }
}

fn ws_size(dev: &Device, p: &Plan, dir: Dir, id: u32) -> usize {
    let mut s = 0usize;
    let h = dev.cudnn.0;
    let c = p.conv[idx(dir)].0;
    let st = unsafe {
        match dir {
            Dir::Fwd => nsys::cudnnGetConvolutionForwardWorkspaceSize(h, p.x.0, p.w.0, c, p.y.0, fwd_algo(id), &mut s),
            Dir::BwdData => {
                nsys::cudnnGetConvolutionBackwardDataWorkspaceSize(h, p.w.0, p.y.0, c, p.x.0, bwd_data_algo(id), &mut s)
            }
            Dir::BwdFilter => nsys::cudnnGetConvolutionBackwardFilterWorkspaceSize(
                h,
                p.x.0,
                p.y.0,
                c,
                p.w.0,
                bwd_filter_algo(id),
                &mut s,
            ),
        }
    };
    ck(st, "cudnnGet*WorkspaceSize (algorithm from the disk cache; delete the cache file if this persists)");
    s
}

/// cudnnFind*AlgorithmEx with a temporary workspace; the fastest successful algorithm whose math
/// type fits the precision.
#[allow(clippy::too_many_arguments)]
fn find(dev: &Device, p: &Plan, dir: Dir, precision: Precision, x: u64, w: u64, y: u64, cs: &ConvShape) -> Algo {
    let mut limit = find_ws_limit();
    let (free, _) = dev.ctx.mem_get_info().unwrap_or((usize::MAX, 0));
    limit = limit.min(free / 4).max(1 << 20);
    let mut ws = dev.stream.alloc_zeros::<u8>(limit).unwrap_or_else(|e| panic!("{}", dev.oom(limit, &e.to_string())));
    let wsp = {
        use cudarc::driver::DevicePtrMut;
        let (p, _g) = ws.device_ptr_mut(&dev.stream);
        p
    };
    dev.bind();
    let h = dev.cudnn.0;
    let c = p.conv[idx(dir)].0;
    const REQ: usize = 8;
    let mut n = 0i32;
    // (id, cudnnStatus code, math, memory, time)
    let mut res: Vec<(u32, u32, u32, usize, f32)> = Vec::new();
    unsafe {
        match dir {
            Dir::Fwd => {
                let mut perf = [std::mem::zeroed::<nsys::cudnnConvolutionFwdAlgoPerf_t>(); REQ];
                ck(
                    nsys::cudnnFindConvolutionForwardAlgorithmEx(
                        h,
                        p.x.0,
                        x as _,
                        p.w.0,
                        w as _,
                        c,
                        p.y.0,
                        y as _,
                        REQ as i32,
                        &mut n,
                        perf.as_mut_ptr(),
                        wsp as _,
                        limit,
                    ),
                    "cudnnFindConvolutionForwardAlgorithmEx",
                );
                for q in &perf[..n as usize] {
                    res.push((q.algo as u32, q.status as u32, q.mathType as u32, q.memory, q.time));
                }
            }
            Dir::BwdData => {
                let mut perf = [std::mem::zeroed::<nsys::cudnnConvolutionBwdDataAlgoPerf_t>(); REQ];
                ck(
                    nsys::cudnnFindConvolutionBackwardDataAlgorithmEx(
                        h,
                        p.w.0,
                        w as _,
                        p.y.0,
                        y as _,
                        c,
                        p.x.0,
                        x as _,
                        REQ as i32,
                        &mut n,
                        perf.as_mut_ptr(),
                        wsp as _,
                        limit,
                    ),
                    "cudnnFindConvolutionBackwardDataAlgorithmEx",
                );
                for q in &perf[..n as usize] {
                    res.push((q.algo as u32, q.status as u32, q.mathType as u32, q.memory, q.time));
                }
            }
            Dir::BwdFilter => {
                let mut perf = [std::mem::zeroed::<nsys::cudnnConvolutionBwdFilterAlgoPerf_t>(); REQ];
                ck(
                    nsys::cudnnFindConvolutionBackwardFilterAlgorithmEx(
                        h,
                        p.x.0,
                        x as _,
                        p.y.0,
                        y as _,
                        c,
                        p.w.0,
                        w as _,
                        REQ as i32,
                        &mut n,
                        perf.as_mut_ptr(),
                        wsp as _,
                        limit,
                    ),
                    "cudnnFindConvolutionBackwardFilterAlgorithmEx",
                );
                for q in &perf[..n as usize] {
                    res.push((q.algo as u32, q.status as u32, q.mathType as u32, q.memory, q.time));
                }
            }
        }
    }
    dev.sync();
    drop(ws);
    let fma = nsys::cudnnMathType_t::CUDNN_FMA_MATH as u32;
    let usable =
        |r: &&(u32, u32, u32, usize, f32)| r.1 == 0 && r.3 <= limit && (precision != Precision::Fp32 || r.2 == fma);
    if let Some(&(id, _, math, ws, ms)) = res.iter().filter(usable).min_by(|a, b| a.4.total_cmp(&b.4)) {
        return Algo { id, math, ws, ms };
    }
    // cudnnFind ran nothing usable (seen for fp32 FMA NCDHW at 64x128^3 on cuDNN 9.19): take
    // cuDNN's heuristic ranking instead, first entry whose workspace fits.
    let heur = heuristic(dev, p, dir);
    let (free, _) = dev.ctx.mem_get_info().unwrap_or((usize::MAX, 0));
    let pick = heur
        .iter()
        .filter(|r| r.1 == 0 && r.3 <= free / 4 && (precision != Precision::Fp32 || r.2 == fma))
        .find(|r| ws_size_checked(dev, p, dir, r.0).is_some());
    eprintln!(
        "meddpm-cuda: cudnnFind found no usable {} algorithm for conv {} -> {} k{} s{} ({precision:?}); find results \
         (id, status, math, bytes, ms) {res:?}; heuristic {heur:?}; using {pick:?}",
        dir.tag(),
        cs.x,
        cs.cout,
        cs.k,
        cs.stride
    );
    match pick {
        Some(&(id, _, math, _, _)) => Algo { id, math, ws: ws_size(dev, p, dir, id), ms: -2.0 },
        None => panic!(
            "cuDNN has no usable {} algorithm for conv {} -> {} k{} s{} ({precision:?}); find results (id, status, \
             math, bytes, ms) {res:?}; heuristic results {heur:?}",
            dir.tag(),
            cs.x,
            cs.cout,
            cs.k,
            cs.stride
        ),
    }
}

/// cuDNN's heuristic ranking (cudnnGet*Algorithm_v7): (id, status, math, bytes, time).
fn heuristic(dev: &Device, p: &Plan, dir: Dir) -> Vec<(u32, u32, u32, usize, f32)> {
    const REQ: usize = 8;
    let (h, c) = (dev.cudnn.0, p.conv[idx(dir)].0);
    let mut n = 0i32;
    let mut res = Vec::new();
    unsafe {
        match dir {
            Dir::Fwd => {
                let mut perf = [std::mem::zeroed::<nsys::cudnnConvolutionFwdAlgoPerf_t>(); REQ];
                let st = nsys::cudnnGetConvolutionForwardAlgorithm_v7(
                    h,
                    p.x.0,
                    p.w.0,
                    c,
                    p.y.0,
                    REQ as i32,
                    &mut n,
                    perf.as_mut_ptr(),
                );
                if cudnn_ck(st, "heuristic").is_ok() {
                    for q in &perf[..n as usize] {
                        res.push((q.algo as u32, q.status as u32, q.mathType as u32, q.memory, q.time));
                    }
                }
            }
            Dir::BwdData => {
                let mut perf = [std::mem::zeroed::<nsys::cudnnConvolutionBwdDataAlgoPerf_t>(); REQ];
                let st = nsys::cudnnGetConvolutionBackwardDataAlgorithm_v7(
                    h,
                    p.w.0,
                    p.y.0,
                    c,
                    p.x.0,
                    REQ as i32,
                    &mut n,
                    perf.as_mut_ptr(),
                );
                if cudnn_ck(st, "heuristic").is_ok() {
                    for q in &perf[..n as usize] {
                        res.push((q.algo as u32, q.status as u32, q.mathType as u32, q.memory, q.time));
                    }
                }
            }
            Dir::BwdFilter => {
                let mut perf = [std::mem::zeroed::<nsys::cudnnConvolutionBwdFilterAlgoPerf_t>(); REQ];
                let st = nsys::cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                    h,
                    p.x.0,
                    p.y.0,
                    c,
                    p.w.0,
                    REQ as i32,
                    &mut n,
                    perf.as_mut_ptr(),
                );
                if cudnn_ck(st, "heuristic").is_ok() {
                    for q in &perf[..n as usize] {
                        res.push((q.algo as u32, q.status as u32, q.mathType as u32, q.memory, q.time));
                    }
                }
            }
        }
    }
    res
}

fn ws_size_checked(dev: &Device, p: &Plan, dir: Dir, id: u32) -> Option<usize> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ws_size(dev, p, dir, id))).ok()
}

/// Temporary slots of converted operands (see `Device::temp`).
const T_X: u8 = 10;
const T_W: u8 = 11;
const T_Y: u8 = 12;
const T_DY: u8 = 13;
const T_DX: u8 = 14;
const T_DW: u8 = 15;
const T_B: u8 = 16;
const T_P: u8 = 17;
const T_WF: u8 = 18;
const T_WPF: u8 = 19;
const T_WPD: u8 = 20;

/// Address of `b`'s data in type `dt`: the buffer itself, or a kept temporary (slot) holding its
/// conversion.
fn operand(dev: &Device, b: &GpuBuf, dt: DType, slot: u8) -> u64 {
    if b.dtype() == dt {
        return dev.ptr(b);
    }
    let t = dev.temp(b.len(), dt, slot);
    dev.cast(t, dt, dev.ptr(b), b.dtype(), b.len(), false);
    t
}

/// out = conv(inp, w) + b (no bias where None), overwriting `out` or added to it (cuDNN's β = 1)
/// per `Accum`: through our few-channel kernel or cuDNN, whichever timed faster for the shape
/// (`MEDDPM_SMALL_CONV` / `force_small` override). An added-to or bias-less forward always takes
/// the plain cuDNN call (the U-Net's residual convs, never few-channel ones).
pub(crate) fn forward(
    dev: &Device,
    cache: &mut ConvCache,
    (out, acc): (&mut GpuBuf, Accum),
    inp: &GpuBuf,
    w: &GpuBuf,
    b: Option<&GpuBuf>,
    cs: ConvShape,
) {
    check_lens(cs, inp.len(), w.len(), out.len(), b.map_or(cs.cout, |b| b.len()));
    *cache.fwd_calls.entry(cs).or_insert(0) += 1;
    if let Some(b) = b {
        require_f32("conv3d bias", &[b]);
    }
    let b = match (acc, b) {
        (Accum::Overwrite, Some(b)) => b,
        _ => {
            cudnn_forward_acc(dev, cache, out, acc == Accum::Add, inp, w, b, cs);
            return;
        }
    };
    let (cl, mma) = (cache.layout == Layout::Ndhwc, cache.mma_on());
    if let Some(kind) = small_fwd_kind_in(cs, (cl, mma)) {
        let gemm = if cache.small_gemm { cache.small_gemm_budget } else { 0 };
        let ours = match small_decided(cache, cs, Dir::Fwd) {
            Some(f) => f,
            None => time_small(dev, cache, cs, Dir::Fwd, |cache, ours| {
                if ours {
                    small_forward(dev, kind, out, inp, w, b, cs, (cl, mma, gemm));
                } else {
                    cudnn_forward(dev, cache, out, inp, w, b, cs);
                }
            }),
        };
        cache.small_used.insert((cs, Dir::Fwd), ours);
        if ours {
            small_forward(dev, kind, out, inp, w, b, cs, (cl, mma, gemm));
            return;
        }
    } else {
        // not ours in this configuration (Cin 5 to 8 with the tensor-core kernels off)
        cache.small_used.remove(&(cs, Dir::Fwd));
    }
    cudnn_forward(dev, cache, out, inp, w, b, cs);
}

/// out = conv(inp, w) + b + z (`Backend::conv3d_forward_res`): cuDNN's conv-bias-activation call
/// with z where the algorithm allows it and timing on first use says it is faster (`forward_plain`),
/// else our bias kernel writes z + b and cuDNN's conv adds onto it (β = 1). Operands of the other
/// type than the compute type, and few-channel or channel-padded shapes, take the second route.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_res(
    dev: &Device,
    cache: &mut ConvCache,
    out: &mut GpuBuf,
    inp: &GpuBuf,
    w: &GpuBuf,
    b: &GpuBuf,
    z: &GpuBuf,
    cs: ConvShape,
) {
    check_lens(cs, inp.len(), w.len(), out.len(), b.len());
    assert!(
        z.len() == out.len() && z.dtype() == out.dtype(),
        "conv3d {} -> {} with a residual: z has {} {:?} elements, expected {} {:?} (the output's)",
        cs.x,
        cs.cout,
        z.len(),
        z.dtype(),
        out.len(),
        out.dtype()
    );
    require_f32("conv3d bias", &[b]);
    *cache.fwd_calls.entry(cs).or_insert(0) += 1;
    if wgmma_forward(dev, cache, out, true, inp, w, Some(b), Some(z), cs) {
        return;
    }
    let cdt = compute_type(cache.precision);
    if out.dtype() != cdt || small_fwd_kind(cs).is_some() || padded_shape(cs).is_some() {
        let cl = cache.layout == Layout::Ndhwc;
        let (yp, zp) = (dev.ptr_mut(out), dev.ptr(z));
        crate::elementwise::add_channel_bias_to(dev, yp, zp, dev.ptr(b), cs.out(), cl, false, out.bf());
        cudnn_forward_acc(dev, cache, out, true, inp, w, None, cs);
        return;
    }
    let (xp, wp) = (operand(dev, inp, cdt, T_X), operand(dev, w, cdt, T_W));
    let (bp, zp) = (dev.ptr(b), dev.ptr(z));
    forward_plain(dev, cache, cs, xp, wp, bp, dev.ptr_mut(out), Some(zp));
}

/// out = conv(inp, w) + b through cuDNN: operands converted to the compute type where needed.
fn cudnn_forward(
    dev: &Device,
    cache: &mut ConvCache,
    out: &mut GpuBuf,
    inp: &GpuBuf,
    w: &GpuBuf,
    b: &GpuBuf,
    cs: ConvShape,
) {
    if wgmma_forward(dev, cache, out, false, inp, w, Some(b), None, cs) {
        return;
    }
    let cdt = compute_type(cache.precision);
    let (xp, wp, bp) = (operand(dev, inp, cdt, T_X), operand(dev, w, cdt, T_W), dev.ptr(b));
    // an output of the other type is computed into a temporary and converted at the end
    let yp = if out.dtype() == cdt { dev.ptr_mut(out) } else { dev.temp(out.len(), cdt, T_Y) };
    forward_typed(dev, cache, cs, xp, wp, bp, yp);
    if out.dtype() != cdt {
        dev.cast(dev.ptr_mut(out), out.dtype(), yp, cdt, out.len(), false);
    }
}

/// out (+)= conv(inp, w) (+ b): the plain cuDNN forward with β = 1 where `add`, then our bias
/// kernel where there is a bias. An output of the other type goes through a temporary of the
/// compute type that holds its current values when added to.
#[allow(clippy::too_many_arguments)]
fn cudnn_forward_acc(
    dev: &Device,
    cache: &mut ConvCache,
    out: &mut GpuBuf,
    add: bool,
    inp: &GpuBuf,
    w: &GpuBuf,
    b: Option<&GpuBuf>,
    cs: ConvShape,
) {
    if wgmma_forward(dev, cache, out, add, inp, w, b, None, cs) {
        return;
    }
    let cdt = compute_type(cache.precision);
    let (xp, wp) = (operand(dev, inp, cdt, T_X), operand(dev, w, cdt, T_W));
    let yp = if out.dtype() == cdt {
        dev.ptr_mut(out)
    } else {
        let t = dev.temp(out.len(), cdt, T_Y);
        if add {
            dev.cast(t, cdt, dev.ptr(out), out.dtype(), out.len(), false);
        }
        t
    };
    // cudnnFind overwrites its output: an added-to output is not given to it
    let a = if cache.plan(cs).algo[0].is_some() || !add {
        cache.algo(dev, Dir::Fwd, cs, xp, wp, yp)
    } else {
        let mut tmp = dev.alloc(out.len(), cdt).unwrap_or_else(|e| panic!("{e}"));
        let tp = dev.ptr_mut(&mut tmp);
        let a = cache.algo(dev, Dir::Fwd, cs, xp, wp, tp);
        dev.sync();
        drop(tmp);
        a
    };
    let cl = cache.layout == Layout::Ndhwc;
    run_forward_beta(dev, cache, a, cs, xp, wp, yp, if add { 1.0 } else { 0.0 });
    if let Some(b) = b {
        let bf = (cdt == DType::Bf16) as i32;
        crate::elementwise::add_channel_bias(dev, yp, dev.ptr(b), cs.out(), cl, false, bf);
    }
    if out.dtype() != cdt {
        dev.cast(dev.ptr_mut(out), out.dtype(), yp, cdt, out.len(), false);
    }
}

/// Whether `conv3d_wgmma_*` computes (cs, dir) (its channels fit, `conv_wgmma::fits`): forced by
/// `force_wgmma`, else, where the volume is large enough (`worth`), timed against cuDNN on first
/// use (`run(cache, ours, target)` computes the direction one way or the other into a scratch
/// bf16 target of `len` elements, accumulated onto it where `add`; the best of five runs each,
/// interleaved) and the faster kept for the shape, direction and `add`, in this process and in the
/// disk cache (keyed by our kernels' sources): later processes take it from there. Timed afresh
/// in every process, the choice flipped between processes where the two are within a few per
/// cent, one source of the ±0.5 ms spread of the whole-head training step between runs.
#[allow(clippy::too_many_arguments)]
fn wgmma_decided(
    dev: &Device,
    cache: &mut ConvCache,
    cs: ConvShape,
    (dir, add): (Dir, bool),
    worth: bool,
    len: usize,
    run: impl FnMut(&mut ConvCache, bool, u64),
) -> bool {
    timed_choice(dev, cache, cs, (dir, add, false), worth, len, run)
}

/// [`wgmma_decided`]'s timing and caches, for our plain kernel (`up` false) or for the Upsample
/// conv's kernels that compute or write the doubled input (`up`: `run` times them against the
/// upsampling pass plus cuDNN; their own choice, "wgmma_up" in the disk cache).
#[allow(clippy::too_many_arguments)]
fn timed_choice(
    dev: &Device,
    cache: &mut ConvCache,
    cs: ConvShape,
    (dir, add, up): (Dir, bool, bool),
    worth: bool,
    len: usize,
    mut run: impl FnMut(&mut ConvCache, bool, u64),
) -> bool {
    if let Some(f) = cache.force_wgmma.or_else(|| cache.wgmma.get(&(cs, dir, add, up)).copied()) {
        return f;
    }
    if !worth {
        return false;
    }
    // the data gradients `conv3d_wgmma_dgrad2` computes are their own choice (A/B)
    let dual = dir == Dir::BwdData && crate::conv_wgmma::dual_fits(cs.x.c, cache.wgmma_dual);
    let kind = if up {
        "wgmma_up"
    } else if dual {
        "wgmma2"
    } else {
        "wgmma"
    };
    let k = choice_key(kind, dir, &cs, (cache.layout, cache.precision), add);
    if let Some(on) = cache.disk_choice(&k) {
        if conv_log() {
            eprintln!(
                "meddpm-cuda conv {} -> {} k{} s{} {dir:?}{}: {kind} {} (timed by an earlier process, disk cache)",
                cs.x,
                cs.cout,
                cs.k,
                cs.stride,
                if add { " accumulated" } else { "" },
                if on { "kept" } else { "not kept" }
            );
        }
        cache.wgmma.insert((cs, dir, add, up), on);
        return on;
    }
    let mut tmp = dev.alloc(len, DType::Bf16).unwrap_or_else(|e| panic!("{e}"));
    let tp = dev.ptr_mut(&mut tmp);
    let t = best_of_five(dev, cache, |cache, ours| run(cache, ours, tp));
    dev.sync();
    drop(tmp);
    let on = t[1] < t[0];
    if conv_log() {
        eprintln!(
            "meddpm-cuda conv {} -> {} k{} s{} {dir:?}{}: {kind} {:.3} ms, cuDNN {:.3} ms",
            cs.x,
            cs.cout,
            cs.k,
            cs.stride,
            if add { " accumulated" } else { "" },
            t[1],
            t[0]
        );
    }
    cache.wgmma.insert((cs, dir, add, up), on);
    cache.remember_choice(k, on);
    on
}

/// out (= or += per `add`) = conv(inp, w) (+ b) through `conv3d_wgmma_fwd` where it fits (bf16
/// input and output, NDHWC, sm_90, Cin and Cout multiples of 64) and is chosen
/// ([`wgmma_decided`]); false (nothing done) otherwise. With `z` (and `add`): out = conv + b + z.
#[allow(clippy::too_many_arguments)]
fn wgmma_forward(
    dev: &Device,
    cache: &mut ConvCache,
    out: &mut GpuBuf,
    add: bool,
    inp: &GpuBuf,
    w: &GpuBuf,
    b: Option<&GpuBuf>,
    z: Option<&GpuBuf>,
    cs: ConvShape,
) -> bool {
    let cl = cache.layout == Layout::Ndhwc;
    let bf = cache.precision == Precision::Bf16 && inp.dtype() == DType::Bf16 && out.dtype() == DType::Bf16;
    if !crate::conv_wgmma::fwd_fits(dev, cs, cl, bf) {
        return false;
    }
    if !wgmma_fwd_chosen(dev, cache, cs, add, inp, w, out.len()) {
        return false;
    }
    let (xp, wp, wbf) = (dev.ptr(inp), dev.ptr(w), w.dtype() == DType::Bf16);
    let acc = if add { Accum::Add } else { Accum::Overwrite };
    let (bp, zp) = (b.map_or(0, |b| dev.ptr(b)), z.map_or(0, |z| dev.ptr(z)));
    crate::conv_wgmma::run(
        dev,
        (xp, wp, bp, dev.ptr_mut(out), zp),
        wbf,
        cs.x,
        cs.cout,
        acc,
        false,
        cache.wgmma_reuse,
        T_WPF,
    );
    cache.wgmma_runs += 1;
    true
}

/// [`wgmma_decided`] for the forward of `cs` (accumulated where `add`) with `conv_wgmma::fits`
/// already checked: timed on `inp` and `w` into a scratch of `len` elements.
fn wgmma_fwd_chosen(
    dev: &Device,
    cache: &mut ConvCache,
    cs: ConvShape,
    add: bool,
    inp: &GpuBuf,
    w: &GpuBuf,
    len: usize,
) -> bool {
    let (xp, wp, wbf) = (dev.ptr(inp), dev.ptr(w), w.dtype() == DType::Bf16);
    let worth = crate::conv_wgmma::worth(dev, cs.out(), cs.cout);
    let acc = if add { Accum::Add } else { Accum::Overwrite };
    wgmma_decided(dev, cache, cs, (Dir::Fwd, add), worth, len, |cache, ours, tp| {
        if ours {
            crate::conv_wgmma::run(dev, (xp, wp, 0, tp, 0), wbf, cs.x, cs.cout, acc, false, cache.wgmma_reuse, T_WPF);
        } else {
            cudnn_fwd_trial(dev, cache, cs, xp, w, tp, add);
        }
    })
}

/// `Backend::upsample_conv3d_forward`: out = conv(up(x), w) (+ b), x of dims `xd`, `cs.x` its
/// trilinear doubling. `conv3d_wgmma_fwd_up` computes the doubling in its producer (`u` stays
/// unwritten) where `conv3d_wgmma` fits `cs`, `ConvCache::up_conv` is on and the first-use timing
/// keeps it (its own choice: the fused kernel against the upsampling pass and cuDNN's conv; a
/// shape shared with the ResBlocks' convs is timed apart from them); else x is doubled into `u`
/// and [`forward`] runs on it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn upsample_forward(
    dev: &Device,
    cache: &mut ConvCache,
    out: &mut GpuBuf,
    u: &mut GpuBuf,
    x: &GpuBuf,
    xd: meddpm::Dims,
    w: &GpuBuf,
    b: Option<&GpuBuf>,
    cs: ConvShape,
) {
    assert_eq!(cs.x, xd.up2(), "upsample conv: its input {} is not the doubling of {xd}", cs.x);
    let cl = cache.layout == Layout::Ndhwc;
    let bf = cache.precision == Precision::Bf16 && [x, &*u, &*out].iter().all(|t| t.dtype() == DType::Bf16);
    if cache.up_conv && crate::conv_wgmma::fwd_fits(dev, cs, cl, bf) {
        check_lens(cs, u.len(), w.len(), out.len(), b.map_or(cs.cout, |b| b.len()));
        assert_eq!(x.len(), xd.numel(), "upsample conv: x length vs {xd}");
        let (xp, wp, wbf, reuse) = (dev.ptr(x), dev.ptr(w), w.dtype() == DType::Bf16, cache.wgmma_reuse);
        let worth = crate::conv_wgmma::worth(dev, cs.out(), cs.cout);
        let up = dev.ptr_mut(u);
        let ours = timed_choice(dev, cache, cs, (Dir::Fwd, false, true), worth, out.len(), |cache, ours, tp| {
            if ours {
                crate::conv_wgmma::run_up(dev, (xp, wp, 0, tp), wbf, cs.x, cs.cout, reuse, T_WPF);
            } else {
                crate::upsample::forward_ptrs(dev, (up, xp), xd, cl, true);
                cudnn_fwd_trial(dev, cache, cs, up, w, tp, false);
            }
        });
        if ours {
            if let Some(b) = b {
                require_f32("conv3d bias", &[b]);
            }
            *cache.fwd_calls.entry(cs).or_insert(0) += 1;
            let ptrs = (xp, wp, b.map_or(0, |b| dev.ptr(b)), dev.ptr_mut(out));
            crate::conv_wgmma::run_up(dev, ptrs, wbf, cs.x, cs.cout, reuse, T_WPF);
            cache.wgmma_runs += 1;
            cache.up_conv_runs += 1;
            return;
        }
    }
    crate::upsample::forward(dev, u, x, xd, cl);
    forward(dev, cache, (out, Accum::Overwrite), u, w, b, cs);
}

/// `Backend::upsample_conv3d_backward`: du (overwritten) = the data gradient, dw += and db += the
/// weight and bias gradients of the conv over up(x) (`cs.x` the doubling of `xd`). Where
/// `conv3d_wgmma` fits the data gradient with the window of planes (64 channels of dout, one
/// slice a block), `ConvCache::up_conv` is on and the first-use timing keeps it (against the
/// upsampling pass and cuDNN's data gradient), `conv3d_wgmma_dgrad_up` computes du and writes the
/// doubling into `u` beside it, and the weight gradient reads `u`; else x is doubled into `u` and
/// [`backward`] runs on it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn upsample_backward(
    dev: &Device,
    cache: &mut ConvCache,
    du: &mut GpuBuf,
    u: &mut GpuBuf,
    dw: &mut GpuBuf,
    db: Option<&mut GpuBuf>,
    dout: &GpuBuf,
    x: &GpuBuf,
    xd: meddpm::Dims,
    w: &GpuBuf,
    cs: ConvShape,
) {
    assert_eq!(cs.x, xd.up2(), "upsample conv backward: its input {} is not the doubling of {xd}", cs.x);
    let cl = cache.layout == Layout::Ndhwc;
    let cdt = compute_type(cache.precision);
    let yd = cs.out();
    let bf = cdt == DType::Bf16 && [x, &*u, &*du, dout].iter().all(|t| t.dtype() == DType::Bf16);
    if cache.up_conv
        && bf
        && yd.c == 64
        && cache.wgmma_reuse
        && !crate::conv_wgmma::dual_fits(cs.x.c, cache.wgmma_dual)
        && crate::conv_wgmma::fits(dev, yd, cs.k, cs.stride, cs.x.c, cl, true)
    {
        check_lens(cs, u.len(), w.len(), dout.len(), cs.cout);
        assert!(du.len() == u.len() && x.len() == xd.numel(), "upsample conv backward: du / x lengths vs {xd}");
        assert_eq!(dw.len(), cs.w_len(), "conv3d backward: dw length");
        require_f32("conv3d backward: dw", &[dw]);
        let (dyp, wp, wbf, xp, up) = (dev.ptr(dout), dev.ptr(w), w.dtype() == DType::Bf16, dev.ptr(x), dev.ptr_mut(u));
        let worth = crate::conv_wgmma::worth(dev, cs.x, cs.x.c);
        let ours = timed_choice(dev, cache, cs, (Dir::BwdData, false, true), worth, du.len(), |cache, ours, tp| {
            if ours {
                crate::conv_wgmma::run_dgrad_up(dev, (dyp, wp, tp), wbf, yd, cs.x.c, (xp, up), T_WPD);
            } else {
                cudnn_dgrad(dev, cache, tp, DType::Bf16, Accum::Overwrite, w, dyp, cs);
                crate::upsample::forward_ptrs(dev, (up, xp), xd, cl, true);
            }
        });
        if ours {
            bias_grad(dev, db, dout, yd, cl);
            crate::conv_wgmma::run_dgrad_up(dev, (dyp, wp, dev.ptr_mut(du)), wbf, yd, cs.x.c, (xp, up), T_WPD);
            cache.wgmma_runs += 1;
            cache.up_conv_runs += 1;
            weight_grad(dev, cache, dw, up, dyp, cs, (cl, cache.mma_on()));
            return;
        }
    }
    crate::upsample::forward(dev, u, x, xd, cl);
    backward(dev, cache, Some((du, Accum::Overwrite)), dw, db, dout, u, w, cs);
}

/// One cuDNN run of a forward's first-use timing: the bf16 conv of x (at `xp`) with w into the
/// scratch `tp` (added onto it where `add`); cudnnFind (first use) writes its output, the scratch.
fn cudnn_fwd_trial(dev: &Device, cache: &mut ConvCache, cs: ConvShape, xp: u64, w: &GpuBuf, tp: u64, add: bool) {
    let wc = operand(dev, w, DType::Bf16, T_W);
    let a = cache.algo(dev, Dir::Fwd, cs, xp, wc, tp);
    run_forward_beta(dev, cache, a, cs, xp, wc, tp, if add { 1.0 } else { 0.0 });
}

/// Whether [`gn_wgmma_forward`] computes the GroupNorm+SiLU → conv `cs` (accumulated or with a
/// residual where `add`) on `inp` with `groups`: `conv3d_wgmma` runs the plain conv of the shape
/// (fits, chosen or forced; the prologue only removes a pass, so it goes wherever the conv does),
/// its table fits, and `wgmma_gn` is on.
pub(crate) fn gn_wgmma_chosen(
    dev: &Device,
    cache: &mut ConvCache,
    cs: ConvShape,
    add: bool,
    (inp, w): (&GpuBuf, &GpuBuf),
    groups: usize,
) -> bool {
    let cl = cache.layout == Layout::Ndhwc;
    let bf = cache.precision == Precision::Bf16 && inp.dtype() == DType::Bf16;
    cache.wgmma_gn
        && crate::conv_wgmma::fwd_fits(dev, cs, cl, bf)
        && crate::conv_wgmma::gn_fits(cs.x, groups)
        && wgmma_fwd_chosen(dev, cache, cs, add, inp, w, cs.out().numel())
}

/// Whether a decoder ResBlock over cat(a (ca channels), b) runs without the concatenation stored
/// (`Backend::cat_conv_fusable`): in_layers' conv `cs` (over the concatenation, whose buffer `x`
/// is) on `conv3d_wgmma_fwd_gn` ([`gn_wgmma_chosen`]), both parts whole stages of 64 channels,
/// the skip conv's weight `w_skip` bf16 and its shared memory within a block's
/// ([`crate::groupnorm::cat_skip_fits`]), and `cat_free` on.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cat_free_chosen(
    dev: &Device,
    cache: &mut ConvCache,
    cs: ConvShape,
    (x, w, w_skip): (&GpuBuf, &GpuBuf, &GpuBuf),
    ca: usize,
    groups: usize,
) -> bool {
    let c = cs.x.c;
    cache.cat_free
        && ca.is_multiple_of(64)
        && ca < c
        && (c - ca).is_multiple_of(64)
        && cs.cout.is_multiple_of(64)
        && w_skip.dtype() == DType::Bf16
        && w_skip.len() == cs.cout * c
        && crate::groupnorm::cat_skip_fits(c, cs.cout)
        && gn_wgmma_chosen(dev, cache, cs, false, (x, w), groups)
}

/// out (= or += per `acc`) = conv(silu(GN(inp + off)), w) (+ b) (+ z: with `Accum::Add`, out =
/// conv + b + z) through `conv3d_wgmma_fwd_gn`, the statistics given: where
/// [`gn_wgmma_chosen`] said so. With `x2` = (b, ca) the input is cat(inp, b) at channel ca, read
/// from the two parts ([`cat_free_chosen`]). With `ystats` = (mean, rstd, off, groups) also the
/// GroupNorm statistics of out + off as stored (the final values, accumulated or not), from the epilogue's
/// per-item partials ([`crate::groupnorm::finalize_stats_counted`]): no pass reads `out` for them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gn_wgmma_forward(
    dev: &Device,
    cache: &mut ConvCache,
    (out, acc): (&mut GpuBuf, Accum),
    (inp, off): (&GpuBuf, Option<&GpuBuf>),
    x2: Option<(&GpuBuf, usize)>,
    (mean, rstd): (&GpuBuf, &GpuBuf),
    (gamma, beta): (&GpuBuf, &GpuBuf),
    (w, b, z): (&GpuBuf, Option<&GpuBuf>, Option<&GpuBuf>),
    cs: ConvShape,
    groups: usize,
    ystats: Option<YStats>,
) {
    let x = cs.x;
    let inp_len = match x2 {
        Some((b2, ca)) => {
            let vox = x.n * x.s();
            assert!(
                inp.len() == vox * ca && b2.len() == vox * (x.c - ca) && b2.dtype() == DType::Bf16,
                "conv3d_wgmma_fwd_gn {cs:?} from parts at channel {ca}: lengths {} and {} (expected {} and {})",
                inp.len(),
                b2.len(),
                vox * ca,
                vox * (x.c - ca)
            );
            x.numel()
        }
        None => inp.len(),
    };
    check_lens(cs, inp_len, w.len(), out.len(), b.map_or(cs.cout, |b| b.len()));
    let ng = x.n * groups;
    assert!(
        out.dtype() == DType::Bf16
            && z.is_none_or(|z| z.len() == out.len() && z.dtype() == DType::Bf16 && acc == Accum::Add)
            && gamma.len() == x.c
            && beta.len() == x.c
            && mean.len() == ng
            && rstd.len() == ng
            && off.is_none_or(|o| o.len() == x.n * x.c && o.dtype() == DType::F32),
        "conv3d_wgmma_fwd_gn {cs:?} groups {groups}: operand lengths or types (out {} {:?}, gamma {}, mean {}, \
         off {:?})",
        out.len(),
        out.dtype(),
        gamma.len(),
        mean.len(),
        off.map(|o| o.len())
    );
    if let Some(b) = b {
        require_f32("conv3d bias", &[b]);
    }
    *cache.fwd_calls.entry(cs).or_insert(0) += 1;
    let reuse = cache.wgmma_reuse;
    let gn = crate::conv_wgmma::GnPro {
        mean: dev.ptr(mean),
        rstd: dev.ptr(rstd),
        gamma: dev.ptr(gamma),
        beta: dev.ptr(beta),
        off: off.map_or(0, |o| dev.ptr(o)),
        groups,
        x2: x2.map_or(0, |(b2, _)| dev.ptr(b2)),
        ca: x2.map_or(0, |(_, ca)| ca),
        ys: 0,
    };
    let (bp, zp) = (b.map_or(0, |b| dev.ptr(b)), z.map_or(0, |z| dev.ptr(z)));
    let ptrs = (dev.ptr(inp), dev.ptr(w), bp, dev.ptr_mut(out), zp);
    let wbf = w.dtype() == DType::Bf16;
    // with ystats the output's statistics: per column item, finalized after the conv
    let items = crate::conv_wgmma::items(dev, x);
    let part = ystats.as_ref().map(|_| dev.scratch(items * cs.cout * 3));
    let gn = crate::conv_wgmma::GnPro { ys: part.as_ref().map_or(0, |p| dev.ptr(&**p)), ..gn };
    let modes = (reuse, false, crate::conv_wgmma::Up::No);
    crate::conv_wgmma::run_gn(dev, ptrs, wbf, x, cs.cout, acc, false, Some(gn), modes, T_WPF);
    if let (Some((ym, yr, yoff, yg)), Some(part)) = (ystats, part) {
        let od = cs.out();
        crate::groupnorm::finalize_stats_counted(dev, dev.ptr(&*part), yoff, (ym, yr), od, yg, items / x.n);
        cache.wgmma_ystats_runs += 1;
    }
    cache.wgmma_runs += 1;
    cache.wgmma_gn_runs += 1;
}

/// Where [`gn_wgmma_forward`] also takes the GroupNorm statistics of its output (+ an offset):
/// mean, rstd [N·G], the offset [N·Cout] and G.
pub(crate) type YStats<'a> = (&'a mut GpuBuf, &'a mut GpuBuf, Option<&'a GpuBuf>, usize);

/// The forward on operands already in the compute type.
fn forward_typed(dev: &Device, cache: &mut ConvCache, cs: ConvShape, xp: u64, wp: u64, bp: u64, yp: u64) {
    if let Some(pcs) = padded_shape(cs) {
        let decided = cache.force_pad.or_else(|| cache.pads.get(&cs).and_then(|p| p.on));
        let on = match decided {
            Some(on) => on,
            None => {
                // time both (third of three runs each, the first ones include cudnnFind) and keep the faster
                let mut t = [f32::INFINITY; 2];
                for (i, padded) in [false, true].into_iter().enumerate() {
                    for _ in 0..3 {
                        t[i] = stream_ms(dev, || {
                            if padded {
                                forward_padded(dev, cache, cs, pcs, xp, wp, bp, yp);
                            } else {
                                forward_plain(dev, cache, cs, xp, wp, bp, yp, None);
                            }
                        });
                    }
                }
                let on = t[1] < t[0];
                if conv_log() {
                    eprintln!(
                        "meddpm-cuda conv {} -> {} k{} s{}: channel-padded {:.3} ms, plain {:.3} ms",
                        cs.x, cs.cout, cs.k, cs.stride, t[1], t[0]
                    );
                }
                cache.pads.get_mut(&cs).expect("created by forward_padded").on = Some(on);
                on
            }
        };
        if on {
            forward_padded(dev, cache, cs, pcs, xp, wp, bp, yp);
            return;
        }
    }
    forward_plain(dev, cache, cs, xp, wp, bp, yp, None);
}

/// Channel counts that keep cuDNN off its tensor-core kernels (Cin = 3 of the first conv, Cout = 1
/// of the last) are padded with zeros to a multiple of 8: the shape to run instead, if any.
fn padded_shape(cs: ConvShape) -> Option<ConvShape> {
    let up = |c: usize| if c.is_multiple_of(4) { c } else { c.next_multiple_of(8) };
    let (cin, cout) = (up(cs.x.c), up(cs.cout));
    (cin != cs.x.c || cout != cs.cout).then(|| ConvShape::new(cs.x.with_c(cin), cout, cs.k, cs.stride))
}

/// Scratch of a channel-padded forward: the padded input (when Cin is padded), weights, and output
/// (when Cout is padded), in the compute type; allocated on the first call of the shape, reused after.
struct Pad {
    x: Option<GpuBuf>,
    w: GpuBuf,
    y: Option<GpuBuf>,
    /// Whether the padded run is the faster one (None: not timed yet).
    on: Option<bool>,
}

/// out = conv(inp, w) + b through the zero-padded shape `pcs`: the padded channels of the input and
/// the padded rows/columns of the weights are 0, so the real output channels are the same sums; the
/// bias is added while copying the real channels out.
#[allow(clippy::too_many_arguments)]
fn forward_padded(
    dev: &Device,
    cache: &mut ConvCache,
    cs: ConvShape,
    pcs: ConvShape,
    xp: u64,
    wp: u64,
    bp: u64,
    yp: u64,
) {
    let cl = cache.layout == Layout::Ndhwc;
    let cdt = compute_type(cache.precision);
    let pad = match cache.pads.entry(cs) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => {
            let a = |n: usize| dev.alloc(n, cdt).unwrap_or_else(|e| panic!("{e}"));
            e.insert(Pad {
                x: (pcs.x.c != cs.x.c).then(|| a(pcs.x.numel())),
                w: a(pcs.w_len()),
                y: (pcs.cout != cs.cout).then(|| a(pcs.out().numel())),
                on: None,
            })
        }
    };
    let k3 = cs.k * cs.k * cs.k;
    // weights (Cout, Cin, k³) as an activation with N = Cout: pad both
    let pw = dev.ptr_mut(&mut pad.w);
    let bf = (cdt == DType::Bf16) as i32;
    pad_nc(dev, pw, wp, cs.cout, pcs.cout, cs.x.c, pcs.x.c, k3 as i64, cl, bf);
    let px = match &mut pad.x {
        Some(b) => {
            let p = dev.ptr_mut(b);
            pad_nc(dev, p, xp, cs.x.n, cs.x.n, cs.x.c, pcs.x.c, cs.x.s() as i64, cl, bf);
            p
        }
        None => xp,
    };
    let py = pad.y.as_mut().map(|b| dev.ptr_mut(b));
    let a = cache.algo(dev, Dir::Fwd, pcs, px, pw, py.unwrap_or(yp));
    match py {
        Some(py) => {
            run_forward(dev, cache, a, pcs, false, px, pw, 0, py, cl, false, None);
            let o = cs.out();
            dev.launch1(
                "unpad_c_bias",
                o.numel(),
                &[
                    Arg::P(yp),
                    Arg::P(py),
                    Arg::P(bp),
                    Arg::I(o.c as i32),
                    Arg::I(pcs.cout as i32),
                    Arg::L(o.s() as i64),
                    Arg::L(o.numel() as i64),
                    Arg::I(cl as i32),
                    Arg::I(bf | (bf << 1)),
                ],
            );
        }
        None => {
            run_forward(dev, cache, a, pcs, false, px, pw, bp, yp, cl, true, None);
        }
    }
}

/// dst (Np, Cp, S) = src (N, C, S) zero-padded, both of the type `bf` says.
#[allow(clippy::too_many_arguments)]
fn pad_nc(dev: &Device, dst: u64, src: u64, n: usize, np: usize, c: usize, cp: usize, s: i64, cl: bool, bf: i32) {
    let total = np as i64 * cp as i64 * s;
    dev.launch1(
        "pad_nc",
        total as usize,
        &[
            Arg::P(dst),
            Arg::P(src),
            Arg::I(n as i32),
            Arg::I(c as i32),
            Arg::I(cp as i32),
            Arg::L(s),
            Arg::L(total),
            Arg::I(cl as i32),
            Arg::I(bf | (bf << 1)),
        ],
    );
}

/// The unpadded forward y = conv(x, w) + b (+ z where given, a tensor of y's dims and type):
/// cuDNN with the bias (and z) fused, or cuDNN's conv then our bias kernel (chosen by timing).
#[allow(clippy::too_many_arguments)]
fn forward_plain(
    dev: &Device,
    cache: &mut ConvCache,
    cs: ConvShape,
    xp: u64,
    wp: u64,
    bp: u64,
    yp: u64,
    z: Option<u64>,
) {
    let a = cache.algo(dev, Dir::Fwd, cs, xp, wp, yp);
    let cl = cache.layout == Layout::Ndhwc;
    let r = z.is_some() as usize;
    let can_fuse = a.id == nsys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM as u32;
    let fused = match (can_fuse, cache.force_fused_bias, cache.plan(cs).fused_bias[r]) {
        (false, _, _) => false,
        (true, Some(f), _) => f,
        (true, None, Some(f)) => f,
        (true, None, None) => {
            // time both variants (second of two runs each) and keep the faster
            let mut t = [f32::INFINITY; 2];
            for f in [false, true] {
                for _ in 0..2 {
                    let mut ok = true;
                    let ms = stream_ms(dev, || ok = run_forward(dev, cache, a, cs, f, xp, wp, bp, yp, cl, true, z));
                    t[f as usize] = if ok { ms } else { f32::INFINITY };
                    if !ok {
                        break;
                    }
                }
            }
            let f = t[1] < t[0];
            if conv_log() {
                eprintln!(
                    "meddpm-cuda conv {} -> {} k{} s{}{}: bias fused into cuDNN {:.3} ms, separate {:.3} ms: {}",
                    cs.x,
                    cs.cout,
                    cs.k,
                    cs.stride,
                    if z.is_some() { " + residual" } else { "" },
                    t[1],
                    t[0],
                    if f { "fused" } else { "separate" }
                );
            }
            cache.plan(cs).fused_bias[r] = Some(f);
            f
        }
    };
    if !run_forward(dev, cache, a, cs, fused, xp, wp, bp, yp, cl, true, z) {
        if conv_log() {
            eprintln!("meddpm-cuda conv {} -> {} k{}: cuDNN refused the fused bias call", cs.x, cs.cout, cs.k);
        }
        cache.plan(cs).fused_bias[r] = Some(false);
        run_forward(dev, cache, a, cs, false, xp, wp, bp, yp, cl, true, z);
    }
}

/// One forward y = conv(x, w) (+ b where `bias`) (+ z where given): fused conv+bias(+z) through
/// cuDNN (y = conv + 1·z + b; under bf16 the f32 bias is rounded to bf16 first, as cuDNN takes it
/// in the output's type and PyTorch's autocast rounds it), or our bias kernel (onto z first where
/// given) and cuDNN's conv (β = 1 onto it). Returns false when cuDNN refuses the fused call (the
/// caller falls back).
#[allow(clippy::too_many_arguments)]
fn run_forward(
    dev: &Device,
    cache: &mut ConvCache,
    a: Algo,
    cs: ConvShape,
    fused: bool,
    xp: u64,
    wp: u64,
    bp: u64,
    yp: u64,
    cl: bool,
    bias: bool,
    z: Option<u64>,
) -> bool {
    let cdt = compute_type(cache.precision);
    let bf = (cdt == DType::Bf16) as i32;
    if fused {
        let bp = if cdt == DType::Bf16 {
            let t = dev.temp(cs.cout, DType::Bf16, T_B);
            dev.cast(t, DType::Bf16, bp, DType::F32, cs.cout, false);
            t
        } else {
            bp
        };
        let act = cache.identity.0;
        let p = cache.plan(cs);
        let ws = dev.workspace(a.ws);
        let wsp = ws_ptr(dev, &ws);
        let (one, alpha2) = (1.0f32, if z.is_some() { 1.0f32 } else { 0.0 });
        dev.bind();
        let st = unsafe {
            nsys::cudnnConvolutionBiasActivationForward(
                dev.cudnn.0,
                &one as *const f32 as _,
                p.x.0,
                xp as _,
                p.w.0,
                wp as _,
                p.conv[0].0,
                fwd_algo(a.id),
                wsp as _,
                a.ws,
                &alpha2 as *const f32 as _,
                p.y.0,
                z.unwrap_or(yp) as _,
                p.bias.0,
                bp as _,
                act,
                p.y.0,
                yp as _,
            )
        };
        if st != nsys::cudnnStatus_t::CUDNN_STATUS_SUCCESS && conv_log() {
            eprintln!(
                "meddpm-cuda conv {} -> {} k{}: cudnnConvolutionBiasActivationForward: {st:?}",
                cs.x, cs.cout, cs.k
            );
        }
        return st == nsys::cudnnStatus_t::CUDNN_STATUS_SUCCESS;
    }
    match z {
        Some(zp) => {
            assert!(bias, "conv3d forward with a residual: the bias pass writes z + b first");
            crate::elementwise::add_channel_bias_to(dev, yp, zp, bp, cs.out(), cl, false, bf);
            run_forward_beta(dev, cache, a, cs, xp, wp, yp, 1.0);
        }
        None => {
            run_forward_beta(dev, cache, a, cs, xp, wp, yp, 0.0);
            if bias {
                crate::elementwise::add_channel_bias(dev, yp, bp, cs.out(), cl, false, bf);
            }
        }
    }
    true
}

/// y = conv(x, w) + β·y through cudnnConvolutionForward with algorithm `a`.
#[allow(clippy::too_many_arguments)]
fn run_forward_beta(dev: &Device, cache: &mut ConvCache, a: Algo, cs: ConvShape, xp: u64, wp: u64, yp: u64, beta: f32) {
    let p = cache.plan(cs);
    let ws = dev.workspace(a.ws);
    let wsp = ws_ptr(dev, &ws);
    let one = 1.0f32;
    dev.bind();
    ck(
        unsafe {
            nsys::cudnnConvolutionForward(
                dev.cudnn.0,
                &one as *const f32 as _,
                p.x.0,
                xp as _,
                p.w.0,
                wp as _,
                p.conv[0].0,
                fwd_algo(a.id),
                wsp as _,
                a.ws,
                &beta as *const f32 as _,
                p.y.0,
                yp as _,
            )
        },
        "cudnnConvolutionForward",
    );
}

fn ws_ptr(dev: &Device, ws: &cudarc::driver::CudaSlice<u8>) -> u64 {
    use cudarc::driver::DevicePtr;
    let (p, _g) = ws.device_ptr(&dev.stream);
    p
}

fn check_lens(cs: ConvShape, x: usize, w: usize, y: usize, b: usize) {
    assert!(
        x == cs.x.numel() && w == cs.w_len() && y == cs.out().numel() && b == cs.cout,
        "conv3d {} -> {} k{} s{}: buffer lengths x {x} w {w} y {y} b {b}, expected {} {} {} {}",
        cs.x,
        cs.cout,
        cs.k,
        cs.stride,
        cs.x.numel(),
        cs.w_len(),
        cs.out().numel(),
        cs.cout
    );
}

/// Whether the weight gradient goes to our kernel (kernels/conv3d.cu) instead of cuDNN: 3×3×3,
/// stride 1, at most 4 output channels — cuDNN 9.19 runs these on a slow sm80 kernel (13.2 of
/// 185 ms in a whole-head TF32 training step on the H200).
/// In bf16 the kernel exists for Cout 1 and 4 only (kernels/conv3d.cu).
pub(crate) fn small_cout_wgrad(cs: ConvShape, cdt: DType) -> bool {
    cs.k == 3 && cs.stride == 1 && (cs.cout <= 4 && (cdt == DType::F32 || cs.cout == 1 || cs.cout == 4))
}

/// dW += the weight gradient of a few-output-channel conv (kernels/conv3d.cu), fp32 in every
/// precision mode. `(cl, mma)`: NDHWC, and the tensor-core stage 1 asked for (bf16 precision and
/// `ConvCache::small_mma`): it runs where Cout is 1 or 4 and Cin is a multiple of 16.
#[allow(clippy::too_many_arguments)]
fn wgrad_small(dev: &Device, dw: &mut GpuBuf, xp: u64, dyp: u64, bf: i32, cs: ConvShape, (cl, mma): (bool, bool)) {
    use Arg::{I, P};
    let x = cs.x;
    if cl && mma && bf == 1 && (cs.cout == 1 || cs.cout == 4) && x.c.is_multiple_of(16) {
        // 8-channel chunks of x a block (kernels/conv3d.cu wgrad_small_mma's NT), and the
        // channel groups they make (grid.y)
        let (name, nt) = if cs.cout == 1 { ("conv3d_wgrad_small1_mma", 8) } else { ("conv3d_wgrad_small4_mma", 2) };
        let groups = x.c.div_ceil(nt * 8);
        let tiles = x.n * x.d * x.h.div_ceil(8) * x.w.div_ceil(32);
        // persistent blocks, two per SM over all groups; a chunk of partial sums per warp (8 a block)
        let blocks = tiles.min((dev.info.sms as usize * 2).div_ceil(groups)).max(1);
        let nchunks = blocks * 8;
        let part = dev.scratch(nchunks * x.c * cs.cout * 27);
        let pp = dev.ptr(&*part);
        let dims = [x.n, x.c, x.d, x.h, x.w].map(|v| I(v as i32));
        let args = [P(xp), P(dyp), P(pp), dims[0], dims[1], dims[2], dims[3], dims[4]];
        dev.launch(name, (blocks as u32, groups as u32, 1), (256, 1, 1), &args);
        dev.launch(
            "conv3d_wgrad_small_finalize",
            ((cs.cout * 27 * x.c) as u32, 1, 1),
            (256, 1, 1),
            &[P(pp), P(dev.ptr_mut(dw)), I(x.c as i32), I(cs.cout as i32), I(nchunks as i32), I(1)],
        );
        return;
    }
    // channels per block and line slots per block (kernels/conv3d.cu); NDHWC threads take 4 lines each
    let cg = if cl { x.c.min(64) } else { 1 };
    let rows = 256 / cg;
    let lines_per_block = if cl { rows * 4 } else { rows };
    let nchunks = (x.n * x.d * x.h).div_ceil(lines_per_block).max(1);
    let groups = x.c.div_ceil(cg);
    let per = cs.cout * 27;
    let part = dev.scratch(nchunks * x.c * per);
    let pp = dev.ptr(&*part);
    let args = [
        P(xp),
        P(dyp),
        P(pp),
        I(x.n as i32),
        I(x.c as i32),
        I(x.d as i32),
        I(x.h as i32),
        I(x.w as i32),
        I(lines_per_block as i32),
        I(cl as i32),
        I(bf),
    ];
    let name =
        ["conv3d_wgrad_small1", "conv3d_wgrad_small2", "conv3d_wgrad_small3", "conv3d_wgrad_small4"][cs.cout - 1];
    dev.launch(name, (nchunks as u32, groups as u32, 1), (256, 1, 1), &args);
    dev.launch(
        "conv3d_wgrad_small_finalize",
        ((per * x.c) as u32, 1, 1),
        (256, 1, 1),
        &[P(pp), P(dev.ptr_mut(dw)), I(x.c as i32), I(cs.cout as i32), I(nchunks as i32), I(cl as i32)],
    );
}

/// Whether the weight gradient of a few-input-channel conv (the U-Net's first: 3 → 64
/// whole-head, 8 → 64 BraTS) goes to our tensor-core kernel instead of cuDNN (which pads the
/// input to 8 channels and runs an sm80 kernel): 3×3×3, stride 1, Cin ≤ 8, Cout 16, 32 or 64
/// (a power-of-two count of 16-byte chunks a voxel: the kernel's swizzle), bf16 NDHWC with the
/// tensor-core few-channel kernels on (`ConvCache::small_mma`).
pub(crate) fn small_cin_wgrad(cs: ConvShape, cdt: DType, (cl, mma): (bool, bool)) -> bool {
    cl && mma && cdt == DType::Bf16 && cs.k == 3 && cs.stride == 1 && cs.x.c <= 8 && matches!(cs.cout, 16 | 32 | 64)
}

/// dW += the weight gradient of a few-input-channel conv on the tensor cores
/// (`conv3d_wgrad_small_cin_mma`, then `conv3d_wgrad_small_finalize`; kernels/conv3d.cu).
fn wgrad_small_cin(dev: &Device, dw: &mut GpuBuf, xp: u64, dyp: u64, cs: ConvShape) {
    use Arg::{I, P};
    let x = cs.x;
    let tiles = x.n * x.d * x.h.div_ceil(8) * x.w.div_ceil(32);
    // persistent blocks, two per SM (161 registers a thread); warps: 3 tap planes per pair of
    // 16-channel output tiles; a chunk of partial sums per block
    let warps = 3 * cs.cout.div_ceil(32);
    let blocks = tiles.min(dev.info.sms as usize * 2).max(1);
    let part = dev.scratch(blocks * x.c * cs.cout * 27);
    let pp = dev.ptr(&*part);
    let dims = [x.n, x.c, cs.cout, x.d, x.h, x.w].map(|v| I(v as i32));
    let args = [P(xp), P(dyp), P(pp), dims[0], dims[1], dims[2], dims[3], dims[4], dims[5]];
    dev.launch("conv3d_wgrad_small_cin_mma", (blocks as u32, 1, 1), ((32 * warps) as u32, 1, 1), &args);
    dev.launch(
        "conv3d_wgrad_small_finalize",
        ((cs.cout * 27 * x.c) as u32, 1, 1),
        (256, 1, 1),
        &[P(pp), P(dev.ptr_mut(dw)), I(x.c as i32), I(cs.cout as i32), I(blocks as i32), I(1)],
    );
}

// ---- few-channel direct convolutions (kernels/conv3d.cu) ------------------------------------------

/// Voxels per thread, output channels per thread of conv3d_small_cin's body, and input channels
/// per shared-memory chunk of conv3d_fwd_small_cout* (kernels/conv3d.cu SC_V, SC_COT, SC_CC).
const SC_V: usize = 4;
const SC_COT: usize = 8;
const SC_CC: usize = 64;
/// The most channels on the wide side of our few-channel kernels.
const SMALL_MAX_C: usize = 1024;

/// Which of our direct forward kernels applies to a conv.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SmallFwd {
    /// Cin ≤ 4: conv3d_fwd_small_cin (a thread: 4 voxels × 8 output channels).
    Cin,
    /// Cout ≤ 4: conv3d_fwd_small_cout1 (Cout 1) or conv3d_fwd_small_cout4 (Cout 2 to 4).
    Cout,
}

/// The direct forward kernel that can run `cs`, if any: 3×3×3, stride 1, Cin ≤ 4 (then Cout ≤ 1024)
/// or else Cout ≤ 4 (then Cin ≤ 1024).
pub(crate) fn small_fwd_kind(cs: ConvShape) -> Option<SmallFwd> {
    if cs.k != 3 || cs.stride != 1 || cs.x.c == 0 || cs.cout == 0 {
        return None;
    }
    if cs.x.c <= 4 && cs.cout <= SMALL_MAX_C {
        Some(SmallFwd::Cin)
    } else if cs.cout <= 4 && cs.x.c <= SMALL_MAX_C {
        Some(SmallFwd::Cout)
    } else {
        None
    }
}

/// Whether our direct kernel can compute the data gradient of `cs`: 3×3×3, stride 1, Cout ≤ 4,
/// Cin ≤ 1024 (conv3d_dgrad_small_cout: the small-Cin forward body on the transposed, flipped
/// weights).
pub(crate) fn small_dgrad(cs: ConvShape) -> bool {
    cs.k == 3 && cs.stride == 1 && (1..=4).contains(&cs.cout) && (1..=SMALL_MAX_C).contains(&cs.x.c)
}

/// The kernels' per-pointer type mask: bit 0 the input (x or dy), bit 1 the weights, bit 2 the
/// output (y or dx); a bit is set for bf16.
fn small_dt(input: DType, w: DType, out: DType) -> i32 {
    let b = |d: DType| (d == DType::Bf16) as i32;
    b(input) | (b(w) << 1) | (b(out) << 2)
}

/// Voxel groups of a volume (kernels/conv3d.cu `vgroup`): SC_V consecutive voxels of a line.
fn voxel_groups(x: Dims) -> usize {
    x.n * x.d * x.h * x.w.div_ceil(SC_V)
}

/// Grid and block of conv3d_fwd_small_cin / conv3d_dgrad_small_cout for a direct conv with
/// `cout` outputs over volume `x`: one warp per SC_COT output channels (up to 8 warps), grid y
/// over blocks of channels, grid x over 32 voxel groups a block (grid-stride, about 8 blocks per SM).
fn small_cin_launch(x: Dims, cout: usize, sms: u32) -> ((u32, u32, u32), (u32, u32, u32)) {
    let warps = cout.div_ceil(SC_COT).clamp(1, 8);
    let gy = cout.div_ceil(warps * SC_COT).max(1);
    let gx = voxel_groups(x).div_ceil(32).min((sms as usize * 8 / gy).max(1)).max(1);
    ((gx as u32, gy as u32, 1), ((32 * warps) as u32, 1, 1))
}

/// Grid and block of conv3d_fwd_small_cout*: 256 threads; a voxel group is one thread (NCDHW) or
/// SC_CC / VEC lanes (NDHWC, VEC = 8 bf16 / 4 f32 input channels a lane).
fn small_cout_launch(x: Dims, cl: bool, xdt: DType, sms: u32) -> ((u32, u32, u32), (u32, u32, u32)) {
    let vec = if xdt == DType::Bf16 { 8 } else { 4 };
    let per_block = if cl { 256 / (SC_CC / vec) } else { 256 };
    let gx = voxel_groups(x).div_ceil(per_block).min(sms as usize * 8).max(1);
    ((gx as u32, 1, 1), (256, 1, 1))
}

/// Whether the tensor-core kernels (`conv3d_fwd_small_cin_mma`, `conv3d_dgrad_small_cout_mma`)
/// compute a few-channel conv of `ci` ≤ 8 inputs and `co` outputs (the forward's, or the data
/// gradient's with the roles swapped): NDHWC, `co` a multiple of 8 up to 64, asked for (`mma`:
/// bf16 precision and `ConvCache::small_mma`). Cin 5 to 8 (BraTS' first conv, 8 → 64) has no
/// FMA twin: there the choice is these kernels or cuDNN.
fn mma_fits(cl: bool, mma: bool, ci: usize, co: usize) -> bool {
    cl && mma && (1..=8).contains(&ci) && co.is_multiple_of(8) && co <= 64
}

/// Dynamic shared memory of [`small_mma_run`]'s kernels for `ci` input channels (kernels/conv3d.cu
/// `small_mma_smem`): the bias (64 f32), the staging (8 warps × 16 rows × 36 f32), the ring of
/// four 180-voxel halo planes (4 or 8 bf16 channels a voxel), the B fragments (7 or 14 k steps ×
/// 8 n tiles × 32 lanes × 8 bytes).
fn small_mma_smem(ci: usize) -> u32 {
    let cip: usize = if ci <= 4 { 4 } else { 8 };
    let ksteps = (27 * cip).div_ceil(16);
    (64 * 4 + 8 * 16 * 36 * 4 + 4 * 180 * (cip / 2) * 4 + ksteps * 8 * 32 * 8) as u32
}

/// The few-channel forward that runs `cs` in a backend with NDHWC `cl` and tensor-core kernels
/// `mma`: [`small_fwd_kind`]'s, or the tensor-core Cin kernel for Cin 5 to 8 where it fits.
fn small_fwd_kind_in(cs: ConvShape, (cl, mma): (bool, bool)) -> Option<SmallFwd> {
    small_fwd_kind(cs)
        .or_else(|| (cs.k == 3 && cs.stride == 1 && mma_fits(cl, mma, cs.x.c, cs.cout)).then_some(SmallFwd::Cin))
}

/// `conv3d_fwd_small_cin_mma` (`tw` false) / `conv3d_dgrad_small_cout_mma` (`tw` true): y (= or +=
/// per `acc`) = conv of `ci`-channel x to `co` channels (+ b where `bp` ≠ 0) over volume `x`; the
/// data gradient's w are the weights of the conv with `ci` outputs. Persistent blocks,
/// [`SMALL_MMA_BLOCKS`] per SM, over work items of 8 (h) × 16 (w) voxels × `dc` planes
/// ([`small_mma_items`]).
#[allow(clippy::too_many_arguments)]
fn small_mma_run(
    dev: &Device,
    (xp, wp, bp, yp): (u64, u64, u64, u64),
    x: Dims,
    ci: usize,
    co: usize,
    dt: i32,
    acc: Accum,
    tw: bool,
) {
    use Arg::{I, P};
    let (dc, grid) = small_mma_items(x, dev.info.sms as usize * SMALL_MMA_BLOCKS);
    let args = [
        P(xp),
        P(wp),
        P(bp),
        P(yp),
        I(x.n as i32),
        I(ci as i32),
        I(co as i32),
        I(x.d as i32),
        I(x.h as i32),
        I(x.w as i32),
        I(dc as i32),
        I(dt),
        I((acc == Accum::Add) as i32),
    ];
    let name = if tw { "conv3d_dgrad_small_cout_mma" } else { "conv3d_fwd_small_cin_mma" };
    dev.launch_shared(name, (grid as u32, 1, 1), (256, 1, 1), small_mma_smem(ci), &args);
}

/// Dynamic shared memory of `conv3d_fwd_gn_small_cout` for `co` outputs (kernels/conv3d.cu):
/// silu(GN(x)) of a 192-row halo plane (bf16, rows of 72), the tap products of 180 rows (f32,
/// rows of nk·8 + 4), the weights' B fragments (kg groups × 4 k steps × nk n tiles × 32 lanes × 8
/// bytes), the per-channel (scale, shift); the 27 taps in kg = 1 group for co ≤ 2, else 3, and
/// nk = ⌈taps a group · co / 8⌉.
fn gn_head_smem(co: usize) -> u32 {
    let kg = if co <= 2 { 1 } else { 3 };
    let nk = (27 / kg * co).div_ceil(8);
    (192 * 72 * 2 + 180 * (nk * 8 + 4) * 4 + kg * 4 * nk * 32 * 8 + 64 * 8) as u32
}

/// The output head's GN → SiLU → Conv3 after its statistics (mean/rstd, N·G): `out` =
/// conv3d(silu(GN(inp)), w) + b in one pass over `inp` (`conv3d_fwd_gn_small_cout`; shapes per
/// [`ConvCache::gn_head_fits`]). Work items as [`small_mma_run`]'s, two blocks per SM.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gn_head_forward(
    dev: &Device,
    out: &mut GpuBuf,
    inp: &GpuBuf,
    (mean, rstd): (&GpuBuf, &GpuBuf),
    (gamma, beta): (&GpuBuf, &GpuBuf),
    (w, b): (&GpuBuf, &GpuBuf),
    cs: ConvShape,
    groups: usize,
) {
    use Arg::{I, P};
    check_lens(cs, inp.len(), w.len(), out.len(), b.len());
    require_f32("conv3d bias", &[b]);
    assert!(inp.dtype() == DType::Bf16 && cs.x.c == 64 && (1..=4).contains(&cs.cout), "gn_head_forward {cs:?}");
    let ng = cs.x.n * groups;
    assert!(
        gamma.len() == 64 && beta.len() == 64 && mean.len() == ng && rstd.len() == ng,
        "gn_head_forward {cs:?} groups {groups}: lengths gamma {} beta {} mean {} rstd {}",
        gamma.len(),
        beta.len(),
        mean.len(),
        rstd.len()
    );
    let x = cs.x;
    let (dc, grid) = small_mma_items(x, dev.info.sms as usize * 2);
    let dt = ((w.dtype() == DType::Bf16) as i32) << 1 | ((out.dtype() == DType::Bf16) as i32) << 2;
    let args = [
        P(dev.ptr(inp)),
        P(dev.ptr(mean)),
        P(dev.ptr(rstd)),
        P(dev.ptr(gamma)),
        P(dev.ptr(beta)),
        I(groups as i32),
        P(dev.ptr(w)),
        P(dev.ptr(b)),
        P(dev.ptr_mut(out)),
        I(x.n as i32),
        I(cs.cout as i32),
        I(x.d as i32),
        I(x.h as i32),
        I(x.w as i32),
        I(dc as i32),
        I(dt),
    ];
    dev.launch_shared("conv3d_fwd_gn_small_cout", (grid as u32, 1, 1), (256, 1, 1), gn_head_smem(cs.cout), &args);
}

/// Resident blocks per SM of the two kernels of [`small_mma_run`]: their `__launch_bounds__`.
const SMALL_MMA_BLOCKS: usize = 3;

/// Planes of d a work item of [`small_mma_run`] walks, and its grid (at most `slots` persistent
/// blocks): the item is a column of 8 × 16 voxels cut into chunks of `dc` planes, each chunk
/// loading two halo planes beyond its own. `dc` minimises the planes the busiest block walks,
/// rounds of items × (`dc` + 1), with at least 4 planes (fewer only where D is smaller), so the
/// ring of halo planes is exercised even on the tests' small volumes.
fn small_mma_items(x: Dims, slots: usize) -> (usize, usize) {
    col_items(x, slots, (8, 16))
}

/// [`small_mma_items`] for columns of `th` × `tw` voxels (kernels/conv3d.cu `col_grid`; the
/// warpgroup-MMA conv's are 32 × 8).
pub(crate) fn col_items(x: Dims, slots: usize, (th, tw): (usize, usize)) -> (usize, usize) {
    let cols = x.n * x.h.div_ceil(th) * x.w.div_ceil(tw);
    let items = |dc: usize| cols * x.d.div_ceil(dc);
    let cost = |dc: usize| items(dc).div_ceil(slots.min(items(dc)).max(1)) * (dc + 1);
    let dc = (x.d.min(4)..=x.d).min_by_key(|&dc| (cost(dc), dc)).unwrap_or(1).max(1);
    (dc, items(dc).min(slots).max(1))
}

/// Planes per slab of [`small_cout_gemm`]: its tap products (27·Cout f32 per voxel, two halo
/// planes included) stay within `budget` bytes (`ConvCache::small_gemm_budget`, 64 MiB), but a
/// slab has at least 8 planes (the halo planes are read twice).
fn gemm_slab(x: Dims, co: usize, budget: usize) -> usize {
    let plane = 27 * co * x.h * x.w * 4;
    (budget / plane).saturating_sub(2).max(8).min(x.d)
}

/// out = conv(inp, w) + b of a Cout ≤ 4, 3×3×3, stride-1 conv in NDHWC as a GEMM and a tap sum
/// (used for Cout = 1, see `ConvCache::small_gemm`):
/// per slab of planes (one halo plane each side) cuBLAS forms every voxel's 27·Cout tap products
/// P[co·27 + t][u] = Σ_ci w[co, t, ci]·x[u, ci] (f32, in the input's type: bf16 tensor cores, or
/// f32 with TF32 as the precision allows), then `conv3d_small_cout_taps` adds the 27 products that
/// land on each output, plus the bias. Reads x about once (the direct kernel reads each input row
/// 13.5 times through the caches) at the price of P written and read once.
fn small_cout_gemm(dev: &Device, out: &mut GpuBuf, inp: &GpuBuf, w: &GpuBuf, b: &GpuBuf, cs: ConvShape, budget: usize) {
    use Arg::{I, L, P};
    let (x, co) = (cs.x, cs.cout);
    let dt = inp.dtype();
    let (xp, wp) = (dev.ptr(inp), operand(dev, w, dt, T_W));
    let hw = x.h * x.w;
    let pd = gemm_slab(x, co, budget);
    let pp = dev.temp(27 * co * (pd + 2).min(x.d) * hw, DType::F32, T_P);
    let (bp, yp, ybf) = (dev.ptr(b), dev.ptr_mut(out), (out.dtype() == DType::Bf16) as i32);
    for n in 0..x.n {
        let mut d0 = 0;
        while d0 < x.d {
            let d1 = (d0 + pd).min(x.d);
            let (h0, h1) = (d0.saturating_sub(1), (d1 + 1).min(x.d));
            let m = (h1 - h0) * hw;
            let a = xp + ((n * x.s() + h0 * hw) * x.c * dt.bytes()) as u64;
            crate::linear::gemm_ex(dev, (m, 27 * co, x.c), (a, true, x.c), (wp, false, x.c), dt, pp, m, 0.0);
            let vox = (d1 - d0) * hw;
            dev.launch(
                "conv3d_small_cout_taps",
                (vox.div_ceil(256) as u32, 1, 1),
                (256, 1, 1),
                &[
                    P(pp),
                    P(bp),
                    P(yp),
                    I(ybf),
                    I(co as i32),
                    I(x.d as i32),
                    I(x.h as i32),
                    I(x.w as i32),
                    I(n as i32),
                    I(d0 as i32),
                    I(d1 as i32),
                    I(h0 as i32),
                    L(m as i64),
                ],
            );
            d0 = d1;
        }
    }
}

/// out = conv(inp, w) + b through our direct kernel `kind` (the tensor-core one where
/// [`mma_fits`]; for Cout = 1 in NDHWC the GEMM and tap sum of [`small_cout_gemm`] where `gemm`,
/// its slab budget in bytes, is not 0);
/// every operand in its own type.
#[allow(clippy::too_many_arguments)]
fn small_forward(
    dev: &Device,
    kind: SmallFwd,
    out: &mut GpuBuf,
    inp: &GpuBuf,
    w: &GpuBuf,
    b: &GpuBuf,
    cs: ConvShape,
    (cl, mma, gemm): (bool, bool, usize),
) {
    use Arg::{I, P};
    let x = cs.x;
    if kind == SmallFwd::Cout && cl && gemm > 0 && cs.cout == 1 {
        small_cout_gemm(dev, out, inp, w, b, cs, gemm);
        return;
    }
    if kind == SmallFwd::Cout && cout_mma_fits(cl, mma, inp.dtype(), x.c, cs.cout) {
        small_cout_mma(dev, out, inp, w, b, cs);
        return;
    }
    let dt = small_dt(inp.dtype(), w.dtype(), out.dtype());
    if kind == SmallFwd::Cin && mma_fits(cl, mma, x.c, cs.cout) {
        let ptrs = (dev.ptr(inp), dev.ptr(w), dev.ptr(b), dev.ptr_mut(out));
        small_mma_run(dev, ptrs, x, x.c, cs.cout, dt, Accum::Overwrite, false);
        return;
    }
    let args = [
        P(dev.ptr(inp)),
        P(dev.ptr(w)),
        P(dev.ptr(b)),
        P(dev.ptr_mut(out)),
        I(x.n as i32),
        I(x.c as i32),
        I(cs.cout as i32),
        I(x.d as i32),
        I(x.h as i32),
        I(x.w as i32),
        I(cl as i32),
        I(dt),
    ];
    let sms = dev.info.sms;
    match kind {
        SmallFwd::Cin => {
            let (grid, block) = small_cin_launch(x, cs.cout, sms);
            dev.launch("conv3d_fwd_small_cin", grid, block, &args);
        }
        SmallFwd::Cout => {
            let (grid, block) = small_cout_launch(x, cl, inp.dtype(), sms);
            let name = if cs.cout == 1 { "conv3d_fwd_small_cout1" } else { "conv3d_fwd_small_cout4" };
            dev.launch(name, grid, block, &args);
        }
    }
}

/// Whether `conv3d_fwd_small_cout_mma` computes a few-output conv's forward: NDHWC, bf16 input,
/// Cin a multiple of 16, Cout ≤ 8, the tensor-core kernels asked for (`mma`).
fn cout_mma_fits(cl: bool, mma: bool, xdt: DType, ci: usize, co: usize) -> bool {
    cl && mma && xdt == DType::Bf16 && ci.is_multiple_of(16) && co <= 8
}

/// out = conv(inp, w) + b of a Cout ≤ 8 conv on the tensor cores (kernels/conv3d.cu
/// `conv3d_fwd_small_cout_mma`, after `conv3d_small_cout_wfrag` arranges the weights as B
/// fragments). Persistent blocks, four per SM, over 1 × 8 × 32-voxel tiles.
fn small_cout_mma(dev: &Device, out: &mut GpuBuf, inp: &GpuBuf, w: &GpuBuf, b: &GpuBuf, cs: ConvShape) {
    use Arg::{I, P};
    let x = cs.x;
    let frags = 27 * (x.c / 16) * 32;
    let wf = dev.temp(2 * frags, DType::F32, T_WF);
    let wbf = (w.dtype() == DType::Bf16) as i32;
    let args = [P(dev.ptr(w)), I(wbf), I(x.c as i32), I(cs.cout as i32), P(wf)];
    dev.launch("conv3d_small_cout_wfrag", (frags.div_ceil(256) as u32, 1, 1), (256, 1, 1), &args);
    let tiles = x.n * x.d * x.h.div_ceil(8) * x.w.div_ceil(32);
    let blocks = tiles.min(dev.info.sms as usize * 4).max(1);
    let ybf = (out.dtype() == DType::Bf16) as i32;
    let dims = [x.n, x.c, cs.cout, x.d, x.h, x.w].map(|v| I(v as i32));
    let args = [
        P(dev.ptr(inp)),
        P(wf),
        P(dev.ptr(b)),
        P(dev.ptr_mut(out)),
        dims[0],
        dims[1],
        dims[2],
        dims[3],
        dims[4],
        dims[5],
        I(ybf),
    ];
    dev.launch("conv3d_fwd_small_cout_mma", (blocks as u32, 1, 1), (256, 1, 1), &args);
}

/// dx (type `dxdt`, = or += per `acc`) = the data gradient of a Cout ≤ 4 conv through our direct
/// kernel (the tensor-core one where [`mma_fits`]), from dy (type `dydt`) and the weights in their
/// own type.
#[allow(clippy::too_many_arguments)]
fn small_dgrad_run(
    dev: &Device,
    dxp: u64,
    dxdt: DType,
    acc: Accum,
    w: &GpuBuf,
    dyp: u64,
    dydt: DType,
    cs: ConvShape,
    (cl, mma): (bool, bool),
) {
    use Arg::{I, P};
    let x = cs.x;
    if mma_fits(cl, mma, cs.cout, x.c) {
        let dt = small_dt(dydt, w.dtype(), dxdt);
        small_mma_run(dev, (dyp, dev.ptr(w), 0, dxp), x, cs.cout, x.c, dt, acc, true);
        return;
    }
    let (grid, block) = small_cin_launch(x, x.c, dev.info.sms);
    let args = [
        P(dyp),
        P(dev.ptr(w)),
        P(dxp),
        I(x.n as i32),
        I(cs.cout as i32),
        I(x.c as i32),
        I(x.d as i32),
        I(x.h as i32),
        I(x.w as i32),
        I(cl as i32),
        I(small_dt(dydt, w.dtype(), dxdt)),
        I((acc == Accum::Add) as i32),
    ];
    dev.launch("conv3d_dgrad_small_cout", grid, block, &args);
}

/// Whether (cs, dir) runs our few-channel kernel, if known without timing: forced by
/// `MEDDPM_SMALL_CONV` / `set_small_conv`, or decided on an earlier call.
fn small_decided(cache: &ConvCache, cs: ConvShape, dir: Dir) -> Option<bool> {
    cache.force_small.or_else(|| cache.small.get(&(cs, dir)).copied())
}

/// Decide by timing whether (cs, dir) runs our few-channel kernel: `run(cache, ours)` computes the
/// direction one way or the other (into a target the caller may overwrite); the best of five runs
/// each, interleaved, is compared (the first cuDNN one includes cudnnFind), the faster is kept for
/// the shape.
fn time_small(
    dev: &Device,
    cache: &mut ConvCache,
    cs: ConvShape,
    dir: Dir,
    run: impl FnMut(&mut ConvCache, bool),
) -> bool {
    let t = best_of_five(dev, cache, run);
    let on = t[1] < t[0];
    if conv_log() {
        eprintln!(
            "meddpm-cuda conv {} -> {} k{} s{} {dir:?}: our few-channel kernel {:.3} ms, cuDNN {:.3} ms",
            cs.x, cs.cout, cs.k, cs.stride, t[1], t[0]
        );
    }
    cache.small.insert((cs, dir), on);
    on
}

/// Milliseconds of `run(cache, false)` and `run(cache, true)` on the stream: the best of five runs
/// each, interleaved (clock ramps and cuDNN's first-call setup fall on both sides; the first
/// whole-head measurement kept the last of 3 in a row and chose cuDNN where ours was faster).
fn best_of_five(dev: &Device, cache: &mut ConvCache, mut run: impl FnMut(&mut ConvCache, bool)) -> [f32; 2] {
    let mut t = [f32::INFINITY; 2];
    for _ in 0..5 {
        for (i, ours) in [false, true].into_iter().enumerate() {
            t[i] = t[i].min(stream_ms(dev, || run(cache, ours)));
        }
    }
    t
}

/// dW (f32 at `dw`) += the weight gradient through cuDNN: beta = 1 into the f32 gradient, or
/// (bf16) beta = 0 into a bf16 temporary then added to it.
fn cudnn_wgrad(dev: &Device, cache: &mut ConvCache, dw: u64, xp: u64, dyp: u64, cs: ConvShape) {
    let cdt = compute_type(cache.precision);
    let one = 1.0f32;
    let beta = if cdt == DType::F32 { 1.0f32 } else { 0.0 };
    let dwp = if cdt == DType::F32 { dw } else { dev.temp(cs.w_len(), cdt, T_DW) };
    // cudnnFind writes its output, so it gets a scratch dw.
    let a = if cache.plan(cs).algo[2].is_some() {
        cache.algo(dev, Dir::BwdFilter, cs, xp, 0, dyp)
    } else {
        let mut tmp = dev.alloc(cs.w_len(), cdt).unwrap_or_else(|e| panic!("{e}"));
        let tp = dev.ptr_mut(&mut tmp);
        let a = cache.algo(dev, Dir::BwdFilter, cs, xp, tp, dyp);
        dev.sync();
        drop(tmp);
        a
    };
    {
        let p = cache.plan(cs);
        let ws = dev.workspace(a.ws);
        let wsp = ws_ptr(dev, &ws);
        dev.bind();
        ck(
            unsafe {
                nsys::cudnnConvolutionBackwardFilter(
                    dev.cudnn.0,
                    &one as *const f32 as _,
                    p.x.0,
                    xp as _,
                    p.y.0,
                    dyp as _,
                    p.conv[2].0,
                    bwd_filter_algo(a.id),
                    wsp as _,
                    a.ws,
                    &beta as *const f32 as _,
                    p.w.0,
                    dwp as _,
                )
            },
            "cudnnConvolutionBackwardFilter",
        );
    }
    if cdt != DType::F32 {
        dev.cast(dw, DType::F32, dwp, cdt, cs.w_len(), true);
    }
}

/// Whether `conv3d_wgmma_wgrad` (bf16) or `conv3d_wgmma_wgrad_tf32` (TF32: f32 operands) computes
/// the weight gradient of `cs` (NDHWC): it fits ([`crate::conv_wgmma::wgrad_fits`]), the
/// precision has a kernel (bf16 or TF32; fp32 keeps its exact FMA sums), it is allowed
/// (`wgmma_wgrad`), and it is forced or timed faster than cuDNN's ([`wgmma_decided`], a scratch
/// f32 dW of the weight's length).
fn wgmma_wgrad_chosen(dev: &Device, cache: &mut ConvCache, cs: ConvShape, xp: u64, dyp: u64) -> bool {
    let cl = cache.layout == Layout::Ndhwc;
    let tf32 = cache.precision == Precision::Tf32;
    let ok = matches!(cache.precision, Precision::Bf16 | Precision::Tf32);
    if !(ok && cache.wgmma_wgrad && crate::conv_wgmma::wgrad_fits(dev, cs.x, (cs.k, cs.stride), cs.cout, cl)) {
        return false;
    }
    // Timed at every size: the kernel's blocks are (kd, input group, output slice) triples times
    // chunks of tiles, so small volumes with wide channels still fill the GPU (the forward's
    // `worth` counts output tiles only).
    // the scratch target: 2 · w_len bf16 elements are w_len f32
    wgmma_decided(dev, cache, cs, (Dir::BwdFilter, false), true, 2 * cs.w_len(), |cache, ours, tp| {
        if ours {
            crate::conv_wgmma::wgrad(dev, (xp, dyp, tp), cs.x, cs.cout, tf32);
        } else {
            cudnn_wgrad(dev, cache, tp, xp, dyp, cs);
        }
    })
}

/// dinp (per Accum) = the data gradient, dw += the weight gradient, db += the bias gradient
/// (skipped when None).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    dev: &Device,
    cache: &mut ConvCache,
    dinp: Option<(&mut GpuBuf, Accum)>,
    dw: &mut GpuBuf,
    db: Option<&mut GpuBuf>,
    dout: &GpuBuf,
    inp: &GpuBuf,
    w: &GpuBuf,
    cs: ConvShape,
) {
    check_lens(cs, inp.len(), w.len(), dout.len(), db.as_ref().map_or(cs.cout, |b| b.len()));
    assert_eq!(dw.len(), cs.w_len(), "conv3d backward: dw length");
    require_f32("conv3d backward: dw", &[dw]);
    let cl = cache.layout == Layout::Ndhwc;
    bias_grad(dev, db, dout, cs.out(), cl);
    let cdt = compute_type(cache.precision);
    let (xp, dyp) = (operand(dev, inp, cdt, T_X), operand(dev, dout, cdt, T_DY));
    let ly = (cl, cache.mma_on());
    weight_grad(dev, cache, dw, xp, dyp, cs, ly);
    if let Some(d) = dinp {
        data_grad(dev, cache, d, dyp, cdt, w, cs, ly);
    }
}

/// The bias gradient: db[c] += the sum over n and voxels of dout (as given; volume `yd`), where
/// there is a db.
fn bias_grad(dev: &Device, db: Option<&mut GpuBuf>, dout: &GpuBuf, yd: meddpm::Dims, cl: bool) {
    if let Some(db) = db {
        require_f32("conv3d backward: db", &[db]);
        let to = crate::elementwise::SumTo::AccumOverN(dev.ptr_mut(db));
        crate::elementwise::channel_sums(dev, dout, yd, cl, to);
    }
}

/// dw += the weight gradient from x and dy (device addresses, both in the compute type): our
/// few-channel kernels, `conv3d_wgmma_wgrad(_tf32)` or cuDNN, as chosen for `cs`.
fn weight_grad(
    dev: &Device,
    cache: &mut ConvCache,
    dw: &mut GpuBuf,
    xp: u64,
    dyp: u64,
    cs: ConvShape,
    ly: (bool, bool),
) {
    let cdt = compute_type(cache.precision);
    if small_cout_wgrad(cs, cdt) {
        wgrad_small(dev, dw, xp, dyp, (cdt == DType::Bf16) as i32, cs, ly);
    } else if small_cin_wgrad(cs, cdt, ly) {
        wgrad_small_cin(dev, dw, xp, dyp, cs);
    } else if wgmma_wgrad_chosen(dev, cache, cs, xp, dyp) {
        let tf32 = cache.precision == Precision::Tf32;
        crate::conv_wgmma::wgrad(dev, (xp, dyp, dev.ptr_mut(dw)), cs.x, cs.cout, tf32);
        cache.wgmma_wgrad_runs += 1;
    } else {
        cudnn_wgrad(dev, cache, dev.ptr_mut(dw), xp, dyp, cs);
    }
}

/// `Backend::conv3d_backward_data`: the data gradient alone.
pub(crate) fn backward_data(
    dev: &Device,
    cache: &mut ConvCache,
    dinp: (&mut GpuBuf, Accum),
    dout: &GpuBuf,
    w: &GpuBuf,
    cs: ConvShape,
) {
    check_lens(cs, cs.x.numel(), w.len(), dout.len(), cs.cout);
    let cdt = compute_type(cache.precision);
    let dyp = operand(dev, dout, cdt, T_DY);
    let ly = (cache.layout == Layout::Ndhwc, cache.mma_on());
    data_grad(dev, cache, dinp, dyp, cdt, w, cs, ly);
}

/// [`backward_data`] overwriting dinp whose epilogue also takes the GroupNorm+SiLU backward's
/// channel sums of dinp ([`crate::conv_wgmma::GnSums`], written to `s.part`) where our wgmma data
/// gradient runs this shape (decided as [`backward_data`] decides: the plain kernel against
/// cuDNN) and `ConvCache::dgrad_gn` is on. Returns whether the sums were taken and whether dy's
/// channel sums were (`s.dys`, where the kernel can: 64 channels of dy, the window of planes); if
/// not, dinp is what [`backward_data`] gives and the caller takes the sums itself.
pub(crate) fn backward_data_gn(
    dev: &Device,
    cache: &mut ConvCache,
    dx: &mut GpuBuf,
    dout: &GpuBuf,
    w: &GpuBuf,
    cs: ConvShape,
    mut s: crate::conv_wgmma::GnSums,
) -> (bool, bool) {
    check_lens(cs, cs.x.numel(), w.len(), dout.len(), cs.cout);
    let cdt = compute_type(cache.precision);
    let dyp = operand(dev, dout, cdt, T_DY);
    let ly = (cache.layout == Layout::Ndhwc, cache.mma_on());
    assert_eq!(dx.len(), cs.x.numel(), "conv3d backward: dinp length");
    let bf = cdt == DType::Bf16 && dx.dtype() == DType::Bf16;
    let (yd, ci) = (cs.out(), cs.x.c);
    if cache.dgrad_gn
        && crate::conv_wgmma::fits(dev, yd, cs.k, cs.stride, ci, ly.0, bf)
        && crate::conv_wgmma::gnb_fits(cs.x.n, ci, s.groups)
    {
        let (wp, wbf) = (dev.ptr(w), w.dtype() == DType::Bf16);
        let worth = crate::conv_wgmma::worth(dev, cs.x, ci);
        let ours = wgmma_decided(dev, cache, cs, (Dir::BwdData, false), worth, dx.len(), |cache, ours, tp| {
            dgrad_trial(dev, cache, ours, tp, (dyp, wp, wbf), w, cs, Accum::Overwrite)
        });
        if ours {
            let reuse = cache.wgmma_reuse;
            if !(reuse && yd.c == 64) {
                s.dys = 0;
            }
            crate::conv_wgmma::run_dgrad_gnb(dev, (dyp, wp, dev.ptr_mut(dx)), wbf, yd, ci, reuse, T_WPD, s);
            cache.wgmma_runs += 1;
            cache.dgrad_gn_runs += 1;
            return (true, s.dys != 0);
        }
    }
    data_grad(dev, cache, (dx, Accum::Overwrite), dyp, cdt, w, cs, ly);
    (false, false)
}

/// One run of the first-use timing of the bf16 data gradient into the scratch target `tp`: our
/// wgmma kernel or cuDNN's.
#[allow(clippy::too_many_arguments)]
fn dgrad_trial(
    dev: &Device,
    cache: &mut ConvCache,
    ours: bool,
    tp: u64,
    (dyp, wp, wbf): (u64, u64, bool),
    w: &GpuBuf,
    cs: ConvShape,
    acc: Accum,
) {
    if ours {
        let modes = (cache.wgmma_reuse, cache.wgmma_dual);
        crate::conv_wgmma::run_dgrad(dev, (dyp, wp, 0, tp, 0), wbf, cs.out(), cs.x.c, acc, modes, T_WPD);
    } else {
        cudnn_dgrad(dev, cache, tp, DType::Bf16, acc, w, dyp, cs);
    }
}

/// Data gradient: our few-channel kernel or cuDNN (timed on first use, on a scratch target
/// because dx may accumulate); dy already in the compute type `cdt`.
#[allow(clippy::too_many_arguments)]
fn data_grad(
    dev: &Device,
    cache: &mut ConvCache,
    (dx, acc): (&mut GpuBuf, Accum),
    dyp: u64,
    cdt: DType,
    w: &GpuBuf,
    cs: ConvShape,
    ly: (bool, bool),
) {
    assert_eq!(dx.len(), cs.x.numel(), "conv3d backward: dinp length");
    let dxdt = dx.dtype();
    let bf = cdt == DType::Bf16 && dxdt == DType::Bf16;
    if crate::conv_wgmma::fits(dev, cs.out(), cs.k, cs.stride, cs.x.c, ly.0, bf) {
        // the data gradient is the forward conv of dy with the flipped, transposed weights
        let (wp, wbf, yd) = (dev.ptr(w), w.dtype() == DType::Bf16, cs.out());
        let worth = crate::conv_wgmma::worth(dev, cs.x, cs.x.c);
        let add = acc == Accum::Add;
        let ours = wgmma_decided(dev, cache, cs, (Dir::BwdData, add), worth, dx.len(), |cache, ours, tp| {
            dgrad_trial(dev, cache, ours, tp, (dyp, wp, wbf), w, cs, acc)
        });
        if ours {
            let (ptrs, modes) = ((dyp, wp, 0, dev.ptr_mut(dx), 0), (cache.wgmma_reuse, cache.wgmma_dual));
            if crate::conv_wgmma::run_dgrad(dev, ptrs, wbf, yd, cs.x.c, acc, modes, T_WPD) {
                cache.wgmma_dual_runs += 1;
            }
            cache.wgmma_runs += 1;
            return;
        }
    }
    let ours = small_dgrad(cs)
        && match small_decided(cache, cs, Dir::BwdData) {
            Some(f) => f,
            None => {
                let mut tmp = dev.alloc(dx.len(), dxdt).unwrap_or_else(|e| panic!("{e}"));
                let tp = dev.ptr_mut(&mut tmp);
                let f = time_small(dev, cache, cs, Dir::BwdData, |cache, ours| {
                    if ours {
                        small_dgrad_run(dev, tp, dxdt, Accum::Overwrite, w, dyp, cdt, cs, ly);
                    } else {
                        cudnn_dgrad(dev, cache, tp, dxdt, Accum::Overwrite, w, dyp, cs);
                    }
                });
                dev.sync();
                drop(tmp);
                f
            }
        };
    if small_dgrad(cs) {
        cache.small_used.insert((cs, Dir::BwdData), ours);
    }
    let dxp = dev.ptr_mut(dx);
    if ours {
        small_dgrad_run(dev, dxp, dxdt, acc, w, dyp, cdt, cs, ly);
    } else {
        cudnn_dgrad(dev, cache, dxp, dxdt, acc, w, dyp, cs);
    }
}

/// dx (type `dxdt`; = or += per `acc`) = the data gradient through cuDNN, from dy in the compute
/// type (an input gradient of the other type goes through a temporary).
#[allow(clippy::too_many_arguments)]
fn cudnn_dgrad(
    dev: &Device,
    cache: &mut ConvCache,
    dxp: u64,
    dxdt: DType,
    acc: Accum,
    w: &GpuBuf,
    dyp: u64,
    cs: ConvShape,
) {
    let cdt = compute_type(cache.precision);
    let wp = operand(dev, w, cdt, T_W);
    let n = cs.x.numel();
    let (one, zero) = (1.0f32, 0.0f32);
    let direct = dxdt == cdt;
    let (dxc, acc_c) = if direct { (dxp, acc) } else { (dev.temp(n, cdt, T_DX), Accum::Overwrite) };
    let a = if cache.plan(cs).algo[1].is_some() || acc_c == Accum::Overwrite {
        cache.algo(dev, Dir::BwdData, cs, dxc, wp, dyp)
    } else {
        let mut tmp = dev.alloc(n, cdt).unwrap_or_else(|e| panic!("{e}"));
        let tp = dev.ptr_mut(&mut tmp);
        let a = cache.algo(dev, Dir::BwdData, cs, tp, wp, dyp);
        dev.sync();
        drop(tmp);
        a
    };
    let p = cache.plan(cs);
    let ws = dev.workspace(a.ws);
    let wsp = ws_ptr(dev, &ws);
    let beta = if acc_c == Accum::Add { one } else { zero };
    dev.bind();
    ck(
        unsafe {
            nsys::cudnnConvolutionBackwardData(
                dev.cudnn.0,
                &one as *const f32 as _,
                p.w.0,
                wp as _,
                p.y.0,
                dyp as _,
                p.conv[1].0,
                bwd_data_algo(a.id),
                wsp as _,
                a.ws,
                &beta as *const f32 as _,
                p.x.0,
                dxc as _,
            )
        },
        "cudnnConvolutionBackwardData",
    );
    drop(ws);
    if !direct {
        dev.cast(dxp, dxdt, dxc, cdt, n, acc == Accum::Add);
    }
}

/// The data gradient of a 1×1×1 stride-1 conv (a decoder ResBlock's skip conv) added onto the
/// two parts of its input, a concatenation: channels [0, ca) onto `ph`, [ca, Cin) onto `ps`, each
/// in the layout ((N, ca, ...) / (N, Cin − ca, ...)). Two cuBLAS GEMMs with β = 1 (f32: TF32 where
/// the precision says so; bf16: f32 accumulation), the weight's column blocks as operands
/// (`Backend::groupnorm_silu_backward_cat_in`'s second half). dout, w and the parts share a type.
pub(crate) fn backward_data_1x1_into_parts(
    dev: &Device,
    (ph, ps): (&mut GpuBuf, &mut GpuBuf),
    dout: &GpuBuf,
    w: &GpuBuf,
    cs: ConvShape,
    ca: usize,
    cl: bool,
) {
    use crate::linear::{gemm_typed, Mat};
    let (x, co) = (cs.x, cs.cout);
    let (ci, s) = (x.c, x.s());
    let dt = dout.dtype();
    assert!(
        cs.k == 1
            && cs.stride == 1
            && ca > 0
            && ca < ci
            && [w.dtype(), ph.dtype(), ps.dtype()].iter().all(|&d| d == dt),
        "1×1 data gradient into parts: {x} → {co} k{} s{} at channel {ca}, types dout {dt:?} w {:?} parts {:?} {:?}",
        cs.k,
        cs.stride,
        w.dtype(),
        ph.dtype(),
        ps.dtype()
    );
    assert!(
        dout.len() == x.n * co * s && w.len() == co * ci && ph.len() == x.n * ca * s && ps.len() == x.n * (ci - ca) * s,
        "1×1 data gradient into parts of {x} at channel {ca}: lengths"
    );
    let e = dt.bytes() as u64;
    let (dp, wp) = (dev.ptr(dout), dev.ptr(w));
    for (part, c0, cp) in [(dev.ptr_mut(ph), 0, ca), (dev.ptr_mut(ps), ca, ci - ca)] {
        if cl {
            // part (N·S × cp, row-major) += dout (N·S × co) · W[:, c0..c0+cp] (W row-major co × ci)
            let a = Mat::row_major(dp, co, 0);
            let b = Mat { ptr: wp + c0 as u64 * e, ld: ci as i32, t: true, stride: 0 };
            gemm_typed(dev, (x.n * s, cp, co), 1.0, a, b, 1.0, Mat::row_major(part, cp, 0), 1, dt);
        } else {
            // per sample: part_n (cp × S) += W[:, c0..c0+cp]ᵀ (cp × co) · dout_n (co × S)
            let a = Mat { ptr: wp + c0 as u64 * e, ld: ci as i32, t: false, stride: 0 };
            let b = Mat::row_major(dp, s, (co * s) as i64);
            let c = Mat::row_major(part, s, (cp * s) as i64);
            gemm_typed(dev, (cp, s, co), 1.0, a, b, 1.0, c, x.n, dt);
        }
    }
}

/// The weight gradient of a 1×1×1 stride-1 conv (a decoder ResBlock's skip conv) whose input is
/// the concatenation cat([h + h_bias, s]) given by its parts (NDHWC), added into `dw` (f32,
/// (Cout, Cin)): two cuBLAS GEMMs, dout (N·S × Cout)ᵀ times each part, accumulated in f32 straight
/// onto the weight's column blocks (cublasGemmEx, β = 1; bf16 operands with f32 accumulation,
/// f32 ones as the precision says), and the bias's share (Σ dout) ⊗ h_bias from dout's
/// per-sample channel sums `dsum` (N × Cout, f32) by `rank1_add`. No concatenation is built.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_filter_1x1_from_parts(
    dev: &Device,
    dw: &mut GpuBuf,
    dout: &GpuBuf,
    (h, h_bias, s): (&GpuBuf, Option<&GpuBuf>, &GpuBuf),
    dsum: &GpuBuf,
    cs: ConvShape,
    ca: usize,
) {
    let (x, co) = (cs.x, cs.cout);
    let (ci, vox) = (x.c, x.n * x.s());
    let dt = dout.dtype();
    require_f32("1×1 weight gradient from parts: dw, dout's channel sums", &[dw, dsum]);
    assert!(
        cs.k == 1 && cs.stride == 1 && ca > 0 && ca < ci && h.dtype() == dt && s.dtype() == dt,
        "1×1 weight gradient from parts: {x} → {co} k{} s{} at channel {ca}, types dout {dt:?} parts {:?} {:?}",
        cs.k,
        cs.stride,
        h.dtype(),
        s.dtype()
    );
    assert!(
        dout.len() == vox * co
            && h.len() == vox * ca
            && s.len() == vox * (ci - ca)
            && dw.len() == co * ci
            && dsum.len() == x.n * co,
        "1×1 weight gradient from parts of {x} at channel {ca}: lengths"
    );
    let dp = dev.ptr(dout);
    let wp = dev.ptr_mut(dw);
    for (part, c0, cp) in [(dev.ptr(h), 0, ca), (dev.ptr(s), ca, ci - ca)] {
        // dwᵀ[c0.., :] (cp × co, column-major, ld ci) += part (cp × N·S) · dout (N·S × co)
        let c = wp + 4 * c0 as u64;
        crate::linear::gemm_ex(dev, (cp, co, vox), (part, false, cp), (dp, true, co), dt, c, ci, 1.0);
    }
    if let Some(b) = h_bias {
        assert!(
            b.dtype() == DType::F32 && b.len() == ca,
            "1×1 weight gradient from parts: bias of {} {:?}",
            b.len(),
            b.dtype()
        );
        let n = (co * ca) as u32;
        use Arg::{I, P};
        let args = [P(wp), P(dev.ptr(dsum)), P(dev.ptr(b)), I(x.n as i32), I(co as i32), I(ca as i32), I(ci as i32)];
        dev.launch("rank1_add", (n.div_ceil(256), 1, 1), (256, 1, 1), &args);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cs(n: usize, cin: usize, d: usize, h: usize, w: usize, cout: usize, k: usize, stride: usize) -> ConvShape {
        ConvShape::new(Dims::new(n, cin, d, h, w), cout, k, stride)
    }

    #[test]
    fn disk_cache_lines_round_trip_algorithms_and_choices() {
        let c = cs(1, 64, 128, 128, 128, 64, 3, 1);
        let lp = (Layout::Ndhwc, Precision::Bf16);
        let (k0, k1) =
            (choice_key("wgmma", Dir::BwdData, &c, lp, false), choice_key("wgmma", Dir::BwdData, &c, lp, true));
        assert_ne!(k0, k1, "accumulated and overwritten outputs are timed apart");
        assert_ne!(k0, choice_key("wgmma", Dir::Fwd, &c, lp, false));
        assert!(!k0.contains(char::is_whitespace), "{k0}");
        let algo = key(Dir::BwdFilter, &c, lp.0, lp.1);
        let text = [
            disk_line(&k0, &Algo { id: 1, math: 0, ws: 0, ms: 0.5 }),
            disk_line(&k1, &Algo { id: 0, math: 0, ws: 0, ms: 0.5 }),
            disk_line(&algo, &Algo { id: 1, math: 1, ws: 1 << 20, ms: 0.5 }),
            "torn line 1\n".into(),
        ]
        .concat();
        let d = parse_disk(&text);
        assert_eq!(d.len(), 3, "the torn line is skipped");
        assert_eq!((d[&k0].id, d[&k1].id), (1, 0));
        assert_eq!((d[&algo].id, d[&algo].math, d[&algo].ws), (1, 1, 1 << 20));
    }

    #[test]
    fn few_channel_kernels_take_only_their_shapes() {
        // the network's first conv (3 -> 64) and last (64 -> 1 whole-head, 64 -> 4 BraTS)
        assert_eq!(small_fwd_kind(cs(1, 3, 128, 128, 128, 64, 3, 1)), Some(SmallFwd::Cin));
        assert_eq!(small_fwd_kind(cs(1, 64, 128, 128, 128, 1, 3, 1)), Some(SmallFwd::Cout));
        assert_eq!(small_fwd_kind(cs(2, 64, 96, 96, 96, 4, 3, 1)), Some(SmallFwd::Cout));
        assert!(small_dgrad(cs(1, 64, 128, 128, 128, 1, 3, 1)));
        assert!(small_dgrad(cs(2, 70, 7, 9, 6, 4, 3, 1)));
        // few on both sides: the small-Cin kernel
        assert_eq!(small_fwd_kind(cs(1, 4, 5, 5, 5, 4, 3, 1)), Some(SmallFwd::Cin));
        assert_eq!(small_fwd_kind(cs(1, 1, 5, 5, 5, 1024, 3, 1)), Some(SmallFwd::Cin));
        assert_eq!(small_fwd_kind(cs(1, 1024, 5, 5, 5, 3, 3, 1)), Some(SmallFwd::Cout));
        // not theirs: wide on both sides, too wide, stride 2, 1x1x1, empty channels
        assert_eq!(small_fwd_kind(cs(1, 5, 5, 5, 5, 5, 3, 1)), None);
        assert_eq!(small_fwd_kind(cs(1, 64, 12, 12, 12, 64, 3, 1)), None);
        assert_eq!(small_fwd_kind(cs(1, 3, 5, 5, 5, 1025, 3, 1)), None);
        assert_eq!(small_fwd_kind(cs(1, 1025, 5, 5, 5, 1, 3, 1)), None);
        assert_eq!(small_fwd_kind(cs(1, 3, 8, 8, 8, 64, 3, 2)), None);
        assert_eq!(small_fwd_kind(cs(1, 64, 8, 8, 8, 1, 3, 2)), None);
        assert_eq!(small_fwd_kind(cs(1, 3, 8, 8, 8, 64, 1, 1)), None);
        assert_eq!(small_fwd_kind(cs(1, 0, 8, 8, 8, 1, 3, 1)), None);
        // Cin 5 to 8 only on the tensor cores: NDHWC, mma on, Cout a multiple of 8 up to 64
        let brats = cs(1, 8, 144, 192, 192, 64, 3, 1);
        assert_eq!(small_fwd_kind(brats), None);
        assert_eq!(small_fwd_kind_in(brats, (true, true)), Some(SmallFwd::Cin));
        assert_eq!(small_fwd_kind_in(brats, (false, true)), None);
        assert_eq!(small_fwd_kind_in(brats, (true, false)), None);
        assert_eq!(small_fwd_kind_in(cs(1, 5, 5, 5, 5, 24, 3, 1), (true, true)), Some(SmallFwd::Cin));
        assert_eq!(small_fwd_kind_in(cs(1, 8, 5, 5, 5, 20, 3, 1), (true, true)), None);
        assert_eq!(small_fwd_kind_in(cs(1, 8, 5, 5, 5, 72, 3, 1), (true, true)), None);
        assert_eq!(small_fwd_kind_in(cs(1, 9, 5, 5, 5, 64, 3, 1), (true, true)), None);
        assert_eq!(small_fwd_kind_in(cs(1, 8, 8, 8, 8, 64, 3, 2), (true, true)), None);
        // the kernels' shared memory (kernels/conv3d.cu small_mma_smem): 38784 and 58880 bytes
        assert_eq!((small_mma_smem(3), small_mma_smem(8)), (38784, 58880));
        assert!(!small_dgrad(cs(1, 3, 8, 8, 8, 64, 3, 1)), "the first conv's dgrad is cuDNN's");
        assert!(!small_dgrad(cs(1, 64, 8, 8, 8, 5, 3, 1)));
        assert!(!small_dgrad(cs(1, 64, 8, 8, 8, 1, 3, 2)));
        assert!(!small_dgrad(cs(1, 1025, 8, 8, 8, 1, 3, 1)));
    }

    #[test]
    fn small_mma_items_cover_the_volume_in_chunks_of_four_planes_or_more() {
        // 128³ on 132 SMs × 3: one item of 43 planes a block (384 blocks); BraTS: three rounds of
        // 36 planes; every chunking covers D, and small volumes get ragged chunks of 4 (the tests')
        assert_eq!(small_mma_items(Dims::new(1, 2, 128, 128, 128), 396), (43, 384));
        assert_eq!(small_mma_items(Dims::new(1, 4, 144, 192, 192), 396), (36, 396));
        assert_eq!(small_mma_items(Dims::new(2, 3, 5, 9, 35), 396), (4, 24));
        assert_eq!(small_mma_items(Dims::new(1, 1, 3, 9, 35), 396), (3, 6));
        for (d, slots) in [(1, 1), (7, 2), (9, 396), (128, 396), (200, 17)] {
            let x = Dims::new(2, 1, d, 17, 33);
            let (dc, grid) = small_mma_items(x, slots);
            assert!(dc >= d.min(4) && dc <= d && grid >= 1 && grid <= slots, "D {d}: {dc} planes, {grid} blocks");
        }
    }

    #[test]
    fn wgmma_work_items_are_columns_of_32_by_8() {
        // conv3d_wgmma's tiles (32 h × 8 w): 128³ has 4 × 16 columns; one item of 64 planes a
        // block fills 128 of 132 SMs in one round; BraTS (144 × 192 × 192: 6 × 24 columns) in
        // ten rounds of 16 planes on all 132; odd sizes round their columns up
        assert_eq!(col_items(Dims::new(1, 64, 128, 128, 128), 132, (32, 8)), (64, 128));
        assert_eq!(col_items(Dims::new(1, 64, 144, 192, 192), 132, (32, 8)), (16, 132));
        let x = Dims::new(2, 64, 5, 35, 9);
        let (dc, grid) = col_items(x, 132, (32, 8));
        assert_eq!((dc, grid), (4, 2 * 2 * 2 * 2));
    }

    #[test]
    fn type_mask_has_one_bit_per_pointer() {
        use DType::{Bf16, F32};
        assert_eq!(small_dt(F32, F32, F32), 0);
        assert_eq!(small_dt(Bf16, F32, F32), 1);
        assert_eq!(small_dt(F32, Bf16, F32), 2);
        assert_eq!(small_dt(F32, F32, Bf16), 4);
        assert_eq!(small_dt(F32, Bf16, Bf16), 6);
        assert_eq!(small_dt(Bf16, Bf16, Bf16), 7);
    }

    #[test]
    fn few_channel_launches_cover_every_channel_and_voxel_group() {
        let sms = 132;
        for (x, cout) in [
            (Dims::new(1, 3, 128, 128, 128), 64),
            (Dims::new(1, 3, 9, 10, 11), 40),
            (Dims::new(2, 1, 3, 4, 8), 5),
            (Dims::new(1, 2, 3, 3, 4), 130),
            (Dims::new(1, 4, 2, 2, 1), 1024),
        ] {
            let ((gx, gy, gz), (bx, by, bz)) = small_cin_launch(x, cout, sms);
            let warps = bx as usize / 32;
            assert!(bx % 32 == 0 && (1..=8).contains(&warps) && (by, bz, gz) == (1, 1, 1), "{x} -> {cout}");
            // the block's channels: warps * SC_COT; the y blocks cover all output channels, none idle
            let per = warps * SC_COT;
            assert!(gy as usize * per >= cout && (gy as usize - 1) * per < cout, "{x} -> {cout}: {gy} x {per}");
            assert!(per <= 64, "the kernel's shared weights hold 64 output channels");
            // grid x: at least one block, none without a voxel group (the kernel strides over the rest)
            let groups = voxel_groups(x);
            assert!(gx >= 1 && (gx as usize - 1) * 32 < groups, "{x}: {gx} blocks for {groups} groups");
            assert!(gx as usize * gy as usize <= (sms as usize * 8).max(gy as usize), "{x}: grid {gx} x {gy}");
        }
        assert_eq!(voxel_groups(Dims::new(2, 3, 5, 6, 7)), 2 * 5 * 6 * 2);
        assert_eq!(voxel_groups(Dims::new(1, 3, 128, 128, 128)), 128 * 128 * 32);
        for (x, cl, dt, per_block) in [
            (Dims::new(1, 64, 128, 128, 128), true, DType::Bf16, 32),
            (Dims::new(1, 64, 128, 128, 128), true, DType::F32, 16),
            (Dims::new(1, 64, 128, 128, 128), false, DType::Bf16, 256),
            (Dims::new(2, 70, 7, 9, 6), true, DType::Bf16, 32),
            (Dims::new(1, 5, 1, 1, 1), false, DType::F32, 256),
        ] {
            let ((gx, gy, _), (bx, _, _)) = small_cout_launch(x, cl, dt, sms);
            assert_eq!((gy, bx), (1, 256));
            let groups = voxel_groups(x);
            assert!(gx >= 1 && (gx as usize - 1) * per_block < groups && gx <= sms * 8, "{x} {cl} {dt:?}: {gx}");
            if groups <= per_block * sms as usize * 8 {
                assert!(gx as usize * per_block >= groups, "{x}: one pass covers all groups");
            }
        }
    }
}
