//! Helpers shared by the GPU parity test binaries (parity.rs, parity_bf16.rs): which convolution
//! path, ours or cuDNN, a conv shape must have taken; the accumulating conv forward vs the CPU;
//! the f32 bias-vector primitives (the same in every precision); GroupNorm+SiLU with an input
//! offset (and the channel sums of its input gradient); the skip concatenation with its GroupNorm
//! statistics; the decoder block's gradient delivered to the concatenation's parts; the identity
//! skip's gradient folded into the GroupNorm+SiLU backward.

use meddpm::cpu::CpuBackend;
use meddpm::{Accum, Backend, ConvShape, Dims};
use meddpm_cuda::CudaBackend;

pub type Buf = <CudaBackend as Backend>::Buf;

/// The accumulating and bias-less forwards (`Backend::conv3d_forward_acc`, the U-Net's residual
/// convs) against the CPU twin: y0 + conv, y0 + conv + b and conv alone, each twice (a shape's
/// first call may search algorithms on a scratch output; the second reuses the choice); then
/// `conv3d_forward_res` (conv + b + z with z = y0) on each bias route, its output starting as NaN.
/// `host` = (x, w, b, y0) as the GPU stores them, `dev` = (x, w, b) on the GPU; `up`/`down` move an
/// output to and from the GPU in the test's storage; `check(what, got, want)` compares.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn check_forward_acc(
    g: &CudaBackend,
    cpu: &CpuBackend,
    cs: ConvShape,
    host: (&[f32], &[f32], &[f32], &[f32]),
    dev: (&Buf, &Buf, &Buf),
    up: &dyn Fn(&[f32]) -> Buf,
    down: &dyn Fn(&Buf) -> Vec<f32>,
    check: &dyn Fn(&str, &[f32], &[f32]),
    tag: &str,
) {
    let (x, w, b, y0) = host;
    let (xg, wg, bg) = dev;
    let (x, w, b) = (x.to_vec(), w.to_vec(), b.to_vec());
    for (acc, bias) in [(Accum::Add, false), (Accum::Add, true), (Accum::Overwrite, false)] {
        let mut want = y0.to_vec();
        cpu.conv3d_forward_acc((&mut want, acc), &x, &w, bias.then_some(&b), cs);
        for rep in 0..2 {
            let mut yg = up(y0);
            g.conv3d_forward_acc((&mut yg, acc), xg, wg, bias.then_some(bg), cs);
            check(&format!("{tag} y {acc:?} bias {bias} (rep {rep})"), &down(&yg), &want);
        }
    }
    // out = conv + b + z (`conv3d_forward_res`, z = y0 in its own buffer): cuDNN's fused call with
    // z forced, forbidden (our bias pass onto z, then β = 1), and timed; twice each
    let mut want = y0.to_vec();
    cpu.conv3d_forward_acc((&mut want, Accum::Add), &x, &w, Some(&b), cs);
    let zg = up(y0);
    for mode in [Some(true), Some(false), None] {
        g.set_choices(|c| c.fused_bias = mode);
        for rep in 0..2 {
            let mut yg = up(&vec![f32::NAN; y0.len()]);
            g.conv3d_forward_res(&mut yg, xg, wg, bg, &zg, cs);
            check(&format!("{tag} y = conv + b + z (fused {mode:?}, rep {rep})"), &down(&yg), &want);
        }
    }
    g.set_choices(|c| c.fused_bias = None);
    assert_eq!(down(&zg), down(&up(y0)), "{tag}: conv3d_forward_res must leave z alone");
}

/// Which of our few-channel direct kernels (kernels/conv3d.cu) a conv shape may run through,
/// decided by hand from the shape: [forward (Cin ≤ 4 or Cout ≤ 4, or where `cin8`, a bf16 NDHWC
/// backend with the tensor-core kernels on, Cin ≤ 8 with Cout a multiple of 8 up to 64), data
/// gradient (Cout ≤ 4)]; 3×3×3 stride 1 only.
pub fn small_expected(cs: ConvShape, cin8: bool) -> [bool; 2] {
    let direct = cs.k == 3 && cs.stride == 1;
    let cin8 = cin8 && cs.x.c <= 8 && cs.cout.is_multiple_of(8) && cs.cout <= 64;
    [direct && (cs.x.c <= 4 || cs.cout <= 4 || cin8), direct && cs.cout <= 4]
}

/// After a call with our few-channel kernels forced on/off (`small`), the path the backend reports
/// for direction `i` (0 forward, 1 data gradient) is the forced one where the shape is theirs.
pub fn check_small_path(g: &CudaBackend, cs: ConvShape, small: Option<bool>, i: usize, tag: &str, cin8: bool) {
    let used = g.conv_small_used(&cs)[i];
    let what = format!("{tag}: {} ran ours: {used:?}", ["forward", "data gradient"][i]);
    match (small_expected(cs, cin8)[i], small) {
        (false, _) => assert_eq!(used, None, "{what}"),
        (true, Some(f)) => assert_eq!(used, Some(f), "{what}"),
        (true, None) => assert!(used.is_some(), "{what}"), // timed: either path
    }
}

/// The f32 bias-vector primitives on `g` against the CPU, in any precision (parameters and their
/// gradients stay f32): `add_bias_vectors` bit for bit, `bias_grad_rows` (db[c] += Σₙ rows[n, c],
/// 3 rows of 37) to 1e-6; both CPU results are checked against plain sums first.
pub fn check_bias_vector_ops(g: &CudaBackend, cpu: &CpuBackend, rnd: &dyn Fn(usize, u64, f32) -> Vec<f32>, tag: &str) {
    let up = |v: &[f32]| {
        let mut b = g.alloc(v.len()).unwrap();
        g.upload(v, &mut b);
        b
    };
    let down = |b: &Buf| {
        let mut h = vec![0f32; b.len()];
        g.download(b, &mut h);
        h
    };
    let (va, vb) = (rnd(37, 11, 1.0), rnd(37, 12, 1e-3));
    let mut vsum = vec![0f32; 37];
    cpu.add_bias_vectors(&mut vsum, &va, &vb);
    assert!(vsum.iter().zip(va.iter().zip(&vb)).all(|(s, (a, b))| *s == a + b), "CPU add_bias_vectors is a + b in f32");
    let mut sg = g.alloc(37).unwrap();
    g.add_bias_vectors(&mut sg, &up(&va), &up(&vb));
    assert_eq!(down(&sg), vsum, "add_bias_vectors [{tag}]: f32 a + b, bit for bit");
    // all at once (one launch on CUDA): vectors of different lengths, each bit for bit
    let (wa, wb) = (rnd(300, 16, 1.0), rnd(300, 17, 1.0));
    let mut wsum = vec![0f32; 300];
    cpu.add_bias_vectors(&mut wsum, &wa, &wb);
    let (mut s1, mut s2) = (g.alloc(37).unwrap(), g.alloc(300).unwrap());
    let (ga, gb, gwa, gwb) = (up(&va), up(&vb), up(&wa), up(&wb));
    g.add_bias_vectors_all(&mut [(&mut s1, &ga, &gb), (&mut s2, &gwa, &gwb)]);
    assert!(down(&s1) == vsum && down(&s2) == wsum, "add_bias_vectors_all [{tag}]: f32 a + b, bit for bit");
    let (rows, db0) = (rnd(3 * 37, 14, 1.0), rnd(37, 15, 1.0));
    let mut db = db0.clone();
    cpu.bias_grad_rows(&mut db, &rows, 3, 37);
    for c in 0..37 {
        let want = db0[c] as f64 + (0..3).map(|n| rows[n * 37 + c] as f64).sum::<f64>();
        assert!((db[c] as f64 - want).abs() < 1e-5, "CPU bias_grad_rows [{c}]: {} vs {want}", db[c]);
    }
    let mut dbg = up(&db0);
    g.bias_grad_rows(&mut dbg, &up(&rows), 3, 37);
    let got = down(&dbg);
    for c in 0..37 {
        let tol = 1e-6 * db[c].abs().max(1.0);
        assert!((got[c] - db[c]).abs() <= tol, "bias_grad_rows [{tag}] [{c}]: {} vs CPU {}", got[c], db[c]);
    }
}

/// Fused GroupNorm+SiLU with a per-(n, c) input offset (`off`, f32 [N·C]: the ResBlock's folded
/// time embedding) on `g` against the CPU twin: the forward's output and statistics, the recompute
/// (bit for bit the forward), the backward's dx (per `acc`), dγ and dβ; then the backward with
/// the channel sums of dx (`groupnorm_silu_backward_sum`). `host` = (x, dy, dx0) as
/// the GPU stores them; `up`/`down` move an activation to and from the GPU, `upr`/`downr` an f32
/// vector; `check(what, got, want)` compares. `sum_round`: the relative rounding of the CPU's stored
/// dx (bf16: 2^-8 bounds it, 0 in f32): its channel sums add the stored, rounded values while CUDA
/// forms them from the backward's unrounded sums, so they may differ by up to `sum_round` · Σ|dx|
/// of the channel before `check`'s tolerance applies.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn check_gn_offset(
    g: &CudaBackend,
    cpu: &CpuBackend,
    (x, groups, acc, sum_round): (Dims, usize, Accum, f64),
    host: (&[f32], &[f32], &[f32]),
    (gamma, beta, off): (&[f32], &[f32], &[f32]),
    (up, down): (&dyn Fn(&[f32]) -> Buf, &dyn Fn(&Buf) -> Vec<f32>),
    (upr, downr): (&dyn Fn(&[f32]) -> Buf, &dyn Fn(&Buf) -> Vec<f32>),
    check: &dyn Fn(&str, &[f32], &[f32]),
    tag: &str,
) {
    let (xin, dy, dx0) = host;
    let (xin, dy, gamma, beta, off) = (xin.to_vec(), dy.to_vec(), gamma.to_vec(), beta.to_vec(), off.to_vec());
    let (n, ng) = (x.numel(), x.n * groups);
    let (mut a_c, mut m_c, mut r_c) = (vec![0f32; n], vec![0f32; ng], vec![0f32; ng]);
    let (mut dg_c, mut db_c, mut dx_c) = (vec![0.5f32; x.c], vec![0.25f32; x.c], dx0.to_vec());
    cpu.groupnorm_silu_forward(&mut a_c, &mut m_c, &mut r_c, &xin, Some(&off), &gamma, &beta, x, groups);
    let d = (&mut dx_c, acc);
    cpu.groupnorm_silu_backward(d, &mut dg_c, &mut db_c, &dy, &xin, Some(&off), &m_c, &r_c, &gamma, &beta, x, groups);
    let (xg, dyg, og, gg, bg) = (up(&xin), up(&dy), upr(&off), upr(&gamma), upr(&beta));
    let (mut ag, mut a2, mut mg, mut rg) =
        (up(&vec![0.0; n]), up(&vec![0.0; n]), upr(&vec![0.0; ng]), upr(&vec![0.0; ng]));
    let (mut dgg, mut dbg, mut dxg) = (upr(&vec![0.5; x.c]), upr(&vec![0.25; x.c]), up(dx0));
    g.groupnorm_silu_forward(&mut ag, &mut mg, &mut rg, &xg, Some(&og), &gg, &bg, x, groups);
    g.groupnorm_silu_recompute(&mut a2, &mg, &rg, &xg, Some(&og), &gg, &bg, x, groups);
    let d = (&mut dxg, acc);
    g.groupnorm_silu_backward(d, &mut dgg, &mut dbg, &dyg, &xg, Some(&og), &mg, &rg, &gg, &bg, x, groups);
    let tag = format!("groupnorm+silu, input offset {x} G{groups} {acc:?} [{tag}]");
    assert!(down(&a2) == down(&ag), "{tag}: recompute differs from the forward");
    check(&format!("{tag} silu out"), &down(&ag), &a_c);
    check(&format!("{tag} mean"), &downr(&mg), &m_c);
    check(&format!("{tag} rstd"), &downr(&rg), &r_c);
    check(&format!("{tag} dx"), &down(&dxg), &dx_c);
    check(&format!("{tag} dgamma+="), &downr(&dgg), &dg_c);
    check(&format!("{tag} dbeta+="), &downr(&dbg), &db_c);
    // with dx's channel sums (`groupnorm_silu_backward_sum`, the ResBlock's time-embedding
    // gradient: CUDA NDHWC forms them from the backward's own sums, else a pass over dx); dx and
    // the sums start as NaN (both overwritten)
    let nc = x.n * x.c;
    let (mut dg_c, mut db_c, mut dx_c, mut s_c) =
        (vec![0.5f32; x.c], vec![0.25f32; x.c], vec![0f32; n], vec![0f32; nc]);
    let (ms, gb) = ((&m_c, &r_c), (&gamma, &beta));
    cpu.groupnorm_silu_backward_sum(
        &mut dx_c,
        &mut s_c,
        &mut dg_c,
        &mut db_c,
        &dy,
        &xin,
        Some(&off),
        ms,
        gb,
        x,
        groups,
    );
    let (mut dgg, mut dbg) = (upr(&vec![0.5; x.c]), upr(&vec![0.25; x.c]));
    let (mut dxg, mut sg) = (up(&vec![f32::NAN; n]), upr(&vec![f32::NAN; nc]));
    let (ms, gb) = ((&mg, &rg), (&gg, &bg));
    g.groupnorm_silu_backward_sum(&mut dxg, &mut sg, &mut dgg, &mut dbg, &dyg, &xg, Some(&og), ms, gb, x, groups);
    check(&format!("{tag} dx (with sums)"), &down(&dxg), &dx_c);
    let got = downr(&sg);
    // the rounding bound per (n, c) over the channel's S voxels (host layout NCDHW)
    let want: Vec<f32> = (0..nc)
        .map(|k| {
            let l1: f64 = dx_c[k * x.s()..(k + 1) * x.s()].iter().map(|v| v.abs() as f64).sum();
            let b = sum_round * l1;
            (s_c[k] as f64 + (got[k] as f64 - s_c[k] as f64).clamp(-b, b)) as f32
        })
        .collect();
    check(&format!("{tag} channel sums of dx"), &got, &want);
    check(&format!("{tag} dgamma+= (with sums)"), &downr(&dgg), &dg_c);
    check(&format!("{tag} dbeta+= (with sums)"), &downr(&dbg), &db_c);
    // with the recomputation of the forward's output riding along (`groupnorm_silu_backward_act`,
    // what the U-Net's backward calls): with and without the sums, bit for bit the calls above,
    // and act bit for bit the forward's output
    let (mut dgs, mut dbs) = (upr(&vec![0.5; x.c]), upr(&vec![0.25; x.c]));
    let (mut dxs, mut ss, mut acts) = (up(&vec![f32::NAN; n]), upr(&vec![f32::NAN; nc]), up(&vec![f32::NAN; n]));
    let d = (&mut dxs, Accum::Overwrite);
    g.groupnorm_silu_backward_act(
        d,
        Some(&mut ss),
        &mut acts,
        (&mut dgs, &mut dbs),
        &dyg,
        &xg,
        Some(&og),
        ms,
        gb,
        x,
        groups,
    );
    assert!(down(&acts) == down(&ag), "{tag}: backward's act (with sums) differs from the forward");
    assert!(down(&dxs) == down(&dxg) && downr(&ss) == downr(&sg), "{tag}: backward with act: dx / sums differ");
    assert!(
        downr(&dgs) == downr(&dgg) && downr(&dbs) == downr(&dbg),
        "{tag}: backward with act: dgamma / dbeta differ"
    );
    let (mut dga, mut dba) = (upr(&vec![0.5; x.c]), upr(&vec![0.25; x.c]));
    let (mut dxa, mut acta) = (up(dx0), up(&vec![f32::NAN; n]));
    let d = (&mut dxa, acc);
    g.groupnorm_silu_backward_act(d, None, &mut acta, (&mut dga, &mut dba), &dyg, &xg, Some(&og), ms, gb, x, groups);
    let (mut dgp, mut dbp, mut dxp) = (upr(&vec![0.5; x.c]), upr(&vec![0.25; x.c]), up(dx0));
    let (mg2, rg2) = ms;
    let (gg2, bg2) = gb;
    let d = (&mut dxp, acc);
    g.groupnorm_silu_backward(d, &mut dgp, &mut dbp, &dyg, &xg, Some(&og), mg2, rg2, gg2, bg2, x, groups);
    assert!(down(&acta) == down(&ag), "{tag}: backward's act differs from the forward");
    assert!(down(&dxa) == down(&dxp), "{tag}: backward with act: dx differs");
    assert!(
        downr(&dga) == downr(&dgp) && downr(&dba) == downr(&dbp),
        "{tag}: backward with act: dgamma / dbeta differ"
    );
}

/// `groupnorm_silu_backward_inplace_act` on `g` (the decoder ResBlock's backward over its skip
/// concatenation): from `d` = dy and x = `xin` (host values as the GPU stores them), d must become
/// the out-of-place backward's dx and x the forward's SiLU output, with the same dγ and dβ (onto
/// `dg0`, `db0`), all bit for bit: `want` = (dx, forward output, dγ, dβ) of those calls.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn check_gn_inplace_act(
    g: &CudaBackend,
    (x, groups): (Dims, usize),
    (xin, dy): (&[f32], &[f32]),
    (dg0, db0): (&[f32], &[f32]),
    (ms, gb): ((&Buf, &Buf), (&Buf, &Buf)),
    want: (&[f32], &[f32], &[f32], &[f32]),
    (up, down): (&dyn Fn(&[f32]) -> Buf, &dyn Fn(&Buf) -> Vec<f32>),
    (upr, downr): (&dyn Fn(&[f32]) -> Buf, &dyn Fn(&Buf) -> Vec<f32>),
    tag: &str,
) {
    let (mut dg, mut db, mut d, mut xa) = (upr(dg0), upr(db0), up(dy), up(xin));
    g.groupnorm_silu_backward_inplace_act(&mut d, &mut xa, (&mut dg, &mut db), ms, gb, x, groups);
    assert!(down(&d) == want.0, "{tag}: in-place backward with act: dx differs");
    assert!(down(&xa) == want.1, "{tag}: in-place backward's act differs from the forward");
    assert!(downr(&dg) == want.2 && downr(&db) == want.3, "{tag}: in-place dgamma/dbeta with act");
}

/// `groupnorm_silu_backward_act_res` (an identity-skip ResBlock's input gradient: dx per mode +=
/// res + the GroupNorm+SiLU backward, act := silu(GN(x))) with res folded into the backward's
/// pass (the default) against the two calls it replaces (`c.res_fold = false`: add_assign or
/// copy, then the backward), both Accum modes, bit for bit in dx, act, dγ and dβ (onto `dg0`,
/// `db0`); the fold counter proves which path ran. `host` = (x, dy, dx0, res) as the GPU stores
/// them; `up`/`down` move an activation, `upr`/`downr` an f32 vector.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn check_res_fold(
    g: &CudaBackend,
    (x, groups): (Dims, usize),
    (xin, dy, dx0, res): (&[f32], &[f32], &[f32], &[f32]),
    (dg0, db0): (&[f32], &[f32]),
    (ms, gb): ((&Buf, &Buf), (&Buf, &Buf)),
    (up, down): (&dyn Fn(&[f32]) -> Buf, &dyn Fn(&Buf) -> Vec<f32>),
    (upr, downr): (&dyn Fn(&[f32]) -> Buf, &dyn Fn(&Buf) -> Vec<f32>),
    tag: &str,
) {
    let (xg, dyg, rg) = (up(xin), up(dy), up(res));
    for mode in [Accum::Overwrite, Accum::Add] {
        let mut outs = Vec::new();
        for fold in [true, false] {
            g.set_choices(|c| c.res_fold = fold);
            let runs = g.runs().res_fold;
            let (mut dx, mut a, mut dg, mut db) = (up(dx0), up(dy), upr(dg0), upr(db0));
            let d = (&mut dx, mode);
            g.groupnorm_silu_backward_act_res(d, &rg, &mut a, (&mut dg, &mut db), &dyg, &xg, None, ms, gb, x, groups);
            assert_eq!(g.runs().res_fold - runs, fold as u64, "{tag} {mode:?}: the folded path ran {fold}");
            outs.push((down(&dx), down(&a), downr(&dg), downr(&db)));
        }
        g.set_choices(|c| c.res_fold = true);
        let (f, u) = (&outs[0], &outs[1]);
        assert!(f.0 == u.0, "{tag} {mode:?}: dx with res folded in differs from add_assign/copy + backward");
        assert!(f.1 == u.1 && f.2 == u.2 && f.3 == u.3, "{tag} {mode:?}: act / dgamma / dbeta with res folded in");
    }
}

/// `concat_channels_stats` (a decoder ResBlock's skip concatenation with its GroupNorm
/// statistics) on `g` against the CPU twin, with and without a bias on the first part: shapes the
/// fused NDHWC kernel takes (both parts' channels a multiple of the vector width: 8 + 16, 4 + 8,
/// 64 + 32 over 5 508 voxels) and one it does not (3 + 4: the concatenation, then the statistics
/// pass). `rnd(len, seed, scale)` gives values as the GPU stores them; `up`/`down` move an
/// activation of the given shape to and from the GPU, `upr`/`downr` an f32 vector;
/// `check(what, got, want, tol)` compares, the concatenation at `tol.0`, the statistics at `tol.1`.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn check_concat_stats(
    g: &CudaBackend,
    cpu: &CpuBackend,
    rnd: &dyn Fn(usize, u64, f32) -> Vec<f32>,
    (up, down): (&dyn Fn(&[f32], Dims) -> Buf, &dyn Fn(&Buf, Dims) -> Vec<f32>),
    (upr, downr): (&dyn Fn(&[f32]) -> Buf, &dyn Fn(&Buf) -> Vec<f32>),
    check: &dyn Fn(&str, &[f32], &[f32], f64),
    tol: (f64, f64),
    tag: &str,
) {
    let cases = [
        (Dims::new(2, 0, 5, 6, 7), 3, 4, 7),
        (Dims::new(2, 0, 5, 6, 7), 8, 16, 4),
        (Dims::new(2, 0, 5, 6, 7), 4, 8, 3),
        (Dims::new(1, 0, 16, 17, 18), 64, 32, 8),
    ];
    for (i, (x, ca, cb, groups)) in cases.into_iter().enumerate() {
        let (xa, xb, xo) = (x.with_c(ca), x.with_c(cb), x.with_c(ca + cb));
        let s = 100 + 10 * i as u64;
        // a mean offset, so the statistics' shifted sums matter (as the GPU stores it)
        let a: Vec<f32> = rnd(xa.numel(), s, 1.0).iter().map(|v| v + 3.0).collect();
        let a = down(&up(&a, xa), xa);
        let (b, abias) = (rnd(xb.numel(), s + 1, 2.0), rnd(ca, s + 2, 1.0));
        let ng = x.n * groups;
        for bias in [None, Some(&abias)] {
            let (mut cat, mut m, mut r) = (vec![0f32; xo.numel()], vec![0f32; ng], vec![0f32; ng]);
            cpu.concat_channels_stats(&mut cat, &a, bias, &b, (&mut m, &mut r), x, ca, cb, groups);
            let (mut catg, mut mg, mut rg) = (up(&vec![0.0; xo.numel()], xo), upr(&vec![0.0; ng]), upr(&vec![0.0; ng]));
            let bg = bias.map(|v| upr(v));
            let (ag, bbg) = (up(&a, xa), up(&b, xb));
            g.concat_channels_stats(&mut catg, &ag, bg.as_ref(), &bbg, (&mut mg, &mut rg), x, ca, cb, groups);
            let t = format!("concat + statistics {xo} ({ca} + {cb}) G{groups} bias {} [{tag}]", bias.is_some());
            check(&format!("{t} out"), &down(&catg, xo), &cat, tol.0);
            check(&format!("{t} mean"), &downr(&mg), &m, tol.1);
            check(&format!("{t} rstd"), &downr(&rg), &r, tol.1);
        }
    }
}

/// `groupnorm_silu_backward_cat_in` on `g` (a decoder ResBlock's input gradient over its skip
/// concatenation cat([h + bias, s]), with the skip conv's weight gradient) against the trait's
/// separate steps run as separate calls on `g` (the concatenation built, the skip conv's weight
/// gradient from it, the in-place GroupNorm+SiLU backward with act, the skip conv's data gradient
/// added, the split): x := silu(GN(x)) and dγ, dβ bit for bit (the same arithmetic on the same
/// stored values, whether x is read from the built concatenation or from its parts), the parts
/// and the weight gradient within `tol` (other summation orders: cuBLAS against cuDNN, in f32
/// rather than through a bf16 temporary, and with `Accum::Add` parts one more rounding step in
/// bf16). Cases with and without the bias, with both parts a multiple of the vector width (the
/// fused paths; `cat_in_parts` in NDHWC) and not (the separate steps), every pair of part modes.
/// `rnd` gives values as the GPU stores them, `up`/`down` move an activation, `upr`/`downr` an
/// f32 vector, `upw` a conv weight as the convolutions read it (bf16 copies under bf16).
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn check_gn_cat_in(
    g: &CudaBackend,
    rnd: &dyn Fn(usize, u64, f32) -> Vec<f32>,
    (up, down): (&dyn Fn(&[f32], Dims) -> Buf, &dyn Fn(&Buf, Dims) -> Vec<f32>),
    (upr, downr): (&dyn Fn(&[f32]) -> Buf, &dyn Fn(&Buf) -> Vec<f32>),
    upw: &dyn Fn(&[f32], &[usize]) -> Buf,
    check: &dyn Fn(&str, &[f32], &[f32], f64),
    tol: f64,
    tag: &str,
) {
    use Accum::{Add, Overwrite};
    let cases = [
        (Dims::new(2, 0, 5, 6, 7), 3, 4, 7, 5, (Overwrite, Add), true),
        (Dims::new(2, 0, 5, 6, 7), 8, 16, 4, 5, (Add, Overwrite), true),
        (Dims::new(2, 0, 5, 6, 7), 4, 20, 4, 6, (Add, Add), false),
        (Dims::new(1, 0, 16, 17, 18), 64, 64, 8, 64, (Overwrite, Add), true),
        (Dims::new(1, 0, 9, 10, 11), 96, 32, 32, 48, (Add, Overwrite), false),
        (Dims::new(2, 0, 3, 5, 4), 16, 8, 8, 12, (Overwrite, Overwrite), true),
    ];
    let (mut fused, mut from_parts) = (0, 0);
    for (i, (x, ca, cb, groups, cout, (mh, msk), with_bias)) in cases.into_iter().enumerate() {
        let (xo, xa, xb, xy) = (x.with_c(ca + cb), x.with_c(ca), x.with_c(cb), x.with_c(cout));
        let c = ca + cb;
        let s = 700 + 10 * i as u64;
        let t =
            format!("cat_in backward {xo} ({ca} + {cb}) G{groups} → {cout} {mh:?}/{msk:?} bias {with_bias} [{tag}]");
        let (h0, s0) = (rnd(xa.numel(), s, 1.0), rnd(xb.numel(), s + 10, 1.0));
        let bias = rnd(ca, s + 11, 0.5);
        let (hg, sg, bg_) = (up(&h0, xa), up(&s0, xb), upr(&bias));
        let hb = with_bias.then_some(&bg_);
        let (dy, dout) = (rnd(xo.numel(), s + 1, 1.0), rnd(xy.numel(), s + 2, 1.0));
        let (gam, bet) = (rnd(c, s + 3, 0.5).iter().map(|v| v + 1.0).collect::<Vec<_>>(), rnd(c, s + 4, 0.5));
        let (dg0, db0) = (rnd(c, s + 5, 1.0), rnd(c, s + 6, 1.0));
        let (ph0, ps0) = (rnd(xa.numel(), s + 7, 1.0), rnd(xb.numel(), s + 8, 1.0));
        let dw0 = rnd(cout * c, s + 12, 1.0);
        let wg = upw(&rnd(cout * c, s + 9, 0.3), &[cout, c, 1, 1, 1]);
        let (gg, bg, doutg) = (upr(&gam), upr(&bet), up(&dout, xy));
        let mut dsum = upr(&vec![0.0; x.n * cout]);
        g.channel_sum(&mut dsum, &doutg, xy);
        let ng = x.n * groups;
        // the concatenation as stored, and the forward's statistics and activation of it
        let mut xin = up(&vec![0.0; xo.numel()], xo);
        g.concat_channels_bias(&mut xin, &hg, hb, &sg, xo, ca, cb);
        let (mut a, mut mg, mut rg) = (up(&vec![0.0; xo.numel()], xo), upr(&vec![0.0; ng]), upr(&vec![0.0; ng]));
        g.groupnorm_silu_forward(&mut a, &mut mg, &mut rg, &xin, None, &gg, &bg, xo, groups);
        let cs = ConvShape::new(xo, cout, 1, 1);
        // the separate steps
        let (mut d1, mut x1, mut dga, mut dba) = (up(&dy, xo), up(&dy, xo), upr(&dg0), upr(&db0));
        let (mut ph1, mut ps1, mut dw1) = (up(&ph0, xa), up(&ps0, xb), upr(&dw0));
        let (parts, gs) = (((&mut ph1, mh), (&mut ps1, msk)), (&mut dga, &mut dba));
        let skip = (&doutg, &dsum, &wg, &mut dw1, cs);
        let (ms, gb) = ((&mg, &rg), (&gg, &bg));
        meddpm::backend::cat_in_steps(g, &mut d1, &mut x1, (&hg, hb, &sg), parts, gs, ms, gb, skip, (ca, cb), groups);
        // in one call (x's contents on entry are not read: garbage)
        let (mut d2, mut x2, mut dgb, mut dbb) = (up(&dy, xo), up(&dy, xo), upr(&dg0), upr(&db0));
        let (mut ph2, mut ps2, mut dw2) = (up(&ph0, xa), up(&ps0, xb), upr(&dw0));
        let (parts, gs) = (((&mut ph2, mh), (&mut ps2, msk)), (&mut dgb, &mut dbb));
        let skip = (&doutg, &dsum, &wg, &mut dw2, cs);
        g.groupnorm_silu_backward_cat_in(&mut d2, &mut x2, (&hg, hb, &sg), parts, gs, ms, gb, skip, (ca, cb), groups);
        fused += g.cat_in_fused(xo, ca, wg.dtype()) as usize;
        from_parts += g.cat_in_parts(xo, ca, wg.dtype()) as usize;
        assert!(down(&x2, xo) == down(&x1, xo) && down(&x2, xo) == down(&a, xo), "{t}: x is not silu(GN(x))");
        assert!(downr(&dgb) == downr(&dga) && downr(&dbb) == downr(&dba), "{t}: dgamma/dbeta");
        check(&format!("{t} dh"), &down(&ph2, xa), &down(&ph1, xa), tol);
        check(&format!("{t} ds"), &down(&ps2, xb), &down(&ps1, xb), tol);
        check(&format!("{t} skip dw"), &downr(&dw2), &downr(&dw1), tol);
    }
    assert!(fused >= 4, "{tag}: only {fused} of the cases took a fused path");
    let want = if Backend::layout(g) == meddpm::Layout::Ndhwc { 3 } else { 0 };
    assert!(from_parts >= want, "{tag}: only {from_parts} of the cases read the concatenation from its parts");
}
