//! cuDNN descriptors and the types every conv file shares: directions ([`Dir`]), algorithm
//! records ([`Algo`]), the per-shape descriptor set ([`Plan`]) and the operand length check.
//!
//! - Layouts are expressed through tensor strides (NDHWC weights in cuDNN's NHWC filter format).
//! - Precision: `Fp32` sets `CUDNN_FMA_MATH` (no tensor cores, true fp32) and only accepts
//!   algorithms cuDNN reports as FMA; `Tf32` sets `CUDNN_TENSOR_OP_MATH`; `Bf16` runs bf16 tensors
//!   (x, w, y) with fp32 accumulation and `CUDNN_TENSOR_OP_MATH` (with the default math type the
//!   legacy API picks a 30 TFLOP/s non-tensor-core kernel for bf16).

use cudarc::cudnn::sys as nsys;
use meddpm::{ConvShape, DType, Layout, Precision};

use crate::device::cudnn_ck;

pub(super) struct TensorDesc(pub(super) nsys::cudnnTensorDescriptor_t);
pub(super) struct FilterDesc(pub(super) nsys::cudnnFilterDescriptor_t);
pub(super) struct ConvDesc(pub(super) nsys::cudnnConvolutionDescriptor_t);
pub(super) struct ActDesc(pub(super) nsys::cudnnActivationDescriptor_t);
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

pub(super) fn ck(st: nsys::cudnnStatus_t, what: &str) {
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

pub(super) fn tensor_desc(d: meddpm::Dims, layout: Layout, dt: DType) -> TensorDesc {
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
pub(super) fn bias_desc(c: usize, dt: DType) -> TensorDesc {
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

pub(super) fn identity_desc() -> ActDesc {
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

pub(super) fn filter_desc(cs: &ConvShape, layout: Layout, dt: DType) -> FilterDesc {
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

pub(super) fn conv_desc(cs: &ConvShape, math: nsys::cudnnMathType_t) -> ConvDesc {
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
    pub(super) fn tag(self) -> &'static str {
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

pub(super) fn math_of(m: u32) -> nsys::cudnnMathType_t {
    use nsys::cudnnMathType_t::*;
    match m {
        0 => CUDNN_DEFAULT_MATH,
        1 => CUDNN_TENSOR_OP_MATH,
        2 => CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION,
        _ => CUDNN_FMA_MATH,
    }
}

pub(super) fn fwd_algo(id: u32) -> nsys::cudnnConvolutionFwdAlgo_t {
    assert!(id < 8, "cuDNN forward algorithm id {id} out of range");
    unsafe { std::mem::transmute::<u32, nsys::cudnnConvolutionFwdAlgo_t>(id) }
}
pub(super) fn bwd_data_algo(id: u32) -> nsys::cudnnConvolutionBwdDataAlgo_t {
    assert!(id < 6, "cuDNN backward-data algorithm id {id} out of range");
    unsafe { std::mem::transmute::<u32, nsys::cudnnConvolutionBwdDataAlgo_t>(id) }
}
pub(super) fn bwd_filter_algo(id: u32) -> nsys::cudnnConvolutionBwdFilterAlgo_t {
    assert!(id < 7, "cuDNN backward-filter algorithm id {id} out of range");
    unsafe { std::mem::transmute::<u32, nsys::cudnnConvolutionBwdFilterAlgo_t>(id) }
}

/// Descriptors for one convolution shape; one conv descriptor per direction because each may run
/// with a different math type.
pub(super) struct Plan {
    pub(super) x: TensorDesc,
    pub(super) y: TensorDesc,
    pub(super) w: FilterDesc,
    pub(super) bias: TensorDesc,
    pub(super) conv: [ConvDesc; 3],
    pub(super) algo: [Option<Algo>; 3],
    /// Forward with the bias fused into cuDNN (cudnnConvolutionBiasActivationForward, identity
    /// activation, only with IMPLICIT_PRECOMP_GEMM) rather than conv + our bias kernel; decided by
    /// timing both on first use, separately for the plain forward ([0]) and the one that adds a
    /// residual tensor z in the same call ([1], `forward_res`).
    pub(super) fused_bias: [Option<bool>; 2],
}

pub(super) fn idx(d: Dir) -> usize {
    match d {
        Dir::Fwd => 0,
        Dir::BwdData => 1,
        Dir::BwdFilter => 2,
    }
}

pub(super) fn check_lens(cs: ConvShape, x: usize, w: usize, y: usize, b: usize) {
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
