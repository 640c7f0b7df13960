"""Full-size PyTorch reference for the GPU comparison of issue 5 (scripts/gpu/torch_full.sh).

What: for each model (whole-head 128^3, BraTS 144x192x192, or a reduced size with --size for a
CPU dry run) it builds our PyTorch re-implementation of Med-DDPM (medddpm_ref.py) with random
weights -- every parameter random, the three zero-initialised convs included (re-initialised
with PyTorch's default init) and the GroupNorm affine parameters perturbed -- and writes
  <name>.pt          torch.save({'step': 1000, 'model': sd_model, 'ema': sd_ema}) where both are
                     GaussianDiffusion state dicts ('denoise_fn.' keys + the 13 schedule buffers),
                     as a released Med-DDPM checkpoint; 'model' = -'ema' on every U-Net tensor
                     (so that a loader taking the wrong group is caught);
  <name>_io.safetensors  x (1, in, D, H, W) ~ N(0, 1), t (1,) as float, and out = UNet_ema(x, t)
                     in float32 with TF32 OFF (cuDNN and matmul); metadata 'unet' (UNetConfig
                     JSON, the key meddpm's Checkpoint::read parses), 'torch', 'device', 'seconds'.
Why: meddpm must load the released .pt files and reproduce PyTorch's forward (issue 5).
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import medddpm_ref as ref  # noqa: E402


def randomise(model, seed):
    """Default PyTorch init for every conv/linear (undoing zero_module), random GN affine."""
    torch.manual_seed(seed)
    for m in model.modules():
        if isinstance(m, (nn.Conv1d, nn.Conv3d, nn.Linear)):
            m.reset_parameters()
        elif isinstance(m, nn.GroupNorm):
            with torch.no_grad():
                m.weight.copy_(1.0 + 0.1 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    assert all(p.abs().max() > 0 for p in model.parameters())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="whole_head,brats")
    ap.add_argument("--size", default=None, help="D,S: reduced volume (CPU dry run)")
    ap.add_argument("--channels", type=int, default=None, help="model_channels (CPU dry run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--t", type=int, default=137)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    for name in a.models.split(","):
        t0 = time.time()
        cfg = dict({"whole_head": ref.WHOLE_HEAD, "brats": ref.BRATS}[name])
        if a.size:
            cfg["depth"], cfg["size"] = (int(v) for v in a.size.split(","))
        if a.channels:
            cfg["model_channels"] = a.channels
            cfg["groups"] = min(cfg["groups"], a.channels)
        unet = ref.UNetModel(cfg)
        randomise(unet, seed=1 if name == "whole_head" else 2)
        diff = ref.GaussianDiffusion(unet, timesteps=250)
        sd = diff.state_dict()
        ema = {k: v.clone() for k, v in sd.items()}
        model = {k: (-v if k.startswith("denoise_fn.") else v.clone()) for k, v in sd.items()}
        torch.save({"step": 1000, "model": model, "ema": ema}, os.path.join(a.out, f"{name}.pt"))
        g = torch.Generator().manual_seed(7)
        x = torch.randn(1, cfg["in_channels"], cfg["depth"], cfg["size"], cfg["size"], generator=g)
        t = torch.tensor([a.t], dtype=torch.long)
        unet = unet.to(a.device).eval()
        with torch.no_grad():
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
            tf = time.time()
            out = unet(x.to(a.device), t.to(a.device))
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
            tf = time.time() - tf
        out = out.float().cpu().contiguous()
        meta = {"unet": json.dumps({f: cfg[f] for f in ref.CONFIG_FIELDS}), "torch": torch.__version__,
                "device": a.device, "forward_seconds": f"{tf:.3f}"}
        save_file({"x": x.contiguous(), "t": t.float(), "out": out},
                  os.path.join(a.out, f"{name}_io.safetensors"), metadata=meta)
        print(f"{name}: {cfg['depth']}x{cfg['size']}x{cfg['size']} params {ref.param_count(unet)}, "
              f"out rms {out.pow(2).mean().sqrt().item():.4g}, forward {tf:.2f} s on {a.device} (TF32 off), "
              f"total {time.time() - t0:.1f} s", flush=True)
        del unet, diff, sd, ema, model, out
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
