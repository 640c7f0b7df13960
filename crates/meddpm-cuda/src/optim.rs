//! Adam (torch.optim.Adam semantics, no weight decay) and the EMA update (kernels/optim.cu), per
//! tensor and over every parameter tensor in one launch (`*_multi`: a device table of the tensors'
//! addresses, built once per set of buffers and kept). Semantics: `Backend::adam_step`,
//! `ema_update`, `*_all`; CPU twin cpu/optim.rs.

use meddpm::backend::AdamStep;

use std::collections::HashMap;
use std::sync::Mutex;

use cudarc::driver::CudaSlice;

use crate::buf::{require_f32, GpuBuf};
use crate::device::{Arg::*, Device};

pub(crate) fn adam(dev: &Device, p: &mut GpuBuf, g: &GpuBuf, m: &mut GpuBuf, v: &mut GpuBuf, h: AdamStep) {
    let n = p.len();
    assert!(
        g.len() == n && m.len() == n && v.len() == n,
        "adam_step: lengths p {n} g {} m {} v {}",
        g.len(),
        m.len(),
        v.len()
    );
    assert!(h.t >= 1, "adam_step: step count t is 1-based, got 0");
    require_f32("adam_step", &[p, g, m, v]);
    let t = h.t as f64;
    let bc1 = 1.0 - (h.beta1 as f64).powf(t);
    let bc2 = 1.0 - (h.beta2 as f64).powf(t);
    let step_size = (h.lr as f64 / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    dev.launch1(
        "adam_step",
        n,
        &[
            P(dev.ptr_mut(p)),
            P(dev.ptr(g)),
            P(dev.ptr_mut(m)),
            P(dev.ptr_mut(v)),
            F(h.beta1),
            F(h.beta2),
            F(h.eps),
            F(step_size),
            F(bc2_sqrt),
            L(n as i64),
        ],
    );
}

pub(crate) fn ema(dev: &Device, ema: &mut GpuBuf, p: &GpuBuf, decay: f32) {
    assert_eq!(ema.len(), p.len(), "ema_update: lengths differ");
    require_f32("ema_update", &[ema, p]);
    let n = p.len();
    dev.launch1("ema_update", n, &[P(dev.ptr_mut(ema)), P(dev.ptr(p)), F(decay), L(n as i64)]);
}

/// Elements per block of the multi-tensor kernels (`MT_CHUNK` in kernels/optim.cu).
const MT_CHUNK: usize = 4096;

/// One entry of a multi-tensor table (`struct MTensor` in kernels/optim.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct MTensor {
    p: [u64; 4],
    n: i64,
    b0: i64,
}

/// Device tables of tensor sets, by their addresses (a set of buffers keeps its table; the
/// trainer has two or three sets: online weights, EMA weights, weight copies).
#[derive(Default)]
pub(crate) struct Tables {
    map: HashMap<Vec<u64>, (CudaSlice<u8>, usize, usize)>,
}

/// The table for `rows` (pointers, element count): (device address, entries, blocks).
fn table(dev: &Device, tables: &Mutex<Tables>, rows: &[([u64; 4], usize)]) -> (u64, usize, usize) {
    let key: Vec<u64> = rows.iter().flat_map(|(p, n)| p.iter().copied().chain([*n as u64])).collect();
    let mut t = tables.lock().unwrap_or_else(|e| e.into_inner());
    if !t.map.contains_key(&key) {
        let mut b0 = 0usize;
        let entries: Vec<MTensor> = rows
            .iter()
            .map(|(p, n)| {
                let e = MTensor { p: *p, n: *n as i64, b0: b0 as i64 };
                b0 += n.div_ceil(MT_CHUNK).max(1);
                e
            })
            .collect();
        // SAFETY: MTensor is plain old data (#[repr(C)], u64/i64 fields).
        let bytes = unsafe {
            std::slice::from_raw_parts(entries.as_ptr() as *const u8, entries.len() * std::mem::size_of::<MTensor>())
        };
        let mut buf = dev.stream.alloc_zeros::<u8>(bytes.len().max(1)).unwrap_or_else(|e| panic!("{e}"));
        dev.stream.memcpy_htod(bytes, &mut buf).unwrap_or_else(|e| panic!("upload of a tensor table: {e}"));
        t.map.insert(key.clone(), (buf, entries.len(), b0));
    }
    let (buf, n, blocks) = &t.map[&key];
    (dev.ptr(buf), *n, *blocks)
}

fn launch_multi(dev: &Device, name: &str, tbl: (u64, usize, usize), extra: &[crate::device::Arg]) {
    let (ptr, n, blocks) = tbl;
    if n == 0 {
        return;
    }
    let mut args = vec![P(ptr), I(n as i32)];
    args.extend_from_slice(extra);
    dev.launch(name, (blocks as u32, 1, 1), (256, 1, 1), &args);
}

/// Adam over every tensor i of (p, g, m, v) in one launch; `zero_g` zeroes the gradients.
#[allow(clippy::too_many_arguments)]
pub(crate) fn adam_all(
    dev: &Device,
    tables: &Mutex<Tables>,
    p: &mut [GpuBuf],
    g: &mut [GpuBuf],
    m: &mut [GpuBuf],
    v: &mut [GpuBuf],
    h: AdamStep,
    zero_g: bool,
) {
    assert!(g.len() == p.len() && m.len() == p.len() && v.len() == p.len(), "adam_step_all: tensor counts differ");
    assert!(h.t >= 1, "adam_step_all: step count t is 1-based, got 0");
    let mut rows = Vec::with_capacity(p.len());
    for i in 0..p.len() {
        let n = p[i].len();
        assert!(g[i].len() == n && m[i].len() == n && v[i].len() == n, "adam_step_all: tensor {i} lengths differ");
        require_f32("adam_step_all", &[&p[i], &g[i], &m[i], &v[i]]);
        rows.push((
            [dev.ptr_mut(&mut p[i]), dev.ptr_mut(&mut g[i]), dev.ptr_mut(&mut m[i]), dev.ptr_mut(&mut v[i])],
            n,
        ));
    }
    let t = h.t as f64;
    let step_size = (h.lr as f64 / (1.0 - (h.beta1 as f64).powf(t))) as f32;
    let bc2_sqrt = (1.0 - (h.beta2 as f64).powf(t)).sqrt() as f32;
    let tbl = table(dev, tables, &rows);
    launch_multi(
        dev,
        "adam_multi",
        tbl,
        &[F(h.beta1), F(h.beta2), F(h.eps), F(step_size), F(bc2_sqrt), I(zero_g as i32)],
    );
}

/// EMA over every tensor in one launch (decay 0: exact copy).
pub(crate) fn ema_all(dev: &Device, tables: &Mutex<Tables>, ema: &mut [GpuBuf], p: &[GpuBuf], decay: f32) {
    assert_eq!(ema.len(), p.len(), "ema_update_all: tensor counts differ");
    let mut rows = Vec::with_capacity(p.len());
    for (e, q) in ema.iter_mut().zip(p) {
        assert_eq!(e.len(), q.len(), "ema_update_all: lengths differ");
        require_f32("ema_update_all", &[e, q]);
        rows.push(([dev.ptr_mut(e), dev.ptr(q), 0, 0], q.len()));
    }
    let tbl = table(dev, tables, &rows);
    launch_multi(dev, "ema_multi", tbl, &[F(decay)]);
}

/// out = a + b for every f32 triple, one launch (kernel add_multi; `Backend::add_bias_vectors_all`).
pub(crate) fn add_all(dev: &Device, tables: &Mutex<Tables>, triples: &mut [(&mut GpuBuf, &GpuBuf, &GpuBuf)]) {
    let mut rows = Vec::with_capacity(triples.len());
    for (o, a, b) in triples.iter_mut() {
        meddpm::backend::check_bias_vectors(o.len(), a.len(), b.len());
        crate::buf::require_f32("add_bias_vectors_all", &[&**o, *a, *b]);
        rows.push(([dev.ptr_mut(*o), dev.ptr(*a), dev.ptr(*b), 0], a.len()));
    }
    let tbl = table(dev, tables, &rows);
    launch_multi(dev, "add_multi", tbl, &[]);
}

/// dst <- src (type conversion) for every pair in one launch.
pub(crate) fn cast_all(dev: &Device, tables: &Mutex<Tables>, pairs: &mut [(&mut GpuBuf, &GpuBuf)]) {
    let mut rows = Vec::with_capacity(pairs.len());
    for (d, s) in pairs.iter_mut() {
        assert_eq!(d.len(), s.len(), "cast_all: lengths differ");
        let dt = d.bf() as u64 | ((s.bf() as u64) << 1);
        rows.push(([dev.ptr_mut(*d), dev.ptr(*s), dt, 0], s.len()));
    }
    let tbl = table(dev, tables, &rows);
    launch_multi(dev, "cast_multi", tbl, &[]);
}
