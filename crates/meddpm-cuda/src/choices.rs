//! The kernel choices of the CUDA backend in one place: which engine or fused path runs where more
//! than one can. Each is a field of [`KernelChoices`] with its default; the environment is read
//! once ([`KernelChoices::env`]), `CudaBackend::new` starts from that, and tests or benchmarks
//! change a backend's copy with `CudaBackend::set_choices`. `meddpm doctor` and `meddpm bench`
//! print the table ([`KernelChoices::table`]); bench records it in its JSON.
//!
//! | variable | field | default | what it chooses |
//! |---|---|---|---|
//! | `MEDDPM_GRAPHS=0` | `graphs` | on | capture `Backend::replay` bodies into CUDA graphs; off: every kernel launched by the host (profilers attribute each to its range) |
//! | `MEDDPM_WGMMA=0/1` | `wgmma` | timed | our wgmma kernels for the wide 3×3×3 convs (bf16 NDHWC, sm_90): forbid / force; unset: timed against cuDNN per shape |
//! | `MEDDPM_SMALL_CONV=0/1` | `small_conv` | timed | our few-channel conv kernels: forbid / force; unset: timed against cuDNN per shape |
//! | `MEDDPM_SMALL_MMA=0` | `small_mma` | on | the few-channel kernels' tensor-core forms (bf16) instead of their FMA forms |
//! | `MEDDPM_FUSED_BIAS=0/1` | `fused_bias` | timed | bias (and residual) in cuDNN's conv-bias-activation call: forbid / force |
//! | `MEDDPM_CONV_PAD=0/1` | `conv_pad` | timed | cuDNN forwards of Cin or Cout not a multiple of 4 on a zero-padded shape: forbid / force |
//! | `MEDDPM_CONV_LOG=1` | `conv_log` | off | print every timed choice with both times |
//! | `MEDDPM_CUDNN_WS_MIB` | `cudnn_ws_mib` | 2048 | the largest workspace `cudnnFind` tries (MiB; at most a quarter of the free memory) |
//!
//! The other fields (the fused paths `wgmma_gn`, `wgmma_reuse`, `wgmma_dual`, `wgmma_wgrad`,
//! `cat_free`, `conv_stats`, `skip_apply`, `res_fold`, `dgrad_gn`, `up_conv`, `fused_head`,
//! `small_gemm`) are on by default and read no variable: each was measured faster on the H200
//! when it landed, so only tests turn them off (to compare a fused path bit for bit with the
//! unfused calls).
//!
//! Configuration that chooses no kernel, read where it is used: `MEDDPM_CACHE_DIR` and
//! `MEDDPM_CUDNN_CACHE=0` (the on-disk cache of cuDNN algorithms, timed choices and compiled
//! kernels, `device::cache_dir`), `MEDDPM_NVRTC_VERBOSE=1` (NVRTC's log), `MEDDPM_NVTX=0` (no NVTX
//! injection), `MEDDPM_GPUS` / `MEDDPM_RDZV_PORT` (data-parallel launch) and `MEDDPM_FAULT_*`
//! (fault injection in tests).

use std::fmt::Write;

use serde::Serialize;

/// The kernel choices of one backend. The module header's table lists the variables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct KernelChoices {
    /// Capture `Backend::replay` bodies into CUDA graphs (`MEDDPM_GRAPHS=0`: off).
    pub graphs: bool,
    /// Some(true): every wide 3×3×3 stride-1 conv with Cin and Cout multiples of 64 (bf16 NDHWC,
    /// sm_90) through `conv3d_wgmma_*`; Some(false): through cuDNN; None: timed against cuDNN on
    /// first use of a shape, direction and accumulation (`MEDDPM_WGMMA=1/0`).
    pub wgmma: Option<bool>,
    /// Some(f): always (f = true) or never run our few-channel kernels where they apply (forward
    /// of Cin ≤ 4, forward and data gradient of Cout ≤ 4); None: time them against cuDNN on first
    /// use (`MEDDPM_SMALL_CONV=1/0`).
    pub small_conv: Option<bool>,
    /// bf16 only: the few-channel forward of Cin ≤ 8 and data gradient of Cout ≤ 4 on the tensor
    /// cores (`conv3d_fwd_small_cin_mma`, `conv3d_dgrad_small_cout_mma`) where the other side is
    /// a multiple of 8 up to 64, and the Cout = 1 and 4 weight gradients' stage 1
    /// (`conv3d_wgrad_small{1,4}_mma`) where Cin is a multiple of 16; false: the FMA kernels
    /// (`MEDDPM_SMALL_MMA=0`).
    pub small_mma: bool,
    /// Some(f): always (f = true) or never fuse the bias (and a residual) into cuDNN's
    /// conv-bias-activation call where the algorithm allows; None: time both on first use
    /// (`MEDDPM_FUSED_BIAS=1/0`).
    pub fused_bias: Option<bool>,
    /// Some(f): always (f = true) or never run a cuDNN forward whose Cin or Cout is not a multiple
    /// of 4 through the channel-padded shape; None: time both on first use (`MEDDPM_CONV_PAD=1/0`).
    pub conv_pad: Option<bool>,
    /// Print the timed choices (fused bias, few-channel kernels, channel padding, wgmma) with both
    /// times (`MEDDPM_CONV_LOG=1`).
    pub conv_log: bool,
    /// The largest workspace `cudnnFind` may try, MiB (default 2048; at most a quarter of the free
    /// memory is used); `MEDDPM_CUDNN_WS_MIB`.
    pub cudnn_ws_mib: usize,
    /// The ResBlocks' GroupNorm+SiLU → conv as `conv3d_wgmma_fwd_gn` where the conv runs on
    /// `conv3d_wgmma` (true), or the two calls.
    pub wgmma_gn: bool,
    /// `conv3d_wgmma_*` with 64 input channels load (and transform) each input plane once for the
    /// three output planes that read it (true), or once per output plane.
    pub wgmma_reuse: bool,
    /// Data gradients with a result of 128k channels on `conv3d_wgmma_dgrad2`, both 64-channel
    /// slices in one block on the same staged dy planes (true), or a block a slice
    /// (`conv3d_wgmma_dgrad`).
    pub wgmma_dual: bool,
    /// The weight gradients of the wide convs may run on `conv3d_wgmma_wgrad` (true: timed against
    /// cuDNN's as the other directions, or forced by `wgmma`), or never.
    pub wgmma_wgrad: bool,
    /// The decoder ResBlocks without their concatenation stored (the skip conv and the statistics
    /// from the parts, `cat_skip_stats_ndhwc`; in_layers' conv reading the parts) where in_layers'
    /// conv runs on `conv3d_wgmma_fwd_gn` (true), or the concatenation built.
    pub cat_free: bool,
    /// The GroupNorm statistics of a fused conv's output from its epilogue where the model asks
    /// (true: `Backend::fused_conv_out_stats`), or a statistics pass.
    pub conv_stats: bool,
    /// A decoder ResBlock's backward from the parts adds its skip conv's data gradient in the
    /// GroupNorm+SiLU backward's pass (`gn_bwd_apply_split_skip`, true) or runs it as GEMMs onto
    /// the parts after.
    pub skip_apply: bool,
    /// An identity-skip ResBlock's skip gradient rides in the GroupNorm+SiLU backward's pass
    /// (true: `Backend::groupnorm_silu_backward_act_res`, `gn_bwd_apply`'s res) or is an
    /// add_assign / copy pass before it.
    pub res_fold: bool,
    /// A ResBlock's conv data gradient, where our wgmma kernel runs it, also takes the following
    /// GroupNorm+SiLU backward's channel sums in its epilogue (true: `conv3d_wgmma_dgrad_gnb`,
    /// `Backend::conv3d_backward_data_gn`) or leaves them to the backward's own pass over dx.
    pub dgrad_gn: bool,
    /// The Upsample's conv, where our wgmma kernels run it, computes the trilinear doubling of its
    /// input in the forward's producer and writes it in the data gradient's (true:
    /// `conv3d_wgmma_fwd_up` / `_dgrad_up`) or reads it from an upsampling pass.
    pub up_conv: bool,
    /// The output head GN → SiLU → Conv3 (Cout ≤ 4, 64 bf16 channels, NDHWC, with `small_mma` in
    /// bf16) as one pass, `conv3d_fwd_gn_small_cout` (true), or GroupNorm+SiLU then the conv.
    pub fused_head: bool,
    /// The forward of Cout = 1 convs in NDHWC as a GEMM plus tap sum (`small_cout_gemm`, true)
    /// rather than the direct FMA kernel (on the H200 the whole-head output conv takes 0.35
    /// instead of 0.76 ms; BraTS' 64 → 4 conv gained nothing that way, so Cout 2–4 stay direct).
    pub small_gemm: bool,
    /// Bytes of tap products per slab of `small_cout_gemm` (64 MiB; tests make it small to run
    /// several slabs).
    pub small_gemm_budget: usize,
}

impl Default for KernelChoices {
    /// Every choice at its default, whatever the environment says.
    fn default() -> Self {
        KernelChoices {
            graphs: true,
            wgmma: None,
            small_conv: None,
            small_mma: true,
            fused_bias: None,
            conv_pad: None,
            conv_log: false,
            cudnn_ws_mib: 2048,
            wgmma_gn: true,
            wgmma_reuse: true,
            wgmma_dual: true,
            wgmma_wgrad: true,
            cat_free: true,
            conv_stats: true,
            skip_apply: true,
            res_fold: true,
            dgrad_gn: true,
            up_conv: true,
            fused_head: true,
            small_gemm: true,
            small_gemm_budget: 64 << 20,
        }
    }
}

impl KernelChoices {
    /// The defaults with the environment's variables applied, read once per process.
    pub fn env() -> KernelChoices {
        static ENV: std::sync::OnceLock<KernelChoices> = std::sync::OnceLock::new();
        *ENV.get_or_init(|| KernelChoices::from_vars(|name| std::env::var(name).ok()))
    }

    /// The defaults with the variables `var` gives applied (`var(name)`: the value, None when
    /// unset).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> KernelChoices {
        let d = KernelChoices::default();
        // "0" turns an on-by-default choice off; any other value leaves it on
        let on = |name: &str, default: bool| var(name).map_or(default, |v| v != "0");
        // "1" forces, "0" forbids, anything else or unset leaves it to timing
        let force = |name: &str| match var(name).as_deref() {
            Some("1") => Some(true),
            Some("0") => Some(false),
            _ => None,
        };
        KernelChoices {
            graphs: on("MEDDPM_GRAPHS", d.graphs),
            wgmma: force("MEDDPM_WGMMA"),
            small_conv: force("MEDDPM_SMALL_CONV"),
            small_mma: on("MEDDPM_SMALL_MMA", d.small_mma),
            // set to anything: "0" forbids, any other value forces
            fused_bias: var("MEDDPM_FUSED_BIAS").map(|v| v != "0"),
            conv_pad: var("MEDDPM_CONV_PAD").map(|v| v != "0"),
            conv_log: var("MEDDPM_CONV_LOG").is_some_and(|v| v != "0"),
            cudnn_ws_mib: var("MEDDPM_CUDNN_WS_MIB").and_then(|v| v.parse().ok()).unwrap_or(d.cudnn_ws_mib),
            ..d
        }
    }

    /// The choices as `name = value` lines, the variable that sets each beside it, and the
    /// fused paths (no variable) on one line when all are on. For `doctor` and `bench`.
    pub fn table(&self) -> String {
        fn tri(v: Option<bool>) -> &'static str {
            match v {
                None => "timed",
                Some(true) => "forced",
                Some(false) => "off",
            }
        }
        fn onoff(v: bool) -> &'static str {
            if v {
                "on"
            } else {
                "off"
            }
        }
        let mut s = String::new();
        let rows: [(&str, String, &str); 8] = [
            ("graphs", onoff(self.graphs).into(), "MEDDPM_GRAPHS"),
            ("wgmma", tri(self.wgmma).into(), "MEDDPM_WGMMA"),
            ("small_conv", tri(self.small_conv).into(), "MEDDPM_SMALL_CONV"),
            ("small_mma", onoff(self.small_mma).into(), "MEDDPM_SMALL_MMA"),
            ("fused_bias", tri(self.fused_bias).into(), "MEDDPM_FUSED_BIAS"),
            ("conv_pad", tri(self.conv_pad).into(), "MEDDPM_CONV_PAD"),
            ("conv_log", onoff(self.conv_log).into(), "MEDDPM_CONV_LOG"),
            ("cudnn_ws_mib", self.cudnn_ws_mib.to_string(), "MEDDPM_CUDNN_WS_MIB"),
        ];
        for (name, value, var) in rows {
            let _ = writeln!(s, "  {name:13} {value:7} ({var})");
        }
        let fused = [
            ("wgmma_gn", self.wgmma_gn),
            ("wgmma_reuse", self.wgmma_reuse),
            ("wgmma_dual", self.wgmma_dual),
            ("wgmma_wgrad", self.wgmma_wgrad),
            ("cat_free", self.cat_free),
            ("conv_stats", self.conv_stats),
            ("skip_apply", self.skip_apply),
            ("res_fold", self.res_fold),
            ("dgrad_gn", self.dgrad_gn),
            ("up_conv", self.up_conv),
            ("fused_head", self.fused_head),
            ("small_gemm", self.small_gemm),
        ];
        let off: Vec<&str> = fused.iter().filter(|(_, on)| !on).map(|(n, _)| *n).collect();
        if off.is_empty() {
            let _ = writeln!(s, "  fused paths   all on");
        } else {
            let _ = writeln!(s, "  fused paths   off: {}", off.join(", "));
        }
        s
    }
}

/// How often each of our kernel paths ran, first-use timing runs aside: the tests prove with it
/// that a path ran (or did not) under a choice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PathRuns {
    /// Convolutions (forward or data gradient) `conv3d_wgmma_*` computed.
    pub wgmma: u64,
    /// Of `wgmma`, those with the GroupNorm+SiLU prologue (`conv3d_wgmma_fwd_gn`).
    pub wgmma_gn: u64,
    /// Of `wgmma`, the data gradients `conv3d_wgmma_dgrad2` computed.
    pub wgmma_dual: u64,
    /// Weight gradients `conv3d_wgmma_wgrad` computed.
    pub wgmma_wgrad: u64,
    /// Calls of `cat_skip_stats_ndhwc` (a decoder ResBlock's skip conv and statistics from the
    /// concatenation's parts).
    pub cat_free: u64,
    /// `conv3d_wgmma_fwd_gn` calls that took their output's GroupNorm statistics.
    pub conv_stats: u64,
    /// Calls of `gn_bwd_apply_split_skip`.
    pub skip_apply: u64,
    /// Backward passes that took an identity skip's gradient in.
    pub res_fold: u64,
    /// Data gradients that took the GroupNorm backward's sums (`conv3d_wgmma_dgrad_gnb`).
    pub dgrad_gn: u64,
    /// Calls of `conv3d_wgmma_fwd_up` and `conv3d_wgmma_dgrad_up`.
    pub up_conv: u64,
}

impl std::fmt::Display for KernelChoices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.table())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> KernelChoices {
        KernelChoices::from_vars(|n| vars.iter().find(|(k, _)| *k == n).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn the_variables_parse_as_they_always_have() {
        assert_eq!(with(&[]), KernelChoices::default());
        let c = with(&[("MEDDPM_GRAPHS", "0"), ("MEDDPM_SMALL_MMA", "0"), ("MEDDPM_CONV_LOG", "1")]);
        assert!(!c.graphs && !c.small_mma && c.conv_log);
        // the forcing switches: 1 forces, 0 forbids, anything else times
        for (v, want) in [("1", Some(true)), ("0", Some(false)), ("auto", None)] {
            let c = with(&[("MEDDPM_WGMMA", v), ("MEDDPM_SMALL_CONV", v)]);
            assert_eq!((c.wgmma, c.small_conv), (want, want), "{v}");
        }
        // the cuDNN-side switches: set to anything but 0 forces
        let c = with(&[("MEDDPM_FUSED_BIAS", "yes"), ("MEDDPM_CONV_PAD", "0")]);
        assert_eq!((c.fused_bias, c.conv_pad), (Some(true), Some(false)));
        assert_eq!(with(&[("MEDDPM_CUDNN_WS_MIB", "512")]).cudnn_ws_mib, 512);
        assert_eq!(with(&[("MEDDPM_CUDNN_WS_MIB", "lots")]).cudnn_ws_mib, 2048);
        // settled switches read nothing any more
        assert!(with(&[("MEDDPM_WGMMA_GN", "0"), ("MEDDPM_CAT_FREE", "0")]).wgmma_gn);
    }

    #[test]
    fn the_table_names_every_variable_and_the_fused_paths_turned_off() {
        let t = KernelChoices::default().table();
        for v in ["MEDDPM_GRAPHS", "MEDDPM_WGMMA", "MEDDPM_SMALL_CONV", "MEDDPM_CUDNN_WS_MIB"] {
            assert!(t.contains(v), "{t}");
        }
        assert!(t.contains("all on"), "{t}");
        let t = KernelChoices { res_fold: false, up_conv: false, ..Default::default() }.table();
        assert!(t.contains("off: res_fold, up_conv"), "{t}");
    }
}
