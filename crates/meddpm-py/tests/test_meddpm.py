"""The Python package on the CPU with the bundled demo model (32³) at a few sampler steps."""

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import meddpm

REPO = Path(__file__).resolve().parents[3]
MASK = REPO / "testdata" / "demo" / "mask" / "demo_0.nii.gz"


@pytest.fixture(scope="module")
def model():
    return meddpm.load(device="cpu")


@pytest.fixture(scope="module")
def mask():
    nib = pytest.importorskip("nibabel")
    return nib.load(str(MASK))


def test_load_names_the_bundled_model(model):
    assert "bundled demo model" in model.source
    assert model.size == (32, 32, 32)
    assert len(model.checkpoint_hash) == 32
    assert model.device == "cpu"


def test_precision_follows_the_device():
    # "auto" (the default) on the CPU is the fp32 reference, and says so; an explicit choice wins
    auto = meddpm.load(device="cpu")
    assert auto.precision == "fp32"
    assert auto.precision_reason.startswith("precision fp32 (default on the CPU")
    asked = meddpm.load(device="cpu", precision="bf16")
    assert (asked.precision, asked.precision_reason) == ("bf16", "precision bf16 (asked: precision=)")
    with pytest.raises(meddpm.MeddpmError, match="expected auto, fp32, tf32 or bf16"):
        meddpm.load(device="cpu", precision="fp16")


def test_sample_numpy_in_numpy_out(model, mask):
    labels = np.asarray(mask.get_fdata(), dtype=np.float32)
    img = model.sample(labels, steps=2, seed=3)
    assert isinstance(img, np.ndarray) and img.dtype == np.float32
    assert img.shape == labels.shape
    assert np.isfinite(img).all() and img.min() >= -1.0 and img.max() <= 1.0


def test_sample_nibabel_image_returns_its_affine(model, mask):
    img, affine = model.sample(mask, steps=2, seed=3)
    assert img.shape == mask.shape
    np.testing.assert_array_equal(affine, mask.affine)
    # the same volume as from the array (same seed)
    same = model.sample(np.asarray(mask.get_fdata()), steps=2, seed=3)
    np.testing.assert_array_equal(img, same)


def test_a_volume_is_the_same_in_a_batch(model, mask):
    a = np.asarray(mask.get_fdata(), dtype=np.float32)
    batched = model.sample([a, a], steps=2, seed=10, batch=2, sampler="ipndm")
    alone = [model.sample(a, steps=2, seed=s, sampler="ipndm") for s in (10, 11)]
    for b, s in zip(batched, alone):
        np.testing.assert_array_equal(b, s)
    assert not np.array_equal(batched[0], batched[1])


def test_engine_errors_are_meddpm_errors_with_the_cli_message(model, tmp_path):
    a = np.zeros((32, 32, 32), np.float32)
    with pytest.raises(meddpm.MeddpmError, match="unknown sampler"):
        model.sample(a, sampler="euler")
    with pytest.raises(meddpm.MeddpmError, match="nope.pt"):
        meddpm.load(tmp_path / "nope.pt")
    with pytest.raises(meddpm.MeddpmError, match="3-D"):
        model.sample(np.zeros((4, 4), np.float32))
    assert issubclass(meddpm.MeddpmError, RuntimeError)


def test_nothing_silent_a_wrong_size_or_another_schedule_is_an_error(model, mask):
    labels = np.asarray(mask.get_fdata(), dtype=np.float32)
    small = labels[::2, ::2, ::2]
    with pytest.raises(meddpm.MeddpmError, match=r"16×16×16.*32×32×32.*resize"):
        model.sample(small, steps=2)
    img = model.sample(small, steps=2, resize=True)
    assert img.shape == small.shape
    with pytest.raises(meddpm.MeddpmError, match="T = 250"):
        model.sample(labels, timesteps=1)


def test_cuda_without_a_device_is_a_clear_error():
    try:
        m = meddpm.load(device="cuda")
    except meddpm.MeddpmError as e:
        assert "no CUDA device" in str(e)
    else:  # a machine with a GPU
        assert m.device == "cuda:0"


def test_the_gil_is_released_while_sampling(model, mask):
    a = np.asarray(mask.get_fdata(), dtype=np.float32)
    done = threading.Event()
    t = threading.Thread(target=lambda: (model.sample(a, steps=6), done.set()))
    ticks = 0
    t.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    t.join()
    assert ticks > 20, f"the main thread ran {ticks} times while sampling"


def test_synthesize_nnunet_then_resume(tmp_path):
    kw = dict(format="nnunet", count=3, augment=1, steps=2, batch=2, dataset_id=9, dataset_name="Py")
    s = meddpm.synthesize(tmp_path, **kw)
    root = Path(s["root"])
    assert root == tmp_path / "Dataset009_Py"
    assert (s["planned"], s["sampled"], s["skipped"]) == (3, 3, 0)
    ds = json.loads((root / "dataset.json").read_text())
    assert ds["numTraining"] == 3 and ds["file_ending"] == ".nii.gz" and ds["channel_names"] == {"0": "T1"}
    assert sorted(os.listdir(root / "labelsTr")) == [f"synth_0000{i}.nii.gz" for i in range(3)]
    lines = [json.loads(l) for l in (root / "meddpm_manifest.jsonl").read_text().splitlines()]
    assert [l["seed"] for l in lines] == [0, 1, 2]
    again = meddpm.synthesize(tmp_path, **kw)
    assert (again["sampled"], again["skipped"]) == (0, 3)


def test_synthesize_errors_name_the_folder(tmp_path):
    with pytest.raises(meddpm.MeddpmError, match="synthesizing into"):
        meddpm.synthesize(tmp_path, format="nnunet", masks=[tmp_path / "missing.nii.gz"], steps=2)
    with pytest.raises(meddpm.MeddpmError, match="unknown format"):
        meddpm.synthesize(tmp_path, format="nifti")


def test_train_is_not_in_the_package_yet():
    with pytest.raises(NotImplementedError):
        meddpm.train()
