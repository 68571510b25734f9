"""Check a v2.1 -> v3.0 conversion frame by frame: ``jpfs lerobot verify SRC DST``.

A conversion is right when every frame's row in DST equals its row in SRC, and every episode's
video in DST holds the same compressed frames as SRC's mp4 (stream copy keeps them byte-identical)
at ``from_timestamp + t`` for each frame time ``t`` of the episode. Metadata (episodes, tasks,
index ranges) must match too. Problems are collected, not raised, so one run reports them all.

Data rows are compared by value and logical type, not by Arrow representation: LeRobot's own
converter writes ``list<float>`` where v2.1 files hold ``fixed_size_list<float>[n]`` (and other
writers use large strings or dictionary encoding). Such differences are reported as notes; a
different value, dtype or column set is a problem.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import pyarrow as pa
from tqdm import tqdm

from . import video
from .dataset import DatasetMeta, EpisodeInfo, load_meta
from .fsutil import DatasetError, get_fs, join, read_table
from .workers import default_workers, worker_pool

log = logging.getLogger(__name__)

__all__ = ["verify"]

TIME_TOLERANCE = 1e-4  # seconds; far below half a frame at any real frame rate
MAX_PROBLEMS = 100


def verify(src: str, dst: str, workers: int | None = None, executor: str = "thread",
           progress: bool = True) -> dict[str, Any]:
    """Compare DST (v3.0) with SRC (v2.1); returns figures and a list of problems (empty: ok)."""
    _cached_meta.cache_clear()
    old = load_meta(src)
    new = load_meta(dst)
    problems = _check_meta(old, new)
    notes: Counter[str] = Counter()
    if problems:
        return _report(src, dst, old, new, problems, 0, 0, notes)
    jobs: list[tuple[str, Any]] = [("data", f) for f in new.data_files]
    jobs += [("video", (k, f)) for k in new.video_keys for f in _files_of(new, k)]
    workers = default_workers() if workers is None else max(1, workers)
    frames = videos = 0
    bar = tqdm(total=len(jobs), desc="verify", unit="file", disable=not progress)
    try:
        with worker_pool(min(workers, max(1, len(jobs))), executor) as pool:
            if pool is None:
                results: Iterator[tuple[int, list[str], list[str]]] = (
                    _check_file(src, dst, kind, arg) for kind, arg in jobs)
            else:
                results = pool.map(_check_file, [src] * len(jobs), [dst] * len(jobs),
                                   [k for k, _ in jobs], [a for _, a in jobs])
            for (kind, _), (count, found, noted) in zip(jobs, results, strict=True):
                if kind == "data":
                    frames += count
                else:
                    videos += count
                problems.extend(found)
                notes.update(noted)
                bar.update(1)
    finally:
        bar.close()
    if frames != old.total_frames and not problems:
        problems.append(f"checked {frames} frames, SRC has {old.total_frames}")
    return _report(src, dst, old, new, problems, frames, videos, notes)


def _report(src: str, dst: str, old: DatasetMeta, new: DatasetMeta, problems: list[str],
            frames: int, videos: int, notes: Counter[str]) -> dict[str, Any]:
    return {
        "src": src, "dst": dst, "ok": not problems, "episodes": len(old.episodes),
        "frames_checked": frames, "episode_videos_checked": videos,
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
            span = seg.to_timestamp - seg.from_timestamp
            if abs(span - ep.length / new.fps) > TIME_TOLERANCE * ep.length:
                problems.append(f"episode {ep.index} {key}: from/to span {span:.6f} s for "
                                f"{ep.length} frames at {new.fps} fps")
    return problems


def _check_file(src: str, dst: str, kind: str, arg: Any) -> tuple[int, list[str], list[str]]:
    """Check one DST file against SRC; returns (frames or episode videos checked, problems,
    notes)."""
    old = _cached_meta(src)
    new = _cached_meta(dst)
    try:
        if kind == "data":
            return _check_data(old, new, arg)
        return (*_check_video(old, new, *arg), [])
    except DatasetError as e:
        return 0, [str(e)], []
    except FileNotFoundError as e:
        return 0, [f"{e.filename or arg}: missing"], []


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


def _check_video(old: DatasetMeta, new: DatasetMeta, key: str, rel: str
                 ) -> tuple[int, list[str]]:
    sfs, sbase = get_fs(old.root)
    dfs, dbase = get_fs(new.root)
    path = join(dbase, rel)
    eps = [ep for ep in new.episodes if ep.videos[key].path == rel]
    if video.is_stub(dfs, path):
        return _check_stub(old, new, key, path, eps)
    problems: list[str] = []
    packets = video.iter_packets(dfs, path)
    checked = 0
    for ep in eps:
        seg = ep.videos[key]
        src_path = join(sbase, old.episode(ep.index).videos[key].path)
        src_packets = list(video.iter_packets(sfs, src_path))
        first = min((p.time for p in src_packets), default=Fraction(0))
        bad = None
        count = 0
        for sp in src_packets:
            dp = next(packets, None)
            if dp is None:
                bad = f"ends after {count} of {len(src_packets)} frames"
                break
            t = float(dp.time)
            if dp.data != sp.data:
                bad = f"frame {count} differs from {src_path}"
            elif abs(t - (seg.from_timestamp + float(sp.time - first))) > TIME_TOLERANCE:
                bad = (f"frame {count} at {t:.6f} s, expected "
                       f"{seg.from_timestamp + float(sp.time - first):.6f} s")
            elif not seg.from_timestamp - TIME_TOLERANCE <= t < seg.to_timestamp:
                bad = f"frame {count} at {t:.6f} s outside [{seg.from_timestamp}, " \
                      f"{seg.to_timestamp})"
            if bad:
                break
            count += 1
        if bad is None and count != ep.length:
            bad = f"{count} frames, the episode has {ep.length}"
        if bad:
            problems.append(f"{path}: episode {ep.index}: {bad}")
            return checked, problems  # later episodes are misaligned; one report is enough
        checked += 1
    extra = sum(1 for _ in packets)
    if extra:
        problems.append(f"{path}: {extra} frames after the last episode")
    return checked, problems


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

