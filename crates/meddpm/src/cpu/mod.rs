//! CpuBackend: the executable specification of every [`Backend`] primitive (fp32, NCDHW).
//!
//! This file is dispatch only: each trait method forwards to a free function in the sibling file
//! of the same name as the CUDA crate's (`conv3d.rs`, `groupnorm.rs`, …). Those functions are
//! generic over [`float::Float`] so the gradient checks run the very same code in f64.
//! Buffers are `Vec<f32>` in PyTorch's layouts, so uploads and downloads are plain copies.
//! Threads: rayon's global pool (outer loops) and the `gemm` crate's rayon parallelism.
//! Allocation: besides `alloc`, conv3d grows a per-thread im2col scratch (at most 2 × 64 MiB per
//! calling thread, kept for reuse; see `conv3d.rs`).

pub mod attention;
pub mod conv3d;
pub mod diffusion;
pub mod elementwise;
pub mod float;
pub mod groupnorm;
pub mod linear;
pub mod loss;
pub mod optim;
pub mod sampler;
pub mod silu;
pub mod upsample;

use crate::backend::{Accum, AdamStep, Backend, DdpmCoefs, Layout, LossKind, Precision, Prediction, SamplerCoefs};
use crate::rng::Philox;
use crate::shape::{ConvShape, Dims};
use crate::Result;

thread_local! {
    /// im2col scratch of the convolutions run from this thread.
    static CONV_SCRATCH: std::cell::RefCell<conv3d::ConvScratch<f32>> =
        std::cell::RefCell::new(conv3d::ConvScratch::new(conv3d::COL_BUDGET));
}

/// The CPU reference backend (fp32, NCDHW, rayon).
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend
    }
}

fn same_len(what: &str, a: usize, b: usize) {
    assert_eq!(a, b, "cpu {what}: buffer length {a} vs {b}");
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;

    fn describe(&self) -> String {
        format!("CPU reference (fp32, NCDHW, {} rayon threads, im2col + gemm)", rayon::current_num_threads())
    }
    fn layout(&self) -> Layout {
        Layout::Ncdhw
    }
    fn precision(&self) -> Precision {
        Precision::Fp32
    }

    fn alloc(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }
    fn len(&self, b: &Vec<f32>) -> usize {
        b.len()
    }
    fn upload(&self, host: &[f32], dst: &mut Vec<f32>) {
        same_len("upload", host.len(), dst.len());
        dst.copy_from_slice(host);
    }
    fn download(&self, src: &Vec<f32>, host: &mut [f32]) {
        same_len("download", src.len(), host.len());
        host.copy_from_slice(src);
    }
    fn upload_act(&self, host_ncdhw: &[f32], x: Dims, dst: &mut Vec<f32>) {
        same_len("upload_act", host_ncdhw.len(), x.numel());
        self.upload(host_ncdhw, dst);
    }
    fn download_act(&self, src: &Vec<f32>, x: Dims, host_ncdhw: &mut [f32]) {
        same_len("download_act", host_ncdhw.len(), x.numel());
        self.download(src, host_ncdhw);
    }
    fn upload_param(&self, host: &[f32], torch_shape: &[usize], dst: &mut Vec<f32>) {
        same_len("upload_param", host.len(), torch_shape.iter().product());
        self.upload(host, dst);
    }
    fn download_param(&self, src: &Vec<f32>, torch_shape: &[usize], host: &mut [f32]) {
        same_len("download_param", host.len(), torch_shape.iter().product());
        self.download(src, host);
    }
    fn zero(&self, b: &mut Vec<f32>) {
        b.fill(0.0);
    }
    fn copy(&self, dst: &mut Vec<f32>, src: &Vec<f32>) {
        same_len("copy", dst.len(), src.len());
        dst.copy_from_slice(src);
    }
    fn sync(&self) {}

    fn conv3d_forward(&self, out: &mut Vec<f32>, inp: &Vec<f32>, w: &Vec<f32>, b: &Vec<f32>, cs: ConvShape) {
        CONV_SCRATCH.with_borrow_mut(|s| conv3d::conv3d_forward_with(out, inp, w, b, cs, s));
    }
    fn conv3d_backward(
        &self,
        dinp: Option<(&mut Vec<f32>, Accum)>,
        dw: &mut Vec<f32>,
        db: &mut Vec<f32>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        w: &Vec<f32>,
        cs: ConvShape,
    ) {
        let dinp = dinp.map(|(d, a)| (d.as_mut_slice(), a));
        CONV_SCRATCH.with_borrow_mut(|s| conv3d::conv3d_backward_with(dinp, dw, db, dout, inp, w, cs, s));
    }

    fn groupnorm_forward(
        &self,
        out: &mut Vec<f32>,
        mean: &mut Vec<f32>,
        rstd: &mut Vec<f32>,
        inp: &Vec<f32>,
        gamma: &Vec<f32>,
        beta: &Vec<f32>,
        x: Dims,
        groups: usize,
    ) {
        groupnorm::groupnorm_forward(out, mean, rstd, inp, gamma, beta, x, groups);
    }
    fn groupnorm_backward(
        &self,
        dinp: (&mut Vec<f32>, Accum),
        dgamma: &mut Vec<f32>,
        dbeta: &mut Vec<f32>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        mean: &Vec<f32>,
        rstd: &Vec<f32>,
        gamma: &Vec<f32>,
        x: Dims,
        groups: usize,
    ) {
        let dinp = (dinp.0.as_mut_slice(), dinp.1);
        groupnorm::groupnorm_backward(dinp, dgamma, dbeta, dout, inp, mean, rstd, gamma, x, groups);
    }
    fn silu_forward(&self, out: &mut Vec<f32>, inp: &Vec<f32>) {
        silu::silu_forward(out, inp);
    }
    fn silu_backward(&self, dinp: (&mut Vec<f32>, Accum), dout: &Vec<f32>, inp: &Vec<f32>) {
        silu::silu_backward((dinp.0.as_mut_slice(), dinp.1), dout, inp);
    }

    fn linear_forward(
        &self,
        out: &mut Vec<f32>,
        inp: &Vec<f32>,
        w: &Vec<f32>,
        b: &Vec<f32>,
        n: usize,
        i: usize,
        o: usize,
    ) {
        linear::linear_forward(out, inp, w, b, n, i, o);
    }
    fn linear_backward(
        &self,
        dinp: Option<(&mut Vec<f32>, Accum)>,
        dw: &mut Vec<f32>,
        db: &mut Vec<f32>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        w: &Vec<f32>,
        n: usize,
        i: usize,
        o: usize,
    ) {
        let dinp = dinp.map(|(d, a)| (d.as_mut_slice(), a));
        linear::linear_backward(dinp, dw, db, dout, inp, w, n, i, o);
    }

    fn attention_forward(&self, out: &mut Vec<f32>, att: &mut Vec<f32>, qkv: &Vec<f32>, x: Dims, heads: usize) {
        attention::attention_forward(out, att, qkv, x, heads);
    }
    fn attention_backward(
        &self,
        dqkv: &mut Vec<f32>,
        datt: &mut Vec<f32>,
        dout: &Vec<f32>,
        qkv: &Vec<f32>,
        att: &Vec<f32>,
        x: Dims,
        heads: usize,
    ) {
        attention::attention_backward(dqkv, datt, dout, qkv, att, x, heads);
    }

    fn upsample_forward(&self, out: &mut Vec<f32>, inp: &Vec<f32>, x: Dims) {
        upsample::upsample_forward(out, inp, x);
    }
    fn upsample_backward(&self, dinp: (&mut Vec<f32>, Accum), dout: &Vec<f32>, x: Dims) {
        upsample::upsample_backward((dinp.0.as_mut_slice(), dinp.1), dout, x);
    }

    fn add_assign(&self, dst: &mut Vec<f32>, src: &Vec<f32>) {
        elementwise::add_assign(dst, src);
    }
    fn scale(&self, buf: &mut Vec<f32>, s: f32) {
        elementwise::scale(buf, s);
    }
    fn add_channel_bias(&self, x: &mut Vec<f32>, bias: &Vec<f32>, xd: Dims) {
        elementwise::add_channel_bias(x, bias, xd);
    }
    fn channel_sum(&self, dbias: &mut Vec<f32>, dx: &Vec<f32>, xd: Dims) {
        elementwise::channel_sum(dbias, dx, xd);
    }
    fn concat_channels(&self, out: &mut Vec<f32>, a: &Vec<f32>, b: &Vec<f32>, x: Dims, ca: usize, cb: usize) {
        elementwise::concat_channels(out, a, b, x, ca, cb);
    }
    fn split_channels(
        &self,
        da: (&mut Vec<f32>, Accum),
        db: (&mut Vec<f32>, Accum),
        dout: &Vec<f32>,
        x: Dims,
        ca: usize,
        cb: usize,
    ) {
        elementwise::split_channels((da.0.as_mut_slice(), da.1), (db.0.as_mut_slice(), db.1), dout, x, ca, cb);
    }

    fn loss_forward(&self, loss: &mut Vec<f32>, pred: &Vec<f32>, target: &Vec<f32>, kind: LossKind) {
        assert!(!loss.is_empty(), "cpu loss_forward: loss buffer is empty");
        loss[0] = loss::loss_forward(pred, target, kind);
    }
    fn loss_backward(&self, dpred: &mut Vec<f32>, pred: &Vec<f32>, target: &Vec<f32>, kind: LossKind, scale: f32) {
        loss::loss_backward(dpred, pred, target, kind, scale);
    }

    fn randn(&self, out: &mut Vec<f32>, rng: Philox, offset: u64, x: Dims) {
        diffusion::randn(out, rng, offset, x);
    }
    fn q_sample(&self, xt: &mut Vec<f32>, x0: &Vec<f32>, eps: &Vec<f32>, a: &[f32], b: &[f32], x: Dims) {
        diffusion::q_sample(xt, x0, eps, a, b, x);
    }
    fn ddpm_step(&self, x: &mut Vec<f32>, eps: &Vec<f32>, z: &Vec<f32>, coefs: &[DdpmCoefs], xd: Dims) {
        diffusion::ddpm_step(x, eps, z, coefs, xd);
    }
    fn sampler_step(
        &self,
        x: &mut Vec<f32>,
        eps: &Vec<f32>,
        hist: &mut [Vec<f32>],
        pred: Prediction,
        clip: bool,
        coefs: &[SamplerCoefs],
        xd: Dims,
    ) {
        sampler::sampler_step(x, eps, hist, pred, clip, coefs, xd);
    }

    fn adam_step(&self, p: &mut Vec<f32>, g: &Vec<f32>, m: &mut Vec<f32>, v: &mut Vec<f32>, h: AdamStep) {
        optim::adam_step(p, g, m, v, h);
    }
    fn ema_update(&self, ema: &mut Vec<f32>, p: &Vec<f32>, decay: f32) {
        optim::ema_update(ema, p, decay);
    }
}
