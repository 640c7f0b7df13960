//! The backend trait: the single list of what the Med-DDPM U-Net needs from hardware.
//!
//! Reading this file tells a newcomer every primitive in the system. Each primitive is a
//! forward/backward pair; outputs come first, gradients carry a `d` prefix, and `Option` marks
//! gradients a caller does not need (e.g. no input gradient for the first conv).
//!
//! Conventions shared by every backend (the CPU one in `cpu/` is the executable spec; the CUDA one
//! lives in the `meddpm-cuda` crate and is checked against it by parity tests):
//! - Buffers hold `f32` values; a backend may *store* the activations and activation gradients
//!   inside the network (buffers from [`Backend::alloc_act`]) as bf16 under [`Precision::Bf16`]:
//!   every write into such a buffer rounds to nearest even, every read widens to f32, and all
//!   arithmetic is f32. Everything else (`alloc`) is f32: parameters, their gradients, optimizer
//!   state, GroupNorm statistics, embeddings, the loss, and the network's input and output.
//! - Activations are addressed by a *logical* shape [`Dims`]
//!   (N, C, D, H, W); how they are laid out in memory (NCDHW or NDHWC) is the backend's business.
//!   Host data always crosses the boundary in NCDHW order through [`Backend::upload_act`] /
//!   [`Backend::download_act`], and parameters in PyTorch's layout through
//!   [`Backend::upload_param`] / [`Backend::download_param`].
//! - **Gradient contract.** Parameter gradients (`dw`, `db`, `dgamma`, `dbeta`) always accumulate
//!   (`+=`), which is what gradient accumulation needs. Input gradients take an explicit
//!   [`Accum`]: `Overwrite` writes, `Add` accumulates (cuDNN/cuBLAS `beta` = 0 or 1). The U-Net's
//!   skip connections are the places that use `Add`.
//! - Shapes are checked by callers against the activation plan; backends may `assert!` lengths.
//! - Nothing here allocates except `alloc`: all buffers are planned at start-up.
//!
//! Methods without a body are the core every backend implements. Methods with one (the fused
//! operations and the batched forms) are made of core calls: the CPU reference and the null
//! backend take those bodies, which give the CPU's results bit for bit, and CUDA overrides what it
//! fuses. `docs/add-a-primitive.md` lists the places a new method touches.

use crate::rng::Philox;
use crate::shape::{ConvShape, Dims};
use crate::Result;

/// Write or accumulate into an input-gradient buffer (maps to cuDNN/cuBLAS `beta` 0 or 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accum {
    Overwrite,
    Add,
}

/// Memory layout of 5-D activations on a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// (N, C, D, H, W): PyTorch's default; the CPU reference uses it.
    Ncdhw,
    /// (N, D, H, W, C): channels-last-3d, what tensor-core convolutions want.
    Ndhwc,
}

/// Math precision of convolutions and GEMMs, and the storage type of activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// True fp32 FMA math.
    Fp32,
    /// fp32 storage, TF32 tensor-core math in convolutions and GEMMs.
    Tf32,
    /// Mixed precision: activations and activation gradients stored in bf16, convolutions on
    /// bf16 tensor cores with fp32 accumulation (reading bf16 copies of the conv weights, see
    /// [`Backend::cast`]); GroupNorm statistics, softmax, the loss, the time embedding, master
    /// weights, Adam moments and EMA stay fp32 (PyTorch autocast's split).
    Bf16,
    /// As `Bf16`, but the wide 3×3×3 convolutions (stride 1, ≥ 16 channels in and out) take E4M3
    /// operands with fp32 accumulation: activations scaled per tensor, weights per output channel,
    /// by powers of two ([`crate::fp8`] is the spec). Only the CPU emulation
    /// (`CpuBackend::fp8`, for tests and eval-configs) runs it; the CLI refuses it on every device.
    Fp8,
}

impl Precision {
    pub const ALL: [Precision; 4] = [Precision::Fp32, Precision::Tf32, Precision::Bf16, Precision::Fp8];
    /// Lower-case name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
            Precision::Fp8 => "fp8",
        }
    }
    /// Storage type of the network's activation buffers ([`Backend::alloc_act`]).
    pub fn act_dtype(self) -> DType {
        match self {
            Precision::Bf16 | Precision::Fp8 => DType::Bf16,
            Precision::Fp32 | Precision::Tf32 => DType::F32,
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Precision::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown precision {s:?}: expected fp32, tf32, bf16 or fp8"))
    }
}

/// Where the compute happens (`--device`): CUDA device 0 when one answers, else the CPU
/// (`auto`); the CPU reference; CUDA device N (an error where it is absent).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceSel {
    Auto,
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for DeviceSel {
    type Err = String;
    /// `auto`, `cpu`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(DeviceSel::Auto),
            "cpu" => Ok(DeviceSel::Cpu),
            "cuda" => Ok(DeviceSel::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSel::Cuda)
                .ok_or_else(|| format!("'{s}' is not a device: use auto, cpu, cuda or cuda:N")),
        }
    }
}

/// Element type a buffer stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    /// bfloat16: the upper 16 bits of an f32, written with round-to-nearest-even.
    Bf16,
}

impl DType {
    pub const fn bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
        }
    }
}

/// `Backend::add_bias_vectors`' operands are three f32 vectors of one length (both backends).
pub fn check_bias_vectors(out: usize, a: usize, b: usize) {
    assert!(out == a && a == b, "add_bias_vectors: lengths {out} {a} {b}, expected one length");
}

/// `x` rounded to the nearest bf16 value (ties to even), returned as f32 — exactly what the GPU
/// stores in a bf16 buffer (`f2bf` in meddpm-cuda's kernels/common.cu). NaN stays NaN.
pub fn round_bf16(x: f32) -> f32 {
    let u = x.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return f32::from_bits((u | 0x0040_0000) & 0xffff_0000);
    }
    let r = u.wrapping_add(0x7fff + ((u >> 16) & 1));
    f32::from_bits(r & 0xffff_0000)
}

/// Loss of ε̂ against ε. Med-DDPM uses L1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LossKind {
    L1,
    L2,
}

/// Adam hyper-parameters for one step (PyTorch `torch.optim.Adam` semantics, no weight decay).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// 1-based step count used for bias correction.
    pub t: u64,
}

/// Per-sample coefficients of one ancestral DDPM step (see `diffusion::ddpm`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DdpmCoefs {
    /// √(1/ᾱ_t)
    pub recip: f32,
    /// √(1/ᾱ_t − 1)
    pub recipm1: f32,
    /// posterior mean coefficient on x̂₀
    pub coef1: f32,
    /// posterior mean coefficient on x_t
    pub coef2: f32,
    /// exp(½·log β̃_t), 0 at t = 0
    pub sigma: f32,
}

/// What one [`Backend::sampler_step`] derives from ε̂ and keeps in its history (see
/// `diffusion::sampler`): DPM-Solver++ works in data prediction, iPNDM in noise prediction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prediction {
    /// d = x̂₀ (clamped to [−1, 1] when the step clips).
    Data,
    /// d = the ε consistent with the (clamped) x̂₀: ε̂ itself where no clamping happened.
    Noise,
}

/// Per-sample coefficients of one [`Backend::sampler_step`]. A coefficient that is exactly 0
/// removes its term: the buffer is not read (and no noise is drawn for `cz` = 0).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplerCoefs {
    /// √(1/ᾱ) at the step's time: x̂₀ = recip·x − recipm1·ε̂
    pub recip: f32,
    /// √(1/ᾱ − 1) at the step's time
    pub recipm1: f32,
    /// on x
    pub cx: f32,
    /// on this step's d
    pub cd: f32,
    /// on the history, newest first (hist[k] gets ch[k])
    pub ch: [f32; 3],
    /// on fresh noise z
    pub cz: f32,
    /// z of element j (logical NCDHW order within this sample) is `noise.normal(offset + j)`
    pub noise: Philox,
    pub offset: u64,
}

/// The GroupNorm statistics a fused convolution may take of its output (see
/// [`Backend::groupnorm_silu_conv3d_fused`]): mean, rstd [N·G], and the offset [N·Cout] (f32) the
/// GroupNorm adds to the output before normalising.
pub type YStats<'a, B> = (&'a mut B, &'a mut B, Option<&'a B>);

/// The GroupNorm+SiLU backward that follows a conv's data gradient in
/// [`Backend::conv3d_backward_data_gn`], whose output gradient that data gradient is: the
/// arguments of [`Backend::groupnorm_silu_backward_act`] (with `dsum`) or, with `res`, of
/// [`Backend::groupnorm_silu_backward_act_res`] — not both; `dout_sum` (f32 [N·Cout], overwritten)
/// receives [`Backend::channel_sum`] of the conv's dout (its bias gradient's per-sample rows).
pub struct GnSiluBack<'a, B> {
    pub dinp: (&'a mut B, Accum),
    pub dsum: Option<&'a mut B>,
    pub res: Option<&'a B>,
    pub act: &'a mut B,
    pub dgb: (&'a mut B, &'a mut B),
    pub inp: &'a B,
    pub off: Option<&'a B>,
    pub ms: (&'a B, &'a B),
    pub gb: (&'a B, &'a B),
    pub x: Dims,
    pub groups: usize,
    pub dout_sum: Option<&'a mut B>,
}

impl<B> GnSiluBack<'_, B> {
    /// The backward as separate calls once `da` holds the data gradient (dout over `yd`): dout's
    /// channel sums (if asked for), then [`Backend::groupnorm_silu_backward_act`] or, with `res`,
    /// [`Backend::groupnorm_silu_backward_act_res`]. The trait's default and a backend's fallbacks.
    pub fn calls<K: Backend<Buf = B> + ?Sized>(self, k: &K, da: &B, dout: &B, yd: Dims) {
        let GnSiluBack { dinp, dsum, res, act, dgb, inp, off, ms, gb, x, groups, dout_sum } = self;
        if let Some(s) = dout_sum {
            k.channel_sum(s, dout, yd);
        }
        match res {
            Some(r) => {
                assert!(dsum.is_none(), "conv3d_backward_data_gn {x}: res and dsum together");
                k.groupnorm_silu_backward_act_res(dinp, r, act, dgb, da, inp, off, ms, gb, x, groups)
            }
            None => k.groupnorm_silu_backward_act(dinp, dsum, act, dgb, da, inp, off, ms, gb, x, groups),
        }
    }
}

/// The hardware abstraction. Generic code stops at the model (`UNet<B>`, `Trainer<B>`).
pub trait Backend {
    /// A device buffer of `f32` elements.
    type Buf;

    /// Human-readable description (device, library versions, precision, layout).
    fn describe(&self) -> String;
    fn layout(&self) -> Layout;
    fn precision(&self) -> Precision;

    // ---- memory -------------------------------------------------------------------------------
    /// A zero-filled f32 buffer of `len` elements.
    fn alloc(&self, len: usize) -> Result<Self::Buf>;
    /// A zero-filled buffer of `len` elements for an activation or activation gradient inside the
    /// network, stored in [`Precision::act_dtype`] (bf16 under `Precision::Bf16`).
    fn alloc_act(&self, len: usize) -> Result<Self::Buf> {
        self.alloc(len)
    }
    /// dst (an [`Backend::alloc_act`] buffer) ← src (f32, same length and layout), rounded to the
    /// activation type: the bf16 copies of the conv weights the convolutions read.
    fn cast(&self, dst: &mut Self::Buf, src: &Self::Buf) {
        self.copy(dst, src);
    }
    fn len(&self, b: &Self::Buf) -> usize;
    /// Raw element copy host → device (no layout change). Lengths must match.
    fn upload(&self, host: &[f32], dst: &mut Self::Buf);
    /// Raw element copy device → host (no layout change). Lengths must match.
    fn download(&self, src: &Self::Buf, host: &mut [f32]);
    /// Host NCDHW activation → device in the backend's layout.
    fn upload_act(&self, host_ncdhw: &[f32], x: Dims, dst: &mut Self::Buf);
    /// [`Backend::upload_act`] that may overlap the work already queued: the copy runs beside it
    /// and everything queued after this call sees `dst` filled. The host slice may go away on
    /// return. Contract: no work queued since the host last waited for the device
    /// ([`Backend::sync`], a download) reads or writes `dst` (the trainer's double-buffered batch,
    /// `Trainer::stage`). Default: a plain `upload_act`.
    fn stage_act(&self, host_ncdhw: &[f32], x: Dims, dst: &mut Self::Buf) {
        self.upload_act(host_ncdhw, x, dst)
    }
    /// Device activation in the backend's layout → host NCDHW.
    fn download_act(&self, src: &Self::Buf, x: Dims, host_ncdhw: &mut [f32]);
    /// Host parameter in PyTorch's layout (`torch_shape`) → device in the backend's layout
    /// (a channels-last backend stores 5-D conv weights as (Cout, kD, kH, kW, Cin)).
    fn upload_param(&self, host: &[f32], torch_shape: &[usize], dst: &mut Self::Buf);
    /// Inverse of [`Backend::upload_param`].
    fn download_param(&self, src: &Self::Buf, torch_shape: &[usize], host: &mut [f32]);
    fn zero(&self, b: &mut Self::Buf);
    /// dst ← src (same length, same layout).
    fn copy(&self, dst: &mut Self::Buf, src: &Self::Buf);
    /// Wait for all queued work (a no-op on the CPU).
    fn sync(&self);
    /// Open a named range (a U-Net block, a phase) around the calls that follow; ranges nest.
    /// For profilers: NVTX on CUDA, the op timer `analysis::timed::Timed`. Default: nothing.
    fn push_range(&self, _name: &str) {}
    /// Close the innermost range opened by [`Backend::push_range`].
    fn pop_range(&self) {}
    /// Run `body` — a fixed sequence of this backend's calls on fixed buffers with fixed shapes
    /// and arguments, with no host data and no host-side decisions inside — possibly as a
    /// captured graph: the CUDA backend runs it plainly the first time under a `key` (algorithm
    /// searches, first-use allocations), captures it into a CUDA graph the second time and from
    /// then on only launches the graph (`body` is not called). The caller guarantees that one key
    /// always means the same calls on the same buffers (the U-Net keys by instance, pass and the
    /// generation of its parameter buffers). Default: call `body`.
    fn replay(&self, _key: u64, body: &mut dyn FnMut()) {
        body()
    }

    // ---- convolution (conv3d covers Conv3 k=3 pad 1, Downsample k=3 stride 2, Conv1 k=1) -------
    /// out[N,Cout,Do,Ho,Wo] = conv(inp[N,Cin,D,H,W], w[Cout,Cin,k,k,k]) + b[Cout].
    fn conv3d_forward(&self, out: &mut Self::Buf, inp: &Self::Buf, w: &Self::Buf, b: &Self::Buf, cs: ConvShape) {
        self.conv3d_forward_acc((out, Accum::Overwrite), inp, w, Some(b), cs)
    }
    /// out (overwritten, or added to per `Accum`) = conv(inp, w) + b, without a bias where `b` is
    /// None: the U-Net adds a residual branch's convolution onto the skip branch already in `out`
    /// (cuDNN's β = 1), its bias folded into an earlier pass.
    fn conv3d_forward_acc(
        &self,
        out: (&mut Self::Buf, Accum),
        inp: &Self::Buf,
        w: &Self::Buf,
        b: Option<&Self::Buf>,
        cs: ConvShape,
    );
    /// out = conv(inp, w) + b + z, z of out's dims: a residual branch's last conv with its bias
    /// and the skip tensor (ResBlocks with an identity skip, attention's proj_out). Backends that
    /// can do it in the conv's epilogue do (CUDA: cuDNN's conv-bias-activation call with z, where
    /// timing says it is faster); this default is the bias pass onto z, then the accumulating conv.
    fn conv3d_forward_res(
        &self,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        w: &Self::Buf,
        b: &Self::Buf,
        z: &Self::Buf,
        cs: ConvShape,
    ) {
        self.add_channel_bias_to(out, z, b, cs.out());
        self.conv3d_forward_acc((out, Accum::Add), inp, w, None, cs);
    }
    /// dinp (per `Accum`), dw += , db += , from dout[N,Cout,Do,Ho,Wo]. `db` None: the caller
    /// has dout's channel sums already (the U-Net's ResBlocks: one sum serves out_layers' conv and
    /// the skip conv; in_layers' conv bias gradient is the time embedding's, `bias_grad_rows`).
    #[allow(clippy::too_many_arguments)]
    fn conv3d_backward(
        &self,
        dinp: Option<(&mut Self::Buf, Accum)>,
        dw: &mut Self::Buf,
        db: Option<&mut Self::Buf>,
        dout: &Self::Buf,
        inp: &Self::Buf,
        w: &Self::Buf,
        cs: ConvShape,
    );
    /// The data half of [`Backend::conv3d_backward`] alone: dinp (per `Accum`) from dout and w.
    /// The U-Net runs it before the weight half where that half's input, silu(GN(·)), is
    /// rewritten by the GroupNorm backward that consumes this gradient
    /// ([`Backend::groupnorm_silu_backward_act`]): no separate recomputation pass.
    fn conv3d_backward_data(&self, dinp: (&mut Self::Buf, Accum), dout: &Self::Buf, w: &Self::Buf, cs: ConvShape);
    /// [`Backend::conv3d_backward_data`] into `da` (overwritten), then the GroupNorm+SiLU backward
    /// `gn` of that gradient (its dout = da): a ResBlock conv's input gradient through the
    /// GroupNorm+SiLU before it. CUDA takes the backward's channel sums in the data gradient's
    /// epilogue where its wgmma kernel runs (no pass that reads da and the GroupNorm's input again
    /// for them), and dout's channel sums from the stages it loads; this default is the calls —
    /// the same values, up to the order of the sums.
    fn conv3d_backward_data_gn(
        &self,
        da: &mut Self::Buf,
        dout: &Self::Buf,
        w: &Self::Buf,
        cs: ConvShape,
        gn: GnSiluBack<'_, Self::Buf>,
    ) {
        self.conv3d_backward_data((&mut *da, Accum::Overwrite), dout, w, cs);
        gn.calls(self, da, dout, cs.out());
    }

    // ---- normalisation and activation -----------------------------------------------------------
    /// GroupNorm(groups, eps 1e-5, affine) over each (n, group): out, and mean/rstd [N·G] saved.
    #[allow(clippy::too_many_arguments)]
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
    );
    /// dinp (per `Accum`), dgamma += , dbeta += .
    #[allow(clippy::too_many_arguments)]
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
    );
    /// The statistics alone: mean/rstd [N·G] (f32) of inp + off (`off` as in
    /// [`Backend::groupnorm_silu_forward`]), as a GroupNorm forward of it saves them. With
    /// [`Backend::groupnorm_silu_recompute`] the core of the GroupNorm+SiLU forwards the trait
    /// provides.
    fn groupnorm_stats(
        &self,
        mean: &mut Self::Buf,
        rstd: &mut Self::Buf,
        inp: &Self::Buf,
        off: Option<&Self::Buf>,
        x: Dims,
        groups: usize,
    );
    /// out = x·σ(x), elementwise over the whole buffer.
    fn silu_forward(&self, out: &mut Self::Buf, inp: &Self::Buf);
    /// dinp (per `Accum`) = dout·σ(x)(1 + x(1−σ(x))).
    fn silu_backward(&self, dinp: (&mut Self::Buf, Accum), dout: &Self::Buf, inp: &Self::Buf);

    /// Fused GroupNorm + SiLU (the ResBlock and output-head prologue): out = silu(GN(inp + off)),
    /// with mean/rstd [N·G] saved. The GroupNorm output itself is not kept: the backward recomputes
    /// it from `inp` and the statistics where SiLU's derivative needs it.
    ///
    /// `off` (f32, [N·C], optional) is a per-(sample, channel) input offset: the GroupNorm reads
    /// inp[n, c, ·] + off[n·C + c], summed in f32 and never stored or rounded (the ResBlock's
    /// time-embedding add, `h + emb_out`, folded in: no pass over `h` that only adds it). The
    /// recompute and the backward take the same offset; the backward's dinp is then also
    /// ∂loss/∂off per voxel.
    ///
    /// This default is [`Backend::groupnorm_stats`], then [`Backend::groupnorm_silu_recompute`]
    /// with them (two passes over `inp`; CUDA fuses them).
    #[allow(clippy::too_many_arguments)]
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
        self.groupnorm_stats(mean, rstd, inp, off, x, groups);
        self.groupnorm_silu_recompute(out, mean, rstd, inp, off, gamma, beta, x, groups);
    }
    /// The output head GroupNorm → SiLU → Conv3 forward: `out` = conv3d(silu(GN(inp)), w) + b with
    /// the statistics saved in mean/rstd for the backward (which recomputes silu(GN(inp))). `act`
    /// is scratch of `inp`'s size for silu(GN(inp)); a backend that fuses the convolution's
    /// prologue need not write it (CUDA: `conv3d_fwd_gn_small_cout`, one pass over `inp` for Cout
    /// ≤ 4). With `fresh` false the statistics are given in mean/rstd (the producing conv's
    /// epilogue took them: [`Backend::groupnorm_silu_conv3d_fused`]'s `ystats`). This default is
    /// the two calls.
    #[allow(clippy::too_many_arguments)]
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
        if fresh {
            self.groupnorm_silu_forward(act, mean, rstd, inp, None, gamma, beta, cs.x, groups);
        } else {
            self.groupnorm_silu_recompute(act, mean, rstd, inp, None, gamma, beta, cs.x, groups);
        }
        self.conv3d_forward(out, act, w, b, cs);
    }
    /// Whether [`Backend::groupnorm_silu_conv3d_fused`] computes conv `cs` (3×3×3 forward,
    /// accumulated onto its output or with a residual where `add`) over silu(GN(`inp`)) with `w`
    /// in one pass, silu(GN(inp)) never stored. The default: no (the model then makes the two
    /// calls). CUDA: where the conv runs on `conv3d_wgmma` (bf16 NDHWC, sm_90, wide channels).
    fn gn_conv_fusable(&self, _inp: &Self::Buf, _w: &Self::Buf, _cs: ConvShape, _add: bool, _groups: usize) -> bool {
        false
    }
    /// Whether [`Backend::groupnorm_silu_conv3d_fused`] and
    /// [`Backend::groupnorm_silu_conv3d_fused_cat`] take their output's GroupNorm statistics
    /// when asked (`ystats`), so that no pass reads the output for them. The default: no. CUDA:
    /// from the epilogue of `conv3d_wgmma_fwd_gn` (`KernelChoices::conv_stats` switches it off).
    fn fused_conv_out_stats(&self) -> bool {
        false
    }
    /// A ResBlock's GroupNorm+SiLU → Conv3 forward as one pass where
    /// [`Backend::gn_conv_fusable`] said so (only then: a backend without it panics):
    /// `out` (= or += per the mode) = conv3d(silu(GN(inp + off)), w) (+ b) (+ z, with
    /// `Accum::Add`: conv + b + z, out's old values unread). With `fresh` the statistics of
    /// inp + off are computed into mean/rstd first (as [`Backend::groupnorm_silu_forward`] saves
    /// them), else they are given (a concatenation's, [`Backend::concat_channels_stats`]).
    ///
    /// `ystats` = (mean, rstd, off): also the GroupNorm statistics of out + off as stored (the
    /// final values, accumulated or not; as [`Backend::groupnorm_silu_forward`] would compute them
    /// from `out`, up to the order of the sums), where [`Backend::fused_conv_out_stats`] said so.
    #[allow(clippy::too_many_arguments)]
    fn groupnorm_silu_conv3d_fused(
        &self,
        _out: (&mut Self::Buf, Accum),
        _inp: (&Self::Buf, Option<&Self::Buf>),
        _stats: (&mut Self::Buf, &mut Self::Buf),
        _fresh: bool,
        _gb: (&Self::Buf, &Self::Buf),
        _wbz: (&Self::Buf, Option<&Self::Buf>, Option<&Self::Buf>),
        cs: ConvShape,
        _groups: usize,
        _ystats: Option<YStats<'_, Self::Buf>>,
    ) {
        panic!("groupnorm_silu_conv3d_fused {cs:?}: this backend does not fuse (gn_conv_fusable is false)")
    }
    /// Whether a decoder ResBlock over the concatenation cat([a, b]) (a: `ca` channels; `x` its
    /// buffer, dims `cs.x`) runs without the concatenation stored: the skip conv and the
    /// statistics by [`Backend::concat_skip_conv_stats`], in_layers' GroupNorm+SiLU → conv `cs`
    /// (weight `w`) by [`Backend::groupnorm_silu_conv3d_fused_cat`], both reading the two parts.
    /// The concatenation's first part then carries its upsampling conv's bias itself (the model
    /// asks before that conv runs). The default: no. CUDA: where [`Backend::gn_conv_fusable`]
    /// fuses `cs`, both parts multiples of 64 channels.
    #[allow(clippy::too_many_arguments)]
    fn cat_conv_fusable(
        &self,
        _x: &Self::Buf,
        _w: &Self::Buf,
        _w_skip: &Self::Buf,
        _cs: ConvShape,
        _ca: usize,
        _groups: usize,
    ) -> bool {
        false
    }
    /// Where [`Backend::cat_conv_fusable`] said so: `out` = the skip conv `cs` (1×1×1 over the
    /// concatenation, weight and bias `wb`) of cat([a, b]) at channel `ca`, and the
    /// concatenation's GroupNorm statistics into `stats` (as
    /// [`Backend::concat_channels_stats`] saves them), the concatenation never stored.
    #[allow(clippy::too_many_arguments)]
    fn concat_skip_conv_stats(
        &self,
        _out: &mut Self::Buf,
        _parts: (&Self::Buf, &Self::Buf),
        _stats: (&mut Self::Buf, &mut Self::Buf),
        _wb: (&Self::Buf, &Self::Buf),
        cs: ConvShape,
        _ca: usize,
        _groups: usize,
    ) {
        panic!("concat_skip_conv_stats {cs:?}: this backend does not fuse (cat_conv_fusable is false)")
    }
    /// Where [`Backend::cat_conv_fusable`] said so: `out` = conv3d(silu(GN(cat([a, b]))), w) with
    /// the concatenation's statistics given, read from its two parts (a: `ca` channels);
    /// `ystats` as [`Backend::groupnorm_silu_conv3d_fused`]'s.
    #[allow(clippy::too_many_arguments)]
    fn groupnorm_silu_conv3d_fused_cat(
        &self,
        _out: &mut Self::Buf,
        _parts: (&Self::Buf, &Self::Buf),
        _stats: (&Self::Buf, &Self::Buf),
        _gb: (&Self::Buf, &Self::Buf),
        _w: &Self::Buf,
        cs: ConvShape,
        _ca: usize,
        _groups: usize,
        _ystats: Option<YStats<'_, Self::Buf>>,
    ) {
        panic!("groupnorm_silu_conv3d_fused_cat {cs:?}: this backend does not fuse (cat_conv_fusable is false)")
    }
    /// `out` = silu(GN(inp)) with the statistics a [`Backend::groupnorm_silu_forward`] of the same
    /// `inp` saved: the same values that forward wrote (the backward's recomputation of a
    /// convolution's input; on the GPU one elementwise pass, no statistics pass).
    #[allow(clippy::too_many_arguments)]
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
    );
    /// [`Backend::groupnorm_silu_forward`] in place: `x` := silu(GN(x)), statistics saved. The
    /// ResBlock that reads a skip concatenation uses it so that no scratch of the concatenation's
    /// size is needed (see `UNet`'s `cat_in`). This default is [`Backend::groupnorm_stats`], then
    /// [`Backend::groupnorm_silu_recompute_inplace`].
    #[allow(clippy::too_many_arguments)]
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
        self.groupnorm_stats(mean, rstd, x, None, xd, groups);
        self.groupnorm_silu_recompute_inplace(x, mean, rstd, gamma, beta, xd, groups);
    }
    /// [`Backend::groupnorm_silu_recompute`] in place: `x` := silu(GN(x)) with the statistics the
    /// [`Backend::groupnorm_silu_forward_inplace`] of the same `x` saved, bit for bit that forward's
    /// output (the decoder ResBlock's backward; on the GPU one elementwise pass, no statistics).
    #[allow(clippy::too_many_arguments)]
    fn groupnorm_silu_recompute_inplace(
        &self,
        x: &mut Self::Buf,
        mean: &Self::Buf,
        rstd: &Self::Buf,
        gamma: &Self::Buf,
        beta: &Self::Buf,
        xd: Dims,
        groups: usize,
    );
    /// [`Backend::groupnorm_silu_backward`] in place with `Accum::Overwrite`: `d` holds
    /// ∂loss/∂silu(GN(inp)) on entry and ∂loss/∂inp on return; dgamma += , dbeta += .
    #[allow(clippy::too_many_arguments)]
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
    );
    /// Backward of [`Backend::groupnorm_silu_forward`]: dinp (per `Accum`), dgamma += , dbeta += .
    #[allow(clippy::too_many_arguments)]
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
    );
    /// [`Backend::groupnorm_silu_backward`] overwriting dinp, plus dsum[n, c] (f32 [N·C],
    /// overwritten) = Σ over the voxels of dinp[n, c]: the ResBlock's time-embedding bias
    /// gradient. Backends that can take it from the backward's own channel sums do (CUDA, NDHWC:
    /// no pass over dinp); this default is the backward, then `channel_sum`.
    #[allow(clippy::too_many_arguments)]
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
        let d = (&mut *dinp, Accum::Overwrite);
        self.groupnorm_silu_backward(d, dgamma, dbeta, dout, inp, off, mean, rstd, gamma, beta, x, groups);
        self.channel_sum(dsum, dinp, x);
    }

    /// [`Backend::groupnorm_silu_backward`] (with `dsum`: [`Backend::groupnorm_silu_backward_sum`],
    /// dinp overwritten) that also writes act = silu(GN(inp + off)), the forward's output that the
    /// convolution's weight gradient reads next: the recomputation rides in the backward's
    /// elementwise pass, which computes GN(inp + off) for SiLU's derivative anyway (CUDA: one
    /// extra write instead of a read-and-write pass). This default is the recomputation, then the
    /// backward — the same values.
    #[allow(clippy::too_many_arguments)]
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
        self.groupnorm_silu_recompute(act, mean, rstd, inp, off, gamma, beta, x, groups);
        match dsum {
            Some(s) => {
                assert!(dinp.1 == Accum::Overwrite, "groupnorm_silu_backward_act with dsum: dinp is overwritten");
                let (ms, gb) = ((mean, rstd), (gamma, beta));
                self.groupnorm_silu_backward_sum(dinp.0, s, dgamma, dbeta, dout, inp, off, ms, gb, x, groups);
            }
            None => {
                self.groupnorm_silu_backward(dinp, dgamma, dbeta, dout, inp, off, mean, rstd, gamma, beta, x, groups)
            }
        }
    }

    /// dinp (per Accum) += res, then += the GroupNorm+SiLU backward with act = silu(GN(inp + off))
    /// ([`Backend::groupnorm_silu_backward_act`], no channel sums): a ResBlock with an identity
    /// skip, whose input gradient is the output gradient (res) plus the main branch's. CUDA folds
    /// res into the backward's elementwise pass (no add_assign or copy pass over dinp); this
    /// default is the two calls — the same values (the intermediate sum rounded as stored).
    #[allow(clippy::too_many_arguments)]
    fn groupnorm_silu_backward_act_res(
        &self,
        dinp: (&mut Self::Buf, Accum),
        res: &Self::Buf,
        act: &mut Self::Buf,
        dgb: (&mut Self::Buf, &mut Self::Buf),
        dout: &Self::Buf,
        inp: &Self::Buf,
        off: Option<&Self::Buf>,
        ms: (&Self::Buf, &Self::Buf),
        gb: (&Self::Buf, &Self::Buf),
        x: Dims,
        groups: usize,
    ) {
        match dinp.1 {
            Accum::Add => self.add_assign(dinp.0, res),
            Accum::Overwrite => self.copy(dinp.0, res),
        }
        self.groupnorm_silu_backward_act((dinp.0, Accum::Add), None, act, dgb, dout, inp, off, ms, gb, x, groups);
    }
    /// [`Backend::groupnorm_silu_backward_inplace`] that also replaces `x` by silu(GN(x)) (the
    /// decoder ResBlock reading a skip concatenation in place: after this call `x` holds the
    /// convolution's input for its weight gradient, and the concatenation need not be rebuilt for
    /// the GroupNorm backward). This default is the backward, then the in-place recomputation.
    #[allow(clippy::too_many_arguments)]
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
        self.groupnorm_silu_backward_inplace(d, dgamma, dbeta, x, mean, rstd, gamma, beta, xd, groups);
        self.groupnorm_silu_recompute_inplace(x, mean, rstd, gamma, beta, xd, groups);
    }

    /// A decoder ResBlock's input gradient over its skip concatenation x = cat([h + h_bias, s])
    /// (`cat_in`; `h_bias` f32, `ca` long, where given: the upsampling conv's bias, see
    /// [`Backend::concat_channels_bias`]), in one call. On entry `d` holds ∂loss/∂silu(GN(x));
    /// `x` is an output: it becomes silu(GN(x)) (the 3×3 conv's input for its weight gradient).
    /// The skip conv (`skip` = its dout, dout's per-sample channel sums `dsum` (N × cout, f32),
    /// weights, weight gradient and 1×1 shape) gets its weight gradient added into `dw`; its data
    /// gradient is added to the GroupNorm+SiLU backward's, and the sum goes straight to the two
    /// parts' gradients, `parts` = (dh: channels 0..ca, ds: ca..ca+cb), each per its `Accum` (as
    /// [`Backend::split_channels`]). `d` is scratch afterwards. This default
    /// ([`cat_in_steps`]) builds the concatenation into `x` and runs the separate calls; a backend
    /// may read x from its parts instead, write the parts from the GroupNorm backward's elementwise
    /// pass and add the skip gradient onto them, so no concatenation-sized tensor is rebuilt,
    /// written, read back or split.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn groupnorm_silu_backward_cat_in(
        &self,
        d: &mut Self::Buf,
        x: &mut Self::Buf,
        cat: (&Self::Buf, Option<&Self::Buf>, &Self::Buf),
        parts: ((&mut Self::Buf, Accum), (&mut Self::Buf, Accum)),
        dgb: (&mut Self::Buf, &mut Self::Buf),
        ms: (&Self::Buf, &Self::Buf),
        gb: (&Self::Buf, &Self::Buf),
        skip: (&Self::Buf, &Self::Buf, &Self::Buf, &mut Self::Buf, ConvShape),
        (ca, cb): (usize, usize),
        groups: usize,
    ) {
        cat_in_steps(self, d, x, cat, parts, dgb, ms, gb, skip, (ca, cb), groups);
    }

    // ---- linear (time-embedding MLP and each ResBlock's emb_layers) ----------------------------
    /// out[N,O] = inp[N,I]·wᵀ[I,O] + b[O], with w stored (O, I) as in PyTorch.
    #[allow(clippy::too_many_arguments)]
    fn linear_forward(
        &self,
        out: &mut Self::Buf,
        inp: &Self::Buf,
        w: &Self::Buf,
        b: &Self::Buf,
        n: usize,
        i: usize,
        o: usize,
    );
    #[allow(clippy::too_many_arguments)]
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
    );

    // ---- attention core (QKVAttentionLegacy) ------------------------------------------------------
    /// qkv: activation of logical shape (N, 3C, D, H, W) from the qkv Conv1 — for head h its
    /// channels [h·3c, h·3c+c) are q, then k, then v (c = C / heads, "legacy" order).
    /// att[N, heads, T, T] = softmax_keys((q·s)ᵀ(k·s)) with s = c^(−1/4), computed in f32;
    /// out (N, C, D, H, W) with out[head h, channel j, query t] = Σ_s v[j, s]·att[t, s].
    /// `x` is the logical shape of `out` (C channels, T = D·H·W tokens). att (and backward's
    /// datt) may be of the activation type: where it is bf16, the logits, att, dP and dZ are
    /// stored in bf16 as PyTorch autocast stores them (the CPU's bf16 mode rounds there).
    fn attention_forward(&self, out: &mut Self::Buf, att: &mut Self::Buf, qkv: &Self::Buf, x: Dims, heads: usize);
    /// dqkv (overwritten) from dout; `datt` is scratch of att's size.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        dqkv: &mut Self::Buf,
        datt: &mut Self::Buf,
        dout: &Self::Buf,
        qkv: &Self::Buf,
        att: &Self::Buf,
        x: Dims,
        heads: usize,
    );

    // ---- resampling ---------------------------------------------------------------------------
    /// Trilinear ×2 in D, H and W, `align_corners=False` (PyTorch `F.interpolate` semantics).
    /// `x` is the input's shape; out has (N, C, 2D, 2H, 2W).
    fn upsample_forward(&self, out: &mut Self::Buf, inp: &Self::Buf, x: Dims);
    fn upsample_backward(&self, dinp: (&mut Self::Buf, Accum), dout: &Self::Buf, x: Dims);
    /// out = conv(up(x), w) (+ b; overwritten): the U-Net's Upsample, x of dims `xd`, `cs.x` its
    /// doubling, `u` a scratch of the doubled volume's size. This default doubles x into `u`,
    /// then convolves; a backend may compute the doubling inside the conv instead (CUDA's wgmma
    /// forward, `u` then unwritten).
    #[allow(clippy::too_many_arguments)]
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
        self.upsample_forward(u, x, xd);
        self.conv3d_forward_acc((out, Accum::Overwrite), u, w, b, cs);
    }
    /// The backward of [`Backend::upsample_conv3d_forward`]'s conv: du (overwritten) its data
    /// gradient, dw += and db += its weight and bias gradients from dout; the conv's input, the
    /// doubling of x, is recomputed into `u` (its weight gradient reads it). This default doubles
    /// x into `u`, then runs [`Backend::conv3d_backward`]; a backend may write `u` inside the
    /// data gradient instead (CUDA's wgmma kernel). The caller takes du to dx
    /// ([`Backend::upsample_backward`]).
    #[allow(clippy::too_many_arguments)]
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
        self.upsample_forward(u, x, xd);
        self.conv3d_backward(Some((du, Accum::Overwrite)), dw, db, dout, u, w, cs);
    }

    // ---- elementwise and channel plumbing ---------------------------------------------------------
    /// dst += src (same length).
    fn add_assign(&self, dst: &mut Self::Buf, src: &Self::Buf);
    /// buf *= s.
    fn scale(&self, buf: &mut Self::Buf, s: f32);
    /// x[n, c, ...] += bias[n, c] (the time embedding, broadcast over D, H, W).
    fn add_channel_bias(&self, x: &mut Self::Buf, bias: &Self::Buf, xd: Dims);
    /// out[n, c, ...] = x[n, c, ...] + bias[c] (a residual's skip branch plus the folded bias of
    /// the branch a `conv3d_forward_acc` then adds).
    fn add_channel_bias_to(&self, out: &mut Self::Buf, x: &Self::Buf, bias: &Self::Buf, xd: Dims);
    /// out = a + b over f32 vectors of one length: two biases folded into one (parameters, never
    /// rounded to the activation type).
    fn add_bias_vectors(&self, out: &mut Self::Buf, a: &Self::Buf, b: &Self::Buf);
    /// [`Backend::add_bias_vectors`] on every triple (out, a, b): a network's folded biases, all
    /// refreshed at once when its parameters change. Default: one call per triple.
    fn add_bias_vectors_all(&self, triples: &mut [(&mut Self::Buf, &Self::Buf, &Self::Buf)]) {
        for (o, a, b) in triples.iter_mut() {
            self.add_bias_vectors(o, a, b);
        }
    }
    /// dbias[n, c] (overwritten) = Σ over D, H, W of dx[n, c, ...].
    fn channel_sum(&self, dbias: &mut Self::Buf, dx: &Self::Buf, xd: Dims);
    /// db[c] += Σₙ rows[n, c] over f32 rows (n × c): a bias gradient from per-sample channel
    /// sums that were taken anyway (`channel_sum`).
    fn bias_grad_rows(&self, db: &mut Self::Buf, rows: &Self::Buf, n: usize, c: usize);
    /// out = cat([a, b], channel axis); a has `ca` channels, b has `cb`; `x` gives N, D, H, W.
    fn concat_channels(&self, out: &mut Self::Buf, a: &Self::Buf, b: &Self::Buf, x: Dims, ca: usize, cb: usize) {
        self.concat_channels_bias(out, a, None, b, x, ca, cb);
    }
    /// out = cat([a + a_bias[c], b]) (a_bias f32, `ca` long, where given): the U-Net's upsampling
    /// conv leaves its bias to the concatenation that reads its output (one pass less).
    #[allow(clippy::too_many_arguments)]
    fn concat_channels_bias(
        &self,
        out: &mut Self::Buf,
        a: &Self::Buf,
        a_bias: Option<&Self::Buf>,
        b: &Self::Buf,
        x: Dims,
        ca: usize,
        cb: usize,
    );
    /// [`Backend::concat_channels_bias`] and the GroupNorm statistics of `out` (`groups` groups of
    /// the ca + cb channels) into mean/rstd, as [`Backend::groupnorm_silu_forward_inplace`] of
    /// `out` saves them: a decoder ResBlock builds its skip concatenation with this, then runs
    /// [`Backend::groupnorm_silu_recompute_inplace`] (on the GPU one pass less over the
    /// concatenation). This default is the two calls: the concatenation, then
    /// [`Backend::groupnorm_stats`] of it as stored.
    #[allow(clippy::too_many_arguments)]
    fn concat_channels_stats(
        &self,
        out: &mut Self::Buf,
        a: &Self::Buf,
        a_bias: Option<&Self::Buf>,
        b: &Self::Buf,
        (mean, rstd): (&mut Self::Buf, &mut Self::Buf),
        x: Dims,
        ca: usize,
        cb: usize,
        groups: usize,
    ) {
        self.concat_channels_bias(out, a, a_bias, b, x, ca, cb);
        self.groupnorm_stats(mean, rstd, out, None, x.with_c(ca + cb), groups);
    }
    /// Backward of concat: da and db (each per its `Accum`) from dout.
    #[allow(clippy::too_many_arguments)]
    fn split_channels(
        &self,
        da: (&mut Self::Buf, Accum),
        db: (&mut Self::Buf, Accum),
        dout: &Self::Buf,
        x: Dims,
        ca: usize,
        cb: usize,
    );

    // ---- loss -------------------------------------------------------------------------------------
    /// loss[0] (overwritten) = mean over all elements of |pred − target| (L1) or (pred − target)².
    fn loss_forward(&self, loss: &mut Self::Buf, pred: &Self::Buf, target: &Self::Buf, kind: LossKind);
    /// dpred (overwritten) = scale · ∂mean-loss/∂pred.
    fn loss_backward(&self, dpred: &mut Self::Buf, pred: &Self::Buf, target: &Self::Buf, kind: LossKind, scale: f32);

    // ---- diffusion --------------------------------------------------------------------------------
    /// Standard normal draws from Philox (see `rng.rs`): element i (in the buffer's *logical NCDHW*
    /// order, shape `x`) gets `rng.normal(offset + i)`. CPU and CUDA produce the same numbers.
    fn randn(&self, out: &mut Self::Buf, rng: Philox, offset: u64, x: Dims);
    /// x_t[n] = a[n]·x0[n] + b[n]·eps[n] per batch element (`q_sample`); `x` is x0's shape.
    fn q_sample(&self, xt: &mut Self::Buf, x0: &Self::Buf, eps: &Self::Buf, a: &[f32], b: &[f32], x: Dims);
    /// The training step's network input: [`Backend::randn`] into `eps` (at `offset`),
    /// [`Backend::q_sample`] of x0 with it into `xt`, and [`Backend::concat_channels`] of x_t and
    /// `cond` (`cc` channels) into `input`; `x` is x0's shape. Backends may do it in one pass
    /// (CUDA: x_t never stored, `xt` untouched). This default is the three calls.
    #[allow(clippy::too_many_arguments)]
    fn q_sample_input(
        &self,
        input: &mut Self::Buf,
        (eps, xt): (&mut Self::Buf, &mut Self::Buf),
        (x0, cond): (&Self::Buf, &Self::Buf),
        rng: Philox,
        offset: u64,
        (a, b): (&[f32], &[f32]),
        x: Dims,
        cc: usize,
    ) {
        self.randn(eps, rng, offset, x);
        self.q_sample(xt, x0, eps, a, b, x);
        self.concat_channels(input, xt, cond, x, x.c, cc);
    }
    /// One ancestral DDPM update in place: x̂₀ = clamp(recip·x − recipm1·ε̂, −1, 1);
    /// x ← coef1·x̂₀ + coef2·x + sigma·z, with per-sample coefficients.
    fn ddpm_step(&self, x: &mut Self::Buf, eps: &Self::Buf, z: &Self::Buf, coefs: &[DdpmCoefs], xd: Dims);
    /// One update of any sampler of `diffusion::sampler`, per sample n with coefficients c = coefs[n]:
    /// x̂₀ᵘ = c.recip·x − c.recipm1·ε̂; x̂₀ = clamp(x̂₀ᵘ, −1, 1) if `clip` else x̂₀ᵘ;
    /// d = x̂₀ (`Data`) or ε̂ + (x̂₀ᵘ − x̂₀)/c.recipm1 (`Noise`);
    /// x ← c.cd·d + c.cx·x + Σₖ c.ch[k]·hist[k] + c.cz·z, z drawn from Philox per sample
    /// (`c.noise`, `c.offset`), so a volume's noise does not depend on its batch position.
    /// Terms with a zero coefficient are skipped. With a history (≤ 3 buffers, newest first),
    /// d is then written into its *last* buffer; the caller rotates the slice so d becomes
    /// hist[0]. The ancestral DDPM step is the case cx = coef2, cd = coef1, cz = sigma, no history.
    #[allow(clippy::too_many_arguments)]
    fn sampler_step(
        &self,
        x: &mut Self::Buf,
        eps: &Self::Buf,
        hist: &mut [Self::Buf],
        pred: Prediction,
        clip: bool,
        coefs: &[SamplerCoefs],
        xd: Dims,
    );

    // ---- optimiser ------------------------------------------------------------------------------
    /// One Adam update of p with gradient g and moments m, v (PyTorch semantics).
    fn adam_step(&self, p: &mut Self::Buf, g: &Self::Buf, m: &mut Self::Buf, v: &mut Self::Buf, h: AdamStep);
    /// ema ← decay·ema + (1 − decay)·p.
    fn ema_update(&self, ema: &mut Self::Buf, p: &Self::Buf, decay: f32);

    // ---- the same over every parameter tensor (one launch on the GPU) ----------------------------
    /// [`Backend::adam_step`] on every tensor i of (p, g, m, v); with `zero_grad` each gradient is
    /// zeroed after use. Default: one call per tensor.
    fn adam_step_all(
        &self,
        p: &mut [Self::Buf],
        g: &mut [Self::Buf],
        m: &mut [Self::Buf],
        v: &mut [Self::Buf],
        h: AdamStep,
        zero_grad: bool,
    ) {
        for (((p, g), m), v) in p.iter_mut().zip(g.iter_mut()).zip(m.iter_mut()).zip(v.iter_mut()) {
            self.adam_step(p, g, m, v, h);
            if zero_grad {
                self.zero(g);
            }
        }
    }
    /// [`Backend::ema_update`] on every tensor; `decay` 0 copies `p` exactly. Default: one call per
    /// tensor.
    fn ema_update_all(&self, ema: &mut [Self::Buf], p: &[Self::Buf], decay: f32) {
        for (e, p) in ema.iter_mut().zip(p) {
            if decay == 0.0 {
                self.copy(e, p);
            } else {
                self.ema_update(e, p, decay);
            }
        }
    }
    /// [`Backend::cast`] on every pair (dst, src). Default: one call per pair.
    fn cast_all(&self, pairs: &mut [(&mut Self::Buf, &Self::Buf)]) {
        for (d, s) in pairs.iter_mut() {
            self.cast(d, s);
        }
    }
}

/// [`Backend::groupnorm_silu_backward_cat_in`] as its separate steps (the trait's default; an
/// override falls back to it where its fused path does not apply): the concatenation built into
/// `x`, the skip conv's weight gradient from it, the in-place GroupNorm+SiLU backward with act,
/// the skip conv's data gradient added, the split into the parts.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn cat_in_steps<B: Backend + ?Sized>(
    be: &B,
    d: &mut B::Buf,
    x: &mut B::Buf,
    (h, h_bias, s): (&B::Buf, Option<&B::Buf>, &B::Buf),
    parts: ((&mut B::Buf, Accum), (&mut B::Buf, Accum)),
    dgb: (&mut B::Buf, &mut B::Buf),
    ms: (&B::Buf, &B::Buf),
    gb: (&B::Buf, &B::Buf),
    (dout, _dsum, w, dw, cs): (&B::Buf, &B::Buf, &B::Buf, &mut B::Buf, ConvShape),
    (ca, cb): (usize, usize),
    groups: usize,
) {
    let xd = cs.x;
    be.concat_channels_bias(x, h, h_bias, s, xd, ca, cb);
    be.conv3d_backward(None, dw, None, dout, x, w, cs);
    be.groupnorm_silu_backward_inplace_act(d, x, dgb, ms, gb, xd, groups);
    be.conv3d_backward_data((&mut *d, Accum::Add), dout, w, cs);
    be.split_channels(parts.0, parts.1, d, xd, ca, cb);
}
