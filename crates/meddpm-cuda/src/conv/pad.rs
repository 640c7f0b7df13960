//! Channel padding: a forward whose Cin or Cout is not a multiple of 4 (the first conv, Cin = 3;
//! the last, Cout = 1) can run through the shape padded with zeros to a multiple of 8, which
//! cuDNN runs on tensor cores; timed against the plain call on first use (`MEDDPM_CONV_PAD=0/1`
//! forbids/forces it). The padded sums are the same sums (the extra terms are exact zeros).

use meddpm::ConvShape;

use super::algo_cache::{ConvCache, Pad};
use super::cudnn::run_forward;
use super::desc::{compute_type, Dir};
use crate::buf::Mode;
use crate::device::{Arg, Device};

/// Channel counts that keep cuDNN off its tensor-core kernels (Cin = 3 of the first conv, Cout = 1
/// of the last) are padded with zeros to a multiple of 8: the shape to run instead, if any.
pub(super) fn padded_shape(cs: ConvShape) -> Option<ConvShape> {
    let up = |c: usize| if c.is_multiple_of(4) { c } else { c.next_multiple_of(8) };
    let (cin, cout) = (up(cs.x.c), up(cs.cout));
    (cin != cs.x.c || cout != cs.cout).then(|| ConvShape::new(cs.x.with_c(cin), cout, cs.k, cs.stride))
}

/// out = conv(inp, w) + b through the zero-padded shape `pcs`: the padded channels of the input and
/// the padded rows/columns of the weights are 0, so the real output channels are the same sums; the
/// bias is added while copying the real channels out.
#[allow(clippy::too_many_arguments)]
pub(super) fn forward_padded(
    dev: &Device,
    cache: &mut ConvCache,
    cs: ConvShape,
    pcs: ConvShape,
    xp: u64,
    wp: u64,
    bp: u64,
    yp: u64,
) {
    let cdt = compute_type(cache.precision);
    let mode = Mode::new(cache.layout, cdt);
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
    pad_nc(dev, pw, wp, cs.cout, pcs.cout, cs.x.c, pcs.x.c, k3 as i64, mode);
    let px = match &mut pad.x {
        Some(b) => {
            let p = dev.ptr_mut(b);
            pad_nc(dev, p, xp, cs.x.n, cs.x.n, cs.x.c, pcs.x.c, cs.x.s() as i64, mode);
            p
        }
        None => xp,
    };
    let py = pad.y.as_mut().map(|b| dev.ptr_mut(b));
    let a = cache.algo(dev, Dir::Fwd, pcs, px, pw, py.unwrap_or(yp));
    match py {
        Some(py) => {
            run_forward(dev, cache, a, pcs, false, px, pw, 0, py, cache.layout, false, None);
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
                    Arg::I(mode.cl() as i32),
                    Arg::I(mode.bf_flag() | (mode.bf_flag() << 1)),
                ],
            );
        }
        None => {
            run_forward(dev, cache, a, pcs, false, px, pw, bp, yp, cache.layout, true, None);
        }
    }
}

/// dst (Np, Cp, S) = src (N, C, S) zero-padded, both in `mode`.
#[allow(clippy::too_many_arguments)]
fn pad_nc(dev: &Device, dst: u64, src: u64, n: usize, np: usize, c: usize, cp: usize, s: i64, mode: Mode) {
    let (cl, bf) = (mode.cl(), mode.bf_flag());
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
