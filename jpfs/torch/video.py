"""Camera frames at sampled timestamps, decoded with PyAV.

Frames are requested in batches; per file the wanted times are sorted and decoded in one forward
pass, seeking only when a keyframe lies between the decoder and the next wanted frame (keyframe
times come from one scan of the packets, no decoding). That is the cheap way to serve a shuffled
window whose samples come from a handful of episodes (LeRobot encodes a keyframe every 2 frames,
so a seek is short). The frame nearest to each time is taken; it must lie within
``tolerance_s``, as in LeRobot's ``decode_video_frames``.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import numpy as np

from .store import Store

log = logging.getLogger(__name__)


class FrameError(ValueError):
    """No frame close enough to a requested timestamp (wrong video or wrong timestamps)."""


class _Cursor:
    """An open video and where its decoder stands."""

    def __init__(self, container: Any, handle: Any):
        self.container = container
        self.handle = handle
        self.stream = container.streams.video[0]
        self.stream.thread_type = "SLICE"
        self.frames: Any = None  # decode iterator
        self.prev: Any = None  # last frame at or before the previous target
        self.ahead: Any = None  # decoded, not yet passed
        self.ended = False
        self.keys = self._keyframes()
        from av.video.reformatter import VideoReformatter

        self.reformatter = VideoReformatter()  # keeps its scaler context from frame to frame

    def _keyframes(self) -> np.ndarray:
        """Times of the keyframes, from the packet headers; the file is rewound afterwards."""
        tb = float(self.stream.time_base)
        keys = [float(p.pts) * tb for p in self.container.demux(self.stream)
                if p.is_keyframe and p.pts is not None]
        self.container.seek(0, stream=self.stream, backward=True, any_frame=False)
        return np.asarray(sorted(keys), dtype=np.float64)

    def should_seek(self, t: float, tol: float) -> bool:
        """Seek when decoding forward would cost more than restarting from a keyframe."""
        last = self.prev.time if self.prev is not None else None
        if last is None:
            if self.frames is None:  # fresh or just seeked: at the file's start
                return t > (self.keys[1] if len(self.keys) > 1 else 0.0) - tol
            return False
        if t < last - tol:
            return True
        k = np.searchsorted(self.keys, t + tol, side="right") - 1
        return bool(k >= 0 and self.keys[k] > last + tol)

    def close(self) -> None:
        self.container.close()
        if self.handle is not None:
            self.handle.close()

    def seek(self, t: float) -> None:
        tb = self.stream.time_base
        self.container.seek(max(0, int(t / tb)), stream=self.stream, backward=True,
                            any_frame=False)
        self.frames = None
        self.prev = self.ahead = None
        self.ended = False

    def next_frame(self) -> Any:
        if self.frames is None:
            self.frames = self.container.decode(self.stream)
        try:
            return next(self.frames)
        except StopIteration:
            self.ended = True
            return None


class FrameReader:
    """Decodes frames of mp4 files of a store; keeps a few files open between calls."""

    def __init__(self, store: Store, *, tolerance_s: float = 1e-4, max_open: int = 32):
        self.store = store
        self.tolerance_s = tolerance_s
        self.max_open = max_open
        self._open: collections.OrderedDict[str, _Cursor] = collections.OrderedDict()
        self.decoded = 0
        self.seeks = 0

    def close(self) -> None:
        """Close every open video."""
        for cur in self._open.values():
            cur.close()
        self._open.clear()

    def _cursor(self, path: str) -> _Cursor:
        cur = self._open.get(path)
        if cur is not None:
            self._open.move_to_end(path)
            return cur
        import av

        if self.store.local:
            cur = _Cursor(av.open(path), None)
        else:
            handle = self.store.open(path)
            cur = _Cursor(av.open(handle), handle)
        self._open[path] = cur
        while len(self._open) > self.max_open:
            _, old = self._open.popitem(last=False)
            old.close()
        return cur

    def read(self, path: str, times: np.ndarray) -> np.ndarray:
        """RGB frames ``(len(times), H, W, 3)`` uint8 nearest to ``times`` (seconds in the file)."""
        times = np.asarray(times, dtype=np.float64)
        uniq, inverse = np.unique(times, return_inverse=True)
        cur = self._cursor(path)
        picked: list[np.ndarray] = []
        for t in uniq:
            picked.append(self._at(cur, float(t), path))
        frames = np.stack(picked) if picked else np.empty((0, 0, 0, 3), np.uint8)
        return frames[inverse.reshape(-1)]

    def _at(self, cur: _Cursor, t: float, path: str) -> np.ndarray:
        tol = self.tolerance_s
        if cur.should_seek(t, tol):
            cur.seek(t)
            self.seeks += 1
        while True:
            if cur.ahead is None and not cur.ended:
                cur.ahead = cur.next_frame()
                if cur.ahead is not None:
                    self.decoded += 1
            if cur.ahead is None:
                best = cur.prev
                break
            ft = cur.ahead.time
            if ft <= t + tol:
                cur.prev, cur.ahead = cur.ahead, None
                if abs(ft - t) <= tol:
                    best = cur.prev
                    break
                continue
            best = cur.ahead if cur.prev is None or (ft - t) < (t - cur.prev.time) else cur.prev
            break
        if best is None or abs(best.time - t) > tol:
            got = "nothing" if best is None else f"{best.time:.6f}s"
            raise FrameError(f"{path}: no frame within {tol}s of {t:.6f}s (nearest: {got})")
        # One reformatter per file: a fresh one per frame (frame.reformat, to_ndarray(format=))
        # rebuilds the colour converter every time, which costs more than decoding.
        return cur.reformatter.reformat(best, format="rgb24").to_ndarray()
