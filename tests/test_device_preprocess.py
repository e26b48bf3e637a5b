"""RolloutLoader(preprocess_device=...): workers decode, the main process runs the processor.

On the CPU the device stage must give exactly the batches of the worker path (the same
torchvision processor on the same uint8 pixels), plain and packed, any number of workers,
resumed or not; on a GPU the batches' image tensors live there, equal to bf16 precision.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

import mmstore
from mmstore._format.media import decode_rgb_tensor
from mmstore._loading.device import PENDING_KEY, DevicePreprocessor, PendingImage
from mmstore.synth import screenshot
from tests.conftest import SMALL_MAX_PIXELS
from tests.families_common import tiny_model, tiny_qwen2_vl_config
from tests.family_cases import CASES, store_images, write_rows
from tests.test_loader import _refs_of, write_steps
from tests.test_packing import write_mixed

# Per-batch cache counters: the device path has no pixel cache (every image is processed).
STATS = {"cache_hits", "cache_misses", "node_cache_hits", "node_cache_misses"}
NO_CUDA = "preprocessing on a GPU needs CUDA, and torch.cuda.is_available() is False here"


@pytest.fixture(scope="module")
def processor():
    """Qwen2-VL's torchvision backend with a small pixel budget."""
    return Qwen2VLImageProcessor(max_pixels=SMALL_MAX_PIXELS)


@pytest.fixture(scope="module")
def stored(tmp_path_factory, processor):
    """24 rows in GRPO groups of 4 with 0, 1 or 2 images each (320x200 screenshots)."""
    store = mmstore.Store.open(tmp_path_factory.mktemp("device") / "s", create=True)
    write_mixed(store, mmstore.adapter_for(processor), steps=1)
    return store


def batches(store, processor, *, device=None, workers=0, packed=False, **kw):
    ds = mmstore.RolloutDataset(store, processor, seed=5, node_cache_bytes=0)
    shape = {"max_tokens": 700} if packed else {"dummy_image": True}
    loader = mmstore.RolloutLoader(
        ds, batch_size=4, num_workers=workers, preprocess_device=device, **shape, **kw
    )
    return list(loader)


def assert_same_batches(expected, got, *, same_workers=True):
    assert len(expected) == len(got) > 0
    for a, b in zip(expected, got, strict=True):
        assert PENDING_KEY not in b
        assert a.keys() == b.keys()
        for key in a.keys() - STATS:
            if isinstance(a[key], torch.Tensor):
                assert b[key].dtype == a[key].dtype, key
                assert torch.equal(a[key], b[key]), key
            else:
                assert a[key] == b[key], key
        # Every image of the batch (the dummy aside) looked up once; in the same workers, the
        # cache of decoded images hits where the cache of processed ones does: each image
        # decoded once per worker, as it is processed once per worker on the worker path.
        assert b["cache_hits"] + b["cache_misses"] == a["cache_hits"] + a["cache_misses"]
        if same_workers:
            assert (b["cache_hits"], b["cache_misses"]) == (a["cache_hits"], a["cache_misses"])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_equal_the_worker_path(stored, processor, workers, packed):
    expected = batches(stored, processor, workers=workers, packed=packed)
    got = batches(stored, processor, device="cpu", workers=workers, packed=packed)
    assert_same_batches(expected, got)
    assert any(b["pixel_values"] is not None and len(b["pixel_values"]) for b in got)
    if not packed:  # text-only batches: the dummy travels too
        assert any(b["dummy_image"] for b in got)


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_each_distinct_image_of_a_batch_is_processed_once_on_the_device(
    stored, processor, monkeypatch, packed
):
    """GRPO groups share their images: each is decoded once per worker, travels once per
    distinct batch, and is processed once per batch on the device, plain batches too."""
    calls: list[PendingImage] = []
    process = DevicePreprocessor.process
    monkeypatch.setattr(
        DevicePreprocessor,
        "process",
        lambda self, entry: calls.append(entry) or process(self, entry),
    )
    ds = mmstore.RolloutDataset(stored, processor, seed=5, node_cache_bytes=0)
    shape = {"max_tokens": 700} if packed else {}
    runs = {}
    for distinct in (False, True):
        calls.clear()
        loader = mmstore.RolloutLoader(
            ds, batch_size=4, preprocess_device="cpu", distinct_images=distinct, **shape
        )
        runs[distinct] = (list(loader), len(calls))
    (plain, plain_calls), (shared, shared_calls) = runs[False], runs[True]
    distinct_images = sum(len(b["image_rows"].get("pixel_values", ())) for b in shared)
    images = sum(len(b["image_index"]) for b in shared)
    assert plain_calls == shared_calls == distinct_images < images
    for want, batch in zip(plain, shared, strict=True):
        got = mmstore.expand_images(batch)
        for key in ("input_ids", "pixel_values", "image_grid_thw"):
            assert (want[key] is None and got[key] is None) or torch.equal(want[key], got[key])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_resume_gives_the_same_batches(stored, processor, packed):
    full = batches(stored, processor, device="cpu", packed=packed)
    ds = mmstore.RolloutDataset(stored, processor, seed=5, node_cache_bytes=0)
    shape = {"max_tokens": 700} if packed else {"dummy_image": True}
    first = mmstore.RolloutLoader(ds, batch_size=4, preprocess_device="cpu", **shape)
    head = list(itertools.islice(first, 2))
    state = first.state_dict()
    resumed = mmstore.RolloutLoader(
        ds, batch_size=4, num_workers=2, preprocess_device="cpu", **shape
    )
    resumed.load_state_dict(state)
    assert_same_batches(full, head + list(resumed), same_workers=False)


def test_missing_media_become_zero_loss_placeholders(tmp_path, processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    write_steps(store, mmstore.adapter_for(processor), steps=1, groups=2, group_size=2)
    victim = _refs_of(store, ["g0-00000-00"])[1]
    os.unlink(store.backend.abspath(victim["uri"]))
    out = {}
    for device in (None, "cpu"):
        ds = mmstore.RolloutDataset(
            store, processor, shuffle=False, missing="placeholder_zero_loss", node_cache_bytes=0
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[device] = list(mmstore.RolloutLoader(ds, batch_size=2, preprocess_device=device))
        assert any(victim["uri"] in str(w.message) for w in caught)
    assert_same_batches(out[None], out["cpu"])
    batch = next(b for b in out["cpu"] if "g0-00000-00" in b["sample_ids"])
    assert batch["images_missing"] == 2 and not batch["loss_mask"].any()


def test_bad_media_errors_name_the_sample_and_image(tmp_path, processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    write_steps(store, mmstore.adapter_for(processor), steps=1, groups=1, group_size=1)
    ref = _refs_of(store, ["g0-00000-00"])[1]
    with open(store.backend.abspath(ref["uri"]), "r+b") as f:
        data = bytearray(f.read())
        data[-20] ^= 0xFF
        f.seek(0)
        f.write(bytes(data))
    ds = mmstore.RolloutDataset(store, processor, node_cache_bytes=0)
    loader = mmstore.RolloutLoader(ds, batch_size=1, preprocess_device="cpu")
    with pytest.raises(mmstore.HashMismatchError) as err:
        list(loader)
    assert err.value.sample_id == "g0-00000-00" and err.value.image_index == 1
    # raised in a worker, before the device stage: the same error, context attributes too
    loader = mmstore.RolloutLoader(ds, batch_size=1, num_workers=1, preprocess_device="cpu")
    with pytest.raises(mmstore.HashMismatchError) as err:
        list(loader)
    assert err.value.sample_id == "g0-00000-00" and err.value.image_index == 1


def test_a_processor_drifting_from_the_spans_is_refused_on_the_device(tmp_path):
    """The device stage checks each image's output against its span, as workers do."""
    drifting = Qwen2VLImageProcessor(max_pixels=SMALL_MAX_PIXELS)
    store = mmstore.Store.open(tmp_path / "s", create=True)
    write_steps(store, mmstore.adapter_for(drifting), steps=1, groups=1, group_size=1)
    ds = mmstore.RolloutDataset(store, drifting, node_cache_bytes=0)
    loader = mmstore.RolloutLoader(ds, batch_size=1, num_workers=1, preprocess_device="cpu")
    drifting.size = {"shortest_edge": SMALL_MAX_PIXELS * 2, "longest_edge": SMALL_MAX_PIXELS * 4}
    with pytest.raises(mmstore.LayoutMismatchError) as err:
        list(loader)
    assert err.value.sample_id == "g0-00000-00" and err.value.image_index == 0
    assert err.value.run_id == "r1" and err.value.uri


def test_a_grid_other_than_the_workers_is_refused(store, processor):
    """Same token count, other grid: the worker's position ids would be wrong, so the device
    stage refuses output whose integer tensors differ from the layout the worker used."""
    adapter = mmstore.adapter_for(processor)
    media = store.put_image(screenshot(0, 320, 200))
    _, (ref,) = adapter.expand([adapter.image_token_id], [media])
    pixels = decode_rgb_tensor(store.read_media(ref.uri, ref.hash))
    grid = torch.tensor([adapter.grid(320, 200)])
    swapped = grid[:, [0, 2, 1]]
    where = {"sample_id": "s0", "image_index": 0}
    stage = DevicePreprocessor(adapter, torch.device("cpu"), torch.bfloat16)
    good = stage.image(PendingImage(pixels, {"image_grid_thw": grid}, ref, where))
    assert (
        torch.equal(good["image_grid_thw"], grid) and good["pixel_values"].dtype == torch.bfloat16
    )
    with pytest.raises(mmstore.LayoutMismatchError, match="image_grid_thw") as err:
        stage.image(PendingImage(pixels, {"image_grid_thw": swapped}, ref, where))
    assert err.value.sample_id == "s0" and err.value.image_index == 0 and err.value.uri == ref.uri


def test_bad_processors_and_devices_are_refused(stored, processor, small_processor):
    pil = mmstore.RolloutDataset(stored, small_processor)  # the PIL backend
    with pytest.raises(mmstore.InvalidArgumentError, match="torchvision"):
        mmstore.RolloutLoader(pil, preprocess_device="cpu")
    ds = mmstore.RolloutDataset(stored, processor)
    for device in ("nonsense", "meta", 3.5):
        with pytest.raises(mmstore.InvalidArgumentError, match="preprocess_device"):
            mmstore.RolloutLoader(ds, preprocess_device=device)
    assert mmstore.RolloutLoader(ds, preprocess_device=torch.device("cpu")).preprocess_device == (
        torch.device("cpu")
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is missing")
def test_cuda_without_cuda_is_refused_naming_the_device(stored, processor):
    ds = mmstore.RolloutDataset(stored, processor)
    with pytest.raises(mmstore.InvalidArgumentError, match=r"'cuda:0'.*CUDA is not available"):
        mmstore.RolloutLoader(ds, preprocess_device="cuda:0")


@pytest.mark.parametrize("name", ["glm4v", "kimi-k25"])
def test_other_families(tmp_path, name):
    case = CASES[name]
    processor = case.small("torchvision")
    store = mmstore.Store.open(tmp_path / "s", create=True)
    a, b, c = store_images(case)
    write_rows(store, case, processor, [("two", [a, b]), ("one", [c]), ("text", [])])
    out = {}
    for device in (None, "cpu"):
        ds = mmstore.RolloutDataset(store, processor, shuffle=False, node_cache_bytes=0)
        out[device] = list(mmstore.RolloutLoader(ds, batch_size=2, preprocess_device=device))
    assert_same_batches(out[None], out["cpu"])
    assert out["cpu"][0]["image_grid_thw"].shape == (3, 3)


def _layout_adapters():
    # Every family's flagship layout, and Qwen-VL's torchvision backend.
    return [*(case.published() for case in CASES.values()), Qwen2VLImageProcessor()]


def test_integer_tensors_are_the_placeholders_without_pixels():
    """What a worker lays out for the device stage (position ids read it) is exactly the
    placeholder's integer part, for every family."""
    for processor in _layout_adapters():
        adapter = mmstore.adapter_for(processor)
        for width, height in [(1, 1), (57, 91), (320, 200), (1920, 1080), (1080, 2400)]:
            got = adapter.integer_tensors(width, height)
            zeros = adapter.placeholder(width, height)
            expected = {k: v for k, v in zeros.items() if v.dtype.kind != "f"}
            assert got.keys() == expected.keys(), adapter
            for key, value in expected.items():
                assert got[key].dtype == value.dtype and (got[key] == value).all(), adapter


# -- on a GPU ---------------------------------------------------------------------------


def _to(batch, names, device):
    return {
        k: batch[k].to(device) if isinstance(batch[k], torch.Tensor) else batch[k] for k in names
    }


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_on_a_gpu_the_image_tensors_live_there_and_a_model_takes_them(stored, processor, packed):
    from transformers import Qwen2VLForConditionalGeneration

    cpu = batches(stored, processor, packed=packed)
    gpu = batches(stored, processor, device="cuda", workers=2, packed=packed, pin_memory=True)
    levels = 1 / 255 / min(processor.image_std)  # one 8-bit gray level after normalization
    assert len(cpu) == len(gpu)
    for a, b in zip(cpu, gpu, strict=True):
        for key in a.keys() - STATS - {"pixel_values", "image_grid_thw"}:
            if isinstance(a[key], torch.Tensor):
                assert b[key].device.type == "cpu" and torch.equal(a[key], b[key]), key
        if a["pixel_values"] is None:
            assert b["pixel_values"] is None
            continue
        assert b["pixel_values"].device.type == b["image_grid_thw"].device.type == "cuda"
        assert b["pixel_values"].dtype == torch.bfloat16
        assert b["image_grid_thw"].dtype == torch.int64
        assert torch.equal(a["image_grid_thw"], b["image_grid_thw"].cpu())
        # CUDA's resampling rounds apart from the CPU's uint8 kernels by a gray level at most
        torch.testing.assert_close(
            b["pixel_values"].cpu().float(), a["pixel_values"].float(), atol=2 * levels, rtol=0.016
        )
    config = tiny_qwen2_vl_config(num_hidden_layers=2)
    model = tiny_model(Qwen2VLForConditionalGeneration, config, torch.float32, attn="sdpa")
    model = model.to("cuda", torch.bfloat16)
    ds = mmstore.RolloutDataset(stored, processor)
    names = mmstore.RolloutLoader(ds, max_tokens=700 if packed else None).model_input_names
    with torch.no_grad():
        for batch in gpu:
            if batch["pixel_values"] is None or not len(batch["pixel_values"]):
                continue
            hidden = model.model(**_to(batch, names, "cuda")).last_hidden_state
            assert torch.isfinite(hidden.float()).all()


@pytest.mark.slow
def test_batches_built_elsewhere_are_finished_where_consumed(stored, processor):
    """Ray actors build batches (``build_batch``: decoded images, pickled); the consumer's
    ``finish_batch`` runs the device stage: the loader's own batches."""
    expected = batches(stored, processor, device="cpu", packed=True)
    ds = mmstore.RolloutDataset(stored, processor, seed=5, node_cache_bytes=0)
    loader = mmstore.RolloutLoader(ds, batch_size=4, max_tokens=700, preprocess_device="cpu")
    built = [pickle.loads(pickle.dumps(loader.build_batch(0, i))) for i in range(len(loader))]
    assert any(PENDING_KEY in b for b in built)
    assert_same_batches(expected, [loader.finish_batch(b) for b in built])


@pytest.mark.slow
def test_the_gpu_check_script_runs_on_the_cpu(tmp_path):
    """scripts/device_preprocess_check.py, as a GPU session runs it, at a tiny scale here."""
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "report.json"
    args = ["--device", "cpu", "--samples", "8", "--group-size", "4", "--size", "160x90"]
    args += ["--reps", "1", "--workers", "1", "--batch-size", "4", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, str(root / "scripts" / "device_preprocess_check.py"), *args],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["ok"] and len(report["equal"]) == 4
    assert all(not check["problems"] for check in report["equal"])
    assert set(report["images_per_s"]) == {"workers", "device", "device_distinct"}
