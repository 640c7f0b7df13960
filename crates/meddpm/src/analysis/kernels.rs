//! Per-kernel records and the kernel-name → category classifier.
//!
//! A [`KernelRecord`] is one executed GPU kernel (from CUPTI's activity API), one memcpy/memset,
//! or one backend call timed on the CPU (see [`super::timed`]). Every record gets a [`Category`]
//! from its name, so GPU timelines, Nsight Compute exports and CPU per-op timings all land in the
//! same breakdown. The categories are the paper's runtime-breakdown axes (issue 4); the name rules
//! follow `../shared/docs/peers.md` §D.3/§D.4 (cuDNN xmma/implicit-GEMM names, cuDNN layout
//! transforms, PyTorch's GroupNorm kernels) plus the names of our own NVRTC kernels
//! (`groupnorm_*`, `silu_*`, `conv3d_*`, `adam_*`, …). The exact names of the NVRTC kernels that
//! `meddpm-cuda` compiles are looked up in [`OUR_KERNELS`] before any name heuristic, so each of
//! them has a category decided by hand.
//!
//! Names may arrive mangled (`_Z…`, CUPTI), demangled (`void cudnn::…<…>(…)`, ncu) or truncated
//! (profiler tables cut them at ~100 characters, which breaks demangling): classification works
//! on any of these, so a truncated mangled name still finds its category.

use serde::{Deserialize, Serialize};

/// What a kernel does, at the granularity of the paper's runtime breakdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// Convolution forward (fprop): cuDNN implicit-GEMM, FFT, our `conv3d_fwd*`.
    ConvForward,
    /// Convolution data gradient (dgrad): ∂L/∂input.
    ConvDgrad,
    /// Convolution weight gradient (wgrad): ∂L/∂weights (and bias).
    ConvWgrad,
    /// A convolution backward done as one call that computes dgrad and wgrad together (the CPU
    /// reference backend's `conv3d_backward`); GPU kernels are always dgrad or wgrad.
    ConvBackward,
    /// Layout and format conversion: cuDNN `nchwToNhwc` / `nhwcToNchw`, transposes, dtype converts.
    Layout,
    /// GroupNorm and other normalisations (statistics, apply, backward).
    Normalization,
    /// Elementwise: activations, adds, scales, copies into concatenations, resampling, RNG.
    Elementwise,
    /// Matrix products: linear layers, attention QKᵀ/AV and softmax, cuBLAS/cutlass GEMMs.
    GemmAttention,
    /// Reductions: sums over axes, losses.
    Reduction,
    /// Optimiser and EMA updates.
    Optimizer,
    /// Memory copies and fills (host↔device, device↔device, memset).
    Memory,
    /// Collectives between GPUs: NCCL's kernels (`ncclDevKernel_AllReduce_Sum_f32_RING_LL`,
    /// `ncclKernel_…`), the data-parallel gradient all-reduce and broadcasts.
    Collective,
    /// Anything unrecognised.
    Other,
}

impl Category {
    /// Every category, in report order.
    pub const ALL: [Category; 13] = [
        Category::ConvForward,
        Category::ConvDgrad,
        Category::ConvWgrad,
        Category::ConvBackward,
        Category::Layout,
        Category::Normalization,
        Category::Elementwise,
        Category::GemmAttention,
        Category::Reduction,
        Category::Optimizer,
        Category::Memory,
        Category::Collective,
        Category::Other,
    ];

    /// Short label for tables and charts.
    pub fn label(self) -> &'static str {
        match self {
            Category::ConvForward => "conv forward",
            Category::ConvDgrad => "conv dgrad",
            Category::ConvWgrad => "conv wgrad",
            Category::ConvBackward => "conv backward (dgrad+wgrad)",
            Category::Layout => "layout conversion",
            Category::Normalization => "normalization",
            Category::Elementwise => "elementwise",
            Category::GemmAttention => "GEMM/attention",
            Category::Reduction => "reduction",
            Category::Optimizer => "optimizer",
            Category::Memory => "memcpy/memset",
            Category::Collective => "NCCL collective",
            Category::Other => "other",
        }
    }

    /// Convolutions and GEMMs run on tensor cores when the math mode allows it.
    pub fn is_matmul(self) -> bool {
        matches!(
            self,
            Category::ConvForward
                | Category::ConvDgrad
                | Category::ConvWgrad
                | Category::ConvBackward
                | Category::GemmAttention
        )
    }
}

impl std::fmt::Display for Category {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// Demangle an Itanium C++ name (`_Z…`); anything else (already demangled, plain `extern "C"`
/// names of NVRTC kernels, truncated names that do not parse) comes back unchanged.
pub fn demangle(name: &str) -> String {
    if !name.starts_with("_Z") {
        return name.to_string();
    }
    let opts = cpp_demangle::DemangleOptions::default();
    match cpp_demangle::Symbol::new(name.as_bytes()).ok().and_then(|s| s.demangle(&opts).ok()) {
        Some(d) => d,
        None => name.to_string(),
    }
}

/// A readable short form of a (demangled) kernel name: no leading `void `, no argument list, at
/// most `max` characters (an ellipsis marks the cut).
pub fn short_name(name: &str, max: usize) -> String {
    let mut s = name.trim();
    s = s.strip_prefix("void ").unwrap_or(s);
    // cut the argument list: the first '(' at template depth 0 that is not "(anonymous namespace)"
    let mut depth = 0i32;
    let b = s.as_bytes();
    let mut cut = s.len();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'<' => depth += 1,
            b'>' => depth -= 1,
            b'(' if depth <= 0 => {
                if s[i..].starts_with("(anonymous namespace)") {
                    i += "(anonymous namespace)".len();
                    continue;
                }
                if i > 0 {
                    cut = i;
                    break;
                }
            }
            _ => {}
        }
        i += 1;
    }
    let s = &s[..cut];
    if s.chars().count() <= max {
        s.to_string()
    } else {
        let t: String = s.chars().take(max.saturating_sub(1)).collect();
        format!("{t}…")
    }
}

/// Our own NVRTC kernels, by exact name, with the category each belongs to: the one list of them.
/// `meddpm-cuda` loads exactly these names from its compiled modules (`Device::new`), and its tests
/// check that every `extern "C" __global__` kernel in `kernels/*.cu` is here and every name here
/// occurs in the sources, so a kernel can be neither forgotten nor stale. [`classify`] consults this table before any heuristic: several of these names
/// (`chan_sum_finalize`, `gn_bwd_apply4`, `chan_gnbwd_*`, `chan_stats_*`) match no pattern.
///
/// - `chan_stats_*` (GroupNorm per-channel statistics), `chan_gnbwd_*` (GroupNorm backward
///   per-channel sums), `gn_*`: normalization;
/// - `chan_sum_*` (channel sums: the convolution bias gradient) and `rows_sum_accum`: reduction;
/// - `pad_nc`, `unpad_c_bias` (channel padding for the tensor-core layouts): layout conversion;
/// - `softmax_*` (attention) and `linear_rows_*` (the time embedding's Linears, bias included):
///   GEMM/attention;
/// - `loss_partial`, `loss_final`: reduction; `loss_bwd`: elementwise;
/// - activations, adds, scales, concat/split (`concat_stats_ndhwc`, the concatenation that also
///   takes its GroupNorm statistics, too), upsampling, RNG and the diffusion update: elementwise;
/// - `adam_step`, `ema_update`: optimizer.
pub const OUR_KERNELS: &[(&str, Category)] = &[
    ("chan_stats_ncdhw", Category::Normalization),
    ("chan_stats_ndhwc1", Category::Normalization),
    ("chan_stats_ndhwc4", Category::Normalization),
    ("chan_stats_ndhwc8", Category::Normalization),
    ("chan_gnbwd_ncdhw", Category::Normalization),
    ("chan_gnbwd_ndhwc1", Category::Normalization),
    ("chan_gnbwd_ndhwc4", Category::Normalization),
    ("chan_gnbwd_ndhwc8", Category::Normalization),
    ("chan_gnbwd3_ndhwc1", Category::Normalization),
    ("chan_gnbwd3_ndhwc4", Category::Normalization),
    ("chan_gnbwd3_ndhwc8", Category::Normalization),
    ("chan_gnbwd_cat_ndhwc4", Category::Normalization),
    ("chan_gnbwd_cat_ndhwc8", Category::Normalization),
    ("concat_stats_ndhwc", Category::Elementwise),
    ("chan_sum_ncdhw", Category::Reduction),
    ("chan_sum_ndhwc1", Category::Reduction),
    ("chan_sum_ndhwc4", Category::Reduction),
    ("chan_sum_ndhwc8", Category::Reduction),
    ("chan_sum_finalize", Category::Reduction),
    ("gn_stats_finalize", Category::Normalization),
    ("gn_apply", Category::Normalization),
    ("gn_bwd_finalize", Category::Normalization),
    ("gn_bwd_apply", Category::Normalization),
    ("gn_bwd_apply_split", Category::Normalization),
    ("silu_fwd", Category::Elementwise),
    ("silu_bwd", Category::Elementwise),
    ("add_assign", Category::Elementwise),
    ("scale_buf", Category::Elementwise),
    ("add_channel_bias", Category::Elementwise),
    ("concat_channels", Category::Elementwise),
    ("rank1_add", Category::ConvWgrad),
    ("split_channels", Category::Elementwise),
    ("pad_nc", Category::Layout),
    ("unpad_c_bias", Category::Layout),
    ("rows_sum_accum", Category::Reduction),
    ("linear_rows_fwd", Category::GemmAttention),
    ("linear_rows_bwd", Category::GemmAttention),
    ("softmax_rows", Category::GemmAttention),
    ("softmax_bwd_rows", Category::GemmAttention),
    ("softmax_rows4", Category::GemmAttention),
    ("softmax_bwd_rows4", Category::GemmAttention),
    ("upsample_fwd", Category::Elementwise),
    ("upsample_bwd", Category::Elementwise),
    ("upsample_fwd_cl", Category::Elementwise),
    ("upsample_bwd_cl", Category::Elementwise),
    ("upsample_fwd_quad", Category::Elementwise),
    ("upsample_bwd_rows", Category::Elementwise),
    ("loss_partial", Category::Reduction),
    ("loss_final", Category::Reduction),
    ("loss_bwd", Category::Elementwise),
    ("randn", Category::Elementwise),
    ("q_sample", Category::Elementwise),
    ("q_sample_input", Category::Elementwise),
    ("ddpm_step", Category::Elementwise),
    ("sampler_step", Category::Elementwise),
    ("adam_step", Category::Optimizer),
    ("ema_update", Category::Optimizer),
    ("adam_multi", Category::Optimizer),
    ("ema_multi", Category::Optimizer),
    ("cast_multi", Category::Layout),
    ("add_multi", Category::Elementwise),
    ("cast_buf", Category::Layout),
    ("conv3d_wgrad_small1", Category::ConvWgrad),
    ("conv3d_wgrad_small2", Category::ConvWgrad),
    ("conv3d_wgrad_small3", Category::ConvWgrad),
    ("conv3d_wgrad_small4", Category::ConvWgrad),
    ("conv3d_wgrad_small_finalize", Category::ConvWgrad),
    ("conv3d_fwd_small_cin", Category::ConvForward),
    ("conv3d_fwd_small_cout1", Category::ConvForward),
    ("conv3d_small_cout_taps", Category::ConvForward),
    ("conv3d_fwd_small_cout4", Category::ConvForward),
    ("conv3d_dgrad_small_cout", Category::ConvDgrad),
    ("conv3d_fwd_small_cin_mma", Category::ConvForward),
    ("conv3d_dgrad_small_cout_mma", Category::ConvDgrad),
    ("conv3d_wgrad_small1_mma", Category::ConvWgrad),
    ("conv3d_wgrad_small4_mma", Category::ConvWgrad),
    ("conv3d_wgrad_small_cin_mma", Category::ConvWgrad),
    ("conv3d_small_cout_wfrag", Category::ConvForward),
    ("conv3d_fwd_small_cout_mma", Category::ConvForward),
    ("conv3d_fwd_gn_small_cout", Category::ConvForward),
    ("conv3d_wgmma_fwd", Category::ConvForward),
    ("conv3d_wgmma_fwd_gn", Category::ConvForward),
    ("conv3d_wgmma_fwd_up", Category::ConvForward),
    ("conv3d_wgmma_wgrad", Category::ConvWgrad),
    ("conv3d_wgmma_wgrad_tf32", Category::ConvWgrad),
    ("conv3d_wgmma_wgrad_sum", Category::ConvWgrad),
    ("cat_skip_stats_ndhwc", Category::ConvForward),
    ("gn_bwd_apply_split_skip", Category::Normalization),
    ("conv3d_wgmma_dgrad", Category::ConvDgrad),
    ("conv3d_wgmma_dgrad2", Category::ConvDgrad),
    ("conv3d_wgmma_dgrad_gnb", Category::ConvDgrad),
    ("conv3d_wgmma_dgrad_up", Category::ConvDgrad),
    ("conv3d_wgmma_pack", Category::Layout),
];

/// The category of one of our own NVRTC kernels, by exact name ([`OUR_KERNELS`]); `None` for any
/// other name.
pub fn our_kernel(name: &str) -> Option<Category> {
    let n = name.trim();
    OUR_KERNELS.iter().find(|(k, _)| *k == n).map(|&(_, c)| c)
}

fn has(s: &str, pats: &[&str]) -> bool {
    pats.iter().any(|p| s.contains(p))
}

/// The category of a kernel from its name (mangled, demangled or truncated; case-insensitive).
///
/// Our own NVRTC kernels are looked up by exact name first ([`OUR_KERNELS`]). Then order matters: memory operations and layout transforms first (cuDNN transform kernels carry
/// conv-like template arguments), then the convolution directions (xmma conv kernels contain
/// "gemm"), then normalisation (PyTorch's GroupNorm apply is an elementwise kernel whose lambda
/// names the group norm), optimiser, GEMM/attention, reductions, and elementwise last.
pub fn classify(name: &str) -> Category {
    if let Some(c) = our_kernel(name) {
        return c;
    }
    let s = name.to_ascii_lowercase();
    let s = s.trim();
    // NCCL's kernels first: their names carry reduction and copy words ("allreduce", "sum")
    if s.contains("nccl") {
        return Category::Collective;
    }
    if s.starts_with("memcpy")
        || s.starts_with("memset")
        || has(s, &["cudamemcpy", "cudamemset", "[cuda memcpy", "[cuda memset"])
    {
        return Category::Memory;
    }
    if has(
        s,
        &[
            "nchwtonhwc",
            "nhwctonchw",
            "nchw2nhwc",
            "nhwc2nchw",
            "generictranspose",
            "tensortransformgeneric",
            "converttensor",
            "transpose",
            "ncdhw_to_ndhwc",
            "ndhwc_to_ncdhw",
            "to_channels_last",
            "permute",
        ],
    ) {
        return Category::Layout;
    }
    // Convolutions. "wgrad"/"dgrad" name the direction in cuDNN (xmma, cutlass, legacy engines)
    // and in our own kernels (conv3d_wgrad*, conv3d_dgrad*).
    let conv_like =
        has(s, &["conv", "xmma", "implicit_gemm", "scudnn", "cudnn", "fft", "winograd", "im2col", "col2im"]);
    if has(s, &["wgrad", "weight_grad", "conv3d_bwd_w", "conv_bwd_filter", "bwd_filter"]) {
        return Category::ConvWgrad;
    }
    if has(s, &["dgrad", "data_grad", "conv3d_bwd_d", "conv_bwd_data", "bwd_data", "backward_data", "col2im"]) {
        return Category::ConvDgrad;
    }
    if has(
        s,
        &[
            "fprop",
            "implicit_convolve",
            "convolve_common",
            "conv3d_fwd",
            "conv3d_forward",
            "conv2d_fwd",
            "convolutionforward",
            "implicit_gemm",
            "fft3d_",
            "fft2d_",
            "winograd",
            "im2col",
            "conv3d",
        ],
    ) || (conv_like && s.contains("conv") && !s.contains("convert"))
    {
        return Category::ConvForward;
    }
    if has(
        s,
        &[
            "groupnorm",
            "group_norm",
            "layernorm",
            "layer_norm",
            "batchnorm",
            "batch_norm",
            "instancenorm",
            "instance_norm",
            "rmsnorm",
            "rowwisemoments",
            "computeinternalgradients",
            "computefusedparams",
            "computebackwardfusedparams",
            "gammabeta",
            "welford",
            "gn_stats",
            "gn_apply",
        ],
    ) {
        return Category::Normalization;
    }
    if has(s, &["adam", "ema_", "_ema", "sgd", "optimizer", "multi_tensor_apply"]) {
        return Category::Optimizer;
    }
    // resampling before GEMM: "trilinear" contains "linear"
    if has(s, &["upsample", "interpolate", "trilinear"]) {
        return Category::Elementwise;
    }
    if has(
        s,
        &[
            "gemm",
            "gemv",
            "nvjet",
            "cublas",
            "cutlass",
            "matmul",
            "splitkreduce",
            "region_transform_abc",
            "softmax",
            "attention",
            "attn_",
            "linear_",
            "_linear",
            "bmm",
        ],
    ) {
        return Category::GemmAttention;
    }
    if has(s, &["loss_"]) && !has(s, &["backward", "bwd", "grad"]) {
        return Category::Reduction;
    }
    if has(
        s,
        &[
            "reduce",
            "reduction",
            "channel_sum",
            "bias_grad_rows",
            "row_sum",
            "col_sum",
            "devicesegmentedreduce",
            "sum_kernel",
            "mean_kernel",
            "norm_kernel",
        ],
    ) {
        return Category::Reduction;
    }
    if has(
        s,
        &[
            "elementwise",
            "silu",
            "sigmoid",
            "relu",
            "gelu",
            "upsample",
            "interpolate",
            "trilinear",
            "concat",
            "catarray",
            "split_",
            "add_",
            "_add",
            "scale_",
            "mul_",
            "axpy",
            "fill",
            "copy",
            "randn",
            "philox",
            "curand",
            "distribution",
            "q_sample",
            "ddpm_step",
            "loss_",
            "clamp",
            "where",
        ],
    ) {
        return Category::Elementwise;
    }
    Category::Other
}

/// One executed kernel (or memcpy/memset, or timed CPU backend call).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelRecord {
    /// Demangled name (CUPTI's name is mangled; CPU records carry the backend op name).
    pub name: String,
    /// Wall time: CUPTI end − start, or the CPU call time between two `sync()`s.
    pub duration_ns: u64,
    /// GPU start timestamp, ns, arbitrary origin (CUPTI's clock): `None` for CPU-timed calls, ncu
    /// and PyTorch-table records. When every record of a pass has one, the breakdown measures the
    /// GPU's idle time between kernels ([`super::breakdown::Idle`]).
    #[serde(default)]
    pub start_ns: Option<u64>,
    /// Launch grid (blocks), where there is one.
    pub grid: Option<[u32; 3]>,
    /// Launch block (threads), where there is one.
    pub block: Option<[u32; 3]>,
    /// Registers per thread.
    pub registers: Option<u32>,
    /// Static + dynamic shared memory per block, bytes.
    pub shared_mem: Option<u32>,
    /// NVTX range path the kernel ran in, outermost first, joined by `/`: by convention
    /// `pass/phase/block` — the pass the profiler opened (`train`, `sample`), the U-Net's
    /// `forward`/`backward` or the profiler's `optimizer`, then the U-Net block
    /// (`input_blocks.1.0`, `time_embed`); e.g. `train/backward/middle_block.1`. `None` outside
    /// any range.
    pub range: Option<String>,
    pub category: Category,
    /// Floating-point operations the kernel does by our count (a multiply-add is 2), if known.
    pub flops: Option<f64>,
    /// Minimum DRAM traffic by our count (every input read once, every output written once), bytes.
    pub bytes: Option<f64>,
}

impl KernelRecord {
    /// A record from a raw (possibly mangled) name: demangled and classified.
    pub fn new(raw_name: &str, duration_ns: u64) -> Self {
        // a name that does not demangle (truncated) stays mangled; classify handles both forms
        let name = demangle(raw_name);
        let category = classify(&name);
        KernelRecord {
            name,
            duration_ns,
            start_ns: None,
            grid: None,
            block: None,
            registers: None,
            shared_mem: None,
            range: None,
            category,
            flops: None,
            bytes: None,
        }
    }

    /// The range path without its block: `train/forward`, `train/optimizer`, `sample`.
    pub fn phase(&self) -> Option<String> {
        let r = self.range.as_deref().filter(|r| !r.is_empty())?;
        Some(r.split('/').take(2).collect::<Vec<_>>().join("/"))
    }

    /// The U-Net block: the range path below `pass/phase`, if any.
    pub fn block_name(&self) -> Option<&str> {
        let r = self.range.as_deref()?;
        let mut it = r.splitn(3, '/');
        it.next()?;
        it.next()?;
        it.next()
    }

    /// Threads launched (grid × block), where known.
    pub fn threads(&self) -> Option<u64> {
        let g = self.grid?;
        let b = self.block?;
        Some(g.iter().chain(b.iter()).map(|&v| v as u64).product())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_names_drop_arguments_but_keep_anonymous_namespaces() {
        assert_eq!(
            short_name(
                "void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float>(long, float, float const*)",
                200
            ),
            "at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float>"
        );
        assert_eq!(short_name("groupnorm_stats", 200), "groupnorm_stats");
        assert_eq!(short_name("abcdefgh", 5), "abcd…");
    }

    #[test]
    fn range_parts() {
        let mut r = KernelRecord::new("silu_fwd", 10);
        assert_eq!((r.phase(), r.block_name()), (None, None));
        r.range = Some("sample".into());
        assert_eq!((r.phase().as_deref(), r.block_name()), (Some("sample"), None));
        r.range = Some("train/optimizer".into());
        assert_eq!((r.phase().as_deref(), r.block_name()), (Some("train/optimizer"), None));
        r.range = Some("train/forward/input_blocks.1.0".into());
        assert_eq!((r.phase().as_deref(), r.block_name()), (Some("train/forward"), Some("input_blocks.1.0")));
    }
}
