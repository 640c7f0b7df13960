//! NIfTI reading and writing against an independent writer/reader (nibabel): the committed
//! fixtures in testdata/nifti were written by nibabel (make_fixtures.py) together with
//! nibabel's own shape, zooms, affine and get_fdata() (expected.json). We check that
//! read_volume agrees, that read → write → read keeps everything, that every bad input gives
//! one clear error naming the file, and (when Python's nibabel is installed) that nibabel reads
//! what we write.

#![allow(clippy::needless_range_loop)] // matrices read best with explicit indices

use meddpm::data::nifti::{read_volume, read_volume_bytes, write_labels, write_volume, Volume};
use meddpm::Error;
use std::io::Write;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixtures() -> PathBuf {
    root().join("testdata/nifti")
}

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meddpm-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn expected() -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn f64s(v: &serde_json::Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn check_against(v: &Volume, e: &serde_json::Value, what: &str) {
    let shape: Vec<usize> = e["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
    assert_eq!(&v.dims[..], &shape[..3], "{what}: dims");
    let zooms = f64s(&e["zooms"]);
    for a in 0..3 {
        assert_eq!(v.spacing[a] as f64, zooms[a], "{what}: spacing[{a}]");
    }
    let aff: Vec<Vec<f64>> = e["affine"].as_array().unwrap().iter().map(f64s).collect();
    for r in 0..4 {
        for c in 0..4 {
            let (got, want) = (v.affine[r][c] as f64, aff[r][c]);
            assert!((got - want).abs() <= 1e-6 * (1.0 + want.abs()), "{what}: affine[{r}][{c}] {got} vs {want}");
        }
    }
    let data = f64s(&e["data"]);
    assert_eq!(v.data.len(), data.len(), "{what}: voxel count");
    for (i, (&g, &w)) in v.data.iter().zip(&data).enumerate() {
        assert_eq!(g, w as f32, "{what}: voxel {i}");
    }
}

#[test]
fn reads_every_dtype_like_nibabel() {
    let e = expected();
    let good = e["good"].as_object().unwrap();
    assert!(good.len() >= 9);
    for (name, exp) in good {
        let v = read_volume(fixtures().join(name)).unwrap_or_else(|err| panic!("{name}: {err}"));
        check_against(&v, exp, name);
    }
    // the scaling really is applied: raw int16 (base − 60), slope 0.5, inter 10 → voxel (1,0,0) = −19.5·… check one
    let v = read_volume(fixtures().join("i16_scaled.nii.gz")).unwrap();
    assert_eq!(v.at(1, 0, 0), (1.0 - 60.0) * 0.5 + 10.0);
    assert_eq!(v.at(3, 4, 5), ((3 + 16 + 100) as f32 - 60.0) * 0.5 + 10.0);
}

#[test]
fn round_trip_keeps_data_dims_spacing_affine() {
    let e = expected();
    let dir = tempdir("roundtrip");
    for (name, exp) in e["good"].as_object().unwrap() {
        let v = read_volume(fixtures().join(name)).unwrap();
        let out = dir.join(format!("rt_{}", name.trim_end_matches(".gz").trim_end_matches(".nii")) + ".nii.gz");
        write_volume(&out, &v).unwrap();
        let w = read_volume(&out).unwrap();
        check_against(&w, exp, &format!("round trip of {name}"));
        // the header keeps what it had: orientation codes and units
        assert_eq!(w.header.xyzt_units, v.header.xyzt_units, "{name}");
        assert_eq!(w.header.datatype, 16, "{name}: written as float32");
        // and a second round trip is byte-identical
        let out2 = dir.join("again.nii.gz");
        write_volume(&out2, &w).unwrap();
        let w2 = read_volume(&out2).unwrap();
        assert_eq!(w2.data, w.data);
        assert_eq!(w2.affine, w.affine);
    }
    // no temporary files left behind
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn labels_are_written_as_uint8_and_refused_when_not_integers() {
    let dir = tempdir("labels");
    let mut v = read_volume(fixtures().join("u8.nii.gz")).unwrap();
    let p = dir.join("labels.nii.gz");
    write_labels(&p, &v).unwrap();
    let w = read_volume(&p).unwrap();
    assert_eq!(w.header.datatype, 2);
    assert_eq!(w.data, v.data);
    v.data[7] = 1.5;
    let err = write_labels(&p, &v).unwrap_err().to_string();
    assert!(err.contains("labels.nii.gz") && err.contains("1.5"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// One error, of the given kind, naming the file and containing `needle`.
fn assert_refused(r: Result<Volume, Error>, file: &str, needle: &str) {
    let err = match r {
        Ok(v) => panic!("{file}: accepted, dims {:?}", v.dims),
        Err(e) => e,
    };
    let msg = err.to_string();
    assert!(msg.contains(file), "error does not name {file}: {msg}");
    assert!(msg.contains(needle), "error for {file} does not say `{needle}`: {msg}");
    assert!(matches!(err, Error::Data { .. } | Error::Format { .. } | Error::Io { .. }), "{err:?}");
}

#[test]
fn bad_files_are_refused_with_the_file_named() {
    let e = expected();
    for (name, needle) in e["bad"].as_object().unwrap() {
        assert_refused(read_volume(fixtures().join(name)), name, needle.as_str().unwrap());
    }
    let dir = tempdir("bad");
    let good = std::fs::read(fixtures().join("f32.nii.gz")).unwrap();
    // truncated gzip
    let p = dir.join("truncated.nii.gz");
    std::fs::write(&p, &good[..good.len() / 2]).unwrap();
    assert_refused(read_volume(&p), "truncated.nii.gz", "gzip");
    // corrupt gzip: flip bytes in the deflate stream (CRC or inflate must fail)
    let mut bad = good.clone();
    for b in &mut bad[40..60] {
        *b ^= 0x5a;
    }
    let p = dir.join("corrupt.nii.gz");
    std::fs::write(&p, &bad).unwrap();
    assert_refused(read_volume(&p), "corrupt.nii.gz", "gzip");
    // uncompressed file cut inside the voxel data
    let raw = std::fs::read(fixtures().join("i32.nii")).unwrap();
    let p = dir.join("cut.nii");
    std::fs::write(&p, &raw[..raw.len() - 10]).unwrap();
    assert_refused(read_volume(&p), "cut.nii", "truncated");
    // cut inside the header
    let p = dir.join("short.nii");
    std::fs::write(&p, &raw[..200]).unwrap();
    assert_refused(read_volume(&p), "short.nii", "not a NIfTI-1 file");
    // not NIfTI at all
    let p = dir.join("text.nii.gz");
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&[b'x'; 400]).unwrap();
    std::fs::write(&p, gz.finish().unwrap()).unwrap();
    assert_refused(read_volume(&p), "text.nii.gz", "NIfTI");
    // empty and missing files
    let p = dir.join("empty.nii.gz");
    std::fs::write(&p, b"").unwrap();
    assert_refused(read_volume(&p), "empty.nii.gz", "not a NIfTI-1 file");
    assert_refused(read_volume(dir.join("missing.nii.gz")), "missing.nii.gz", "");
    // in-memory parsing names the given name
    assert_refused(read_volume_bytes(&good[..100], Path::new("memory.nii.gz")), "memory.nii.gz", "gzip");
    // writing into a missing folder fails naming the target, leaving nothing behind
    let v = read_volume(fixtures().join("f32.nii.gz")).unwrap();
    let target = dir.join("no/such/dir/out.nii.gz");
    let err = write_volume(&target, &v).unwrap_err().to_string();
    assert!(err.contains("out.nii.gz"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn new_volumes_have_a_plain_header() {
    let dir = tempdir("newvol");
    let data: Vec<f32> = (0..2 * 3 * 4).map(|i| i as f32 * 0.5).collect();
    let v = Volume::new([2, 3, 4], [1.5, 1.5, 2.0], data.clone());
    let p = dir.join("new.nii.gz");
    write_volume(&p, &v).unwrap();
    let w = read_volume(&p).unwrap();
    assert_eq!(w.data, data);
    assert_eq!(w.spacing, [1.5, 1.5, 2.0]);
    assert_eq!(w.affine, [[1.5, 0.0, 0.0, 0.0], [0.0, 1.5, 0.0, 0.0], [0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 1.0]]);
    std::fs::remove_dir_all(&dir).ok();
}

fn have_nibabel() -> bool {
    std::process::Command::new("python3")
        .args(["-c", "import nibabel"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

#[test]
fn nibabel_reads_what_we_write() {
    if !have_nibabel() {
        println!("SKIP nibabel_reads_what_we_write: `python3 -c 'import nibabel'` failed (pip install nibabel)");
        return;
    }
    let dir = tempdir("nibabel");
    // a rotated qform-only source: the affine must survive as nibabel sees it
    for src in ["qform_only.nii.gz", "i16_bigendian.nii.gz", "no_xform.nii.gz"] {
        let v = read_volume(fixtures().join(src)).unwrap();
        let p = dir.join(format!("ours_{src}"));
        write_volume(&p, &v).unwrap();
        let script = "import sys, json, nibabel as nib\n\
                      img = nib.load(sys.argv[1])\n\
                      d = img.get_fdata()\n\
                      print(json.dumps({'shape': list(d.shape), 'zooms': [float(z) for z in img.header.get_zooms()],\n\
                      'affine': img.affine.tolist(), 'data': d.ravel(order='F').tolist(), 'dtype': str(img.get_data_dtype())}))";
        let out = std::process::Command::new("python3").args(["-c", script]).arg(&p).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(got["dtype"], "float32");
        // nibabel's view of our file == nibabel's view of the source
        check_against(&v, &got, &format!("nibabel on our copy of {src}"));
        let e = expected();
        let want = &e["good"][src];
        let ga: Vec<Vec<f64>> = got["affine"].as_array().unwrap().iter().map(f64s).collect();
        let wa: Vec<Vec<f64>> = want["affine"].as_array().unwrap().iter().map(f64s).collect();
        for r in 0..4 {
            for c in 0..4 {
                assert!((ga[r][c] - wa[r][c]).abs() < 1e-5, "{src}: affine[{r}][{c}] {} vs {}", ga[r][c], wa[r][c]);
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
