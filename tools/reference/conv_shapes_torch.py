"""Per-shape cuDNN convolution timings through PyTorch (cudnn.benchmark, cuDNN's graph API with
its engine autotuning): every Conv3d of the Med-DDPM U-Net, forward, data gradient and weight
gradient, bf16 (or --precision tf32) in channels_last_3d (or --layout ncdhw).

Why: meddpm drives cuDNN through its legacy API (cudnnFind over 8 algorithms); PyTorch reaches the
same library through the graph API, which can pick other engine configurations. This script says
per shape what that route gets, to compare with the CUPTI times in `meddpm profile`'s kernels.csv.

Prints one JSON line per shape and a table: shape, uses per forward, ms fwd / dgrad / wgrad.
"""

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import medddpm_ref as ref  # noqa: E402


def timeit(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="whole-head", choices=["whole-head", "brats", "tiny"])
    ap.add_argument("--precision", default="bf16", choices=["bf16", "tf32"])
    ap.add_argument("--layout", default="ndhwc", choices=["ndhwc", "ncdhw"])
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    cfg = {"whole-head": ref.WHOLE_HEAD, "brats": ref.BRATS, "tiny": ref.TINY}[a.preset]
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    dev = torch.device("cuda")
    dt = torch.bfloat16 if a.precision == "bf16" else torch.float32
    fmt = torch.channels_last_3d if a.layout == "ndhwc" else torch.contiguous_format
    shapes = {}

    def hook(m, inp, out):
        x = inp[0]
        k = (tuple(x.shape), m.out_channels, m.kernel_size[0], m.stride[0], m.padding[0])
        shapes[k] = shapes.get(k, 0) + 1

    # the shapes: one forward of the real model (no_grad, autocast as the bench runs it)
    mnet = ref.UNetModel(cfg, use_checkpoint=False).to(dev).to(memory_format=fmt)
    for m in mnet.modules():
        if isinstance(m, torch.nn.Conv3d):
            m.register_forward_hook(hook)
    x = torch.randn(1, cfg["in_channels"], cfg["depth"], cfg["size"], cfg["size"], device=dev)
    t = torch.zeros(1, dtype=torch.long, device=dev)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
        mnet(x.contiguous(memory_format=fmt), t)
    del mnet, x
    torch.cuda.empty_cache()
    rows = []
    tot = [0.0, 0.0, 0.0]
    for (xs, co, k, s, p), uses in sorted(shapes.items(), key=lambda kv: -kv[0][0][2] * kv[0][0][1]):
        xin = torch.randn(xs, device=dev, dtype=dt).contiguous(memory_format=fmt)
        w = (torch.randn(co, xs[1], k, k, k, device=dev, dtype=dt) * 0.05).contiguous(memory_format=fmt)
        y = F.conv3d(xin, w, None, s, p)
        dy = torch.randn_like(y).contiguous(memory_format=fmt)
        fwd = timeit(lambda: F.conv3d(xin, w, None, s, p), a.iters)
        bw = torch.ops.aten.convolution_backward
        dgr = timeit(lambda: bw(dy, xin, w, None, [s] * 3, [p] * 3, [1] * 3, False, [0] * 3, 1,
                                [True, False, False]), a.iters)
        wgr = timeit(lambda: bw(dy, xin, w, None, [s] * 3, [p] * 3, [1] * 3, False, [0] * 3, 1,
                                [False, True, False]), a.iters)
        r = {"x": list(xs), "cout": co, "k": k, "s": s, "uses": uses, "fwd_ms": fwd, "dgrad_ms": dgr,
             "wgrad_ms": wgr, "tflops_fwd": 2 * y.numel() * xs[1] * k ** 3 / fwd / 1e9}
        print(json.dumps(r), flush=True)
        rows.append(r)
        tot[0] += fwd * uses
        tot[1] += dgr * uses
        tot[2] += wgr * uses
        del xin, w, y, dy
        torch.cuda.empty_cache()
    print(f"{'input':>22} {'cout':>4} k s uses {'fwd':>7} {'dgrad':>7} {'wgrad':>7} TF/s")
    for r in rows:
        print(f"{str(tuple(r['x'])):>22} {r['cout']:>4} {r['k']} {r['s']} {r['uses']:>4} {r['fwd_ms']:7.3f} "
              f"{r['dgrad_ms']:7.3f} {r['wgrad_ms']:7.3f} {r['tflops_fwd']:5.0f}")
    print(f"sum over one forward's uses: fwd {tot[0]:.2f} ms, dgrad {tot[1]:.2f} ms, wgrad {tot[2]:.2f} ms "
          f"(torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {a.precision} {a.layout})")


if __name__ == "__main__":
    main()
