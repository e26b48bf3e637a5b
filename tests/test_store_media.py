"""Media: content-addressed puts (dedup, timestamps, staging), verified reads, refusals."""

from __future__ import annotations

import io
import os
import struct
import time
import zlib

import pytest
from PIL import Image

import mmstore
from mmstore._format.media import content_hash
from tests.store_workers import image_bytes, make_row, tree


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def any_store(request):
    return request.getfixturevalue("store" if request.param == "local" else "s3_store")


def stored(store):
    """Every file of the store but the rollouts table's log (a new store's version 0)."""
    return [f.path for f in store.backend.list("") if not f.path.startswith("rollouts/_delta_log/")]


def png_header(width: int, height: int) -> bytes:
    """A valid PNG header claiming ``width`` x ``height``, then an IDAT of one empty deflate
    block: no pixel data at all, so only a header check can refuse it for its size."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


def spy_fsync(monkeypatch) -> list[str]:
    """Record the path of every file or directory fsync'd (the real fsync still runs)."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def jpeg_bytes(seed: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise((64, 48), 40 + seed).convert("RGB").save(buf, format="JPEG")
    return buf.getvalue()


def test_put_is_content_addressed_and_deduplicated(any_store):
    data = image_bytes(1)
    media = any_store.put_media(data, ext="png")
    h = content_hash(data)
    assert media == mmstore.MediaRef(
        hash=h, uri=f"media/{h[:2]}/{h[2:4]}/{h}.png", width=120, height=80, nbytes=len(data)
    )
    assert any_store.put_media(data, ext="PNG") == media
    assert [f.path for f in any_store.backend.list("media")] == [media.uri]
    assert any_store.read_media(media.uri, media.hash) == data
    # put_image encodes PNG deterministically: the same picture is the same file.
    image = Image.open(io.BytesIO(data))
    assert any_store.put_image(image) == any_store.put_image(image.copy())


def test_local_second_put_writes_nothing_but_renews_mtime(store, monkeypatch):
    data = image_bytes(2)
    media = store.put_media(data)
    path = store.backend.abspath(media.uri)
    os.utime(path, (1_000_000, 1_000_000))  # as if written long ago
    before = tree(store.backend.base)
    fsyncs = spy_fsync(monkeypatch)
    start = time.time()

    assert store.put_media(data) == media

    after = tree(store.backend.base)
    assert after.keys() == before.keys()  # no new file, no staging debris
    rel = os.path.relpath(path, store.backend.base)
    assert after[rel][2] == before[rel][2]  # the same inode: not rewritten
    assert after[rel][1] >= int(start * 1e9) - 10**9  # timestamp renewed to about now
    assert fsyncs == []  # nothing written, nothing to sync


def test_local_new_put_is_staged_and_linked_and_synced_at_commit(store, monkeypatch):
    synced = spy_fsync(monkeypatch)
    media = store.put_media(image_bytes(3))
    path = store.backend.abspath(media.uri)
    staging = store.backend.abspath("_staging")
    assert synced == []  # durability is the commit's job (tests/test_durable_writes.py)
    assert os.listdir(staging) == []  # the staging name is gone
    store.sync_media([media.uri])
    assert path in synced and os.path.dirname(path) in synced
    assert os.stat(path).st_nlink == 1


def test_s3_second_put_renews_last_modified(s3_store):
    data = image_bytes(4)
    media = s3_store.put_media(data)
    first = s3_store.media_stat(media.uri)
    time.sleep(1.1)  # S3 timestamps have one-second resolution
    assert s3_store.put_media(data) == media
    second = s3_store.media_stat(media.uri)
    assert second.mtime > first.mtime
    assert sorted(stored(s3_store)) == [media.uri, "mmstore.json"]


def test_jpeg_extension_is_canonical(any_store):
    data = jpeg_bytes()
    a = any_store.put_media(data, ext="jpeg")
    b = any_store.put_media(data, ext=".JPG")
    assert a == b and a.uri.endswith(".jpg")
    photo = any_store.put_image(Image.open(io.BytesIO(data)), format="jpeg")
    assert photo.uri.endswith(".jpg")


def test_read_media_verifies(any_store):
    media = any_store.put_media(image_bytes(5))
    with pytest.raises(mmstore.HashMismatchError, match=media.uri):
        any_store.read_media(media.uri, "0" * 32)
    # Bytes changed behind the store's back.
    any_store.backend.write_atomic(media.uri, image_bytes(6))
    with pytest.raises(mmstore.HashMismatchError) as err:
        any_store.read_media(media.uri, media.hash)
    assert isinstance(err.value, ValueError) and err.value.uri == media.uri
    missing = f"media/ab/cd/{'ab' + 'cd' * 15}.png"
    with pytest.raises(mmstore.MediaNotFoundError) as err:
        any_store.read_media(missing, "ab" + "cd" * 15)
    assert isinstance(err.value, FileNotFoundError) and err.value.uri == missing


def test_open_image_decodes_rgb(any_store):
    rgba = Image.new("RGBA", (40, 30), (10, 20, 30, 128))
    media = any_store.put_image(rgba)
    image = any_store.open_image(media.uri, media.hash)
    assert (image.mode, image.size) == ("RGB", (40, 30))


@pytest.mark.parametrize(
    ("data", "ext", "match"),
    [
        (image_bytes(7), "jpg", "bytes are PNG but ext='jpg'"),
        (jpeg_bytes(), "png", "bytes are JPEG but ext='png'"),
        (image_bytes(7), "exe", "unsupported media extension"),
        (b"hello, not an image", "png", "not a decodable image"),
        (b"", "png", "not a decodable image"),
        (image_bytes(7)[:20], "png", "not a decodable image"),
    ],
)
def test_bad_media_is_refused_and_leaves_no_trace(any_store, data, ext, match):
    with pytest.raises(mmstore.ImageDecodeError, match=match) as err:
        any_store.put_media(data, ext=ext)
    assert type(err.value) is mmstore.ImageDecodeError
    assert " object at 0x" not in str(err.value)
    assert stored(any_store) == ["mmstore.json"]


@pytest.mark.parametrize(
    ("width", "height"),
    [(10_000, 10_000), (100_000, 100_000)],  # over our 64 MP limit; over Pillow's own too
)
def test_decompression_bomb_header_is_refused_before_decoding(any_store, width, height):
    # The file holds no pixel data: any decoding attempt would fail differently.
    with pytest.raises(mmstore.DecompressionBombError) as err:
        any_store.put_media(png_header(width, height))
    assert type(err.value) is mmstore.DecompressionBombError
    assert stored(any_store) == ["mmstore.json"]


def test_the_bomb_header_holds_no_decodable_pixels(store):
    # Puts check headers only (fast); the same file at a small size fails only when decoded,
    # which shows the refusals above came from the header, before any decoding.
    media = store.put_media(png_header(8, 8))
    with pytest.raises(mmstore.ImageDecodeError, match="do not decode") as err:
        store.open_image(media.uri, media.hash)
    assert type(err.value) is mmstore.ImageDecodeError


def test_pixel_limit_applies_to_puts_and_decodes(tmp_path):
    big = image_bytes(8, 200, 150)  # 30 000 pixels
    generous = mmstore.Store.open(tmp_path / "s", create=True)
    media = generous.put_media(big)
    strict = mmstore.Store.open(tmp_path / "s", max_image_pixels=20_000)
    with pytest.raises(mmstore.DecompressionBombError, match="30000 pixels exceeds the limit"):
        strict.put_media(big)
    assert strict.read_media(media.uri, media.hash) == big  # bytes are still served
    with pytest.raises(mmstore.DecompressionBombError) as err:
        strict.open_image(media.uri, media.hash)
    assert err.value.uri == media.uri


def test_a_directory_is_not_media(store, adapter):
    h = content_hash(image_bytes(9))
    uri = f"media/{h[:2]}/{h[2:4]}/{h}.png"
    os.makedirs(store.backend.abspath(uri))
    assert store.media_stat(uri) is None
    with pytest.raises(mmstore.MediaNotFoundError):
        store.read_media(uri, h)
    fake = mmstore.MediaRef(hash=h, uri=uri, width=120, height=80)
    with pytest.raises(mmstore.MediaNotFoundError), store.writer(run_id="r", step=0) as w:
        w.write(make_row(adapter, [fake], "s0"))


# -- put_image: what a caller plausibly has in hand ------------------------------------


def test_put_image_takes_a_path_and_stores_its_bytes_as_they_are(store, tmp_path):
    data = jpeg_bytes(3)  # effect_noise is random: write the bytes once
    (tmp_path / "pic.jpg").write_bytes(data)
    for path in (tmp_path / "pic.jpg", str(tmp_path / "pic.jpg")):
        media = store.put_image(path)
        assert media.uri.endswith(".jpg") and media.hash == content_hash(data)
    assert store.put_image(tmp_path / "pic.jpg", format="png").uri.endswith(".png")
    with pytest.raises(mmstore.InvalidArgumentError, match="no image file"):
        store.put_image(tmp_path / "absent.png")


@pytest.mark.parametrize(
    ("shape", "mode"), [((30, 40), "L"), ((30, 40, 3), "RGB"), ((30, 40, 4), "RGBA")]
)
def test_put_image_takes_uint8_arrays(store, shape, mode):
    import numpy as np

    array = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    media = store.put_image(array)
    assert (media.width, media.height) == (40, 30)
    stored = Image.open(io.BytesIO(store.read_media(media.uri, media.hash)))
    assert stored.mode == mode and np.array_equal(np.asarray(stored), array)


def test_put_image_takes_chw_and_hwc_uint8_tensors(store):
    import numpy as np
    import torch

    hwc = torch.randint(0, 256, (30, 40, 3), dtype=torch.uint8)
    a = store.put_image(hwc)
    b = store.put_image(hwc.permute(2, 0, 1))  # CHW, as torchvision holds images
    assert a.hash == b.hash and (a.width, a.height) == (40, 30)
    assert np.array_equal(np.asarray(store.open_image(a.uri, a.hash)), hwc.numpy())


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda np, torch: np.zeros((30, 40, 3), dtype=np.float32), "uint8"),
        (lambda np, torch: np.zeros((30, 40, 2), dtype=np.uint8), "shape"),
        (lambda np, torch: torch.zeros((3, 4, 3), dtype=torch.uint8), "CHW or HWC"),
        (lambda np, torch: b"\x89PNG...", "put_media"),
        (lambda np, torch: [[0, 1], [2, 3]], "a file path, a PIL image"),
    ],
)
def test_put_image_refuses_what_it_cannot_read_saying_what_to_pass(store, make, match):
    import numpy as np
    import torch

    with pytest.raises(mmstore.InvalidArgumentError, match=match):
        store.put_image(make(np, torch))
    assert stored(store) == ["mmstore.json"]


def test_put_media_refuses_what_is_not_bytes(store):
    with pytest.raises(mmstore.InvalidArgumentError, match="put_image"):
        store.put_media(Image.new("RGB", (4, 4)))
