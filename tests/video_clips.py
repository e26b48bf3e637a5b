"""Small deterministic video clips for tests, and the reference decode.

``make_clip`` encodes frames that tell themselves apart (each frame's index drawn as a bar
of its own length and a shade of its own), in yuv420p, with a chosen keyframe interval so
that seeking has keyframes to land on. ``decode_all`` is the reference every seeking decode
must match: every frame, in order, as transformers' pyav backend decodes them.
"""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np

# PyAV encoder for each codec name a test asks for.
ENCODERS = {
    "mpeg4": "mpeg4",
    "h264": "libx264",
    "hevc": "libx265",
    "vp8": "libvpx",
    "vp9": "libvpx-vp9",
    "av1": "libsvtav1",
}
# Quiet the encoders' banners (x265, SVT-AV1 print to stderr) and keep them fast.
_OPTIONS = {
    "libx264": {"preset": "ultrafast"},
    "libx265": {"preset": "ultrafast", "log-level": "error", "x265-params": "log-level=error"},
    "libvpx": {"deadline": "realtime", "cpu-used": "8"},
    "libvpx-vp9": {"deadline": "realtime", "cpu-used": "8"},
    "libsvtav1": {"preset": "12", "svtav1-params": "lp=1"},
}


def available(codec: str) -> bool:
    """Whether this PyAV can encode ``codec`` (a key of :data:`ENCODERS`)."""
    return ENCODERS[codec] in av.codecs_available


def frame_pixels(index: int, num_frames: int, width: int, height: int, seed: int) -> np.ndarray:
    """Frame ``index``'s RGB pixels: a bar whose length is the index and a background whose
    shade steps with it, over a smooth seeded gradient (so codecs have texture to code)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 64, 3)
    ys, xs = np.mgrid[0:height, 0:width]
    pixels = np.empty((height, width, 3), dtype=np.uint8)
    pixels[..., 0] = (base[0] + xs * 96 // max(width, 1)) % 256
    pixels[..., 1] = (base[1] + ys * 96 // max(height, 1)) % 256
    pixels[..., 2] = (base[2] + index * 160 // max(num_frames, 1)) % 256
    bar = max(1, width * (index + 1) // num_frames)
    pixels[height // 3 : 2 * height // 3, :bar] = 255
    return pixels


def make_clip(
    num_frames: int = 24,
    width: int = 168,
    height: int = 112,
    fps: float | Fraction = 12,
    codec: str = "mpeg4",
    container: str = "mp4",
    gop: int | None = None,
    seed: int = 0,
    *,
    b_frames: int | None = None,
    fragmented: bool = False,
    rotation: int | None = None,
) -> bytes:
    """An encoded clip of ``num_frames`` distinct frames; ``gop`` is the keyframe interval
    (None: the encoder's default, one keyframe for a short clip)."""
    rate = fps if isinstance(fps, Fraction) else Fraction(fps).limit_denominator(1001)
    encoder = ENCODERS[codec]
    options = dict(_OPTIONS.get(encoder, {}))
    fmt = {"mkv": "matroska", "mov": "mov"}.get(container, container)
    buf = io.BytesIO()
    # Fragmented MP4 puts its index first and the frames after it, in fragments (a stream).
    container_options = {"movflags": "frag_keyframe+empty_moov"} if fragmented else {}
    with av.open(buf, "w", format=fmt, container_options=container_options) as out:
        stream = out.add_stream(encoder, rate=rate, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if gop is not None:
            stream.codec_context.gop_size = gop
            if encoder == "libx264":  # x264 also places keyframes on scene cuts
                stream.codec_context.options = {**options, "sc_threshold": "0"}
        if b_frames is not None:
            stream.codec_context.max_b_frames = b_frames
        if rotation is not None:
            stream.set_display_rotation(rotation)
        for i in range(num_frames):
            pixels = frame_pixels(i, num_frames, width, height, seed)
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def make_audio(seconds: float = 0.5) -> bytes:
    """An audio-only MP4 (AAC): a container mmstore accepts, holding no video stream."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("aac", rate=16000)
        samples = int(16000 * seconds)
        tone = np.sin(np.arange(samples) / 10).astype(np.float32)[None, :]
        frame = av.AudioFrame.from_ndarray(tone, format="fltp", layout="mono")
        frame.sample_rate = 16000
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def decode_all(data: bytes) -> np.ndarray:
    """Every frame of the first video stream, decoded in order: uint8 ``[T, H, W, 3]``."""
    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return np.stack(frames)


def keyframes(data: bytes) -> int:
    """How many keyframe packets the first video stream holds."""
    with av.open(io.BytesIO(data)) as container:
        return sum(p.is_keyframe for p in container.demux(video=0) if p.size)
