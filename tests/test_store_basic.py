"""Store round trip on local disk and on S3: put, dedup, verified read, write, list."""

from __future__ import annotations

import pickle

import pyarrow.parquet as pq
import pytest

import mmstore
from mmstore.synth import screenshot


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def any_store(request):
    return request.getfixturevalue("store" if request.param == "local" else "s3_store")


def test_put_read_write_round_trip(any_store, adapter):
    image = screenshot(1, 320, 200)
    media = any_store.put_image(image)
    again = any_store.put_image(image)
    assert again == media
    assert media.uri == f"media/{media.hash[:2]}/{media.hash[2:4]}/{media.hash}.png"
    assert (media.width, media.height) == (320, 200)
    data = any_store.read_media(media.uri, media.hash)
    assert len(data) == media.nbytes
    assert any_store.open_image(media.uri, media.hash).tobytes() == image.tobytes()
    with pytest.raises(mmstore.HashMismatchError):
        any_store.read_media(media.uri, "0" * 32)

    tokens, refs = adapter.expand([5, adapter.image_token_id, 6], [media])
    with any_store.writer(run_id="r1", step=0) as w:
        w.write(
            mmstore.Rollout(
                sample_id="a",
                tokens=tokens,
                prompt_len=2,
                loss_mask=[True] * len(tokens),
                images=refs,
            )
        )
    files = any_store.rollout_files()
    assert [f.path.rsplit("/", 1)[0] for f in files] == ["rollouts/run_id=r1/step=0"]
    path = any_store.backend.abspath(files[0].path)
    table = pq.read_table(path, filesystem=any_store.backend.fs, partitioning=None)
    assert table.column("sample_id").to_pylist() == ["a"]
    assert table.column("images").to_pylist()[0][0]["hash"] == media.hash


def test_store_pickles_for_dataloader_workers(any_store, tmp_path):
    # DataLoader workers receive the store by pickling; the copy reads and writes the same
    # bytes, with the same trust settings.
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    store = mmstore.Store.open(
        any_store.root, trusted_roots=[trusted], s3_options=any_store.s3_options or None
    )
    media = store.put_image(screenshot(2, 160, 100))
    copy = pickle.loads(pickle.dumps(store))
    assert copy.root == store.root
    assert copy.trusted_roots == store.trusted_roots == (f"file://{trusted.resolve()}",)
    assert copy.read_media(media.uri, media.hash) == store.read_media(media.uri, media.hash)
    other = copy.put_image(screenshot(3, 160, 100))
    assert store.read_media(other.uri, other.hash)
    with pytest.raises(mmstore.UntrustedURIError):
        copy.read_media("file:///etc/passwd", media.hash)
