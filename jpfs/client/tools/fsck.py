"""``jpfs fsck``: check the namespace across all shards, and repair it.

It first lets in-flight cross-shard transactions finish (and aborts prepared records whose
coordinator has forgotten them), then reads every inode, entry and chunk record and checks:

- every entry's directory exists and is a directory, and its inode exists with the entry's type;
- every file's link count equals the entries naming it; every directory has exactly one entry
  (the root none), a parent pointer to that entry's directory, and 2 + subdirectories links;
- no inode is unreachable (orphans are moved to ``/lost+found``, never deleted);
- no chunk record belongs to a missing inode;
- every copy of a replicated shard holds the same records as its leader (a hash of every
  record, compared once the copies are at the same position; a copy that is down or still
  catching up is noted, not counted as a problem).

Run it on a quiet cluster: a change made during the scan can look like a problem. Each repair
states what it expects to find, so a repair computed from a stale scan changes nothing.
"""

from __future__ import annotations

import logging
import stat
from collections import Counter
from dataclasses import dataclass, field

import trio

from ...errors import JPFSError
from ...placement import shard_of
from ...proto.replica import REPL_DIGEST, ReplDigest, ShardPool, StatusReq
from ...types import ROOT_INO
from ..wire.meta import MetaClient

log = logging.getLogger(__name__)

LOST_FOUND = b"lost+found"
SETTLE_TIME = 15.0


@dataclass
class Report:
    """What fsck counted, found and repaired."""

    inodes: int = 0
    entries: int = 0
    chunks: int = 0
    problems: list[str] = field(default_factory=list)
    repaired: int = 0
    counts: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    """What was not checked and why (a copy that is down or still catching up)."""

    @property
    def clean(self) -> bool:
        """Whether no problem was found."""
        return not self.problems

    def add(self, kind: str, text: str) -> None:
        """Record a problem: ``text`` for the report, counted under ``kind``."""
        self.counts[kind] += 1
        self.problems.append(text)

    def as_dict(self) -> dict:
        """The report as one JSON-able object (the first 200 problems in full, all of them
        counted)."""
        return {"clean": self.clean, "inodes": self.inodes, "entries": self.entries,
                "chunks": self.chunks, "problems": dict(self.counts),
                "details": self.problems[:200], "repaired": self.repaired,
                "notes": self.notes}


async def _scan(meta: MetaClient, shard: int, kind: str) -> list:
    out, after = [], b""
    while True:
        page = await meta.scan(shard, kind, after)
        items, nxt = page.items, page.next
        out.extend(items)
        if nxt is None:
            return out
        after = nxt


async def settle(meta: MetaClient, report: Report, repair: bool) -> None:
    """Wait for cross-shard transactions to finish; abort orphaned prepared records."""
    deadline = trio.current_time() + SETTLE_TIME
    while True:
        pend = [await meta.pending(s) for s in range(meta.n_shards)]
        if not any(p.intents or p.prepared for p in pend):
            return
        if trio.current_time() > deadline:
            break
        await trio.sleep(0.2)
    for shard, p in enumerate(pend):
        for txid, state in p.intents:
            report.add("unfinished_transaction",
                       f"shard {shard}: transaction {txid.hex()} still {state}")
        for txid, coordinator in p.prepared:
            state = await meta.call(coordinator, "tx_status", txid)
            if state == "unknown":
                report.add("orphan_prepared", f"shard {shard}: prepared transaction "
                           f"{txid.hex()} has no coordinator record")
                if repair and await meta.repair(shard, "abort_tx", [txid]):
                    report.repaired += 1


async def check_copies(meta: MetaClient, report: Report, wait: float = 10.0) -> None:
    """Compare every copy of each replicated shard: same position, same records."""
    pool = meta.pool
    if not isinstance(pool, ShardPool):
        return
    for shard, copies in enumerate(pool.pools):
        if len(copies) < 2:
            continue
        deadline = trio.current_time() + wait
        down = ""
        while True:
            got: list[ReplDigest | None] = []
            for j in range(len(copies)):
                try:
                    got.append(REPL_DIGEST.decode(await copies.call(
                        j, REPL_DIGEST, StatusReq(shard), timeout=60.0)))
                except JPFSError as e:
                    got.append(None)
                    down = e.strerror or str(e)
            live = [(j, g) for j, g in enumerate(got) if g is not None]
            positions = {(g.term, g.seq) for _, g in live}
            # a copy installing a snapshot holds part of the shard: wait for it too
            catching_up = len(positions) > 1 or any(g.resyncing for _, g in live)
            if not catching_up or trio.current_time() > deadline:
                break
            await trio.sleep(0.2)
        for j, g in enumerate(got):
            if g is None:
                report.notes.append(f"shard {shard} copy {j} not checked: {down}")
        if catching_up:
            where = ", ".join(f"copy {j} " + ("installing a snapshot" if g.resyncing
                                               else f"at seq {g.seq}") for j, g in live)
            report.notes.append(f"shard {shard}: copies still catching up, not compared "
                                f"({where})")
            continue
        if len({g.digest for _, g in live}) > 1:
            report.add("copies_differ", f"shard {shard}: copies at the same position hold "
                       f"different records{_where_they_differ(live)} (" + ", ".join(
                           f"copy {j}: {g.records} records, {g.digest[:12]}"
                           for j, g in live) + "); stop the odd copy, move its data "
                       "directory away and start it again: it resyncs from the leader")


def _where_they_differ(live: list[tuple[int, ReplDigest]]) -> str:
    """`` in databases a, b`` where the copies' per-database hashes disagree (empty when a
    copy's daemon predates them)."""
    dbs = [g.dbs for _, g in live]
    if any(d is None for d in dbs):
        return ""
    names = sorted({name for d in dbs if d is not None for name in d})
    differ = [name for name in names
              if len({tuple(d.get(name, ())) for d in dbs if d is not None}) > 1]
    return f" in database{'s' if len(differ) > 1 else ''} {', '.join(differ)}" if differ else ""


async def fsck(meta: MetaClient, *, repair: bool = False) -> Report:
    """Check every shard against the others (and with ``repair``, fix what is found)."""
    report = Report()
    await settle(meta, report, repair)
    inodes: dict[int, list] = {}
    dentries: list[list] = []
    chunk_inos: set[int] = set()
    for shard in range(meta.n_shards):
        for ino, mode, nlink, parent, _size in await _scan(meta, shard, "inode"):
            inodes[ino] = [mode, nlink, parent]
        dentries.extend(await _scan(meta, shard, "dentry"))
        for ino, *_ in await _scan(meta, shard, "chunk"):
            report.chunks += 1
            chunk_inos.add(ino)
    report.inodes, report.entries = len(inodes), len(dentries)

    async def fix(shard: int, kind: str, args: list) -> object:
        if not repair:
            return None
        try:
            done = await meta.repair(shard, kind, args)
        except JPFSError as e:
            log.warning("repair %s %r failed: %s", kind, args, e.strerror)
            return None
        if done:
            report.repaired += 1
        return done

    refs: dict[int, list[tuple[int, bytes]]] = {}
    subdirs: Counter = Counter()
    for parent, name, ino, kind in dentries:
        where = f"entry {name!r} in directory {parent:#x}"
        pnode = inodes.get(parent)
        if pnode is None or not stat.S_ISDIR(pnode[0]):
            report.add("entry_in_missing_directory", f"{where}: directory missing")
            await fix(shard_of(parent), "drop_dentry", [parent, name, ino])
            continue
        node = inodes.get(ino)
        if node is None:
            report.add("dangling_entry", f"{where}: inode {ino:#x} missing")
            await fix(shard_of(parent), "drop_dentry", [parent, name, ino])
            continue
        if stat.S_IFMT(node[0]) != kind:
            report.add("entry_type", f"{where}: type {kind:o} but inode is {node[0]:o}")
            await fix(shard_of(parent), "set_dentry_kind", [parent, name, ino,
                                                             stat.S_IFMT(node[0])])
        refs.setdefault(ino, []).append((parent, name))
        if stat.S_ISDIR(node[0]):
            subdirs[parent] += 1

    lost_found: int | None = None

    async def lost_and_found() -> int | None:
        nonlocal lost_found
        if lost_found is None and repair:
            # make_dir counts the new directory in the root's link count itself
            lost_found = await meta.call(shard_of(ROOT_INO), "repair", "make_dir",
                                         [ROOT_INO, LOST_FOUND])
        return lost_found

    for ino, (mode, nlink, parent) in sorted(inodes.items()):
        names = refs.get(ino, [])
        if ino == ROOT_INO:
            continue
        if not names:
            report.add("orphan", f"inode {ino:#x} is not reachable from any directory")
            lf = await lost_and_found()
            if lf is not None and await fix(shard_of(lf), "add_dentry",
                                            [lf, f"#{ino:x}".encode(), ino, stat.S_IFMT(mode)]):
                names = [(lf, f"#{ino:x}".encode())]
                if stat.S_ISDIR(mode):
                    subdirs[lf] += 1
                    await fix(shard_of(ino), "set_parent", [ino, lf])
                    parent = lf
        if stat.S_ISDIR(mode):
            if len(names) > 1:
                report.add("directory_links", f"directory {ino:#x} has {len(names)} entries")
                for p, n in names:
                    if p != parent:
                        await fix(shard_of(p), "drop_dentry", [p, n, ino])
                        subdirs[p] -= 1
            elif names and names[0][0] != parent:
                report.add("parent_pointer", f"directory {ino:#x} points to parent {parent:#x} "
                           f"but is listed in {names[0][0]:#x}")
                await fix(shard_of(ino), "set_parent", [ino, names[0][0]])
        elif names and nlink != len(names):
            report.add("link_count", f"inode {ino:#x} has nlink {nlink} but {len(names)} entries")
            await fix(shard_of(ino), "set_nlink", [ino, len(names)])
    for ino, (mode, nlink, _) in inodes.items():
        if stat.S_ISDIR(mode):
            want = 2 + subdirs[ino]
            if nlink != want:
                report.add("dir_link_count", f"directory {ino:#x} has nlink {nlink}, "
                           f"expected {want}")
                await fix(shard_of(ino), "set_nlink", [ino, want])
    if lost_found is not None and subdirs[lost_found]:
        await fix(shard_of(lost_found), "set_nlink", [lost_found, 2 + subdirs[lost_found]])
    for ino in chunk_inos - inodes.keys():
        report.add("orphan_chunks", f"chunk records of missing inode {ino:#x}")
        await fix(shard_of(ino), "drop_chunks", [ino])
    await check_copies(meta, report)
    return report
