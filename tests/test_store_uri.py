"""URI safety: a media URI resolves inside the store or under a root the caller trusts."""

from __future__ import annotations

import os

import pytest

import mmstore
from mmstore._format.media import content_hash
from mmstore._storage.backends import s3_filesystem
from tests.store_workers import image_bytes

H = "ab" + "cd" * 15  # a well-formed hash

UNTRUSTED = [
    "media/../mmstore.json",
    "media/ab/../../mmstore.json",
    "../outside.png",
    "/etc/passwd",
    "media/ab/cd/..",
    "media\\ab\\cd\\x.png",
    "media/ab\\..\\..\\mmstore.json",
    "mmstore.json",
    "rollouts/run_id=r/step=0/part.parquet",
    "pins/keep.json",
    "_staging/x.tmp",
    "media",
    "media/",
    "media//ab/x.png",
    "media/./ab/x.png",
    "media/ab/x\x00.png",
    "http://example.com/a.png",
    "https://example.com/a.png",
    "HTTP://example.com/a.png",
    "data:image/png;base64,iVBORw0KGgo=",
    "ftp://example.com/a.png",
    "C:\\images\\a.png",
    "file:///etc/passwd",
    "file://evil.example.com/etc/passwd",
    "file:etc/passwd",
    "s3://some-bucket/a.png",
]


@pytest.mark.parametrize("uri", UNTRUSTED)
def test_untrusted_uris_are_refused(store, uri):
    with pytest.raises(mmstore.UntrustedURIError) as err:
        store.read_media(uri, H)
    assert type(err.value) is mmstore.UntrustedURIError
    assert isinstance(err.value, PermissionError)
    with pytest.raises(mmstore.UntrustedURIError):
        store.media_stat(uri)


@pytest.mark.parametrize("uri", ["", None, 3])
def test_non_strings_are_refused(store, uri):
    with pytest.raises(mmstore.UntrustedURIError):
        store.resolve(uri)


@pytest.mark.parametrize("uri", ["media/../mmstore.json", "/mmstore.json", "http://x/a.png"])
def test_s3_store_refuses_the_same(s3_store, uri):
    with pytest.raises(mmstore.UntrustedURIError):
        s3_store.read_media(uri, H)


def test_symlinks_leaving_the_store_are_refused(store, tmp_path):
    secret = tmp_path / "secret.png"
    secret.write_bytes(image_bytes(1))
    h = content_hash(secret.read_bytes())
    media_dir = store.backend.abspath(f"media/{h[:2]}/{h[2:4]}")
    os.makedirs(media_dir)
    os.symlink(secret, os.path.join(media_dir, f"{h}.png"))
    os.symlink(tmp_path, store.backend.abspath("media/zz"))
    for uri in (f"media/{h[:2]}/{h[2:4]}/{h}.png", "media/zz/secret.png"):
        with pytest.raises(mmstore.UntrustedURIError, match="symlink"):
            store.read_media(uri, h)
    # A symlink that stays inside the store is fine.
    media = store.put_media(image_bytes(2))
    os.symlink(store.backend.abspath("media"), store.backend.abspath("media/alias"))
    alias = "media/alias/" + media.uri.removeprefix("media/")
    assert store.read_media(alias, media.hash) == image_bytes(2)


@pytest.fixture
def external(tmp_path):
    """A directory of images outside the store, and a sibling whose name extends it."""
    root = tmp_path / "images"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.png").write_bytes(image_bytes(3))
    sibling = tmp_path / "images-private"
    sibling.mkdir()
    (sibling / "b.png").write_bytes(image_bytes(4))
    (root / "escape.png").symlink_to(sibling / "b.png")
    return root


def test_file_uris_under_trusted_roots_resolve_and_verify(tmp_path, external):
    store = mmstore.Store.open(tmp_path / "s", create=True, trusted_roots=[f"file://{external}"])
    h = content_hash(image_bytes(3))
    uri = f"file://{external}/sub/a.png"
    assert store.read_media(uri, h) == image_bytes(3)
    assert store.read_media(f"file://localhost{external}/sub/a.png", h) == image_bytes(3)
    assert store.open_image(uri, h).size == (120, 80)
    with pytest.raises(mmstore.HashMismatchError):
        store.read_media(uri, H)
    with pytest.raises(mmstore.MediaNotFoundError):
        store.read_media(f"file://{external}/sub/missing.png", h)
    for bad in (
        f"file://{external}/../images-private/b.png",  # '..' never, even back inside
        f"file://{external}/sub/../sub/a.png",
        f"file://{external}-private/b.png",  # a sibling that merely shares the prefix
        f"file://{external}/escape.png",  # a symlink out of the trusted root
        f"file://{tmp_path}/s/mmstore.json",
    ):
        with pytest.raises(mmstore.UntrustedURIError):
            store.read_media(bad, h)


def test_trusted_roots_must_be_absolute(tmp_path):
    with pytest.raises(mmstore.UntrustedURIError, match="absolute"):
        mmstore.Store.open(tmp_path / "s", create=True, trusted_roots=["relative/dir"])


def test_s3_uris_under_trusted_roots_resolve_and_verify(tmp_path, s3_store, s3_options):
    bucket = s3_store.root.removeprefix("s3://").split("/")[0]
    fs = s3_filesystem(s3_options)
    for key, seed in (("shared/imgs/a.png", 5), ("shared/imgs-other/b.png", 6)):
        with fs.open_output_stream(f"{bucket}/{key}") as f:
            f.write(image_bytes(seed))
    store = mmstore.Store.open(
        tmp_path / "local",
        create=True,
        trusted_roots=[f"s3://{bucket}/shared/imgs/"],
        s3_options=s3_options,
    )
    h = content_hash(image_bytes(5))
    assert store.read_media(f"s3://{bucket}/shared/imgs/a.png", h) == image_bytes(5)
    with pytest.raises(mmstore.MediaNotFoundError):
        store.read_media(f"s3://{bucket}/shared/imgs/none.png", h)
    for bad in (
        f"s3://{bucket}/shared/imgs-other/b.png",
        f"s3://{bucket}/shared/imgs/../imgs-other/b.png",
        f"s3://{bucket}/shared/imgs//a.png",
        f"s3://{bucket}/store/mmstore.json",
        f"s3://other-{bucket}/shared/imgs/a.png",
    ):
        with pytest.raises(mmstore.UntrustedURIError):
            store.read_media(bad, h)
    # A whole bucket can be trusted too.
    whole = mmstore.Store.open(
        tmp_path / "local", trusted_roots=[f"s3://{bucket}/"], s3_options=s3_options
    )
    other = f"s3://{bucket}/shared/imgs-other/b.png"
    assert whole.read_media(other, content_hash(image_bytes(6))) == image_bytes(6)
