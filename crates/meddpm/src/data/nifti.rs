//! NIfTI-1 volumes in and out: the one place that talks to the `nifti` crate (0.18).
//!
//! [`read_volume`] reads `.nii` / `.nii.gz` (gzip is detected by its magic bytes, not the name)
//! into a [`Volume`] of f32 voxels with X fastest — the file's own order — applying
//! `scl_slope`/`scl_inter` the way nibabel's `get_fdata` does (a slope of 0 or non-finite means
//! "no scaling"). The affine is the one nibabel's `img.affine` returns: sform if `sform_code > 0`,
//! else qform if `qform_code > 0`, else nibabel's fallback `shape_zoom_affine` (x flipped, centred).
//! [`write_volume`] writes float32 `.nii.gz` keeping the source header (orientation codes,
//! units, description), atomically: a temporary file in the same folder renamed over the target.
//!
//! Every failure names the file: non-3-D data, NaN/Inf voxels, unsupported data types, NIfTI-2,
//! truncated or corrupt gzip streams. The gzip stream is decoded in full before parsing so the
//! CRC is checked (the crate alone stops reading once it has the voxels it needs).

use crate::error::{Error, Result};
use nifti::{InMemNiftiObject, NiftiHeader, NiftiObject, NiftiType};
use std::io::Read;
use std::path::{Path, PathBuf};

/// A 3-D NIfTI volume as f32 voxels.
#[derive(Clone, Debug)]
pub struct Volume {
    /// Voxel counts along NIfTI axes (X, Y, Z).
    pub dims: [usize; 3],
    /// Voxel size along (X, Y, Z) from `pixdim[1..4]` (mm in practice).
    pub spacing: [f32; 3],
    /// Voxel-to-world affine (row-major 4×4), as nibabel's `img.affine`.
    pub affine: [[f32; 4]; 4],
    /// Voxels, X fastest: `data[x + X*(y + Y*z)]`. In tensor terms this is already the
    /// C-order array of shape (Z, Y, X) = (D, H, W).
    pub data: Vec<f32>,
    /// The header read from the file (or a default one); written back by [`write_volume`].
    pub header: NiftiHeader,
}

impl Volume {
    /// A new volume with a fresh header: the affine is diag(spacing) with sform code 2
    /// ("aligned"), units mm.
    pub fn new(dims: [usize; 3], spacing: [f32; 3], data: Vec<f32>) -> Volume {
        assert_eq!(data.len(), dims[0] * dims[1] * dims[2], "Volume::new: data length vs dims {dims:?}");
        let mut affine = [[0f32; 4]; 4];
        for (i, s) in spacing.iter().enumerate() {
            affine[i][i] = *s;
        }
        affine[3][3] = 1.0;
        let header = NiftiHeader { sform_code: 2, qform_code: 0, xyzt_units: 2, ..NiftiHeader::default() };
        Volume { dims, spacing, affine, data, header }
    }

    /// The same geometry and header with other voxels (`data.len()` must match).
    pub fn like(&self, data: Vec<f32>) -> Volume {
        assert_eq!(data.len(), self.len(), "Volume::like: data length vs dims {:?}", self.dims);
        Volume { data, ..self.clone_meta() }
    }

    /// A copy without the voxels (`data` empty): geometry and header only.
    pub fn clone_meta(&self) -> Volume {
        Volume {
            dims: self.dims,
            spacing: self.spacing,
            affine: self.affine,
            data: Vec::new(),
            header: self.header.clone(),
        }
    }

    /// Number of voxels X·Y·Z.
    pub fn len(&self) -> usize {
        self.dims[0] * self.dims[1] * self.dims[2]
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Linear index of voxel (x, y, z).
    #[inline]
    pub fn index(&self, x: usize, y: usize, z: usize) -> usize {
        x + self.dims[0] * (y + self.dims[1] * z)
    }

    /// Voxel (x, y, z).
    #[inline]
    pub fn at(&self, x: usize, y: usize, z: usize) -> f32 {
        self.data[self.index(x, y, z)]
    }
}

fn fmt_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::format(path, msg)
}

/// Read a `.nii` or `.nii.gz` file.
pub fn read_volume(path: impl AsRef<Path>) -> Result<Volume> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    read_volume_bytes(&bytes, path)
}

/// Parse a NIfTI-1 file held in memory (gzipped or not); `name` is used in error messages.
pub fn read_volume_bytes(bytes: &[u8], name: &Path) -> Result<Volume> {
    let decoded;
    let raw: &[u8] = if bytes.len() >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b {
        let mut out = Vec::with_capacity(bytes.len().saturating_mul(4));
        flate2::read::MultiGzDecoder::new(bytes)
            .read_to_end(&mut out)
            .map_err(|e| fmt_err(name, format!("corrupt or truncated gzip stream: {e}")))?;
        decoded = out;
        &decoded
    } else {
        bytes
    };
    if raw.len() < 348 {
        return Err(fmt_err(name, format!("not a NIfTI-1 file: {} bytes, a header alone is 348", raw.len())));
    }
    let sizeof_hdr =
        [i32::from_le_bytes(raw[0..4].try_into().unwrap()), i32::from_be_bytes(raw[0..4].try_into().unwrap())];
    if sizeof_hdr.contains(&540) {
        return Err(fmt_err(
            name,
            "NIfTI-2 files are not supported (the nifti crate reads NIfTI-1); re-save as NIfTI-1, e.g. nibabel's Nifti1Image",
        ));
    }
    if !sizeof_hdr.contains(&348) {
        return Err(fmt_err(name, "not a NIfTI-1 file (sizeof_hdr is not 348)"));
    }
    let obj = InMemNiftiObject::from_reader(std::io::Cursor::new(raw)).map_err(|e| match e {
        nifti::NiftiError::NoVolumeData => {
            fmt_err(name, "header-only NIfTI (.hdr/.img pair) is not supported; save it as a single .nii.gz")
        }
        nifti::NiftiError::IncompatibleLength(got, want) => {
            fmt_err(name, format!("truncated voxel data: {got} bytes present, the header needs {want}"))
        }
        nifti::NiftiError::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
            fmt_err(name, "truncated file (ended inside the header or extensions)")
        }
        other => fmt_err(name, format!("unreadable NIfTI: {other}")),
    })?;
    let header = obj.header().clone();
    let dims = spatial_dims(&header, name)?;
    let n = dims[0] * dims[1] * dims[2];
    let volume = obj.into_volume();
    let slope = header.scl_slope as f64;
    let inter = header.scl_inter as f64;
    let (slope, inter) = if slope == 0.0 || !slope.is_finite() { (1.0, 0.0) } else { (slope, inter) };
    let datatype =
        header.data_type().map_err(|_| fmt_err(name, format!("unknown datatype code {}", header.datatype)))?;
    macro_rules! typed {
        ($t:ty) => {{
            let v: Vec<$t> = volume.into_nifti_typed_data::<$t>().map_err(|e| fmt_err(name, format!("{e}")))?;
            if slope == 1.0 && inter == 0.0 {
                v.into_iter().map(|x| x as f32).collect::<Vec<f32>>()
            } else {
                v.into_iter().map(|x| (x as f64 * slope + inter) as f32).collect::<Vec<f32>>()
            }
        }};
    }
    let data: Vec<f32> = match datatype {
        NiftiType::Uint8 => typed!(u8),
        NiftiType::Int8 => typed!(i8),
        NiftiType::Int16 => typed!(i16),
        NiftiType::Uint16 => typed!(u16),
        NiftiType::Int32 => typed!(i32),
        NiftiType::Uint32 => typed!(u32),
        NiftiType::Int64 => typed!(i64),
        NiftiType::Uint64 => typed!(u64),
        NiftiType::Float32 => typed!(f32),
        NiftiType::Float64 => typed!(f64),
        other => {
            return Err(fmt_err(
                name,
                format!(
                "unsupported datatype {other:?}; expected a scalar type (uint8, int16, int32, float32, float64, ...)"
            ),
            ))
        }
    };
    if data.len() != n {
        return Err(fmt_err(name, format!("{} voxels read, dims {:?} need {n}", data.len(), dims)));
    }
    if let Some(i) = data.iter().position(|v| !v.is_finite()) {
        let bad = data.iter().filter(|v| !v.is_finite()).count();
        let (x, y, z) = (i % dims[0], (i / dims[0]) % dims[1], i / (dims[0] * dims[1]));
        return Err(Error::data(
            name,
            format!("{bad} voxel(s) are NaN or Inf (first at voxel ({x}, {y}, {z}): {})", data[i]),
        ));
    }
    let spacing = [1, 2, 3].map(|i| {
        let s = header.pixdim[i].abs();
        if s.is_finite() && s > 0.0 {
            s
        } else {
            1.0
        }
    });
    let affine = header_affine(&header, dims, spacing);
    Ok(Volume { dims, spacing, affine, data, header })
}

/// The spatial (X, Y, Z) dims: 3-D, or 4-D+ whose extra dims are all 1.
fn spatial_dims(h: &NiftiHeader, name: &Path) -> Result<[usize; 3]> {
    let nd = h.dim[0] as usize;
    if !(1..=7).contains(&nd) {
        return Err(fmt_err(name, format!("invalid dim[0] = {nd}")));
    }
    let shape: Vec<usize> = h.dim[1..=nd].iter().map(|&d| d as usize).collect();
    if nd < 3 || shape[3..].iter().any(|&d| d != 1) {
        return Err(Error::data(name, format!("expected a 3-D volume, found shape {shape:?}")));
    }
    if shape[..3].contains(&0) {
        return Err(Error::data(name, format!("empty volume: shape {shape:?}")));
    }
    Ok([shape[0], shape[1], shape[2]])
}

/// nibabel's `get_best_affine`: sform, else qform, else the centred, x-flipped base affine.
pub fn header_affine(h: &NiftiHeader, dims: [usize; 3], spacing: [f32; 3]) -> [[f32; 4]; 4] {
    if h.sform_code > 0 {
        [h.srow_x, h.srow_y, h.srow_z, [0.0, 0.0, 0.0, 1.0]]
    } else if h.qform_code > 0 {
        qform_affine(h, spacing)
    } else {
        let mut a = [[0f32; 4]; 4];
        let z = [-spacing[0], spacing[1], spacing[2]];
        for i in 0..3 {
            a[i][i] = z[i];
            a[i][3] = -((dims[i] as f32 - 1.0) / 2.0) * z[i];
        }
        a[3][3] = 1.0;
        a
    }
}

/// The NIfTI-1 quaternion affine (nifti1.h, method 2), computed in f64.
fn qform_affine(h: &NiftiHeader, spacing: [f32; 3]) -> [[f32; 4]; 4] {
    let (b, c, d) = (h.quatern_b as f64, h.quatern_c as f64, h.quatern_d as f64);
    let a = (1.0 - (b * b + c * c + d * d)).max(0.0).sqrt();
    let r = [
        [a * a + b * b - c * c - d * d, 2.0 * (b * c - a * d), 2.0 * (b * d + a * c)],
        [2.0 * (b * c + a * d), a * a + c * c - b * b - d * d, 2.0 * (c * d - a * b)],
        [2.0 * (b * d - a * c), 2.0 * (c * d + a * b), a * a + d * d - c * c - b * b],
    ];
    let qfac = if h.pixdim[0] < 0.0 { -1.0 } else { 1.0 };
    let s = [spacing[0] as f64, spacing[1] as f64, spacing[2] as f64 * qfac];
    let t = [h.quatern_x, h.quatern_y, h.quatern_z];
    let mut m = [[0f32; 4]; 4];
    for i in 0..3 {
        for j in 0..3 {
            m[i][j] = (r[i][j] * s[j]) as f32;
        }
        m[i][3] = t[i];
    }
    m[3][3] = 1.0;
    m
}

/// The header that [`write_volume`] writes: the volume's header with its dims, spacing and
/// affine (as sform, code kept or 2), little-endian, scaling reset and, if the old qform no longer describes
/// the affine, qform_code set to 0 so readers use the sform.
fn output_header(v: &Volume) -> NiftiHeader {
    let mut h = v.header.clone();
    for i in 0..3 {
        h.pixdim[i + 1] = v.spacing[i];
    }
    if h.pixdim[0] != 1.0 && h.pixdim[0] != -1.0 {
        h.pixdim[0] = 1.0;
    }
    if h.qform_code > 0 {
        let q = qform_affine(&h, v.spacing);
        let same =
            (0..3).all(|i| (0..4).all(|j| (q[i][j] - v.affine[i][j]).abs() <= 1e-4 * (1.0 + v.affine[i][j].abs())));
        if !same {
            h.qform_code = 0;
        }
    }
    if h.sform_code <= 0 {
        h.sform_code = 2;
    }
    h.srow_x = v.affine[0];
    h.srow_y = v.affine[1];
    h.srow_z = v.affine[2];
    h.cal_min = 0.0;
    h.cal_max = 0.0;
    h.intent_code = 0;
    h.dim = [3, 1, 1, 1, 1, 1, 1, 1];
    h.magic = *nifti::header::MAGIC_CODE_NIP1;
    h.endianness = nifti::Endianness::Little;
    h
}

/// Write `v` as float32 `.nii.gz` (gzip whatever the extension), atomically.
pub fn write_volume(path: impl AsRef<Path>, v: &Volume) -> Result<()> {
    let path = path.as_ref();
    assert_eq!(v.data.len(), v.len(), "write_volume: {} voxels for dims {:?}", v.data.len(), v.dims);
    let arr = fortran_view(&v.data, v.dims);
    write_with(path, v, |w| w.write_nifti(&arr))
}

/// Write an integer label volume as uint8 `.nii.gz` (values must be integers in 0..=255).
pub fn write_labels(path: impl AsRef<Path>, v: &Volume) -> Result<()> {
    let path = path.as_ref();
    let mut out = Vec::with_capacity(v.len());
    for (i, &x) in v.data.iter().enumerate() {
        if x.fract() != 0.0 || !(0.0..=255.0).contains(&x) {
            return Err(Error::data(path, format!("label value {x} at voxel {i} is not an integer in 0..=255")));
        }
        out.push(x as u8);
    }
    assert_eq!(out.len(), v.len(), "write_labels: {} voxels for dims {:?}", out.len(), v.dims);
    let arr = fortran_view(&out, v.dims);
    write_with(path, v, |w| w.write_nifti(&arr))
}

/// (X, Y, Z) in Fortran order views an x-fastest buffer without copying.
fn fortran_view<T>(data: &[T], dims: [usize; 3]) -> ndarray::ArrayView3<'_, T> {
    use ndarray::ShapeBuilder;
    ndarray::ArrayView3::from_shape((dims[0], dims[1], dims[2]).f(), data)
        .expect("x-fastest buffer matches a Fortran-order (X, Y, Z) view")
}

/// Write through the crate's writer into a temporary file, then rename it over `path`.
fn write_with(
    path: &Path,
    v: &Volume,
    write: impl FnOnce(nifti::writer::WriterOptions<'_>) -> nifti::Result<()>,
) -> Result<()> {
    let header = output_header(v);
    let tmp = temp_path(path);
    let result = write(nifti::writer::WriterOptions::new(&tmp).reference_header(&header).compress(true))
        .map_err(|e| match e {
            nifti::NiftiError::Io(io) => Error::io(path, io),
            other => fmt_err(path, format!("cannot write NIfTI: {other}")),
        })
        .and_then(|_| std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e)));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// `dir/.name.<pid>.<n>.tmp.nii.gz`: same folder (rename stays atomic), a name that the
/// crate's writer keeps as is (it ends in `.nii.gz`).
fn temp_path(path: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = format!(".{name}.{}.{}.tmp.nii.gz", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
    path.with_file_name(tmp)
}
