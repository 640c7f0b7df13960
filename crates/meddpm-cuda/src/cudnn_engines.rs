//! cuDNN's backend (graph) API for one convolution: the engine configurations its heuristics
//! offer for a shape and direction, each built into an execution plan and timed on the GPU.
//!
//! Why: the legacy API (`cudnnFind*AlgorithmEx`, conv3d.rs) picks among a handful of algorithm
//! ids, each mapped by cuDNN to one engine configuration; on the H200 its bf16 NDHWC weight
//! gradient of the 64 → 64 convs at 128³ runs at ~48 % of the tensor cores' peak where the
//! 128 → 64 one reaches ~69 % (CUPTI, docs/perf/h200-2026-12-02f). The backend API exposes the
//! engines and their knobs (tile, split-K, swizzle) directly; this module surveys them so the
//! choice can be measured before it is wired into the convolution path.
//!
//! Scope: bf16 NDHWC tensors (x, w, y), f32 compute, cross-correlation, one op per graph; the
//! three directions. Errors (an unsupported configuration, a plan that does not finalize) are
//! returned per configuration, never panics.

use cudarc::cudnn::sys as nsys;
use meddpm::ConvShape;
use nsys::cudnnBackendAttributeName_t as A;
use nsys::cudnnBackendAttributeType_t as T;
use nsys::cudnnBackendDescriptorType_t as D;

use crate::device::{cudnn_ck, Device};

/// Which computation of a convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvDir {
    Fwd,
    BwdData,
    BwdFilter,
}

impl ConvDir {
    pub fn tag(self) -> &'static str {
        match self {
            ConvDir::Fwd => "fwd",
            ConvDir::BwdData => "bwd_data",
            ConvDir::BwdFilter => "bwd_filter",
        }
    }
}

/// One engine configuration of the survey: where it came from, what cuDNN calls it, its
/// workspace, and its median time (or why it could not run).
#[derive(Clone, Debug)]
pub struct EngineTiming {
    /// Heuristic mode and rank ("A#0", "B#3", "fallback#1").
    pub source: String,
    /// The engine's global index.
    pub engine: i64,
    /// The plan's JSON representation where cuDNN gives one (engine id and knob values).
    pub json: String,
    pub workspace: usize,
    /// Median milliseconds over the timed runs, or the error.
    pub ms: Result<f32, String>,
}

/// An owned backend descriptor.
struct Desc(nsys::cudnnBackendDescriptor_t);

impl Drop for Desc {
    fn drop(&mut self) {
        if !self.0.is_null() {
            unsafe { nsys::cudnnBackendDestroyDescriptor(self.0) };
        }
    }
}

fn create(t: D) -> Result<Desc, String> {
    let mut d = std::ptr::null_mut();
    cudnn_ck(unsafe { nsys::cudnnBackendCreateDescriptor(t, &mut d) }, &format!("cudnnBackendCreateDescriptor {t:?}"))?;
    Ok(Desc(d))
}

fn set<V>(d: &Desc, name: A, ty: T, vals: &[V]) -> Result<(), String> {
    cudnn_ck(
        unsafe { nsys::cudnnBackendSetAttribute(d.0, name, ty, vals.len() as i64, vals.as_ptr() as *const _) },
        &format!("cudnnBackendSetAttribute {name:?}"),
    )
}

fn finalize(d: &Desc, what: &str) -> Result<(), String> {
    cudnn_ck(unsafe { nsys::cudnnBackendFinalize(d.0) }, &format!("cudnnBackendFinalize {what}"))
}

fn get_i64(d: &Desc, name: A) -> Result<i64, String> {
    let (mut v, mut n) = (0i64, 0i64);
    cudnn_ck(
        unsafe {
            nsys::cudnnBackendGetAttribute(d.0, name, T::CUDNN_TYPE_INT64, 1, &mut n, &mut v as *mut i64 as *mut _)
        },
        &format!("cudnnBackendGetAttribute {name:?}"),
    )?;
    Ok(v)
}

/// A bf16 tensor of NCDHW dimensions `dims` stored channels-last (NDHWC strides).
fn tensor(uid: i64, dims: [i64; 5]) -> Result<Desc, String> {
    let [n, c, d, h, w] = dims;
    let strides = [d * h * w * c, 1, h * w * c, w * c, c];
    let t = create(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
    set(&t, A::CUDNN_ATTR_TENSOR_DATA_TYPE, T::CUDNN_TYPE_DATA_TYPE, &[nsys::cudnnDataType_t::CUDNN_DATA_BFLOAT16])?;
    set(&t, A::CUDNN_ATTR_TENSOR_DIMENSIONS, T::CUDNN_TYPE_INT64, &[n, c, d, h, w])?;
    set(&t, A::CUDNN_ATTR_TENSOR_STRIDES, T::CUDNN_TYPE_INT64, &strides)?;
    set(&t, A::CUDNN_ATTR_TENSOR_UNIQUE_ID, T::CUDNN_TYPE_INT64, &[uid])?;
    set(&t, A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, T::CUDNN_TYPE_INT64, &[16i64])?;
    finalize(&t, "tensor")?;
    Ok(t)
}

/// The operation graph of one convolution `dir` over `cs` (uids: x 1, w 2, y 3).
fn op_graph(dev: &Device, cs: &ConvShape, dir: ConvDir) -> Result<(Desc, [Desc; 4]), String> {
    let x = cs.x;
    let y = cs.out();
    let k = cs.k as i64;
    let xt = tensor(1, [x.n as i64, x.c as i64, x.d as i64, x.h as i64, x.w as i64])?;
    let wt = tensor(2, [cs.cout as i64, x.c as i64, k, k, k])?;
    let yt = tensor(3, [y.n as i64, y.c as i64, y.d as i64, y.h as i64, y.w as i64])?;
    let conv = create(D::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR)?;
    let (p, s) = (cs.pad() as i64, cs.stride as i64);
    set(
        &conv,
        A::CUDNN_ATTR_CONVOLUTION_COMP_TYPE,
        T::CUDNN_TYPE_DATA_TYPE,
        &[nsys::cudnnDataType_t::CUDNN_DATA_FLOAT],
    )?;
    set(
        &conv,
        A::CUDNN_ATTR_CONVOLUTION_CONV_MODE,
        T::CUDNN_TYPE_CONVOLUTION_MODE,
        &[nsys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION],
    )?;
    set(&conv, A::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, T::CUDNN_TYPE_INT64, &[3i64])?;
    set(&conv, A::CUDNN_ATTR_CONVOLUTION_DILATIONS, T::CUDNN_TYPE_INT64, &[1i64; 3])?;
    set(&conv, A::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, T::CUDNN_TYPE_INT64, &[s; 3])?;
    set(&conv, A::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, T::CUDNN_TYPE_INT64, &[p; 3])?;
    set(&conv, A::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, T::CUDNN_TYPE_INT64, &[p; 3])?;
    finalize(&conv, "convolution")?;
    let bd = T::CUDNN_TYPE_BACKEND_DESCRIPTOR;
    let (alpha, beta) = ([1.0f32], [0.0f32]);
    let op = match dir {
        ConvDir::Fwd => {
            let op = create(D::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR)?;
            set(&op, A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, bd, &[xt.0])?;
            set(&op, A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, bd, &[wt.0])?;
            set(&op, A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, bd, &[yt.0])?;
            set(&op, A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, bd, &[conv.0])?;
            set(&op, A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, T::CUDNN_TYPE_FLOAT, &alpha)?;
            set(&op, A::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, T::CUDNN_TYPE_FLOAT, &beta)?;
            op
        }
        ConvDir::BwdData => {
            let op = create(D::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR)?;
            set(&op, A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, bd, &[xt.0])?;
            set(&op, A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W, bd, &[wt.0])?;
            set(&op, A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY, bd, &[yt.0])?;
            set(&op, A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC, bd, &[conv.0])?;
            set(&op, A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA, T::CUDNN_TYPE_FLOAT, &alpha)?;
            set(&op, A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA, T::CUDNN_TYPE_FLOAT, &beta)?;
            op
        }
        ConvDir::BwdFilter => {
            let op = create(D::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR)?;
            set(&op, A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, bd, &[xt.0])?;
            set(&op, A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW, bd, &[wt.0])?;
            set(&op, A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY, bd, &[yt.0])?;
            set(&op, A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC, bd, &[conv.0])?;
            set(&op, A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA, T::CUDNN_TYPE_FLOAT, &alpha)?;
            set(&op, A::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA, T::CUDNN_TYPE_FLOAT, &beta)?;
            op
        }
    };
    finalize(&op, &format!("convolution {} operation", dir.tag()))?;
    let g = create(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
    set(&g, A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, T::CUDNN_TYPE_HANDLE, &[dev.cudnn.0])?;
    set(&g, A::CUDNN_ATTR_OPERATIONGRAPH_OPS, bd, &[op.0])?;
    finalize(&g, "operation graph")?;
    Ok((g, [xt, wt, yt, op]))
}

/// The engine configurations cuDNN's heuristics in `mode` offer for the graph (at most `max`).
fn heuristics(g: &Desc, mode: nsys::cudnnBackendHeurMode_t, max: usize) -> Result<Vec<Desc>, String> {
    let h = create(D::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
    set(&h, A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, &[g.0])?;
    set(&h, A::CUDNN_ATTR_ENGINEHEUR_MODE, T::CUDNN_TYPE_HEUR_MODE, &[mode])?;
    finalize(&h, "engine heuristics")?;
    let cfgs: Vec<Desc> = (0..max).map(|_| create(D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR)).collect::<Result<_, _>>()?;
    let mut ptrs: Vec<nsys::cudnnBackendDescriptor_t> = cfgs.iter().map(|c| c.0).collect();
    let mut n = 0i64;
    cudnn_ck(
        unsafe {
            nsys::cudnnBackendGetAttribute(
                h.0,
                A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
                T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                max as i64,
                &mut n,
                ptrs.as_mut_ptr() as *mut _,
            )
        },
        "cudnnBackendGetAttribute ENGINEHEUR_RESULTS",
    )?;
    let mut cfgs = cfgs;
    cfgs.truncate(n.max(0) as usize);
    Ok(cfgs)
}

/// The engine's global index of a configuration (-1 where cuDNN does not say).
fn engine_index(cfg: &Desc) -> i64 {
    let Ok(e) = create(D::CUDNN_BACKEND_ENGINE_DESCRIPTOR) else { return -1 };
    let mut n = 0i64;
    let mut p = e.0;
    let st = unsafe {
        nsys::cudnnBackendGetAttribute(
            cfg.0,
            A::CUDNN_ATTR_ENGINECFG_ENGINE,
            T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            1,
            &mut n,
            &mut p as *mut _ as *mut _,
        )
    };
    if cudnn_ck(st, "ENGINECFG_ENGINE").is_err() {
        return -1;
    }
    get_i64(&e, A::CUDNN_ATTR_ENGINE_GLOBAL_INDEX).unwrap_or(-1)
}

/// The plan's JSON representation (engine and knobs), empty where cuDNN gives none.
fn plan_json(plan: &Desc) -> String {
    let mut buf = vec![0u8; 4096];
    let mut n = 0i64;
    let st = unsafe {
        nsys::cudnnBackendGetAttribute(
            plan.0,
            A::CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION,
            T::CUDNN_TYPE_CHAR,
            buf.len() as i64,
            &mut n,
            buf.as_mut_ptr() as *mut _,
        )
    };
    if cudnn_ck(st, "EXECUTION_PLAN_JSON_REPRESENTATION").is_err() {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Build, run and time every engine configuration cuDNN's heuristics (modes A and B, then the
/// fallback list) offer for convolution `dir` over `cs` in bf16 NDHWC, on the buffers at
/// (x, w, y) (device pointers of the shape's elements; contents are overwritten for the output
/// of the direction). Each configuration: one untimed run, then the median of `reps` timed runs.
/// Configurations whose workspace passes `ws_limit` bytes are listed with an error, not run.
#[allow(clippy::too_many_arguments)]
pub(crate) fn survey(
    dev: &Device,
    cs: &ConvShape,
    dir: ConvDir,
    ptrs: [u64; 3],
    reps: usize,
    ws_limit: usize,
    per_mode: usize,
) -> Result<Vec<EngineTiming>, String> {
    dev.bind();
    let (g, _keep) = op_graph(dev, cs, dir)?;
    let mut out: Vec<EngineTiming> = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    let modes = [
        ("A", nsys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A),
        ("B", nsys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_B),
        ("fallback", nsys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK),
    ];
    for (tag, mode) in modes {
        let cfgs = match heuristics(&g, mode, per_mode) {
            Ok(c) => c,
            Err(e) => {
                out.push(EngineTiming {
                    source: format!("{tag}: none"),
                    engine: -1,
                    json: String::new(),
                    workspace: 0,
                    ms: Err(e),
                });
                continue;
            }
        };
        for (rank, cfg) in cfgs.iter().enumerate() {
            let engine = engine_index(cfg);
            let source = format!("{tag}#{rank}");
            let plan = match (|| {
                let plan = create(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
                set(&plan, A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, T::CUDNN_TYPE_HANDLE, &[dev.cudnn.0])?;
                set(&plan, A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, &[cfg.0])?;
                finalize(&plan, "execution plan")?;
                Ok::<Desc, String>(plan)
            })() {
                Ok(p) => p,
                Err(e) => {
                    out.push(EngineTiming { source, engine, json: String::new(), workspace: 0, ms: Err(e) });
                    continue;
                }
            };
            let json = plan_json(&plan);
            // the same configuration from two modes is timed once
            let key = if json.is_empty() { format!("{engine}/{source}") } else { json.clone() };
            if seen.contains(&key) {
                continue;
            }
            seen.push(key);
            let ws = get_i64(&plan, A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE).unwrap_or(0).max(0) as usize;
            if ws > ws_limit {
                let ms = Err(format!("workspace {ws} bytes over the limit {ws_limit}"));
                out.push(EngineTiming { source, engine, json, workspace: ws, ms });
                continue;
            }
            let ms = time_plan(dev, &plan, ptrs, ws, reps);
            out.push(EngineTiming { source, engine, json, workspace: ws, ms });
        }
    }
    Ok(out)
}

/// The median of `reps` timed runs of the plan (after one untimed run) on the data at `ptrs`.
fn time_plan(dev: &Device, plan: &Desc, ptrs: [u64; 3], ws: usize, reps: usize) -> Result<f32, String> {
    let wsb = dev.workspace(ws);
    let wsp = crate::conv3d::ws_ptr(dev, &wsb);
    let vp = create(D::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
    let uids = [1i64, 2, 3];
    let data: [*mut std::ffi::c_void; 3] = ptrs.map(|p| p as *mut _);
    set(&vp, A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, T::CUDNN_TYPE_INT64, &uids)?;
    set(&vp, A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, T::CUDNN_TYPE_VOID_PTR, &data)?;
    set(&vp, A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE, T::CUDNN_TYPE_VOID_PTR, &[wsp as *mut std::ffi::c_void])?;
    finalize(&vp, "variant pack")?;
    let run = || cudnn_ck(unsafe { nsys::cudnnBackendExecute(dev.cudnn.0, plan.0, vp.0) }, "cudnnBackendExecute");
    run()?;
    dev.sync();
    let mut ms = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let mut r = Ok(());
        let t = crate::conv3d::stream_ms(dev, || r = run());
        r?;
        ms.push(t);
    }
    ms.sort_by(f32::total_cmp);
    Ok(ms[ms.len() / 2])
}
