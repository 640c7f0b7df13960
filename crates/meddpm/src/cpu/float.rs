//! The small float trait the CPU kernels are generic over, and the one safe GEMM wrapper.
//!
//! Every kernel in `cpu/` is written once over [`Float`] and instantiated with `f32` by
//! [`super::CpuBackend`] and with `f64` by the finite-difference gradient checks
//! (`tests/gradcheck.rs`), so the checks measure the math, not fp32 rounding.
//! [`gemm`] wraps `gemm::gemm` (the only `unsafe` in the CPU backend) behind bounds-checked
//! strided matrix views; its semantics are plain `C (+)= A·B`. [`vectorized`] runs a kernel body
//! under `pulp`'s runtime CPU dispatch (AVX2 + FMA where present), and [`sum_f64`] is the
//! f64 accumulation of the reductions, in a fixed order the compiler can vectorise.

use std::fmt::Debug;
use std::iter::Sum;
use std::ops::{Add, AddAssign, Div, DivAssign, Mul, MulAssign, Neg, Sub, SubAssign};

use crate::backend::Accum;

/// `f32` or `f64`: what the CPU kernels need from a real number.
pub trait Float:
    Copy
    + Send
    + Sync
    + Debug
    + Default
    + PartialOrd
    + Sum
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
    + DivAssign
    + 'static
{
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    fn exp(self) -> Self;
    fn sqrt(self) -> Self;
    fn abs(self) -> Self;
    /// self·a + b with one rounding (a single FMA instruction where the CPU has one).
    fn mul_add(self, a: Self, b: Self) -> Self;
    fn zero() -> Self {
        Self::from_f64(0.0)
    }
    fn one() -> Self {
        Self::from_f64(1.0)
    }
    fn max(self, o: Self) -> Self {
        if o > self {
            o
        } else {
            self
        }
    }
    fn min(self, o: Self) -> Self {
        if o < self {
            o
        } else {
            self
        }
    }
}

impl Float for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn exp(self) -> Self {
        f32::exp(self)
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn abs(self) -> Self {
        f32::abs(self)
    }
    #[inline(always)]
    fn mul_add(self, a: Self, b: Self) -> Self {
        f32::mul_add(self, a, b)
    }
}

impl Float for f64 {
    fn from_f64(x: f64) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    fn abs(self) -> Self {
        f64::abs(self)
    }
    #[inline(always)]
    fn mul_add(self, a: Self, b: Self) -> Self {
        f64::mul_add(self, a, b)
    }
}

/// Run `f` compiled for the best instruction set of this CPU (pulp's runtime dispatch: AVX2 + FMA
/// on x86-64 where present). `f` and everything it calls must be `#[inline(always)]`.
#[inline(always)]
pub fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    struct Op<F>(F);
    impl<R, F: FnOnce() -> R> pulp::WithSimd for Op<F> {
        type Output = R;
        #[inline(always)]
        fn with_simd<S: pulp::Simd>(self, _: S) -> R {
            (self.0)()
        }
    }
    pulp::Arch::new().dispatch(Op(f))
}

/// Σ f(x) in f64 over `xs`, as 8 interleaved partial sums added at the end: a fixed order
/// (deterministic), and independent chains that vectorise, unlike one sequential sum.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
pub fn sum_f64<T: Float>(xs: &[T], f: impl Fn(f64) -> f64) -> f64 {
    let mut acc = [0f64; 8];
    let chunks = xs.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|&v| f(v.to_f64())).sum();
    for c in chunks {
        for l in 0..8 {
            acc[l] += f(c[l].to_f64());
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// Σ f(x, y) over pairs of `xs` and `ys` (equal lengths), in the order of [`sum_f64`].
#[inline(always)]
#[allow(clippy::needless_range_loop)]
pub fn sum2_f64<T: Float>(xs: &[T], ys: &[T], f: impl Fn(f64, f64) -> f64) -> f64 {
    assert_eq!(xs.len(), ys.len(), "sum2_f64: lengths");
    let mut acc = [0f64; 8];
    let (xc, yc) = (xs.chunks_exact(8), ys.chunks_exact(8));
    let tail: f64 = xc.remainder().iter().zip(yc.remainder()).map(|(&x, &y)| f(x.to_f64(), y.to_f64())).sum();
    for (x, y) in xc.zip(yc) {
        for l in 0..8 {
            acc[l] += f(x[l].to_f64(), y[l].to_f64());
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// Write (`Overwrite`) or accumulate (`Add`) one input-gradient element.
#[inline]
pub fn put<T: Float>(dst: &mut T, v: T, acc: Accum) {
    match acc {
        Accum::Overwrite => *dst = v,
        Accum::Add => *dst += v,
    }
}

/// A read-only strided matrix view: element (r, c) is `data[r·rs + c·cs]`.
#[derive(Clone, Copy)]
pub struct Mat<'a, T> {
    pub data: &'a [T],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> Mat<'a, T> {
    /// Row-major `rows × cols` with row stride `ld` (≥ cols).
    pub fn new(data: &'a [T], rows: usize, cols: usize, ld: usize) -> Self {
        Mat { data, rows, cols, rs: ld, cs: 1 }
    }
    /// Contiguous row-major `rows × cols`.
    pub fn dense(data: &'a [T], rows: usize, cols: usize) -> Self {
        Self::new(data, rows, cols, cols)
    }
    /// The transpose (no copy).
    pub fn t(self) -> Self {
        Mat { data: self.data, rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs }
    }
}

/// A mutable strided matrix view (row-major with row stride `rs`).
pub struct MatMut<'a, T> {
    pub data: &'a mut [T],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
}

impl<'a, T> MatMut<'a, T> {
    pub fn new(data: &'a mut [T], rows: usize, cols: usize, ld: usize) -> Self {
        MatMut { data, rows, cols, rs: ld }
    }
    pub fn dense(data: &'a mut [T], rows: usize, cols: usize) -> Self {
        Self::new(data, rows, cols, cols)
    }
}

fn fits(len: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> bool {
    rows == 0 || cols == 0 || (rows - 1) * rs + (cols - 1) * cs < len
}

/// `C = A·B` (`accumulate == false`) or `C += A·B` (`accumulate == true`), with `alpha` scaling
/// the product. Multi-threaded (rayon) when the product is large enough to pay for it.
pub fn gemm<T: Float>(c: MatMut<'_, T>, accumulate: bool, alpha: T, a: Mat<'_, T>, b: Mat<'_, T>) {
    let (m, n, k) = (c.rows, c.cols, a.cols);
    assert!(
        a.rows == m && b.rows == k && b.cols == n,
        "gemm shapes: C {m}x{n}, A {}x{}, B {}x{}",
        a.rows,
        k,
        b.rows,
        b.cols
    );
    assert!(fits(a.data.len(), a.rows, a.cols, a.rs, a.cs), "gemm: A view out of bounds");
    assert!(fits(b.data.len(), b.rows, b.cols, b.rs, b.cs), "gemm: B view out of bounds");
    assert!(fits(c.data.len(), c.rows, c.cols, c.rs, 1), "gemm: C view out of bounds");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                c.data[r * c.rs..r * c.rs + n].fill(T::zero());
            }
        }
        return;
    }
    let par = if (m * n * k) as f64 >= 2e5 { gemm::Parallelism::Rayon(0) } else { gemm::Parallelism::None };
    // SAFETY: the three views were checked above to lie inside their slices; `c` is borrowed
    // mutably and cannot alias `a` or `b`; T is f32 or f64, which `gemm::gemm` supports.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.data.as_mut_ptr(),
            1,
            c.rs as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            T::one(),
            alpha,
            false,
            false,
            false,
            par,
        )
    }
}
