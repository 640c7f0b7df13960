"""Can cuDNN's graph API fuse Med-DDPM's GroupNorm+SiLU into its 3D convolutions? A probe.

What: for every 3×3×3 stride-1 convolution shape of the U-Net (bf16, channels-last), builds cuDNN
graphs through the cuDNN frontend's Python bindings (package nvidia-cudnn-frontend, not part of
PyTorch) and times every execution plan cuDNN offers, median of --iters:
  plain      conv_fprop                                   (the baseline, = PyTorch's cuDNN conv)
  prologue   conv_fprop(swish(x * s + b))                 (GroupNorm+SiLU at batch 1 is a per-
                                                           channel scale and shift, then SiLU)
  genstats   conv_fprop -> per-channel Σy, Σy²            (the next GroupNorm's statistics)
  pro+stats  both
  wgrad      conv_wgrad(x, dy)           and  wgrad-pro  conv_wgrad(swish(x * s + b), dy)
  pro-relu, pro-affine   the prologue with ReLU / without an activation (is Swish the obstacle?)
Prints one JSON line per (shape, graph): supported or cuDNN's reason, the best plan's time, the
number of plans tried, and for the fused graphs the largest error against PyTorch's unfused ops.

Why: issue 12's 41 / 13 ms targets leave ~10 / ~2 ms for everything that is not a convolution;
the GroupNorm+SiLU passes before each conv are most of what is left. cuDNN's generic runtime-fusion
engines are documented to take pointwise ops ahead of the convolution's main loop; whether they do
so for 3D, bf16, NDHWC with Swish, and how fast the fused kernels are next to the tuned standalone
ones, is only known by asking the library on the real shapes. Run on the GPU machine:
    PYTHONPATH=<unpacked wheel> python3 tools/reference/cudnn_fusion_probe.py [--shapes N]
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import medddpm_ref as ref  # noqa: E402

import cudnn  # noqa: E402  (nvidia-cudnn-frontend)

BF16 = cudnn.data_type.BFLOAT16
F32 = cudnn.data_type.FLOAT


def conv_shapes(cfg):
    """Distinct 3×3×3 stride-1 conv inputs of one forward: (input shape, cout) -> uses."""
    shapes = {}

    def hook(m, inp, out):
        if m.kernel_size[0] == 3 and m.stride[0] == 1 and m.in_channels >= 8:
            k = (tuple(inp[0].shape), m.out_channels)
            shapes[k] = shapes.get(k, 0) + 1

    net = ref.UNetModel(cfg, use_checkpoint=False).cuda().to(memory_format=torch.channels_last_3d)
    for m in net.modules():
        if isinstance(m, torch.nn.Conv3d):
            m.register_forward_hook(hook)
    x = torch.randn(1, cfg["in_channels"], cfg["depth"], cfg["size"], cfg["size"], device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        net(x.contiguous(memory_format=torch.channels_last_3d), torch.zeros(1, dtype=torch.long, device="cuda"))
    del net
    torch.cuda.empty_cache()
    return sorted(shapes.items(), key=lambda kv: -(kv[0][0][1] * kv[0][0][2] ** 3))


def plan_ms(graph, pack, i, handle, iters):
    """Median ms of plan i (built) over `iters` runs after two warm-up runs (CUDA events)."""
    ws = torch.empty(max(1, graph.get_workspace_size_plan_at_index(i)), dtype=torch.uint8, device="cuda")
    run = lambda: graph.execute_plan_at_index(pack, ws, i, handle=handle)  # noqa: E731
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def time_plans(graph, pack, handle, iters):
    """Every plan cuDNN built for the graph: (best ms, plans that ran, first error)."""
    best, ran, err = float("inf"), 0, None
    for i in range(graph.get_execution_plan_count()):
        try:
            best = min(best, plan_ms(graph, pack, i, handle, iters))
            ran += 1
        except Exception as e:  # noqa: BLE001 -- a plan that fails to run is reported, not fatal
            err = err or str(e).splitlines()[0][:200]
    return best, ran, err


def build(graph):
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans(cudnn.build_plan_policy.ALL)


def probe(kind, xs, cout, handle, iters):
    n, c, d, h, w = xs
    cl = torch.channels_last_3d
    x = (torch.randn(xs, device="cuda") * 0.5).to(torch.bfloat16).contiguous(memory_format=cl)
    wt = (torch.randn(cout, c, 3, 3, 3, device="cuda") * 0.03).to(torch.bfloat16).contiguous(memory_format=cl)
    sc = (1.0 + 0.1 * torch.randn(1, c, 1, 1, 1, device="cuda")).contiguous(memory_format=cl)
    sh = (0.1 * torch.randn(1, c, 1, 1, 1, device="cuda")).contiguous(memory_format=cl)
    g = cudnn.pygraph(io_data_type=BF16, intermediate_data_type=F32, compute_data_type=F32, handle=handle)
    X = g.tensor_like(x)
    pack = {X: x}
    inp = X
    pro = kind in ("prologue", "pro+stats", "wgrad-pro", "pro-relu", "pro-affine")
    act = {"pro-relu": F.relu, "pro-affine": lambda t: t}.get(kind, F.silu)
    if pro:
        S, B = g.tensor_like(sc), g.tensor_like(sh)
        pack[S], pack[B] = sc, sh
        inp = g.add(a=g.mul(a=X, b=S), b=B)
        if kind == "pro-relu":
            inp = g.relu(input=inp)
        elif kind != "pro-affine":
            inp = g.swish(input=inp)
    ref_in = act(x.float() * sc + sh) if pro else x.float()
    out = {}
    if kind.startswith("wgrad"):
        dy = (torch.randn(n, cout, d, h, w, device="cuda") * 0.1).to(torch.bfloat16).contiguous(memory_format=cl)
        DY = g.tensor_like(dy)
        pack[DY] = dy
        DW = g.conv_wgrad(image=inp, loss=DY, padding=[1, 1, 1], stride=[1, 1, 1], dilation=[1, 1, 1])
        dw = torch.empty(cout, c, 3, 3, 3, device="cuda", dtype=torch.float32).contiguous(memory_format=cl)
        DW.set_output(True).set_data_type(F32).set_dim(list(dw.shape)).set_stride(list(dw.stride()))
        pack[DW] = dw
        out["dw"] = (dw, lambda: torch.ops.aten.convolution_backward(
            dy.float(), ref_in, wt.float(), None, [1] * 3, [1] * 3, [1] * 3, False, [0] * 3, 1,
            [False, True, False])[1])
    else:
        W = g.tensor_like(wt)
        pack[W] = wt
        Y = g.conv_fprop(image=inp, weight=W, padding=[1, 1, 1], stride=[1, 1, 1], dilation=[1, 1, 1])
        y = torch.empty(n, cout, d, h, w, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=cl)
        Y.set_output(True).set_data_type(BF16)
        pack[Y] = y
        yref = lambda: F.conv3d(ref_in, wt.float(), None, 1, 1)  # noqa: E731
        out["y"] = (y, yref)
        if kind in ("genstats", "pro+stats"):
            SUM, SQ = g.genstats(input=Y)
            s1 = torch.empty(1, cout, 1, 1, 1, device="cuda").contiguous(memory_format=cl)
            s2 = torch.empty_like(s1)
            SUM.set_output(True).set_data_type(F32)
            SQ.set_output(True).set_data_type(F32)
            pack[SUM], pack[SQ] = s1, s2
            out["sum"] = (s1, lambda: yref().sum(dim=(2, 3, 4), keepdim=True))
    t0 = time.time()
    build(g)
    build_s = time.time() - t0
    ms, ran, err = time_plans(g, pack, handle, iters)
    errs = {}
    if ran:
        g.execute(pack, torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device="cuda"), handle=handle)
        torch.cuda.synchronize()
        for k, (got, want) in out.items():
            want = want()
            errs[k] = float((got.float() - want).abs().max() / (want.abs().max() + 1e-12))
    return {"ms": ms if ran else None, "plans": g.get_execution_plan_count(), "ran": ran, "build_s": round(build_s, 2),
            "rel_err": errs, "plan_error": err}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="whole-head", choices=["whole-head", "brats", "tiny"])
    ap.add_argument("--shapes", type=int, default=99, help="largest N shapes only")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--kinds", default="plain,prologue,genstats,pro+stats,wgrad,wgrad-pro")
    a = ap.parse_args()
    cfg = {"whole-head": ref.WHOLE_HEAD, "brats": ref.BRATS, "tiny": ref.TINY}[a.preset]
    handle = cudnn.create_handle()
    print(json.dumps({"torch": torch.__version__, "cudnn_backend": getattr(cudnn, "backend_version", lambda: "?")(),
                      "frontend": getattr(cudnn, "__version__", "?"), "gpu": torch.cuda.get_device_name()}), flush=True)
    rows = []
    for (xs, cout), uses in conv_shapes(cfg)[: a.shapes]:
        for kind in a.kinds.split(","):
            r = {"x": list(xs), "cout": cout, "uses": uses, "kind": kind}
            try:
                r.update(probe(kind, xs, cout, handle, a.iters))
            except Exception as e:  # noqa: BLE001 -- "not supported" is a result here
                msg = str(e).strip().splitlines()
                r.update({"ms": None, "error": (msg[0] if msg else type(e).__name__)[:300]})
                if os.environ.get("PROBE_TRACE"):
                    traceback.print_exc()
            torch.cuda.empty_cache()
            print(json.dumps(r), flush=True)
            rows.append(r)
    print(f"{'input':>22} {'cout':>4} {'kind':>10} {'ms':>8}  note")
    for r in rows:
        ms = f"{r['ms']:8.3f}" if r.get("ms") else "       -"
        note = r.get("error") or (f"{r['ran']}/{r['plans']} plans, err {r['rel_err']}" if "ran" in r else "")
        print(f"{str(tuple(r['x'])):>22} {r['cout']:>4} {r['kind']:>10} {ms}  {note}")


if __name__ == "__main__":
    main()
