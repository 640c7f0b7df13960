"""The MONAI example (examples/monai_dataset.py) runs: synthetic pairs through a DataLoader into
a MONAI U-Net with Dice+CE. Skipped where torch or MONAI is not installed (CI installs neither:
see .ci/python.sh)."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (CI leaves it out: its Linux wheel is 539 MB and pulls the CUDA wheels)")
pytest.importorskip("monai", reason="MONAI is not installed")
pytest.importorskip("nibabel")


def test_monai_training_loop_on_synthetic_pairs():
    path = Path(__file__).resolve().parents[1] / "examples" / "monai_dataset.py"
    spec = importlib.util.spec_from_file_location("monai_dataset", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["monai_dataset"] = mod
    spec.loader.exec_module(mod)
    losses = mod.main(iterations=1, steps=2)
    assert len(losses) == 2 and all(l == l and l > 0 for l in losses)
    item = mod.SyntheticPairs(mod.meddpm.load(), [__import__("nibabel").load(str(path.parents[3] / "testdata/demo/mask/demo_0.nii.gz"))], 1, steps=2)[0]
    assert item["image"].shape == item["label"].shape == (1, 32, 32, 32)
