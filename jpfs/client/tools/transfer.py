"""``jpfs import`` and ``jpfs export``: copy whole trees between the local filesystem and JPFS.

Import also reads from any fsspec URL whose package is installed (s3://, gs://, hf://,
https://): the tree is listed once, and each batch of small files is fetched with one ``cat``
(concurrent requests on async stores). Files keep the store's modification time where it has one,
so resume works the same; where it has none, a file of the same size counts as copied.

Import walks the source top-down and, per directory, sends its small files in name order as
batches: one storage request per batch (so the files land back to back in a volume, neighbours
on disk as they are in the directory) and one ``bulk_create`` metadata transaction per batch.
Large files stream chunk by chunk. Several batches are in flight at once.

Both directions resume: a file whose destination already has the same size and modification time
is skipped (as rsync does by default), so a rerun after an interruption copies only the rest.

A file or directory that cannot be copied (a daemon down, a source unreadable) is recorded in
``TransferStats.errors`` with its path and the reason, and the rest is copied; a rerun once the
cause is fixed copies what failed and skips the rest.
"""

from __future__ import annotations

import datetime as dt
import errno
import logging
import os
import posixpath
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from ... import uri
from ...errors import JPFSError, error
from ...types import Chunk
from ..client import AsyncClient, Entry
from ..data.store import new_blob_id
from ..paths import jpfs_path

log = logging.getLogger(__name__)

BATCH_BYTES = 32 << 20
BATCH_FILES = 1000
PARALLEL = 4


@dataclass
class TransferStats:
    """What an import or export copied, skipped and failed on."""

    files: int = 0
    bytes: int = 0
    skipped: int = 0
    skipped_bytes: int = 0
    dirs: int = 0
    symlinks: int = 0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        """The counts, and the first 100 errors, as one JSON-able object."""
        return {"files": self.files, "bytes": self.bytes, "skipped": self.skipped,
                "skipped_bytes": self.skipped_bytes, "dirs": self.dirs,
                "symlinks": self.symlinks, "errors": self.errors[:100]}


Progress = Callable[[int, int], None]
"""Called with (files, bytes) as they are done (or skipped)."""


def scan_local(src: str | os.PathLike) -> tuple[int, int]:
    """(files, bytes) under a local tree: the totals for a progress bar."""
    files = size = 0
    for _root, _dirs, names in os.walk(os.fspath(src)):
        for n in names:
            try:
                st = os.lstat(os.path.join(_root, n))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                files += 1
                size += st.st_size
    return files, size


@dataclass(frozen=True)
class SourceFile:
    """A regular file to import: where to read it and what its copy records."""

    name: str
    path: str  # on the source: a local path, or a path on the fsspec filesystem
    size: int
    mtime_ns: int | None  # None where the store keeps no time: resume compares sizes only
    mode: int = 0o644
    uid: int = 0
    gid: int = 0


@dataclass
class SourceDir:
    """One directory of the source, top-down: its files and symlinks, in name order."""

    rel: str  # "." for the root
    files: list[SourceFile] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (name, target)


class LocalSource:
    """A local directory tree (``os.walk``; symlinks kept as symlinks)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        if not self.root.is_dir():
            raise error(errno.ENOTDIR, "import copies a directory tree", str(self.root))
        self.errors: list[str] = []

    def walk(self):
        """Each directory of the tree, top-down in name order, with its regular files and symlinks;
        what cannot be read is noted in ``errors`` and skipped."""
        for root, dirs, names in os.walk(self.root):
            dirs.sort()
            d = SourceDir(os.path.relpath(root, self.root))
            # os.walk lists symlinks to directories with the directories (and does not enter)
            links = [n for n in dirs if os.path.islink(os.path.join(root, n))]
            for name in sorted(names + links):
                path = os.path.join(root, name)
                try:
                    st = os.lstat(path)
                except OSError as e:
                    self.errors.append(f"{path}: {e.strerror}")
                    continue
                if stat.S_ISLNK(st.st_mode):
                    d.links.append((name, os.readlink(path)))
                elif stat.S_ISREG(st.st_mode):
                    d.files.append(SourceFile(name, path, st.st_size, st.st_mtime_ns,
                                              st.st_mode & 0o7777, st.st_uid, st.st_gid))
            yield d

    def read(self, files: list[SourceFile]) -> list[bytes | OSError]:
        """The bytes of each file, or the OSError reading it failed with, in order."""
        out: list[bytes | OSError] = []
        for f in files:
            try:
                with open(f.path, "rb") as fh:
                    out.append(fh.read())
            except OSError as e:
                out.append(e)
        return out

    def open(self, f: SourceFile):
        """The file opened for reading (binary)."""
        return open(f.path, "rb")


def is_url(src: str | os.PathLike) -> bool:
    """True for an fsspec URL (``s3://b/x``, ``hf://datasets/...``, ``https://...``)."""
    text = os.fspath(src)
    return isinstance(text, str) and "://" in text and not text.startswith("jpfs:")


def open_url(url: str, storage_options: dict | None = None):
    """The fsspec filesystem and root path of ``url``; a missing package is named."""
    import fsspec

    protocol = url.split("://", 1)[0]
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as e:
        raise error(errno.EPROTONOSUPPORT, f"reading {protocol}:// URLs needs a package that "
                    f"is not installed ({e})", url) from None
    except ValueError as e:
        if "Protocol not known" in str(e):
            raise error(errno.EPROTONOSUPPORT, f"fsspec knows no {protocol}:// filesystem",
                        url) from None
        raise


class RemoteSource:
    """A tree on any fsspec filesystem: listed once (``find``), read in batches with ``cat``
    (concurrent requests on async stores such as s3fs, gcsfs, http)."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url
        self.fs, root = open_url(url, storage_options)
        self.root = root.rstrip("/")
        self.errors: list[str] = []
        self.dirs: list[SourceDir] | None = None

    def list_tree(self) -> tuple[int, int]:
        """List the tree (blocking: run it in a thread); returns (files, bytes)."""
        try:
            found = self.fs.find(self.root, withdirs=True, detail=True)
        except FileNotFoundError:
            raise error(errno.ENOENT, "no such directory", self.url) from None
        if not found or (len(found) == 1 and self._rel(next(iter(found))) == "."):
            if not self.fs.exists(self.root):
                raise error(errno.ENOENT, "no such directory (nothing found under it)", self.url)
            if not self.fs.isdir(self.root):
                raise error(errno.ENOTDIR, "a file, not a directory (import copies directory "
                            "trees: give the prefix that holds it)", self.url)
        dirs: dict[str, SourceDir] = {".": SourceDir(".")}
        uid, gid = os.getuid(), os.getgid()
        for path, info in found.items():
            rel = self._rel(path)
            if rel == ".":
                continue
            parent = posixpath.dirname(rel) or "."
            for d in _ancestors(parent):
                dirs.setdefault(d, SourceDir(d))
            if info.get("type") == "directory":
                dirs.setdefault(rel, SourceDir(rel))
                continue
            size = info.get("size")
            if size is None:
                size = self.fs.size(path)
            dirs[parent].files.append(SourceFile(posixpath.basename(rel), path, int(size or 0),
                                                 _mtime_ns(info), 0o644, uid, gid))
        for sd in dirs.values():
            sd.files.sort(key=lambda f: f.name)
        self.dirs = [dirs[k] for k in sorted(dirs, key=_top_down)]
        return (sum(len(d.files) for d in self.dirs),
                sum(f.size for d in self.dirs for f in d.files))

    def _rel(self, path: str) -> str:
        p = self.fs._strip_protocol(path).rstrip("/")
        return posixpath.relpath(p, self.root) if p != self.root else "."

    def walk(self):
        """Each directory under the prefix, top-down (the tree is listed on first use)."""
        if self.dirs is None:
            self.list_tree()
        yield from self.dirs or ()

    def read(self, files: list[SourceFile]) -> list[bytes | OSError]:
        """The bytes of each file (one batched ``cat``), or the OSError it failed with, in order."""
        got = self.fs.cat([f.path for f in files], on_error="return")
        out: list[bytes | OSError] = []
        for f in files:
            v = got.get(f.path)
            if v is None:  # some stores key the answer by the stripped path
                v = got.get(self.fs._strip_protocol(f.path), FileNotFoundError(f.path))
            out.append(v if isinstance(v, bytes | OSError) else OSError(str(v)))
        return out

    def open(self, f: SourceFile):
        """The file opened for reading (binary) on the fsspec filesystem."""
        return self.fs.open(f.path, "rb")


def _ancestors(rel: str) -> list[str]:
    out = []
    while rel not in (".", ""):
        out.append(rel)
        rel = posixpath.dirname(rel) or "."
    return [".", *reversed(out)]


def _top_down(rel: str) -> tuple[str, ...]:
    return () if rel == "." else tuple(rel.split("/"))


def _mtime_ns(info: dict) -> int | None:
    """A listing entry's modification time in ns, under whichever key the store uses."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "modified", "mtime_ns"):
        v = info.get(key)
        if v is None:
            continue
        if key == "mtime_ns":
            return int(v)
        if isinstance(v, str):
            try:
                v = dt.datetime.fromisoformat(v.replace("Z", "+00:00"))
            except ValueError:
                continue
        if isinstance(v, dt.datetime):
            if v.tzinfo is None:
                v = v.replace(tzinfo=dt.UTC)
            return (v - _EPOCH) // dt.timedelta(microseconds=1) * 1000
        if isinstance(v, int | float):
            return int(round(float(v) * 1e9))
    return None


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def _same(attr, f: SourceFile) -> bool:
    return attr.is_reg and attr.size == f.size and (f.mtime_ns is None
                                                    or attr.mtime_ns == f.mtime_ns)


async def import_tree(client: AsyncClient, src: str | os.PathLike, dst: str, *,
                      parallel: int = PARALLEL, batch_bytes: int = BATCH_BYTES,
                      batch_files: int = BATCH_FILES, progress: Progress | None = None,
                      storage_options: dict | None = None,
                      on_listed: Callable[[int, int], None] | None = None) -> TransferStats:
    """Make JPFS directory ``dst`` hold a copy of the tree ``src`` (its entries): a local
    directory or an fsspec URL (s3://, gs://, hf://, https://, ... with its package installed;
    ``storage_options`` go to that filesystem). ``on_listed(files, bytes)`` is called once a
    remote tree is listed (the totals for a progress bar)."""
    data = client._data()
    if is_url(src):
        remote = RemoteSource(str(src), storage_options)
        totals = await trio.to_thread.run_sync(remote.list_tree)
        source: LocalSource | RemoteSource = remote
        if on_listed is not None:
            on_listed(*totals)
    else:
        source = LocalSource(src)
    stats = TransferStats()
    tick = progress or (lambda files, nbytes: None)
    await client.makedirs(dst, exist_ok=True)
    slots = trio.Semaphore(parallel)
    now = time.time_ns()

    async def send_batch(parent: int, items: list[tuple[SourceFile, str]], run: int) -> None:
        files = [f for f, _ in items]
        got = await trio.to_thread.run_sync(source.read, files)
        contents: list[bytes] = []
        kept: list[SourceFile] = []
        for f, c in zip(files, got, strict=True):
            if isinstance(c, BaseException):
                stats.errors.append(f"{f.path}: {getattr(c, 'strerror', None) or c}")
                tick(1, f.size)
            else:
                kept.append(f)
                contents.append(c)
        if not kept:
            return
        # one batch = one run of neighbours packed on one node; the runs spread over the nodes
        nodes = data.placement(0, parent, 0, 1, group=run)
        blobs = [(new_blob_id(), nodes, c) for c in contents if len(c)]
        try:
            stored = iter(await data.storage.put(blobs)) if blobs else iter(())
        except JPFSError as e:  # every file of the batch failed; the others go on
            stats.errors += [f"{f.path}: {e.strerror}" for f in kept]
            tick(len(kept), sum(len(c) for c in contents))
            return
        ids = iter(b for b, _, _ in blobs)
        entries = []
        for f, content in zip(kept, contents, strict=True):
            chunks = []
            if content:
                used, xxh = next(stored)
                chunks = [Chunk(0, next(ids), used, len(content), len(content),
                                xxh).to_wire()]
            entries.append([os.fsencode(f.name), f.mode, f.uid, f.gid, len(content),
                            f.mtime_ns if f.mtime_ns is not None else now, chunks])
        try:
            results = await data.meta.bulk_create(parent, entries, replace=True)
        except JPFSError as e:
            stats.errors += [f"{f.path}: {e.strerror}" for f in kept]
            tick(len(kept), sum(len(c) for c in contents))
            return
        for f, res, content in zip(kept, results, contents, strict=True):
            if isinstance(res, OSError):
                stats.errors.append(f"{f.path}: {res.strerror}")
            else:
                stats.files += 1
                stats.bytes += len(content)
        tick(len(kept), sum(len(c) for c in contents))

    async def send_large(dpath: str, f: SourceFile) -> None:
        target = f"{dpath.rstrip('/')}/{f.name}"
        try:
            if isinstance(source, LocalSource):
                await client.put(f.path, target)
                n = f.size
            else:
                n = await _put_stream(client, source, f, target, now)
            stats.files += 1
            stats.bytes += n
        except (JPFSError, OSError) as e:
            stats.errors.append(f"{f.path}: {e.strerror or e}")
        tick(1, f.size)

    async with trio.open_nursery() as nursery:
        for d in source.walk():
            stats.errors += source.errors
            source.errors.clear()
            dpath = dst if d.rel == "." else f"{dst.rstrip('/')}/{d.rel}"
            try:
                if d.rel != ".":
                    await client.makedirs(dpath, exist_ok=True)
                    stats.dirs += 1
                existing = {e.name: e.attr for e in await client.scandir(dpath)}
                parent = (await client.stat(dpath)).ino
            except JPFSError as e:  # its files are not copied; the rest of the tree is
                stats.errors.append(f"{uri.SCHEME}{dpath}: {e.strerror} ({len(d.files)} "
                                    "files not copied)")
                tick(len(d.files), sum(f.size for f in d.files))
                continue
            for name, target in d.links:
                if name not in existing:
                    await client.symlink(target, f"{dpath.rstrip('/')}/{name}")
                    stats.symlinks += 1
            batch: list[tuple[SourceFile, str]] = []
            size = run = 0
            for f in d.files:
                old = existing.get(f.name)
                if old is not None and _same(old, f):
                    stats.skipped += 1
                    stats.skipped_bytes += f.size
                    tick(1, f.size)
                    continue
                if f.size > data.chunk_size:
                    await _start(nursery, slots, send_large, dpath, f)
                    continue
                batch.append((f, dpath))
                size += f.size
                if len(batch) >= batch_files or size >= batch_bytes:
                    await _start(nursery, slots, send_batch, parent, batch, run)
                    batch, size, run = [], 0, run + 1
            if batch:
                await _start(nursery, slots, send_batch, parent, batch, run)
    stats.errors += source.errors
    return stats


async def _put_stream(client: AsyncClient, source: RemoteSource, f: SourceFile, target: str,
                      now: int, window: int = 4) -> int:
    """Stream one large remote file into JPFS, ``window`` chunks at a time (as ``put`` does for
    local files); the content appears at once when every chunk is stored."""
    data = client._data()
    parent, name, _ = await client.paths.parent(target)
    attr, _ = await client.meta.create(parent, name, stat.S_IFREG | f.mode, exclusive=False)
    cs = data.chunk_size
    handle = await trio.to_thread.run_sync(source.open, f)
    chunks: list = []
    size = 0
    try:
        index = 0
        while True:
            pieces = []
            for _ in range(window):
                buf = await trio.to_thread.run_sync(handle.read, cs)
                if not buf:
                    break
                pieces.append((index, memoryview(buf)))
                size += len(buf)
                index += 1
            if not pieces:
                break
            chunks += await data.store(attr.ino, parent, pieces, -(-max(f.size, size) // cs))
            if len(pieces) < window:
                break
    finally:
        await trio.to_thread.run_sync(handle.close)
    await client.meta.write_chunks(attr.ino, chunks, size)
    await client.meta.setattr(attr.ino, mtime_ns=f.mtime_ns if f.mtime_ns is not None else now,
                              mode=f.mode)
    return size


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
    """Make local directory ``dst`` hold a copy of the JPFS tree ``src`` (its entries).

    A file or directory that cannot be read is listed in the result's ``errors`` (its path and
    why) and the rest is copied; a rerun copies what is missing and skips the rest."""
    client._data()
    dst = Path(dst)
    src = jpfs_path(src)
    stats = TransferStats()
    tick = progress or (lambda files, nbytes: None)
    if not (await client.stat(src)).is_dir:
        raise error(errno.ENOTDIR, "export copies a directory tree", src)
    slots = trio.Semaphore(parallel)

    def failed(path: str, e: OSError, size: int = 0) -> None:
        stats.errors.append(f"{uri.SCHEME}{path}: {e.strerror or e}")
        tick(1, size)

    async def fetch_batch(ldir: Path, entries: list[Entry]) -> None:
        try:
            views = await client.read_many([e.path for e in entries])
        except JPFSError as err:
            if len(entries) == 1:
                failed(entries[0].path, err, entries[0].attr.size)
                return
            # which ones: one file at a time (a node known to be down is answered at once)
            for e in entries:
                await fetch_batch(ldir, [e])
            return
        await trio.to_thread.run_sync(_write_files, ldir, entries, views)
        stats.files += len(entries)
        n = sum(len(v) for v in views)
        stats.bytes += n
        tick(len(entries), n)

    async def fetch_large(ldir: Path, e: Entry) -> None:
        try:
            await client.get(e.path, ldir / e.name)
        except JPFSError as err:
            failed(e.path, err, e.attr.size)
            return
        stats.files += 1
        stats.bytes += e.attr.size
        tick(1, e.attr.size)

    chunk_size = client.cluster.chunk_size
    stack = [src]
    async with trio.open_nursery() as nursery:
        while stack:
            dpath = stack.pop()
            try:
                listing = await client.scandir(dpath)
            except JPFSError as err:  # nothing below it is copied; the rest of the tree is
                stats.errors.append(f"{uri.SCHEME}{dpath}: {err.strerror} (directory not "
                                    "copied)")
                continue
            stack.extend(reversed([e.path for e in listing if e.attr.is_dir]))
            rel = os.path.relpath(dpath, src)
            ldir = dst if rel == "." else dst / rel
            ldir.mkdir(parents=True, exist_ok=True)
            stats.dirs += rel != "."
            batch: list[Entry] = []
            size = 0
            for e in listing:
                target = ldir / e.name
                if e.attr.is_link:
                    if not target.is_symlink():
                        try:
                            os.symlink(await client.readlink(e.path), target)
                        except JPFSError as err:
                            failed(e.path, err)
                            continue
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
