"""Check a v2.1 -> v3.0 conversion frame by frame: ``jpfs lerobot verify SRC DST``.

A conversion is right when every frame's row in DST equals its row in SRC, and every episode's
video in DST shows SRC's frames at the same times: inside the episode's from/to span, DST holds
exactly SRC's frames, frame ``j`` shown at ``from_timestamp + (t_j - t_0)`` where SRC shows it at
``t_j``, and each decodes to SRC's pixels bit for bit. Decoded frames are compared, not packets:
a remuxer may rewrite packets and keep every frame, and a timestamp shift keeps every packet and
hands a loader another frame. ``frames="full"`` decodes every frame; ``"sample"`` decodes each
episode's first, middle and last frames (timestamps and frame counts are checked for every frame
either way, from the packet headers). Metadata (episodes, tasks, index ranges) must match too.
Problems are collected, not raised, so one run reports them all.

Data rows are compared by value and logical type, not by Arrow representation: LeRobot's own
converter writes ``list<float>`` where v2.1 files hold ``fixed_size_list<float>[n]`` (and other
writers use large strings or dictionary encoding). Such differences are reported as notes; a
different value, dtype or column set is a problem.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
from collections import Counter, deque
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import pyarrow as pa
from tqdm import tqdm

from . import frames as fr
from . import video
from .dataset import DatasetMeta, EpisodeInfo, load_meta
from .fsutil import DatasetError, get_fs, join, read_table
from .workers import default_workers, worker_pool

log = logging.getLogger(__name__)

__all__ = ["verify"]

TIME_TOLERANCE = 1e-4  # seconds: LeRobot's default tolerance_s, far below half a frame
MAX_PROBLEMS = 100
FRAME_CHECKS = ("full", "sample")
NEAR = 4  # frames searched either side of a mismatch for where the wanted frame went


def verify(src: str, dst: str, workers: int | None = None, executor: str = "thread",
           progress: bool = True, frames: str = "full") -> dict[str, Any]:
    """Compare DST (v3.0) with SRC (v2.1); returns figures and a list of problems (empty: ok).

    Args:
        frames: "full" decodes every video frame of both; "sample" each episode's first, middle
            and last (every frame's time and the frame counts are checked either way).
    """
    if frames not in FRAME_CHECKS:
        raise ValueError(f"frames must be one of {', '.join(FRAME_CHECKS)}, not {frames!r}")
    _cached_meta.cache_clear()
    _timestamps.cache_clear()
    old = load_meta(src)
    new = load_meta(dst)
    problems = _check_meta(old, new)
    notes: Counter[str] = Counter()
    if problems:
        return _report(src, dst, old, new, problems, 0, 0, notes)
    jobs: list[tuple[str, Any]] = [("data", f) for f in new.data_files]
    jobs += [("video", (k, f, frames)) for k in new.video_keys for f in _files_of(new, k)]
    workers = default_workers() if workers is None else max(1, workers)
    rows = videos = decoded = 0
    bar = tqdm(total=len(jobs), desc="verify", unit="file", disable=not progress)
    try:
        with worker_pool(min(workers, max(1, len(jobs))), executor) as pool:
            if pool is None:
                results: Iterator[tuple[Any, list[str], list[str]]] = (
                    _check_file(src, dst, kind, arg) for kind, arg in jobs)
            else:
                results = pool.map(_check_file, [src] * len(jobs), [dst] * len(jobs),
                                   [k for k, _ in jobs], [a for _, a in jobs])
            for (kind, _), (count, found, noted) in zip(jobs, results, strict=True):
                if kind == "data":
                    rows += count
                else:
                    videos += count[0]
                    decoded += count[1]
                problems.extend(found)
                notes.update(noted)
                bar.update(1)
    finally:
        bar.close()
    if rows != old.total_frames and not problems:
        problems.append(f"checked {rows} frames, SRC has {old.total_frames}")
    report = _report(src, dst, old, new, problems, rows, videos, notes)
    report.update(video_frames_decoded=decoded, frame_check=frames)
    return report


def _report(src: str, dst: str, old: DatasetMeta, new: DatasetMeta, problems: list[str],
            rows: int, videos: int, notes: Counter[str]) -> dict[str, Any]:
    return {
        "src": src, "dst": dst, "ok": not problems, "episodes": len(old.episodes),
        "frames_checked": rows, "episode_videos_checked": videos,
        "problems": problems[:MAX_PROBLEMS], "problem_count": len(problems),
        "notes": [f"{n} [{c} data files]" if c > 1 else n for n, c in sorted(notes.items())],
    }


def _files_of(meta: DatasetMeta, key: str) -> list[str]:
    return list(dict.fromkeys(ep.videos[key].path for ep in meta.episodes))


def _check_meta(old: DatasetMeta, new: DatasetMeta) -> list[str]:
    problems = []
    if old.version != "v2.1" or new.version != "v3.0":
        problems.append(f"expected SRC v2.1 and DST v3.0, found {old.version} and {new.version}")
    if old.fps != new.fps:
        problems.append(f"fps {new.fps} in DST, {old.fps} in SRC")
    if old.tasks != new.tasks:
        problems.append("tasks differ")
    if old.video_keys != new.video_keys:
        problems.append(f"cameras differ: {new.video_keys} vs {old.video_keys}")
    strip = {k: {kk: vv for kk, vv in ft.items() if kk != "fps"} for k, ft in new.features.items()}
    if strip != old.features:
        problems.append("features in meta/info.json differ")
    if len(old.episodes) != len(new.episodes):
        problems.append(f"{len(new.episodes)} episodes in DST, {len(old.episodes)} in SRC")
        return problems
    for a, b in zip(old.episodes, new.episodes, strict=True):
        if (a.index, a.length, a.tasks, a.dataset_from, a.dataset_to) != (
                b.index, b.length, b.tasks, b.dataset_from, b.dataset_to):
            problems.append(f"episode {a.index}: metadata differs (length, tasks or index range)")
    for key in new.video_keys:
        for ep in new.episodes:
            seg = ep.videos[key]
            if not seg.to_timestamp > seg.from_timestamp >= 0:
                problems.append(f"episode {ep.index} {key}: from/to span [{seg.from_timestamp}, "
                                f"{seg.to_timestamp}) holds no time")
    return problems


def _check_file(src: str, dst: str, kind: str, arg: Any) -> tuple[Any, list[str], list[str]]:
    """Check one DST file against SRC; returns (rows, or (episode videos, frames decoded),
    checked; problems; notes)."""
    old = _cached_meta(src)
    new = _cached_meta(dst)
    nothing: Any = 0 if kind == "data" else (0, 0)
    try:
        if kind == "data":
            return _check_data(old, new, arg)
        return _check_video(old, new, *arg)
    except DatasetError as e:
        return nothing, [str(e)], []
    except FileNotFoundError as e:
        return nothing, [f"{e.filename or arg}: missing"], []


@functools.lru_cache(maxsize=4)
def _cached_meta(root: str) -> DatasetMeta:
    """Metadata loaded once per worker process, not once per checked file."""
    return load_meta(root)


def _check_data(old: DatasetMeta, new: DatasetMeta, rel: str
                ) -> tuple[int, list[str], list[str]]:
    sfs, sbase = get_fs(old.root)
    dfs, dbase = get_fs(new.root)
    path = join(dbase, rel)
    table = read_table(dfs, path).replace_schema_metadata(None)
    eps = [ep for ep in new.episodes if ep.data_file == rel]
    problems = []
    notes: set[str] = set()
    frames = 0
    covered = 0
    for ep in eps:
        src_ep = old.episode(ep.index)
        want = read_table(sfs, join(sbase, src_ep.data_file)).replace_schema_metadata(None)
        got = table.slice(ep.row_start, ep.length)
        covered += ep.length
        bad, noted = compare_schemas(got.schema, want.schema)
        notes.update(noted)
        if bad:
            problems.append(f"{path}: episode {ep.index}: {'; '.join(bad)}")
            continue
        cols = [c for c in want.column_names
                if not canonical(got.column(c)).equals(canonical(want.column(c)))]
        if cols:
            problems.append(f"{path}: episode {ep.index} rows {ep.row_start}-"
                            f"{ep.row_start + ep.length}: values of {cols} differ from SRC")
            continue
        index = got.column("index").to_numpy()
        if len(index) and (index[0] != ep.dataset_from or index[-1] != ep.dataset_to - 1):
            problems.append(f"{path}: episode {ep.index}: index column does not match "
                            "dataset_from_index/dataset_to_index")
        frames += ep.length
    if covered != table.num_rows:
        problems.append(f"{path}: {table.num_rows} rows, its episodes account for {covered}")
    return frames, problems, sorted(notes)


def logical_type(t: pa.DataType) -> pa.DataType:
    """The type with representation choices taken out: any list kind is a list, large strings
    and binaries are plain ones, a dictionary is its values' type."""
    if pa.types.is_dictionary(t):
        return logical_type(t.value_type)
    if pa.types.is_fixed_size_list(t) or pa.types.is_large_list(t) or pa.types.is_list(t):
        return pa.list_(logical_type(t.value_type))
    if pa.types.is_large_string(t) or str(t) == "string_view":
        return pa.string()
    if pa.types.is_large_binary(t) or str(t) == "binary_view":
        return pa.binary()
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, logical_type(f.type)) for f in t])
    return t


def canonical(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """A column in its logical type's representation, so equal values compare equal."""
    want = logical_type(col.type)
    return col if col.type == want else col.cast(want)


def compare_schemas(got: pa.Schema, want: pa.Schema) -> tuple[list[str], list[str]]:
    """(problems, notes) of DST's frame schema against SRC's: missing or extra columns and
    different logical types are problems; representation, order and nullability are notes."""
    problems, notes = [], []
    missing = [n for n in want.names if n not in got.names]
    extra = [n for n in got.names if n not in want.names]
    if missing:
        problems.append(f"columns {missing} missing")
    if extra:
        problems.append(f"columns {extra} not in SRC")
    common = [n for n in want.names if n in got.names]
    if not missing and not extra and got.names != want.names:
        notes.append("columns in another order than in SRC")
    for name in common:
        a, b = got.field(name), want.field(name)
        if logical_type(a.type) != logical_type(b.type):
            problems.append(f"column {name!r} is {a.type}, SRC has {b.type}")
        elif a.type != b.type:
            notes.append(f"column {name!r} stored as {a.type} in DST, {b.type} in SRC: the "
                         "same logical type, values compared")
        if a.nullable != b.nullable:
            notes.append(f"column {name!r} nullable={a.nullable}, SRC nullable={b.nullable}")
    return problems, notes


def _check_video(old: DatasetMeta, new: DatasetMeta, key: str, rel: str, frames: str
                 ) -> tuple[tuple[int, int], list[str], list[str]]:
    """One DST video file against each of its episodes' SRC videos: times, counts, pixels."""
    sfs, sbase = get_fs(old.root)
    dfs, dbase = get_fs(new.root)
    path = join(dbase, rel)
    eps = [ep for ep in new.episodes if ep.videos[key].path == rel]
    if video.is_stub(dfs, path):
        checked, stub_problems = _check_stub(old, new, key, path, eps)
        return (checked, 0), stub_problems, []
    dst_times = fr.frame_times(dfs, path)
    tol = Fraction(TIME_TOLERANCE)
    problems: list[str] = []
    notes: list[str] = []
    checked = covered = 0
    decoded = 0
    full = _DecodedFile(dfs, path) if frames == "full" else None
    seeker = fr.FrameSeeker(dfs, path) if frames == "sample" else None
    try:
        for ep in eps:
            seg = ep.videos[key]
            start = Fraction(seg.from_timestamp)
            lo = bisect.bisect_left(dst_times, start - tol)
            hi = bisect.bisect_left(dst_times, Fraction(seg.to_timestamp) - tol)
            covered += hi - lo
            where = f"{path}: episode {ep.index} camera {key}"
            src_ep = old.episode(ep.index)
            src_path = join(sbase, src_ep.videos[key].path)
            src_times = fr.frame_times(sfs, src_path)
            got = [t - start for t in dst_times[lo:hi]]
            want = [t - src_times[0] for t in src_times]
            problem = _check_times(got, want, ep.length, start, tol)
            if problem:
                problems.append(f"{where}: {problem}")
                continue
            note = _check_timestamps(_timestamps(old.root, src_ep.data_file), src_path, want,
                                     tol)
            if note:
                notes.append(note)
            if full is not None:
                problem, n = _compare_all(full, fr.iter_frames(sfs, src_path), start, tol)
            else:
                assert seeker is not None
                problem, n = _compare_sample(seeker, sfs, src_path, dst_times[lo:hi], src_times)
            decoded += n
            if problem:
                problems.append(f"{where}: {problem}")
                continue
            checked += 1
    finally:
        if seeker is not None:
            seeker.close()
        if full is not None:
            full.close()
    if covered != len(dst_times):
        problems.append(f"{path}: {len(dst_times) - covered} of its {len(dst_times)} frames lie "
                        "outside every episode's from/to span")
    return (checked, decoded), problems, notes


def _check_times(got: list[Fraction], want: list[Fraction], length: int, start: Fraction,
                 tol: Fraction) -> str | None:
    """Why DST's frame times inside an episode's span (``got``, relative to its start) are not
    SRC's (``want``, relative to its first frame), or None."""
    if len(want) != length:
        return f"SRC's video holds {len(want)} frames, the episode has {length}"
    for j, w in enumerate(want):
        if j >= len(got) or abs(got[j] - w) > tol:
            if got:
                k = min(range(len(got)), key=lambda i: abs(got[i] - w))
                near = (f"the nearest DST frame to that time is its frame {k}, at "
                        f"{float(got[k]):.6f} s ({float(start + got[k]):.6f} s in the file)")
            else:
                near = "DST has no frame in the span"
            shown = (f"DST shows it at {float(got[j]):.6f} s" if j < len(got)
                     else f"DST's span holds only {len(got)} frames")
            return (f"frame {j} is shown at {float(w):.6f} s of the episode in SRC; {shown}; "
                    f"{near}")
    if len(got) > len(want):
        return (f"DST's span holds {len(got)} frames, SRC's episode {len(want)}: frame "
                f"{len(want)} at {float(got[len(want)]):.6f} s of the episode is not SRC's")
    return None


@functools.lru_cache(maxsize=1024)
def _timestamps(root: str, rel: str) -> tuple[float, ...]:
    """An SRC episode's timestamp column, read once for all its cameras."""
    fs, base = get_fs(root)
    return tuple(read_table(fs, join(base, rel), columns=["timestamp"]).column("timestamp")
                 .to_pylist())


def _check_timestamps(column: tuple[float, ...], video_path: str, times: list[Fraction],
                      tol: Fraction) -> str | None:
    """A note when SRC's own frames are not where its timestamp column says (a loader of SRC
    then gets the same frames as one of DST: the conversion kept them where they were)."""
    off = [j for j, (t, ts) in enumerate(zip(times, column, strict=False))
           if abs(t - Fraction(ts)) > tol]
    if not off:
        return None
    j = off[0]
    return (f"SRC {video_path}: {len(off)} frames are not at their timestamp (frame {j} at "
            f"{float(times[j]):.6f} s, its timestamp {column[j]:.6f} s); DST keeps them as SRC has "
            "them")


class _DecodedFile:
    """A DST video decoded once from its start, handed out episode by episode (by time)."""

    def __init__(self, fs: Any, path: str):
        self._frames = fr.iter_frames(fs, path)
        self._ahead: deque[fr.Frame] = deque()  # decoded, not yet handed out
        self.recent: deque[fr.Frame] = deque(maxlen=NEAR + 1)  # the last handed out

    def close(self) -> None:
        self._frames.close()  # type: ignore[attr-defined]  # a generator

    def _pull(self) -> fr.Frame | None:
        return self._ahead.popleft() if self._ahead else next(self._frames, None)

    def next_from(self, start: Fraction) -> fr.Frame | None:
        """The next frame shown at or after ``start``."""
        while (f := self._pull()) is not None and f.time < start:
            pass
        if f is not None:
            self.recent.append(f)
        return f

    def peek(self, n: int) -> list[fr.Frame]:
        """Up to ``n`` frames after the last one handed out, left to be handed out."""
        while len(self._ahead) < n and (f := next(self._frames, None)) is not None:
            self._ahead.append(f)
        return list(self._ahead)[:n]


def _compare_all(dst: _DecodedFile, src: Iterator[fr.Frame], start: Fraction, tol: Fraction
                 ) -> tuple[str | None, int]:
    """Every decoded frame of one episode, DST against SRC; (problem or None, frames decoded)."""
    try:
        return _compare_frames(dst, src, start, tol)
    finally:
        src.close()  # type: ignore[attr-defined]  # a generator: closes its video


def _compare_frames(dst: _DecodedFile, src: Iterator[fr.Frame], start: Fraction, tol: Fraction
                    ) -> tuple[str | None, int]:
    decoded = 0
    recent: deque[fr.Frame] = deque(maxlen=NEAR)
    dst.recent.clear()
    first: Fraction | None = None
    for j, s in enumerate(src):
        first = s.time if first is None else first
        d = dst.next_from(start - tol)
        decoded += 2
        if d is None:
            return f"DST's video ends before frame {j}", decoded
        if abs((d.time - start) - (s.time - first)) > tol:
            return (f"frame {j} decodes at {float(d.time - start):.6f} s of the episode in DST, "
                    f"{float(s.time - first):.6f} s in SRC"), decoded
        if not fr.same_image(d.image, s.image):
            src_after = list(itertools.islice(src, NEAR))
            return _mismatch(j, s, list(recent), src_after, list(dst.recent)[:-1], d,
                             dst.peek(NEAR), first), decoded
        recent.append(s)
    return None, decoded


def _mismatch(j: int, s: fr.Frame, src_before: list[fr.Frame], src_after: list[fr.Frame],
              dst_before: list[fr.Frame], d: fr.Frame, dst_after: list[fr.Frame],
              first: Fraction) -> str:
    """Frame ``j`` differs: say where SRC's frame ``j`` went, or which SRC frame DST shows."""
    head = (f"frame {j} (at {float(s.time - first):.6f} s of the episode) decodes to other pixels "
            f"than SRC's")
    window = [*dst_before, d, *dst_after]
    here = len(dst_before)
    for k, f in enumerate(window):
        if fr.same_image(f.image, s.image):
            return (f"{head}; SRC's frame {j} is DST's frame {j + k - here} of the episode, at "
                    f"{float(f.time):.6f} s in the file ({k - here:+d} frames)")
    shown = [*src_before, s, *src_after]
    here = len(src_before)
    for k, f in enumerate(shown):
        if k != here and fr.same_image(f.image, d.image):
            return (f"{head}; DST shows SRC's frame {j + k - here} there, and SRC's frame {j} "
                    f"nowhere near ({k - here:+d} frames)")
    return f"{head}; no frame within {NEAR} of it matches (re-encoded or corrupt)"


def _same_at(seeker: fr.FrameSeeker, t: Fraction, want: fr.Frame) -> bool:
    got = seeker.at(t)
    return got is not None and fr.same_image(got.image, want.image)


def _compare_sample(seeker: fr.FrameSeeker, fs: Any, src_path: str, dst_times: list[Fraction],
                    src_times: list[Fraction]) -> tuple[str | None, int]:
    """An episode's first, middle and last decoded frames, DST against SRC."""
    n = len(src_times)
    before = seeker.decoded
    decoded = 0
    with fr.FrameSeeker(fs, src_path) as src:
        for j in sorted({0, n // 2, n - 1}):
            s = src.at(src_times[j])
            d = seeker.at(dst_times[j])
            if s is None or d is None:
                return f"frame {j} does not decode", decoded
            if fr.same_image(d.image, s.image):
                continue
            near = range(max(0, j - NEAR), min(n, j + NEAR + 1))
            found = next((k for k in near if k != j and _same_at(seeker, dst_times[k], s)), None)
            shown = None if found is not None else next(
                (k for k in near if k != j and _same_at(src, src_times[k], d)), None)
            head = (f"frame {j} (at {float(src_times[j] - src_times[0]):.6f} s of the episode) "
                    "decodes to other pixels than SRC's")
            decoded = src.decoded + seeker.decoded - before
            if found is not None:
                return (f"{head}; SRC's frame {j} is DST's frame {found} of the episode, at "
                        f"{float(dst_times[found]):.6f} s in the file ({found - j:+d} frames)"
                        ), decoded
            if shown is not None:
                return (f"{head}; DST shows SRC's frame {shown} there, and SRC's frame {j} "
                        f"nowhere near ({shown - j:+d} frames)"), decoded
            return f"{head}; no frame within {NEAR} of it matches (re-encoded or corrupt)", \
                decoded
        decoded = src.decoded + seeker.decoded - before
    return None, decoded


def _check_stub(old: DatasetMeta, new: DatasetMeta, key: str, path: str,
                eps: list[EpisodeInfo]) -> tuple[int, list[str]]:
    sfs, sbase = get_fs(old.root)
    dfs, _ = get_fs(new.root)
    segs = video.stub_payloads(dfs, path)
    if len(segs) != len(eps):
        return 0, [f"{path}: {len(segs)} segments for {len(eps)} episodes"]
    for n, (ep, (frames, payload)) in enumerate(zip(eps, segs, strict=True)):
        src_path = join(sbase, old.episode(ep.index).videos[key].path)
        (want_frames, want_payload), = video.stub_payloads(sfs, src_path)
        if frames != ep.length or frames != want_frames or payload != want_payload:
            return n, [f"{path}: episode {ep.index}: stand-in segment differs from {src_path}"]
    return len(eps), []

