//! 1×1 convs over a concatenation held as its two parts (a decoder ResBlock's skip conv that
//! never stores its concatenation): the data gradient written into the parts and the weight
//! gradient read from them, as cuBLAS GEMMs.

use meddpm::{ConvShape, DType, Layout};

use crate::buf::{require_f32, GpuBuf};
use crate::device::{Arg, Device};

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
    layout: Layout,
) {
    use crate::linear::{gemm_typed, Mat};
    let cl = layout == Layout::Ndhwc;
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
