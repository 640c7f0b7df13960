"""Does cuDNN have faster configurations of its own 3D convolution kernels than the ones it picks?

What: for the largest convolutions of the whole-head U-Net (bf16, channels-last, batch 1, 3×3×3
stride 1: forward, data gradient, weight gradient), builds each as a one-node cuDNN graph through
the cuDNN frontend's Python bindings (package nvidia-cudnn-frontend, not part of PyTorch) and
  1. times every plan that cuDNN's heuristics (modes A, B, fallback) offer — what cudnnFind /
     PyTorch choose among;
  2. for the engines of the three fastest of those plans, takes the fastest plan's knob settings
     (parsed from its name, "eng<id>_k<knob>=<value>...") and varies one knob at a time over its
     whole range (CTA_COUNT, TILE_CGA_M/N, OCCUPANCY, SPLIT_K, KERNEL_CFG, ... as the engine
     reports them), timing every variant that builds;
  3. records the launch grid of the heuristics' best and of the overall best plan (torch.profiler).
Prints one JSON line per shape: the best heuristic plan, the best variant, and the ten fastest.

Why: meddpm's profile shows cuDNN's persistent sm90 kernels launching 120 (forward, data
gradient) and 108 (weight gradient) CTAs on the H200's 132 SMs, at ~50 % of the dense bf16 peak.
If a knob (e.g. CTA_COUNT) gives a faster kernel of the same engine, a backend-API convolution path
that sets it would be worth building; if not, the convolutions are as fast as cuDNN gets. Run on the
GPU machine (prints a table last):
    PYTHONPATH=<unpacked wheel> python3 tools/reference/cudnn_engine_probe.py [--shapes N] [--iters K]
"""

import argparse
import json
import os
import re
import sys
import time

import torch

import cudnn  # noqa: E402  (nvidia-cudnn-frontend)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cudnn_fusion_probe import plan_ms  # noqa: E402  (the same timing as the fusion probe)

BF16 = cudnn.data_type.BFLOAT16
F32 = cudnn.data_type.FLOAT
CL = torch.channels_last_3d

# (direction, N, Cin, D, H, W, Cout): the whole-head model's largest 3×3×3 stride-1 convolutions
SHAPES = [
    ("fprop", 1, 64, 128, 128, 128, 64),
    ("dgrad", 1, 64, 128, 128, 128, 64),
    ("wgrad", 1, 64, 128, 128, 128, 64),
    ("fprop", 1, 128, 128, 128, 128, 64),
    ("dgrad", 1, 128, 128, 128, 128, 64),
    ("wgrad", 1, 128, 128, 128, 128, 64),
]


def make_graph(direction, n, c, d, h, w, k, handle):
    """A one-node graph and its variant pack (tensor -> torch buffer)."""
    x = (torch.randn(n, c, d, h, w, device="cuda") * 0.5).to(torch.bfloat16).contiguous(memory_format=CL)
    wt = (torch.randn(k, c, 3, 3, 3, device="cuda") * 0.03).to(torch.bfloat16).contiguous(memory_format=CL)
    dy = (torch.randn(n, k, d, h, w, device="cuda") * 0.1).to(torch.bfloat16).contiguous(memory_format=CL)
    g = cudnn.pygraph(io_data_type=BF16, intermediate_data_type=F32, compute_data_type=F32, handle=handle)
    geo = dict(padding=[1, 1, 1], stride=[1, 1, 1], dilation=[1, 1, 1])
    if direction == "fprop":
        X, W = g.tensor_like(x), g.tensor_like(wt)
        Y = g.conv_fprop(image=X, weight=W, **geo)
        y = torch.empty_like(dy)
        Y.set_output(True).set_data_type(BF16).set_dim(list(y.shape)).set_stride(list(y.stride()))
        pack = {X: x, W: wt, Y: y}
    elif direction == "dgrad":
        DY, W = g.tensor_like(dy), g.tensor_like(wt)
        DX = g.conv_dgrad(loss=DY, filter=W, **geo)
        dx = torch.empty_like(x)
        DX.set_output(True).set_data_type(BF16).set_dim(list(dx.shape)).set_stride(list(dx.stride()))
        pack = {DY: dy, W: wt, DX: dx}
    else:
        X, DY = g.tensor_like(x), g.tensor_like(dy)
        DW = g.conv_wgrad(image=X, loss=DY, **geo)
        dw = torch.empty_like(wt)
        DW.set_output(True).set_data_type(BF16).set_dim(list(dw.shape)).set_stride(list(dw.stride()))
        pack = {X: x, DY: dy, DW: dw}
    g.validate()
    g.build_operation_graph()
    return g, pack


def time_all(g, pack, handle, iters):
    """[(ms, plan name, index)] for every plan of `g` that builds and runs."""
    out = []
    for i in range(g.get_execution_plan_count()):
        try:
            g.build_plan_at_index(i)
            out.append((plan_ms(g, pack, i, handle, iters), g.get_plan_name_at_index(i), i))
        except Exception:  # noqa: BLE001 -- a plan that does not build or run is skipped
            continue
    return sorted(out)


# cudnnBackendKnobType_t, the numbers in plan names (cudnn_backend.h); the frontend's Python enum
# numbers its knob types differently, so settings go by name.
BACKEND_KNOBS = ("SPLIT_K SWIZZLE TILE_SIZE USE_TEX EDGE KBLOCK LDGA LDGB CHUNK_K SPLIT_H WINO_TILE MULTIPLY "
                 "SPLIT_K_BUF TILEK STAGES REDUCTION_MODE CTA_SPLIT_K_MODE SPLIT_K_SLC IDX_MODE SLICED SPLIT_RS "
                 "SINGLEBUFFER LDGC SPECFILT KERNEL_CFG WORKSPACE TILE_CGA TILE_CGA_M TILE_CGA_N BLOCK_SIZE "
                 "OCCUPANCY ARRAY_SIZE_PER_THREAD NUM_C_PER_BLOCK SPLIT_COLS TILE_ROWS TILE_COLS LOAD_SIZE").split()


def knobs_of(name):
    """Engine id and knob settings {knob name: value} from a plan name like 'eng12_k2=3_k27=8'."""
    m = re.match(r"eng(\d+)", name)
    eng = int(m.group(1)) if m else None
    return eng, {BACKEND_KNOBS[int(t)]: int(v) for t, v in re.findall(r"k(\d+)=(-?\d+)", name)
                 if int(t) < len(BACKEND_KNOBS)}


def grid_of(g, pack, i, handle):
    """Launch grid(s) of plan i's kernels (torch.profiler, one run)."""
    ws = torch.empty(max(1, g.get_workspace_size_plan_at_index(i)), dtype=torch.uint8, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        g.execute_plan_at_index(pack, ws, i, handle=handle)
        torch.cuda.synchronize()
    path = f"/tmp/probe-trace-{time.time_ns()}.json"
    prof.export_chrome_trace(path)
    tr = json.load(open(path))
    return [(e["name"][:90], e.get("args", {}).get("grid"), round(e.get("dur", 0) / 1000, 3))
            for e in tr.get("traceEvents", []) if e.get("cat") == "kernel"]


def sample(lo, hi, step, extra):
    vals = list(range(lo, hi + 1, max(1, step)))
    if len(vals) > 16:
        idx = sorted({round(j * (len(vals) - 1) / 15) for j in range(16)})
        vals = [vals[j] for j in idx]
    return sorted(set(vals) | {v for v in extra if lo <= v <= hi})


def probe(shape, handle, iters):
    direction, n, c, d, h, w, k = shape
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # 1. the heuristics' plans
    g, pack = make_graph(direction, n, c, d, h, w, k, handle)
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    heur = time_all(g, pack, handle, iters)
    res = {"conv": f"{direction} {n}x{c}x{d}x{h}x{w} -> {k}", "heuristic_plans": len(heur)}
    if not heur:
        return res
    res["heuristic_best"] = {"ms": round(heur[0][0], 4), "plan": heur[0][1]}
    res["heuristic_first3"] = [{"ms": round(t, 4), "plan": p} for t, p, _ in heur[:3]]
    res["heuristic_best_grid"] = grid_of(g, pack, heur[0][2], handle)
    # 2. one knob at a time around the best plan of each of the three fastest engines
    engines = []
    for _, name, _ in heur:
        e, kn = knobs_of(name)
        if e is not None and e not in [x[0] for x in engines]:
            engines.append((e, kn))
        if len(engines) == 3:
            break
    g2, pack2 = make_graph(direction, n, c, d, h, w, k, handle)
    tried, knob_info = 0, {}
    for e, base in engines:
        try:
            knobs = g2.get_knobs_for_engine(e)
        except Exception as ex:  # noqa: BLE001
            knob_info[e] = f"no knobs: {str(ex).splitlines()[0][:120]}"
            continue
        knob_info[e] = [(str(kb.type), int(kb.type), kb.min_value, kb.max_value, kb.stride) for kb in knobs]
        names = {str(kb.type).split(".")[-1] for kb in knobs}
        variants = [dict(base)]
        for kb in knobs:
            kn = str(kb.type).split(".")[-1]
            extra = [sms, 2 * sms, sms // 2] if kn == "CTA_COUNT" else []
            for v in sample(kb.min_value, kb.max_value, kb.stride, extra):
                variants.append({**base, kn: v})
        # the thread-block cluster shape, jointly (the heuristics' pick, 8 x 1, fits 15 clusters = 120
        # CTAs on a 132-SM H200)
        if {"TILE_CGA_M", "TILE_CGA_N"} <= names:
            for m in (1, 2, 4, 8):
                for nn in (1, 2, 4):
                    variants.append({**base, "TILE_CGA_M": m, "TILE_CGA_N": nn})
        errors = {}
        for setting in variants:
            try:
                g2.create_execution_plan(e, {getattr(cudnn.knob_type, kn): kv for kn, kv in setting.items()})
                tried += 1
            except Exception as ex:  # noqa: BLE001 -- an invalid combination; the first reasons are kept
                m = str(ex).strip().splitlines()
                if len(errors) < 3:
                    errors[str(setting)] = (m[0] if m else type(ex).__name__)[:200]
        if errors:
            knob_info[f"{e} errors"] = errors
    try:
        g2.check_support()
    except Exception:  # noqa: BLE001
        pass
    var = time_all(g2, pack2, handle, iters)
    res.update({"engines": [e for e, _ in engines], "knobs": knob_info, "variants_created": tried,
                "variants_ran": len(var)})
    if var:
        res["variant_best"] = {"ms": round(var[0][0], 4), "plan": var[0][1]}
        res["variant_top10"] = [{"ms": round(t, 4), "plan": p} for t, p, _ in var[:10]]
        res["variant_best_grid"] = grid_of(g2, pack2, var[0][2], handle)
        res["speedup_vs_heuristic_best"] = round(heur[0][0] / var[0][0], 4)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", type=int, default=len(SHAPES))
    ap.add_argument("--only", default="", help="comma-separated indices into the shape list")
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    print(json.dumps({"torch": torch.__version__, "cudnn_backend": getattr(cudnn, "backend_version", lambda: "?")(),
                      "frontend": getattr(cudnn, "__version__", "?"), "gpu": torch.cuda.get_device_name(),
                      "sms": torch.cuda.get_device_properties(0).multi_processor_count}), flush=True)
    rows = []
    pick = [SHAPES[int(i)] for i in a.only.split(",")] if a.only else SHAPES[: a.shapes]
    for shape in pick:
        t0 = time.time()
        try:
            r = probe(shape, handle, a.iters)
        except Exception as ex:  # noqa: BLE001 -- reported, the next shape still runs
            r = {"conv": str(shape), "error": str(ex).splitlines()[0][:300]}
        r["probe_s"] = round(time.time() - t0, 1)
        torch.cuda.empty_cache()
        print(json.dumps(r), flush=True)
        rows.append(r)
    print(f"{'convolution':>34} {'heuristic best ms':>18} {'variant best ms':>16} {'speedup':>8}  grids (heuristic | variant)")
    for r in rows:
        hb, vb = r.get("heuristic_best", {}).get("ms"), r.get("variant_best", {}).get("ms")
        gh = [x[1] for x in r.get("heuristic_best_grid", [])]
        gv = [x[1] for x in r.get("variant_best_grid", [])]
        print(f"{r['conv']:>34} {hb or '-':>18} {vb or '-':>16} {r.get('speedup_vs_heuristic_best', '-'):>8}  {gh} | {gv}")


if __name__ == "__main__":
    main()
