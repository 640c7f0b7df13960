//! Resizing volumes to the model size and back, as the reference does with torchio `Resize`.
//!
//! torchio `Resize(shape)` resamples to spacing `old·n_old/n_new` with SimpleITK, placing the
//! first output voxel centre at input index `0.5·(r − 1)` (r = n_old/n_new): output voxel `j`
//! samples input coordinate `(j + 0.5)·r − 0.5` — the "align_corners = False" convention —
//! with linear interpolation whose neighbours are clamped at the borders. [`trilinear`] is
//! that, done separably (x, then y, then z), which equals the trilinear formula exactly in
//! real arithmetic. [`nearest`] takes input index `floor((j + 0.5)·r)` (ITK's nearest-neighbour
//! rounding of the same coordinate), clamped. There is no anti-aliasing, as in the reference.
//!
//! Buffers are 3-D with axis 0 fastest (NIfTI's X, or equally the tensor's W); `dims` lists
//! sizes fastest axis first.

/// Per-axis linear sampling table: for each output index, (i0, i1, w1) with
/// value = (1 − w1)·src[i0] + w1·src[i1].
fn linear_table(n_src: usize, n_dst: usize) -> Vec<(usize, usize, f32)> {
    let r = n_src as f64 / n_dst as f64;
    (0..n_dst)
        .map(|j| {
            let x = ((j as f64 + 0.5) * r - 0.5).clamp(0.0, (n_src - 1) as f64);
            let i0 = x.floor() as usize;
            let i1 = (i0 + 1).min(n_src - 1);
            (i0, i1, (x - i0 as f64) as f32)
        })
        .collect()
}

/// Trilinear resize of a 3-D buffer (axis 0 fastest) from `src_dims` to `dst_dims`.
pub fn trilinear(src: &[f32], src_dims: [usize; 3], dst_dims: [usize; 3]) -> Vec<f32> {
    let [sx, sy, sz] = src_dims;
    let [dx, dy, dz] = dst_dims;
    assert_eq!(src.len(), sx * sy * sz, "trilinear: buffer length vs dims {src_dims:?}");
    assert!(dst_dims.iter().all(|&d| d > 0) && src_dims.iter().all(|&d| d > 0), "trilinear: empty dims");
    if src_dims == dst_dims {
        return src.to_vec();
    }
    let (tx, ty, tz) = (linear_table(sx, dx), linear_table(sy, dy), linear_table(sz, dz));
    // along x: (sx, sy, sz) -> (dx, sy, sz)
    let mut a = vec![0f32; dx * sy * sz];
    for (row_in, row_out) in src.chunks_exact(sx).zip(a.chunks_exact_mut(dx)) {
        for (o, &(i0, i1, w)) in row_out.iter_mut().zip(&tx) {
            *o = row_in[i0] + w * (row_in[i1] - row_in[i0]);
        }
    }
    // along y: (dx, sy, sz) -> (dx, dy, sz)
    let mut b = vec![0f32; dx * dy * sz];
    for (slab_in, slab_out) in a.chunks_exact(dx * sy).zip(b.chunks_exact_mut(dx * dy)) {
        for (row_out, &(i0, i1, w)) in slab_out.chunks_exact_mut(dx).zip(&ty) {
            let (r0, r1) = (&slab_in[i0 * dx..(i0 + 1) * dx], &slab_in[i1 * dx..(i1 + 1) * dx]);
            for ((o, &p), &q) in row_out.iter_mut().zip(r0).zip(r1) {
                *o = p + w * (q - p);
            }
        }
    }
    // along z: (dx, dy, sz) -> (dx, dy, dz)
    let plane = dx * dy;
    let mut c = vec![0f32; plane * dz];
    for (slab_out, &(i0, i1, w)) in c.chunks_exact_mut(plane).zip(&tz) {
        let (p0, p1) = (&b[i0 * plane..(i0 + 1) * plane], &b[i1 * plane..(i1 + 1) * plane]);
        for ((o, &p), &q) in slab_out.iter_mut().zip(p0).zip(p1) {
            *o = p + w * (q - p);
        }
    }
    c
}

fn nearest_table(n_src: usize, n_dst: usize) -> Vec<usize> {
    let r = n_src as f64 / n_dst as f64;
    (0..n_dst).map(|j| (((j as f64 + 0.5) * r).floor() as usize).min(n_src - 1)).collect()
}

/// Nearest-neighbour resize (for label maps) of a 3-D buffer (axis 0 fastest).
pub fn nearest(src: &[f32], src_dims: [usize; 3], dst_dims: [usize; 3]) -> Vec<f32> {
    let [sx, sy, sz] = src_dims;
    let [dx, dy, dz] = dst_dims;
    assert_eq!(src.len(), sx * sy * sz, "nearest: buffer length vs dims {src_dims:?}");
    if src_dims == dst_dims {
        return src.to_vec();
    }
    let (tx, ty, tz) = (nearest_table(sx, dx), nearest_table(sy, dy), nearest_table(sz, dz));
    let mut out = Vec::with_capacity(dx * dy * dz);
    for &z in &tz {
        for &y in &ty {
            let row = &src[(z * sy + y) * sx..(z * sy + y + 1) * sx];
            out.extend(tx.iter().map(|&x| row[x]));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Direct trilinear formula at one output voxel, for comparison with the separable code.
    fn direct(src: &[f32], s: [usize; 3], d: [usize; 3], j: [usize; 3]) -> f64 {
        let mut idx = [(0usize, 0usize, 0f64); 3];
        for a in 0..3 {
            let r = s[a] as f64 / d[a] as f64;
            let x = ((j[a] as f64 + 0.5) * r - 0.5).clamp(0.0, (s[a] - 1) as f64);
            let i0 = x.floor() as usize;
            idx[a] = (i0, (i0 + 1).min(s[a] - 1), x - i0 as f64);
        }
        let mut acc = 0.0;
        for cz in 0..2 {
            for cy in 0..2 {
                for cx in 0..2 {
                    let (x, wx) = if cx == 0 { (idx[0].0, 1.0 - idx[0].2) } else { (idx[0].1, idx[0].2) };
                    let (y, wy) = if cy == 0 { (idx[1].0, 1.0 - idx[1].2) } else { (idx[1].1, idx[1].2) };
                    let (z, wz) = if cz == 0 { (idx[2].0, 1.0 - idx[2].2) } else { (idx[2].1, idx[2].2) };
                    acc += wx * wy * wz * src[x + s[0] * (y + s[1] * z)] as f64;
                }
            }
        }
        acc
    }

    #[test]
    fn trilinear_matches_direct_formula_and_is_exact_on_linear_fields() {
        let s = [5, 7, 4];
        let src: Vec<f32> = (0..140).map(|i| ((i * 37) % 11) as f32 - 3.0).collect();
        for d in [[9, 3, 8], [5, 7, 4], [2, 13, 1], [10, 14, 8]] {
            let out = trilinear(&src, s, d);
            for z in 0..d[2] {
                for y in 0..d[1] {
                    for x in 0..d[0] {
                        let want = direct(&src, s, d, [x, y, z]);
                        let got = out[x + d[0] * (y + d[1] * z)] as f64;
                        assert!((got - want).abs() < 1e-5, "{d:?} ({x},{y},{z}): {got} vs {want}");
                    }
                }
            }
        }
        // a linear ramp along x, downsampled 2×: output j samples input 2j + 0.5.
        let ramp: Vec<f32> = (0..8 * 2 * 2).map(|i| (i % 8) as f32).collect();
        let out = trilinear(&ramp, [8, 2, 2], [4, 1, 1]);
        assert_eq!(out, vec![0.5, 2.5, 4.5, 6.5]);
        // upsampled 2×: j samples (j + 0.5)/2 − 0.5, clamped at 0 and 7.
        let out = trilinear(&ramp, [8, 2, 2], [16, 2, 2]);
        assert_eq!(&out[..4], &[0.0, 0.25, 0.75, 1.25]);
        assert_eq!(out[15], 7.0);
    }

    #[test]
    fn nearest_picks_source_voxels() {
        let src: Vec<f32> = (0..8).map(|i| i as f32).collect();
        assert_eq!(nearest(&src, [8, 1, 1], [4, 1, 1]), vec![1.0, 3.0, 5.0, 7.0]);
        assert_eq!(nearest(&src, [8, 1, 1], [16, 1, 1])[..4], [0.0, 0.0, 1.0, 1.0]);
    }
}
