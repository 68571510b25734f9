"""Episode videos: tiny real encodes, sized stand-ins, probing, and stream-copy concatenation.

Real datasets hold AV1 mp4s; JPFS's generator writes small real encodes (PyAV) so that the converter
and loaders are exercised on genuine containers, or "stubs" (sized stand-in bytes with a one-line
header) when only the I/O shape matters. Stubs are recorded as ``video.codec == "jpfs-stub"``.
"""

from __future__ import annotations

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
# LeRobot encodes, no B-frames so pts == dts and every frame is one packet.
ENCODERS: dict[str, tuple[str, dict[str, str]]] = {
    "libsvtav1": ("av1", {"g": "2", "crf": "30", "preset": "12"}),
    "libx264": ("h264", {"g": "2", "crf": "30", "preset": "ultrafast", "bf": "0"}),
    "libvpx-vp9": ("vp9", {"g": "2", "crf": "30", "b": "0", "deadline": "realtime",
                           "cpu-used": "8"}),
}
CODEC_ALIASES = {"av1": "libsvtav1", "h264": "libx264", "vp9": "libvpx-vp9"}


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


def encode(frames: np.ndarray, fps: int, encoder: str) -> bytes:
    """An mp4 of ``frames`` ((n, H, W, 3) uint8 RGB): pts 0, 1, 2... in units of 1/fps."""
    import io

    import av

    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its banner to stderr otherwise
    _, options = ENCODERS[encoder]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        # ENCODERS names video encoders only; PyAV types a codec chosen by a run-time name as
        # any kind of stream.
        stream = cast("VideoStream", out.add_stream(encoder, rate=fps, options=dict(options)))
        stream.width = frames.shape[2]
        stream.height = frames.shape[1]
        stream.pix_fmt = "yuv420p"
        tb = Fraction(1, fps)
        for i, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = i
            frame.time_base = tb
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


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


def probe(fs: fsspec.AbstractFileSystem, path: str) -> VideoInfo:
    """Frame count and duration of a video, by reading every packet (cheap: no decoding)."""
    stub = _read_stub(fs, path) if fs.exists(path) else None
    if stub:
        return _stub_info(fs, path, *stub)
    frames = 0
    first: int | None = None
    end = 0
    import av

    with open_input(fs, path) as src:
        try:
            with av.open(src, "r") as inp:
                if not inp.streams.video:
                    raise DatasetError(path, "has no video stream")
                s = inp.streams.video[0]
                tb = _time_base(path, s)
                step = _frame_ticks(s)
                for pkt in inp.demux(s):
                    if pkt.dts is None:
                        continue
                    pts = pkt.pts if pkt.pts is not None else pkt.dts
                    first = pts if first is None else min(first, pts)
                    end = max(end, pts + (pkt.duration or step))
                    frames += 1
                info = VideoInfo(path, s.codec_context.name, s.codec_context.width,
                                 s.codec_context.height, frames,
                                 Fraction(end - (first or 0)) * tb, fs.size(path))
        except av.error.FFmpegError as e:
            raise _av_error(path, e) from None
    return info


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
    """Join episode videos into one file by stream copy (no re-encode), timestamps continuous.

    Each input's first frame lands right after the previous input's last frame ends, so episode
    ``k`` spans ``[start_k, start_k + duration_k)`` in the output. Stand-in videos are joined
    byte-wise under one new header. ``output`` is a local OS path.

    Raises:
        DatasetError: naming the input that is missing, unreadable, truncated, holds another
            number of frames than expected, or cannot be joined to the first (other codec).
    """
    stubs = [_read_stub(fs, p) if fs.exists(p) else None for p in inputs[:1]]
    if stubs and stubs[0]:
        return _concat_stubs(fs, inputs, output, expected_frames)
    import av

    segments: list[Segment] = []
    with av.open(output, "w", format="mp4", options={"movflags": "faststart"}) as out:
        ostream = None
        ref: tuple[Any, ...] = ()  # the first input's codec parameters, set with ostream
        offset = 0  # output ticks
        for i, path in enumerate(inputs):
            with open_input(fs, path) as src:
                try:
                    inp = av.open(src, "r")
                except av.error.FFmpegError as e:
                    raise _av_error(path, e) from None
                with inp:
                    if not inp.streams.video:
                        raise DatasetError(path, "has no video stream")
                    s = inp.streams.video[0]
                    cc = s.codec_context
                    key = (cc.name, cc.width, cc.height, bytes(cc.extradata or b""))
                    if ostream is None:
                        ostream = out.add_stream_from_template(s, opaque=True)
                        out_tb = _time_base(path, s)
                        ostream.time_base = out_tb
                        ref = key
                    elif key != ref:
                        raise DatasetError(
                            path, f"cannot be joined by stream copy to {inputs[0]}: codec "
                            f"parameters differ ({key[:3]} vs {ref[:3]})")
                    in_tb = _time_base(path, s)
                    same = in_tb == out_tb  # the usual case: plain integer offsets per packet
                    scale = in_tb / out_tb
                    step = _frame_ticks(s)
                    first: int | None = None
                    end = 0
                    frames = 0
                    try:
                        for pkt in inp.demux(s):
                            dts = pkt.dts
                            if dts is None:  # the demuxer's final flush packet
                                continue
                            pts = pkt.pts
                            if pts is None:
                                pts = dts
                            if first is None:
                                first = min(pts, dts)
                            dur = pkt.duration or step
                            rel = pts - first
                            if rel + dur > end:
                                end = rel + dur
                            if same:
                                pkt.pts = offset + rel
                                pkt.dts = offset + dts - first
                                pkt.duration = dur
                            else:
                                pkt.pts = offset + round(rel * scale)
                                pkt.dts = offset + round((dts - first) * scale)
                                pkt.duration = round(dur * scale)
                                pkt.time_base = out_tb
                            pkt.stream = ostream
                            out.mux(pkt)
                            frames += 1
                    except av.error.FFmpegError as e:
                        raise _av_error(path, e) from None
            want = expected_frames[i] if expected_frames else None
            if want is not None and frames != want:
                raise DatasetError(path, f"holds {frames} frames, the episode has {want} "
                                         "(truncated or wrong video)")
            ticks = _rescale(end, in_tb, out_tb)
            segments.append(Segment(frames, Fraction(end) * in_tb, Fraction(offset) * out_tb))
            offset += ticks
    return segments


def _rescale(ticks: int, src: Fraction, dst: Fraction) -> int:
    return ticks if src == dst else round(ticks * src / dst)


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
    import av

    with open_input(fs, path) as src:
        try:
            with av.open(src, "r") as inp:
                s = inp.streams.video[0]
                tb = _time_base(path, s)
                for pkt in inp.demux(s):
                    if pkt.dts is None:
                        continue
                    pts = pkt.pts if pkt.pts is not None else pkt.dts
                    yield Packet(pts * tb, bytes(pkt), bool(pkt.is_keyframe))
        except av.error.FFmpegError as e:
            raise _av_error(path, e) from None


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
