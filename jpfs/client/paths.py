"""Path resolution for the path API: from a path inside JPFS to its inode.

Paths are POSIX paths inside JPFS (``/a/b``; ``jpfs:/a/b`` and ``jpfs://a/b`` are accepted too).
Resolution walks from the root one ``lookup`` per component, following symlinks as the kernel does
(40 at most, then ELOOP). Directories resolved recently are remembered for ``dir_cache_ttl``
seconds, so a loop over files of one directory costs one call per file. Kept apart from
``AsyncClient`` (client.py), which builds one ``Resolver`` and reads as the public API over it;
this module owns the directory cache and says how errors name their paths.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import trio

from .. import uri
from ..errors import ChecksumError, DeadlineError, JPFSError, Unavailable, error
from ..types import ROOT_INO, Attr
from .wire.meta import MetaClient

MAX_SYMLINKS = 40


def jpfs_path(p: str | os.PathLike) -> str:
    """The normalised JPFS path (``/a/b``) of ``p``: a path, ``jpfs:/a/b`` or ``jpfs://a/b``."""
    p = os.fspath(p)
    return uri.to_path(p) if uri.is_jpfs(p) else uri.normalize(p)


def at_path(e: OSError, path: str) -> OSError:
    """``e`` naming ``path`` (a copy, so an error shared by several paths stays right for each;
    one that names a path already is kept). Unavailable, DeadlineError and ChecksumError stay
    what they are, so callers can still tell a daemon that is down from a missing file."""
    if e.filename is not None:
        return e
    if isinstance(e, (Unavailable, DeadlineError, ChecksumError)):
        named: OSError = type(e)(e.strerror or str(e))
    else:
        named = error(e.errno or errno.EIO, e.strerror or str(e))
    named.filename = path
    return named


@contextmanager
def naming(path: str, *, change: bool = False) -> Iterator[None]:
    """A JPFSError raised inside the ``with`` comes out naming ``path``: through ``at_path``
    (a path named already and a daemon's kind of failure are kept), or with ``change`` as
    ``error(errno, strerror, path)``: a change names the path it changes."""
    try:
        yield
    except JPFSError as e:
        raise (error(e.errno, e.strerror, path) if change else at_path(e, path)) from None


class Resolver:
    """Paths to inodes over a MetaClient, with a cache of the directories resolved recently.

    Args:
        meta: where lookups go (it follows the cluster map itself).
        dir_cache_ttl: how long resolved directories are trusted (seconds; 0: not cached).
    """

    def __init__(self, meta: MetaClient, dir_cache_ttl: float):
        self.meta = meta
        self.dir_cache_ttl = dir_cache_ttl
        self._dirs: dict[str, tuple[int, float]] = {}

    def forget(self, path: str) -> None:
        """Drop cached directories at or below ``path`` (after it moved or went away)."""
        if self._dirs:
            prefix = path.rstrip("/") + "/"
            for k in [k for k in self._dirs if k == path or k.startswith(prefix)]:
                del self._dirs[k]

    async def walk(self, path: str, follow: bool) -> tuple[Attr, str]:
        """Resolve ``path`` (normalised); returns its attributes and its symlink-free form."""
        links = 0
        comps = uri.split(path)
        i, cur_path = 0, "/"
        cur = None  # Attr of cur_path, fetched lazily
        ino = ROOT_INO
        while i < len(comps):
            # longest cached directory prefix first: skips most lookups in a hot directory
            if i == 0 and self._dirs:
                for j in range(len(comps) - 1, 0, -1):
                    prefix = "/" + "/".join(comps[:j])
                    hit = self._dirs.get(prefix)
                    if hit and hit[1] > time.monotonic():
                        ino, cur_path, i, cur = hit[0], prefix, j, None
                        break
            name = comps[i]
            try:
                attr = await self.meta.lookup(ino, os.fsencode(name))
            except JPFSError as e:
                raise at_path(e, path) from None
            last = i == len(comps) - 1
            if attr.is_link and (follow or not last):
                links += 1
                if links > MAX_SYMLINKS:
                    raise error(errno.ELOOP, "too many levels of symbolic links", path)
                try:
                    target = os.fsdecode(await self.meta.readlink(attr.ino))
                except JPFSError as e:
                    raise at_path(e, path) from None
                base = "/" if target.startswith("/") else cur_path
                comps = uri.split(base + "/" + target) + comps[i + 1:]
                i, cur_path, ino, cur = 0, "/", ROOT_INO, None
                continue
            if not last and not attr.is_dir:
                raise error(errno.ENOTDIR, "not a directory", path)
            cur_path = cur_path.rstrip("/") + "/" + name
            if attr.is_dir and self.dir_cache_ttl > 0:
                self._dirs[cur_path] = (attr.ino, time.monotonic() + self.dir_cache_ttl)
            ino, cur = attr.ino, attr
            i += 1
        if cur is None:
            try:
                cur = await self.meta.getattr(ino)
            except JPFSError as e:
                raise at_path(e, path) from None
        return cur, cur_path

    async def directory(self, path: str) -> tuple[Attr, str]:
        """``walk`` of a directory (following symlinks; ENOTDIR for anything else), from any
        accepted spelling of its path."""
        attr, real = await self.walk(jpfs_path(path), True)
        if not attr.is_dir:
            raise error(errno.ENOTDIR, "not a directory", path)
        return attr, real

    async def dir_ino(self, path: str) -> int:
        """The inode of a directory, from the directory cache when it is fresh there (no call
        at all); what is needed to look up, create or list *in* it."""
        if path == "/":
            return ROOT_INO
        hit = self._dirs.get(path)
        if hit and hit[1] > time.monotonic():
            return hit[0]
        attr, _ = await self.walk(path, follow=True)
        if not attr.is_dir:
            raise error(errno.ENOTDIR, "not a directory", path)
        return attr.ino

    async def parent(self, path: str) -> tuple[int, bytes, str]:
        """(parent directory inode, last name, normalised path) for creating or removing."""
        p = jpfs_path(path)
        if p == "/":
            raise error(errno.EBUSY, "the root cannot be changed this way", p)
        head, name = p.rsplit("/", 1)
        return await self.dir_ino(head or "/"), os.fsencode(name), p

    async def by_directory(self, paths: list[str], lookup) -> list:
        """``await lookup(parent_ino, names)`` once per directory of ``paths`` (directories in
        parallel); its per-name answers in the order of ``paths``. An error reaching a
        directory is the answer for each of its names."""
        groups: dict[str, list[tuple[int, bytes]]] = {}
        for i, p in enumerate(paths):
            head, _, name = jpfs_path(p).rpartition("/")
            groups.setdefault(head or "/", []).append((i, os.fsencode(name)))
        out: list = [None] * len(paths)

        async def one(head: str, items: list[tuple[int, bytes]]) -> None:
            try:
                got = await lookup(await self.dir_ino(head), [n for _, n in items])
            except JPFSError as e:
                got = [e] * len(items)
            for (i, _), answer in zip(items, got, strict=True):
                out[i] = answer

        async with trio.open_nursery() as nursery:
            for head, items in groups.items():
                nursery.start_soon(one, head, items)
        return out

    async def layouts(self, paths: list[str]) -> list:
        """The layouts of many files: one ``lookup_layouts`` call per directory, then a walk of
        each name it could not answer (a symlink, an inode on another shard); an error is the
        answer for a path that cannot be resolved."""
        layouts = await self.by_directory(paths, self.meta.lookup_layouts)

        async def the_long_way(i: int) -> None:
            p = jpfs_path(paths[i])
            try:
                attr, _ = await self.walk(p, True)
                layouts[i] = await self.meta.get_layout(attr.ino)
            except JPFSError as e:
                layouts[i] = at_path(e, p)

        async with trio.open_nursery() as nursery:
            for i, lay in enumerate(layouts):
                if isinstance(lay, tuple):
                    nursery.start_soon(the_long_way, i)
        return layouts
