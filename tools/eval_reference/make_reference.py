#!/usr/bin/env python3
"""Reference values for meddpm's synthesis-quality metrics, computed with MONAI itself.

What it does
------------
Builds a few small deterministic 3D volumes, runs MONAI's metric implementations on them and
writes everything needed to check meddpm's Rust port (crates/meddpm/src/eval/) into one JSON file:
the recipe of every volume, checksums of the volumes, and the metric values.

* SSIMMetric / MultiScaleSSIMMetric (spatial_dims=3), PSNRMetric, MAEMetric, MMDMetric from
  `monai.metrics` (MONAI 1.6.1, monai/metrics/regression.py and mmd.py).
* SSIM and MS-SSIM: MONAI casts its inputs to float32 (compute_ssim_and_cs calls
  convert_data_type(..., dtype=torch.float)). Those float32 numbers are THE reference
  ("monai_f32"). To see how close an f64 implementation can get, the same MONAI code is run a
  second time with that cast disabled and torch's default dtype set to float64 (so the Gaussian
  window is also built in f64): "monai_f64". Nothing else in MONAI's code path is changed.
* PSNR, MAE, MMD: MONAI keeps the input dtype, so they are run on float64 copies of the float32
  volumes ("monai_f64") and on float32 ("monai_f32").
* Wasserstein-1 between voxel-intensity distributions per label: not in MONAI; computed with
  scipy.stats.wasserstein_distance. Mean intensity per label: numpy in float64.
* Masked PSNR/MAE: MONAI's metrics applied to the voxels selected by the mask (label != 0),
  passed as a (1, N) tensor.
* The size check of compute_ms_ssim is recorded too: cases where MONAI raises ValueError.

Volumes are NOT stored: every volume is a recipe that numpy and the Rust test evaluate with the
same IEEE-754 float64 operations in the same order (only +, -, *, /), then round to float32:

    v = base
    for (cz, cy, cx, r, a) in blobs:            # z, y, x are voxel indices along D, H, W
        s = ((z - cz)*(z - cz) + (y - cy)*(y - cy)) + (x - cx)*(x - cx)
        v = v + a / (1.0 + s / (r*r))
    if noise != 0: v = v + noise * (u - 0.5)   # u = uniform(seed, linear index)
    value = float32(v)

    uniform(seed, i) = (splitmix64((seed << 32) + i) >> 11) * 2**-53   (wrapping u64 arithmetic)

All recipe parameters are multiples of 1/64 (exact in binary and in short decimal), so a JSON
round-trip changes nothing. Per volume the JSON holds the float64 sum of the float32 voxels and a
few exact voxel values, so a generator mismatch is caught before any metric is compared.

Array layout: a volume is (D, H, W), C-order (W fastest), given to MONAI as (1, 1, D, H, W).
Label maps: labels = (f >= t1) + (f >= t2) where f is the float32 value of a noise-free recipe.

Run (MONAI needs torch; it is a pure-Python wheel):
    python3 make_reference.py --out testdata/eval/reference.json [--device cuda|cpu]
On CUDA, TF32 is switched off so float32 convolutions are true float32.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np

WEIGHTS = (0.0448, 0.2856, 0.3001, 0.2363, 0.1333)
MASK64 = (1 << 64) - 1


# ---------------------------------------------------------------------------------------------
# deterministic volumes


def splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def hash_uniform(seed: int, n: int) -> np.ndarray:
    idx = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = splitmix64(idx + np.uint64((seed << 32) & MASK64))
    return (h >> np.uint64(11)).astype(np.float64) * (2.0**-53)


def make_volume(spec: dict) -> np.ndarray:
    d, h, w = spec["dims"]
    z = np.arange(d, dtype=np.float64)[:, None, None]
    y = np.arange(h, dtype=np.float64)[None, :, None]
    x = np.arange(w, dtype=np.float64)[None, None, :]
    v = np.full((d, h, w), float(spec["base"]), dtype=np.float64)
    for cz, cy, cx, r, a in spec["blobs"]:
        dz, dy, dx = z - cz, y - cy, x - cx
        s = (dz * dz + dy * dy) + dx * dx
        v = v + a / (1.0 + s / (r * r))
    if spec["noise"] != 0:
        u = hash_uniform(int(spec["seed"]), d * h * w).reshape(d, h, w)
        v = v + spec["noise"] * (u - 0.5)
    return v.astype(np.float32)


def make_labels(spec: dict) -> np.ndarray:
    f = make_volume(spec["field"]).astype(np.float64)
    t1, t2 = spec["thresholds"]
    return ((f >= t1).astype(np.uint8) + (f >= t2).astype(np.uint8)).astype(np.uint8)


def q(v: float, step: float = 1.0 / 64.0) -> float:
    return float(np.round(v / step) * step)


def pair_specs(rng, dims, seed, scale=1.0, nblobs=14, noise=0.08, shift=1.5):
    """A 'real' recipe and a related 'generated' recipe (blobs moved/rescaled, other noise)."""
    base = q(0.1 * scale - (scale - 1.0))  # 0.1 for [0,1] data, -0.8 for [-1,1] data
    blobs = []
    for _ in range(nblobs):
        c = [q(rng.uniform(0, n)) for n in dims]
        r = q(rng.uniform(1.5, max(2.0, min(dims) / 3.0)))
        a = q(rng.uniform(-0.25, 0.5) * scale)
        blobs.append([c[0], c[1], c[2], r, a])
    gblobs = []
    for cz, cy, cx, r, a in blobs:
        gblobs.append([q(cz + rng.normal(0, shift)), q(cy + rng.normal(0, shift)), q(cx + rng.normal(0, shift)),
                       q(r * (1 + 0.1 * rng.normal())), q(a * (1 + 0.2 * rng.normal()))])
    real = {"dims": list(dims), "base": base, "blobs": blobs, "noise": q(noise * scale), "seed": seed}
    gen = {"dims": list(dims), "base": base, "blobs": gblobs, "noise": q(noise * scale), "seed": seed + 1}
    return real, gen


def checksum(v: np.ndarray) -> dict:
    flat = v.reshape(-1)
    n = flat.size
    idx = sorted({0, n // 3, n // 2, (2 * n) // 3, n - 1})
    return {"sum": float(flat.astype(np.float64).sum()), "probe_index": idx,
            "probe_value": [float(flat[i]) for i in idx]}


# ---------------------------------------------------------------------------------------------
# MONAI, float32 (as shipped) and float64 (dtype cast disabled)


class F64Mode:
    """Run MONAI's regression code without its float32 cast, with float64 as torch's default."""

    def __init__(self, torch, R):
        self.torch, self.R = torch, R

    def __enter__(self):
        self.orig = self.R.convert_data_type
        orig = self.orig

        def keep_dtype(data, output_type=None, device=None, dtype=None, **kw):
            return orig(data, output_type=output_type, device=device, dtype=None, **kw)

        self.R.convert_data_type = keep_dtype
        self.torch.set_default_dtype(self.torch.float64)
        return self

    def __exit__(self, *a):
        self.R.convert_data_type = self.orig
        self.torch.set_default_dtype(self.torch.float32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    import torch
    import scipy
    import scipy.stats
    import monai
    import monai.metrics.regression as R
    from monai.metrics import MAEMetric, MMDMetric, MultiScaleSSIMMetric, PSNRMetric, SSIMMetric

    dev = args.device if (args.device != "cuda" or torch.cuda.is_available()) else "cpu"
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    t_start = time.time()

    rng = np.random.default_rng(20261130)
    volumes: dict[str, dict] = {}
    arrays: dict[str, np.ndarray] = {}

    def add(name, spec):
        volumes[name] = spec
        arrays[name] = make_volume(spec)

    def add_pair(prefix, dims, seed, scale=1.0, **kw):
        r, g = pair_specs(rng, dims, seed, scale, **kw)
        add(prefix + "_real", r)
        add(prefix + "_gen", g)
        return prefix + "_gen", prefix + "_real"

    def t5(a, dtype):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=dev, dtype=dtype)[None, None]

    def both(fn):
        v32 = fn(torch.float32)
        with F64Mode(torch, R):
            v64 = fn(torch.float64)
        return {"monai_f32": v32, "monai_f64": v64}

    # ---- SSIM ------------------------------------------------------------------------------
    ssim_cases = []

    def ssim_case(name, x, y, k, dr):
        def run(dt):
            m = SSIMMetric(spatial_dims=3, data_range=dr, win_size=k)
            return float(m(t5(arrays[x], dt), t5(arrays[y], dt)).reshape(-1)[0].item())

        ssim_cases.append({"name": name, "x": x, "y": y, "kernel_size": k, "sigma": 1.5, "k1": 0.01, "k2": 0.03,
                           "data_range": dr, **both(run)})

    x, y = add_pair("s16", (16, 16, 16), 11)
    ssim_case("s16_k11", x, y, 11, 1.0)
    x, y = add_pair("saniso", (16, 20, 24), 21, scale=2.0)
    ssim_case("saniso_k7_dr2", x, y, 7, 2.0)
    x, y = add_pair("ssmall", (9, 12, 10), 31, nblobs=5)
    ssim_case("ssmall_k3", x, y, 3, 1.0)
    add("const025_16", {"dims": [16, 16, 16], "base": 0.25, "blobs": [], "noise": 0.0, "seed": 0})
    add("const050_16", {"dims": [16, 16, 16], "base": 0.5, "blobs": [], "noise": 0.0, "seed": 0})
    ssim_case("const_vs_real_k11", "const025_16", "s16_real", 11, 1.0)
    ssim_case("const_vs_const_k11", "const025_16", "const050_16", 11, 1.0)

    # ---- MS-SSIM ---------------------------------------------------------------------------
    ms_cases = []

    def ms_case(name, x, y, k, dr):
        def run(dt):
            m = MultiScaleSSIMMetric(spatial_dims=3, data_range=dr, kernel_size=k, weights=WEIGHTS)
            return float(m(t5(arrays[x], dt), t5(arrays[y], dt)).reshape(-1)[0].item())

        # per-scale means, from MONAI's own compute_ssim_and_cs + avg_pool3d (float32): diagnostics
        xs, ys = t5(arrays[x], torch.float32), t5(arrays[y], torch.float32)
        scales = []
        for _ in WEIGHTS:
            s, c = R.compute_ssim_and_cs(xs, ys, 3, (k, k, k), (1.5, 1.5, 1.5), dr)
            scales.append({"ssim": float(s.mean().item()), "cs": float(c.mean().item())})
            xs = torch.nn.functional.avg_pool3d(xs, kernel_size=2)
            ys = torch.nn.functional.avg_pool3d(ys, kernel_size=2)
        ms_cases.append({"name": name, "x": x, "y": y, "kernel_size": k, "sigma": 1.5, "k1": 0.01, "k2": 0.03,
                         "data_range": dr, "weights": list(WEIGHTS), **both(run), "per_scale_f32": scales})

    x, y = add_pair("m112", (112, 112, 112), 41, nblobs=24)
    ms_case("m112_k7", x, y, 7, 1.0)
    x, y = add_pair("maniso", (115, 121, 128), 51, scale=2.0, nblobs=24)
    ms_case("maniso_k7_dr2", x, y, 7, 2.0)
    x, y = add_pair("m48", (48, 50, 53), 61, nblobs=16, shift=0.75)
    ms_case("m48_k3", x, y, 3, 1.0)
    x, y = add_pair("m176", (176, 176, 176), 71, nblobs=30)
    ms_case("m176_k11", x, y, 11, 1.0)
    # anti-correlated pair: cs < 0 at some scale, MONAI clamps with relu
    anti = dict(volumes["m48_real"])
    anti = {**anti, "base": q(1.0 - anti["base"]), "noise": -anti["noise"],
            "blobs": [[cz, cy, cx, r, -a] for cz, cy, cx, r, a in anti["blobs"]]}
    add("m48_anti", anti)
    ms_case("m48_anti_k3", "m48_anti", "m48_real", 3, 1.0)

    raises = []
    for dims, k in [((111, 112, 112), 7), ((112, 112, 112), 7), ((176, 175, 176), 11), ((47, 48, 48), 3)]:
        try:
            z = torch.zeros((1, 1) + dims, device=dev)
            MultiScaleSSIMMetric(spatial_dims=3, kernel_size=k)(z, z)
            r = False
        except ValueError:
            r = True
        raises.append({"dims": list(dims), "kernel_size": k, "n_weights": 5, "monai_raises": r})

    # ---- PSNR / MAE, whole volume and inside the mask ----------------------------------------
    err_cases = []
    x, y = add_pair("e24", (24, 24, 24), 81)
    field = dict(volumes["e24_real"], noise=0.0)
    f0 = make_volume(field).astype(np.float64)  # thresholds at the 55 % / 90 % quantiles
    labels = {"e24_labels": {"field": field,
                             "thresholds": [q(np.quantile(f0, 0.55)), q(np.quantile(f0, 0.9))]}}
    lab = make_labels(labels["e24_labels"])
    x2, y2 = add_pair("e2", (16, 20, 24), 91, scale=2.0)

    def err_case(name, x, y, max_val, mask_name=None):
        a, b = arrays[x], arrays[y]
        if mask_name is not None:
            sel = make_labels(labels[mask_name]) != 0
            a, b = a[sel], b[sel]

        def run(dt):
            ta = torch.from_numpy(np.ascontiguousarray(a)).to(dev, dt).reshape(1, -1)
            tb = torch.from_numpy(np.ascontiguousarray(b)).to(dev, dt).reshape(1, -1)
            return {"psnr": float(PSNRMetric(max_val)(ta, tb).reshape(-1)[0].item()),
                    "mae": float(MAEMetric()(ta, tb).reshape(-1)[0].item())}

        err_cases.append({"name": name, "x": x, "y": y, "max_val": max_val, "mask": mask_name,
                          "n_voxels": int(a.size), "monai_f32": run(torch.float32), "monai_f64": run(torch.float64)})

    err_case("e24_whole", x, y, 1.0)
    err_case("e24_mask", x, y, 1.0, "e24_labels")
    err_case("e2_whole_dr2", x2, y2, 2.0)

    # ---- MMD (linear kernel) ----------------------------------------------------------------
    mmd_cases = []

    def mmd_case(name, reals, gens):
        def run(dt):
            yr = torch.stack([torch.from_numpy(arrays[n]) for n in reals])[:, None].to(dev, dt)
            yp = torch.stack([torch.from_numpy(arrays[n]) for n in gens])[:, None].to(dev, dt)
            return float(MMDMetric()(yr, yp).reshape(-1)[0].item())

        mmd_cases.append({"name": name, "real": reals, "generated": gens,
                          "monai_f32": run(torch.float32), "monai_f64": run(torch.float64)})

    reals, gens = [], []
    for i in range(3):
        a, b = add_pair(f"mmd{i}", (12, 14, 16), 101 + 10 * i, nblobs=6)
        gens.append(a)
        reals.append(b)
    mmd_case("mmd_3v3", reals, gens)
    mmd_case("mmd_2v2", reals[:2], gens[1:])

    # ---- Wasserstein-1 and mean intensity per label -----------------------------------------
    label_cases = []
    for l in [0, 1, 2, None]:
        sel = np.ones_like(lab, dtype=bool) if l is None else (lab == l)
        a, b = arrays[x][sel].astype(np.float64), arrays[y][sel].astype(np.float64)
        label_cases.append({"x": x, "y": y, "labels": "e24_labels", "label": l, "n_voxels": int(sel.sum()),
                            "w1_scipy": float(scipy.stats.wasserstein_distance(a, b)),
                            "mean_x": float(a.mean()), "mean_y": float(b.mean())})

    out = {
        "generator": "tools/eval_reference/make_reference.py",
        "layout": "volumes are (D,H,W) C-order; MONAI input (1,1,D,H,W); x = y_pred (generated), y = y (real)",
        "versions": {"monai": monai.__version__, "torch": torch.__version__, "numpy": np.__version__,
                     "scipy": scipy.__version__, "python": platform.python_version()},
        "device": dev if dev == "cpu" else f"{dev} ({torch.cuda.get_device_name(0)}), TF32 off",
        "volumes": {k: {"recipe": v, "checksum": checksum(arrays[k])} for k, v in volumes.items()},
        "labels": {k: {**v, "counts": [int((lab == i).sum()) for i in range(3)]} for k, v in labels.items()},
        "ssim": ssim_cases,
        "ms_ssim": ms_cases,
        "ms_ssim_size_check": raises,
        "psnr_mae": err_cases,
        "mmd": mmd_cases,
        "label_stats": label_cases,
        "seconds": round(time.time() - t_start, 1),
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for c in ssim_cases + ms_cases:
        print(f"{c['name']:22s} f32 {c['monai_f32']:.8f}  f64 {c['monai_f64']:.12f}")
    for c in err_cases:
        print(f"{c['name']:22s} {c['monai_f64']}")
    for c in mmd_cases:
        print(f"{c['name']:22s} f32 {c['monai_f32']:.6f}  f64 {c['monai_f64']:.9f}")
    print(raises)
    print(f"done in {out['seconds']} s on {out['device']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
