//! Mask augmentation from the reference's `mask_generator.ipynb` (spec §5.3): new conditioning
//! masks made by scaling or shifting the tumour of an existing whole-head mask.
//!
//! - [`scale_tumour`]: the tumour is resampled nearest-neighbour about its centroid —
//!   `scipy.ndimage.map_coordinates(tumour, (p − c)/s + c, order=0, mode='constant')`, i.e. each
//!   voxel p takes the tumour bit at round-half-up((p − c)/s + c), 0 outside the volume. The
//!   head label is restored where the old tumour was (head = old head ∪ old tumour), the new
//!   tumour is drawn over it (also where it leaves the head, as in the notebook), and the result
//!   is kept only if it has at least `min_voxels` tumour voxels (30 in the notebook). Scales are
//!   `linspace(2.0, 0.5, 20)` in the notebook ([`linspace`]).
//! - [`shift_tumour`]: the tumour is moved by whole voxels (constant 0 fill); only its part that
//!   lands on *head* voxels of the original mask is kept (the old tumour site does not count as
//!   head here, as in the notebook), and the result is kept only if that part is at least half
//!   the original tumour. The old tumour site is refilled with the head label. The notebook
//!   uses shifts −40..40 step 10 on every axis.
//!
//! Differences, documented: shifts are given in NIfTI voxel axes (x, y, z) — the notebook's
//! names follow SimpleITK's array order (z, y, x), and as it enumerates all combinations the
//! set of outputs is the same. The notebook's `scipy.ndimage.shift` is a cubic-spline shift of
//! a boolean array; for whole-voxel shifts that is the exact shift implemented here. Labels
//! other than head and tumour are left as they are (the notebook only has 0, 1, 2).

use super::nifti::Volume;

/// Which labels mean head and tumour (1 and 2 in the reference).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Labels {
    pub head: f32,
    pub tumour: f32,
}

impl Default for Labels {
    fn default() -> Self {
        Labels { head: 1.0, tumour: 2.0 }
    }
}

/// numpy's `linspace(start, end, n)`: start + i·step, the last value exactly `end`.
pub fn linspace(start: f64, end: f64, n: usize) -> Vec<f64> {
    match n {
        0 => vec![],
        1 => vec![start],
        _ => {
            let step = (end - start) / (n - 1) as f64;
            let mut v: Vec<f64> = (0..n).map(|i| start + i as f64 * step).collect();
            v[n - 1] = end;
            v
        }
    }
}

fn count(v: &Volume, label: f32) -> usize {
    v.data.iter().filter(|&&x| x == label).count()
}

/// Tumour voxel centroid (x, y, z), or None without tumour.
pub fn centroid(v: &Volume, label: f32) -> Option<[f64; 3]> {
    let mut s = [0f64; 3];
    let mut n = 0usize;
    for z in 0..v.dims[2] {
        for y in 0..v.dims[1] {
            for x in 0..v.dims[0] {
                if v.at(x, y, z) == label {
                    s[0] += x as f64;
                    s[1] += y as f64;
                    s[2] += z as f64;
                    n += 1;
                }
            }
        }
    }
    (n > 0).then(|| s.map(|a| a / n as f64))
}

/// The tumour scaled by `scale` about its centroid; None if it has no tumour or the result has
/// fewer than `min_voxels` tumour voxels.
pub fn scale_tumour(mask: &Volume, scale: f64, labels: Labels, min_voxels: usize) -> Option<Volume> {
    let c = centroid(mask, labels.tumour)?;
    let [nx, ny, nz] = mask.dims;
    let src = |p: usize, a: usize, n: usize| -> Option<usize> {
        let q = ((p as f64 - c[a]) / scale + c[a] + 0.5).floor();
        (q >= 0.0 && q < n as f64).then_some(q as usize)
    };
    let mut data = Vec::with_capacity(mask.len());
    for z in 0..nz {
        let sz = src(z, 2, nz);
        for y in 0..ny {
            let sy = src(y, 1, ny);
            for x in 0..nx {
                let old = mask.at(x, y, z);
                let tumour = match (src(x, 0, nx), sy, sz) {
                    (Some(a), Some(b), Some(c)) => mask.at(a, b, c) == labels.tumour,
                    _ => false,
                };
                data.push(if tumour {
                    labels.tumour
                } else if old == labels.tumour {
                    labels.head
                } else {
                    old
                });
            }
        }
    }
    let out = mask.like(data);
    (count(&out, labels.tumour) >= min_voxels).then_some(out)
}

/// The tumour moved by `shift` voxels along (x, y, z); None if less than half of it lands on
/// head voxels (or there is no tumour).
pub fn shift_tumour(mask: &Volume, shift: [i64; 3], labels: Labels) -> Option<Volume> {
    let original = count(mask, labels.tumour);
    if original == 0 {
        return None;
    }
    let [nx, ny, nz] = mask.dims;
    let mut within = vec![false; mask.len()];
    let mut kept = 0usize;
    for z in 0..nz {
        for y in 0..ny {
            for x in 0..nx {
                let (sx, sy, sz) = (x as i64 - shift[0], y as i64 - shift[1], z as i64 - shift[2]);
                let inside = sx >= 0 && sy >= 0 && sz >= 0 && sx < nx as i64 && sy < ny as i64 && sz < nz as i64;
                let i = mask.index(x, y, z);
                if inside
                    && mask.at(sx as usize, sy as usize, sz as usize) == labels.tumour
                    && mask.data[i] == labels.head
                {
                    within[i] = true;
                    kept += 1;
                }
            }
        }
    }
    if (kept as f64) < original as f64 / 2.0 {
        return None;
    }
    let data = mask
        .data
        .iter()
        .zip(&within)
        .map(|(&v, &w)| {
            if w {
                labels.tumour
            } else if v == labels.tumour {
                labels.head
            } else {
                v
            }
        })
        .collect();
    Some(mask.like(data))
}

/// The notebook's shift grid: every (dx, dy, dz) in range(−r, r+1, step)³.
pub fn shift_grid(range: i64, step: i64) -> Vec<[i64; 3]> {
    let axis: Vec<i64> = (-range..=range).step_by(step.max(1) as usize).collect();
    let mut v = Vec::new();
    for &a in &axis {
        for &b in &axis {
            for &c in &axis {
                v.push([a, b, c]);
            }
        }
    }
    v
}
