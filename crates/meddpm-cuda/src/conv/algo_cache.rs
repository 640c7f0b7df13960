//! `ConvCache`: a backend's convolution state. cuDNN plans per shape, algorithms chosen by
//! `cudnnFind*AlgorithmEx` (timed on the real buffers) once per shape and kept in a per-backend
//! map and in an on-disk cache per GPU and cuDNN version (`device::cache_dir`: `$MEDDPM_CACHE_DIR`,
//! else `$XDG_CACHE_HOME/meddpm`, else `~/.cache/meddpm`; `MEDDPM_CUDNN_CACHE=0` disables it).
//! The workspace grows to the chosen algorithm's need. The timed choices between our kernels and
//! cuDNN per shape are kept in the same file (keyed by a hash of our kernels' sources), so every
//! later process runs the same kernels. It also holds the kernel choices (`crate::choices`) and the run
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
use crate::choices::{KernelChoices, PathRuns};
use crate::device::{cache_dir, cudnn_ck, Device};

/// Per-backend convolution state: plans per shape and the on-disk algorithm cache.
pub(crate) struct ConvCache {
    pub(super) layout: Layout,
    pub(super) precision: Precision,
    /// The kernel choices (`crate::choices`): which engine or fused path runs where several can.
    pub(crate) choices: KernelChoices,
    /// How often each of our kernel paths ran (tests read it through `CudaBackend::runs`).
    pub(crate) runs: PathRuns,
    pub(super) plans: HashMap<ConvShape, Plan>,
    /// Forward calls per shape since the last reset (for per-layer benchmarks).
    pub(crate) fwd_calls: HashMap<ConvShape, u64>,
    /// Channel-padded forward state per original shape.
    pub(super) pads: HashMap<ConvShape, Pad>,
    /// Per (shape, direction, accumulated): whether `conv3d_wgmma_*` timed faster than cuDNN.
    pub(super) wgmma: HashMap<(ConvShape, Dir, bool, bool), bool>,
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
    pub(crate) fn new(dev: &Device, layout: Layout, precision: Precision, choices: KernelChoices) -> ConvCache {
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
            choices,
            runs: PathRuns::default(),
            plans: HashMap::new(),
            fwd_calls: HashMap::new(),
            pads: HashMap::new(),
            wgmma: HashMap::new(),
            small: HashMap::new(),
            small_used: HashMap::new(),
            identity: identity_desc(),
            disk,
            disk_path,
        }
    }

    /// Whether the tensor-core few-channel kernels run (`small_mma`, bf16 precision only).
    pub(super) fn mma_on(&self) -> bool {
        self.choices.small_mma && self.precision == Precision::Bf16
    }

    /// Whether [`gn_head_forward`] takes the output head of `cs` (`groups` GroupNorm groups) with
    /// a bf16 input: `fused_head` on, the tensor-core few-channel kernels on, NDHWC, 64 input
    /// channels, Cout ≤ 4, 3×3×3 stride 1.
    pub(crate) fn gn_head_fits(&self, cs: ConvShape, groups: usize, x_bf16: bool) -> bool {
        self.choices.fused_head
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
                Precision::Tf32 | Precision::Bf16 | Precision::Fp8 => nsys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
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
        let ws_mib = self.choices.cudnn_ws_mib;
        let cached = self.disk.get(&k).copied();
        let plan = self.plan(cs);
        let a = match cached {
            Some(mut a) => {
                ck(unsafe { nsys::cudnnSetConvolutionMathType(plan.conv[idx(dir)].0, math_of(a.math)) }, "math type");
                a.ws = ws_size(dev, plan, dir, a.id);
                a
            }
            None => {
                let a = find(dev, plan, dir, precision, (x, w, y), &cs, ws_mib);
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
/// `ws_mib`: the largest workspace to try, MiB (`KernelChoices::cudnn_ws_mib`; at most a quarter
/// of the free memory is used).
fn find(
    dev: &Device,
    p: &Plan,
    dir: Dir,
    precision: Precision,
    (x, w, y): (u64, u64, u64),
    cs: &ConvShape,
    ws_mib: usize,
) -> Algo {
    let mut limit = ws_mib << 20;
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
