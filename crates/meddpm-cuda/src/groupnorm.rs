//! GroupNorm (eps 1e-5, affine) forward and backward, plain or fused with SiLU, for both layouts.
//! Semantics: `Backend::groupnorm_*` (torch.nn.GroupNorm, biased variance); CPU twin cpu/groupnorm.rs.
//!
//! PyTorch spends 41 % of a Med-DDPM sampling forward in a statistics kernel that launches one
//! block per (n, group) — 32 blocks on a 132-SM GPU. Here every pass is parallel over the whole
//! volume: stage 1 (kernels/reduce.cu) reduces chunks of voxels per channel with thousands of
//! blocks, stage 2 (one small block per group) combines the chunk partials in double, stage 3 is
//! elementwise. Three passes over the data forward (read x; read x, write out [and act]), and
//! three backward (read dout, x [, y]; again, write dx).

use meddpm::{Accum, Dims};

use crate::buf::GpuBuf;
use crate::device::{Arg::*, Device};
use crate::elementwise::{chunking, launch_partial, same_bf, Partial};

pub(crate) const EPS: f32 = 1e-5;

/// Forward: out = GN(inp); with `act` also act = silu(out). mean/rstd [N·G] saved.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    dev: &Device,
    out: &mut GpuBuf,
    act: Option<&mut GpuBuf>,
    mean: &mut GpuBuf,
    rstd: &mut GpuBuf,
    inp: &GpuBuf,
    gamma: &GpuBuf,
    beta: &GpuBuf,
    x: Dims,
    groups: usize,
    cl: bool,
) {
    check(x, groups, inp.len(), gamma.len(), mean.len());
    assert_eq!(out.len(), x.numel(), "groupnorm {x}: out length");
    let bf = match &act {
        Some(a) => same_bf("groupnorm+silu", &[inp, out, a]),
        None => same_bf("groupnorm", &[inp, out]),
    };
    let (len, nchunks) = chunking(x, cl);
    let part = dev.scratch(x.n * nchunks * x.c * 2);
    let pp = dev.ptr(&*part);
    let xp = dev.ptr(inp);
    launch_partial(dev, Partial::Stats, x, groups, cl, &[xp], pp, bf);
    let (mp, rp) = (dev.ptr_mut(mean), dev.ptr_mut(rstd));
    dev.launch(
        "gn_stats_finalize",
        (groups as u32, 1, 1),
        (256, 1, 1),
        &[
            P(pp),
            P(mp),
            P(rp),
            I(x.n as i32),
            I(x.c as i32),
            L(x.s() as i64),
            I(groups as i32),
            I(len as i32),
            I(nchunks as i32),
            F(EPS),
        ],
    );
    let ap = act.map(|a| {
        assert_eq!(a.len(), x.numel(), "groupnorm+silu {x}: act length");
        dev.ptr_mut(a)
    });
    let v4 = vec4_ok(x, cl);
    dev.launch1(
        if v4 { "gn_apply4" } else { "gn_apply" },
        if v4 { x.numel() / 4 } else { x.numel() },
        &[
            P(xp),
            P(mp),
            P(rp),
            P(dev.ptr(gamma)),
            P(dev.ptr(beta)),
            P(dev.ptr_mut(out)),
            P(ap.unwrap_or(0)),
            I(x.c as i32),
            L(x.s() as i64),
            I(groups as i32),
            L(x.numel() as i64),
            I(cl as i32),
            I(bf),
        ],
    );
}

/// Whether the 4-wide elementwise kernels apply: groups of four consecutive elements share the
/// sample and are one channel (NCDHW, S % 4 == 0) or four consecutive channels (NDHWC, C % 4 == 0).
fn vec4_ok(x: Dims, cl: bool) -> bool {
    if cl {
        x.c.is_multiple_of(4)
    } else {
        x.s().is_multiple_of(4)
    }
}

fn check(x: Dims, groups: usize, inp: usize, gamma: usize, stats: usize) {
    assert!(
        groups > 0 && x.c.is_multiple_of(groups) && inp == x.numel() && gamma == x.c && stats == x.n * groups,
        "groupnorm {x} groups {groups}: lengths inp {inp} gamma {gamma} mean/rstd {stats}"
    );
}

/// Backward: dinp (per Accum), dgamma += , dbeta += . With `y` (the saved GroupNorm output) the
/// incoming gradient is first multiplied by silu'(y) on the fly (fused GroupNorm+SiLU backward).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    dev: &Device,
    dinp: (&mut GpuBuf, Accum),
    dgamma: &mut GpuBuf,
    dbeta: &mut GpuBuf,
    dout: &GpuBuf,
    y: Option<&GpuBuf>,
    inp: &GpuBuf,
    mean: &GpuBuf,
    rstd: &GpuBuf,
    gamma: &GpuBuf,
    x: Dims,
    groups: usize,
    cl: bool,
) {
    check(x, groups, inp.len(), gamma.len(), mean.len());
    assert!(dout.len() == x.numel() && dinp.0.len() == x.numel(), "groupnorm backward {x}: dout/dinp lengths");
    let bf = match y {
        Some(y) => same_bf("groupnorm+silu backward", &[dinp.0, dout, inp, y]),
        None => same_bf("groupnorm backward", &[dinp.0, dout, inp]),
    };
    let (_, nchunks) = chunking(x, cl);
    let npart = x.n * nchunks * x.c * 2;
    let scratch = dev.scratch(npart + x.n * groups * 2);
    let pp = dev.ptr(&*scratch);
    let coef = pp + (npart * 4) as u64;
    let (dp, xp, mp, rp, gp) = (dev.ptr(dout), dev.ptr(inp), dev.ptr(mean), dev.ptr(rstd), dev.ptr(gamma));
    let yp = y.map(|b| dev.ptr(b)).unwrap_or(0);
    launch_partial(dev, Partial::GnBwd, x, groups, cl, &[dp, xp, yp, mp], pp, bf);
    dev.launch(
        "gn_bwd_finalize",
        (groups as u32, 1, 1),
        (256, 1, 1),
        &[
            P(pp),
            P(rp),
            P(gp),
            P(dev.ptr_mut(dgamma)),
            P(dev.ptr_mut(dbeta)),
            P(coef),
            I(x.n as i32),
            I(x.c as i32),
            L(x.s() as i64),
            I(groups as i32),
            I(nchunks as i32),
        ],
    );
    let v4 = vec4_ok(x, cl);
    dev.launch1(
        if v4 { "gn_bwd_apply4" } else { "gn_bwd_apply" },
        if v4 { x.numel() / 4 } else { x.numel() },
        &[
            P(dp),
            P(xp),
            P(yp),
            P(mp),
            P(rp),
            P(gp),
            P(coef),
            P(dev.ptr_mut(dinp.0)),
            I(x.c as i32),
            L(x.s() as i64),
            I(groups as i32),
            L(x.numel() as i64),
            I(cl as i32),
            I((dinp.1 == Accum::Add) as i32),
            I(bf),
        ],
    );
}
