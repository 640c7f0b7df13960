//! Linear layers (time-embedding MLP, each ResBlock's emb_layers) and the GEMM helper shared with
//! attention. Semantics: `Backend::linear_*` (torch.nn.Linear, w stored (O, I)); CPU twin
//! cpu/linear.rs. GEMMs are cuBLAS (column-major); bias add and bias gradient are our kernels.
//!
//! [`Mat`] describes a *logical* row-major-thinking matrix by where cuBLAS finds it: either the
//! column-major storage holds the matrix itself (`t == false`) or its transpose (`t == true`), with
//! leading dimension `ld` and a batch stride. [`gemm`] then computes C = α·A·B + β·C for any mix.

use cudarc::cublas::sys as bsys;
use meddpm::{Accum, DType, Layout};

use crate::buf::{require_f32, GpuBuf, Mode};
use crate::device::{cublas_ck, Arg::*, Device};

#[derive(Clone, Copy, Debug)]
pub(crate) struct Mat {
    pub ptr: u64,
    pub ld: i32,
    /// Storage holds the transpose (column-major view), e.g. any row-major matrix.
    pub t: bool,
    /// Elements between consecutive matrices of a batch.
    pub stride: i64,
}

impl Mat {
    /// A row-major (rows × cols) matrix: column-major storage of its transpose.
    pub fn row_major(ptr: u64, cols: usize, stride: i64) -> Mat {
        Mat { ptr, ld: cols as i32, t: true, stride }
    }
    /// The logical transpose (same storage).
    pub fn tr(self) -> Mat {
        Mat { t: !self.t, ..self }
    }
}

fn op(t: bool) -> bsys::cublasOperation_t {
    if t {
        bsys::cublasOperation_t::CUBLAS_OP_T
    } else {
        bsys::cublasOperation_t::CUBLAS_OP_N
    }
}

/// C (m × n) = alpha · A (m × k) · B (k × n) + beta · C, for `batch` f32 matrices (TF32 where the
/// handle's math mode allows it).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    dev: &Device,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Mat,
    b: Mat,
    beta: f32,
    c: Mat,
    batch: usize,
) {
    gemm_typed(dev, (m, n, k), alpha, a, b, beta, c, batch, meddpm::DType::F32)
}

/// [`gemm`] for A, B and C of element type `dt`: f32 (cublasSgemmStridedBatched) or bf16
/// (cublasGemmStridedBatchedEx, f32 accumulation, C rounded to bf16 as it is stored).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_typed(
    dev: &Device,
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: Mat,
    b: Mat,
    beta: f32,
    c: Mat,
    batch: usize,
    dt: meddpm::DType,
) {
    use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType};
    dev.bind();
    let (m, n, k) = (m as i32, n as i32, k as i32);
    // cuBLAS is column-major: C itself, or (c.t) its storage holds Cᵀ = Bᵀ·Aᵀ.
    let (ta, tb, mm, nn, x, y) = if !c.t { (a.t, b.t, m, n, a, b) } else { (!b.t, !a.t, n, m, b, a) };
    let st = unsafe {
        if dt == meddpm::DType::F32 {
            bsys::cublasSgemmStridedBatched(
                dev.blas.0,
                op(ta),
                op(tb),
                mm,
                nn,
                k,
                &alpha,
                x.ptr as *const f32,
                x.ld,
                x.stride,
                y.ptr as *const f32,
                y.ld,
                y.stride,
                &beta,
                c.ptr as *mut f32,
                c.ld,
                c.stride,
                batch as i32,
            )
        } else {
            let t = cudaDataType::CUDA_R_16BF;
            bsys::cublasGemmStridedBatchedEx(
                dev.blas.0,
                op(ta),
                op(tb),
                mm,
                nn,
                k,
                &alpha as *const f32 as _,
                x.ptr as _,
                t,
                x.ld,
                x.stride,
                y.ptr as _,
                t,
                y.ld,
                y.stride,
                &beta as *const f32 as _,
                c.ptr as _,
                t,
                c.ld,
                c.stride,
                batch as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
    };
    cublas_ck(st, &format!("gemm m {m} n {n} k {k} batch {batch} {dt:?}")).unwrap_or_else(|e| panic!("{e}"));
}

/// C (m × n, f32, column-major with leading dimension `ldc`) = A·B + β·C for A, B of type `dt`
/// (bf16 or f32) given as (address, transposed, leading dimension): cublasGemmEx with f32
/// accumulation (TF32 where the handle's math mode allows it, i.e. under Tf32 and Bf16 precision).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_ex(
    dev: &Device,
    (m, n, k): (usize, usize, usize),
    a: (u64, bool, usize),
    b: (u64, bool, usize),
    dt: meddpm::DType,
    c: u64,
    ldc: usize,
    beta: f32,
) {
    use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType};
    let t = if dt == meddpm::DType::Bf16 { cudaDataType::CUDA_R_16BF } else { cudaDataType::CUDA_R_32F };
    let alpha = 1.0f32;
    dev.bind();
    let st = unsafe {
        bsys::cublasGemmEx(
            dev.blas.0,
            op(a.1),
            op(b.1),
            m as i32,
            n as i32,
            k as i32,
            &alpha as *const f32 as _,
            a.0 as _,
            t,
            a.2 as i32,
            b.0 as _,
            t,
            b.2 as i32,
            &beta as *const f32 as _,
            c as _,
            cudaDataType::CUDA_R_32F,
            ldc as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    cublas_ck(st, &format!("gemm_ex m {m} n {n} k {k} {dt:?}")).unwrap_or_else(|e| panic!("{e}"));
}

/// out[N,O] = inp[N,I]·wᵀ + b.
/// Rows (batch) up to which a Linear is one launch each way (kernels/linear.cu LIN_ROWS).
const LIN_ROWS: usize = 8;

#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    dev: &Device,
    out: &mut GpuBuf,
    inp: &GpuBuf,
    w: &GpuBuf,
    b: &GpuBuf,
    n: usize,
    i: usize,
    o: usize,
) {
    assert!(
        out.len() == n * o && inp.len() == n * i && w.len() == o * i && b.len() == o,
        "linear N {n} I {i} O {o}: lengths out {} inp {} w {} b {}",
        out.len(),
        inp.len(),
        w.len(),
        b.len()
    );
    require_f32("linear", &[out, inp, w, b]);
    if n <= LIN_ROWS {
        dev.launch(
            "linear_rows_fwd",
            (o as u32, 1, 1),
            (256, 1, 1),
            &[
                P(dev.ptr_mut(out)),
                P(dev.ptr(inp)),
                P(dev.ptr(w)),
                P(dev.ptr(b)),
                I(n as i32),
                I(i as i32),
                I(o as i32),
            ],
        );
        return;
    }
    let op_ = dev.ptr_mut(out);
    let x = Mat::row_major(dev.ptr(inp), i, 0);
    let wm = Mat::row_major(dev.ptr(w), i, 0);
    gemm(dev, n, o, i, 1.0, x, wm.tr(), 0.0, Mat::row_major(op_, o, 0), 1);
    let d = meddpm::Dims::new(n, o, 1, 1, 1);
    crate::elementwise::add_channel_bias(dev, op_, dev.ptr(b), d, Mode::new(Layout::Ncdhw, DType::F32), false);
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    dev: &Device,
    dinp: Option<(&mut GpuBuf, Accum)>,
    dw: &mut GpuBuf,
    db: &mut GpuBuf,
    dout: &GpuBuf,
    inp: &GpuBuf,
    w: &GpuBuf,
    n: usize,
    i: usize,
    o: usize,
) {
    assert!(
        dout.len() == n * o && inp.len() == n * i && w.len() == o * i && dw.len() == o * i && db.len() == o,
        "linear backward N {n} I {i} O {o}: lengths"
    );
    require_f32("linear backward", &[dw, db, dout, inp, w]);
    if n <= LIN_ROWS {
        let (dxp, acc) = match dinp {
            Some((dx, acc)) => {
                assert_eq!(dx.len(), n * i, "linear backward: dinp length");
                require_f32("linear backward", &[dx]);
                (dev.ptr_mut(dx), acc == Accum::Add)
            }
            None => (0, false),
        };
        let blocks = (o * i).div_ceil(1024) + if dxp != 0 { i.div_ceil(32) } else { 0 };
        #[rustfmt::skip]
        let args = [P(dev.ptr_mut(dw)), P(dev.ptr_mut(db)), P(dxp), P(dev.ptr(dout)), P(dev.ptr(inp)), P(dev.ptr(w)),
            I(n as i32), I(i as i32), I(o as i32), I(acc as i32)];
        dev.launch("linear_rows_bwd", (blocks as u32, 1, 1), (1024, 1, 1), &args);
        return;
    }
    let dy = Mat::row_major(dev.ptr(dout), o, 0);
    let x = Mat::row_major(dev.ptr(inp), i, 0);
    // dw[O,I] += doutᵀ·inp
    gemm(dev, o, i, n, 1.0, dy.tr(), x, 1.0, Mat::row_major(dev.ptr_mut(dw), i, 0), 1);
    // db[o] += Σ_n dout[n, o]
    bias_grad_rows(dev, db, dout, n, o);
    if let Some((dx, acc)) = dinp {
        assert_eq!(dx.len(), n * i, "linear backward: dinp length");
        require_f32("linear backward", &[dx]);
        let beta = if acc == Accum::Add { 1.0 } else { 0.0 };
        // dinp[N,I] = dout·w
        let wm = Mat::row_major(dev.ptr(w), i, 0);
        gemm(dev, n, i, o, 1.0, dy, wm, beta, Mat::row_major(dev.ptr_mut(dx), i, 0), 1);
    }
}

/// db[c] += Σₙ rows[n, c] over f32 buffers (`Backend::bias_grad_rows`; Linear's bias gradient).
pub(crate) fn bias_grad_rows(dev: &Device, db: &mut GpuBuf, rows: &GpuBuf, n: usize, c: usize) {
    assert!(
        db.len() == c && rows.len() == n * c,
        "bias_grad_rows: db {} rows {} for n={n} c={c}",
        db.len(),
        rows.len()
    );
    require_f32("bias_grad_rows", &[db, rows]);
    dev.launch(
        "rows_sum_accum",
        (c.div_ceil(128) as u32, 1, 1),
        (128, 1, 1),
        &[P(dev.ptr_mut(db)), P(dev.ptr(rows)), I(n as i32), I(c as i32)],
    );
}
