//! CpuBackend: the executable specification of every [`Backend`] primitive (fp32, NCDHW).
//!
//! With [`CpuBackend::bf16`] it also emulates `Precision::Bf16` exactly where the GPU stores bf16:
//! every primitive still computes in f32, then rounds (to nearest even, [`round_bf16`]) the
//! outputs that the GPU writes into activation buffers — conv outputs and input gradients,
//! GroupNorm(+SiLU) outputs and input gradients, attention logits, probabilities, outputs and
//! their gradients (dP, dZ, dqkv), upsampling,
//! residual adds, bias broadcasts, concat/split — and convolutions first round their inputs,
//! weights and output gradients (the GPU converts them to bf16 before cuDNN) and round each
//! weight-gradient contribution before adding it to the f32 gradient (cuDNN writes it in bf16;
//! meddpm's own wide-conv weight gradient on sm_90, `conv3d_wgmma_wgrad`, adds f32 sums, which
//! the bf16 tests' tolerances cover).
//! Statistics, the time embedding (linear, SiLU), the loss, diffusion and optimizer ops stay f32.
//! GPU bf16 parity tests compare against this mode with tolerances of a few bf16 ulps.
//!
//! With [`CpuBackend::fp8`] it emulates `Precision::Fp8` ([`crate::fp8`] is the spec): as bf16,
//! except that the forward of every conv [`crate::fp8::conv_runs_fp8`] picks (3×3×3, stride 1,
//! ≥ 16 channels in and out) quantises its bf16 operands to E4M3 — the input per tensor, by the
//! power-of-two scale of the tensor's own amax (scaled just in time, as a producing kernel's
//! epilogue would), the weight per output channel — and accumulates in f32, then adds the bias
//! and rounds the output to bf16. Backward passes run as in bf16 (fp8 training is not emulated).
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

use crate::backend::{
    round_bf16, Accum, AdamStep, Backend, DdpmCoefs, Layout, LossKind, Precision, Prediction, SamplerCoefs,
};
use crate::fp8::{self, Fp8Format};
use crate::rng::Philox;
use crate::shape::{ConvShape, Dims};
use crate::Result;

thread_local! {
    /// im2col scratch of the convolutions run from this thread.
    static CONV_SCRATCH: std::cell::RefCell<conv3d::ConvScratch<f32>> =
        std::cell::RefCell::new(conv3d::ConvScratch::new(conv3d::COL_BUDGET));
    /// GroupNorm+SiLU backward: the gradient before GroupNorm (grown on the first call of a size,
    /// then reused).
    static GN_SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A GroupNorm's input plus its per-(n, c) offset (`groupnorm_silu_*` with `off`).
    static GN_OFF: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Recomputed GroupNorm statistics (`groupnorm_silu_recompute`).
    static GN_STATS: std::cell::RefCell<[Vec<f32>; 2]> = const { std::cell::RefCell::new([Vec::new(), Vec::new()]) };
    /// bf16 emulation: rounded copies of conv operands and a weight-gradient temporary (grown on
    /// the first call of a size, then reused).
    static EMU: std::cell::RefCell<[Vec<f32>; 4]> =
        const { std::cell::RefCell::new([Vec::new(), Vec::new(), Vec::new(), Vec::new()]) };
}

/// `f(inp)`, or with a per-(n, c) input offset `f(inp + off)`: the sum in a per-thread scratch,
/// in f32 and not rounded in bf16 mode (the GPU adds the offset in registers; see
/// `Backend::groupnorm_silu_forward`).
fn with_offset<R>(inp: &[f32], off: Option<&Vec<f32>>, x: Dims, f: impl FnOnce(&[f32]) -> R) -> R {
    match off {
        None => f(inp),
        Some(off) => GN_OFF.with_borrow_mut(|s| {
            s.clear();
            s.extend_from_slice(inp);
            elementwise::add_channel_bias(s, off, x);
            f(s)
        }),
    }
}

/// The CPU reference backend (fp32, NCDHW, rayon); optionally emulating bf16 storage, or bf16
/// storage with fp8 wide convs.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend {
    bf16: bool,
    /// fp8 operands in the wide convs' forward (with `bf16` set: bf16 everywhere else).
    fp8: bool,
}

impl CpuBackend {
    /// The fp32 reference.
    pub fn new() -> Self {
        CpuBackend { bf16: false, fp8: false }
    }
    /// The bf16-emulating reference (see the module docs).
    pub fn bf16() -> Self {
        CpuBackend { bf16: true, fp8: false }
    }
    /// The fp8-emulating reference (see the module docs): the spec of `Precision::Fp8`, for tests
    /// and eval-configs' `cpu-fp8` row.
    pub fn fp8() -> Self {
        CpuBackend { bf16: true, fp8: true }
    }
    /// `Fp32` or `Bf16`. TF32 has no CPU emulation; fp8's ([`CpuBackend::fp8`]) is for tests and
    /// eval-configs only, so `--precision fp8` is refused here too.
    pub fn with_precision(p: Precision) -> Result<Self> {
        match p {
            Precision::Fp32 => Ok(Self::new()),
            Precision::Bf16 => Ok(Self::bf16()),
            Precision::Tf32 => Err(crate::Error::Config(
                "the CPU backend has no TF32 mode: use --precision fp32 or bf16 on the CPU".into(),
            )),
            Precision::Fp8 => Err(crate::Error::Config(
                "--precision fp8 does not run on the CPU (its emulation is slow and for tests and eval-configs' \
                 cpu-fp8 row only): use --precision fp32 or bf16 on the CPU"
                    .into(),
            )),
        }
    }
    /// Round a buffer the GPU stores as bf16 (no-op in fp32 mode).
    fn r(&self, b: &mut [f32]) {
        if self.bf16 {
            b.iter_mut().for_each(|v| *v = round_bf16(*v));
        }
    }
}

/// `src` rounded to bf16 in the reusable vector `dst`.
fn rounded_into<'a>(dst: &'a mut Vec<f32>, src: &[f32]) -> &'a [f32] {
    dst.clear();
    dst.extend(src.iter().map(|&v| round_bf16(v)));
    dst
}

fn same_len(what: &str, a: usize, b: usize) {
    assert_eq!(a, b, "cpu {what}: buffer length {a} vs {b}");
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;

    fn describe(&self) -> String {
        let p = match (self.bf16, self.fp8) {
            (_, true) => "fp8-emulating: E4M3 wide convs, bf16 elsewhere",
            (true, false) => "bf16-emulating",
            (false, false) => "fp32",
        };
        format!(
            "CPU reference ({p}, NCDHW, {} rayon threads, {})",
            rayon::current_num_threads(),
            conv3d::kernels_line()
        )
    }
    fn layout(&self) -> Layout {
        Layout::Ncdhw
    }
    fn precision(&self) -> Precision {
        match (self.bf16, self.fp8) {
            (_, true) => Precision::Fp8,
            (true, false) => Precision::Bf16,
            (false, false) => Precision::Fp32,
        }
    }
    fn cast(&self, dst: &mut Vec<f32>, src: &Vec<f32>) {
        same_len("cast", dst.len(), src.len());
        dst.copy_from_slice(src);
        self.r(dst);
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

    fn conv3d_forward_acc(
        &self,
        (out, acc): (&mut Vec<f32>, Accum),
        inp: &Vec<f32>,
        w: &Vec<f32>,
        b: Option<&Vec<f32>>,
        cs: ConvShape,
    ) {
        let b = b.map(|b| &b[..]);
        if !self.bf16 {
            CONV_SCRATCH.with_borrow_mut(|s| conv3d::conv3d_forward_acc(out, acc, inp, w, b, cs, s));
            return;
        }
        EMU.with_borrow_mut(|[ex, ew, tx, tw]| {
            let (x, w) = if self.fp8 && fp8::conv_runs_fp8(&cs) {
                // E4M3 from the bf16 operands the GPU holds: input per tensor, weight per channel
                fp8::quantize_tensor_into(ex, rounded_into(tx, inp), Fp8Format::E4M3);
                fp8::quantize_channels_into(ew, rounded_into(tw, w), cs.cout, Fp8Format::E4M3);
                (&ex[..], &ew[..])
            } else {
                (rounded_into(ex, inp), rounded_into(ew, w))
            };
            CONV_SCRATCH.with_borrow_mut(|s| conv3d::conv3d_forward_acc(out, acc, x, w, b, cs, s));
        });
        self.r(out);
    }
    fn conv3d_backward(
        &self,
        dinp: Option<(&mut Vec<f32>, Accum)>,
        dw: &mut Vec<f32>,
        db: Option<&mut Vec<f32>>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        w: &Vec<f32>,
        cs: ConvShape,
    ) {
        if !self.bf16 {
            let dinp = dinp.map(|(d, a)| (d.as_mut_slice(), a));
            let db = db.map(|b| b.as_mut_slice());
            CONV_SCRATCH.with_borrow_mut(|s| conv3d::conv3d_backward_with(dinp, dw, db, dout, inp, w, cs, s));
            return;
        }
        // db from the output gradient as given (the GPU sums it before converting); dw's
        // contribution rounded to bf16 (cuDNN writes it in bf16) before it is added to the f32
        // gradient; the input gradient rounded as it is stored.
        if let Some(db) = db {
            conv3d::bias_grad(db, dout, cs);
        }
        EMU.with_borrow_mut(|[ex, ew, edy, edw]| {
            let (x, w, dy) = (rounded_into(ex, inp), rounded_into(ew, w), rounded_into(edy, dout));
            edw.clear();
            edw.resize(dw.len(), 0.0);
            let mut dinp = dinp;
            let di = dinp.as_mut().map(|(d, a)| (d.as_mut_slice(), *a));
            CONV_SCRATCH.with_borrow_mut(|s| conv3d::conv3d_backward_with(di, edw, None, dy, x, w, cs, s));
            for (g, &c) in dw.iter_mut().zip(edw.iter()) {
                *g += round_bf16(c);
            }
            if let Some((d, _)) = dinp {
                self.r(d);
            }
        });
    }
    fn conv3d_backward_data(&self, dinp: (&mut Vec<f32>, Accum), dout: &Vec<f32>, w: &Vec<f32>, cs: ConvShape) {
        let (d, acc) = dinp;
        if !self.bf16 {
            CONV_SCRATCH
                .with_borrow_mut(|s| conv3d::conv3d_backward_data_with((d.as_mut_slice(), acc), dout, w, cs, s));
            return;
        }
        // as conv3d_backward's data half: bf16 operands, the gradient rounded as it is stored
        EMU.with_borrow_mut(|[_, ew, edy, _]| {
            let (w, dy) = (rounded_into(ew, w), rounded_into(edy, dout));
            CONV_SCRATCH.with_borrow_mut(|s| conv3d::conv3d_backward_data_with((d.as_mut_slice(), acc), dy, w, cs, s));
        });
        self.r(d);
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
        self.r(out);
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
        groupnorm::groupnorm_backward(
            (dinp.0.as_mut_slice(), dinp.1),
            dgamma,
            dbeta,
            dout,
            inp,
            mean,
            rstd,
            gamma,
            x,
            groups,
        );
        self.r(dinp.0);
    }
    fn groupnorm_stats(
        &self,
        mean: &mut Vec<f32>,
        rstd: &mut Vec<f32>,
        inp: &Vec<f32>,
        off: Option<&Vec<f32>>,
        x: Dims,
        groups: usize,
    ) {
        with_offset(inp, off, x, |xi| groupnorm::groupnorm_stats(mean, rstd, xi, x, groups));
    }
    fn silu_forward(&self, out: &mut Vec<f32>, inp: &Vec<f32>) {
        silu::silu_forward(out, inp);
    }
    fn silu_backward(&self, dinp: (&mut Vec<f32>, Accum), dout: &Vec<f32>, inp: &Vec<f32>) {
        silu::silu_backward((dinp.0.as_mut_slice(), dinp.1), dout, inp);
    }
    /// GroupNorm and SiLU in one pass (`groupnorm::groupnorm_silu_forward`), the statistics taken
    /// again in f64 into a scratch instead of read from the saved f32 ones (which are rounded), so
    /// the trait's forward (statistics, then this) and a backward's recomputation write the same
    /// values; SiLU of the unrounded GroupNorm value, rounded in bf16 mode as the GPU stores only
    /// the SiLU output.
    fn groupnorm_silu_recompute(
        &self,
        out: &mut Vec<f32>,
        mean: &Vec<f32>,
        rstd: &Vec<f32>,
        inp: &Vec<f32>,
        off: Option<&Vec<f32>>,
        gamma: &Vec<f32>,
        beta: &Vec<f32>,
        x: Dims,
        groups: usize,
    ) {
        GN_STATS.with_borrow_mut(|[m, r]| {
            m.resize(mean.len(), 0.0);
            r.resize(rstd.len(), 0.0);
            with_offset(inp, off, x, |xi| groupnorm::groupnorm_silu_forward(out, m, r, xi, gamma, beta, x, groups));
        });
        self.r(out);
    }
    /// [`Backend::groupnorm_silu_recompute`] in place (`groupnorm::groupnorm_silu_forward_inplace`,
    /// its statistics into a scratch).
    fn groupnorm_silu_recompute_inplace(
        &self,
        x: &mut Vec<f32>,
        mean: &Vec<f32>,
        rstd: &Vec<f32>,
        gamma: &Vec<f32>,
        beta: &Vec<f32>,
        xd: Dims,
        groups: usize,
    ) {
        GN_STATS.with_borrow_mut(|[m, r]| {
            m.resize(mean.len(), 0.0);
            r.resize(rstd.len(), 0.0);
            groupnorm::groupnorm_silu_forward_inplace(x, m, r, gamma, beta, xd, groups);
        });
        self.r(x);
    }
    fn groupnorm_silu_backward_inplace(
        &self,
        d: &mut Vec<f32>,
        dgamma: &mut Vec<f32>,
        dbeta: &mut Vec<f32>,
        inp: &Vec<f32>,
        mean: &Vec<f32>,
        rstd: &Vec<f32>,
        gamma: &Vec<f32>,
        beta: &Vec<f32>,
        x: Dims,
        groups: usize,
    ) {
        GN_SCRATCH.with_borrow_mut(|g| {
            g.resize(inp.len(), 0.0);
            groupnorm::groupnorm_silu_backward_inplace(d, dgamma, dbeta, inp, mean, rstd, gamma, beta, x, groups, g);
        });
        self.r(d);
    }
    /// SiLU's backward and GroupNorm's backward, fused per (n, group)
    /// (`groupnorm::groupnorm_silu_backward`; the SiLU gradient lives in a per-thread scratch).
    fn groupnorm_silu_backward(
        &self,
        dinp: (&mut Vec<f32>, Accum),
        dgamma: &mut Vec<f32>,
        dbeta: &mut Vec<f32>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        off: Option<&Vec<f32>>,
        mean: &Vec<f32>,
        rstd: &Vec<f32>,
        gamma: &Vec<f32>,
        beta: &Vec<f32>,
        x: Dims,
        groups: usize,
    ) {
        GN_SCRATCH.with_borrow_mut(|g| {
            g.resize(inp.len(), 0.0);
            let d = (dinp.0.as_mut_slice(), dinp.1);
            with_offset(inp, off, x, |xi| {
                groupnorm::groupnorm_silu_backward(d, dgamma, dbeta, dout, xi, mean, rstd, gamma, beta, x, groups, g)
            });
        });
        self.r(dinp.0);
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
        attention::attention_forward(out, att, qkv, x, heads, |b| self.r(b));
        self.r(out);
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
        attention::attention_backward(dqkv, datt, dout, qkv, att, x, heads, |b| self.r(b));
        self.r(dqkv);
    }

    fn upsample_forward(&self, out: &mut Vec<f32>, inp: &Vec<f32>, x: Dims) {
        upsample::upsample_forward(out, inp, x);
        self.r(out);
    }
    fn upsample_backward(&self, dinp: (&mut Vec<f32>, Accum), dout: &Vec<f32>, x: Dims) {
        upsample::upsample_backward((dinp.0.as_mut_slice(), dinp.1), dout, x);
        self.r(dinp.0);
    }

    fn add_assign(&self, dst: &mut Vec<f32>, src: &Vec<f32>) {
        elementwise::add_assign(dst, src);
        self.r(dst);
    }
    fn scale(&self, buf: &mut Vec<f32>, s: f32) {
        elementwise::scale(buf, s);
    }
    fn add_channel_bias(&self, x: &mut Vec<f32>, bias: &Vec<f32>, xd: Dims) {
        elementwise::add_channel_bias(x, bias, xd);
        self.r(x);
    }
    fn add_channel_bias_to(&self, out: &mut Vec<f32>, x: &Vec<f32>, bias: &Vec<f32>, xd: Dims) {
        elementwise::add_channel_bias_to(out, x, bias, xd);
        self.r(out);
    }
    fn add_bias_vectors(&self, out: &mut Vec<f32>, a: &Vec<f32>, b: &Vec<f32>) {
        crate::backend::check_bias_vectors(out.len(), a.len(), b.len());
        out.iter_mut().zip(a.iter().zip(b)).for_each(|(o, (&a, &b))| *o = a + b);
    }
    fn channel_sum(&self, dbias: &mut Vec<f32>, dx: &Vec<f32>, xd: Dims) {
        elementwise::channel_sum(dbias, dx, xd);
    }
    fn bias_grad_rows(&self, db: &mut Vec<f32>, rows: &Vec<f32>, n: usize, c: usize) {
        linear::bias_grad_rows(db, rows, n, c);
    }
    fn concat_channels_bias(
        &self,
        out: &mut Vec<f32>,
        a: &Vec<f32>,
        a_bias: Option<&Vec<f32>>,
        b: &Vec<f32>,
        x: Dims,
        ca: usize,
        cb: usize,
    ) {
        elementwise::concat_channels_bias(out, a, a_bias.map(|v| &v[..]), b, x, ca, cb);
        self.r(out);
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
        self.r(da.0);
        self.r(db.0);
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
