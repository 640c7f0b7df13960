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

use super::kernels::{Category, KernelRecord};
use crate::backend::{Accum, AdamStep, Backend, DdpmCoefs, Layout, LossKind, Precision, Prediction, SamplerCoefs};
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

impl<B: Backend> Backend for Timed<B> {
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
    fn len(&self, b: &Self::Buf) -> usize {
        self.inner.len(b)
    }
    fn upload(&self, host: &[f32], dst: &mut Self::Buf) {
        self.rec("upload", Category::Memory, None, host.len() as f64, || self.inner.upload(host, dst))
    }
    fn download(&self, src: &Self::Buf, host: &mut [f32]) {
        let n = host.len() as f64;
        self.rec("download", Category::Memory, None, n, || self.inner.download(src, host))
    }
    fn upload_act(&self, host_ncdhw: &[f32], x: Dims, dst: &mut Self::Buf) {
        let n = host_ncdhw.len() as f64;
        self.rec("upload_act", Category::Memory, None, n, || self.inner.upload_act(host_ncdhw, x, dst))
    }
    fn stage_act(&self, host_ncdhw: &[f32], x: Dims, dst: &mut Self::Buf) {
        let n = host_ncdhw.len() as f64;
        self.rec("stage_act", Category::Memory, None, n, || self.inner.stage_act(host_ncdhw, x, dst))
    }
    fn download_act(&self, src: &Self::Buf, x: Dims, host_ncdhw: &mut [f32]) {
        let n = host_ncdhw.len() as f64;
        self.rec("download_act", Category::Memory, None, n, || self.inner.download_act(src, x, host_ncdhw))
    }
    fn upload_param(&self, host: &[f32], torch_shape: &[usize], dst: &mut Self::Buf) {
        let n = host.len() as f64;
        self.rec("upload_param", Category::Memory, None, n, || self.inner.upload_param(host, torch_shape, dst))
    }
    fn download_param(&self, src: &Self::Buf, torch_shape: &[usize], host: &mut [f32]) {
        let n = host.len() as f64;
        self.rec("download_param", Category::Memory, None, n, || self.inner.download_param(src, torch_shape, host))
    }
    fn zero(&self, b: &mut Self::Buf) {
        let n = self.l(b);
        self.rec("zero", Category::Memory, None, n, || self.inner.zero(b))
    }
    fn copy(&self, dst: &mut Self::Buf, src: &Self::Buf) {
        let n = 2.0 * self.l(src);
        self.rec("copy", Category::Memory, None, n, || self.inner.copy(dst, src))
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

    fn conv3d_forward_acc(
        &self,
        (out, acc): (&mut Self::Buf, Accum),
        inp: &Self::Buf,
        w: &Self::Buf,
        b: Option<&Self::Buf>,
        cs: ConvShape,
    ) {
        // an added-to output is read as well as written
        let reads_out = if acc == Accum::Add { 2.0 } else { 1.0 };
        let e = reads_out * self.l(out) + self.l(inp) + self.l(w) + b.map_or(0.0, |b| self.l(b));
        self.rec("conv3d_forward", Category::ConvForward, Some(cs.flops()), e, || {
            self.inner.conv3d_forward_acc((out, acc), inp, w, b, cs)
        })
    }
    fn conv3d_forward_res(
        &self,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        w: &Self::Buf,
        b: &Self::Buf,
        z: &Self::Buf,
        cs: ConvShape,
    ) {
        let e = self.l(out) + self.l(z) + self.l(inp) + self.l(w) + self.l(b);
        self.rec("conv3d_forward", Category::ConvForward, Some(cs.flops()), e, || {
            self.inner.conv3d_forward_res(out, inp, w, b, z, cs)
        })
    }
    fn conv3d_backward(
        &self,
        dinp: Option<(&mut Self::Buf, Accum)>,
        dw: &mut Self::Buf,
        db: Option<&mut Self::Buf>,
        dout: &Self::Buf,
        inp: &Self::Buf,
        w: &Self::Buf,
        cs: ConvShape,
    ) {
        let db_bytes = db.as_ref().map_or(0.0, |b| self.l(b));
        let mut e = self.l(dout) + self.l(inp) + self.l(w) + 2.0 * (self.l(dw) + db_bytes);
        let (name, cat, flops) = match &dinp {
            Some((d, a)) => {
                e += self.acc(d, *a);
                ("conv3d_backward", Category::ConvBackward, 2.0 * cs.flops())
            }
            None => ("conv3d_backward_wgrad", Category::ConvWgrad, cs.flops()),
        };
        self.rec(name, cat, Some(flops), e, || self.inner.conv3d_backward(dinp, dw, db, dout, inp, w, cs))
    }
    fn conv3d_backward_data(&self, dinp: (&mut Self::Buf, Accum), dout: &Self::Buf, w: &Self::Buf, cs: ConvShape) {
        let e = self.l(dout) + self.l(w) + self.acc(dinp.0, dinp.1);
        self.rec("conv3d_backward_data", Category::ConvDgrad, Some(cs.flops()), e, || {
            self.inner.conv3d_backward_data(dinp, dout, w, cs)
        })
    }
    fn groupnorm_forward(
        &self,
        out: &mut Self::Buf,
        mean: &mut Self::Buf,
        rstd: &mut Self::Buf,
        inp: &Self::Buf,
        gamma: &Self::Buf,
        beta: &Self::Buf,
        x: Dims,
        groups: usize,
    ) {
        let e = self.l(out) + self.l(mean) + self.l(rstd) + self.l(inp) + self.l(gamma) + self.l(beta);
        self.rec("groupnorm_forward", Category::Normalization, None, e, || {
            self.inner.groupnorm_forward(out, mean, rstd, inp, gamma, beta, x, groups)
        })
    }
    fn groupnorm_backward(
        &self,
        dinp: (&mut Self::Buf, Accum),
        dgamma: &mut Self::Buf,
        dbeta: &mut Self::Buf,
        dout: &Self::Buf,
        inp: &Self::Buf,
        mean: &Self::Buf,
        rstd: &Self::Buf,
        gamma: &Self::Buf,
        x: Dims,
        groups: usize,
    ) {
        let e = self.acc(dinp.0, dinp.1)
            + 2.0 * (self.l(dgamma) + self.l(dbeta))
            + self.l(dout)
            + self.l(inp)
            + self.l(mean)
            + self.l(rstd)
            + self.l(gamma);
        self.rec("groupnorm_backward", Category::Normalization, None, e, || {
            self.inner.groupnorm_backward(dinp, dgamma, dbeta, dout, inp, mean, rstd, gamma, x, groups)
        })
    }
    fn silu_forward(&self, out: &mut Self::Buf, inp: &Self::Buf) {
        let e = self.l(out) + self.l(inp);
        self.rec("silu_forward", Category::Elementwise, None, e, || self.inner.silu_forward(out, inp))
    }
    fn silu_backward(&self, dinp: (&mut Self::Buf, Accum), dout: &Self::Buf, inp: &Self::Buf) {
        let e = self.acc(dinp.0, dinp.1) + self.l(dout) + self.l(inp);
        self.rec("silu_backward", Category::Elementwise, None, e, || self.inner.silu_backward(dinp, dout, inp))
    }
    fn groupnorm_silu_forward(
        &self,
        out: &mut Self::Buf,
        mean: &mut Self::Buf,
        rstd: &mut Self::Buf,
        inp: &Self::Buf,
        off: Option<&Self::Buf>,
        gamma: &Self::Buf,
        beta: &Self::Buf,
        x: Dims,
        groups: usize,
    ) {
        let e = self.l(out) + self.l(mean) + self.l(rstd) + self.l(inp) + self.lo(off) + self.l(gamma) + self.l(beta);
        self.rec("groupnorm_silu_forward", Category::Normalization, None, e, || {
            self.inner.groupnorm_silu_forward(out, mean, rstd, inp, off, gamma, beta, x, groups)
        })
    }
    fn groupnorm_silu_conv3d_forward(
        &self,
        out: &mut Self::Buf,
        act: &mut Self::Buf,
        (mean, rstd): (&mut Self::Buf, &mut Self::Buf),
        fresh: bool,
        inp: &Self::Buf,
        (gamma, beta): (&Self::Buf, &Self::Buf),
        (w, b): (&Self::Buf, &Self::Buf),
        cs: ConvShape,
        groups: usize,
    ) {
        // one record for the head as the inner backend runs it (fused on CUDA: inp read once,
        // out written; act untouched)
        let e = self.l(out)
            + self.l(mean)
            + self.l(rstd)
            + self.l(inp)
            + self.l(gamma)
            + self.l(beta)
            + self.l(w)
            + self.l(b);
        self.rec("groupnorm_silu_conv3d_forward", Category::ConvForward, Some(cs.flops()), e, || {
            self.inner.groupnorm_silu_conv3d_forward(
                out,
                act,
                (mean, rstd),
                fresh,
                inp,
                (gamma, beta),
                (w, b),
                cs,
                groups,
            )
        })
    }
    fn gn_conv_fusable(&self, inp: &Self::Buf, w: &Self::Buf, cs: ConvShape, add: bool, groups: usize) -> bool {
        self.inner.gn_conv_fusable(inp, w, cs, add, groups)
    }
    fn fused_conv_out_stats(&self) -> bool {
        self.inner.fused_conv_out_stats()
    }
    fn groupnorm_silu_conv3d_fused(
        &self,
        (out, mode): (&mut Self::Buf, Accum),
        (inp, off): (&Self::Buf, Option<&Self::Buf>),
        (mean, rstd): (&mut Self::Buf, &mut Self::Buf),
        fresh: bool,
        (gamma, beta): (&Self::Buf, &Self::Buf),
        (w, b, z): (&Self::Buf, Option<&Self::Buf>, Option<&Self::Buf>),
        cs: ConvShape,
        groups: usize,
        ystats: Option<crate::backend::YStats<'_, Self::Buf>>,
    ) {
        // one record as the inner backend runs it: inp read (twice with fresh statistics), out
        // written (read too when accumulated), z read
        let e = self.l(inp) * if fresh { 2.0 } else { 1.0 }
            + self.acc(out, mode)
            + self.lo(z)
            + self.lo(off)
            + self.l(mean)
            + self.l(rstd)
            + self.l(gamma)
            + self.l(beta)
            + self.l(w)
            + self.lo(b);
        self.rec("groupnorm_silu_conv3d_fused", Category::ConvForward, Some(cs.flops()), e, || {
            let st = (mean, rstd);
            self.inner.groupnorm_silu_conv3d_fused(
                (out, mode),
                (inp, off),
                st,
                fresh,
                (gamma, beta),
                (w, b, z),
                cs,
                groups,
                ystats,
            )
        })
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
    fn concat_skip_conv_stats(
        &self,
        out: &mut Self::Buf,
        (a, b): (&Self::Buf, &Self::Buf),
        (mean, rstd): (&mut Self::Buf, &mut Self::Buf),
        (w, bias): (&Self::Buf, &Self::Buf),
        cs: ConvShape,
        ca: usize,
        groups: usize,
    ) {
        // the two parts read, out written, the statistics written
        let e = self.l(a) + self.l(b) + self.l(out) + self.l(mean) + self.l(rstd) + self.l(w) + self.l(bias);
        self.rec("concat_skip_conv_stats", Category::ConvForward, Some(cs.flops()), e, || {
            self.inner.concat_skip_conv_stats(out, (a, b), (mean, rstd), (w, bias), cs, ca, groups)
        })
    }
    fn groupnorm_silu_conv3d_fused_cat(
        &self,
        out: &mut Self::Buf,
        (a, b): (&Self::Buf, &Self::Buf),
        (mean, rstd): (&Self::Buf, &Self::Buf),
        (gamma, beta): (&Self::Buf, &Self::Buf),
        w: &Self::Buf,
        cs: ConvShape,
        ca: usize,
        groups: usize,
        ystats: Option<crate::backend::YStats<'_, Self::Buf>>,
    ) {
        let e = self.l(a)
            + self.l(b)
            + self.l(out)
            + self.l(mean)
            + self.l(rstd)
            + self.l(gamma)
            + self.l(beta)
            + self.l(w);
        self.rec("groupnorm_silu_conv3d_fused_cat", Category::ConvForward, Some(cs.flops()), e, || {
            self.inner.groupnorm_silu_conv3d_fused_cat(
                out,
                (a, b),
                (mean, rstd),
                (gamma, beta),
                w,
                cs,
                ca,
                groups,
                ystats,
            )
        })
    }
    fn groupnorm_silu_forward_inplace(
        &self,
        x: &mut Self::Buf,
        mean: &mut Self::Buf,
        rstd: &mut Self::Buf,
        gamma: &Self::Buf,
        beta: &Self::Buf,
        xd: Dims,
        groups: usize,
    ) {
        let e = 2.0 * self.l(x) + self.l(mean) + self.l(rstd) + self.l(gamma) + self.l(beta);
        self.rec("groupnorm_silu_forward", Category::Normalization, None, e, || {
            self.inner.groupnorm_silu_forward_inplace(x, mean, rstd, gamma, beta, xd, groups)
        })
    }
    fn concat_channels_stats(
        &self,
        out: &mut Self::Buf,
        a: &Self::Buf,
        a_bias: Option<&Self::Buf>,
        b: &Self::Buf,
        stats: (&mut Self::Buf, &mut Self::Buf),
        x: Dims,
        ca: usize,
        cb: usize,
        groups: usize,
    ) {
        let e = self.l(out) + self.l(a) + self.lo(a_bias) + self.l(b) + self.l(stats.0) + self.l(stats.1);
        self.rec("concat_channels_stats", Category::Elementwise, None, e, || {
            self.inner.concat_channels_stats(out, a, a_bias, b, stats, x, ca, cb, groups)
        })
    }
    fn groupnorm_silu_recompute_inplace(
        &self,
        x: &mut Self::Buf,
        mean: &Self::Buf,
        rstd: &Self::Buf,
        gamma: &Self::Buf,
        beta: &Self::Buf,
        xd: Dims,
        groups: usize,
    ) {
        let e = 2.0 * self.l(x) + self.l(mean) + self.l(rstd) + self.l(gamma) + self.l(beta);
        self.rec("groupnorm_silu_recompute", Category::Normalization, None, e, || {
            self.inner.groupnorm_silu_recompute_inplace(x, mean, rstd, gamma, beta, xd, groups)
        })
    }
    fn groupnorm_silu_backward_inplace(
        &self,
        d: &mut Self::Buf,
        dgamma: &mut Self::Buf,
        dbeta: &mut Self::Buf,
        inp: &Self::Buf,
        mean: &Self::Buf,
        rstd: &Self::Buf,
        gamma: &Self::Buf,
        beta: &Self::Buf,
        x: Dims,
        groups: usize,
    ) {
        // d read and rewritten, the input read; dγ/dβ accumulated (read and written) as in
        // every other GroupNorm backward record
        let e = 2.0 * self.l(d) + self.l(inp) + self.gn_params((dgamma, dbeta), (mean, rstd), (gamma, beta));
        self.rec("groupnorm_silu_backward", Category::Normalization, None, e, || {
            self.inner.groupnorm_silu_backward_inplace(d, dgamma, dbeta, inp, mean, rstd, gamma, beta, x, groups)
        })
    }
    fn groupnorm_silu_recompute(
        &self,
        out: &mut Self::Buf,
        mean: &Self::Buf,
        rstd: &Self::Buf,
        inp: &Self::Buf,
        off: Option<&Self::Buf>,
        gamma: &Self::Buf,
        beta: &Self::Buf,
        x: Dims,
        groups: usize,
    ) {
        let e = self.l(out) + self.l(mean) + self.l(rstd) + self.l(inp) + self.lo(off) + self.l(gamma) + self.l(beta);
        self.rec("groupnorm_silu_recompute", Category::Normalization, None, e, || {
            self.inner.groupnorm_silu_recompute(out, mean, rstd, inp, off, gamma, beta, x, groups)
        })
    }
    fn groupnorm_silu_backward(
        &self,
        dinp: (&mut Self::Buf, Accum),
        dgamma: &mut Self::Buf,
        dbeta: &mut Self::Buf,
        dout: &Self::Buf,
        inp: &Self::Buf,
        off: Option<&Self::Buf>,
        mean: &Self::Buf,
        rstd: &Self::Buf,
        gamma: &Self::Buf,
        beta: &Self::Buf,
        x: Dims,
        groups: usize,
    ) {
        let p = self.gn_params((dgamma, dbeta), (mean, rstd), (gamma, beta));
        let e = self.acc(dinp.0, dinp.1) + self.l(dout) + self.l(inp) + self.lo(off) + p;
        self.rec("groupnorm_silu_backward", Category::Normalization, None, e, || {
            self.inner.groupnorm_silu_backward(dinp, dgamma, dbeta, dout, inp, off, mean, rstd, gamma, beta, x, groups)
        })
    }
    fn groupnorm_silu_backward_sum(
        &self,
        dinp: &mut Self::Buf,
        dsum: &mut Self::Buf,
        dgamma: &mut Self::Buf,
        dbeta: &mut Self::Buf,
        dout: &Self::Buf,
        inp: &Self::Buf,
        off: Option<&Self::Buf>,
        (mean, rstd): (&Self::Buf, &Self::Buf),
        (gamma, beta): (&Self::Buf, &Self::Buf),
        x: Dims,
        groups: usize,
    ) {
        let p = self.gn_params((dgamma, dbeta), (mean, rstd), (gamma, beta));
        let e = self.l(dinp) + self.l(dsum) + self.l(dout) + self.l(inp) + self.lo(off) + p;
        self.rec("groupnorm_silu_backward", Category::Normalization, None, e, || {
            let (ms, gb) = ((mean, rstd), (gamma, beta));
            self.inner.groupnorm_silu_backward_sum(dinp, dsum, dgamma, dbeta, dout, inp, off, ms, gb, x, groups)
        })
    }
    fn groupnorm_silu_backward_act(
        &self,
        dinp: (&mut Self::Buf, Accum),
        dsum: Option<&mut Self::Buf>,
        act: &mut Self::Buf,
        (dgamma, dbeta): (&mut Self::Buf, &mut Self::Buf),
        dout: &Self::Buf,
        inp: &Self::Buf,
        off: Option<&Self::Buf>,
        (mean, rstd): (&Self::Buf, &Self::Buf),
        (gamma, beta): (&Self::Buf, &Self::Buf),
        x: Dims,
        groups: usize,
    ) {
        let p = self.gn_params((dgamma, dbeta), (mean, rstd), (gamma, beta));
        let e = self.acc(dinp.0, dinp.1)
            + dsum.as_ref().map_or(0.0, |s| self.l(s))
            + self.l(act)
            + self.l(dout)
            + self.l(inp)
            + self.lo(off)
            + p;
        self.rec("groupnorm_silu_backward", Category::Normalization, None, e, || {
            let (gg, ms, gb) = ((dgamma, dbeta), (mean, rstd), (gamma, beta));
            self.inner.groupnorm_silu_backward_act(dinp, dsum, act, gg, dout, inp, off, ms, gb, x, groups)
        })
    }
    fn groupnorm_silu_backward_inplace_act(
        &self,
        d: &mut Self::Buf,
        x: &mut Self::Buf,
        (dgamma, dbeta): (&mut Self::Buf, &mut Self::Buf),
        (mean, rstd): (&Self::Buf, &Self::Buf),
        (gamma, beta): (&Self::Buf, &Self::Buf),
        xd: Dims,
        groups: usize,
    ) {
        let e = 2.0 * (self.l(d) + self.l(x)) + self.gn_params((dgamma, dbeta), (mean, rstd), (gamma, beta));
        self.rec("groupnorm_silu_backward", Category::Normalization, None, e, || {
            let (gg, ms, gb) = ((dgamma, dbeta), (mean, rstd), (gamma, beta));
            self.inner.groupnorm_silu_backward_inplace_act(d, x, gg, ms, gb, xd, groups)
        })
    }
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn groupnorm_silu_backward_cat_in(
        &self,
        d: &mut Self::Buf,
        x: &mut Self::Buf,
        (h, hb, s): (&Self::Buf, Option<&Self::Buf>, &Self::Buf),
        ((ph, mh), (ps, msk)): ((&mut Self::Buf, Accum), (&mut Self::Buf, Accum)),
        (dgamma, dbeta): (&mut Self::Buf, &mut Self::Buf),
        (mean, rstd): (&Self::Buf, &Self::Buf),
        (gamma, beta): (&Self::Buf, &Self::Buf),
        (dout, dsum, w, dw, cs): (&Self::Buf, &Self::Buf, &Self::Buf, &mut Self::Buf, ConvShape),
        cacb: (usize, usize),
        groups: usize,
    ) {
        // the GroupNorm+SiLU backward from the parts into the parts, the skip conv's weight and
        // data gradients (their FLOPs): x read from the parts (twice: sums and elementwise pass)
        // and written once as the activation, dout read by both GEMMs
        let p = self.gn_params((dgamma, dbeta), (mean, rstd), (gamma, beta));
        let (xr, hbl) = (2.0 * (self.l(h) + self.l(s)), hb.map_or(0.0, |v| self.l(v)));
        let e = self.l(d) + xr + hbl + self.l(x) + self.acc(ph, mh) + self.acc(ps, msk) + p;
        let e = e + 2.0 * self.l(dout) + self.l(dsum) + self.l(w) + 2.0 * self.l(dw);
        self.rec("groupnorm_silu_backward_cat_in", Category::Normalization, Some(2.0 * cs.flops()), e, || {
            let (cat, parts, gg, ms, gb) =
                ((h, hb, s), ((ph, mh), (ps, msk)), (dgamma, dbeta), (mean, rstd), (gamma, beta));
            self.inner.groupnorm_silu_backward_cat_in(
                d,
                x,
                cat,
                parts,
                gg,
                ms,
                gb,
                (dout, dsum, w, dw, cs),
                cacb,
                groups,
            )
        })
    }
    fn linear_forward(
        &self,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        w: &Self::Buf,
        b: &Self::Buf,
        n: usize,
        i: usize,
        o: usize,
    ) {
        let e = self.l(out) + self.l(inp) + self.l(w) + self.l(b);
        let f = 2.0 * (n * i * o) as f64;
        self.rec("linear_forward", Category::GemmAttention, Some(f), e, || {
            self.inner.linear_forward(out, inp, w, b, n, i, o)
        })
    }
    fn linear_backward(
        &self,
        dinp: Option<(&mut Self::Buf, Accum)>,
        dw: &mut Self::Buf,
        db: &mut Self::Buf,
        dout: &Self::Buf,
        inp: &Self::Buf,
        w: &Self::Buf,
        n: usize,
        i: usize,
        o: usize,
    ) {
        let mut e = self.l(dout) + self.l(inp) + self.l(w) + 2.0 * (self.l(dw) + self.l(db));
        let mut f = 2.0 * (n * i * o) as f64;
        if let Some((d, a)) = &dinp {
            e += self.acc(d, *a);
            f *= 2.0;
        }
        self.rec("linear_backward", Category::GemmAttention, Some(f), e, || {
            self.inner.linear_backward(dinp, dw, db, dout, inp, w, n, i, o)
        })
    }
    fn attention_forward(&self, out: &mut Self::Buf, att: &mut Self::Buf, qkv: &Self::Buf, x: Dims, heads: usize) {
        let e = self.l(out) + self.l(att) + self.l(qkv);
        self.rec("attention_forward", Category::GemmAttention, Some(attention_flops(x)), e, || {
            self.inner.attention_forward(out, att, qkv, x, heads)
        })
    }
    fn attention_backward(
        &self,
        dqkv: &mut Self::Buf,
        datt: &mut Self::Buf,
        dout: &Self::Buf,
        qkv: &Self::Buf,
        att: &Self::Buf,
        x: Dims,
        heads: usize,
    ) {
        let e = self.l(dqkv) + 2.0 * self.l(datt) + self.l(dout) + self.l(qkv) + self.l(att);
        self.rec("attention_backward", Category::GemmAttention, Some(2.0 * attention_flops(x)), e, || {
            self.inner.attention_backward(dqkv, datt, dout, qkv, att, x, heads)
        })
    }
    fn upsample_forward(&self, out: &mut Self::Buf, inp: &Self::Buf, x: Dims) {
        let e = self.l(out) + self.l(inp);
        self.rec("upsample_forward", Category::Elementwise, None, e, || self.inner.upsample_forward(out, inp, x))
    }
    fn upsample_backward(&self, dinp: (&mut Self::Buf, Accum), dout: &Self::Buf, x: Dims) {
        let e = self.acc(dinp.0, dinp.1) + self.l(dout);
        self.rec("upsample_backward", Category::Elementwise, None, e, || self.inner.upsample_backward(dinp, dout, x))
    }
    fn upsample_conv3d_forward(
        &self,
        out: &mut Self::Buf,
        u: &mut Self::Buf,
        x: &Self::Buf,
        xd: Dims,
        w: &Self::Buf,
        b: Option<&Self::Buf>,
        cs: ConvShape,
    ) {
        // one record as the inner backend runs it (fused on CUDA: x read, out written; u untouched)
        let e = self.l(out) + self.l(x) + self.l(w) + self.lo(b);
        self.rec("upsample_conv3d_forward", Category::ConvForward, Some(cs.flops()), e, || {
            self.inner.upsample_conv3d_forward(out, u, x, xd, w, b, cs)
        })
    }
    fn upsample_conv3d_backward(
        &self,
        du: &mut Self::Buf,
        u: &mut Self::Buf,
        dw: &mut Self::Buf,
        db: Option<&mut Self::Buf>,
        dout: &Self::Buf,
        x: &Self::Buf,
        xd: Dims,
        w: &Self::Buf,
        cs: ConvShape,
    ) {
        // one record as the inner backend runs it (fused on CUDA: the doubled input written
        // once, read by the weight gradient)
        let db_bytes = db.as_ref().map_or(0.0, |b| self.l(b));
        let e = self.l(du) + 2.0 * self.l(u) + self.l(w) + 2.0 * (self.l(dw) + db_bytes) + self.l(dout) + self.l(x);
        self.rec("upsample_conv3d_backward", Category::ConvBackward, Some(2.0 * cs.flops()), e, || {
            self.inner.upsample_conv3d_backward(du, u, dw, db, dout, x, xd, w, cs)
        })
    }
    fn add_assign(&self, dst: &mut Self::Buf, src: &Self::Buf) {
        let e = 2.0 * self.l(dst) + self.l(src);
        self.rec("add_assign", Category::Elementwise, None, e, || self.inner.add_assign(dst, src))
    }
    fn scale(&self, buf: &mut Self::Buf, s: f32) {
        let e = 2.0 * self.l(buf);
        self.rec("scale", Category::Elementwise, None, e, || self.inner.scale(buf, s))
    }
    fn add_channel_bias(&self, x: &mut Self::Buf, bias: &Self::Buf, xd: Dims) {
        let e = 2.0 * self.l(x) + self.l(bias);
        self.rec("add_channel_bias", Category::Elementwise, None, e, || self.inner.add_channel_bias(x, bias, xd))
    }
    fn add_channel_bias_to(&self, out: &mut Self::Buf, x: &Self::Buf, bias: &Self::Buf, xd: Dims) {
        let e = self.l(out) + self.l(x) + self.l(bias);
        self.rec("add_channel_bias", Category::Elementwise, None, e, || {
            self.inner.add_channel_bias_to(out, x, bias, xd)
        })
    }
    fn add_bias_vectors(&self, out: &mut Self::Buf, a: &Self::Buf, b: &Self::Buf) {
        let e = self.l(out) + self.l(a) + self.l(b);
        self.rec("add_bias_vectors", Category::Elementwise, None, e, || self.inner.add_bias_vectors(out, a, b))
    }
    fn add_bias_vectors_all(&self, triples: &mut [(&mut Self::Buf, &Self::Buf, &Self::Buf)]) {
        let e = triples.iter().map(|(o, a, b)| self.l(o) + self.l(a) + self.l(b)).sum();
        self.rec("add_bias_vectors_all", Category::Elementwise, None, e, || self.inner.add_bias_vectors_all(triples))
    }
    fn channel_sum(&self, dbias: &mut Self::Buf, dx: &Self::Buf, xd: Dims) {
        let e = self.l(dbias) + self.l(dx);
        self.rec("channel_sum", Category::Reduction, None, e, || self.inner.channel_sum(dbias, dx, xd))
    }
    fn bias_grad_rows(&self, db: &mut Self::Buf, rows: &Self::Buf, n: usize, c: usize) {
        let e = 2.0 * self.l(db) + self.l(rows);
        self.rec("bias_grad_rows", Category::Reduction, None, e, || self.inner.bias_grad_rows(db, rows, n, c))
    }
    fn concat_channels_bias(
        &self,
        out: &mut Self::Buf,
        a: &Self::Buf,
        a_bias: Option<&Self::Buf>,
        b: &Self::Buf,
        x: Dims,
        ca: usize,
        cb: usize,
    ) {
        let e = self.l(out) + self.l(a) + self.l(b) + a_bias.map_or(0.0, |v| self.l(v));
        self.rec("concat_channels", Category::Elementwise, None, e, || {
            self.inner.concat_channels_bias(out, a, a_bias, b, x, ca, cb)
        })
    }
    fn split_channels(
        &self,
        da: (&mut Self::Buf, Accum),
        db: (&mut Self::Buf, Accum),
        dout: &Self::Buf,
        x: Dims,
        ca: usize,
        cb: usize,
    ) {
        let e = self.acc(da.0, da.1) + self.acc(db.0, db.1) + self.l(dout);
        self.rec("split_channels", Category::Elementwise, None, e, || {
            self.inner.split_channels(da, db, dout, x, ca, cb)
        })
    }
    fn loss_forward(&self, loss: &mut Self::Buf, pred: &Self::Buf, target: &Self::Buf, kind: LossKind) {
        let e = self.l(loss) + self.l(pred) + self.l(target);
        self.rec("loss_forward", Category::Reduction, None, e, || self.inner.loss_forward(loss, pred, target, kind))
    }
    fn loss_backward(&self, dpred: &mut Self::Buf, pred: &Self::Buf, target: &Self::Buf, kind: LossKind, scale: f32) {
        let e = self.l(dpred) + self.l(pred) + self.l(target);
        self.rec("loss_backward", Category::Elementwise, None, e, || {
            self.inner.loss_backward(dpred, pred, target, kind, scale)
        })
    }
    fn randn(&self, out: &mut Self::Buf, rng: Philox, offset: u64, x: Dims) {
        let e = self.l(out);
        self.rec("randn", Category::Elementwise, None, e, || self.inner.randn(out, rng, offset, x))
    }
    fn q_sample(&self, xt: &mut Self::Buf, x0: &Self::Buf, eps: &Self::Buf, a: &[f32], b: &[f32], x: Dims) {
        let e = self.l(xt) + self.l(x0) + self.l(eps);
        self.rec("q_sample", Category::Elementwise, None, e, || self.inner.q_sample(xt, x0, eps, a, b, x))
    }
    fn ddpm_step(&self, x: &mut Self::Buf, eps: &Self::Buf, z: &Self::Buf, coefs: &[DdpmCoefs], xd: Dims) {
        let e = 2.0 * self.l(x) + self.l(eps) + self.l(z);
        self.rec("ddpm_step", Category::Elementwise, None, e, || self.inner.ddpm_step(x, eps, z, coefs, xd))
    }
    fn sampler_step(
        &self,
        x: &mut Self::Buf,
        eps: &Self::Buf,
        hist: &mut [Self::Buf],
        pred: Prediction,
        clip: bool,
        coefs: &[SamplerCoefs],
        xd: Dims,
    ) {
        let e = 2.0 * self.l(x) + self.l(eps) + 2.0 * hist.iter().map(|h| self.l(h)).sum::<f64>();
        self.rec("sampler_step", Category::Elementwise, None, e, || {
            self.inner.sampler_step(x, eps, hist, pred, clip, coefs, xd)
        })
    }
    fn adam_step(&self, p: &mut Self::Buf, g: &Self::Buf, m: &mut Self::Buf, v: &mut Self::Buf, h: AdamStep) {
        let e = 2.0 * (self.l(p) + self.l(m) + self.l(v)) + self.l(g);
        self.rec("adam_step", Category::Optimizer, None, e, || self.inner.adam_step(p, g, m, v, h))
    }
    fn ema_update(&self, ema: &mut Self::Buf, p: &Self::Buf, decay: f32) {
        let e = 2.0 * self.l(ema) + self.l(p);
        self.rec("ema_update", Category::Optimizer, None, e, || self.inner.ema_update(ema, p, decay))
    }
}

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

#[allow(unused_variables)]
impl Backend for NullBackend {
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
    fn upload(&self, host: &[f32], dst: &mut usize) {}
    fn download(&self, src: &usize, host: &mut [f32]) {}
    fn upload_act(&self, host_ncdhw: &[f32], x: Dims, dst: &mut usize) {}
    fn download_act(&self, src: &usize, x: Dims, host_ncdhw: &mut [f32]) {}
    fn upload_param(&self, host: &[f32], torch_shape: &[usize], dst: &mut usize) {}
    fn download_param(&self, src: &usize, torch_shape: &[usize], host: &mut [f32]) {}
    fn zero(&self, b: &mut usize) {}
    fn copy(&self, dst: &mut usize, src: &usize) {}
    fn sync(&self) {}
    fn conv3d_forward_acc(&self, out: (&mut usize, Accum), inp: &usize, w: &usize, b: Option<&usize>, cs: ConvShape) {}
    fn conv3d_backward(
        &self,
        dinp: Option<(&mut usize, Accum)>,
        dw: &mut usize,
        db: Option<&mut usize>,
        dout: &usize,
        inp: &usize,
        w: &usize,
        cs: ConvShape,
    ) {
    }
    fn conv3d_backward_data(&self, dinp: (&mut usize, Accum), dout: &usize, w: &usize, cs: ConvShape) {}
    fn groupnorm_forward(
        &self,
        out: &mut usize,
        mean: &mut usize,
        rstd: &mut usize,
        inp: &usize,
        gamma: &usize,
        beta: &usize,
        x: Dims,
        groups: usize,
    ) {
    }
    fn groupnorm_backward(
        &self,
        dinp: (&mut usize, Accum),
        dgamma: &mut usize,
        dbeta: &mut usize,
        dout: &usize,
        inp: &usize,
        mean: &usize,
        rstd: &usize,
        gamma: &usize,
        x: Dims,
        groups: usize,
    ) {
    }
    fn groupnorm_silu_forward(
        &self,
        out: &mut usize,
        mean: &mut usize,
        rstd: &mut usize,
        inp: &usize,
        off: Option<&usize>,
        gamma: &usize,
        beta: &usize,
        x: Dims,
        groups: usize,
    ) {
    }
    fn groupnorm_silu_forward_inplace(
        &self,
        x: &mut usize,
        mean: &mut usize,
        rstd: &mut usize,
        gamma: &usize,
        beta: &usize,
        xd: Dims,
        groups: usize,
    ) {
    }
    fn concat_channels_stats(
        &self,
        out: &mut usize,
        a: &usize,
        a_bias: Option<&usize>,
        b: &usize,
        stats: (&mut usize, &mut usize),
        x: Dims,
        ca: usize,
        cb: usize,
        groups: usize,
    ) {
    }
    fn groupnorm_silu_recompute_inplace(
        &self,
        x: &mut usize,
        mean: &usize,
        rstd: &usize,
        gamma: &usize,
        beta: &usize,
        xd: Dims,
        groups: usize,
    ) {
    }
    fn groupnorm_silu_backward_inplace(
        &self,
        d: &mut usize,
        dgamma: &mut usize,
        dbeta: &mut usize,
        inp: &usize,
        mean: &usize,
        rstd: &usize,
        gamma: &usize,
        beta: &usize,
        x: Dims,
        groups: usize,
    ) {
    }
    fn groupnorm_silu_recompute(
        &self,
        out: &mut usize,
        mean: &usize,
        rstd: &usize,
        inp: &usize,
        off: Option<&usize>,
        gamma: &usize,
        beta: &usize,
        x: Dims,
        groups: usize,
    ) {
    }
    fn groupnorm_silu_backward(
        &self,
        dinp: (&mut usize, Accum),
        dgamma: &mut usize,
        dbeta: &mut usize,
        dout: &usize,
        inp: &usize,
        off: Option<&usize>,
        mean: &usize,
        rstd: &usize,
        gamma: &usize,
        beta: &usize,
        x: Dims,
        groups: usize,
    ) {
    }
    fn silu_forward(&self, out: &mut usize, inp: &usize) {}
    fn silu_backward(&self, dinp: (&mut usize, Accum), dout: &usize, inp: &usize) {}
    fn linear_forward(&self, out: &mut usize, inp: &usize, w: &usize, b: &usize, n: usize, i: usize, o: usize) {}
    fn linear_backward(
        &self,
        dinp: Option<(&mut usize, Accum)>,
        dw: &mut usize,
        db: &mut usize,
        dout: &usize,
        inp: &usize,
        w: &usize,
        n: usize,
        i: usize,
        o: usize,
    ) {
    }
    fn attention_forward(&self, out: &mut usize, att: &mut usize, qkv: &usize, x: Dims, heads: usize) {}
    fn attention_backward(
        &self,
        dqkv: &mut usize,
        datt: &mut usize,
        dout: &usize,
        qkv: &usize,
        att: &usize,
        x: Dims,
        heads: usize,
    ) {
    }
    fn upsample_forward(&self, out: &mut usize, inp: &usize, x: Dims) {}
    fn upsample_backward(&self, dinp: (&mut usize, Accum), dout: &usize, x: Dims) {}
    fn add_assign(&self, dst: &mut usize, src: &usize) {}
    fn scale(&self, buf: &mut usize, s: f32) {}
    fn add_channel_bias(&self, x: &mut usize, bias: &usize, xd: Dims) {}
    fn add_channel_bias_to(&self, out: &mut usize, x: &usize, bias: &usize, xd: Dims) {}
    fn add_bias_vectors(&self, out: &mut usize, a: &usize, b: &usize) {}
    fn channel_sum(&self, dbias: &mut usize, dx: &usize, xd: Dims) {}
    fn bias_grad_rows(&self, db: &mut usize, rows: &usize, n: usize, c: usize) {}
    fn concat_channels_bias(
        &self,
        out: &mut usize,
        a: &usize,
        a_bias: Option<&usize>,
        b: &usize,
        x: Dims,
        ca: usize,
        cb: usize,
    ) {
    }
    fn split_channels(
        &self,
        da: (&mut usize, Accum),
        db: (&mut usize, Accum),
        dout: &usize,
        x: Dims,
        ca: usize,
        cb: usize,
    ) {
    }
    fn loss_forward(&self, loss: &mut usize, pred: &usize, target: &usize, kind: LossKind) {}
    fn loss_backward(&self, dpred: &mut usize, pred: &usize, target: &usize, kind: LossKind, scale: f32) {}
    fn randn(&self, out: &mut usize, rng: Philox, offset: u64, x: Dims) {}
    fn q_sample(&self, xt: &mut usize, x0: &usize, eps: &usize, a: &[f32], b: &[f32], x: Dims) {}
    fn ddpm_step(&self, x: &mut usize, eps: &usize, z: &usize, coefs: &[DdpmCoefs], xd: Dims) {}
    fn sampler_step(
        &self,
        x: &mut usize,
        eps: &usize,
        hist: &mut [usize],
        pred: Prediction,
        clip: bool,
        coefs: &[SamplerCoefs],
        xd: Dims,
    ) {
    }
    fn adam_step(&self, p: &mut usize, g: &usize, m: &mut usize, v: &mut usize, h: AdamStep) {}
    fn ema_update(&self, ema: &mut usize, p: &usize, decay: f32) {}
}
