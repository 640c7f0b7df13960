//! Images for conditioning masks: a lesion-free T1 darkened where the mask says tumour, as the
//! demo data are made (`demo` module docs, step 4), so that masks made by `meddpm masks`
//! (tumour scaled or shifted) get a matching image and become training pairs.
//!
//! [`render`]: image = T1 × [`LESION_FACTOR`] on tumour voxels, × [`RIM_FACTOR`] on the other
//! voxels within `rim` voxels (Euclidean, voxel units) of a tumour voxel, × 1 elsewhere. For the
//! demo's balls this is its rule up to the rim's shape (the demo's rim is a spherical shell of
//! one voxel about the centre; here it follows the mask's outline, which a scaled or shifted
//! tumour needs). [`write_pairs`] renders a list of masks into `masks/` and `images/` folders
//! that `meddpm train --masks --images` pairs by the digits of their names.

use super::convention::minmax_pm1;
use super::demo::{LESION_FACTOR, RIM_FACTOR};
use super::nifti::{read_volume, write_labels, write_volume, Volume};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// The image of `mask` made from the lesion-free `t1` (same grid): tumour voxels (label
/// `tumour`) × 0.45, voxels within `rim` voxels of the tumour × 0.725.
pub fn render(t1: &Volume, mask: &Volume, tumour: f32, rim: f64) -> Result<Volume> {
    if t1.dims != mask.dims {
        return Err(Error::Config(format!("mask dims {:?} differ from the T1's {:?}", mask.dims, t1.dims)));
    }
    let [nx, ny, nz] = mask.dims;
    let r = rim.max(0.0).floor() as i64;
    let mut factor = vec![1f64; mask.data.len()];
    for z in 0..nz {
        for y in 0..ny {
            for x in 0..nx {
                if mask.data[x + nx * (y + ny * z)] != tumour {
                    continue;
                }
                for dz in -r..=r {
                    for dy in -r..=r {
                        for dx in -r..=r {
                            if ((dx * dx + dy * dy + dz * dz) as f64) > rim * rim {
                                continue;
                            }
                            let (xx, yy, zz) = (x as i64 + dx, y as i64 + dy, z as i64 + dz);
                            if xx < 0 || yy < 0 || zz < 0 || xx >= nx as i64 || yy >= ny as i64 || zz >= nz as i64 {
                                continue;
                            }
                            let i = xx as usize + nx * (yy as usize + ny * zz as usize);
                            factor[i] = factor[i].min(RIM_FACTOR);
                        }
                    }
                }
            }
        }
    }
    let data = t1
        .data
        .iter()
        .zip(&mask.data)
        .zip(&factor)
        .map(|((&v, &m), &f)| if m == tumour { (v as f64 * LESION_FACTOR) as f32 } else { (v as f64 * f) as f32 })
        .collect();
    Ok(mask.like(data))
}

/// Render every mask of `masks` with [`render`] and write the pairs as
/// `out/masks/pair_NNNN.nii.gz` (labels, uint8) and `out/images/pair_NNNN.nii.gz` (float32, the
/// mask's geometry), NNNN = position in `masks`, plus `out/pairs.csv` (`pair,source`); with
/// `real`, also `out/real/pair_NNNN.nii.gz`: the image min-max scaled to [−1, 1] as the
/// whole-head convention feeds it to the model (what `meddpm eval` compares samples with). Uses
/// `threads` worker threads. Returns the number of pairs.
pub fn write_pairs(
    t1: &Volume,
    masks: &[PathBuf],
    out: &Path,
    tumour: f32,
    rim: f64,
    real: bool,
    threads: usize,
) -> Result<usize> {
    let (md, id, rd) = (out.join("masks"), out.join("images"), out.join("real"));
    for d in [&md, &id].into_iter().chain(real.then_some(&rd)) {
        std::fs::create_dir_all(d).map_err(|e| Error::io(d, e))?;
    }
    let jobs: Vec<(usize, &PathBuf)> = masks.iter().enumerate().collect();
    let chunk = jobs.len().div_ceil(threads.max(1)).max(1);
    let results: Vec<Result<()>> = std::thread::scope(|sc| {
        let handles: Vec<_> = jobs
            .chunks(chunk)
            .map(|part| {
                let (md, id, rd) = (&md, &id, &rd);
                sc.spawn(move || -> Result<()> {
                    for &(n, path) in part {
                        let mask = read_volume(path)?;
                        let image = render(t1, &mask, tumour, rim)
                            .map_err(|e| Error::data(path, format!("cannot render its image: {e}")))?;
                        let name = format!("pair_{n:04}.nii.gz");
                        write_labels(md.join(&name), &mask)?;
                        if real {
                            write_volume(rd.join(&name), &image.like(minmax_pm1(&image.data)))?;
                        }
                        write_volume(id.join(&name), &image)?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("render worker panicked")).collect()
    });
    for r in results {
        r?;
    }
    let mut csv = String::from("pair,source\n");
    for (n, p) in masks.iter().enumerate() {
        csv += &format!("pair_{n:04},{}\n", p.display());
    }
    let f = out.join("pairs.csv");
    std::fs::write(&f, csv).map_err(|e| Error::io(&f, e))?;
    Ok(masks.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vol(dims: [usize; 3], data: Vec<f32>) -> Volume {
        Volume::new(dims, [1.0; 3], data)
    }

    #[test]
    fn render_darkens_tumour_and_rim_only() {
        let dims = [7, 7, 7];
        let n = 343;
        let t1 = vol(dims, vec![100.0; n]);
        let mut m = vec![1f32; n];
        let c = 3 + 7 * (3 + 7 * 3);
        m[c] = 2.0;
        let mask = vol(dims, m);
        let img = render(&t1, &mask, 2.0, 1.0).unwrap();
        assert_eq!(img.data[c], 45.0);
        // the six face neighbours are the rim at rim = 1; edge neighbours (distance √2) are not
        for d in [1, 7, 49] {
            assert_eq!(img.data[c + d], 72.5);
            assert_eq!(img.data[c - d], 72.5);
        }
        assert_eq!(img.data[c + 1 + 7], 100.0);
        assert_eq!(img.data.iter().filter(|&&v| v == 100.0).count(), n - 7);
        // rim 2 reaches the (2, 0, 0) and (1, 1, 0) neighbours too
        let img2 = render(&t1, &mask, 2.0, 2.0).unwrap();
        assert_eq!(img2.data[c + 2], 72.5);
        assert_eq!(img2.data[c + 1 + 7], 72.5);
        assert_eq!(img2.data[c + 2 + 7], 100.0);
        // no tumour: the T1 itself; other grid: an error
        let plain = vol(dims, vec![1.0; n]);
        assert_eq!(render(&t1, &plain, 2.0, 2.0).unwrap().data, t1.data);
        assert!(render(&vol([7, 7, 6], vec![0.0; 294]), &mask, 2.0, 1.0).is_err());
    }

    #[test]
    fn written_pairs_pair_by_name() {
        let dir = crate::testing::scratch_dir("lesion");
        let dims = [6, 5, 4];
        let t1 = vol(dims, (0..120).map(|i| i as f32).collect());
        let mut paths = Vec::new();
        for k in 0..3 {
            let mut m = vec![1f32; 120];
            m[10 + 30 * k] = 2.0;
            let p = dir.join(format!("in_{k}.nii.gz"));
            write_labels(&p, &vol(dims, m)).unwrap();
            paths.push(p);
        }
        let out = dir.join("out");
        assert_eq!(write_pairs(&t1, &paths, &out, 2.0, 1.0, true, 2).unwrap(), 3);
        for (k, src) in paths.iter().enumerate() {
            let name = format!("pair_{k:04}.nii.gz");
            let m = read_volume(out.join("masks").join(&name)).unwrap();
            let im = read_volume(out.join("images").join(&name)).unwrap();
            assert_eq!(m.data, read_volume(src).unwrap().data);
            assert_eq!(im.data, render(&t1, &m, 2.0, 1.0).unwrap().data);
            let r = read_volume(out.join("real").join(&name)).unwrap();
            assert_eq!(r.data, minmax_pm1(&im.data));
        }
        let csv = std::fs::read_to_string(out.join("pairs.csv")).unwrap();
        assert_eq!(csv.lines().count(), 4);
        assert!(csv.contains("pair_0002,") && csv.contains("in_2.nii.gz"));
        let ds = super::super::dataset::Dataset::from_folders(
            &out.join("masks"),
            &[out.join("images")],
            super::super::convention::Convention::whole_head(),
            [4, 5, 6],
        )
        .unwrap();
        assert_eq!(ds.len(), 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
