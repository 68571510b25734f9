"""Decoded camera frames, for checking conversions by what a loader sees.

A conversion is judged by decoded pixels at presentation times, never by compressed packets:
a remuxer may rewrite a packet's bytes (FFmpeg's concat demuxer does, for some keyframes) and
leave every decoded frame the same, and a timestamp shift leaves every packet's bytes the same
while a loader gets another frame. Pixels stay in the stream's own format (no colour
conversion), so equal frames compare equal bit for bit and the check costs only the decode.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import fsspec
import numpy as np

from .fsutil import DatasetError
from .video import open_video

__all__ = ["Frame", "FrameSeeker", "frame_times", "iter_frames", "same_image"]


@dataclass(frozen=True)
class Frame:
    """One decoded frame: its presentation time in the file (seconds) and its pixels."""

    time: Fraction
    image: np.ndarray


def _pixels(frame: Any) -> np.ndarray:
    """The frame's planes as one array in its own pixel format (RGB where PyAV has no array
    layout for that format)."""
    try:
        return frame.to_ndarray()
    except (ValueError, NotImplementedError):
        return frame.to_ndarray(format="rgb24")


def same_image(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-for-bit equal frames."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))


def frame_times(fs: fsspec.AbstractFileSystem, path: str) -> list[Fraction]:
    """Presentation times of every frame, sorted, from the packet headers (no decoding)."""
    with open_video(fs, path) as (container, stream, tb):
        times = [Fraction(p.pts if p.pts is not None else p.dts) * tb
                 for p in container.demux(stream) if p.dts is not None]
    times.sort()
    return times


def iter_frames(fs: fsspec.AbstractFileSystem, path: str) -> Iterator[Frame]:
    """Every frame of a video in presentation order, decoded from the start."""
    with open_video(fs, path) as (container, stream, tb):
        for frame in container.decode(stream):
            if frame.pts is not None:
                yield Frame(Fraction(frame.pts) * tb, _pixels(frame))


class FrameSeeker:
    """Frames at chosen times, as a loader reads them: seek to the keyframe at or before the
    time, decode forward, take the nearest frame.

    Every time seeks (a keyframe every few frames, as LeRobot encodes, makes that short): two
    frames decoded one after the other need not be neighbours, as a decoder may drop frames it
    cannot decode after a seek (FFmpeg's HEVC decoder, started at a CRA, drops the frames up
    to the next CRA of a joined file).
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str):
        self.path = path
        self._video = open_video(fs, path)
        self._container, self._stream, self._tb = self._video.__enter__()
        self._frames: Iterator[Any] | None = None
        self._prev: Frame | None = None  # the last frame decoded at or before the last time
        self._ahead: Frame | None = None  # decoded past the last time, not yet handed out
        self.decoded = 0

    def __enter__(self) -> FrameSeeker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the video."""
        self._video.__exit__(None, None, None)

    def _seek(self, t: Fraction) -> None:
        self._container.seek(max(0, int(t / self._tb)), stream=self._stream, backward=True,
                             any_frame=False)
        self._frames = None
        self._prev = self._ahead = None

    def _next(self) -> Frame | None:
        import av

        if self._ahead is not None:
            f, self._ahead = self._ahead, None
            return f
        if self._frames is None:
            self._frames = iter(self._container.decode(self._stream))
        try:
            while True:
                frame = next(self._frames)
                if frame.pts is not None:
                    self.decoded += 1
                    return Frame(Fraction(frame.pts) * self._tb, _pixels(frame))
        except StopIteration:
            return None
        except av.error.FFmpegError as e:
            raise DatasetError(self.path, f"not a decodable video ({e})") from None

    def at(self, t: Fraction) -> Frame | None:
        """The decoded frame nearest to ``t`` (seconds), or None for a video with no frames."""
        self._seek(t)
        found = self._forward(t)
        if found is None or (self._prev is None and found.time > t):
            # The seek landed past ``t`` (demuxers may index keyframes by decode time): start
            # over from the beginning, which is always a keyframe.
            self._seek(Fraction(0))
            found = self._forward(t)
        return found

    def _forward(self, t: Fraction) -> Frame | None:
        """Decode until a frame lies past ``t``; the nearer of it and the one before."""
        while True:
            f = self._next()
            if f is None:
                return self._prev
            if f.time <= t:
                self._prev = f
                continue
            self._ahead = f
            if self._prev is None or f.time - t < t - self._prev.time:
                return f
            return self._prev
