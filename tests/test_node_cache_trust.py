"""The node cache belongs to its user and checks what it serves (issue 30, items 2 and the
fuzz test): a directory that is not the user's own turns the cache off with a warning, never
failing training; a damaged entry (any byte of its header or payload) is recomputed and
replaced, never served; a whole entry that is not what the caller expects is recomputed."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from mmstore._loading.node_cache import NodeCache, fits
from tests.store_workers import small_adapter


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.randn(64, 12, generator=g).to(torch.bfloat16),
        "image_grid_thw": torch.tensor([[1, 8, 8]], dtype=torch.int64),
    }


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a
    )


def _never():
    pytest.fail("computed, but a whole entry was published")


class Counted:
    """``compute`` for get_or_compute that counts its calls."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.calls = 0

    def __call__(self) -> dict[str, torch.Tensor]:
        self.calls += 1
        return self.tensors


# -- the directory ------------------------------------------------------------------------


def test_a_new_directory_is_created_private(tmp_path):
    old = os.umask(0)  # whatever the umask: only the user may enter
    try:
        cache = NodeCache(str(tmp_path / "c"), 1 << 20)
    finally:
        os.umask(old)
    assert cache.enabled
    assert os.stat(tmp_path / "c").st_mode & 0o777 == 0o700


def test_a_directory_others_may_write_to_is_not_used(tmp_path):
    # Another user pre-created the directory world-writable and planted an entry under a key
    # anyone can compute: the victim must not train on the planted pixels.
    directory = tmp_path / "shared"
    planter = NodeCache(str(directory), 1 << 20)
    key = planter.key("hash", "fingerprint")
    planter.get_or_compute(key, lambda: {k: torch.zeros_like(v) for k, v in _tensors(1).items()})
    os.chmod(directory, 0o777)
    with pytest.warns(RuntimeWarning, match="node cache off.*mode 0777"):
        cache = NodeCache(str(directory), 1 << 20)
    assert not cache.enabled
    assert _equal(cache.get_or_compute(key, lambda: _tensors(1)), _tensors(1))
    cache.get_or_compute("other", lambda: _tensors(2))
    assert "other" not in os.listdir(directory)  # nothing written there either
    assert (cache.hits, cache.misses) == (0, 2)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_directory_of_another_user_is_not_used(tmp_path):
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)  # nobody's, mode 0700: no bare PermissionError
    with pytest.warns(RuntimeWarning, match="belongs to uid 65534"):
        cache = NodeCache(str(directory), 1 << 20)
    assert _equal(cache.get_or_compute("k", lambda: _tensors(1)), _tensors(1))
    assert os.listdir(directory) == []


def test_a_plain_file_in_the_directorys_place_is_not_an_error(tmp_path):
    (tmp_path / "c").write_bytes(b"not a directory")
    with pytest.warns(RuntimeWarning, match="is not a directory"):
        cache = NodeCache(str(tmp_path / "c"), 1 << 20)
    assert _equal(cache.get_or_compute("k", lambda: _tensors(1)), _tensors(1))


def test_a_symbolic_link_is_never_followed(tmp_path):
    # The attacker's directory (here: one of ours, private, so only the link is wrong).
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    os.symlink(target, tmp_path / "c")
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        cache = NodeCache(str(tmp_path / "c"), 1 << 20)
    assert _equal(cache.get_or_compute("k", lambda: _tensors(1)), _tensors(1))
    assert os.listdir(target) == []  # nothing written through the link


def test_a_directory_in_a_folder_others_may_rename_it_from_is_not_used(tmp_path):
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)  # not sticky: anyone may swap our directory for theirs
    with pytest.warns(RuntimeWarning, match="not sticky"):
        cache = NodeCache(str(parent / "c"), 1 << 20)
    assert not cache.enabled
    os.chmod(parent, 0o1777)  # sticky, as /dev/shm and /tmp are: only the owner renames
    assert NodeCache(str(parent / "c"), 1 << 20).enabled


# -- the entries --------------------------------------------------------------------------


def _published(tmp_path, seed: int = 1) -> tuple[NodeCache, str]:
    cache = NodeCache(str(tmp_path / "c"), 1 << 20)
    cache.get_or_compute("k", lambda: _tensors(seed))
    return cache, str(tmp_path / "c" / "k")


def _edit(path: str, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` (same length) in the file at ``path``."""
    assert len(old) == len(new)
    with open(path, "rb") as f:
        data = f.read()
    assert data.count(old) == 1
    with open(path, "wb") as f:
        f.write(data.replace(old, new))


def _flip(path: str, from_end: int) -> None:
    with open(path, "r+b") as f:
        f.seek(-from_end, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-from_end, os.SEEK_END)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p: _flip(p, 100), id="a flipped bit in the pixels"),
        pytest.param(lambda p: _edit(p, b'"bfloat16"', b'"float16" '), id="float16 in the header"),
        pytest.param(lambda p: _edit(p, b"[64, 12]", b"[32, 24]"), id="another shape"),
        pytest.param(
            lambda p: _edit(p, b'"image_grid_thw"', b'"image_grid_xyz"'), id="a key missing"
        ),
    ],
)
def test_a_damaged_entry_is_recomputed_and_replaced(tmp_path, damage):
    _, path = _published(tmp_path)
    damage(path)
    cache = NodeCache(str(tmp_path / "c"), 1 << 20)
    compute = Counted(_tensors(1))
    assert _equal(cache.get_or_compute("k", compute), _tensors(1))
    assert compute.calls == 1
    # Replaced: the next request is a hit again, of the right pixels.
    assert _equal(cache.get_or_compute("k", _never), _tensors(1))


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_an_entry_that_is_not_a_plain_file_is_never_read(tmp_path, kind):
    # A link to a whole entry elsewhere is not followed; a FIFO does not block the reader.
    cache, path = _published(tmp_path)
    os.replace(path, tmp_path / "elsewhere")
    {
        "symlink": lambda: os.symlink(tmp_path / "elsewhere", path),
        "fifo": lambda: os.mkfifo(path),
        "directory": lambda: os.mkdir(path),
    }[kind]()
    compute = Counted(_tensors(2))
    assert _equal(cache.get_or_compute("k", compute), _tensors(2)) and compute.calls == 1
    assert _equal(cache.get_or_compute("k", _never), _tensors(2))  # replaced by an entry


def test_a_whole_entry_that_is_not_what_the_caller_expects_is_recomputed(tmp_path):
    # Well-formed, checksum and all, but float16 pixels in a (32, 24) shape: what the entry
    # says it is, not what this caller's image takes.
    cache = NodeCache(str(tmp_path / "c"), 1 << 20)
    wrong = {"pixel_values": torch.zeros(32, 24, dtype=torch.float16)}
    cache.get_or_compute("k", lambda: wrong)
    expected = {
        "pixel_values": np.zeros((64, 12), np.float32),
        "image_grid_thw": np.array([[1, 8, 8]]),
    }
    compute = Counted(_tensors(1))

    def get() -> dict[str, torch.Tensor]:
        return cache.get_or_compute(
            "k", compute, check=lambda got: fits(got, expected, torch.bfloat16)
        )

    assert _equal(get(), _tensors(1)) and compute.calls == 1
    assert _equal(get(), _tensors(1)) and compute.calls == 1  # replaced: a hit
    assert cache.hits == 1


def test_fits():
    expected = {"pixel_values": np.zeros((4, 6), np.float32), "grid": np.array([[1, 2, 2]])}
    good = {
        "pixel_values": torch.ones(4, 6, dtype=torch.bfloat16),
        "grid": torch.tensor([[1, 2, 2]]),
    }
    assert fits(good, expected, torch.bfloat16)
    assert not fits(good, expected, torch.float16)  # floats in another dtype
    assert not fits({**good, "grid": torch.tensor([[1, 2, 3]])}, expected, torch.bfloat16)
    assert not fits(
        {**good, "grid": torch.tensor([[1, 2, 2]], dtype=torch.int32)}, expected, torch.bfloat16
    )
    assert not fits({**good, "pixel_values": torch.ones(6, 4)}, expected, torch.float32)
    assert not fits({"pixel_values": good["pixel_values"]}, expected, torch.bfloat16)
    assert not fits({**good, "extra": torch.ones(1)}, expected, torch.bfloat16)


def test_a_hit_is_confirmed_before_it_is_served(tmp_path):
    cache, _ = _published(tmp_path)

    def gone() -> None:
        raise FileNotFoundError("the media is gone")

    with pytest.raises(FileNotFoundError, match="media is gone"):
        cache.get_or_compute("k", _never, confirm=gone)
    assert cache.hits == 0  # not served
    # The entry stays: the media may come back, or stand under another URI.
    assert _equal(cache.get_or_compute("k", _never, confirm=lambda: None), _tensors(1))


# -- the entry format, fuzzed -------------------------------------------------------------


def _processor_output() -> dict[str, torch.Tensor]:
    """The real processor's tensors for one small image, in the train dtype."""
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (84, 112, 3), dtype=np.uint8))
    return small_adapter().process([image], torch.bfloat16)


PROCESSED = _processor_output()
_ENTRY = {}  # the undamaged entry's bytes, made once


def _entry_bytes() -> bytes:
    if not _ENTRY:
        with tempfile.TemporaryDirectory() as root:
            NodeCache(os.path.join(root, "c"), 1 << 24).get_or_compute("k", lambda: PROCESSED)
            with open(os.path.join(root, "c", "k"), "rb") as f:
                _ENTRY["bytes"] = f.read()
    return _ENTRY["bytes"]


def _apply(data: bytes, edits: list[tuple[str, int, int]]) -> bytes:
    """``data`` after ``edits``: (kind, position, value) each, positions wrapped to fit."""
    out = bytearray(data)
    for kind, position, value in edits:
        at = position % (len(out) + 1)
        if kind == "flip" and at < len(out):
            out[at] ^= 1 << (value % 8)
        elif kind == "set" and at < len(out):
            out[at] = value % 256
        elif kind == "truncate":
            del out[at:]
        elif kind == "insert":
            out[at:at] = bytes([value % 256])
        elif kind == "delete":
            del out[at : at + 1]
    return bytes(out)


# Positions: the first 256 bytes (the prefix and the JSON header) as often as anywhere.
_position = st.one_of(st.integers(0, 255), st.integers(0, 1 << 20))
_edits = st.lists(
    st.tuples(
        st.sampled_from(["flip", "set", "truncate", "insert", "delete"]),
        _position,
        st.integers(0, 255),
    ),
    min_size=1,
    max_size=4,
)


@pytest.mark.slow  # hypothesis
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=_edits)
def test_damage_anywhere_in_an_entry_is_never_served(edits):
    original = _entry_bytes()
    damaged = _apply(original, edits)
    with tempfile.TemporaryDirectory() as root:
        directory = os.path.join(root, "c")
        cache = NodeCache(directory, 1 << 24)
        with open(os.path.join(directory, "k"), "wb") as f:
            f.write(damaged)
        compute = Counted(PROCESSED)
        got = cache.get_or_compute("k", compute)
        assert _equal(got, PROCESSED)  # the processor's pixels, whatever the damage
        # Damaged bytes are recomputed, never served; an undamaged entry is a hit.
        assert compute.calls == (damaged != original)
        assert _equal(cache.get_or_compute("k", _never), PROCESSED)  # replaced, whole
        del got
