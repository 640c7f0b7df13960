//! The direct 3×3×3 convolution kernels (`cpu/conv3d/direct.rs`) against the im2col + GEMM path,
//! in f32 (the backend's precision, where the kernels run vectorised) and f64, on odd shapes:
//! W not a multiple of the 16-voxel tile (and wider than one tile), channel counts not multiples
//! of the 4-channel block, batch 2, single-voxel axes. Forward, data gradient (overwrite and
//! add), filter gradient (with and without a data gradient) and bias gradient. `MORE_SHAPES`
//! adds the cases of the flat-tile kernels: Cout of one and two 8-channel vectors (the transposed
//! filter gradient), planes narrower than a tile, W 1, the 2- and 3-channel blocks.
//!
//! The path is chosen by the scratch budget (`conv3d::uses_direct`): the default budget takes
//! the direct kernels for these shapes, a budget of one element forces im2col with one-plane slabs.

use meddpm::cpu::conv3d::{self, ConvScratch, COL_BUDGET};
use meddpm::cpu::float::Float;
use meddpm::testing::{compare, randn_f64, Tolerance};
use meddpm::{Accum, ConvShape, Dims};

struct Grads<T> {
    out: Vec<T>,
    dx: Vec<T>,
    dx_add: Vec<T>,
    dw: Vec<T>,
    db: Vec<T>,
    dw_no_dx: Vec<T>,
}

fn run<T: Float>(cs: ConvShape, budget: usize, seed: u64) -> Grads<T> {
    let conv =
        |stream, len, scale| -> Vec<T> { randn_f64(seed, stream, len, scale).into_iter().map(T::from_f64).collect() };
    let o = cs.out();
    let (x, w, b, g) =
        (conv(0, cs.x.numel(), 1.0), conv(1, cs.w_len(), 0.3), conv(2, cs.cout, 1.0), conv(3, o.numel(), 1.0));
    let prior = conv(4, cs.x.numel(), 1.0);
    let prior_w = conv(5, cs.w_len(), 1.0);
    let mut s = ConvScratch::new(budget);

    let mut out = vec![T::zero(); o.numel()];
    conv3d::conv3d_forward_with(&mut out, &x, &w, &b, cs, &mut s);
    let (mut dx, mut dw, mut db) = (prior.clone(), prior_w.clone(), vec![T::zero(); cs.cout]);
    conv3d::conv3d_backward_with(Some((&mut dx, Accum::Overwrite)), &mut dw, Some(&mut db), &g, &x, &w, cs, &mut s);
    let (mut dx_add, mut dw2, mut db2) = (prior.clone(), vec![T::zero(); cs.w_len()], vec![T::zero(); cs.cout]);
    conv3d::conv3d_backward_with(Some((&mut dx_add, Accum::Add)), &mut dw2, Some(&mut db2), &g, &x, &w, cs, &mut s);
    let mut dw_no_dx = vec![T::zero(); cs.w_len()];
    conv3d::conv3d_backward_with(None, &mut dw_no_dx, Some(&mut db2), &g, &x, &w, cs, &mut s);
    // the data gradient alone: the same sums as the joint call's, bit for bit
    data_only_matches(cs, (&prior, &dx, &dx_add), &g, &w, &mut s);
    Grads { out, dx, dx_add, dw, db, dw_no_dx }
}

/// `conv3d_backward_data_with` (overwrite and add onto `prior`) equals the joint backward's
/// data gradients `dx` / `dx_add` exactly.
fn data_only_matches<T: Float>(
    cs: ConvShape,
    (prior, dx, dx_add): (&[T], &[T], &[T]),
    g: &[T],
    w: &[T],
    s: &mut ConvScratch<T>,
) {
    let mut d = prior.to_vec();
    conv3d::conv3d_backward_data_with((&mut d, Accum::Overwrite), g, w, cs, s);
    assert!(d == dx, "{cs:?}: data-only gradient (overwrite) differs from the joint backward's");
    let mut d = prior.to_vec();
    conv3d::conv3d_backward_data_with((&mut d, Accum::Add), g, w, cs, s);
    assert!(d == dx_add, "{cs:?}: data-only gradient (add) differs from the joint backward's");
}

/// The data-only backward on the im2col and pointwise paths too (stride 2, 1×1×1, batch 2).
#[test]
fn data_only_backward_equals_joint_on_every_path() {
    let shapes = [
        ConvShape::new(Dims::new(2, 3, 5, 6, 7), 4, 3, 2),
        ConvShape::new(Dims::new(2, 5, 4, 3, 6), 7, 1, 1),
        ConvShape::new(Dims::new(1, 4, 6, 5, 7), 3, 3, 1),
    ];
    for cs in shapes {
        for budget in [COL_BUDGET, 1] {
            let r = |st, len, sc| randn_f64(7, st, len, sc).into_iter().map(f32::from_f64).collect::<Vec<f32>>();
            let (x, w, g, prior) =
                (r(0, cs.x.numel(), 1.0), r(1, cs.w_len(), 0.3), r(3, cs.out().numel(), 1.0), r(4, cs.x.numel(), 1.0));
            let mut s = ConvScratch::new(budget);
            let (mut dx, mut dx_add, mut dw) = (prior.clone(), prior.clone(), vec![0f32; cs.w_len()]);
            conv3d::conv3d_backward_with(Some((&mut dx, Accum::Overwrite)), &mut dw, None, &g, &x, &w, cs, &mut s);
            conv3d::conv3d_backward_with(Some((&mut dx_add, Accum::Add)), &mut dw, None, &g, &x, &w, cs, &mut s);
            data_only_matches(cs, (&prior, &dx, &dx_add), &g, &w, &mut s);
        }
    }
}

fn check<T: Float + Into<f64>>(name: &str, cs: ConvShape, tol: Tolerance) {
    assert!(conv3d::uses_direct(&cs, COL_BUDGET), "{name}: the default budget should take the direct kernels");
    assert!(!conv3d::uses_direct(&cs, 1), "{name}: a one-element budget should force im2col");
    let direct = run::<T>(cs, COL_BUDGET, 11);
    let im2col = run::<T>(cs, 1, 11);
    compare(&format!("{name} forward"), &direct.out, &im2col.out, tol).unwrap();
    compare(&format!("{name} dinp (overwrite)"), &direct.dx, &im2col.dx, tol).unwrap();
    compare(&format!("{name} dinp (add)"), &direct.dx_add, &im2col.dx_add, tol).unwrap();
    compare(&format!("{name} dw (+= onto a prior)"), &direct.dw, &im2col.dw, tol).unwrap();
    compare(&format!("{name} db"), &direct.db, &im2col.db, tol).unwrap();
    compare(&format!("{name} dw (no dinp)"), &direct.dw_no_dx, &im2col.dw_no_dx, tol).unwrap();
}

const SHAPES: [(&str, Dims, usize); 4] = [
    ("W 19 (one tile + 3), Cin 3, Cout 5", Dims::new(2, 3, 5, 6, 19), 5),
    ("W 33 (two tiles + 1), Cout 1", Dims::new(1, 2, 3, 4, 33), 1),
    ("W 16 (exact tile), Cin 6, Cout 9", Dims::new(2, 6, 4, 7, 16), 9),
    ("single-voxel D and H, W 5", Dims::new(1, 4, 1, 1, 5), 4),
];

#[test]
fn direct_equals_im2col_f32() {
    for (name, x, cout) in SHAPES {
        check::<f32>(name, ConvShape::new(x, cout, 3, 1), Tolerance::new(2e-5, 2e-5));
    }
}

#[test]
fn direct_equals_im2col_f64() {
    for (name, x, cout) in SHAPES {
        check::<f64>(name, ConvShape::new(x, cout, 3, 1), Tolerance::new(1e-12, 1e-12));
    }
}

#[test]
fn other_geometries_stay_on_im2col() {
    let x = Dims::new(1, 8, 8, 8, 8);
    assert!(!conv3d::uses_direct(&ConvShape::new(x, 8, 3, 2), COL_BUDGET), "stride 2");
    assert!(!conv3d::uses_direct(&ConvShape::new(x, 8, 1, 1), COL_BUDGET), "1×1×1");
    // The whole-head model's first level (64 channels at 128³) is far over the budget.
    let wh = Dims::new(1, 64, 128, 128, 128);
    assert!(!conv3d::uses_direct(&ConvShape::new(wh, 64, 3, 1), COL_BUDGET), "whole-head level 0");
}

/// Shapes of the tiled kernels' other cases: Cout a multiple of the 8-channel vector of the
/// transposed filter gradient (one and two vectors), planes narrower than a tile (W 4: a 24-voxel
/// tile spans several rows and halo columns), a one-voxel-wide W, Cout 2 and 3 (the small blocks).
const MORE_SHAPES: [(&str, Dims, usize); 5] = [
    ("Cout 8, Cin 8, W 8, batch 2", Dims::new(2, 8, 5, 6, 8), 8),
    ("Cout 16 (two vectors), W 4", Dims::new(1, 5, 3, 4, 4), 16),
    ("Cout 2, W 1", Dims::new(1, 3, 4, 5, 1), 2),
    ("Cout 3, W 7, Cin 1", Dims::new(2, 1, 6, 3, 7), 3),
    ("Cout 12, W 26, H 1", Dims::new(1, 2, 2, 1, 26), 12),
];

#[test]
fn direct_equals_im2col_more_shapes_f32() {
    for (name, x, cout) in MORE_SHAPES {
        check::<f32>(name, ConvShape::new(x, cout, 3, 1), Tolerance::new(2e-5, 2e-5));
    }
}

#[test]
fn direct_equals_im2col_more_shapes_f64() {
    for (name, x, cout) in MORE_SHAPES {
        check::<f64>(name, ConvShape::new(x, cout, 3, 1), Tolerance::new(1e-12, 1e-12));
    }
}

/// The channel block is min(max(k, 1), 4) for every k, through an opaque argument. rustc 1.95.0
/// once compiled an if/else form of it to max(k, 1) (see `direct::block`), and the forward then
/// used blocks its weight arrangement did not.
#[test]
fn block_is_a_clamp() {
    use meddpm::cpu::conv3d::direct::{block, CB};
    let want = [1, 1, 2, 3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4];
    assert_eq!(CB, 4);
    for (k, &w) in want.iter().enumerate() {
        assert_eq!(block(std::hint::black_box(k)), w, "block({k})");
    }
    assert_eq!(block(std::hint::black_box(1 << 20)), 4);
}
