"""Changes of names: mknod, mkdir, symlink, link, unlink, rmdir and rename.

Each is sent to the directory's shard, which answers with the directory's attributes after it
where it can (``post_op``), except where this VFS holds the directory's write lease
(``leases.py``): mkdirs, unlinks and plain renames of files there, and rmdirs of directories
whose leases it holds too, are answered at once and committed behind in batches; other rmdirs
and renames there are sent as the holder's, keeping the lease. Any other change of a leased
directory's names gives the lease back first. What this VFS knew of the directories' names is
forgotten when a change fails (it may be wrong). ``create`` is writes.py's (it opens what it
makes), with the helpers here.
"""

from __future__ import annotations

import errno
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ...errors import JPFSError, error
from ...placement import shard_of
from ...proto.meta import check_name
from ...types import Attr
from .leases import GiveBack, LeasedDir
from .leasing import Leasing
from .shared import SharedState

_DEVICES = (stat.S_IFBLK, stat.S_IFCHR)


class Namespace:
    """The namespace changes the VFS sends, or answers from a lease (see the module
    docstring)."""

    def __init__(self, shared: SharedState, leasing: Leasing):
        self.shared = shared
        self.leasing = leasing
        self.leases = leasing.leases
        self.meta = shared.meta
        self.inodes = shared.inodes
        self.prefetcher = shared.prefetcher
        self.known = shared.known

    def owner(self, parent: int, uid: int, gid: int, mode: int) -> tuple[int, int]:
        """(gid, mode) of a new inode: a setgid directory gives its group, and to a new
        directory its setgid bit (as Linux does on local filesystems)."""
        p = self.inodes.get(parent)
        if p is not None and p.attr.mode & stat.S_ISGID:
            gid = p.attr.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        return gid, mode

    @contextmanager
    def names_of(self, *dirs: int) -> Iterator[None]:
        """Around a namespace change: if it fails, what this VFS knew of the directories' names
        may be wrong (EEXIST where it knew of nothing): forget it."""
        try:
            yield
        except JPFSError:
            if self.known is not None:
                for d in dirs:
                    self.known.drop(d)
            raise

    def made_in(self, parent: int, name: bytes, child: Attr, subdir: bool = False,
                answered: bool = False) -> None:
        """``child`` was just made in ``parent``. Made in one transaction on the parent's shard
        (files, symlinks, directories placed there), the parent's new mtime and ctime are the
        child's ctime to the nanosecond (and a directory adds a link): no need to ask again,
        and the attributes stay as fresh as they were; so too for a change ``answered`` from
        the parent's lease (its batch is the shard's next word). Anything else: ask next
        time."""
        self.prefetcher.forget_dir(parent)
        here = answered or shard_of(child.ino) == shard_of(parent)
        if self.known is not None:
            self.known.changed(parent, added=name)
        node = self.inodes.get(parent)
        if node is None:
            return
        if not here or node.fetched == float("-inf"):
            self.inodes.stale(parent)
            return
        t = self._lease_time(parent) if answered else child.ctime_ns
        node.attr = node.attr.with_(mtime_ns=t, ctime_ns=t,
                                    nlink=node.attr.nlink + (1 if subdir else 0))

    def _lease_time(self, parent: int) -> int:
        """``parent``'s mtime and ctime after the last change answered from its lease: what its
        batch sets on the shard too (``LeasedDir.changed_ns``)."""
        ld = self.leases.dirs.get(parent) if self.leases is not None else None
        return ld.changed_ns if ld is not None and ld.changed_ns else time.time_ns()

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int,
                    gid: int) -> Attr:
        """A regular file, FIFO, socket or block/character device (metadata only: type, mode
        and device number; the kernel does their I/O)."""
        self.shared.writable()
        await self.leasing.ready(parent)
        await self.leasing.give_back(parent)
        gid, mode = self.owner(parent, uid, gid, mode)
        with self.names_of(parent):
            attr = await self.meta.mknod(parent, name, mode,
                                         rdev if stat.S_IFMT(mode) in _DEVICES else 0, uid, gid)
        self.made_in(parent, name, attr)
        return self.shared.attr_of(self.inodes.remember(attr, parent, name))

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Attr:
        """Make directory ``name`` in ``parent`` owned by ``uid``/``gid`` (a setgid parent gives its
        group and bit); its attributes. EEXIST if the name is taken, EROFS on a read-only mount."""
        self.shared.writable()
        await self.leasing.ready(parent)
        gid, mode = self.owner(parent, uid, gid, stat.S_IFDIR | (mode & 0o7777))
        sent = time.monotonic()
        attr = await self._mkdir_leased(parent, name, mode, uid, gid)
        if attr is None:
            await self.leasing.give_back(parent)
            with self.names_of(parent), self.leasing.changing(parent):
                attr, after = await self.meta.mkdir(parent, name, mode & 0o7777, uid, gid)
            self.made_in(parent, name, attr, subdir=True)
            if after is not None:
                self.shared.post_op(parent, after)
        if self.known is not None:
            self.known.made(attr.ino, sent)
        return self.shared.attr_of(self.inodes.remember(attr, parent, name))

    async def _mkdir_leased(self, parent: int, name: bytes, mode: int, uid: int, gid: int
                            ) -> Attr | None:
        """``mkdir`` answered from ``parent``'s lease (committed behind, ``leases.py``): the new
        directory's attributes; None where this VFS does not hold the lease (send it)."""
        leases = self.leases
        if leases is None or self.known is None:
            return None
        ld = await leases.hold(parent)
        if ld is None:
            return None
        check_name(name)
        ino = None if name in ld.names else await leases.dir_ino(ld, name)
        if leases.dirs.get(parent) is not ld or ld.ending:
            return None  # recalled meanwhile
        if name in ld.names:
            raise error(errno.EEXIST, "file exists")
        if ino is None:
            return None
        attr = leases.add_dir(ld, name, mode, uid, gid, ino)
        self.made_in(parent, name, attr, subdir=True, answered=True)
        return attr

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int
                      ) -> Attr:
        """Make symlink ``name`` in ``parent`` pointing at ``target``; its attributes. EEXIST if the
        name is taken, EROFS on a read-only mount."""
        self.shared.writable()
        await self.leasing.ready(parent)
        await self.leasing.give_back(parent)
        gid, _ = self.owner(parent, uid, gid, stat.S_IFLNK)
        with self.names_of(parent):
            attr = await self.meta.symlink(parent, name, target, uid, gid)
        self.made_in(parent, name, attr)
        return self.shared.attr_of(self.inodes.remember(attr, parent, name))

    async def link(self, ino: int, parent: int, name: bytes) -> Attr:
        """Give inode ``ino`` the new name ``name`` in ``parent``; its attributes after. EEXIST if
        the name is taken, EROFS on a read-only mount."""
        self.shared.writable()
        await self.leasing.ready(parent)
        await self.leasing.settle(ino)
        await self.leasing.give_back(parent)
        with self.names_of(parent):
            attr = await self.meta.link(ino, parent, name)
        self.shared.changed_dir(parent)
        if self.known is not None:
            self.known.changed(parent, added=name)
        return self.shared.attr_of(self.inodes.remember(attr, parent, name))

    async def unlink(self, parent: int, name: bytes) -> None:
        """Remove the non-directory ``name`` from ``parent`` (answered at once from the directory's
        lease where this VFS holds it); ENOENT, EISDIR or EROFS as unlink(2)."""
        self.shared.writable()
        await self.leasing.ready(parent)
        leases = self.leases
        node = self.inodes.child(parent, name)
        if leases is not None and node is not None and not node.attr.is_dir:
            ld = await leases.hold(parent)
            if ld is not None and leases.book.removable(ld, name, node.ino):
                try:
                    await leases.remove(ld, name, node.ino)
                except GiveBack:
                    pass
                else:
                    self._unlinked(parent, name)
                    return
        await self.leasing.give_back(parent)
        with self.names_of(parent), self.leasing.changing(parent):
            after = await self.meta.unlink(parent, name)
        gone = self.inodes.unname(parent, name)
        if self.known is not None:
            self.known.changed(parent, removed=name)
        self.shared.post_op(parent, after)
        if gone is not None:
            self.inodes.stale(gone.ino)  # nlink and ctime changed

    def _unlinked(self, parent: int, name: bytes) -> None:
        """An unlink answered from a lease: what the shard's post-op answer would have told."""
        gone = self.inodes.unname(parent, name)
        if self.known is not None:
            self.known.changed(parent, removed=name)
        self._touched_in_lease(parent)
        if gone is not None:
            self.inodes.stale(gone.ino)  # nlink and ctime: asked (after the batch) next time

    async def rmdir(self, parent: int, name: bytes) -> None:
        """Remove the empty directory ``name`` from ``parent``; ENOTEMPTY, ENOTDIR or EROFS as
        rmdir(2)."""
        self.shared.writable()
        await self.leasing.ready(parent)
        child = self.inodes.child(parent, name)
        leases = self.leases
        ld = None
        if leases is not None and child is not None and child.attr.is_dir:
            ld = await leases.hold(parent)
            if ld is not None and await self._rmdir_leased(ld, name, child.ino):
                self._removed_dir(parent, name, None)
                return
        if ld is None:
            await self.leasing.give_back(parent)
        else:
            assert leases is not None
            await leases.book.settle(parent)  # the shard checks the names it has
        if child is not None:
            await self.leasing.give_back(child.ino)  # its own entries, which it must not have
        with self.names_of(parent), self.leasing.changing(parent):
            after = await self.meta.rmdir(
                parent, name, session=leases.session if leases and ld is not None else None)
        if leases is not None and ld is not None:
            ld.names.pop(name, None)  # the holder's own change: the lease's names follow it
        self._removed_dir(parent, name, after)

    async def _rmdir_leased(self, ld: LeasedDir, name: bytes, ino: int) -> bool:
        """``rmdir`` answered from the parent's lease (``ld``) and committed behind, when this
        VFS holds the lease of the directory too and its names are none (what was answered
        there committed first): True if so; False to send it."""
        leases = self.leases
        assert leases is not None
        gone = leases.dirs.get(ino)
        if gone is None or gone.ending or ld.names.get(name) != ino:
            return False
        await leases.book.settle(ino)
        if leases.dirs.get(ino) is not gone or gone.ending or leases.dirs.get(ld.parent) \
                is not ld or ld.ending or ld.names.get(name) != ino:
            return False  # recalled meanwhile
        if gone.names:
            raise error(errno.ENOTEMPTY, "directory not empty")
        leases.remove_dir(ld, name, gone)
        return True

    def _removed_dir(self, parent: int, name: bytes, after: Attr | None) -> None:
        """What this VFS knows after an rmdir: ``after``, the shard's post-op attributes of the
        parent, or None for one answered from the parent's lease."""
        gone = self.inodes.unname(parent, name)
        if self.known is not None:
            self.known.changed(parent, removed=name)
            if gone is not None:
                self.known.drop(gone.ino)
        if after is None:
            self._touched_in_lease(parent, subdirs=-1)
        else:
            self.shared.post_op(parent, after)
        if gone is not None:
            self.inodes.stale(gone.ino)
        self.inodes.moved()

    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
                     flags: int) -> None:
        """Rename as ``rename(2)``, with RENAME_NOREPLACE (1) and RENAME_EXCHANGE (2). A plain
        rename of a file within a directory this mount holds the lease of keeps the lease: it
        is answered from the lease and committed behind when the lease's names vouch for both
        names (``LeaseBook.movable``); else what the lease answered there is committed first,
        and the shard lets the holder's rename pass (the lease's names follow it)."""
        self.shared.writable()
        await self.leasing.ready(parent_old, parent_new)
        check_name(name_old)
        check_name(name_new)  # before a lease answers it
        leases = self.leases
        ld = None
        moving = self.inodes.child(parent_old, name_old)
        if leases is not None and parent_old == parent_new and not flags and moving is not None \
                and moving.attr.is_reg and shard_of(moving.ino) == shard_of(parent_old):
            # one shard's transaction (a file made in the directory): no self-recall
            ld = await leases.hold(parent_old)
            target = self.inodes.child(parent_new, name_new)
            if ld is not None and (target is None or target.attr.is_reg) and leases.book.movable(
                    ld, name_old, moving.ino, name_new, target.ino if target else None):
                leases.rename(ld, name_old, name_new)
                if target is None or target.ino != moving.ino:  # else rename(2) does nothing
                    self._moved(parent_old, name_old, parent_new, name_new, 0, None)
                return
            if ld is not None:
                await leases.book.settle(parent_old)
        if ld is None:
            await self.leasing.give_back(parent_old, parent_new)
        with self.names_of(parent_old, parent_new), self.leasing.changing(parent_old), \
                self.leasing.changing(parent_new):
            src_after, dst_after = await self.meta.rename(
                parent_old, name_old, parent_new, name_new, flags,
                session=leases.session if leases is not None and ld is not None else None)
        if leases is not None and ld is not None:
            leases.book.renamed(ld, name_old, name_new)
        self._moved(parent_old, name_old, parent_new, name_new, flags, (src_after, dst_after))

    def _moved(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
               flags: int, after: tuple | None) -> None:
        """What this VFS knows after a rename: ``after``, the shard's post-op attributes of both
        directories, or None for a rename answered from the lease (the directory's times are
        now; the moved file's ctime is asked after the batch)."""
        if self.known is not None:
            exchange = bool(flags & 2)
            self.known.changed(parent_old, removed=None if exchange else name_old)
            self.known.changed(parent_new, added=name_new)
            if exchange:
                self.known.changed(parent_old, added=name_old)
        moved = self.inodes.unname(parent_old, name_old)
        other = self.inodes.unname(parent_new, name_new)
        if after is None:
            self._touched_in_lease(parent_old)
        else:
            self.shared.post_op(parent_old, after[0])
            if parent_new != parent_old:
                self.shared.post_op(parent_new, after[1])
        for node, p, n in ((moved, parent_new, name_new),
                           (other if flags & 2 else None, parent_old, name_old)):
            if node is not None:  # keep the names right: co-access learning works on paths
                self.inodes.remember(node.attr, p, n, lookup=False)
                self.inodes.stale(node.ino)  # its ctime moved
        if other is not None and not flags & 2:
            self.inodes.stale(other.ino)  # replaced: one link fewer
        self.inodes.moved()

    def _touched_in_lease(self, parent: int, subdirs: int = 0) -> None:
        """``parent``'s names changed by a change answered from its lease: its times are the
        change's (and its link count moves by ``subdirs``)."""
        self.prefetcher.forget_dir(parent)
        node = self.inodes.get(parent)
        if node is not None and node.fetched != float("-inf"):
            t = self._lease_time(parent)
            node.attr = node.attr.with_(mtime_ns=t, ctime_ns=t,
                                        nlink=node.attr.nlink + subdirs)


__all__ = ["Namespace"]
