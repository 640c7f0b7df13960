"""Round trip of `meddpm convert`: torch.save (Med-DDPM-shaped {'step','model','ema'}) -> meddpm convert
-> safetensors -> PyTorch load_state_dict(strict=True) -> forward identical to the torch.load'ed EMA
weights. Full-size whole-head and BraTS checkpoints (random weights, 0.3 / 0.46 GB, written to WORK)
and the micro fixture; also the --diffusion-keys variant into GaussianDiffusion.

Usage: python3 tools/reference/roundtrip_convert.py path/to/meddpm [WORK]   (needs torch, safetensors)
"""
import os
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import medddpm_ref as ref  # noqa: E402

B = sys.argv[1]
W = sys.argv[2] if len(sys.argv) > 2 else "/tmp/meddpm-roundtrip"
os.makedirs(W, exist_ok=True)
torch.manual_seed(0)
def check(name, cfg, pt, extra, sp):
    out = f"{W}/{name}.safetensors"
    t0 = time.time()
    r = subprocess.run([B, "convert", pt, out] + extra, capture_output=True, text=True)
    dt = time.time() - t0
    print(name, "convert rc", r.returncode, f"{dt:.1f}s", r.stdout.strip()[:200], r.stderr.strip()[:300])
    assert r.returncode == 0
    sd = load_file(out)
    m = ref.UNetModel(cfg); m.load_state_dict(sd, strict=True)
    ck = torch.load(pt, map_location="cpu")
    d = ck["ema"] if "ema" in ck else ck
    m2 = ref.UNetModel(cfg); m2.load_state_dict({k.removeprefix("denoise_fn."): v for k, v in d.items() if k.startswith("denoise_fn.") or "." in k}, strict=True)
    x = torch.randn(1, cfg["in_channels"], *sp); t = torch.tensor([17.0])
    with torch.no_grad():
        a, b = m(x, t), m2(x, t)
    print(name, "strict load_state_dict ok; forward max|diff|", (a - b).abs().max().item())
    assert torch.equal(a, b)
    # GaussianDiffusion keys variant
    r = subprocess.run([B, "convert", pt, out + ".gd", "--diffusion-keys"] + extra, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    gd = ref.GaussianDiffusion(ref.UNetModel(cfg)); gd.load_state_dict(load_file(out + ".gd"), strict=True)
    print(name, "GaussianDiffusion strict load ok; buffer max|diff|",
          max((gd.state_dict()[k] - ref.GaussianDiffusion(ref.UNetModel(cfg)).state_dict()[k]).abs().max().item() for k in ["betas", "posterior_mean_coef2"]))

for name, cfg, sp in [("whole_head", ref.WHOLE_HEAD, (16, 16, 16)), ("brats", ref.BRATS, (16, 32, 32))]:
    pt = f"{W}/{name}.pt"
    if not os.path.exists(pt):
        g1, g2 = ref.GaussianDiffusion(ref.UNetModel(cfg)), ref.GaussianDiffusion(ref.UNetModel(cfg))
        for p in list(g1.parameters()) + list(g2.parameters()):
            with torch.no_grad(): p.normal_(0, 0.02)
        torch.save({"step": 100000, "model": g1.state_dict(), "ema": g2.state_dict()}, pt)
    print(name, "pt size MB", os.path.getsize(pt) / 1e6)
    check(name, cfg, pt, [], sp)
check("micro", dict(ref.TINY, model_channels=2, channel_mult=[1, 1], groups=2, depth=4, size=4),
      os.path.join(HERE, "../../testdata/torch/micro_ckpt.pt"), ["--depth", "4", "--size", "4", "--groups", "2"], (4, 4, 4))
