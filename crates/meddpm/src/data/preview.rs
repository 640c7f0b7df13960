//! PNG previews: the middle slice of each volume in three planes, volumes side by side
//! (columns: e.g. mask, image, samples; rows: axial, coronal, sagittal), or the planes through
//! a chosen point such as a lesion's centroid ([`label_position`], [`render_at`]).
//!
//! Slices are taken in voxel axes, not reoriented: axial = z-middle shown x → right, y → up;
//! coronal = y-middle, x → right, z → up; sagittal = x-middle, y → right, z → up (for RAS-ish
//! files such as MNI and the Med-DDPM examples this puts anterior/superior up). Label volumes
//! use a fixed palette; intensity volumes are windowed to their own min..max. Small volumes are
//! enlarged by an integer factor (nearest) so the largest side is at least 128 pixels.
//! [`render_titled`] adds a title over each column (a built-in 5×7 bitmap font: the `image`
//! crate draws no text, and plotters is built without fonts); a sample's preview uses it.

use super::nifti::Volume;
use crate::error::{Error, Result};
use image::{Rgb, RgbImage};
use std::path::Path;

/// How a volume is coloured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Integer labels through [`PALETTE`].
    Labels,
    /// Grey levels, min..max of the volume.
    Intensity,
}

/// Label colours: 0 black, 1 grey, 2 red, 3 green, 4 blue, then more; labels wrap around.
pub const PALETTE: [[u8; 3]; 8] = [
    [0, 0, 0],
    [150, 150, 150],
    [230, 40, 40],
    [40, 200, 60],
    [50, 90, 230],
    [240, 210, 40],
    [200, 60, 200],
    [40, 210, 210],
];

/// Labels if every voxel is an integer and there are at most 16 distinct values.
pub fn guess_kind(v: &Volume) -> Kind {
    let mut seen: Vec<f32> = Vec::new();
    for &x in &v.data {
        if x.fract() != 0.0 {
            return Kind::Intensity;
        }
        if !seen.contains(&x) {
            seen.push(x);
            if seen.len() > 16 {
                return Kind::Intensity;
            }
        }
    }
    Kind::Labels
}

/// (width, height) of plane `p` (0 axial, 1 coronal, 2 sagittal) of dims (X, Y, Z).
fn plane_size(d: [usize; 3], p: usize) -> (usize, usize) {
    match p {
        0 => (d[0], d[1]),
        1 => (d[0], d[2]),
        _ => (d[1], d[2]),
    }
}

/// Slice index at fractional position `f` (0.5 = the middle, n/2) of an axis of `n` voxels.
fn slice_at(f: f64, n: usize) -> usize {
    ((f * n as f64).floor().max(0.0) as usize).min(n - 1)
}

/// Voxel shown at (u, v) (v = 0 at the top) of plane `p`, the planes cutting at `pos`.
fn plane_voxel(v: &Volume, p: usize, u: usize, w: usize, pos: [f64; 3]) -> f32 {
    let [nx, ny, nz] = v.dims;
    match p {
        0 => v.at(u, ny - 1 - w, slice_at(pos[2], nz)),
        1 => v.at(u, slice_at(pos[1], ny), nz - 1 - w),
        _ => v.at(slice_at(pos[0], nx), u, nz - 1 - w),
    }
}

/// Fractional position (x, y, z) ∈ [0, 1)³ of the centroid of `label` in `mask` (voxel
/// centre i ↦ (i + 0.5)/n), to cut every column through a lesion; None if absent.
pub fn label_position(mask: &Volume, label: f32) -> Option<[f64; 3]> {
    let c = super::masks::centroid(mask, label)?;
    Some([0, 1, 2].map(|a| (c[a].round() + 0.5) / mask.dims[a] as f64))
}

/// The enlargement factor, the gap between panels, and each column's width in pixels.
fn columns(volumes: &[(&Volume, Kind)]) -> (usize, usize, Vec<usize>) {
    let max_side = volumes.iter().flat_map(|(v, _)| v.dims).max().unwrap_or(1).max(1);
    let scale = 128usize.div_ceil(max_side).max(1);
    let col_w = volumes.iter().map(|(v, _)| (0..3).map(|p| plane_size(v.dims, p).0).max().unwrap() * scale).collect();
    (scale, 4, col_w)
}

/// Render the three mid-planes of each volume, one column per volume.
pub fn render(volumes: &[(&Volume, Kind)]) -> RgbImage {
    render_at(volumes, [0.5; 3])
}

/// Render the planes through fractional position `pos` (x, y, z) of each volume (volumes of
/// different sizes are cut at the same relative position).
pub fn render_at(volumes: &[(&Volume, Kind)], pos: [f64; 3]) -> RgbImage {
    assert!(!volumes.is_empty(), "preview::render: no volumes");
    let (scale, gap, col_w) = columns(volumes);
    let row_h: Vec<usize> =
        (0..3).map(|p| volumes.iter().map(|(v, _)| plane_size(v.dims, p).1).max().unwrap() * scale).collect();
    let width = col_w.iter().sum::<usize>() + gap * (volumes.len() + 1);
    let height = row_h.iter().sum::<usize>() + gap * 4;
    let mut img = RgbImage::from_pixel(width as u32, height as u32, Rgb([40, 40, 48]));
    let mut x0 = gap;
    for (c, (v, kind)) in volumes.iter().enumerate() {
        let (lo, hi) = v.data.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
        let range = if hi > lo { hi - lo } else { 1.0 };
        let mut y0 = gap;
        for (p, &rh) in row_h.iter().enumerate() {
            let (pw, ph) = plane_size(v.dims, p);
            for w in 0..ph {
                for u in 0..pw {
                    let val = plane_voxel(v, p, u, w, pos);
                    let rgb = match kind {
                        Kind::Labels => PALETTE[(val.round().max(0.0) as usize) % PALETTE.len()],
                        Kind::Intensity => {
                            let g = (((val - lo) / range) * 255.0).round().clamp(0.0, 255.0) as u8;
                            [g, g, g]
                        }
                    };
                    for dy in 0..scale {
                        for dx in 0..scale {
                            img.put_pixel((x0 + u * scale + dx) as u32, (y0 + w * scale + dy) as u32, Rgb(rgb));
                        }
                    }
                }
            }
            y0 += rh + gap;
        }
        x0 += col_w[c] + gap;
    }
    img
}

/// [`render_at`] with a title over each column: a strip of upper-case text (a built-in 5×7
/// bitmap font: letters, digits, `-`, `_`, `.`; other characters are blanks), drawn twice as
/// large where the column is wide enough. Titles beyond the columns are ignored.
pub fn render_titled(volumes: &[(&Volume, Kind)], titles: &[&str], pos: [f64; 3]) -> RgbImage {
    let body = render_at(volumes, pos);
    let (_, gap, col_w) = columns(volumes);
    let fits = |t: &str, w: usize, px: usize| t.chars().count() * 6 * px <= w;
    let px = if titles.iter().zip(&col_w).all(|(t, &w)| fits(t, w, 2)) { 2 } else { 1 };
    let strip = 7 * px + gap + 2;
    let mut img = RgbImage::from_pixel(body.width(), body.height() + strip as u32, Rgb([40, 40, 48]));
    image::imageops::replace(&mut img, &body, 0, strip as i64);
    let mut x0 = gap;
    for (t, &w) in titles.iter().zip(&col_w) {
        let text_w = (t.chars().count() * 6 * px).saturating_sub(px);
        let left = x0 + w.saturating_sub(text_w) / 2;
        for (i, c) in t.chars().enumerate() {
            let rows = glyph(c);
            for (r, bits) in rows.iter().enumerate() {
                for b in 0..5 {
                    if bits >> (4 - b) & 1 == 1 {
                        for dy in 0..px {
                            for dx in 0..px {
                                let (x, y) = (left + (i * 6 + b) * px + dx, gap + r * px + dy);
                                if x < x0 + w {
                                    img.put_pixel(x as u32, y as u32, Rgb([230, 230, 230]));
                                }
                            }
                        }
                    }
                }
            }
        }
        x0 += w + gap;
    }
    img
}

/// Rows (top first, bit 4 = leftmost pixel) of a 5×7 upper-case glyph; a blank for others.
fn glyph(c: char) -> [u8; 7] {
    const LETTERS: [[u8; 7]; 26] = [
        [0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11], // A
        [0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E], // B
        [0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E], // C
        [0x1E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1E], // D
        [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F], // E
        [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10], // F
        [0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F], // G
        [0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11], // H
        [0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E], // I
        [0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C], // J
        [0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11], // K
        [0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F], // L
        [0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11], // M
        [0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11], // N
        [0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E], // O
        [0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10], // P
        [0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D], // Q
        [0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11], // R
        [0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E], // S
        [0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04], // T
        [0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E], // U
        [0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04], // V
        [0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A], // W
        [0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11], // X
        [0x11, 0x11, 0x0A, 0x04, 0x04, 0x04, 0x04], // Y
        [0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F], // Z
    ];
    const DIGITS: [[u8; 7]; 10] = [
        [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E], // 0
        [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E], // 1
        [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F], // 2
        [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E], // 3
        [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02], // 4
        [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E], // 5
        [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E], // 6
        [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08], // 7
        [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E], // 8
        [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C], // 9
    ];
    match c.to_ascii_uppercase() {
        l @ 'A'..='Z' => LETTERS[l as usize - 'A' as usize],
        d @ '0'..='9' => DIGITS[d as usize - '0' as usize],
        '-' => [0, 0, 0, 0x1F, 0, 0, 0],
        '_' => [0, 0, 0, 0, 0, 0, 0x1F],
        '.' => [0, 0, 0, 0, 0, 0x0C, 0x0C],
        _ => [0; 7],
    }
}

/// [`render_titled`] through the middle, saved as PNG atomically.
pub fn write_png_titled(path: impl AsRef<Path>, volumes: &[(&Volume, Kind)], titles: &[&str]) -> Result<()> {
    if volumes.is_empty() {
        return Err(Error::Config("preview: no volumes to draw".into()));
    }
    save_png(path.as_ref(), &render_titled(volumes, titles, [0.5; 3]))
}

/// Render the mid-planes and save as PNG, atomically (temporary file + rename).
pub fn write_png(path: impl AsRef<Path>, volumes: &[(&Volume, Kind)]) -> Result<()> {
    write_png_at(path, volumes, [0.5; 3])
}

/// Render the planes through `pos` (see [`render_at`]) and save as PNG, atomically.
pub fn write_png_at(path: impl AsRef<Path>, volumes: &[(&Volume, Kind)], pos: [f64; 3]) -> Result<()> {
    let path = path.as_ref();
    if volumes.is_empty() {
        return Err(Error::Config("preview: no volumes to draw".into()));
    }
    save_png(path, &render_at(volumes, pos))
}

/// Save `img` as PNG at `path`, atomically (temporary file + rename).
fn save_png(path: &Path, img: &RgbImage) -> Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp.png", std::process::id()));
    let result = img
        .save_with_format(&tmp, image::ImageFormat::Png)
        .map_err(|e| Error::format(path, format!("cannot write PNG: {e}")))
        .and_then(|_| std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e)));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
