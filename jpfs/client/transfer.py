"""``jpfs import`` and ``jpfs export``: copy whole trees between the local filesystem and JPFS.

Import walks the source top-down and, per directory, sends its small files in name order as
batches: one storage request per batch (so the files land back to back in a volume, neighbours
on disk as they are in the directory) and one ``bulk_create`` metadata transaction per batch.
Large files stream chunk by chunk. Several batches are in flight at once.

Both directions resume: a file whose destination already has the same size and modification time
is skipped (as rsync does by default), so a rerun after an interruption copies only the rest.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from ..errors import JPFSError, error
from ..placement import chunk_nodes
from ..types import Chunk
from .client import AsyncClient, Entry
from .data import new_blob_id

log = logging.getLogger(__name__)

BATCH_BYTES = 32 << 20
BATCH_FILES = 1000
PARALLEL = 4


@dataclass
class TransferStats:
    files: int = 0
    bytes: int = 0
    skipped: int = 0
    skipped_bytes: int = 0
    dirs: int = 0
    symlinks: int = 0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"files": self.files, "bytes": self.bytes, "skipped": self.skipped,
                "skipped_bytes": self.skipped_bytes, "dirs": self.dirs,
                "symlinks": self.symlinks, "errors": self.errors[:100]}


Progress = Callable[[int, int], None]
"""Called with (files, bytes) as they are done (or skipped)."""


def scan_local(src: str | os.PathLike) -> tuple[int, int]:
    """(files, bytes) under a local tree: the totals for a progress bar."""
    files = size = 0
    for _root, _dirs, names in os.walk(src):
        for n in names:
            try:
                st = os.lstat(os.path.join(_root, n))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                files += 1
                size += st.st_size
    return files, size


def _same(attr, st: os.stat_result) -> bool:
    return attr.is_reg and attr.size == st.st_size and attr.mtime_ns == st.st_mtime_ns


def _read_files(paths: list[str]) -> list[bytes]:
    out = []
    for p in paths:
        with open(p, "rb") as f:
            out.append(f.read())
    return out


async def import_tree(client: AsyncClient, src: str | os.PathLike, dst: str, *,
                      parallel: int = PARALLEL, batch_bytes: int = BATCH_BYTES,
                      batch_files: int = BATCH_FILES, progress: Progress | None = None
                      ) -> TransferStats:
    """Make JPFS directory ``dst`` hold a copy of the local tree ``src`` (its entries)."""
    data = client._data()
    src = Path(src)
    if not src.is_dir():
        raise error(errno.ENOTDIR, "import copies a directory tree", str(src))
    stats = TransferStats()
    tick = progress or (lambda files, nbytes: None)
    await client.makedirs(dst, exist_ok=True)
    slots = trio.Semaphore(parallel)

    async def send_batch(parent: int, items: list[tuple[str, os.stat_result, str]],
                         run: int) -> None:
        contents = await trio.to_thread.run_sync(_read_files, [p for _, _, p in items])
        # one batch = one run of neighbours packed on one node; the runs spread over the nodes
        nodes = chunk_nodes(0, parent, 0, 1, data.cluster.n_nodes, data.cluster.replicas,
                            group=run)
        blobs = [(new_blob_id(), nodes, c) for c in contents if len(c)]
        stored = iter(await data.storage.put(blobs)) if blobs else iter(())
        ids = iter(b for b, _, _ in blobs)
        entries = []
        for (name, st, _), content in zip(items, contents, strict=True):
            chunks = []
            if content:
                used, xxh = next(stored)
                chunks = [Chunk(0, next(ids), used, len(content), len(content),
                                xxh).to_wire()]
            entries.append([os.fsencode(name), st.st_mode & 0o7777, st.st_uid, st.st_gid,
                            len(content), st.st_mtime_ns, chunks])
        results = await data.meta.bulk_create(parent, entries, replace=True)
        for (_, _, path), res, content in zip(items, results, contents, strict=True):
            if isinstance(res, OSError):
                stats.errors.append(f"{path}: {res.strerror}")
            else:
                stats.files += 1
                stats.bytes += len(content)
        tick(len(items), sum(len(c) for c in contents))

    async def send_large(dpath: str, name: str, st: os.stat_result, path: str) -> None:
        try:
            await client.put(path, f"{dpath.rstrip('/')}/{name}")
            stats.files += 1
            stats.bytes += st.st_size
        except (JPFSError, OSError) as e:
            stats.errors.append(f"{path}: {e.strerror or e}")
        tick(1, st.st_size)

    async with trio.open_nursery() as nursery:
        for root, dirs, names in os.walk(src):
            dirs.sort()
            rel = os.path.relpath(root, src)
            dpath = dst if rel == "." else f"{dst.rstrip('/')}/{rel}"
            if rel != ".":
                await client.makedirs(dpath, exist_ok=True)
                stats.dirs += 1
            existing = {e.name: e.attr for e in await client.scandir(dpath)}
            parent = (await client.stat(dpath)).ino
            batch: list[tuple[str, os.stat_result, str]] = []
            size = run = 0
            # os.walk lists symlinks to directories with the directories (and does not enter)
            links = [n for n in dirs if os.path.islink(os.path.join(root, n))]
            for name in sorted(names + links):
                path = os.path.join(root, name)
                try:
                    st = os.lstat(path)
                except OSError as e:
                    stats.errors.append(f"{path}: {e.strerror}")
                    continue
                old = existing.get(name)
                if stat.S_ISLNK(st.st_mode):
                    target = os.readlink(path)
                    if old is None:
                        await client.symlink(target, f"{dpath.rstrip('/')}/{name}")
                        stats.symlinks += 1
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                if old is not None and _same(old, st):
                    stats.skipped += 1
                    stats.skipped_bytes += st.st_size
                    tick(1, st.st_size)
                    continue
                if st.st_size > data.chunk_size:
                    await _start(nursery, slots, send_large, dpath, name, st, path)
                    continue
                batch.append((name, st, path))
                size += st.st_size
                if len(batch) >= batch_files or size >= batch_bytes:
                    await _start(nursery, slots, send_batch, parent, batch, run)
                    batch, size, run = [], 0, run + 1
            if batch:
                await _start(nursery, slots, send_batch, parent, batch, run)
    return stats


async def _start(nursery: trio.Nursery, slots: trio.Semaphore, fn, *args) -> None:
    """Start ``fn`` once one of the ``parallel`` slots is free (the walk waits meanwhile, so
    work read ahead stays bounded); the slot is freed when ``fn`` ends."""
    await slots.acquire()

    async def run() -> None:
        try:
            await fn(*args)
        finally:
            slots.release()

    nursery.start_soon(run)


async def export_tree(client: AsyncClient, src: str, dst: str | os.PathLike, *,
                      parallel: int = PARALLEL, batch_bytes: int = BATCH_BYTES,
                      batch_files: int = BATCH_FILES, progress: Progress | None = None
                      ) -> TransferStats:
    """Make local directory ``dst`` hold a copy of the JPFS tree ``src`` (its entries)."""
    client._data()
    dst = Path(dst)
    stats = TransferStats()
    tick = progress or (lambda files, nbytes: None)
    if not (await client.stat(src)).is_dir:
        raise error(errno.ENOTDIR, "export copies a directory tree", src)
    slots = trio.Semaphore(parallel)

    async def fetch_batch(ldir: Path, entries: list[Entry]) -> None:
        views = await client.read_many([e.path for e in entries])
        await trio.to_thread.run_sync(_write_files, ldir, entries, views)
        stats.files += len(entries)
        n = sum(len(v) for v in views)
        stats.bytes += n
        tick(len(entries), n)

    async def fetch_large(ldir: Path, e: Entry) -> None:
        await client.get(e.path, ldir / e.name)
        stats.files += 1
        stats.bytes += e.attr.size
        tick(1, e.attr.size)

    chunk_size = client.cluster.chunk_size
    async with trio.open_nursery() as nursery:
        async for dpath, _dirs, _files in client.walk(src):
            rel = os.path.relpath(dpath, src)
            ldir = dst if rel == "." else dst / rel
            ldir.mkdir(parents=True, exist_ok=True)
            stats.dirs += rel != "."
            batch: list[Entry] = []
            size = 0
            for e in await client.scandir(dpath):
                target = ldir / e.name
                if e.attr.is_link:
                    if not target.is_symlink():
                        os.symlink(await client.readlink(e.path), target)
                        stats.symlinks += 1
                    continue
                if not e.attr.is_reg:
                    continue
                try:
                    st = os.lstat(target)
                    if st.st_size == e.attr.size and st.st_mtime_ns == e.attr.mtime_ns:
                        stats.skipped += 1
                        stats.skipped_bytes += st.st_size
                        tick(1, st.st_size)
                        continue
                except FileNotFoundError:
                    pass
                if e.attr.size > chunk_size:
                    await _start(nursery, slots, fetch_large, ldir, e)
                    continue
                batch.append(e)
                size += e.attr.size
                if len(batch) >= batch_files or size >= batch_bytes:
                    await _start(nursery, slots, fetch_batch, ldir, batch)
                    batch, size = [], 0
            if batch:
                await _start(nursery, slots, fetch_batch, ldir, batch)
    return stats


def _write_files(ldir: Path, entries: list[Entry], views: list[memoryview]) -> None:
    for e, v in zip(entries, views, strict=True):
        target = ldir / e.name
        tmp = ldir / f".{e.name}.jpfs-part"
        with open(tmp, "wb") as f:
            f.write(v)
        os.chmod(tmp, e.attr.mode & 0o7777)
        os.utime(tmp, ns=(e.attr.atime_ns, e.attr.mtime_ns))
        os.replace(tmp, target)
