"""PyTorch side of `meddpm bench --torch`: times our PyTorch re-implementation of Med-DDPM
(tools/reference/medddpm_ref.py, the reference's UNetModel + GaussianDiffusion) at full size, in
the same configurations as the Rust bench, and prints one JSON object on stdout.

What is timed (same definitions as crates/meddpm-cli/src/bench.rs):
  * train micro-step: draw t and noise, q_sample, forward, L1 loss, backward, Adam step, zero_grad;
  * sampling forward: one denoiser forward under torch.no_grad();
median of --iters CUDA-synchronised wall times after --warmup iterations.
Configurations: --precision fp32 = TF32 off everywhere (cuDNN and matmul); tf32 = PyTorch's default
(cuDNN TF32 on, matmul TF32 off); bf16 = the default plus torch.autocast(bfloat16) around forward
and loss, as a user adds it; --layout ndhwc = model and input in torch.channels_last_3d;
--compile = torch.compile(denoise_fn) (minutes of compilation before the timed iterations).
Peak memory: torch.cuda.max_memory_allocated over the training iterations (the caching allocator's
own accounting; excludes the CUDA context and cuDNN's library memory), and the whole process's
device memory (cudaMemGetInfo total - free) after training, the figure meddpm bench reports.
The reference's AttentionBlock gradient checkpointing is kept on (use_checkpoint=True), except
under bf16 autocast, where its custom autograd function fails: there attention runs plainly.
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import medddpm_ref as ref  # noqa: E402

PRESETS = {"whole-head": ref.WHOLE_HEAD, "brats": ref.BRATS, "tiny": ref.TINY}


def timed(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts), ts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="whole-head", choices=sorted(PRESETS))
    ap.add_argument("--config", help="UNetConfig as JSON (overrides --preset)")
    ap.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "bf16"])
    ap.add_argument("--compile", action="store_true", help="torch.compile the denoiser")
    ap.add_argument("--layout", default="ncdhw", choices=["ncdhw", "ndhwc"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-train", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "torch.cuda is not available"}))
        return 1
    cfg = json.loads(a.config) if a.config else PRESETS[a.preset]
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = a.precision in ("tf32", "bf16")
    torch.backends.cuda.matmul.allow_tf32 = False
    fmt = torch.channels_last_3d if a.layout == "ndhwc" else torch.contiguous_format
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bf16 = a.precision == "bf16"
    diff = ref.GaussianDiffusion(ref.UNetModel(cfg, use_checkpoint=not bf16)).to(dev).to(memory_format=fmt)
    if a.compile:
        diff.denoise_fn = torch.compile(diff.denoise_fn)
    net = diff.denoise_fn
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else (lambda: contextlib.nullcontext())
    shape = (1, cfg["out_channels"], cfg["depth"], cfg["size"], cfg["size"])
    cshape = (1, cfg["in_channels"] - cfg["out_channels"], cfg["depth"], cfg["size"], cfg["size"])
    x0 = torch.randn(shape, device=dev).contiguous(memory_format=fmt)
    cond = torch.randn(cshape, device=dev).contiguous(memory_format=fmt)
    out = {"precision": a.precision, "layout": a.layout, "compile": a.compile, "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name(0),
           "params": ref.param_count(net)}

    with torch.no_grad():
        xin = torch.cat([x0, cond], 1).contiguous(memory_format=fmt)
        t = torch.tensor([100], device=dev)
        def fwd():
            with amp():
                net(xin, t)

        t0 = time.perf_counter()
        fwd()
        torch.cuda.synchronize()
        out["first_fwd_s"] = time.perf_counter() - t0
        out["fwd_ms"], out["fwd_all_ms"] = timed(fwd, a.warmup, a.iters)

    if not a.no_train:
        opt = torch.optim.Adam(net.parameters(), lr=1e-5)

        def step():
            tt = torch.randint(0, diff.num_timesteps, (1,), device=dev)
            noise = torch.randn_like(x0)
            with amp():
                loss = diff.p_losses(x0, cond, tt, noise)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        torch.cuda.reset_peak_memory_stats()
        out["train_ms"], out["train_all_ms"] = timed(step, a.warmup, a.iters)
        out["train_peak_bytes"] = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        out["process_used_bytes"] = total - free
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
