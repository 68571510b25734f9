"""Episode videos: tiny real encodes, sized stand-ins, probing, and stream-copy concatenation.

Real datasets hold AV1 mp4s; JPFS's generator writes small real encodes (PyAV) so that the converter
and loaders are exercised on genuine containers, or "stubs" (sized stand-in bytes with a one-line
header) when only the I/O shape matters. Stubs are recorded as ``video.codec == "jpfs-stub"``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, cast

import fsspec
import numpy as np

from .fsutil import DatasetError, open_input
from .layout import STUB_CODEC

if TYPE_CHECKING:
    from av.video.stream import VideoStream

log = logging.getLogger(__name__)

STUB_MAGIC = b"JPFS-STUB-VIDEO "
_STUB_HEAD_MAX = 1 << 20

# PyAV encoder name -> (codec name LeRobot records, encoder options). A keyframe every 2 frames as
# LeRobot encodes, no B-frames; ``encode(options=...)`` overrides them (tests make B-frames, long
# and open GOPs with it).
ENCODERS: dict[str, tuple[str, dict[str, str]]] = {
    "libsvtav1": ("av1", {"g": "2", "crf": "30", "preset": "12"}),
    "libx264": ("h264", {"g": "2", "crf": "30", "preset": "ultrafast", "bf": "0"}),
    "libvpx-vp9": ("vp9", {"g": "2", "crf": "30", "b": "0", "deadline": "realtime",
                           "cpu-used": "8"}),
    "libx265": ("hevc", {"g": "2", "crf": "30", "preset": "ultrafast",
                         "x265-params": "log-level=error:bframes=0"}),
    "libaom-av1": ("av1", {"g": "2", "crf": "30", "cpu-used": "8"}),  # where PyAV has it
}
CODEC_ALIASES = {"av1": "libsvtav1", "h264": "libx264", "vp9": "libvpx-vp9", "hevc": "libx265"}


def have_av() -> bool:
    """True when PyAV is importable (the ``video`` extra)."""
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def pick_encoder(preferred: str | None = None) -> str:
    """The PyAV encoder to use: ``preferred`` (name or alias), else AV1 as LeRobot, else H.264."""
    import av

    names = [CODEC_ALIASES.get(preferred, preferred)] if preferred else list(ENCODERS)
    for name in names:
        if name not in ENCODERS:
            raise ValueError(f"unknown video codec {preferred!r} (choose from "
                             f"{', '.join(sorted(CODEC_ALIASES))})")
        try:
            av.codec.Codec(name, "w")
        except Exception:  # noqa: BLE001 - PyAV raises various errors for a missing encoder
            continue
        return name
    raise ValueError(f"PyAV has no encoder for {preferred or 'any of ' + ', '.join(ENCODERS)}")


def synth_frames(n: int, height: int, width: int, seed: int,
                 indices: np.ndarray | None = None) -> np.ndarray:
    """Deterministic RGB frames: a coloured gradient with a square moving across it.

    Frame ``t`` of an ``n``-frame episode; ``indices`` picks some (stats of stand-in videos need
    only samples), the default all ``n``.
    """
    rng = np.random.default_rng(seed)
    base = rng.integers(40, 200, size=3)
    xs = np.arange(width)
    ys = np.arange(height)
    frame = np.empty((height, width, 3), np.uint8)
    frame[...] = base
    frame[:, :, int(rng.integers(3))] = (xs * 255 // max(1, width - 1))[None, :]
    t = np.arange(n) if indices is None else np.asarray(indices)
    frames = np.broadcast_to(frame, (len(t), height, width, 3)).copy()
    side = max(2, min(height, width) // 6)
    px = (int(rng.integers(width)) + 2 * t) % max(1, width - side)
    py = (int(rng.integers(height)) + t) % max(1, height - side)
    mask = (((ys[None, :] >= py[:, None]) & (ys[None, :] < py[:, None] + side))[:, :, None]
            & ((xs[None, :] >= px[:, None]) & (xs[None, :] < px[:, None] + side))[:, None, :])
    frames[mask] = rng.integers(0, 256, size=3).astype(np.uint8)
    return frames


def encode(frames: np.ndarray, fps: int, encoder: str, options: dict[str, str] | None = None,
           pts: list[int] | None = None, time_base: Fraction | None = None) -> bytes:
    """An mp4 of ``frames`` ((n, H, W, 3) uint8 RGB).

    Frame ``i`` is shown at ``pts[i] * time_base`` (default ``i / fps``: pts 0, 1, 2... in units
    of 1/fps); ``options`` are added to the encoder's defaults in :data:`ENCODERS`.
    """
    import io

    import av

    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its banner to stderr otherwise
    opts = {**ENCODERS[encoder][1], **(options or {})}
    tb = time_base or Fraction(1, fps)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        # ENCODERS names video encoders only; PyAV types a codec chosen by a run-time name as
        # any kind of stream.
        stream = cast("VideoStream", out.add_stream(encoder, rate=fps, options=opts))
        stream.width = frames.shape[2]
        stream.height = frames.shape[1]
        stream.pix_fmt = "yuv420p"
        if time_base is not None:
            stream.codec_context.time_base = tb
        lone = _reorder_delay(encoder, opts, frames, fps, tb) if len(frames) == 1 else None
        for i, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = i if pts is None else pts[i]
            frame.time_base = tb
            for packet in stream.encode(frame):
                _mux(out, packet, lone)
        for packet in stream.encode():
            _mux(out, packet, lone)
    return buf.getvalue()


def _mux(out, packet, lone: int | None) -> None:
    """Mux one encoded packet; ``lone``: the packet is a video's only one, to be decoded
    ``lone`` ticks before it is shown (``_reorder_delay``)."""
    if lone is not None and packet.pts is not None:
        packet.dts = packet.pts - lone
    out.mux(packet)


def _reorder_delay(encoder: str, options: dict, frames, fps: int, tb: Fraction) -> int:
    """How many ticks of ``tb`` the encoder decodes a frame before it shows it, measured on the
    frame given three times. libx265 with B-frames gives the packet of a video of one frame an
    uninitialized dts (seen: -8.7e15; the mp4 muxer refuses most such values), and libx264
    and libx265 give it 0 where the encoder's other videos start 2 frames early: videos
    concatenated packet by packet then lost that frame (a one-frame episode, converted as
    LeRobot converts). The lone frame is given the delay its encoder's longer videos have."""
    import io

    import av

    with av.open(io.BytesIO(), "w", format="mp4") as probe:
        stream = cast("VideoStream", probe.add_stream(encoder, rate=fps, options=options))
        stream.width = frames.shape[2]
        stream.height = frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = tb
        packets = []
        for i in range(3):
            frame = av.VideoFrame.from_ndarray(frames[0], format="rgb24")
            frame.pts = i * max(1, round(1 / (fps * tb)))
            frame.time_base = tb
            packets += stream.encode(frame)
        packets += stream.encode()
    first = min(packets, key=lambda p: p.dts if p.dts is not None else 0)
    return max(0, (first.pts or 0) - (first.dts or 0)) if first.pts is not None else 0


def make_stub(frames: int, fps: int, width: int, height: int, nbytes: int, seed: int) -> bytes:
    """A stand-in video of about ``nbytes``: a JSON header line then incompressible filler."""
    payload = nbytes
    for _ in range(3):  # the header's length depends on the payload size it states
        head = stub_header(frames, fps, width, height, [(frames, payload)])
        payload = max(0, nbytes - len(head))
    head = stub_header(frames, fps, width, height, [(frames, payload)])
    filler = np.random.default_rng(seed).bytes(payload)
    return head + filler


def stub_header(frames: int, fps: int, width: int, height: int,
                segments: list[tuple[int, int]]) -> bytes:
    """The header line of a stub: frame count, rate, and (frames, payload bytes) per segment."""
    meta = {"frames": frames, "fps": fps, "width": width, "height": height,
            "payload": sum(b for _, b in segments), "segments": [list(s) for s in segments]}
    return STUB_MAGIC + json.dumps(meta, separators=(",", ":")).encode() + b"\n"


@dataclass(frozen=True)
class VideoInfo:
    """What a video file holds, read from its packets (not decoded)."""

    path: str
    codec: str
    width: int
    height: int
    frames: int
    duration: Fraction  # seconds, first pts to end of last frame
    size: int
    stub: bool = False


def _read_stub(fs: fsspec.AbstractFileSystem, path: str) -> tuple[dict[str, Any], int] | None:
    """(header, header length) when ``path`` is a stub, else None."""
    with fs.open(path, "rb") as f:
        head = f.read(len(STUB_MAGIC))
        if head != STUB_MAGIC:
            return None
        line = f.readline(_STUB_HEAD_MAX)
    try:
        meta = json.loads(line)
    except ValueError:
        raise DatasetError(path, "stand-in video with a corrupt header") from None
    return meta, len(STUB_MAGIC) + len(line)


def _stub_info(fs: fsspec.AbstractFileSystem, path: str, meta: dict, head_len: int) -> VideoInfo:
    size = fs.size(path)
    if size != head_len + meta["payload"]:
        raise DatasetError(path, f"truncated stand-in video ({size} bytes, header says "
                                 f"{head_len + meta['payload']})")
    return VideoInfo(path, STUB_CODEC, meta["width"], meta["height"], meta["frames"],
                     Fraction(meta["frames"], meta["fps"]), size, stub=True)


def _av_error(path: str, e: Exception) -> DatasetError:
    return DatasetError(path, f"not a readable video, truncated or corrupt ({e})")


@contextlib.contextmanager
def open_video(fs: fsspec.AbstractFileSystem, path: str) -> Iterator[tuple[Any, Any, Fraction]]:
    """A real video opened with PyAV: (container, its first video stream, that stream's time
    base). A missing or unreadable file, or one without a video stream, raises DatasetError
    naming it; so does an FFmpeg error while the caller reads it."""
    import av

    with open_input(fs, path) as src:
        try:
            container = av.open(src, "r")
        except av.error.FFmpegError as e:
            raise _av_error(path, e) from None
        with container:
            stream = _video_stream(path, container)
            try:
                yield container, stream, _time_base(path, stream)
            except av.error.FFmpegError as e:
                raise _av_error(path, e) from None


def probe(fs: fsspec.AbstractFileSystem, path: str) -> VideoInfo:
    """Frame count and duration of a video, by reading every packet (cheap: no decoding)."""
    stub = _read_stub(fs, path) if fs.exists(path) else None
    if stub:
        return _stub_info(fs, path, *stub)
    frames = 0
    first: int | None = None
    end = 0
    with open_video(fs, path) as (inp, s, tb):
        step = _frame_ticks(s)
        for pkt in inp.demux(s):
            if pkt.dts is None:
                continue
            pts = pkt.pts if pkt.pts is not None else pkt.dts
            first = pts if first is None else min(first, pts)
            end = max(end, pts + (pkt.duration or step))
            frames += 1
        cc = s.codec_context
        return VideoInfo(path, cc.name, cc.width, cc.height, frames,
                         Fraction(end - (first or 0)) * tb, fs.size(path))


def _time_base(path: str, stream: VideoStream) -> Fraction:
    """A demuxed stream's time base: FFmpeg gives every stream it opens one (PyAV's None is for
    an output stream not yet set up)."""
    if stream.time_base is None:
        raise DatasetError(path, "has a video stream without a time base")
    return Fraction(stream.time_base)


def _frame_ticks(stream: Any) -> int:
    """One frame's duration in the stream's time base (for packets without a duration)."""
    rate = stream.average_rate or stream.guessed_rate or 30
    return max(1, round(1 / (Fraction(rate) * stream.time_base)))


@dataclass(frozen=True)
class Segment:
    """One input of a concatenation: its frames, its duration and where it starts in the output."""

    frames: int
    duration: Fraction
    start: Fraction


def concat(fs: fsspec.AbstractFileSystem, inputs: list[str], output: str,
           expected_frames: list[int] | None = None) -> list[Segment]:
    """Join episode videos into one file by stream copy (no re-encode), as FFmpeg's concat
    demuxer does for LeRobot's converter.

    Each input is rebased on its first *presentation* time, so its first frame is shown where
    the previous input's last frame ends and every frame keeps its place relative to the
    episode's start: episode ``k`` spans ``[start_k, start_k + duration_k)`` in the output,
    ``duration_k`` running from its first frame's pts to the end of its last frame. Decode times
    move with the presentation times, so a stream with B-frames (whose first decode time lies
    before its first presentation time) keeps its reordering. Stand-in videos are joined
    byte-wise under one new header. ``output`` is a local OS path.

    Raises:
        DatasetError: naming the input that is missing, unreadable, truncated, holds another
            number of frames than expected, hides frames behind an edit list, or cannot be
            joined to the first by stream copy (other codec parameters).
    """
    stubs = [_read_stub(fs, p) if fs.exists(p) else None for p in inputs[:1]]
    if stubs and stubs[0]:
        return _concat_stubs(fs, inputs, output, expected_frames)
    import av

    segments: list[Segment] = []
    with av.open(output, "w", format="mp4", options={"movflags": "faststart"}) as out:
        ostream = None
        ref: tuple[Any, ...] = ()  # the first input's codec parameters, set with ostream
        out_tb = Fraction(1)
        offset = 0  # output ticks where the next input's first frame is shown
        last_dts: int | None = None  # the last decode time written, output ticks
        lead_ref: int | None = None  # the first input's decode lead, output ticks
        for i, path in enumerate(inputs):
            with open_video(fs, path) as (inp, s, in_tb):
                key = _stream_key(s)
                if ostream is None:
                    ostream = out.add_stream_from_template(s, opaque=True)
                    out_tb = in_tb
                    ostream.time_base = out_tb
                    ref = key
                elif key != ref:
                    raise DatasetError(
                        path, f"cannot be joined by stream copy to {inputs[0]}: codec "
                        f"parameters differ ({_describe_key(key)} vs {_describe_key(ref)}); "
                        "re-encode the episodes' videos with one encoder setting")
                step = _frame_ticks(s)
                packets = _episode_packets(path, inp, s)
            want = expected_frames[i] if expected_frames else None
            if want is not None and len(packets) != want:
                raise DatasetError(path, f"holds {len(packets)} frames, the episode has {want} "
                                         "(truncated or wrong video)")
            first = min(p.pts for p in packets)
            end = max(p.pts + (p.duration or step) for p in packets)
            scale = in_tb / out_tb
            # How far the first decode time lies before the first presentation time (B-frames
            # reorder). Every input decodes that far ahead of its start as the first one does:
            # demuxers index keyframes by decode time and shift a seek by the first input's lead,
            # so an input that led less (a one-frame episode) would be found only by seeking to
            # a keyframe of the input before it, whose decoder may then drop frames (FFmpeg's
            # HEVC decoder does, after starting at a CRA).
            lead = -min(_rescale(p.dts - first, scale) for p in packets)
            if lead_ref is None:
                lead_ref = lead
            extra = max(0, lead_ref - lead)
            # An input that reorders more than the first would decode before the previous
            # input's last frame: it starts that much later (its timestamps say where).
            if last_dts is not None and offset - lead - extra <= last_dts:
                offset = last_dts + 1 + lead + extra
            try:
                for pkt in packets:
                    pts, dts, dur = pkt.pts, pkt.dts, pkt.duration or step
                    pkt.pts = offset + _rescale(pts - first, scale)
                    pkt.dts = offset + _rescale(dts - first, scale) - extra
                    pkt.duration = _rescale(dur, scale)
                    pkt.time_base = out_tb
                    pkt.stream = ostream
                    last_dts = pkt.dts
                    out.mux(pkt)
            except av.error.FFmpegError as e:
                raise DatasetError(path, f"cannot be joined by stream copy ({e})") from None
            segments.append(Segment(len(packets), Fraction(end - first) * in_tb,
                                    Fraction(offset) * out_tb))
            offset += _rescale(end - first, scale)
    return segments


def _video_stream(path: str, inp: Any) -> Any:
    if not inp.streams.video:
        raise DatasetError(path, "has no video stream")
    return inp.streams.video[0]


def _stream_key(stream: Any) -> tuple[Any, ...]:
    """What must be equal for two streams' packets to share one output stream."""
    cc = stream.codec_context
    return (cc.name, cc.width, cc.height, cc.pix_fmt, bytes(cc.extradata or b""))


def _describe_key(key: tuple[Any, ...]) -> str:
    name, width, height, pix_fmt, extradata = key
    return f"{name} {width}x{height} {pix_fmt}, {len(extradata)}-byte codec header"


def _episode_packets(path: str, inp: Any, stream: Any) -> list[Any]:
    """Every packet of one episode's video (timestamps in the stream's time base, pts set).

    Raises:
        DatasetError: the file is corrupt, holds no frame, or hides frames (an edit list that
            starts after the first decoded frame: stream copy into a joined file would show
            them).
    """
    packets = []
    hidden = 0
    for pkt in inp.demux(stream):
        if pkt.dts is None:  # the demuxer's final flush packet
            continue
        if pkt.pts is None:
            pkt.pts = pkt.dts
        hidden += bool(pkt.is_discard)
        packets.append(pkt)
    if not packets:
        raise DatasetError(path, "holds no frames")
    if hidden:
        raise DatasetError(path, f"hides {hidden} decoded frames behind an mp4 edit list; stream "
                                 "copy into a joined file would show them: re-encode this video "
                                 "without the edit list")
    return packets


def _rescale(ticks: int, scale: Fraction) -> int:
    """Ticks of one time base in another (``scale`` = source / destination time base)."""
    return ticks if scale == 1 else round(ticks * scale)


def _concat_stubs(fs: fsspec.AbstractFileSystem, inputs: list[str], output: str,
                  expected_frames: list[int] | None) -> list[Segment]:
    infos = []
    for i, path in enumerate(inputs):
        stub = _read_stub(fs, path) if fs.exists(path) else None
        if stub is None:
            raise DatasetError(path, "missing, or a real video among stand-in videos")
        meta, head_len = stub
        info = _stub_info(fs, path, meta, head_len)
        want = expected_frames[i] if expected_frames else None
        if want is not None and info.frames != want:
            raise DatasetError(path, f"holds {info.frames} frames, the episode has {want}")
        infos.append((meta, head_len))
    first = infos[0][0]
    segs = [(m["frames"], m["payload"]) for m, _ in infos]
    head = stub_header(sum(f for f, _ in segs), first["fps"], first["width"], first["height"], segs)
    out_segments = []
    start = Fraction(0)
    with open(output, "wb") as out:
        out.write(head)
        for path, (meta, head_len) in zip(inputs, infos, strict=True):
            with fs.open(path, "rb") as f:
                f.seek(head_len)
                while chunk := f.read(1 << 20):
                    out.write(chunk)
            dur = Fraction(meta["frames"], meta["fps"])
            out_segments.append(Segment(meta["frames"], dur, start))
            start += dur
    return out_segments


@dataclass(frozen=True)
class Packet:
    """One compressed frame: presentation time in seconds, payload, keyframe flag."""

    time: Fraction
    data: bytes
    keyframe: bool


def iter_packets(fs: fsspec.AbstractFileSystem, path: str) -> Iterator[Packet]:
    """Every packet of a real video in file order (stubs have none: use :func:`stub_payloads`)."""
    with open_video(fs, path) as (inp, s, tb):
        for pkt in inp.demux(s):
            if pkt.dts is None:
                continue
            pts = pkt.pts if pkt.pts is not None else pkt.dts
            yield Packet(pts * tb, bytes(pkt), bool(pkt.is_keyframe))


def is_stub(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """True when ``path`` is a stand-in video."""
    return _read_stub(fs, path) is not None


def stub_payloads(fs: fsspec.AbstractFileSystem, path: str) -> list[tuple[int, bytes]]:
    """(frames, payload) of each segment of a stand-in video."""
    stub = _read_stub(fs, path)
    if stub is None:
        raise DatasetError(path, "not a stand-in video")
    meta, head_len = stub
    _stub_info(fs, path, meta, head_len)
    out = []
    with fs.open(path, "rb") as f:
        f.seek(head_len)
        for frames, nbytes in meta["segments"]:
            out.append((frames, f.read(nbytes)))
    return out
