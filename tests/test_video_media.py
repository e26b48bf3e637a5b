"""Video bytes: probing refuses what is not an accepted clip (and bombs, before decoding),
and the seeking decode gives exactly the frames a full sequential decode gives."""

from __future__ import annotations

import io
import subprocess
import sys
from fractions import Fraction

import av
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image

import mmstore._format.video as video
from mmstore._format.video import VideoInfo, decode_frames, frame_pts, probe_video
from mmstore.errors import DecompressionBombError, ImageDecodeError, InvalidArgumentError

from .video_clips import available, decode_all, frame_pixels, keyframes, make_audio, make_clip

LIMITS = {"max_pixels": 10_000_000, "max_frames": 10_000}
WHERE = "media/ab/cd/clip.mp4"


def _codec(codec: str) -> str:
    """Skip a case whose encoder this PyAV lacks (the decoder is what is under test)."""
    if not available(codec):
        pytest.skip(f"this PyAV cannot encode {codec}")
    return codec


@pytest.fixture
def decodes(monkeypatch) -> list[int]:
    """Packets handed to the decoder, counted where every decode goes through."""
    handed: list[int] = []
    real = video._decode

    def counting(stream, packet):
        if packet is not None:
            handed.append(packet.pts)
        return real(stream, packet)

    monkeypatch.setattr(video, "_decode", counting)
    return handed


@pytest.fixture
def no_decoding(monkeypatch) -> None:
    def refuse(stream, packet):
        raise AssertionError("a frame was decoded")

    monkeypatch.setattr(video, "_decode", refuse)


# --- probe ---


@pytest.mark.parametrize(
    ("codec", "container", "ext"),
    [
        ("mpeg4", "mp4", "mp4"),
        ("h264", "mp4", "mp4"),
        ("hevc", "mp4", "mp4"),
        ("av1", "mp4", "mp4"),
        ("mpeg4", "mov", "mov"),
        ("h264", "mov", "mov"),
        ("h264", "mkv", "mkv"),
        ("hevc", "mkv", "mkv"),
        ("vp8", "webm", "webm"),
        ("vp9", "webm", "webm"),
        ("av1", "webm", "webm"),
        ("vp9", "mkv", "mkv"),
    ],
)
def test_probe_reads_container_codec_size_and_frames(codec, container, ext):
    data = make_clip(num_frames=15, codec=_codec(codec), container=container, gop=4)
    info = probe_video(data, **LIMITS, where=WHERE)
    assert info == VideoInfo(ext, codec, 168, 112, 15, 12.0, ext)
    assert len(decode_all(data)) == info.num_frames
    assert np.array_equal(decode_frames(data, range(15)), decode_all(data))


@pytest.mark.parametrize("fps", [1, 12, 24, 30, Fraction(30000, 1001)])
@pytest.mark.parametrize(("codec", "container"), [("mpeg4", "mp4"), ("vp9", "webm")])
def test_probe_reports_the_average_frame_rate(fps, codec, container):
    data = make_clip(num_frames=9, width=64, height=48, fps=fps, codec=_codec(codec),
                     container=container)  # fmt: skip
    info = probe_video(data, **LIMITS)
    # WebM keeps milliseconds: FFmpeg recovers 30000/1001 from the rounded timestamps.
    assert info.fps == pytest.approx(float(fps), rel=1e-3)
    assert info.num_frames == 9


@pytest.mark.parametrize(
    ("width", "height", "frames"), [(168, 112, 1), (64, 480, 7), (480, 64, 40)]
)
def test_probe_odd_aspect_ratios_and_lengths(width, height, frames):
    data = make_clip(num_frames=frames, width=width, height=height, gop=8)
    info = probe_video(data, **LIMITS)
    assert (info.width, info.height, info.num_frames) == (width, height, frames)
    assert decode_all(data).shape == (frames, height, width, 3)


def test_frame_pts_are_the_presentation_timestamps_of_a_full_decode():
    data = make_clip(num_frames=20, codec=_codec("h264"), gop=5, b_frames=3)
    with av.open(io.BytesIO(data)) as container:
        reference = [frame.pts for frame in container.decode(video=0)]
    assert frame_pts(data) == reference == sorted(reference)


def test_several_video_streams_read_the_first():
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        streams = []
        for width, height in ((64, 48), (32, 32)):
            stream = out.add_stream("mpeg4", rate=12)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            streams.append(stream)
        for i in range(6):
            for stream in streams:
                pixels = frame_pixels(i, 6, stream.width, stream.height, 0)
                frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
                for packet in stream.encode(frame):
                    out.mux(packet)
        for stream in streams:
            for packet in stream.encode():
                out.mux(packet)
    data = buf.getvalue()
    info = probe_video(data, **LIMITS)
    assert (info.width, info.height, info.num_frames) == (64, 48, 6)
    assert np.array_equal(decode_frames(data, [0, 5]), decode_all(data)[[0, 5]])


# --- refusals ---


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(_png(), id="png"),
        pytest.param(np.random.default_rng(0).bytes(4096), id="random"),
        pytest.param(b"", id="empty"),
        pytest.param(b"hello, this is text\n" * 20, id="text"),
        pytest.param(b"\x00\x00\x00\x18ftypisom" + bytes(200), id="mp4-header-then-zeros"),
        pytest.param(b"\x1a\x45\xdf\xa3" + np.random.default_rng(1).bytes(500), id="ebml-noise"),
    ],
)
def test_non_videos_are_refused_with_where(data):
    with pytest.raises(ImageDecodeError) as err:
        probe_video(data, **LIMITS, where=WHERE)
    assert err.value.uri == WHERE
    assert not isinstance(err.value, DecompressionBombError)
    with pytest.raises(ImageDecodeError):
        decode_frames(data, [0], where=WHERE)


def test_audio_only_file_is_refused():
    with pytest.raises(ImageDecodeError, match="no video stream") as err:
        probe_video(make_audio(), **LIMITS, where=WHERE)
    assert err.value.uri == WHERE


def test_codec_outside_the_allow_list_is_refused_by_name():
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as out:
        stream = out.add_stream("mjpeg", rate=12)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuvj420p"
        frame = av.VideoFrame.from_ndarray(frame_pixels(0, 1, 32, 32, 0), format="rgb24")
        for packet in [*stream.encode(frame), *stream.encode()]:
            out.mux(packet)
    with pytest.raises(ImageDecodeError, match="mjpeg") as err:
        probe_video(buf.getvalue(), **LIMITS, where=WHERE)
    assert err.value.codec == "mjpeg" and err.value.uri == WHERE


def test_too_many_pixels_is_refused_before_decoding(no_decoding):
    data = make_clip(num_frames=4, width=64, height=48)
    with pytest.raises(DecompressionBombError, match="limit of 3071") as err:
        probe_video(data, max_pixels=64 * 48 - 1, max_frames=100, where=WHERE)
    assert err.value.uri == WHERE
    with pytest.raises(DecompressionBombError):
        decode_frames(data, [0], max_pixels=64 * 48 - 1, where=WHERE)


def test_too_many_frames_is_refused_before_decoding(no_decoding):
    data = make_clip(num_frames=30, width=32, height=32)
    with pytest.raises(DecompressionBombError, match="more than 29 frames") as err:
        probe_video(data, max_pixels=10_000, max_frames=29, where=WHERE)
    assert err.value.uri == WHERE


def test_limits_are_inclusive():
    data = make_clip(num_frames=30, width=32, height=32)
    info = probe_video(data, max_pixels=32 * 32, max_frames=30)
    assert info.num_frames == 30


def test_rotated_clips_are_refused():
    data = make_clip(num_frames=4, width=64, height=32, rotation=90)
    with pytest.raises(ImageDecodeError, match="turned") as err:
        probe_video(data, **LIMITS, where=WHERE)
    assert err.value.uri == WHERE
    with pytest.raises(ImageDecodeError, match="turned"):
        decode_frames(data, [1], where=WHERE)
    # An explicit identity matrix is no turn.
    upright = make_clip(num_frames=4, width=64, height=32, rotation=0)
    assert probe_video(upright, **LIMITS).width == 64


@pytest.mark.parametrize(
    ("container", "codec", "fragmented"),
    [
        ("mp4", "mpeg4", False),
        ("mp4", "h264", True),
        ("mkv", "h264", False),
        ("webm", "vp9", False),
    ],
)
@pytest.mark.parametrize("keep", [0.5, 0.9, 0.999])
def test_truncated_clips_are_refused(container, codec, fragmented, keep):
    data = make_clip(num_frames=20, codec=_codec(codec), container=container, gop=4,
                     fragmented=fragmented)  # fmt: skip
    cut = data[: int(len(data) * keep)]
    with pytest.raises(ImageDecodeError) as err:
        probe_video(cut, **LIMITS, where=WHERE)
    assert err.value.uri == WHERE
    with pytest.raises(ImageDecodeError):
        decode_frames(cut, [0, 19], where=WHERE)


def test_corrupt_body_is_refused_mid_decode():
    data = bytearray(make_clip(num_frames=30, codec=_codec("h264"), container="mkv", gop=5))
    middle = len(data) // 3
    data[middle : middle + 200] = bytes(b ^ 0x5A for b in data[middle : middle + 200])
    probe_video(bytes(data), **LIMITS)  # the header and first frame are intact
    with pytest.raises(ImageDecodeError, match="damaged") as err:
        decode_frames(bytes(data), range(30), where=WHERE)
    assert err.value.uri == WHERE


def test_missing_pyav_names_the_extra(monkeypatch):
    data = make_clip(num_frames=2, width=32, height=32)
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    with pytest.raises(InvalidArgumentError, match=r"mmstore\[video\]"):
        probe_video(data, **LIMITS)
    with pytest.raises(InvalidArgumentError, match=r"mmstore\[video\]"):
        decode_frames(data, [0])


@pytest.mark.slow
def test_importing_the_module_does_not_import_pyav():
    code = "import sys, mmstore._format.video; assert 'av' not in sys.modules, 'av imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- decode_frames ---


@pytest.mark.parametrize(
    "indices",
    [[24], [-1], [3, 3], [5, 2], []],
    ids=["past-end", "negative", "repeated", "decreasing", "empty"],
)
def test_bad_indices_are_refused(indices):
    data = make_clip(num_frames=24, width=32, height=32)
    with pytest.raises(InvalidArgumentError) as err:
        decode_frames(data, indices, where=WHERE)
    assert err.value.uri == WHERE
    if indices == [24]:
        assert (err.value.index, err.value.num_frames) == (24, 24)


# Clips whose decode must match the full sequential decode bit for bit: many keyframes, one
# per frame, a single one; B-frames (decode order != presentation order) and open GOPs.
_CLIPS = {
    "mpeg4-gop4": {"codec": "mpeg4", "gop": 4},
    "mpeg4-gop1": {"codec": "mpeg4", "gop": 1},
    "mpeg4-one-keyframe": {"codec": "mpeg4", "gop": 600},
    "mpeg4-bframes": {"codec": "mpeg4", "gop": 5, "b_frames": 2},
    "h264-bframes": {"codec": "h264", "gop": 6, "b_frames": 3},
    "h264-mkv": {"codec": "h264", "gop": 4, "container": "mkv", "b_frames": 2},
    "hevc-open-gop": {"codec": "hevc", "gop": 6},
    "vp9-webm": {"codec": "vp9", "gop": 4, "container": "webm"},
    "vp8-webm-one-keyframe": {"codec": "vp8", "gop": 600, "container": "webm"},
    "h264-fragmented": {"codec": "h264", "gop": 5, "fragmented": True},
}
_FRAMES = 30
_cache: dict[str, tuple[bytes, np.ndarray]] = {}


def _clip(name: str) -> tuple[bytes, np.ndarray]:
    if name not in _cache:
        options = _CLIPS[name]
        _codec(options["codec"])
        data = make_clip(num_frames=_FRAMES, width=64, height=48, **options)
        _cache[name] = data, decode_all(data)
    return _cache[name]


def test_clip_keyframes_are_as_asked():
    assert keyframes(_clip("mpeg4-gop1")[0]) == _FRAMES
    assert keyframes(_clip("mpeg4-one-keyframe")[0]) == 1
    assert keyframes(_clip("mpeg4-gop4")[0]) >= _FRAMES // 4


@pytest.mark.parametrize("name", list(_CLIPS))
@settings(max_examples=8, deadline=None)
@given(chosen=st.sets(st.integers(0, _FRAMES - 1), min_size=1, max_size=6))
@example(chosen={0})
@example(chosen={_FRAMES - 1})
@example(chosen={0, _FRAMES - 1})
def test_decode_frames_equals_the_full_decode(name, chosen):
    data, reference = _clip(name)
    indices = sorted(chosen)
    got = decode_frames(data, indices)
    assert got.dtype == np.uint8 and got.shape == (len(indices), 48, 64, 3)
    assert np.array_equal(got, reference[indices])


def test_frames_are_distinct():
    _, reference = _clip("mpeg4-gop1")
    assert len({frame.tobytes() for frame in reference}) == _FRAMES


def test_decode_seeks_instead_of_decoding_from_the_start(decodes):
    data = make_clip(num_frames=120, width=32, height=32, gop=6)
    reference = decode_all(data)
    assert np.array_equal(decode_frames(data, [110, 113]), reference[[110, 113]])
    # From the keyframe at 108 to 113, plus what the decoder holds back: not 114 frames.
    assert 0 < len(decodes) <= 12, decodes
    assert min(decodes) >= frame_pts(data)[100]


@pytest.mark.parametrize("codec", ["mpeg4", "h264"])
def test_sparse_frames_of_a_long_clip_seek_from_keyframe_to_keyframe(decodes, codec):
    """Frames sampled across a clip (2 of every 30 here) cost a keyframe interval each: the
    decoder seeks past the stretches between them instead of decoding through."""
    if not available(codec):
        pytest.skip(f"no {codec} encoder")
    data = make_clip(num_frames=120, width=32, height=32, gop=10, codec=codec)
    wanted = [3, 33, 64, 95, 119]
    assert np.array_equal(decode_frames(data, wanted), decode_all(data)[wanted])
    # Each from its keyframe (at most 10 back) plus what a decoder holds back: not 117.
    assert 0 < len(decodes) <= 5 * 14, decodes


def test_decode_stops_after_the_last_wanted_frame(decodes):
    data = make_clip(num_frames=120, width=32, height=32, gop=600)  # one keyframe
    assert np.array_equal(decode_frames(data, [0, 2]), decode_all(data)[[0, 2]])
    assert len(decodes) <= 5, decodes


def test_a_seek_that_lands_late_falls_back_to_the_start(monkeypatch, decodes):
    data = make_clip(num_frames=40, width=32, height=32, gop=5)
    real_packets, real_open = video._real_packets, video._open
    reads, opens = [], []

    def landing_late(container, stream):  # the first read after the seek misses a packet
        packets = real_packets(container, stream)
        if not reads:
            next(packets)
        reads.append(container)
        return packets

    def counting_open(*args, **kwargs):
        opens.append(args)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(video, "_real_packets", landing_late)
    monkeypatch.setattr(video, "_open", counting_open)
    got = decode_frames(data, [22, 23])
    assert len(opens) == 2  # the file read again from its first byte
    assert np.array_equal(got, decode_all(data)[[22, 23]])
    assert min(decodes) >= frame_pts(data)[20]  # packets before the keyframe skipped


@pytest.mark.slow
def test_a_worker_forked_after_a_decode_does_not_hang(tmp_path):
    """FFmpeg's threaded RGB converter, kept alive by a reference cycle until a garbage
    collection, joined threads the fork did not copy when collected in a DataLoader worker:
    the worker hung forever. The decoder converts on one thread of its own."""
    script = tmp_path / "fork_after_decode.py"
    script.write_text(
        "import gc\n"
        "from torch.utils.data import DataLoader, Dataset\n"
        "from mmstore._format.video import decode_frames\n"
        "from mmstore.synth import screen_recording\n"
        "gc.disable()  # keep what a decode leaves to the collector, as a parent between runs\n"
        "decode_frames(screen_recording(0, 48, 320, 200, 24), [0, 12, 24])\n"
        "class Collecting(Dataset):\n"
        "    def __len__(self): return 2\n"
        "    def __getitem__(self, i):\n"
        "        gc.collect()\n"
        "        return i\n"
        "print(sum(len(b) for b in DataLoader(Collecting(), num_workers=1, timeout=60)))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "2"
