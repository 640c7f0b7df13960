"""One forward (or training step) of the PyTorch Med-DDPM reference, for `meddpm profile` (issue 4).

What: builds ``medddpm_ref.UNetModel`` for a preset (whole-head by default) on CUDA, runs
``--warmup`` unrecorded forwards (cudnn.benchmark picks algorithms there), then ONE recorded forward
inside the NVTX push/pop range ``forward`` (``train`` with ``--train``: forward, L1 loss, backward).

Why: the reference and meddpm are compared category by category in the same report:
  * under Nsight Compute:
      meddpm profile --nvtx-include forward/ --out DIR -- python3 tools/reference/profile_torch.py
    (ncu's ``--nvtx-include forward/`` keeps exactly the recorded forward);
  * in-process, with PyTorch's own CUPTI profiler (``--table FILE``): writes the
    ``key_averages().table()`` that ``meddpm profile --torch-table FILE`` reads.

Math follows meddpm's configuration names: ``--math tf32`` (default; cuDNN and matmul TF32 allowed)
or ``fp32``; ``--layout ndhwc`` (channels_last_3d, default) or ``ncdhw``.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import medddpm_ref as ref  # noqa: E402

PRESETS = {"whole-head": ref.WHOLE_HEAD, "brats": ref.BRATS, "tiny": ref.TINY}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="whole-head")
    ap.add_argument("--math", choices=["tf32", "fp32"], default="tf32")
    ap.add_argument("--layout", choices=["ndhwc", "ncdhw"], default="ndhwc")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--train", action="store_true", help="forward + L1 loss + backward instead of a forward")
    ap.add_argument("--table", help="profile in-process with torch.profiler and write the kernel table here")
    a = ap.parse_args()

    cfg = PRESETS[a.preset]
    tf32 = a.math == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = True
    fmt = torch.channels_last_3d if a.layout == "ndhwc" else torch.contiguous_format
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = ref.UNetModel(cfg).to(dev).to(memory_format=fmt)
    x = torch.randn(1, cfg["in_channels"], cfg["depth"], cfg["size"], cfg["size"], device=dev)
    x = x.contiguous(memory_format=fmt)
    t = torch.tensor([125.0], device=dev)
    target = torch.randn(1, cfg["out_channels"], cfg["depth"], cfg["size"], cfg["size"], device=dev)
    name = "train" if a.train else "forward"

    def step():
        if a.train:
            model.zero_grad(set_to_none=True)
            loss = (model(x, t) - target).abs().mean()
            loss.backward()
        else:
            with torch.no_grad():
                model(x, t)

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    if a.table:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=-1)
        with open(a.table, "w") as f:
            f.write(f"# tools/reference/profile_torch.py --preset {a.preset} --math {a.math} --layout {a.layout}"
                    f" ({name}), torch {torch.__version__}, {torch.cuda.get_device_name()}\n")
            f.write(table)
        print(f"profile_torch: wrote {a.table}")
    else:
        torch.cuda.nvtx.range_push(name)
        step()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    print(f"profile_torch: one {name} of {a.preset} ({a.math}, {a.layout}) done")


if __name__ == "__main__":
    main()
