"""meddpm: Med-DDPM (mask-conditioned 3D brain-MRI diffusion) from Python.

    import meddpm
    m = meddpm.load("model_128.pt", device="cuda")   # or None: the bundled demo model
    image = m.sample(mask, steps=50, seed=0)                           # numpy in, numpy out
    image, affine = m.sample(nib.load("mask.nii.gz"), steps=50)        # a nibabel image: the affine too
    meddpm.synthesize("raw", format="nnunet", masks=["masks/"], augment=4, count=100)
    meddpm.train(out="runs/mine", preset="whole-head", masks="M/", images=["I/"], steps=100_000)

Arrays are NIfTI-ordered (X, Y, Z), as nibabel's ``get_fdata()`` returns them. The work runs in
Rust with the GIL released; engine errors raise :class:`MeddpmError` with the CLI's message.
"""

from __future__ import annotations

import numpy as np

from ._meddpm import MeddpmError, __version__
from ._meddpm import Model as _NativeModel
from ._meddpm import synthesize as _synthesize
from ._meddpm import train as _train

__all__ = ["MeddpmError", "Model", "load", "synthesize", "train", "__version__"]


def load(path=None, device="cpu", precision="auto", layout="ndhwc", weights="ema", size=None):
    """Load weights: a meddpm checkpoint or safetensors state dict, or a reference ``.pt`` file
    (None: the demo model bundled into this build). ``device``: "cpu", "cuda", "cuda:N" or "auto";
    ``precision``: "auto" (bf16 on GPUs with bf16 tensor cores, sm_80+; TF32 on older GPUs; fp32
    on the CPU), "fp32", "tf32" or "bf16"; ``size``: (D, H=W) to sample at another size."""
    return Model(path, device, precision, layout, weights, size)


def _is_nibabel(x):
    return hasattr(x, "affine") and hasattr(x, "get_fdata")


def _to_bytes(mask):
    a = np.asarray(mask, dtype=np.float32)
    if a.ndim != 3:
        raise MeddpmError(f"a mask is a 3-D array (X, Y, Z), got shape {a.shape}")
    return a.astype("<f4").tobytes(order="F"), tuple(int(n) for n in a.shape)


def _from_bytes(b, dims):
    return np.frombuffer(b, dtype="<f4").reshape(dims, order="F").copy()


class Model:
    """A loaded model (see :func:`load`)."""

    def __init__(self, path=None, device="cpu", precision="auto", layout="ndhwc", weights="ema", size=None):
        self._m = _NativeModel(None if path is None else str(path), device, precision, layout, weights, size)

    source = property(lambda self: self._m.source, doc="where the weights came from")
    checkpoint_hash = property(lambda self: self._m.checkpoint_hash, doc="XXH3-128 of the checkpoint file")
    size = property(lambda self: self._m.size, doc="(D, H, W) the model samples at")
    device = property(lambda self: self._m.device, doc="cpu or cuda:N")
    precision = property(lambda self: self._m.precision, doc="fp32, tf32 or bf16: what sampling uses")
    precision_reason = property(lambda self: self._m.precision_reason, doc="which precision, and why")

    def __repr__(self):
        return f"meddpm.Model({self.source!r}, device={self.device!r})"

    def sample(self, mask, steps=None, sampler="ddpm", seed=0, batch=1, timesteps=None, eta=0.0,
               convention="whole-head", resize=False):
        """One volume per mask. ``mask``: a numpy array (X, Y, Z) of labels or a nibabel image,
        or a list of them (mask k draws from seed ``seed + k``; ``batch`` volumes per forward,
        each the same as alone). Returns a float32 array on the mask's grid, values in [-1, 1]
        (BraTS: (4, X, Y, Z), the modalities); ``(array, affine)`` for a nibabel image; a list
        for a list. A mask of another size than the model's volumes raises ``MeddpmError`` unless
        ``resize=True``; ``timesteps`` defaults to the model's T (another T raises)."""
        many = isinstance(mask, (list, tuple))
        masks = list(mask) if many else [mask]
        affines = [m.affine if _is_nibabel(m) else None for m in masks]
        arrays = [m.get_fdata(dtype=np.float32) if _is_nibabel(m) else m for m in masks]
        outs = self._m._sample([_to_bytes(a) for a in arrays], steps=steps, sampler=sampler, seed=seed,
                            batch=batch, timesteps=timesteps, eta=eta, convention=convention,
                            resize=resize)
        results = []
        for per, affine in zip(outs, affines):
            images = [_from_bytes(b, dims) for (_suffix, b, dims, is_label) in per if not is_label]
            img = images[0] if len(images) == 1 else np.stack(images)
            results.append(img if affine is None else (img, affine))
        return results if many else results[0]


def synthesize(out, format="nnunet", masks=(), checkpoint=None, **kw):
    """``meddpm synthesize``: a synthetic (image, label) dataset from masks, in nnU-Net v2,
    MONAI or plain layout, resumable, with a manifest line per pair. Keywords as the command's
    flags (``augment``, ``count``, ``seed``, ``sampler``, ``steps``, ``batch``, ``dataset_id``,
    ``dataset_name``, ``device``, ``precision``, ...). Returns a summary dict."""
    return _synthesize(str(out), format=format, masks=[str(m) for m in masks],
                       checkpoint=None if checkpoint is None else str(checkpoint), **kw)


def train(out=None, resume=None, masks=None, images=(), manifest=None, **kw):
    """``meddpm train``: a new run into ``out`` (default ``runs/demo``; no data: the built-in
    demo), or ``resume=".../checkpoint.safetensors"`` to continue a run exactly (other keywords
    then override its settings, as the command's flags do). Keywords as the command's flags:
    ``preset`` ("demo", "tiny", "whole-head", "brats"; required with ``masks``/``manifest``),
    ``convention``, ``steps``, ``lr``, ``grad_accum``, ``batch``, ``seed``, ``checkpoint_every``,
    ``sample_at_end``, ``preview_every`` ("auto", 0: off, or N steps), ``resize``, ``device``,
    ``precision`` ("auto": bf16 on sm_80+ GPUs, TF32 before, fp32 on the CPU), ``layout``,
    ``verbose`` (print the log lines). The GIL is released while it trains; Ctrl-C finishes the
    step, saves the checkpoint and returns with ``outcome == "stopped"``. Returns a dict:
    ``outcome`` ("finished" or "stopped"), ``start``/``step``, ``checkpoint``, ``loss_csv``,
    ``progress`` (the previews page), ``previews``, ``samples``, ``precision``, ``log``. A
    diverged run raises ``MeddpmError`` naming the step and the checkpoint kept."""
    p = lambda x: None if x is None else str(x)
    if "preview_every" in kw:
        kw["preview_every"] = str(kw["preview_every"])
    return _train(out=p(out), resume=p(resume), masks=p(masks), images=[str(i) for i in images],
                  manifest=p(manifest), **kw)
