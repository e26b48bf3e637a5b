"""Video bytes: safe probing and frame-exact decoding with PyAV.

A video's frames are numbered in presentation order: frame ``i`` is the ``i``-th frame a full
sequential decode gives (what transformers' pyav backend indexes). The frame count and each
frame's timestamp come from demuxing the packets of the first video stream, which reads the
container without decoding: a container's own frame count (``stream.frames``) can be absent
(Matroska) or lie. :func:`decode_frames` seeks to the keyframe at or before the first wanted
frame and decodes forward only as far as the last one, giving the same pixels a sequential
decode gives at those indices.

PyAV's wheel bundles a pinned FFmpeg, so decoded frames are the same bytes on every machine
that installs it. It is imported on first use (``import mmstore`` stays light); it is the
``mmstore[video]`` extra.

Only what a model input plausibly is gets past :func:`probe_video`: ISO BMFF (MP4,
QuickTime) and Matroska (MKV, WebM) holding H.264, HEVC, VP8, VP9, AV1 or MPEG-4 Part 2.
The container is sniffed from its magic bytes and only its demuxer is opened: FFmpeg never
probes the bytes with its other demuxers (playlists that open further URLs, image
sequences, raw formats that accept anything). Clips whose display matrix turns them
(phone videos shot upright) are refused: engines disagree on applying it, so the frames a
model would see are not well defined.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from itertools import chain, pairwise
from typing import TYPE_CHECKING, Any

import numpy as np

from mmstore._format.media import DEFAULT_MAX_PIXELS
from mmstore.errors import InvalidArgumentError, VideoBombError, VideoDecodeError

if TYPE_CHECKING:
    import av
    from av.container import InputContainer
    from av.video.stream import VideoStream

# FFmpeg codec id name -> accepted. Each has a decoder in PyAV's bundled FFmpeg (AV1 through
# libdav1d: FFmpeg's native AV1 decoder needs a hardware accelerator); tests encode a clip
# of each and decode it.
CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4"})
# Codecs a WebM file may hold (the WebM spec); Matroska holding anything else is an .mkv.
_WEBM_CODECS = frozenset({"vp8", "vp9", "av1"})
# The extension each container is stored under (the container's own short name).
EXTENSIONS = ("mp4", "mov", "mkv", "webm")

# ISO BMFF files open with a box: size (4 bytes) then its type. Files from cameras and
# ffmpeg open with `ftyp`; old QuickTime files with `moov`, `mdat`, `wide`, `free` or `skip`.
_BMFF_BOXES = frozenset({b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip"})
_EBML_MAGIC = b"\x1a\x45\xdf\xa3"  # every Matroska (and WebM) file opens with this
# The EBML header (first few dozen bytes) names its DocType: "webm" or "matroska".
_EBML_HEADER_BYTES = 64
# The identity display matrix (16.16 fixed point, last column 2.30): a clip shown as stored.
_IDENTITY_MATRIX = np.array([1 << 16, 0, 0, 0, 1 << 16, 0, 0, 0, 1 << 30], dtype="<i4")
# Decoders check the size they allocate, not the picture's: rows padded to SIMD strides (up
# to 64 pixels) and heights to whole blocks. This headroom over max_pixels covers 64 pixels
# on both sides of the largest frame these codecs code (65536 a side); the exact limit is
# ours, on the stated size and on every decoded frame's.
_DECODER_HEADROOM = 1 << 24
_INSTALL_HINT = 'video needs PyAV: pip install "mmstore[video]"'


@dataclass(frozen=True)
class VideoInfo:
    """What :func:`probe_video` found, read from the container without decoding a frame
    beyond the first (which shows the clip decodes and is not turned).

    ``width`` and ``height`` are those of every decoded frame; ``num_frames`` counts the
    video packets (one frame each) in presentation order; ``fps`` is the stream's average
    frame rate, as transformers' and vLLM's PyAV readers report it (a processor's
    timestamps are ``frame_index / fps``). ``ext`` is the extension to store it under.
    """

    container: str
    codec: str
    width: int
    height: int
    num_frames: int
    fps: float
    ext: str


@dataclass(frozen=True)
class _Packet:
    """One video packet in decode order: its presentation timestamp and whether decoding
    may start at it."""

    pts: int
    keyframe: bool


def probe_video(
    data: bytes, *, max_pixels: int, max_frames: int, where: str | None = None
) -> VideoInfo:
    """The clip's container, codec, frame size, frame count and rate.

    Refuses what is not an accepted video, and bombs (more than ``max_pixels`` per frame or
    ``max_frames`` frames) before decoding a frame. Then decodes the first frame only: it
    must decode, at the stated size, shown as stored. A clip with several video streams is
    read as its first.
    """
    container_name = _container_kind(data, where)
    with _open(data, container_name, max_pixels=max_pixels, where=where) as container:
        stream = _video_stream(container, where)
        codec = _codec(stream, where)
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_size(width, height, max_pixels, where)
        packets = _demux(container, stream, max_frames=max_frames, where=where)
        fps = _fps(stream, sorted(p.pts for p in packets))
        # The first frame (its size and display matrix) is the only one a probe decodes.
        reopen = partial(_open, data, container_name, max_pixels=max_pixels, where=where)
        frames = _decoded(container, stream, packets, start=0, reopen=reopen, where=where)
        first = next(frames, None)
        name = _container_short_name(data, container_name, codec, container.metadata)
    if first is None:
        raise VideoDecodeError(f"{codec} video stream decodes to no frame", uri=where)
    _check_frame(first, width, height, where)
    return VideoInfo(name, codec, width, height, len(packets), fps, name)


def clip_mismatch(info: VideoInfo, ref: Any) -> str | None:
    """What differs between a probed clip and the facts a video ref (its span) was laid out
    for: size, frame count, rate; None when nothing does. A ref may pair a stored clip's hash
    with other facts: every reader compares before it lays anything out."""
    facts = (info.width, info.height, info.num_frames)
    if facts == (ref.width, ref.height, ref.num_frames) and abs(info.fps - ref.fps) <= 1e-6:
        return None
    return (
        f"the clip is {info.num_frames} frames of {info.width}x{info.height} at {info.fps:g} "
        f"fps; the ref says {ref.num_frames} of {ref.width}x{ref.height} at {ref.fps:g}: its "
        "span was laid out for another clip"
    )


def frame_pts(data: bytes, *, where: str | None = None) -> list[int]:
    """Presentation timestamps (in the video stream's time base) of every frame, in
    presentation order: entry ``i`` is frame ``i``'s. Read by demuxing, without decoding."""
    with _open(data, _container_kind(data, where), where=where) as container:
        stream = _video_stream(container, where)
        return sorted(p.pts for p in _demux(container, stream, where=where))


def decode_frames(
    data: bytes,
    indices: Sequence[int],
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    where: str | None = None,
) -> np.ndarray:
    """The RGB frames at presentation-order ``indices`` (strictly increasing), as uint8
    ``[T, H, W, 3]``: bit for bit what a full sequential decode gives at those indices.

    Decoding starts at the last keyframe (in decode order) before the first wanted frame,
    seeks on to the keyframe before a later one wherever that skips packets, and stops once
    the last wanted frame is out: frames sampled from a long clip cost about a keyframe
    interval each, not the clip. The decoder refuses frames over ``max_pixels``.
    """
    wanted_indices = _check_indices(indices, where)
    kind = _container_kind(data, where)
    reopen = partial(_open, data, kind, max_pixels=max_pixels, where=where)
    with reopen() as c:
        stream = _video_stream(c, where)
        _codec(stream, where)
        packets = _demux(c, stream, where=where)
        order = sorted(p.pts for p in packets)
        if wanted_indices[-1] >= len(order):
            raise InvalidArgumentError(
                f"frame index {wanted_indices[-1]} is past the clip's {len(order)} frames",
                uri=where,
                index=wanted_indices[-1],
                num_frames=len(order),
            )
        wanted = {order[i]: n for n, i in enumerate(wanted_indices)}
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_size(width, height, max_pixels, where)
        out = np.empty((len(wanted), height, width, 3), dtype=np.uint8)
        for start, part in _seek_groups(packets, wanted):
            frames = _decoded(c, stream, packets, start=start, reopen=reopen, where=where)
            _collect(out, frames, part, wanted_indices, width, height, where)
        return out


def _seek_groups(
    packets: list[_Packet], wanted: dict[int, int]
) -> list[tuple[int, dict[int, int]]]:
    """The wanted frames (pts -> slot) in runs, each with the packet to start decoding it
    from: a run ends where seeking to the next wanted frame's keyframe skips packets that
    decoding on would pass through (sparse samples of a long clip decode a keyframe
    interval each, not the stretches between them)."""
    where_is = {p.pts: i for i, p in enumerate(packets)}
    groups: list[tuple[int, dict[int, int]]] = []
    last = -1  # the decode position of the current run's last wanted frame
    for pts in sorted(wanted):
        start = _start_packet(packets, {pts: wanted[pts]})
        if not groups or start > last:
            groups.append((start, {}))
        groups[-1][1][pts] = wanted[pts]
        last = max(last, where_is[pts])
    return groups


def _collect(
    out: np.ndarray,
    frames: Iterator[av.VideoFrame],
    wanted: dict[int, int],
    indices: list[int],
    width: int,
    height: int,
    where: str | None,
) -> None:
    """The wanted frames (pts -> slot of ``out``) as RGB, stopping at the last one: the
    frames a decoder still holds back, and those after, are never decoded."""
    filled: set[int] = set()
    for frame in frames:
        slot = wanted.get(frame.pts) if frame.pts is not None else None
        if slot is None or slot in filled:
            continue
        _check_frame(frame, width, height, where)
        out[slot] = _rgb(frame)
        filled.add(slot)
        if len(filled) == len(wanted):
            return
    # Each packet holds one frame; a damaged stream can decode to fewer.
    missing = min(indices[slot] for slot in wanted.values() if slot not in filled)
    raise VideoDecodeError(
        f"video frame {missing} never decodes (a corrupt body)", uri=where, index=missing
    )


def _rgb(frame: av.VideoFrame) -> np.ndarray:
    """The frame as RGB ``[H, W, 3]``, as ``frame.to_ndarray(format="rgb24")`` converts it,
    by a converter of this call alone on one thread: FFmpeg's threaded converter, freed by
    Python's garbage collector in a forked DataLoader worker, joins threads the fork did not
    copy and hangs the worker (PyAV keeps converters in reference cycles)."""
    from av.video.reformatter import VideoReformatter

    rgb = VideoReformatter().reformat(frame, format="rgb24", threads=1)
    return rgb.to_ndarray()


def _av() -> Any:
    """PyAV, imported on first use: a clear error where the optional extra is missing."""
    try:
        import av
    except ImportError:
        raise InvalidArgumentError(_INSTALL_HINT) from None
    return av


def _container_kind(data: bytes, where: str | None) -> str:
    """The FFmpeg demuxer for ``data``, from its magic bytes ("mp4" or "matroska"), once
    its top-level structure shows the file whole."""
    if len(data) >= 8 and bytes(data[4:8]) in _BMFF_BOXES:
        kind = "mp4"
    elif bytes(data[:4]) == _EBML_MAGIC:
        kind = "matroska"
    else:
        raise VideoDecodeError(
            f"not an MP4, MOV, MKV or WebM video ({len(data)} bytes starting {bytes(data[:8])!r})",
            uri=where,
        )
    _check_whole(data, kind, where)
    return kind


def _check_whole(data: bytes, kind: str, where: str | None) -> None:
    """Refuse bytes cut short: FFmpeg reads a Matroska or fragmented MP4 file that ends
    early as a shorter clip, without a word. The top-level structure states its own sizes:
    MP4's boxes, Matroska's Segment. (A cut exactly between two boxes cannot be told from a
    shorter file; nor can a Matroska file written live, whose Segment size is unknown.)"""
    end = _bmff_end(data) if kind == "mp4" else _matroska_end(data)
    if end is not None and end > len(data):
        raise VideoDecodeError(
            f"video file is cut short: its structure spans {end} bytes, {len(data)} are here",
            uri=where,
        )


def _bmff_end(data: bytes) -> int:
    """Where the last top-level MP4 box ends, by the boxes' stated sizes."""
    offset = 0
    while offset + 8 <= len(data):
        size = int.from_bytes(data[offset : offset + 4], "big")
        if size == 1 and offset + 16 <= len(data):  # a 64-bit size follows the type
            size = int.from_bytes(data[offset + 8 : offset + 16], "big")
        elif size == 0:  # the box runs to the end of the file
            return len(data)
        if size < 8:
            return offset  # no box is this small: not a size FFmpeg will read either
        offset += size
    return offset


def _matroska_end(data: bytes) -> int | None:
    """Where the Segment ends (it holds every frame), or None where its size is unknown."""
    header_size, at = _ebml_vint(data, 4)  # the EBML header's size follows its 4-byte id
    at += header_size
    if data[at : at + 4] != b"\x18\x53\x80\x67":  # the Segment's id
        return None
    size, body = _ebml_vint(data, at + 4)
    return None if size < 0 else body + size


def _ebml_vint(data: bytes, at: int) -> tuple[int, int]:
    """An EBML variable-length size at ``at``: (value, offset after it); -1 for "unknown"."""
    if at >= len(data) or data[at] == 0:
        return -1, len(data)
    length = 9 - data[at].bit_length()  # leading zero bits + 1 give the length in bytes
    value = data[at] & ((1 << (8 - length)) - 1)
    for byte in data[at + 1 : at + length]:
        value = value << 8 | byte
    unknown = value == (1 << (7 * length)) - 1
    return (-1 if unknown else value), at + length


def _container_short_name(data: bytes, kind: str, codec: str, metadata: dict[str, str]) -> str:
    """The canonical name (and extension) of an accepted container."""
    if kind == "mp4":  # QuickTime files carry major brand "qt  "
        return "mov" if metadata.get("major_brand", "").strip() == "qt" else "mp4"
    is_webm = b"webm" in bytes(data[:_EBML_HEADER_BYTES])
    return "webm" if is_webm and codec in _WEBM_CODECS else "mkv"


class _Opened:
    """An opened input container as a context manager that closes it."""

    def __init__(self, container: InputContainer) -> None:
        self.container = container

    def __enter__(self) -> InputContainer:
        return self.container

    def __exit__(self, *exc: object) -> None:
        self.container.close()


def _open(
    data: bytes, kind: str, *, max_pixels: int = DEFAULT_MAX_PIXELS, where: str | None
) -> _Opened:
    """Open ``data`` with the one demuxer its magic bytes name. Opening reads the header
    and may decode a first frame to learn its pixel format (FFmpeg's find_stream_info): the
    decoders get ``max_pixels`` (with alignment headroom), so not even that frame is
    allocated far over the limit."""
    av = _av()
    options = {"max_pixels": str(max_pixels + _DECODER_HEADROOM)}
    try:
        container = av.open(io.BytesIO(data), format=kind, options=options)
    except av.FFmpegError as exc:
        raise VideoDecodeError(
            f"video container does not open: {_reason(exc)}", uri=where
        ) from None
    for stream in container.streams.video:  # the decoders PyAV opens for us get it too
        if stream.codec_context is not None:
            stream.codec_context.options = dict(options)
    return _Opened(container)


def _video_stream(container: InputContainer, where: str | None) -> VideoStream:
    if not container.streams.video:
        raise VideoDecodeError(f"{container.format.name} file holds no video stream", uri=where)
    return container.streams.video[0]


def _codec(stream: VideoStream, where: str | None) -> str:
    """The stream's codec id name (libdav1d decodes "av1"), refused outside :data:`CODECS`."""
    context = stream.codec_context
    name = context.codec.canonical_name if context is not None else "unknown"
    if name not in CODECS:
        raise VideoDecodeError(
            f"video codec {name!r} is not accepted; use one of {sorted(CODECS)}",
            uri=where,
            codec=name,
        )
    return name


def _check_size(width: int, height: int, max_pixels: int, where: str | None) -> None:
    if width <= 0 or height <= 0:
        # Opening hands the decoders a pixel limit; one refusing a larger size zeroes it.
        raise VideoBombError(
            f"video frame size {width}x{height}: the stream states none, or one over the "
            f"limit of {max_pixels} pixels that the decoder refused",
            uri=where,
        )
    if width * height > max_pixels:
        raise VideoBombError(
            f"video frames of {width}x{height} = {width * height} pixels exceed the limit "
            f"of {max_pixels}",
            uri=where,
        )


def _demux(
    container: InputContainer,
    stream: VideoStream,
    *,
    max_frames: int | None = None,
    where: str | None,
) -> list[_Packet]:
    """The stream's packets in decode order, read without decoding; refuses more than
    ``max_frames`` as soon as one more is read, and packets no frame index can name."""
    av = _av()
    packets: list[_Packet] = []
    seen: set[int] = set()
    try:
        for packet in container.demux(stream):
            # Empty packets end the stream; discarded ones (before an MP4 edit list's start)
            # are decoded for reference only and output no frame.
            if packet.size == 0 or packet.is_discard:
                continue
            if packet.pts is None or packet.pts in seen:
                raise VideoDecodeError(
                    f"video packet {len(packets)} has a missing or repeated timestamp "
                    f"({packet.pts}): its frame has no place in presentation order",
                    uri=where,
                )
            if packet.is_corrupt:  # FFmpeg flags a packet the file ends inside of
                raise VideoDecodeError(
                    f"video packet {len(packets)} is cut short or corrupt (a truncated file)",
                    uri=where,
                )
            seen.add(packet.pts)
            packets.append(_Packet(packet.pts, packet.is_keyframe))
            if max_frames is not None and len(packets) > max_frames:
                raise VideoBombError(
                    f"video holds more than {max_frames} frames, the limit", uri=where
                )
    except av.FFmpegError as exc:
        raise VideoDecodeError(
            f"video container does not read: {_reason(exc)}", uri=where
        ) from None
    if not packets:
        raise VideoDecodeError("video stream holds no frame", uri=where)
    if not packets[0].keyframe:
        raise VideoDecodeError("video stream does not start at a keyframe", uri=where)
    return packets


def _fps(stream: VideoStream, order: list[int]) -> float:
    """The stream's average frame rate (FFmpeg's ``avg_frame_rate``: what transformers' and
    vLLM's PyAV readers report); where a container states none, frames over their span."""
    rate = stream.average_rate
    if rate:
        return float(rate)
    span = (order[-1] - order[0]) * (stream.time_base or Fraction(0))
    return float((len(order) - 1) / span) if span else 0.0


def _check_indices(indices: Sequence[int], where: str | None) -> list[int]:
    wanted = [int(i) for i in indices]
    if not wanted:
        raise InvalidArgumentError("decode_frames needs at least one frame index", uri=where)
    if wanted[0] < 0:
        raise InvalidArgumentError(
            f"frame index {wanted[0]} is negative", uri=where, index=wanted[0]
        )
    for before, after in pairwise(wanted):
        if after <= before:
            raise InvalidArgumentError(
                f"frame indices must be strictly increasing; {after} follows {before}",
                uri=where,
                index=after,
            )
    return wanted


def _start_packet(packets: list[_Packet], wanted: dict[int, int]) -> int:
    """The decode-order position of the last keyframe at or before every wanted frame's
    packet, shown no later than the first wanted frame: decoding from it reproduces them
    (frames shown before a keyframe but decoded after it may lean on the previous one's)."""
    first_pts = min(wanted)
    first_packet = min(i for i, p in enumerate(packets) if p.pts in wanted)
    for i in range(first_packet, -1, -1):
        if packets[i].keyframe and packets[i].pts <= first_pts:
            return i
    return 0


def _decoded(
    container: InputContainer,
    stream: VideoStream,
    packets: list[_Packet],
    *,
    start: int,
    reopen: Callable[[], _Opened],
    where: str | None,
) -> Iterator[av.VideoFrame]:
    """Frames decoded from packet ``start`` (decode order) on, then the decoder's flush."""
    av = _av()
    try:
        # None last: the flush that gets out the frames a decoder holds back for reordering.
        for packet in chain(_packets_from(container, stream, packets, start, reopen), [None]):
            for frame in _decode(stream, packet):
                # A decoder that met damage conceals it and flags the frame; later frames
                # predicted from it are damaged too, wanted or not.
                if frame.is_corrupt:
                    raise VideoDecodeError(
                        f"video frame at pts {frame.pts} decodes damaged (a corrupt body)",
                        uri=where,
                    )
                yield frame
    except av.FFmpegError as exc:
        raise VideoDecodeError(f"video frames do not decode: {_reason(exc)}", uri=where) from None


def _packets_from(
    container: InputContainer,
    stream: VideoStream,
    packets: list[_Packet],
    start: int,
    reopen: Callable[[], _Opened],
) -> Iterator[av.Packet]:
    """The stream's packets from decode position ``start`` on (or from an earlier keyframe).

    Seeks to that keyframe first. A demuxer may land elsewhere: MP4 seeks by decode
    timestamp, Matroska by its cues, which may be missing. Landing on a keyframe no later
    than ``start`` is as good (decoding from it gives the same frames); anywhere else, the
    file is read again from its first byte (a fresh demuxer: seeking to the start is as
    container-dependent) and the packets before ``start`` are skipped, never decoded.
    """
    position = {p.pts: i for i, p in enumerate(packets)}
    container.seek(packets[start].pts, stream=stream, backward=True, any_frame=False)
    demuxed = _real_packets(container, stream)
    first = next(demuxed, None)
    landed = position.get(first.pts) if first is not None and first.pts is not None else None
    if first is not None and landed is not None and landed <= start and first.is_keyframe:
        yield first
        yield from demuxed
        return
    with reopen() as fresh:
        for packet in _real_packets(fresh, fresh.streams.video[0]):
            if packet.pts is not None and position.get(packet.pts, start) >= start:
                yield packet


def _real_packets(container: InputContainer, stream: VideoStream) -> Iterator[av.Packet]:
    """Demuxed packets that carry a frame (not the empty one that ends the stream)."""
    for packet in container.demux(stream):
        if packet.size:
            yield packet


def _decode(stream: VideoStream, packet: av.Packet | None) -> list[av.VideoFrame]:
    """Every decode goes through here (tests count the packets it is handed)."""
    return stream.decode(packet)


def _check_frame(frame: av.VideoFrame, width: int, height: int, where: str | None) -> None:
    """A decoded frame must have the stream's size and be shown as stored."""
    if (frame.width, frame.height) != (width, height):
        raise VideoDecodeError(
            f"video frame of {frame.width}x{frame.height} in a {width}x{height} stream "
            "(the size changes mid-stream)",
            uri=where,
        )
    # A mapping from side-data type to side data (PyAV's stub types it as one SideData).
    # Ask by type: iterating it gave the side data before PyAV 18.1.1 and the types after.
    from av.sidedata.sidedata import Type

    sides: Any = frame.side_data
    side = sides.get(Type.DISPLAYMATRIX)
    if side is None:
        return
    matrix = np.frombuffer(bytes(side), dtype="<i4")
    if not np.array_equal(matrix, _IDENTITY_MATRIX):
        raise VideoDecodeError(
            f"video is turned {frame.rotation} degrees (or mirrored) by its display matrix; "
            "re-encode it upright",
            uri=where,
        )


def _reason(exc: BaseException) -> str:
    """FFmpeg's message without the file name PyAV adds (``<none>``) or its errno prefix."""
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
