"""LeRobot v2.1 -> v3.0 conversion: parallel, resumable, and never half-valid.

The official algorithm (docs/lerobot.md): episode parquets are concatenated in episode order
into data files up to a size limit, each camera's episode mp4s are joined by stream copy into
video files up to another, and the metadata is rewritten. Here each output file is one
independent task run on a pool of workers. Crash safety:

- the plan (which episodes go into which file) is a pure function of SRC and the limits, and is
  stored in ``DST/.jpfs-convert/plan.json``; a rerun recomputes it;
- every output is written under ``DST/.jpfs-convert/tmp/`` (fsynced), renamed into place when
  complete, and then recorded by a marker in ``DST/.jpfs-convert/done/``, the progress journal.
  A marker names its task's digest (inputs, their sizes, limits), so a rerun redoes exactly the
  files whose task changed (other limits, a repaired source file) and keeps the rest;
- ``meta/info.json`` is written last, then the journal is removed: a DST without info.json, or
  with a journal, is an unfinished conversion, which a rerun with the same arguments completes.

SRC is only read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from . import layout, stats, video
from .dataset import DatasetMeta, load_meta
from .fsutil import (
    DatasetError,
    fsync_file,
    get_fs,
    is_local,
    join,
    local_output,
    read_json,
    read_jsonl,
    read_parquet_metadata,
    read_table,
    replace,
    write_json,
    write_parquet_table,
)
from .workers import default_workers, worker_pool

log = logging.getLogger(__name__)

__all__ = ["convert", "plan_conversion", "ConvertPlan", "Task", "JOURNAL_DIR", "VerifyError"]

JOURNAL_DIR = ".jpfs-convert"
# Data files are written in row groups of whole episodes: by default one episode per row group,
# so a loader reading episodes in shuffled order fetches only that episode's bytes (with one big
# row group per file, as pandas writes them, each episode read decodes the whole group: measured
# 13x slower than v2.1 on 200-row episodes). A positive row_group_rows packs episodes until a
# group holds at least that many rows (faster full scans, slower single-episode reads).
DEFAULT_ROW_GROUP_ROWS = 0
# Below this much source data a process pool costs more to start than it saves.
INLINE_BELOW_BYTES = 64 * 1024 * 1024
MB = 1024 * 1024


class VerifyError(DatasetError):
    """The conversion was written but does not check out against SRC (``report`` says how)."""

    def __init__(self, path: str, message: str, report: dict[str, Any] | None = None):
        super().__init__(path, message)
        self.report = report or {}

    def __reduce__(self):
        return (type(self), (self.path, self.message, self.report))


@dataclass(frozen=True)
class Task:
    """One output file: the episodes (positions in the episode list) it concatenates."""

    key: str
    kind: str  # "data" | "video"
    video_key: str | None
    chunk: int
    file: int
    output: str  # relative to DST
    inputs: tuple[str, ...]  # relative to SRC
    episodes: tuple[int, ...]
    lengths: tuple[int, ...]
    input_sizes: tuple[int, ...]  # bytes of each input: a changed source file redoes the task
    row_group_rows: int = DEFAULT_ROW_GROUP_ROWS

    def digest(self) -> str:
        """Identity of the task's output: what a done marker must match to be trusted."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class ConvertPlan:
    """Everything the conversion will write, decided before anything is written."""

    src: str
    data_file_mb: float
    video_file_mb: float
    chunks_size: int
    tasks: tuple[Task, ...]
    source_files: int
    source_bytes: int
    row_group_rows: int = DEFAULT_ROW_GROUP_ROWS

    def digest(self) -> str:
        """Identity of the whole plan (recorded; a changed plan keeps its still-valid files)."""
        body = json.dumps([self.data_file_mb, self.video_file_mb, self.chunks_size,
                           self.row_group_rows, [t.digest() for t in self.tasks]])
        return hashlib.sha256(body.encode()).hexdigest()


def group_by_size(sizes: list[int], limit: int, chunks_size: int
                  ) -> list[tuple[int, int, list[int]]]:
    """(chunk, file, positions) groups: a new file starts when current + next >= limit."""
    groups: list[tuple[int, int, list[int]]] = []
    chunk = file = 0
    acc = 0
    cur: list[int] = []
    for i, size in enumerate(sizes):
        if cur and acc + size >= limit:
            groups.append((chunk, file, cur))
            chunk, file = layout.next_chunk_file(chunk, file, chunks_size)
            acc, cur = 0, []
        cur.append(i)
        acc += size
    if cur:
        groups.append((chunk, file, cur))
    return groups


def uncompressed_size(md: pq.FileMetaData) -> int:
    """A parquet file's uncompressed column-chunk bytes (LeRobot's data size measure)."""
    total = 0
    for rg in range(md.num_row_groups):
        g = md.row_group(rg)
        total += sum(g.column(c).total_uncompressed_size for c in range(g.num_columns))
    return total


def _schema_problem(schema: pa.Schema, want: pa.Schema) -> str | None:
    """Why ``schema`` cannot be concatenated with ``want`` (None when it can)."""
    names, want_names = schema.names, want.names
    if names != want_names:
        missing = [n for n in want_names if n not in names]
        extra = [n for n in names if n not in want_names]
        if missing or extra:
            return f"columns differ (missing {missing}, unexpected {extra})"
        return f"column order {names} differs from {want_names}"
    for f, w in zip(schema, want, strict=True):
        if f.type != w.type:
            return f"column {f.name!r} is {f.type}, expected {w.type}"
    return None


def plan_conversion(src: str, data_file_mb: float = layout.DEFAULT_DATA_FILE_MB,
                    video_file_mb: float = layout.DEFAULT_VIDEO_FILE_MB,
                    chunks_size: int = layout.CHUNKS_SIZE, meta: DatasetMeta | None = None,
                    progress: bool = True, threads: int = 4,
                    row_group_rows: int = DEFAULT_ROW_GROUP_ROWS) -> ConvertPlan:
    """Decide every output file from SRC's sizes; checks each episode parquet's schema.

    Raises:
        DatasetError: naming a missing file, a parquet with another schema or row count.
    """
    meta = meta or load_meta(src)
    if meta.version != layout.V21:
        raise DatasetError(src, f"is already {meta.version}; only v2.1 datasets are converted")
    if chunks_size < 1:
        raise ValueError("chunks_size must be at least 1")
    sfs, sbase = get_fs(src)
    episodes = meta.episodes
    want_cols = layout.frame_columns(meta.features)

    def footer(i: int) -> pq.FileMetaData:
        path = join(sbase, episodes[i].data_file)
        try:
            return read_parquet_metadata(sfs, path)
        except FileNotFoundError:
            raise DatasetError(path, "missing") from None
        except (OSError, ValueError) as e:
            raise DatasetError(path, f"not a readable parquet file ({e})") from None

    with ThreadPoolExecutor(max(1, threads)) as pool:
        footers = list(tqdm(pool.map(footer, range(len(episodes))), total=len(episodes),
                            desc="plan: read parquet footers", unit="ep", disable=not progress,
                            leave=False))
    first_schema: pa.Schema | None = None
    for ep, md in zip(episodes, footers, strict=True):
        path = join(sbase, ep.data_file)
        schema = md.schema.to_arrow_schema()
        if first_schema is None:
            if schema.names != want_cols:
                problem = _schema_problem(schema, pa.schema(
                    [pa.field(n, schema.field(n).type) if n in schema.names
                     else pa.field(n, pa.null()) for n in want_cols]))
                raise DatasetError(path, f"schema does not match info.json features: {problem}")
            first_schema = schema
        elif problem := _schema_problem(schema, first_schema):
            raise DatasetError(path, f"schema differs from the first episode's: {problem}")
        if md.num_rows != ep.length:
            raise DatasetError(path, f"has {md.num_rows} rows, episodes.jsonl says {ep.length}")
    sizes = [uncompressed_size(md) for md in footers]
    file_sizes = _sizes(sfs, sbase, [ep.data_file for ep in episodes])
    tasks: list[Task] = []
    for chunk, file, pos in group_by_size(sizes, int(data_file_mb * MB), chunks_size):
        tasks.append(Task(
            key=f"data-c{chunk:03d}-f{file:03d}", kind="data", video_key=None, chunk=chunk,
            file=file, output=layout.v30_data_path(chunk, file),
            inputs=tuple(episodes[i].data_file for i in pos), episodes=tuple(pos),
            lengths=tuple(episodes[i].length for i in pos),
            input_sizes=tuple(file_sizes[i] for i in pos), row_group_rows=row_group_rows))
    source_bytes = sum(file_sizes)
    source_files = len(episodes)
    for key in meta.video_keys:
        vsizes = _sizes(sfs, sbase, [ep.videos[key].path for ep in episodes])
        source_bytes += sum(vsizes)
        source_files += len(vsizes)
        for chunk, file, pos in group_by_size(vsizes, int(video_file_mb * MB), chunks_size):
            tasks.append(Task(
                key=f"video-{key}-c{chunk:03d}-f{file:03d}", kind="video", video_key=key,
                chunk=chunk, file=file, output=layout.v30_video_path(key, chunk, file),
                inputs=tuple(episodes[i].videos[key].path for i in pos), episodes=tuple(pos),
                lengths=tuple(episodes[i].length for i in pos),
                input_sizes=tuple(vsizes[i] for i in pos)))
    return ConvertPlan(src, data_file_mb, video_file_mb, chunks_size, tuple(tasks),
                       source_files, source_bytes, row_group_rows)


def _sizes(fs: Any, base: str, rels: list[str]) -> list[int]:
    """Sizes of many files, one directory listing per folder instead of a stat per file."""
    by_dir: dict[str, dict[str, int]] = {}
    out = []
    for rel in rels:
        path = join(base, rel)
        folder = posixpath.dirname(path)
        if folder not in by_dir:
            try:
                listing = fs.ls(folder, detail=True)
            except FileNotFoundError:
                listing = []
            by_dir[folder] = {fs._strip_protocol(e["name"]): e["size"] for e in listing}
        size = by_dir[folder].get(fs._strip_protocol(path))
        if size is None:
            raise DatasetError(path, "missing")
        out.append(int(size))
    return out


# ----------------------------------------------------------------------------------------------
# Tasks (run in worker processes or threads: module-level, plain arguments)


def run_task(src: str, dst: str, task: Task) -> dict[str, Any]:
    """Write one output file under a temporary name, then rename it into place."""
    sfs, sbase = get_fs(src)
    dfs, dbase = get_fs(dst)
    ext = posixpath.splitext(task.output)[1]
    tmp = join(dbase, f"{JOURNAL_DIR}/tmp/{task.key}{ext}")
    final = join(dbase, task.output)
    inputs = [join(sbase, rel) for rel in task.inputs]
    result: dict[str, Any] = {}
    with local_output(dfs, tmp) as local:
        if task.kind == "data":
            _concat_parquet(sfs, inputs, list(task.lengths), local, task.row_group_rows)
        else:
            segs = video.concat(sfs, inputs, local, list(task.lengths))
            result["segments"] = [[s.frames, s.duration.numerator, s.duration.denominator,
                                   s.start.numerator, s.start.denominator] for s in segs]
        if is_local(dfs):
            fsync_file(local)
    result["size"] = dfs.size(tmp)
    replace(dfs, tmp, final)
    return result


def _concat_parquet(fs: Any, inputs: list[str], lengths: list[int], output: str,
                    row_group_rows: int) -> None:
    writer: pq.ParquetWriter | None = None
    schema: pa.Schema | None = None
    pending: list[pa.Table] = []
    rows = 0
    try:
        for path, want in zip(inputs, lengths, strict=True):
            try:
                table = read_table(fs, path)
            except FileNotFoundError:
                raise DatasetError(path, "missing") from None
            except (OSError, ValueError) as e:
                raise DatasetError(path, f"not a readable parquet file ({e})") from None
            if schema is None or writer is None:  # the first input: both are set here
                schema = table.schema
                writer = pq.ParquetWriter(output, schema)
            elif problem := _schema_problem(table.schema, schema):
                raise DatasetError(path, f"schema differs from the first episode's: {problem}")
            if table.num_rows != want:
                raise DatasetError(path, f"has {table.num_rows} rows, the episode has {want}")
            pending.append(table.replace_schema_metadata(schema.metadata))
            rows += table.num_rows
            if rows >= row_group_rows:
                writer.write_table(pa.concat_tables(pending), row_group_size=rows)
                pending, rows = [], 0
        if pending and writer is not None:
            writer.write_table(pa.concat_tables(pending), row_group_size=rows)
    finally:
        if writer is not None:
            writer.close()


# ----------------------------------------------------------------------------------------------
# The journal


class Journal:
    """``DST/.jpfs-convert``: the plan, one marker per finished output, and temporary files.

    A marker holds the digest of its task (inputs, their sizes, episodes, limits): it is trusted
    only while the task is unchanged and its output file still has the recorded size.
    """

    def __init__(self, dst: str):
        self.fs, self.base = get_fs(dst)
        self.dir = join(self.base, JOURNAL_DIR)

    def exists(self) -> bool:
        return self.fs.exists(join(self.dir, "plan.json"))

    def start(self, plan: ConvertPlan) -> None:
        """Record the plan, drop outputs an earlier different plan left, clear temporaries."""
        path = join(self.dir, "plan.json")
        digest = plan.digest()
        if self.fs.exists(path):
            try:
                old = read_json(self.fs, path)
            except DatasetError:
                old = {}
            if old.get("digest") != digest:
                log.warning("%s: the unfinished conversion had another plan (source files or "
                            "limits changed); keeping only the files that are still valid",
                            self.base)
                keep = {t.output for t in plan.tasks}
                for rel in old.get("outputs", []):
                    if rel not in keep and self.fs.exists(join(self.base, rel)):
                        self.fs.rm(join(self.base, rel))
        tmp = join(self.dir, "tmp")
        if self.fs.exists(tmp):
            self.fs.rm(tmp, recursive=True)
        self.fs.makedirs(tmp, exist_ok=True)
        self.fs.makedirs(join(self.dir, "done"), exist_ok=True)
        write_json(self.fs, path, {"digest": digest, "src": plan.src,
                                   "data_file_mb": plan.data_file_mb,
                                   "video_file_mb": plan.video_file_mb,
                                   "chunks_size": plan.chunks_size,
                                   "outputs": [t.output for t in plan.tasks]})

    def done(self, task: Task) -> dict[str, Any] | None:
        """The recorded result of a finished task whose output is still there, else None."""
        marker = join(self.dir, f"done/{task.key}.json")
        try:
            rec = read_json(self.fs, marker)
        except DatasetError:
            return None
        out = join(self.base, task.output)
        if not isinstance(rec, dict) or rec.get("task") != task.digest():
            return None
        if not self.fs.exists(out) or self.fs.size(out) != rec["result"]["size"]:
            return None
        return rec["result"]

    def record(self, task: Task, result: dict[str, Any]) -> None:
        """Mark ``task`` done: written aside and renamed, so a marker is never half there."""
        tmp = join(self.dir, f"tmp/done-{task.key}.json")
        write_json(self.fs, tmp, {"task": task.digest(), "output": task.output,
                                  "result": result}, indent=None)
        self.fs.mv(tmp, join(self.dir, f"done/{task.key}.json"))

    def remove(self) -> None:
        self.fs.rm(self.dir, recursive=True)


# ----------------------------------------------------------------------------------------------
# The conversion


def convert(src: str, dst: str, data_file_mb: float = layout.DEFAULT_DATA_FILE_MB,
            video_file_mb: float = layout.DEFAULT_VIDEO_FILE_MB, workers: int | None = None,
            chunks_size: int = layout.CHUNKS_SIZE, executor: str = "thread",
            row_group_rows: int = DEFAULT_ROW_GROUP_ROWS,
            progress: bool = True,
            on_task_done: Callable[[Task], None] | None = None,
            verify: str = "sample") -> dict[str, Any]:
    """Convert the v2.1 dataset at ``src`` into a v3.0 dataset at ``dst``; resumes if unfinished.

    Args:
        src, dst: local paths or fsspec URLs (``jpfs://...``); ``src`` is never modified.
        data_file_mb, video_file_mb: size limits of the output files (LeRobot: 100 and 200).
        workers: parallel output files (default: one per core, at most 8; with processes,
            inline below 64 MiB of source); 1 runs everything inline.
        row_group_rows: 0 for one parquet row group per episode (default), else pack whole
            episodes until a row group holds at least this many rows.
        chunks_size: files per chunk folder (LeRobot: 1000; small values force chunk rollovers).
        executor: "thread" (default, measured faster) or "process" workers.
        on_task_done: called after each output file is journaled (tests, progress hooks).
        verify: check what was written against SRC (:func:`jpfs.lerobot.verify.verify`):
            "sample" (default) decodes each episode's first, middle and last frames, "full"
            every frame, "off" skips it. Every frame's time and count is checked unless "off".

    Returns:
        Figures: episodes, frames, files and bytes in and out, tasks run and resumed, seconds
        (the verification's report under "verify", its time under "verify_seconds").

    Raises:
        VerifyError: DST was written but decodes to other frames or rows than SRC.
    """
    if verify not in ("sample", "full", "off"):
        raise ValueError(f"verify must be sample, full or off, not {verify!r}")
    t0 = time.perf_counter()
    workers = None if workers is None else max(1, workers)
    sfs, sbase = get_fs(src)
    dfs, dbase = get_fs(dst)
    if _same_place(sfs, sbase, dfs, dbase):
        raise ValueError(f"{dst}: the destination must differ from the source")
    meta = load_meta(src)
    journal = Journal(dst)
    resuming = journal.exists()
    if not resuming and dfs.exists(dbase) and dfs.ls(dbase):
        if dfs.exists(join(dbase, layout.INFO_PATH)):
            info = read_json(dfs, join(dbase, layout.INFO_PATH))
            if info.get("codebase_version") == layout.V30:
                log.info("%s already holds a finished v3.0 dataset", dst)
                return {"src": src, "dst": dst, "already_done": True,
                        "episodes": info.get("total_episodes"),
                        "frames": info.get("total_frames"), "seconds": 0.0}
        raise DatasetError(dbase, "is not empty and holds no unfinished conversion; "
                                  "choose an empty or new destination")
    plan = plan_conversion(src, data_file_mb, video_file_mb, chunks_size, meta=meta,
                           progress=progress, threads=workers or 4,
                           row_group_rows=row_group_rows)
    if workers is None:
        small = executor == "process" and plan.source_bytes < INLINE_BELOW_BYTES
        workers = 1 if small else default_workers()
    # Stats are checked before any output exists, so a bad file fails fast.
    ep_stats = _load_episode_stats(sfs, sbase, meta)
    journal.start(plan)
    results: dict[str, dict[str, Any]] = {}
    todo = []
    for task in plan.tasks:
        rec = journal.done(task)
        if rec is None:
            todo.append(task)
        else:
            results[task.key] = rec
    log.info("convert %s -> %s: %d output files, %d already done, %d workers (%s)", src, dst,
             len(plan.tasks), len(results), workers, executor)
    bar = tqdm(total=len(plan.tasks), initial=len(results), desc="convert", unit="file",
               disable=not progress)
    try:
        with worker_pool(min(workers, max(1, len(todo))), executor) as pool:
            if pool is None:
                for task in todo:
                    results[task.key] = _finish(journal, task, run_task(src, dst, task),
                                                bar, on_task_done)
            else:
                futures: dict[Future, Task] = {pool.submit(run_task, src, dst, t): t
                                               for t in todo}
                try:
                    for fut in as_completed(futures):
                        task = futures[fut]
                        results[task.key] = _finish(journal, task, fut.result(), bar,
                                                    on_task_done)
                except BaseException:
                    for f in futures:
                        f.cancel()
                    raise
    finally:
        bar.close()
    _write_meta(dfs, dbase, meta, plan, results, ep_stats)
    info = layout.info_v30_from_v21(meta.info, data_file_mb, video_file_mb, chunks_size)
    info_tmp = join(dbase, f"{JOURNAL_DIR}/tmp/info.json")
    write_json(dfs, info_tmp, info)
    replace(dfs, info_tmp, join(dbase, layout.INFO_PATH))
    journal.remove()
    seconds = time.perf_counter() - t0
    report = None
    if verify != "off":
        from .verify import verify as check

        report = check(src, dst, workers=workers, executor=executor, progress=progress,
                       frames=verify)
        if not report["ok"]:
            raise VerifyError(dst, f"the conversion does not match SRC ({report['problem_count']} "
                              f"problems; the first: {report['problems'][0]})", report)
    out_bytes = sum(r["size"] for r in results.values())
    data_files = sum(1 for t in plan.tasks if t.kind == "data")
    figures = {
        "src": src, "dst": dst, "episodes": len(meta.episodes), "frames": meta.total_frames,
        "cameras": len(meta.video_keys), "source_files": plan.source_files,
        "source_bytes": plan.source_bytes, "data_files": data_files,
        "video_files": len(plan.tasks) - data_files, "output_bytes": out_bytes,
        "tasks_run": len(todo), "tasks_resumed": len(plan.tasks) - len(todo),
        "resumed": resuming, "workers": workers, "executor": executor, "seconds": seconds,
    }
    if report is not None:
        figures["verify"] = report
        figures["verify_seconds"] = time.perf_counter() - t0 - seconds
    log.info("converted %d episodes in %.2f s", len(meta.episodes), seconds)
    return figures


def _finish(journal: Journal, task: Task, result: dict[str, Any], bar: tqdm,
            hook: Callable[[Task], None] | None) -> dict[str, Any]:
    journal.record(task, result)
    bar.update(1)
    if hook:
        hook(task)
    return result


def _same_place(sfs: Any, sbase: str, dfs: Any, dbase: str) -> bool:
    if type(sfs) is not type(dfs):
        return False
    a, b = sbase.rstrip("/") + "/", dbase.rstrip("/") + "/"
    return a.startswith(b) or b.startswith(a)


def _load_episode_stats(fs: Any, base: str, meta: DatasetMeta) -> dict[int, stats.Stats]:
    path = join(base, layout.V21_EPISODES_STATS_PATH)
    out: dict[int, stats.Stats] = {}
    for row in read_jsonl(fs, path):
        try:
            out[int(row["episode_index"])] = stats.from_json(row["stats"])
        except (KeyError, TypeError, ValueError):
            raise DatasetError(path, f"bad line for episode {row.get('episode_index')!r}"
                               ) from None
    missing = [ep.index for ep in meta.episodes if ep.index not in out]
    if missing:
        raise DatasetError(path, f"has no stats for episodes {missing[:10]}")
    return out


def _write_meta(fs: Any, base: str, meta: DatasetMeta, plan: ConvertPlan,
                results: dict[str, dict[str, Any]], ep_stats: dict[int, stats.Stats]) -> None:
    """meta/tasks.parquet, meta/episodes/chunk-000/file-000.parquet and meta/stats.json."""
    n = len(meta.episodes)
    rows: list[dict[str, Any]] = [{} for _ in range(n)]
    start = 0
    for i, ep in enumerate(meta.episodes):
        rows[i] = {"episode_index": ep.index, "data/chunk_index": None, "data/file_index": None,
                   "dataset_from_index": start, "dataset_to_index": start + ep.length}
        start += ep.length
    video_cols: list[dict[str, Any]] = [{} for _ in range(n)]
    for task in plan.tasks:
        if task.kind == "data":
            for pos in task.episodes:
                rows[pos]["data/chunk_index"] = task.chunk
                rows[pos]["data/file_index"] = task.file
            continue
        segs = results[task.key]["segments"]
        k = task.video_key
        assert k is not None, task  # every video task names its camera (plan)
        for pos, (_, dn, dd, sn, sd) in zip(task.episodes, segs, strict=True):
            begin = Fraction(sn, sd)
            video_cols[pos][k] = {
                f"videos/{k}/chunk_index": task.chunk,
                f"videos/{k}/file_index": task.file,
                f"videos/{k}/from_timestamp": float(begin),
                f"videos/{k}/to_timestamp": float(begin + Fraction(dn, dd)),
            }
    for i, ep in enumerate(meta.episodes):
        for k in sorted(meta.video_keys):  # the official converter orders cameras by name
            rows[i].update(video_cols[i][k])
        rows[i]["tasks"] = list(ep.tasks)
        rows[i]["length"] = ep.length
        rows[i].update(stats.flatten(ep_stats[ep.index]))
        rows[i]["meta/episodes/chunk_index"] = 0
        rows[i]["meta/episodes/file_index"] = 0
    table = pa.Table.from_pylist(rows)
    write_parquet(fs, join(base, layout.V30_EPISODES_PATH.format(chunk_index=0, file_index=0)),
                  table)
    write_parquet(fs, join(base, layout.V30_TASKS_PATH), tasks_table(meta.tasks))
    agg = stats.aggregate([ep_stats[ep.index] for ep in meta.episodes])
    write_json(fs, join(base, layout.V30_STATS_PATH), stats.to_json(agg))


def write_parquet(fs: Any, path: str, table: pa.Table) -> None:
    """A whole parquet file through fsspec."""
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    write_parquet_table(fs, path, table)


def tasks_table(tasks: dict[int, str]) -> pa.Table:
    """meta/tasks.parquet: column ``task_index`` with the task text as the pandas index "task".

    The pandas metadata is written by hand so that ``pd.read_parquet`` gives LeRobot's frame
    (index named "task") without pandas being needed here.
    """
    order = sorted(tasks)
    table = pa.table({"task_index": pa.array(order, pa.int64()),
                      "task": pa.array([tasks[i] for i in order], pa.string())})
    pandas_meta = {
        "index_columns": ["task"],
        "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode",
                            "numpy_type": "object", "metadata": {"encoding": "UTF-8"}}],
        "columns": [
            {"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
             "numpy_type": "int64", "metadata": None},
            {"name": "task", "field_name": "task", "pandas_type": "unicode",
             "numpy_type": "object", "metadata": None},
        ],
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.0.0",
    }
    return table.replace_schema_metadata({b"pandas": json.dumps(pandas_meta).encode()})

