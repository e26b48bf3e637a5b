"""Store round trip on local disk and on S3: put, dedup, verified read, write, list."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

import mmstore
from mmstore._synth import screenshot


@pytest.fixture(params=["local", "s3"])
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
