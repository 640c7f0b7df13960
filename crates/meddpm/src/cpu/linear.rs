//! Linear layer (PyTorch `nn.Linear`, weight stored (O, I)): out[N, O] = inp[N, I]·wᵀ + b.
//!
//! Backward: dinp = dout·w, dw += doutᵀ·inp, db += Σ_n dout. Used by the time-embedding MLP and
//! each ResBlock's `emb_layers`; sizes are tiny, so plain GEMMs suffice.

use super::float::{gemm, Float, Mat, MatMut};
use crate::backend::Accum;

#[allow(clippy::too_many_arguments)]
pub fn linear_forward<T: Float>(out: &mut [T], inp: &[T], w: &[T], b: &[T], n: usize, i: usize, o: usize) {
    assert!(
        out.len() == n * o && inp.len() == n * i,
        "linear: out {} / inp {} vs n={n} i={i} o={o}",
        out.len(),
        inp.len()
    );
    assert!(w.len() == o * i && b.len() == o, "linear: w {} / b {} vs (o={o}, i={i})", w.len(), b.len());
    for row in out.chunks_mut(o) {
        row.copy_from_slice(b);
    }
    gemm(MatMut::dense(out, n, o), true, T::one(), Mat::dense(inp, n, i), Mat::dense(w, o, i).t());
}

#[allow(clippy::too_many_arguments)]
pub fn linear_backward<T: Float>(
    dinp: Option<(&mut [T], Accum)>,
    dw: &mut [T],
    db: &mut [T],
    dout: &[T],
    inp: &[T],
    w: &[T],
    n: usize,
    i: usize,
    o: usize,
) {
    assert!(dout.len() == n * o && inp.len() == n * i, "linear: dout/inp length vs n={n} i={i} o={o}");
    assert!(w.len() == o * i && dw.len() == o * i && db.len() == o, "linear: w/dw/db length vs (o={o}, i={i})");
    let g = Mat::dense(dout, n, o);
    bias_grad_rows(db, dout, n, o);
    // dw (O × I) += doutᵀ (O × N) · inp (N × I)
    gemm(MatMut::dense(dw, o, i), true, T::one(), g.t(), Mat::dense(inp, n, i));
    if let Some((dx, acc)) = dinp {
        assert_eq!(dx.len(), n * i, "linear: dinp length vs n·i");
        // dinp (N × I) (+)= dout (N × O) · w (O × I)
        gemm(MatMut::dense(dx, n, i), acc == Accum::Add, T::one(), g, Mat::dense(w, o, i));
    }
}

/// db[c] += Σₙ rows[n, c] (`Backend::bias_grad_rows`; Linear's bias gradient).
pub fn bias_grad_rows<T: Float>(db: &mut [T], rows: &[T], n: usize, c: usize) {
    assert!(
        db.len() == c && rows.len() == n * c,
        "bias_grad_rows: db {} rows {} for n={n} c={c}",
        db.len(),
        rows.len()
    );
    for row in rows.chunks(c) {
        for (d, &v) in db.iter_mut().zip(row) {
            *d += v;
        }
    }
}
