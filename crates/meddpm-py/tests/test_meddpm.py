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


def _main_thread_ticks_while(work):
    """How often the main thread ran (about every millisecond) while `work` ran on another thread:
    many times only if `work` released the GIL."""
    done = threading.Event()
    t = threading.Thread(target=lambda: (work(), done.set()))
    ticks = 0
    t.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    t.join()
    return ticks


def test_the_gil_is_released_while_sampling(model, mask):
    a = np.asarray(mask.get_fdata(), dtype=np.float32)
    ticks = _main_thread_ticks_while(lambda: model.sample(a, steps=6))
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


# ---- meddpm.train: the command's run from Python (tiny model, CPU, a few steps) -------------


def _tiny(out, **kw):
    kw.setdefault("steps", 4)
    kw.setdefault("preview_every", 0)
    return meddpm.train(out=out, preset="tiny", device="cpu", sample_at_end=False, verbose=False, **kw)


def test_train_runs_resumes_and_keeps_its_previews(tmp_path):
    run = tmp_path / "run"
    r = _tiny(run, preview_every=2)
    assert (r["outcome"], r["start"], r["step"], r["previews"]) == ("finished", 0, 4, 2)
    assert r["precision"] == "fp32"
    assert r["log"][0].startswith("meddpm train on CPU reference") and "precision fp32 (default on the CPU" in r["log"][0]
    assert Path(r["checkpoint"]).is_file() and Path(r["loss_csv"]).is_file()
    assert sorted(p.name for p in (run / "previews").iterdir()) == ["step_000002.png", "step_000004.png"]
    assert Path(r["progress"]).read_text().count("<figure>") == 2
    # a resume continues the run in its folder, with its previews
    r2 = meddpm.train(resume=r["checkpoint"], steps=6, preview_every=2, device="cpu", verbose=False)
    assert (r2["outcome"], r2["start"], r2["step"]) == ("finished", 4, 6)
    assert sorted(p.name for p in (run / "previews").iterdir())[-1] == "step_000006.png"
    assert len((run / "loss.csv").read_text().splitlines()) == 1 + 6


def test_train_is_the_command(tmp_path):
    # the same run from the CLI and from Python: the same losses, bit for bit
    import subprocess
    exe = os.environ.get("MEDDPM_BIN") or str(REPO / "target" / "release" / "meddpm")
    if not Path(exe).is_file():
        pytest.skip(f"no meddpm binary at {exe} (cargo build --release, or MEDDPM_BIN)")
    _tiny(tmp_path / "py")
    subprocess.run([exe, "train", "--preset", "tiny", "--device", "cpu", "--no-sample", "--steps", "4",
                    "--preview-every", "0", "--out", str(tmp_path / "cli")], check=True, capture_output=True)
    assert (tmp_path / "py" / "loss.csv").read_text() == (tmp_path / "cli" / "loss.csv").read_text()


def test_ctrl_c_saves_and_returns_stopped(tmp_path):
    import _thread
    timer = threading.Timer(1.5, _thread.interrupt_main)
    timer.start()
    try:
        r = _tiny(tmp_path / "run", steps=1_000_000, checkpoint_every=0)
    finally:
        timer.cancel()
    assert r["outcome"] == "stopped" and 0 < r["step"] < 1_000_000
    assert Path(r["checkpoint"]).is_file()
    r2 = meddpm.train(resume=r["checkpoint"], steps=r["step"] + 1, device="cpu", verbose=False)
    assert (r2["outcome"], r2["step"]) == ("finished", r["step"] + 1)


def test_train_refuses_bad_settings(tmp_path):
    with pytest.raises(meddpm.MeddpmError, match="preview_every"):
        _tiny(tmp_path / "a", preview_every="soon")
    with pytest.raises(meddpm.MeddpmError, match="preset="):
        meddpm.train(out=str(tmp_path / "b"), masks=str(tmp_path), images=[str(tmp_path)], verbose=False)
    with pytest.raises(meddpm.MeddpmError, match="steps = 0"):
        _tiny(tmp_path / "c", steps=0)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_gil_is_released_while_training(tmp_path):
    ticks = _main_thread_ticks_while(lambda: _tiny(tmp_path / "run", steps=30))
    assert ticks > 20, f"the main thread ran {ticks} times while training"
