"""Golden files for the Rust engine, computed with the PyTorch reference in float64.

What it writes (into OUTDIR, default testdata/golden):
  * ``tiny.safetensors`` (UNetConfig::tiny(), N=2) and ``tiny_heads2.safetensors`` (2 heads,
    2 res blocks, attention at ds 1 and 2, non-cubic 8x4x4 volume, N=2). Keys:
      param.<key>  every UNet parameter (state-dict key without ``denoise_fn.``)
      grad.<key>   d loss / d param
      x (N,in,D,H,W), t (N,) float timesteps, eps (N,out,D,H,W), out (N,out,D,H,W), loss (1,)
      sched.<name> the 13 GaussianDiffusion buffers for T=250 (float32, as in a checkpoint)
    metadata: "config" (JSON, UNetConfig field names), "batch", "loss", "dtype", "seed",
    "f32_out_max_abs_diff" (float32 vs float64 forward, a tolerance hint).
    loss = mean |out - eps| (L1, spec §3.2). All parameters are random: PyTorch default init, then
    GroupNorm affine and the zero-initialised convs (out_layers.3, proj_out, out.2) are overwritten
    with random values so that no gradient path is hidden. Parameters and inputs are rounded to
    float32 first; forward/backward run in float64; results are stored as float32. Size is
    dominated by params + grads (8 bytes per parameter): tiny (184,649 parameters) is 1.5 MB,
    tiny_heads2 (162,049) 1.4 MB.
  * ``keys_whole_head.txt`` and ``keys_brats.txt``: one ``<key> <d0>,<d1>,...`` line per tensor
    of a real GaussianDiffusion state dict (13 buffers, then ``denoise_fn.*``), in order.

Why: independent reference values for the engine's forward, backward and schedule, and the exact
key/shape list of the released checkpoints (spec §4.2).

Optional cross-check (``--orig DIR``, DIR holding mobaidoctor/med-ddpm's ``diffusion_model``
package): the original UNet, loaded with the same state dict, must give the same forward output
and gradients in float32 and the same key/shape lists for the two real configs.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import medddpm_ref as ref  # noqa: E402


def randomize_all(model, gen):
    """Every parameter random-ish: GN affine near (1, 0); zero-initialised convs get the default
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)) instead of zeros."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.GroupNorm):
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=gen))
            elif isinstance(m, (torch.nn.Conv1d, torch.nn.Conv3d, torch.nn.Linear)):
                if torch.all(m.weight == 0):
                    fan_in = m.weight[0].numel()
                    b = 1.0 / fan_in ** 0.5
                    m.weight.copy_((torch.rand(m.weight.shape, generator=gen) * 2 - 1) * b)
                    m.bias.copy_((torch.rand(m.bias.shape, generator=gen) * 2 - 1) * b)
    for name, p in model.named_parameters():
        assert not torch.all(p == 0), f"{name} still all zero"


def build_random(cfg, seed):
    torch.manual_seed(seed)
    model = ref.UNetModel(cfg)
    randomize_all(model, torch.Generator().manual_seed(seed + 1))
    return model


def make_inputs(cfg, batch, seed):
    g = torch.Generator().manual_seed(seed + 2)
    d, s = cfg["depth"], cfg["size"]
    x = torch.randn((batch, cfg["in_channels"], d, s, s), generator=g)
    eps = torch.randn((batch, cfg["out_channels"], d, s, s), generator=g)
    t = torch.tensor([3.0, 247.0, 125.0, 0.0][:batch], dtype=torch.float32)
    return x, t, eps


def run_case(model, x, t, eps):
    """Forward, L1 loss, backward; returns (out, loss, {key: grad})."""
    model.zero_grad(set_to_none=True)
    dt = model.time_embed[0].weight.dtype
    out = model(x.to(dt), t.to(dt))
    loss = (out - eps.to(dt)).abs().mean()
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    return out.detach(), loss.detach(), grads


def golden(cfg, batch, seed, path):
    model = build_random(cfg, seed)  # float32 parameters
    x, t, eps = make_inputs(cfg, batch, seed)
    out32, _, _ = run_case(model, x, t, eps)
    m64 = build_random(cfg, seed).double()  # identical values, exactly widened
    out, loss, grads = run_case(m64, x, t, eps)
    f32_diff = (out32.double() - out).abs().max().item()

    tensors = {}
    for k, p in model.state_dict().items():
        tensors[f"param.{k}"] = p.detach().float().contiguous()
    for k, g in grads.items():
        tensors[f"grad.{k}"] = g.float().contiguous()
    tensors["x"], tensors["t"], tensors["eps"] = x.contiguous(), t.contiguous(), eps.contiguous()
    tensors["out"] = out.float().contiguous()
    tensors["loss"] = loss.float().reshape(1)
    for name, v in ref.schedule_buffers(250).items():
        tensors[f"sched.{name}"] = torch.tensor(v, dtype=torch.float32)
    meta = {
        "config": json.dumps({f: cfg[f] for f in ref.CONFIG_FIELDS}),
        "batch": str(batch),
        "loss": "mean(|out - eps|) over all N*C*D*H*W elements",
        "dtype": "params/x/t/eps are float32 values; forward+backward in float64; results rounded to float32",
        "seed": str(seed),
        "timesteps": "250",
        "f32_out_max_abs_diff": f"{f32_diff:.3e}",
    }
    save_file(tensors, path, metadata=meta)
    size = os.path.getsize(path)
    print(f"{path}: {len(tensors)} tensors, {size} bytes, params {ref.param_count(model)}, "
          f"loss {loss.item():.9f}, out[0..4] {out.flatten()[:4].tolist()}, f32 vs f64 out {f32_diff:.2e}")
    # params + grads in float32 dominate: 8 bytes per parameter (tiny: 184,649 -> 1.48 MB)
    assert size < 8 * ref.param_count(model) + 200_000, f"{path} is {size} bytes"
    return model, x, t, eps, out32


def key_list(cfg, path, expect_params):
    diff = ref.GaussianDiffusion(ref.UNetModel(cfg), timesteps=250)
    n = ref.param_count(diff.denoise_fn)
    sd = diff.state_dict()
    with open(path, "w") as f:
        for k, v in sd.items():
            f.write(f"{k} {','.join(str(d) for d in v.shape)}\n")
    print(f"{path}: {len(sd)} keys, UNet params {n:,} (expected {expect_params:,})")
    assert n == expect_params, f"param count {n} != {expect_params}"
    return diff.denoise_fn


def cross_check(orig_dir, cases, full_models):
    """Compare with the original med-ddpm code (float32, CPU)."""
    sys.path.insert(0, orig_dir)
    import diffusion_model.modules as om
    import diffusion_model.unet as ou
    import diffusion_model.unet_brats as oub

    # real configs: keys and shapes identical
    for (name, mine), builder in zip(full_models, [
            lambda: ou.create_model(128, 64, 1, in_channels=3, out_channels=1),
            lambda: oub.create_model(192, 64, 2, in_channels=8, out_channels=4)]):
        theirs = builder()
        a = [(k, tuple(v.shape)) for k, v in mine.state_dict().items()]
        b = [(k, tuple(v.shape)) for k, v in theirs.state_dict().items()]
        print(f"cross-check {name}: keys+shapes identical in order: {a == b} ({len(a)} tensors)")
        assert a == b

    # tiny configs: patch the hard-wired 32 groups, load our state dict, compare in float32
    for cfg, model, x, t, eps, out_mine in cases:
        g = cfg["groups"]
        norm = lambda c: om.GroupNorm32(g, c)  # noqa: E731
        om.normalization = norm
        ou.normalization = norm
        theirs = ou.UNetModel(image_size=cfg["size"], in_channels=cfg["in_channels"],
                              model_channels=cfg["model_channels"], out_channels=cfg["out_channels"],
                              num_res_blocks=cfg["num_res_blocks"],
                              attention_resolutions=tuple(cfg["attention_ds"]),
                              channel_mult=tuple(cfg["channel_mult"]), num_heads=cfg["num_heads"])
        theirs.load_state_dict(model.state_dict(), strict=True)
        out_t = theirs(x, t)
        loss_t = (out_t - eps).abs().mean()
        loss_t.backward()
        model.zero_grad(set_to_none=True)
        out_m = model(x, t)
        (out_m - eps).abs().mean().backward()
        d_out = (out_t - out_m).abs().max().item()
        gm = dict(model.named_parameters())
        d_grad = max(((p.grad - gm[k].grad).abs().max() / (gm[k].grad.abs().max() + 1e-30)).item()
                     for k, p in theirs.named_parameters())
        print(f"cross-check tiny heads={cfg['num_heads']}: float32 out max|diff| {d_out:.2e}, "
              f"max rel grad diff {d_grad:.2e}")
        assert d_out < 1e-5 and d_grad < 1e-4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="testdata/golden")
    ap.add_argument("--orig", default=None, help="folder holding med-ddpm's diffusion_model package")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    cases = []
    for cfg, name, seed in [(ref.TINY, "tiny", 1234), (ref.TINY_HEADS2, "tiny_heads2", 5678)]:
        model, x, t, eps, out32 = golden(cfg, 2, seed, os.path.join(a.out, f"{name}.safetensors"))
        cases.append((cfg, model, x, t, eps, out32))
    wh = key_list(ref.WHOLE_HEAD, os.path.join(a.out, "keys_whole_head.txt"), 40_226_433)
    br = key_list(ref.BRATS, os.path.join(a.out, "keys_brats.txt"), 57_562_564)
    if a.orig:
        cross_check(a.orig, cases, [("whole_head", wh), ("brats", br)])


if __name__ == "__main__":
    main()
