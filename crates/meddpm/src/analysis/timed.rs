//! `Timed<B>`: a [`Backend`] that forwards every call to an inner backend and records one
//! [`KernelRecord`] per call — op name, category, wall time between two `sync()`s, FLOPs and
//! minimum bytes by our count, and the range path the caller (and the U-Net, through
//! [`Backend::push_range`]) has open. This is the CPU profile path: it lets `meddpm profile` build
//! the same breakdown without a GPU, so CI exercises the whole report pipeline.
//!
//! [`NullBackend`] computes nothing: its buffers are lengths. Wrapped in `Timed`, a U-Net pass over
//! it yields the exact list of calls with their FLOP and byte counts in milliseconds, even for the
//! full 128³ model — the input of the roofline predictions for any preset.
//!
//! Counting conventions (as `model::cost`, spec §8): a multiply-add is 2 FLOPs; convolutions count
//! `ConvShape::flops` per direction; attention counts QKᵀ and AV (4·T²·C per sample forward, twice
//! that backward), softmax is not counted; elementwise ops get no FLOP count (they are
//! memory-bound). Bytes are the minimum DRAM traffic: every buffer an op reads is read once, every
//! buffer it writes is written once, and an accumulating write (`+=`) is also a read.
//!
//! Both backends come from one description of the operations, [`backend_ops!`]: each
//! [`Backend`] method once, with its signature, whether the trait gives it a body, and its record
//! (name, category, FLOPs, elements moved). `Timed` forwards and records every listed method;
//! `NullBackend` implements the listed methods the trait requires with empty bodies and takes the
//! trait's bodies for the others. A new primitive is one entry here (see
//! `docs/add-a-primitive.md`); the test at the end fails when the trait and the list disagree.

use super::kernels::{Category, Category as C, KernelRecord};
use crate::backend::{
    Accum, AdamStep, Backend, DdpmCoefs, Layout, LossKind, Precision, Prediction, SamplerCoefs, YStats,
};
use crate::rng::Philox;
use crate::shape::{ConvShape, Dims};
use crate::Result;
use std::cell::RefCell;
use std::time::Instant;

/// A backend wrapper that times and counts every call (see the module docs).
pub struct Timed<B: Backend> {
    inner: B,
    records: RefCell<Vec<KernelRecord>>,
    ranges: RefCell<Vec<String>>,
}

const F32: f64 = 4.0;

impl<B: Backend> Timed<B> {
    pub fn new(inner: B) -> Self {
        Timed { inner, records: RefCell::new(Vec::new()), ranges: RefCell::new(Vec::new()) }
    }
    pub fn inner(&self) -> &B {
        &self.inner
    }
    /// The records so far, and clear them.
    pub fn take_records(&self) -> Vec<KernelRecord> {
        std::mem::take(&mut *self.records.borrow_mut())
    }
    /// The open range path, outermost first, joined by `/`.
    pub fn range_path(&self) -> Option<String> {
        let r = self.ranges.borrow();
        (!r.is_empty()).then(|| r.join("/"))
    }

    /// Time `f` between two syncs and record it. `reads`/`writes` are element counts.
    fn rec<R>(&self, name: &str, category: Category, flops: Option<f64>, elems: f64, f: impl FnOnce() -> R) -> R {
        self.inner.sync();
        let t0 = Instant::now();
        let r = f();
        self.inner.sync();
        let ns = t0.elapsed().as_nanos() as u64;
        let mut k = KernelRecord::new(name, ns);
        k.category = category;
        k.flops = flops;
        k.bytes = Some(elems * F32);
        k.range = self.range_path();
        self.records.borrow_mut().push(k);
        r
    }

    fn l(&self, b: &B::Buf) -> f64 {
        self.inner.len(b) as f64
    }
    /// [`Self::l`] of an optional operand (0 when absent).
    fn lo(&self, b: Option<&B::Buf>) -> f64 {
        b.map_or(0.0, |b| self.l(b))
    }
    /// Elements moved by an input-gradient write: written once, read too when accumulating.
    fn acc(&self, b: &B::Buf, a: Accum) -> f64 {
        match a {
            Accum::Overwrite => self.l(b),
            Accum::Add => 2.0 * self.l(b),
        }
    }
    /// Elements a GroupNorm+SiLU backward moves besides its activations: dγ, dβ accumulated (read
    /// and written), the statistics and γ, β read.
    fn gn_params(
        &self,
        (dg, db): (&B::Buf, &B::Buf),
        (mean, rstd): (&B::Buf, &B::Buf),
        (g, b): (&B::Buf, &B::Buf),
    ) -> f64 {
        2.0 * (self.l(dg) + self.l(db)) + self.l(mean) + self.l(rstd) + self.l(g) + self.l(b)
    }
}

fn attention_flops(x: Dims) -> f64 {
    let t = x.s() as f64;
    4.0 * t * t * x.c as f64 * x.n as f64
}

/// The one description of the [`Backend`] operations that [`Timed`] records: `$cb!` receives
/// `{ items }` (the caller's hand-written methods) and then every operation as
/// `required|provided fn name(args) => |t| (record name, category, FLOPs, elements)`.
/// `required` marks a method the trait declares without a body, `provided` one it gives a body
/// (a fused operation composed of the core ones, or a batched form); `t` is the [`Timed`] whose
/// helpers ([`Timed::l`], [`Timed::lo`], [`Timed::acc`], [`Timed::gn_params`]) count elements.
///
/// Not listed, and why (the test `every_trait_method_is_described` holds this list and the
/// trait together):
/// - queries and bookkeeping, written by hand in both impls: `describe`, `layout`, `precision`,
///   `alloc`, `len`, `sync`; in `Timed` also `push_range`, `pop_range` (its range path) and the
///   fusability queries `gn_conv_fusable`, `fused_conv_out_stats`, `cat_conv_fusable`;
/// - [`UNRECORDED`]: provided methods `Timed` leaves to the trait's body, so that their parts
///   are the records.
macro_rules! backend_ops {
    ($cb:ident! { $($items:tt)* }) => { $cb! { { $($items)* }
        // ---- memory
        required fn upload(host: &[f32], dst: &mut Self::Buf)
            => |t| ("upload", C::Memory, None, host.len() as f64);
        required fn download(src: &Self::Buf, host: &mut [f32])
            => |t| ("download", C::Memory, None, host.len() as f64);
        required fn upload_act(host_ncdhw: &[f32], x: Dims, dst: &mut Self::Buf)
            => |t| ("upload_act", C::Memory, None, host_ncdhw.len() as f64);
        provided fn stage_act(host_ncdhw: &[f32], x: Dims, dst: &mut Self::Buf)
            => |t| ("stage_act", C::Memory, None, host_ncdhw.len() as f64);
        required fn download_act(src: &Self::Buf, x: Dims, host_ncdhw: &mut [f32])
            => |t| ("download_act", C::Memory, None, host_ncdhw.len() as f64);
        required fn upload_param(host: &[f32], torch_shape: &[usize], dst: &mut Self::Buf)
            => |t| ("upload_param", C::Memory, None, host.len() as f64);
        required fn download_param(src: &Self::Buf, torch_shape: &[usize], host: &mut [f32])
            => |t| ("download_param", C::Memory, None, host.len() as f64);
        required fn zero(b: &mut Self::Buf) => |t| ("zero", C::Memory, None, t.l(b));
        required fn copy(dst: &mut Self::Buf, src: &Self::Buf) => |t| ("copy", C::Memory, None, 2.0 * t.l(src));
        provided fn cast(dst: &mut Self::Buf, src: &Self::Buf) => |t| ("cast", C::Memory, None, 2.0 * t.l(src));

        // ---- convolution
        required fn conv3d_forward_acc(
            out: (&mut Self::Buf, Accum), inp: &Self::Buf, w: &Self::Buf, b: Option<&Self::Buf>, cs: ConvShape,
        ) => |t| ("conv3d_forward", C::ConvForward, Some(cs.flops()),
            t.acc(out.0, out.1) + t.l(inp) + t.l(w) + t.lo(b));
        provided fn conv3d_forward_res(
            out: &mut Self::Buf, inp: &Self::Buf, w: &Self::Buf, b: &Self::Buf, z: &Self::Buf, cs: ConvShape,
        ) => |t| ("conv3d_forward", C::ConvForward, Some(cs.flops()),
            t.l(out) + t.l(z) + t.l(inp) + t.l(w) + t.l(b));
        required fn conv3d_backward(
            dinp: Option<(&mut Self::Buf, Accum)>, dw: &mut Self::Buf, db: Option<&mut Self::Buf>,
            dout: &Self::Buf, inp: &Self::Buf, w: &Self::Buf, cs: ConvShape,
        ) => |t| {
            let e = t.l(dout) + t.l(inp) + t.l(w) + 2.0 * (t.l(dw) + db.as_ref().map_or(0.0, |b| t.l(b)));
            match &dinp {
                Some((d, a)) => ("conv3d_backward", C::ConvBackward, Some(2.0 * cs.flops()), e + t.acc(d, *a)),
                None => ("conv3d_backward_wgrad", C::ConvWgrad, Some(cs.flops()), e),
            }
        };
        required fn conv3d_backward_data(dinp: (&mut Self::Buf, Accum), dout: &Self::Buf, w: &Self::Buf, cs: ConvShape)
            => |t| ("conv3d_backward_data", C::ConvDgrad, Some(cs.flops()), t.l(dout) + t.l(w) + t.acc(dinp.0, dinp.1));

        // ---- normalisation and activation
        required fn groupnorm_forward(
            out: &mut Self::Buf, mean: &mut Self::Buf, rstd: &mut Self::Buf, inp: &Self::Buf, gamma: &Self::Buf,
            beta: &Self::Buf, x: Dims, groups: usize,
        ) => |t| ("groupnorm_forward", C::Normalization, None,
            t.l(out) + t.l(mean) + t.l(rstd) + t.l(inp) + t.l(gamma) + t.l(beta));
        required fn groupnorm_backward(
            dinp: (&mut Self::Buf, Accum), dgamma: &mut Self::Buf, dbeta: &mut Self::Buf, dout: &Self::Buf,
            inp: &Self::Buf, mean: &Self::Buf, rstd: &Self::Buf, gamma: &Self::Buf, x: Dims, groups: usize,
        ) => |t| ("groupnorm_backward", C::Normalization, None,
            t.acc(dinp.0, dinp.1) + 2.0 * (t.l(dgamma) + t.l(dbeta))
                + t.l(dout) + t.l(inp) + t.l(mean) + t.l(rstd) + t.l(gamma));
        required fn groupnorm_stats(
            mean: &mut Self::Buf, rstd: &mut Self::Buf, inp: &Self::Buf, off: Option<&Self::Buf>, x: Dims, groups: usize,
        ) => |t| ("groupnorm_stats", C::Normalization, None, t.l(mean) + t.l(rstd) + t.l(inp) + t.lo(off));
        required fn silu_forward(out: &mut Self::Buf, inp: &Self::Buf)
            => |t| ("silu_forward", C::Elementwise, None, t.l(out) + t.l(inp));
        required fn silu_backward(dinp: (&mut Self::Buf, Accum), dout: &Self::Buf, inp: &Self::Buf)
            => |t| ("silu_backward", C::Elementwise, None, t.acc(dinp.0, dinp.1) + t.l(dout) + t.l(inp));
        provided fn groupnorm_silu_forward(
            out: &mut Self::Buf, mean: &mut Self::Buf, rstd: &mut Self::Buf, inp: &Self::Buf,
            off: Option<&Self::Buf>, gamma: &Self::Buf, beta: &Self::Buf, x: Dims, groups: usize,
        ) => |t| ("groupnorm_silu_forward", C::Normalization, None,
            t.l(out) + t.l(mean) + t.l(rstd) + t.l(inp) + t.lo(off) + t.l(gamma) + t.l(beta));
        // one record for the head as the inner backend runs it (fused on CUDA: inp read once,
        // out written; act untouched)
        provided fn groupnorm_silu_conv3d_forward(
            out: &mut Self::Buf, act: &mut Self::Buf, stats: (&mut Self::Buf, &mut Self::Buf), fresh: bool,
            inp: &Self::Buf, gb: (&Self::Buf, &Self::Buf), wb: (&Self::Buf, &Self::Buf), cs: ConvShape,
            groups: usize,
        ) => |t| ("groupnorm_silu_conv3d_forward", C::ConvForward, Some(cs.flops()),
            t.l(out) + t.l(stats.0) + t.l(stats.1) + t.l(inp) + t.l(gb.0) + t.l(gb.1) + t.l(wb.0) + t.l(wb.1));
        // one record as the inner backend runs it: inp read (twice with fresh statistics), out
        // written (read too when accumulated), z read
        provided fn groupnorm_silu_conv3d_fused(
            out: (&mut Self::Buf, Accum), inp: (&Self::Buf, Option<&Self::Buf>),
            stats: (&mut Self::Buf, &mut Self::Buf), fresh: bool, gb: (&Self::Buf, &Self::Buf),
            wbz: (&Self::Buf, Option<&Self::Buf>, Option<&Self::Buf>), cs: ConvShape, groups: usize,
            ystats: Option<YStats<'_, Self::Buf>>,
        ) => |t| ("groupnorm_silu_conv3d_fused", C::ConvForward, Some(cs.flops()),
            t.l(inp.0) * if fresh { 2.0 } else { 1.0 } + t.acc(out.0, out.1) + t.lo(wbz.2) + t.lo(inp.1)
                + t.l(stats.0) + t.l(stats.1) + t.l(gb.0) + t.l(gb.1) + t.l(wbz.0) + t.lo(wbz.1));
        // the two parts read, out written, the statistics written
        provided fn concat_skip_conv_stats(
            out: &mut Self::Buf, parts: (&Self::Buf, &Self::Buf), stats: (&mut Self::Buf, &mut Self::Buf),
            wb: (&Self::Buf, &Self::Buf), cs: ConvShape, ca: usize, groups: usize,
        ) => |t| ("concat_skip_conv_stats", C::ConvForward, Some(cs.flops()),
            t.l(parts.0) + t.l(parts.1) + t.l(out) + t.l(stats.0) + t.l(stats.1) + t.l(wb.0) + t.l(wb.1));
        provided fn groupnorm_silu_conv3d_fused_cat(
            out: &mut Self::Buf, parts: (&Self::Buf, &Self::Buf), stats: (&Self::Buf, &Self::Buf),
            gb: (&Self::Buf, &Self::Buf), w: &Self::Buf, cs: ConvShape, ca: usize, groups: usize,
            ystats: Option<YStats<'_, Self::Buf>>,
        ) => |t| ("groupnorm_silu_conv3d_fused_cat", C::ConvForward, Some(cs.flops()),
            t.l(parts.0) + t.l(parts.1) + t.l(out) + t.l(stats.0) + t.l(stats.1) + t.l(gb.0) + t.l(gb.1) + t.l(w));
        required fn groupnorm_silu_recompute(
            out: &mut Self::Buf, mean: &Self::Buf, rstd: &Self::Buf, inp: &Self::Buf, off: Option<&Self::Buf>,
            gamma: &Self::Buf, beta: &Self::Buf, x: Dims, groups: usize,
        ) => |t| ("groupnorm_silu_recompute", C::Normalization, None,
            t.l(out) + t.l(mean) + t.l(rstd) + t.l(inp) + t.lo(off) + t.l(gamma) + t.l(beta));
        provided fn groupnorm_silu_forward_inplace(
            x: &mut Self::Buf, mean: &mut Self::Buf, rstd: &mut Self::Buf, gamma: &Self::Buf, beta: &Self::Buf,
            xd: Dims, groups: usize,
        ) => |t| ("groupnorm_silu_forward", C::Normalization, None,
            2.0 * t.l(x) + t.l(mean) + t.l(rstd) + t.l(gamma) + t.l(beta));
        required fn groupnorm_silu_recompute_inplace(
            x: &mut Self::Buf, mean: &Self::Buf, rstd: &Self::Buf, gamma: &Self::Buf, beta: &Self::Buf, xd: Dims,
            groups: usize,
        ) => |t| ("groupnorm_silu_recompute", C::Normalization, None,
            2.0 * t.l(x) + t.l(mean) + t.l(rstd) + t.l(gamma) + t.l(beta));
        // d read and rewritten, the input read; dγ/dβ accumulated (read and written) as in every
        // other GroupNorm backward record
        required fn groupnorm_silu_backward_inplace(
            d: &mut Self::Buf, dgamma: &mut Self::Buf, dbeta: &mut Self::Buf, inp: &Self::Buf, mean: &Self::Buf,
            rstd: &Self::Buf, gamma: &Self::Buf, beta: &Self::Buf, x: Dims, groups: usize,
        ) => |t| ("groupnorm_silu_backward", C::Normalization, None,
            2.0 * t.l(d) + t.l(inp) + t.gn_params((dgamma, dbeta), (mean, rstd), (gamma, beta)));
        required fn groupnorm_silu_backward(
            dinp: (&mut Self::Buf, Accum), dgamma: &mut Self::Buf, dbeta: &mut Self::Buf, dout: &Self::Buf,
            inp: &Self::Buf, off: Option<&Self::Buf>, mean: &Self::Buf, rstd: &Self::Buf, gamma: &Self::Buf,
            beta: &Self::Buf, x: Dims, groups: usize,
        ) => |t| ("groupnorm_silu_backward", C::Normalization, None,
            t.acc(dinp.0, dinp.1) + t.l(dout) + t.l(inp) + t.lo(off)
                + t.gn_params((dgamma, dbeta), (mean, rstd), (gamma, beta)));
        provided fn groupnorm_silu_backward_sum(
            dinp: &mut Self::Buf, dsum: &mut Self::Buf, dgamma: &mut Self::Buf, dbeta: &mut Self::Buf,
            dout: &Self::Buf, inp: &Self::Buf, off: Option<&Self::Buf>, ms: (&Self::Buf, &Self::Buf),
            gb: (&Self::Buf, &Self::Buf), x: Dims, groups: usize,
        ) => |t| ("groupnorm_silu_backward", C::Normalization, None,
            t.l(dinp) + t.l(dsum) + t.l(dout) + t.l(inp) + t.lo(off) + t.gn_params((dgamma, dbeta), ms, gb));
        provided fn groupnorm_silu_backward_act(
            dinp: (&mut Self::Buf, Accum), dsum: Option<&mut Self::Buf>, act: &mut Self::Buf,
            dgb: (&mut Self::Buf, &mut Self::Buf), dout: &Self::Buf, inp: &Self::Buf, off: Option<&Self::Buf>,
            ms: (&Self::Buf, &Self::Buf), gb: (&Self::Buf, &Self::Buf), x: Dims, groups: usize,
        ) => |t| ("groupnorm_silu_backward", C::Normalization, None,
            t.acc(dinp.0, dinp.1) + dsum.as_ref().map_or(0.0, |s| t.l(s)) + t.l(act) + t.l(dout) + t.l(inp)
                + t.lo(off) + t.gn_params((dgb.0, dgb.1), ms, gb));
        provided fn groupnorm_silu_backward_inplace_act(
            d: &mut Self::Buf, x: &mut Self::Buf, dgb: (&mut Self::Buf, &mut Self::Buf),
            ms: (&Self::Buf, &Self::Buf), gb: (&Self::Buf, &Self::Buf), xd: Dims, groups: usize,
        ) => |t| ("groupnorm_silu_backward", C::Normalization, None,
            2.0 * (t.l(d) + t.l(x)) + t.gn_params((dgb.0, dgb.1), ms, gb));
        // the GroupNorm+SiLU backward from the parts into the parts, the skip conv's weight and
        // data gradients (their FLOPs): x read from the parts (twice: sums and elementwise pass)
        // and written once as the activation, dout read by both GEMMs
        provided fn groupnorm_silu_backward_cat_in(
            d: &mut Self::Buf, x: &mut Self::Buf, cat: (&Self::Buf, Option<&Self::Buf>, &Self::Buf),
            parts: ((&mut Self::Buf, Accum), (&mut Self::Buf, Accum)), dgb: (&mut Self::Buf, &mut Self::Buf),
            ms: (&Self::Buf, &Self::Buf), gb: (&Self::Buf, &Self::Buf),
            skip: (&Self::Buf, &Self::Buf, &Self::Buf, &mut Self::Buf, ConvShape), cacb: (usize, usize),
            groups: usize,
        ) => |t| {
            let p = t.gn_params((dgb.0, dgb.1), ms, gb);
            let (xr, hbl) = (2.0 * (t.l(cat.0) + t.l(cat.2)), t.lo(cat.1));
            let e = t.l(d) + xr + hbl + t.l(x) + t.acc(parts.0 .0, parts.0 .1) + t.acc(parts.1 .0, parts.1 .1) + p;
            let e = e + 2.0 * t.l(skip.0) + t.l(skip.1) + t.l(skip.2) + 2.0 * t.l(skip.3);
            ("groupnorm_silu_backward_cat_in", C::Normalization, Some(2.0 * skip.4.flops()), e)
        };

        // ---- linear
        required fn linear_forward(
            out: &mut Self::Buf, inp: &Self::Buf, w: &Self::Buf, b: &Self::Buf, n: usize, i: usize, o: usize,
        ) => |t| ("linear_forward", C::GemmAttention, Some(2.0 * (n * i * o) as f64),
            t.l(out) + t.l(inp) + t.l(w) + t.l(b));
        required fn linear_backward(
            dinp: Option<(&mut Self::Buf, Accum)>, dw: &mut Self::Buf, db: &mut Self::Buf, dout: &Self::Buf,
            inp: &Self::Buf, w: &Self::Buf, n: usize, i: usize, o: usize,
        ) => |t| {
            let e = t.l(dout) + t.l(inp) + t.l(w) + 2.0 * (t.l(dw) + t.l(db));
            let f = 2.0 * (n * i * o) as f64;
            match &dinp {
                Some((d, a)) => ("linear_backward", C::GemmAttention, Some(2.0 * f), e + t.acc(d, *a)),
                None => ("linear_backward", C::GemmAttention, Some(f), e),
            }
        };

        // ---- attention core
        required fn attention_forward(out: &mut Self::Buf, att: &mut Self::Buf, qkv: &Self::Buf, x: Dims, heads: usize)
            => |t| ("attention_forward", C::GemmAttention, Some(attention_flops(x)), t.l(out) + t.l(att) + t.l(qkv));
        required fn attention_backward(
            dqkv: &mut Self::Buf, datt: &mut Self::Buf, dout: &Self::Buf, qkv: &Self::Buf, att: &Self::Buf, x: Dims,
            heads: usize,
        ) => |t| ("attention_backward", C::GemmAttention, Some(2.0 * attention_flops(x)),
            t.l(dqkv) + 2.0 * t.l(datt) + t.l(dout) + t.l(qkv) + t.l(att));

        // ---- resampling
        required fn upsample_forward(out: &mut Self::Buf, inp: &Self::Buf, x: Dims)
            => |t| ("upsample_forward", C::Elementwise, None, t.l(out) + t.l(inp));
        required fn upsample_backward(dinp: (&mut Self::Buf, Accum), dout: &Self::Buf, x: Dims)
            => |t| ("upsample_backward", C::Elementwise, None, t.acc(dinp.0, dinp.1) + t.l(dout));
        // one record as the inner backend runs it (fused on CUDA: x read, out written; u untouched)
        provided fn upsample_conv3d_forward(
            out: &mut Self::Buf, u: &mut Self::Buf, x: &Self::Buf, xd: Dims, w: &Self::Buf, b: Option<&Self::Buf>,
            cs: ConvShape,
        ) => |t| ("upsample_conv3d_forward", C::ConvForward, Some(cs.flops()), t.l(out) + t.l(x) + t.l(w) + t.lo(b));
        // one record as the inner backend runs it (fused on CUDA: the doubled input written once,
        // read by the weight gradient)
        provided fn upsample_conv3d_backward(
            du: &mut Self::Buf, u: &mut Self::Buf, dw: &mut Self::Buf, db: Option<&mut Self::Buf>,
            dout: &Self::Buf, x: &Self::Buf, xd: Dims, w: &Self::Buf, cs: ConvShape,
        ) => |t| ("upsample_conv3d_backward", C::ConvBackward, Some(2.0 * cs.flops()),
            t.l(du) + 2.0 * t.l(u) + t.l(w) + 2.0 * (t.l(dw) + db.as_ref().map_or(0.0, |b| t.l(b)))
                + t.l(dout) + t.l(x));

        // ---- elementwise and channel plumbing
        required fn add_assign(dst: &mut Self::Buf, src: &Self::Buf)
            => |t| ("add_assign", C::Elementwise, None, 2.0 * t.l(dst) + t.l(src));
        required fn scale(buf: &mut Self::Buf, s: f32) => |t| ("scale", C::Elementwise, None, 2.0 * t.l(buf));
        required fn add_channel_bias(x: &mut Self::Buf, bias: &Self::Buf, xd: Dims)
            => |t| ("add_channel_bias", C::Elementwise, None, 2.0 * t.l(x) + t.l(bias));
        required fn add_channel_bias_to(out: &mut Self::Buf, x: &Self::Buf, bias: &Self::Buf, xd: Dims)
            => |t| ("add_channel_bias", C::Elementwise, None, t.l(out) + t.l(x) + t.l(bias));
        required fn add_bias_vectors(out: &mut Self::Buf, a: &Self::Buf, b: &Self::Buf)
            => |t| ("add_bias_vectors", C::Elementwise, None, t.l(out) + t.l(a) + t.l(b));
        provided fn add_bias_vectors_all(triples: &mut [(&mut Self::Buf, &Self::Buf, &Self::Buf)])
            => |t| ("add_bias_vectors_all", C::Elementwise, None,
                triples.iter().map(|(o, a, b)| t.l(o) + t.l(a) + t.l(b)).sum());
        required fn channel_sum(dbias: &mut Self::Buf, dx: &Self::Buf, xd: Dims)
            => |t| ("channel_sum", C::Reduction, None, t.l(dbias) + t.l(dx));
        required fn bias_grad_rows(db: &mut Self::Buf, rows: &Self::Buf, n: usize, c: usize)
            => |t| ("bias_grad_rows", C::Reduction, None, 2.0 * t.l(db) + t.l(rows));
        required fn concat_channels_bias(
            out: &mut Self::Buf, a: &Self::Buf, a_bias: Option<&Self::Buf>, b: &Self::Buf, x: Dims, ca: usize,
            cb: usize,
        ) => |t| ("concat_channels", C::Elementwise, None, t.l(out) + t.l(a) + t.l(b) + t.lo(a_bias));
        provided fn concat_channels_stats(
            out: &mut Self::Buf, a: &Self::Buf, a_bias: Option<&Self::Buf>, b: &Self::Buf,
            stats: (&mut Self::Buf, &mut Self::Buf), x: Dims, ca: usize, cb: usize, groups: usize,
        ) => |t| ("concat_channels_stats", C::Elementwise, None,
            t.l(out) + t.l(a) + t.lo(a_bias) + t.l(b) + t.l(stats.0) + t.l(stats.1));
        required fn split_channels(
            da: (&mut Self::Buf, Accum), db: (&mut Self::Buf, Accum), dout: &Self::Buf, x: Dims, ca: usize, cb: usize,
        ) => |t| ("split_channels", C::Elementwise, None, t.acc(da.0, da.1) + t.acc(db.0, db.1) + t.l(dout));

        // ---- loss
        required fn loss_forward(loss: &mut Self::Buf, pred: &Self::Buf, target: &Self::Buf, kind: LossKind)
            => |t| ("loss_forward", C::Reduction, None, t.l(loss) + t.l(pred) + t.l(target));
        required fn loss_backward(
            dpred: &mut Self::Buf, pred: &Self::Buf, target: &Self::Buf, kind: LossKind, scale: f32,
        ) => |t| ("loss_backward", C::Elementwise, None, t.l(dpred) + t.l(pred) + t.l(target));

        // ---- diffusion
        required fn randn(out: &mut Self::Buf, rng: Philox, offset: u64, x: Dims)
            => |t| ("randn", C::Elementwise, None, t.l(out));
        required fn q_sample(xt: &mut Self::Buf, x0: &Self::Buf, eps: &Self::Buf, a: &[f32], b: &[f32], x: Dims)
            => |t| ("q_sample", C::Elementwise, None, t.l(xt) + t.l(x0) + t.l(eps));
        required fn ddpm_step(x: &mut Self::Buf, eps: &Self::Buf, z: &Self::Buf, coefs: &[DdpmCoefs], xd: Dims)
            => |t| ("ddpm_step", C::Elementwise, None, 2.0 * t.l(x) + t.l(eps) + t.l(z));
        required fn sampler_step(
            x: &mut Self::Buf, eps: &Self::Buf, hist: &mut [Self::Buf], pred: Prediction, clip: bool,
            coefs: &[SamplerCoefs], xd: Dims,
        ) => |t| ("sampler_step", C::Elementwise, None,
            2.0 * t.l(x) + t.l(eps) + 2.0 * hist.iter().map(|h| t.l(h)).sum::<f64>());

        // ---- optimiser
        required fn adam_step(p: &mut Self::Buf, g: &Self::Buf, m: &mut Self::Buf, v: &mut Self::Buf, h: AdamStep)
            => |t| ("adam_step", C::Optimizer, None, 2.0 * (t.l(p) + t.l(m) + t.l(v)) + t.l(g));
        required fn ema_update(ema: &mut Self::Buf, p: &Self::Buf, decay: f32)
            => |t| ("ema_update", C::Optimizer, None, 2.0 * t.l(ema) + t.l(p));
    } };
}

/// Provided [`Backend`] methods that [`Timed`] does not forward: it runs the trait's body, so the
/// calls that body makes are recorded one by one (the per-call profile's view).
pub const UNRECORDED: &[&str] = &[
    "replay",
    "conv3d_forward",
    "conv3d_backward_data_gn",
    "groupnorm_silu_backward_act_res",
    "concat_channels",
    "q_sample_input",
    "adam_step_all",
    "ema_update_all",
    "cast_all",
];

/// `impl Backend for Timed<B>`: the hand-written items, then every listed operation timed between
/// two syncs and recorded.
macro_rules! impl_timed {
    ({ $($items:tt)* } $(
        $kind:ident fn $name:ident($($arg:ident: $ty:ty),* $(,)?) => |$t:ident| $rec:expr;
    )*) => {
        #[allow(unused_variables)]
        impl<B: Backend> Backend for Timed<B> {
            $($items)*
            $(
                fn $name(&self, $($arg: $ty),*) {
                    let $t = self;
                    let (name, category, flops, elems) = $rec;
                    self.rec(name, category, flops, elems, || self.inner.$name($($arg),*))
                }
            )*
        }

        /// Every operation of [`backend_ops!`] by name, with `true` where the trait provides a
        /// body.
        pub const DESCRIBED: &[(&str, bool)] = &[$((stringify!($name), op_kind!($kind))),*];
    };
}

/// `provided` → true, `required` → false (any other word does not compile).
macro_rules! op_kind {
    (required) => {
        false
    };
    (provided) => {
        true
    };
}

/// `impl Backend for NullBackend`: the hand-written items, then an empty body for every listed
/// operation the trait requires (the provided ones keep the trait's body, made of those).
macro_rules! impl_null {
    ({ $($items:tt)* } $(
        $kind:ident fn $name:ident($($arg:ident: $ty:ty),* $(,)?) => |$t:ident| $rec:expr;
    )*) => {
        #[allow(unused_variables)]
        impl Backend for NullBackend {
            $($items)*
            $( null_op!($kind fn $name($($arg: $ty),*)); )*
        }
    };
}

/// One `NullBackend` method: nothing for a required one, the trait's body for a provided one.
macro_rules! null_op {
    (required fn $name:ident($($arg:ident: $ty:ty),*)) => {
        fn $name(&self, $($arg: $ty),*) {}
    };
    (provided fn $name:ident($($arg:ident: $ty:ty),*)) => {};
}

backend_ops!(impl_timed! {
    type Buf = B::Buf;

    fn describe(&self) -> String {
        format!("{} (timed per op)", self.inner.describe())
    }
    fn layout(&self) -> Layout {
        self.inner.layout()
    }
    fn precision(&self) -> Precision {
        self.inner.precision()
    }
    fn alloc(&self, len: usize) -> Result<Self::Buf> {
        self.inner.alloc(len)
    }
    // The inner backend's activation type (bf16 under Precision::Bf16), not the trait's f32 body.
    fn alloc_act(&self, len: usize) -> Result<Self::Buf> {
        self.inner.alloc_act(len)
    }
    fn len(&self, b: &Self::Buf) -> usize {
        self.inner.len(b)
    }
    fn sync(&self) {
        self.inner.sync()
    }
    fn push_range(&self, name: &str) {
        self.ranges.borrow_mut().push(name.to_string());
        self.inner.push_range(name)
    }
    fn pop_range(&self) {
        self.ranges.borrow_mut().pop();
        self.inner.pop_range()
    }
    fn gn_conv_fusable(&self, inp: &Self::Buf, w: &Self::Buf, cs: ConvShape, add: bool, groups: usize) -> bool {
        self.inner.gn_conv_fusable(inp, w, cs, add, groups)
    }
    fn fused_conv_out_stats(&self) -> bool {
        self.inner.fused_conv_out_stats()
    }
    fn cat_conv_fusable(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        w_skip: &Self::Buf,
        cs: ConvShape,
        ca: usize,
        groups: usize,
    ) -> bool {
        self.inner.cat_conv_fusable(x, w, w_skip, cs, ca, groups)
    }
});

/// A backend that computes nothing: a buffer is its length. Used under [`Timed`] to list and
/// count the calls of a pass for any model size (see the module docs). Downloads leave the host
/// slice untouched.
#[derive(Clone, Copy, Debug)]
pub struct NullBackend {
    pub layout: Layout,
    pub precision: Precision,
}

impl Default for NullBackend {
    fn default() -> Self {
        NullBackend { layout: Layout::Ncdhw, precision: Precision::Fp32 }
    }
}

backend_ops!(impl_null! {
    type Buf = usize;

    fn describe(&self) -> String {
        "null backend (counts calls, FLOPs and bytes; computes nothing)".into()
    }
    fn layout(&self) -> Layout {
        self.layout
    }
    fn precision(&self) -> Precision {
        self.precision
    }
    fn alloc(&self, len: usize) -> Result<usize> {
        Ok(len)
    }
    fn len(&self, b: &usize) -> usize {
        *b
    }
    fn sync(&self) {}
});

#[cfg(test)]
mod tests {
    use super::*;

    /// The methods of `trait Backend` in backend.rs, each with `true` where it has a body.
    fn trait_methods() -> Vec<(String, bool)> {
        let src = include_str!("../backend.rs");
        let start = src.find("pub trait Backend {").expect("trait Backend in backend.rs");
        let body = &src[start..];
        let end = body.find("\n}\n").expect("end of trait Backend");
        let body = &body[..end];
        let mut out = Vec::new();
        for (i, line) in body.lines().enumerate() {
            let Some(rest) = line.strip_prefix("    fn ") else { continue };
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            // the signature ends at the first line (from this one) ending in `;` or `{`
            let tail = body.lines().skip(i).find(|l| l.ends_with(';') || l.ends_with('{')).unwrap();
            out.push((name, tail.ends_with('{')));
        }
        out
    }

    /// Every trait method is described once: in [`backend_ops!`] (as required or provided, as the
    /// trait has it), hand-written, or left to the trait's body ([`UNRECORDED`]).
    #[test]
    fn every_trait_method_is_described() {
        let by_hand = [
            "describe",
            "layout",
            "precision",
            "alloc",
            "alloc_act",
            "len",
            "sync",
            "push_range",
            "pop_range",
            "gn_conv_fusable",
            "fused_conv_out_stats",
            "cat_conv_fusable",
        ];
        let methods = trait_methods();
        assert!(methods.len() > 60, "parsed {} trait methods", methods.len());
        for (m, provided) in &methods {
            let described = DESCRIBED.iter().filter(|(n, _)| n == m).collect::<Vec<_>>();
            let elsewhere = by_hand.contains(&m.as_str()) || UNRECORDED.contains(&m.as_str());
            match (described.as_slice(), elsewhere) {
                ([(_, p)], false) => {
                    assert_eq!(p, provided, "{m}: backend_ops! says provided = {p}, the trait {provided}")
                }
                ([], true) => {}
                _ => panic!("{m}: list it once in backend_ops! (or in UNRECORDED / by hand, with a reason)"),
            }
        }
        for (n, _) in DESCRIBED {
            assert!(methods.iter().any(|(m, _)| m == n), "{n}: in backend_ops! but not in trait Backend");
        }
    }
}
