"""Tiny ``torch.save`` files for the Rust PyTorch-checkpoint reader (crates/meddpm/src/checkpoint/torch.rs).

What it writes (into OUTDIR, default testdata/torch):
  * ``micro_ckpt.pt``: a Med-DDPM-shaped training checkpoint {'step': 123, 'model': sd, 'ema': sd2}
    where sd/sd2 are GaussianDiffusion state dicts (13 schedule buffers + ``denoise_fn.*``) of the
    MICRO config below, with different random values; tensors live on cuda:0 when a GPU is present
    (so the storages carry the 'cuda:0' location tag, like the released checkpoints).
  * ``micro_bare.pt``: a bare UNet state dict (no ``denoise_fn.`` prefix) of the NANO config,
    CPU storages.
  * ``misc.pt``: an OrderedDict exercising the format: transposed / sliced (offset + strides) /
    expanded (stride 0) tensors, two tensors sharing one storage at different offsets, float64,
    float16, bfloat16, int64, int32, uint8 and bool tensors, a 0-d scalar, an empty tensor and an
    ``nn.Parameter``.
  * ``legacy.pt``: a pre-1.6 (non-zip) torch.save file, which the reader must reject clearly.
  * ``expected.safetensors``: for every tensor above the expected values as contiguous float32
    (``t.float()`` of the original), under ``<file stem>/<dict>/<key>`` with dict "model", "ema"
    or "" (bare); the schedule buffers of "ema" equal those of "model" and are stored once.
    In micro_ckpt the two dicts' schedule buffers are the same tensors, so the file holds each
    buffer storage once and both dicts reference it. "order" lists the keys of micro_ckpt/model and misc; micro_ckpt/ema has the same order as
    model, micro_bare the UNet's parameter order. The bare dict keeps the ``_metadata`` attribute
    that ``state_dict()`` attaches (a pickle BUILD on the OrderedDict); the checkpoint's dicts
    are plain OrderedDicts. Metadata "order" (JSON {stem: {dict: [keys in file order]}}), "steps"
    (JSON {stem: step or null}), "micro_config" (JSON, UNetConfig field names).

Why: reference data for the reader's tests, written by PyTorch itself (spec §4.1).
"""

import argparse
import json
import os
import sys
from collections import OrderedDict

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import medddpm_ref as ref  # noqa: E402

MICRO = dict(depth=4, size=4, in_channels=3, out_channels=1, model_channels=2, channel_mult=[1, 1],
             num_res_blocks=1, attention_ds=[2], num_heads=1, groups=2)
# The bare file only needs to differ in layout (no prefix, no buffers): one level, 2 -> 1 channels.
NANO = dict(depth=2, size=2, in_channels=2, out_channels=1, model_channels=2, channel_mult=[1],
            num_res_blocks=1, attention_ds=[], num_heads=1, groups=2)


def random_diffusion(seed, cfg=MICRO):
    torch.manual_seed(seed)
    d = ref.GaussianDiffusion(ref.UNetModel(cfg), timesteps=250)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    return d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="testdata/torch")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    expected, order, steps = {}, {}, {}

    def record(stem, dname, sd, skip=(), keep_order=True):
        if keep_order:
            order.setdefault(stem, {})[dname] = list(sd.keys())
        for k, v in sd.items():
            if k not in skip:
                expected[f"{stem}/{dname}/{k}"] = v.detach().cpu().float().contiguous().clone()

    sd = OrderedDict((k, v.to(dev)) for k, v in random_diffusion(1).state_dict().items())
    sd2 = OrderedDict((k, v.to(dev)) for k, v in random_diffusion(2).state_dict().items())
    for k in ref.schedule_buffers(250):  # share the buffer storages between the two dicts
        sd2[k] = sd[k]
    torch.save({"step": 123, "model": sd, "ema": sd2}, os.path.join(a.out, "micro_ckpt.pt"))
    record("micro_ckpt", "model", sd)
    # the 13 buffers are the same in both dicts: stored once (under "model")
    record("micro_ckpt", "ema", sd2, skip=set(ref.schedule_buffers(250)), keep_order=False)
    steps["micro_ckpt"] = 123

    bare = random_diffusion(3, NANO).denoise_fn.state_dict()
    torch.save(bare, os.path.join(a.out, "micro_bare.pt"))
    record("micro_bare", "", bare, keep_order=False)
    steps["micro_bare"] = None

    g = torch.Generator().manual_seed(9)
    big = torch.randn(12, generator=g)
    misc = OrderedDict()
    misc["transposed"] = torch.randn(3, 4, generator=g).t()
    misc["sliced"] = torch.randn(4, 6, generator=g)[1:, ::2]
    misc["expanded"] = torch.randn(3, 1, generator=g).expand(3, 4)
    misc["shared_a"] = big[0:5]
    misc["shared_b"] = big[5:12].view(7, 1)
    misc["f64"] = torch.randn(2, 3, generator=g, dtype=torch.float64)
    misc["f16"] = torch.randn(5, generator=g).half()
    misc["bf16"] = torch.randn(5, generator=g).bfloat16()
    misc["i64"] = torch.arange(-3, 3, dtype=torch.int64).reshape(2, 3)
    misc["i32"] = torch.arange(4, dtype=torch.int32)
    misc["u8"] = torch.tensor([0, 7, 255], dtype=torch.uint8)
    misc["bool"] = torch.tensor([True, False, True])
    misc["scalar"] = torch.tensor(2.5)
    misc["empty"] = torch.zeros(0, 3)
    misc["param"] = torch.nn.Parameter(torch.randn(2, 2, generator=g))
    assert not misc["transposed"].is_contiguous() and not misc["sliced"].is_contiguous()
    assert misc["sliced"].storage_offset() > 0
    torch.save(misc, os.path.join(a.out, "misc.pt"))
    record("misc", "", misc)
    steps["misc"] = None

    try:
        torch.save({"w": torch.ones(2)}, os.path.join(a.out, "legacy.pt"),
                   _use_new_zipfile_serialization=False)
    except Exception as e:  # the legacy writer may be gone in some torch version
        print(f"legacy.pt not written: {e}")

    meta = {"order": json.dumps(order), "steps": json.dumps(steps),
            "micro_config": json.dumps({f: MICRO[f] for f in ref.CONFIG_FIELDS}),
            "nano_config": json.dumps({f: NANO[f] for f in ref.CONFIG_FIELDS}),
            "torch_version": torch.__version__, "device": dev}
    save_file(expected, os.path.join(a.out, "expected.safetensors"), metadata=meta)
    total = 0
    for f in sorted(os.listdir(a.out)):
        s = os.path.getsize(os.path.join(a.out, f))
        total += s
        print(f"{a.out}/{f}: {s} bytes")
    print(f"fixtures total {total} bytes, micro UNet params {ref.param_count(random_diffusion(1).denoise_fn)}, "
          f"storages on {dev}, torch {torch.__version__}")
    assert total < 300_000


if __name__ == "__main__":
    main()
