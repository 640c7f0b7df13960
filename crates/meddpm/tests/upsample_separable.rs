//! `cpu/upsample.rs` computes trilinear ×2 upsampling as three 1-D passes; this checks it, and its
//! backward, against the direct 8-corner formula (written out here) on odd shapes, in f64.

use meddpm::cpu::upsample::{axis_taps, upsample_backward, upsample_forward};
use meddpm::testing::{compare, randn_f64, Tolerance};
use meddpm::{Accum, Dims};

#[test]
fn separable_equals_eight_corners() {
    for x in [Dims::new(2, 3, 3, 5, 4), Dims::new(1, 2, 1, 2, 7), Dims::new(1, 1, 4, 1, 1)] {
        let (td, th, tw) = (axis_taps(x.d), axis_taps(x.h), axis_taps(x.w));
        let inp = randn_f64(5, 0, x.numel(), 1.0);
        let g = randn_f64(5, 1, x.up2().numel(), 1.0);
        let prior = randn_f64(5, 2, x.numel(), 1.0);
        let (mut want, mut want_dx) = (vec![0.0; x.up2().numel()], prior.clone());
        let mut j = 0;
        for nc in 0..x.n * x.c {
            let at = |d: usize, h: usize, w: usize| nc * x.s() + (d * x.h + h) * x.w + w;
            for &(d0, d1, a0, a1) in &td {
                for &(h0, h1, b0, b1) in &th {
                    for &(w0, w1, c0, c1) in &tw {
                        for (id, wd) in [(d0, a0), (d1, a1)] {
                            for (ih, wh) in [(h0, b0), (h1, b1)] {
                                for (iw, ww) in [(w0, c0), (w1, c1)] {
                                    want[j] += wd * wh * ww * inp[at(id, ih, iw)];
                                    want_dx[at(id, ih, iw)] += wd * wh * ww * g[j];
                                }
                            }
                        }
                        j += 1;
                    }
                }
            }
        }
        let tol = Tolerance::new(1e-12, 1e-12);
        let mut out = vec![0.0; x.up2().numel()];
        upsample_forward(&mut out, &inp, x);
        compare(&format!("{x} forward"), &out, &want, tol).unwrap();
        let mut dx = prior.clone();
        upsample_backward((&mut dx, Accum::Add), &g, x);
        compare(&format!("{x} backward (add)"), &dx, &want_dx, tol).unwrap();
    }
}
