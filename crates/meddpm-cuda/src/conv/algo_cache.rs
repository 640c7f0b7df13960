//! `ConvCache`: a backend's convolution state. cuDNN plans per shape, algorithms chosen by
//! `cudnnFind*AlgorithmEx` (timed on the real buffers) once per shape and kept in a per-backend
//! map and in an on-disk cache per GPU and cuDNN version (`device::cache_dir`: `$MEDDPM_CACHE_DIR`,
//! else `$XDG_CACHE_HOME/meddpm`, else `~/.cache/meddpm`; `MEDDPM_CUDNN_CACHE=0` disables it).
//! The workspace grows to the chosen algorithm's need. The timed choices between our kernels and
//! cuDNN per shape are kept in the same file (keyed by a hash of our kernels' sources), so every
//! later process runs the same kernels. It also holds the kernel-choice switches and the run
//! counters the tests read.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;

use cudarc::cudnn::sys as nsys;
use meddpm::{ConvShape, Layout, Precision};

use super::desc::{
    bias_desc, bwd_data_algo, bwd_filter_algo, ck, compute_type, conv_desc, filter_desc, fwd_algo, identity_desc, idx,
    math_of, tensor_desc, ActDesc, Algo, Dir, Plan,
};
use crate::buf::GpuBuf;
use crate::device::{cache_dir, cudnn_ck, Device};

/// A kernel choice forced by the environment variable `name`: "1" forces it (Some(true)), "0"
/// forbids it (Some(false)), anything else or unset leaves it to timing (None).
fn env_force(name: &str) -> Option<bool> {
    match std::env::var(name).as_deref() {
        Ok("1") => Some(true),
        Ok("0") => Some(false),
        _ => None,
    }
}

/// Largest workspace `cudnnFind` may try (bytes, default 2 GiB, at most a quarter of the free
/// memory); `MEDDPM_CUDNN_WS_MIB` overrides.
fn find_ws_limit() -> usize {
    std::env::var("MEDDPM_CUDNN_WS_MIB").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(2048) << 20
}

/// Per-backend convolution state: plans per shape and the on-disk algorithm cache.
pub(crate) struct ConvCache {
    pub(super) layout: Layout,
    pub(super) precision: Precision,
    pub(super) plans: HashMap<ConvShape, Plan>,
    /// Forward calls per shape since the last reset (for per-layer benchmarks).
    pub(crate) fwd_calls: HashMap<ConvShape, u64>,
    /// Some(f): always (f = true) or never fuse the bias into cuDNN where possible; None: time it.
    pub(crate) force_fused_bias: Option<bool>,
    /// Some(f): always (f = true) or never run Cin/Cout not divisible by 4 through the
    /// channel-padded shape; None: time both on first use.
    pub(crate) force_pad: Option<bool>,
    /// Channel-padded forward state per original shape.
    pub(super) pads: HashMap<ConvShape, Pad>,
    /// Some(f): always (f = true) or never run our few-channel kernels where they apply
    /// (`small_fwd_kind`, `small_dgrad`; the default is Some(true)); None: time them against
    /// cuDNN on first use.
    pub(crate) force_small: Option<bool>,
    /// bf16 only: the few-channel forward of Cin ≤ 8 and data gradient of Cout ≤ 4 on the tensor
    /// cores (`conv3d_fwd_small_cin_mma`, `conv3d_dgrad_small_cout_mma`) where the other side is
    /// a multiple of 8 up to 64, and the Cout = 1 and 4 weight gradients' stage 1
    /// (`conv3d_wgrad_small{1,4}_mma`) where Cin is a multiple of 16; false: the FMA kernels
    /// (`MEDDPM_SMALL_MMA=0`, A/B benchmarks).
    pub(crate) small_mma: bool,
    /// The output head GN → SiLU → Conv3 (Cout ≤ 4, 64 bf16 channels, NDHWC, with `small_mma` in
    /// bf16) as one pass, `conv3d_fwd_gn_small_cout` (true, the default), or GroupNorm+SiLU then
    /// the conv (`MEDDPM_FUSED_HEAD=0`, A/B benchmarks).
    pub(crate) fused_head: bool,
    /// The forward of Cout = 1 convs in NDHWC as a GEMM plus tap sum (`small_cout_gemm`, the
    /// default) rather than the direct FMA kernel (`MEDDPM_SMALL_GEMM=0`, A/B benchmarks). On the
    /// H200 the whole-head output conv takes 0.35 instead of 0.76 ms; BraTS' 64 → 4 conv gained
    /// nothing that way (58.75–59.10 vs 58.72 ms per forward, +0.12 GiB), so Cout 2–4 stay direct.
    pub(crate) small_gemm: bool,
    /// Bytes of tap products per slab of `small_cout_gemm` (64 MiB; tests make it small to run
    /// several slabs).
    pub(crate) small_gemm_budget: usize,
    /// Some(f): always (f = true) or never run the wide 3×3×3 convs (Cin, Cout multiples of 64,
    /// bf16 NDHWC, sm_90) through `conv3d_wgmma_*` (`wgmma.rs`); None (the default): time them
    /// against cuDNN on first use of a shape and direction. `MEDDPM_WGMMA=0/1`.
    pub(crate) force_wgmma: Option<bool>,
    /// Per (shape, direction, accumulated): whether `conv3d_wgmma_*` timed faster than cuDNN.
    pub(super) wgmma: HashMap<(ConvShape, Dir, bool, bool), bool>,
    /// Convolutions (forward or data gradient) `conv3d_wgmma_*` computed, timing runs aside (tests).
    pub(crate) wgmma_runs: u64,
    /// The ResBlocks' GroupNorm+SiLU → conv as `conv3d_wgmma_fwd_gn` where the conv runs on
    /// `conv3d_wgmma` (true, the default), or the two calls (`MEDDPM_WGMMA_GN=0`, A/B benchmarks).
    pub(crate) wgmma_gn: bool,
    /// Of `wgmma_runs`, those with the GroupNorm+SiLU prologue (tests).
    pub(crate) wgmma_gn_runs: u64,
    /// `conv3d_wgmma_*` with 64 input channels load (and transform) each input plane once for the
    /// three output planes that read it (true, the default), or once per output plane
    /// (`MEDDPM_WGMMA_REUSE=0`, A/B benchmarks).
    pub(crate) wgmma_reuse: bool,
    /// Data gradients with a result of 128k channels on `conv3d_wgmma_dgrad2`, both 64-channel
    /// slices in one block on the same staged dy planes (true, the default), or a block a slice
    /// (`conv3d_wgmma_dgrad`; `MEDDPM_WGMMA_DUAL=0`, A/B benchmarks).
    pub(crate) wgmma_dual: bool,
    /// Of `wgmma_runs`, the data gradients `conv3d_wgmma_dgrad2` computed (tests).
    pub(crate) wgmma_dual_runs: u64,
    /// The weight gradients of the wide convs may run on `conv3d_wgmma_wgrad` (true, the default:
    /// timed against cuDNN's as the other directions, or forced by `force_wgmma`), or never
    /// (`MEDDPM_WGMMA_WGRAD=0`, A/B benchmarks).
    pub(crate) wgmma_wgrad: bool,
    /// Weight gradients `conv3d_wgmma_wgrad` computed, timing runs aside (tests).
    pub(crate) wgmma_wgrad_runs: u64,
    /// The decoder ResBlocks without their concatenation stored (the skip conv and the
    /// statistics from the parts, `cat_skip_stats_ndhwc`; in_layers' conv reading the parts)
    /// where in_layers' conv runs on `conv3d_wgmma_fwd_gn` (true, the default), or the
    /// concatenation built (`MEDDPM_CAT_FREE=0`, A/B benchmarks).
    pub(crate) cat_free: bool,
    /// Calls of `cat_skip_stats_ndhwc` (tests).
    pub(crate) cat_free_runs: u64,
    /// The GroupNorm statistics of a fused conv's output from its epilogue where the model asks
    /// (true, the default: `Backend::fused_conv_out_stats`), or a statistics pass
    /// (`MEDDPM_CONV_STATS=0`, A/B benchmarks and the bit-for-bit tests).
    pub(crate) conv_stats: bool,
    /// `conv3d_wgmma_fwd_gn` calls that took their output's statistics (tests).
    pub(crate) wgmma_ystats_runs: u64,
    /// A decoder ResBlock's backward from the parts adds its skip conv's data gradient in the
    /// GroupNorm+SiLU backward's pass (`gn_bwd_apply_split_skip`, true, the default) or runs it as
    /// GEMMs onto the parts after (`MEDDPM_SKIP_APPLY=0`, A/B benchmarks).
    pub(crate) skip_apply: bool,
    /// Calls of `gn_bwd_apply_split_skip` (tests).
    pub(crate) skip_apply_runs: u64,
    /// An identity-skip ResBlock's skip gradient rides in the GroupNorm+SiLU backward's pass
    /// (true, the default: `Backend::groupnorm_silu_backward_act_res`, `gn_bwd_apply`'s res) or is
    /// an add_assign / copy pass before it (`MEDDPM_RES_FOLD=0`, A/B benchmarks and tests).
    pub(crate) res_fold: bool,
    /// Backward passes that took the skip gradient in (tests).
    pub(crate) res_fold_runs: u64,
    /// A ResBlock's conv data gradient, where our wgmma kernel runs it, also takes the following
    /// GroupNorm+SiLU backward's channel sums in its epilogue (true, the default:
    /// `conv3d_wgmma_dgrad_gnb`, `Backend::conv3d_backward_data_gn`) or leaves them to the
    /// backward's own pass over dx (`MEDDPM_DGRAD_GN=0`, A/B benchmarks and tests).
    pub(crate) dgrad_gn: bool,
    /// Data gradients that took the sums (tests).
    pub(crate) dgrad_gn_runs: u64,
    /// The Upsample's conv, where our wgmma kernels run it, computes the trilinear doubling of its
    /// input in the forward's producer and writes it in the data gradient's for the weight
    /// gradient (true, the default: `conv3d_wgmma_fwd_up` / `_dgrad_up`,
    /// `Backend::upsample_conv3d_forward` / `_backward`) or reads it from an upsampling pass
    /// (`MEDDPM_UP_CONV=0`, A/B benchmarks and tests).
    pub(crate) up_conv: bool,
    /// Calls of `conv3d_wgmma_fwd_up` and `conv3d_wgmma_dgrad_up` (tests).
    pub(crate) up_conv_runs: u64,
    /// Per (shape, direction): whether our few-channel kernel timed faster.
    pub(super) small: HashMap<(ConvShape, Dir), bool>,
    /// Per (shape, direction): whether the latest call ran our few-channel kernel; absent where
    /// the latest call's configuration had none for the shape.
    pub(super) small_used: HashMap<(ConvShape, Dir), bool>,
    pub(super) identity: ActDesc,
    pub(super) disk: HashMap<String, Algo>,
    pub(super) disk_path: Option<PathBuf>,
}

fn key(dir: Dir, cs: &ConvShape, layout: Layout, precision: Precision) -> String {
    let x = cs.x;
    format!(
        "{} {:?} {:?} {}x{}x{}x{}x{} {} {} {}",
        dir.tag(),
        layout,
        precision,
        x.n,
        x.c,
        x.d,
        x.h,
        x.w,
        cs.cout,
        cs.k,
        cs.stride
    )
    .to_lowercase()
    .replace(' ', "_")
}

/// The disk cache's key of a timed choice between our `kind` of kernel and cuDNN for (dir, cs)
/// (accumulated where `add`): the sources' hash in it, so a changed kernel is timed again.
pub(super) fn choice_key(
    kind: &str,
    dir: Dir,
    cs: &ConvShape,
    (layout, precision): (Layout, Precision),
    add: bool,
) -> String {
    let acc = if add { "_add" } else { "" };
    format!("choice-{kind}-{:016x}_{}{acc}", crate::device::sources_key(), key(dir, cs, layout, precision))
}

/// One line of the disk cache: key, algorithm id, math type, workspace bytes.
fn disk_line(k: &str, a: &Algo) -> String {
    format!("{k} {} {} {}\n", a.id, a.math, a.ws)
}

/// The disk cache's lines (`disk_line`); others (a torn last line, an older format) are skipped.
fn parse_disk(text: &str) -> HashMap<String, Algo> {
    let mut disk = HashMap::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() == 4 {
            if let (Ok(id), Ok(math), Ok(ws)) = (f[1].parse(), f[2].parse(), f[3].parse()) {
                disk.insert(f[0].to_string(), Algo { id, math, ws, ms: -1.0 });
            }
        }
    }
    disk
}

impl ConvCache {
    pub(crate) fn new(dev: &Device, layout: Layout, precision: Precision) -> ConvCache {
        let disk_path = cache_dir().map(|d| {
            let gpu: String = dev.info.name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect();
            d.join(format!(
                "cudnn-algos-{gpu}-sm{}{}-cudnn{}.txt",
                dev.info.cc.0, dev.info.cc.1, dev.info.cudnn_version
            ))
        });
        let disk = disk_path
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .map_or_else(HashMap::new, |t| parse_disk(&t));
        ConvCache {
            layout,
            precision,
            plans: HashMap::new(),
            fwd_calls: HashMap::new(),
            // MEDDPM_CONV_PAD=0/1 forbids/forces the channel padding (A/B benchmarks)
            force_pad: std::env::var("MEDDPM_CONV_PAD").ok().map(|v| v != "0"),
            // MEDDPM_FUSED_BIAS=0/1 forbids/forces the bias (and residual) in cuDNN's call
            force_fused_bias: std::env::var("MEDDPM_FUSED_BIAS").ok().map(|v| v != "0"),
            pads: HashMap::new(),
            // our few-channel kernels timed against cuDNN per shape by default; MEDDPM_SMALL_CONV=1
            // forces them, =0 forbids them (A/B benchmarks)
            force_small: env_force("MEDDPM_SMALL_CONV"),
            small_mma: std::env::var("MEDDPM_SMALL_MMA").map_or(true, |v| v != "0"),
            fused_head: std::env::var("MEDDPM_FUSED_HEAD").map_or(true, |v| v != "0"),
            small_gemm: std::env::var("MEDDPM_SMALL_GEMM").map_or(true, |v| v != "0"),
            small_gemm_budget: 64 << 20,
            force_wgmma: env_force("MEDDPM_WGMMA"),
            wgmma: HashMap::new(),
            wgmma_runs: 0,
            wgmma_gn: std::env::var("MEDDPM_WGMMA_GN").map_or(true, |v| v != "0"),
            wgmma_gn_runs: 0,
            wgmma_reuse: std::env::var("MEDDPM_WGMMA_REUSE").map_or(true, |v| v != "0"),
            wgmma_dual: std::env::var("MEDDPM_WGMMA_DUAL").map_or(true, |v| v != "0"),
            wgmma_dual_runs: 0,
            wgmma_wgrad: std::env::var("MEDDPM_WGMMA_WGRAD").map_or(true, |v| v != "0"),
            wgmma_wgrad_runs: 0,
            cat_free: std::env::var("MEDDPM_CAT_FREE").map_or(true, |v| v != "0"),
            cat_free_runs: 0,
            conv_stats: std::env::var("MEDDPM_CONV_STATS").map_or(true, |v| v != "0"),
            wgmma_ystats_runs: 0,
            skip_apply: std::env::var("MEDDPM_SKIP_APPLY").map_or(true, |v| v != "0"),
            skip_apply_runs: 0,
            res_fold: std::env::var("MEDDPM_RES_FOLD").map_or(true, |v| v != "0"),
            res_fold_runs: 0,
            dgrad_gn: std::env::var("MEDDPM_DGRAD_GN").map_or(true, |v| v != "0"),
            dgrad_gn_runs: 0,
            up_conv: std::env::var("MEDDPM_UP_CONV").map_or(true, |v| v != "0"),
            up_conv_runs: 0,
            small: HashMap::new(),
            small_used: HashMap::new(),
            identity: identity_desc(),
            disk,
            disk_path,
        }
    }

    /// Whether the tensor-core few-channel kernels run (`small_mma`, bf16 precision only).
    pub(super) fn mma_on(&self) -> bool {
        self.small_mma && self.precision == Precision::Bf16
    }

    /// Whether [`gn_head_forward`] takes the output head of `cs` (`groups` GroupNorm groups) with
    /// a bf16 input: `fused_head` on, the tensor-core few-channel kernels on, NDHWC, 64 input
    /// channels, Cout ≤ 4, 3×3×3 stride 1.
    pub(crate) fn gn_head_fits(&self, cs: ConvShape, groups: usize, x_bf16: bool) -> bool {
        self.fused_head
            && self.mma_on()
            && self.layout == Layout::Ndhwc
            && x_bf16
            && cs.x.c == 64
            && (1..=4).contains(&cs.cout)
            && cs.k == 3
            && cs.stride == 1
            && groups > 0
            && 64 % groups == 0
    }

    pub(super) fn plan(&mut self, cs: ConvShape) -> &mut Plan {
        let (layout, precision) = (self.layout, self.precision);
        self.plans.entry(cs).or_insert_with(|| {
            let math = match precision {
                Precision::Fp32 => nsys::cudnnMathType_t::CUDNN_FMA_MATH,
                Precision::Tf32 | Precision::Bf16 => nsys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
            };
            let dt = compute_type(precision);
            Plan {
                x: tensor_desc(cs.x, layout, dt),
                y: tensor_desc(cs.out(), layout, dt),
                w: filter_desc(&cs, layout, dt),
                bias: bias_desc(cs.cout, dt),
                conv: [conv_desc(&cs, math), conv_desc(&cs, math), conv_desc(&cs, math)],
                algo: [None, None, None],
                fused_bias: [None, None],
            }
        })
    }

    pub(super) fn remember(&mut self, k: String, a: Algo) {
        if let Some(p) = &self.disk_path {
            let line = disk_line(&k, &a);
            let _ = std::fs::create_dir_all(p.parent().unwrap_or(p));
            if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(p) {
                let _ = f.write_all(line.as_bytes());
            }
        }
        self.disk.insert(k, a);
    }

    /// A timed kernel choice (`choice_key`) an earlier process kept in the disk cache.
    pub(super) fn disk_choice(&self, k: &str) -> Option<bool> {
        self.disk.get(k).map(|a| a.id == 1)
    }

    /// Keep a timed kernel choice in the disk cache (a line like an algorithm's: id 1 = ours).
    pub(super) fn remember_choice(&mut self, k: String, on: bool) {
        self.remember(k, Algo { id: on as u32, math: 0, ws: 0, ms: -1.0 });
    }

    /// The algorithm for (dir, cs): from the plan, the disk cache, or cudnnFind on the given
    /// buffers (x, w, y device addresses; the output one is overwritten by Find).
    pub(super) fn algo(&mut self, dev: &Device, dir: Dir, cs: ConvShape, x: u64, w: u64, y: u64) -> Algo {
        if let Some(a) = self.plan(cs).algo[idx(dir)] {
            return a;
        }
        let k = key(dir, &cs, self.layout, self.precision);
        let precision = self.precision;
        let cached = self.disk.get(&k).copied();
        let plan = self.plan(cs);
        let a = match cached {
            Some(mut a) => {
                ck(unsafe { nsys::cudnnSetConvolutionMathType(plan.conv[idx(dir)].0, math_of(a.math)) }, "math type");
                a.ws = ws_size(dev, plan, dir, a.id);
                a
            }
            None => {
                let a = find(dev, plan, dir, precision, x, w, y, &cs);
                ck(unsafe { nsys::cudnnSetConvolutionMathType(plan.conv[idx(dir)].0, math_of(a.math)) }, "math type");
                a
            }
        };
        self.plan(cs).algo[idx(dir)] = Some(a);
        if cached.is_none() {
            self.remember(k, a);
        }
        a
    }

    /// Whether the forward of `cs` fuses its bias into cuDNN (None: not decided yet).
    pub(crate) fn fused_bias(&self, cs: &ConvShape) -> Option<bool> {
        self.plans.get(cs).and_then(|p| p.fused_bias[0])
    }

    /// Whether the latest forward and data gradient of `cs` ran our few-channel kernels (None: no
    /// such call yet, or the shape is not one of theirs).
    pub(crate) fn small_used(&self, cs: &ConvShape) -> [Option<bool>; 2] {
        [Dir::Fwd, Dir::BwdData].map(|d| self.small_used.get(&(*cs, d)).copied())
    }

    /// The algorithms chosen so far (for benchmarks and describe()).
    pub(crate) fn chosen(&self, cs: &ConvShape) -> [Option<Algo>; 3] {
        self.plans.get(cs).map(|p| p.algo).unwrap_or([None, None, None])
    }
}

fn ws_size(dev: &Device, p: &Plan, dir: Dir, id: u32) -> usize {
    let mut s = 0usize;
    let h = dev.cudnn.0;
    let c = p.conv[idx(dir)].0;
    let st = unsafe {
        match dir {
            Dir::Fwd => nsys::cudnnGetConvolutionForwardWorkspaceSize(h, p.x.0, p.w.0, c, p.y.0, fwd_algo(id), &mut s),
            Dir::BwdData => {
                nsys::cudnnGetConvolutionBackwardDataWorkspaceSize(h, p.w.0, p.y.0, c, p.x.0, bwd_data_algo(id), &mut s)
            }
            Dir::BwdFilter => nsys::cudnnGetConvolutionBackwardFilterWorkspaceSize(
                h,
                p.x.0,
                p.y.0,
                c,
                p.w.0,
                bwd_filter_algo(id),
                &mut s,
            ),
        }
    };
    ck(st, "cudnnGet*WorkspaceSize (algorithm from the disk cache; delete the cache file if this persists)");
    s
}

/// cudnnFind*AlgorithmEx with a temporary workspace; the fastest successful algorithm whose math
/// type fits the precision.
#[allow(clippy::too_many_arguments)]
fn find(dev: &Device, p: &Plan, dir: Dir, precision: Precision, x: u64, w: u64, y: u64, cs: &ConvShape) -> Algo {
    let mut limit = find_ws_limit();
    let (free, _) = dev.ctx.mem_get_info().unwrap_or((usize::MAX, 0));
    limit = limit.min(free / 4).max(1 << 20);
    let mut ws = dev.stream.alloc_zeros::<u8>(limit).unwrap_or_else(|e| panic!("{}", dev.oom(limit, &e.to_string())));
    let wsp = {
        use cudarc::driver::DevicePtrMut;
        let (p, _g) = ws.device_ptr_mut(&dev.stream);
        p
    };
    dev.bind();
    let h = dev.cudnn.0;
    let c = p.conv[idx(dir)].0;
    const REQ: usize = 8;
    let mut n = 0i32;
    // (id, cudnnStatus code, math, memory, time)
    let mut res: Vec<(u32, u32, u32, usize, f32)> = Vec::new();
    unsafe {
        match dir {
            Dir::Fwd => {
                let mut perf = [std::mem::zeroed::<nsys::cudnnConvolutionFwdAlgoPerf_t>(); REQ];
                ck(
                    nsys::cudnnFindConvolutionForwardAlgorithmEx(
                        h,
                        p.x.0,
                        x as _,
                        p.w.0,
                        w as _,
                        c,
                        p.y.0,
                        y as _,
                        REQ as i32,
                        &mut n,
                        perf.as_mut_ptr(),
                        wsp as _,
                        limit,
                    ),
                    "cudnnFindConvolutionForwardAlgorithmEx",
                );
                for q in &perf[..n as usize] {
                    res.push((q.algo as u32, q.status as u32, q.mathType as u32, q.memory, q.time));
                }
            }
            Dir::BwdData => {
                let mut perf = [std::mem::zeroed::<nsys::cudnnConvolutionBwdDataAlgoPerf_t>(); REQ];
                ck(
                    nsys::cudnnFindConvolutionBackwardDataAlgorithmEx(
                        h,
                        p.w.0,
                        w as _,
                        p.y.0,
                        y as _,
                        c,
                        p.x.0,
                        x as _,
                        REQ as i32,
                        &mut n,
                        perf.as_mut_ptr(),
                        wsp as _,
                        limit,
                    ),
                    "cudnnFindConvolutionBackwardDataAlgorithmEx",
                );
                for q in &perf[..n as usize] {
                    res.push((q.algo as u32, q.status as u32, q.mathType as u32, q.memory, q.time));
                }
            }
            Dir::BwdFilter => {
                let mut perf = [std::mem::zeroed::<nsys::cudnnConvolutionBwdFilterAlgoPerf_t>(); REQ];
                ck(
                    nsys::cudnnFindConvolutionBackwardFilterAlgorithmEx(
                        h,
                        p.x.0,
                        x as _,
                        p.y.0,
                        y as _,
                        c,
                        p.w.0,
                        w as _,
                        REQ as i32,
                        &mut n,
                        perf.as_mut_ptr(),
                        wsp as _,
                        limit,
                    ),
                    "cudnnFindConvolutionBackwardFilterAlgorithmEx",
                );
                for q in &perf[..n as usize] {
                    res.push((q.algo as u32, q.status as u32, q.mathType as u32, q.memory, q.time));
                }
            }
        }
    }
    dev.sync();
    drop(ws);
    let fma = nsys::cudnnMathType_t::CUDNN_FMA_MATH as u32;
    let usable =
        |r: &&(u32, u32, u32, usize, f32)| r.1 == 0 && r.3 <= limit && (precision != Precision::Fp32 || r.2 == fma);
    if let Some(&(id, _, math, ws, ms)) = res.iter().filter(usable).min_by(|a, b| a.4.total_cmp(&b.4)) {
        return Algo { id, math, ws, ms };
    }
    // cudnnFind ran nothing usable (seen for fp32 FMA NCDHW at 64x128^3 on cuDNN 9.19): take
    // cuDNN's heuristic ranking instead, first entry whose workspace fits.
    let heur = heuristic(dev, p, dir);
    let (free, _) = dev.ctx.mem_get_info().unwrap_or((usize::MAX, 0));
    let pick = heur
        .iter()
        .filter(|r| r.1 == 0 && r.3 <= free / 4 && (precision != Precision::Fp32 || r.2 == fma))
        .find(|r| ws_size_checked(dev, p, dir, r.0).is_some());
    eprintln!(
        "meddpm-cuda: cudnnFind found no usable {} algorithm for conv {} -> {} k{} s{} ({precision:?}); find results \
         (id, status, math, bytes, ms) {res:?}; heuristic {heur:?}; using {pick:?}",
        dir.tag(),
        cs.x,
        cs.cout,
        cs.k,
        cs.stride
    );
    match pick {
        Some(&(id, _, math, _, _)) => Algo { id, math, ws: ws_size(dev, p, dir, id), ms: -2.0 },
        None => panic!(
            "cuDNN has no usable {} algorithm for conv {} -> {} k{} s{} ({precision:?}); find results (id, status, \
             math, bytes, ms) {res:?}; heuristic results {heur:?}",
            dir.tag(),
            cs.x,
            cs.cout,
            cs.k,
            cs.stride
        ),
    }
}

/// cuDNN's heuristic ranking (cudnnGet*Algorithm_v7): (id, status, math, bytes, time).
fn heuristic(dev: &Device, p: &Plan, dir: Dir) -> Vec<(u32, u32, u32, usize, f32)> {
    const REQ: usize = 8;
    let (h, c) = (dev.cudnn.0, p.conv[idx(dir)].0);
    let mut n = 0i32;
    let mut res = Vec::new();
    unsafe {
        match dir {
            Dir::Fwd => {
                let mut perf = [std::mem::zeroed::<nsys::cudnnConvolutionFwdAlgoPerf_t>(); REQ];
                let st = nsys::cudnnGetConvolutionForwardAlgorithm_v7(
                    h,
                    p.x.0,
                    p.w.0,
                    c,
                    p.y.0,
                    REQ as i32,
                    &mut n,
                    perf.as_mut_ptr(),
                );
                if cudnn_ck(st, "heuristic").is_ok() {
                    for q in &perf[..n as usize] {
                        res.push((q.algo as u32, q.status as u32, q.mathType as u32, q.memory, q.time));
                    }
                }
            }
            Dir::BwdData => {
                let mut perf = [std::mem::zeroed::<nsys::cudnnConvolutionBwdDataAlgoPerf_t>(); REQ];
                let st = nsys::cudnnGetConvolutionBackwardDataAlgorithm_v7(
                    h,
                    p.w.0,
                    p.y.0,
                    c,
                    p.x.0,
                    REQ as i32,
                    &mut n,
                    perf.as_mut_ptr(),
                );
                if cudnn_ck(st, "heuristic").is_ok() {
                    for q in &perf[..n as usize] {
                        res.push((q.algo as u32, q.status as u32, q.mathType as u32, q.memory, q.time));
                    }
                }
            }
            Dir::BwdFilter => {
                let mut perf = [std::mem::zeroed::<nsys::cudnnConvolutionBwdFilterAlgoPerf_t>(); REQ];
                let st = nsys::cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                    h,
                    p.x.0,
                    p.y.0,
                    c,
                    p.w.0,
                    REQ as i32,
                    &mut n,
                    perf.as_mut_ptr(),
                );
                if cudnn_ck(st, "heuristic").is_ok() {
                    for q in &perf[..n as usize] {
                        res.push((q.algo as u32, q.status as u32, q.mathType as u32, q.memory, q.time));
                    }
                }
            }
        }
    }
    res
}

fn ws_size_checked(dev: &Device, p: &Plan, dir: Dir, id: u32) -> Option<usize> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ws_size(dev, p, dir, id))).ok()
}

/// Scratch of a channel-padded forward: the padded input (when Cin is padded), weights, and output
/// (when Cout is padded), in the compute type; allocated on the first call of the shape, reused after.
pub(super) struct Pad {
    pub(super) x: Option<GpuBuf>,
    pub(super) w: GpuBuf,
    pub(super) y: Option<GpuBuf>,
    /// Whether the padded run is the faster one (None: not timed yet).
    pub(super) on: Option<bool>,
}

#[cfg(test)]
mod tests {
    use meddpm::Dims;

    use super::*;

    fn cs(n: usize, cin: usize, d: usize, h: usize, w: usize, cout: usize, k: usize, stride: usize) -> ConvShape {
        ConvShape::new(Dims::new(n, cin, d, h, w), cout, k, stride)
    }

    #[test]
    fn disk_cache_lines_round_trip_algorithms_and_choices() {
        let c = cs(1, 64, 128, 128, 128, 64, 3, 1);
        let lp = (Layout::Ndhwc, Precision::Bf16);
        let (k0, k1) =
            (choice_key("wgmma", Dir::BwdData, &c, lp, false), choice_key("wgmma", Dir::BwdData, &c, lp, true));
        assert_ne!(k0, k1, "accumulated and overwritten outputs are timed apart");
        assert_ne!(k0, choice_key("wgmma", Dir::Fwd, &c, lp, false));
        assert!(!k0.contains(char::is_whitespace), "{k0}");
        let algo = key(Dir::BwdFilter, &c, lp.0, lp.1);
        let text = [
            disk_line(&k0, &Algo { id: 1, math: 0, ws: 0, ms: 0.5 }),
            disk_line(&k1, &Algo { id: 0, math: 0, ws: 0, ms: 0.5 }),
            disk_line(&algo, &Algo { id: 1, math: 1, ws: 1 << 20, ms: 0.5 }),
            "torn line 1\n".into(),
        ]
        .concat();
        let d = parse_disk(&text);
        assert_eq!(d.len(), 3, "the torn line is skipped");
        assert_eq!((d[&k0].id, d[&k1].id), (1, 0));
        assert_eq!((d[&algo].id, d[&algo].math, d[&algo].ws), (1, 1, 1 << 20));
    }
}
