"""The healer's pure part: what one chunk needs, and the record reads and writes it makes.

``plan_chunk`` decides from a chunk record, the map's node states, which nodes answer and which
copies their scrubbers marked bad; ``new_nodes`` says what the record becomes once copies
succeeded; ``scan_page`` and ``swap_nodes`` are the shard transactions (a page of records, and
the compare-and-set rewrite). ``heal.py`` runs them round after round.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from jpfs.placement import spread
from jpfs.types import Chunk

from . import keys as K
from .txn import Txn

ACTIVE, DRAINING, REMOVED = "active", "draining", "removed"
BATCH_BYTES = 16 << 20
BATCH_BLOBS = 512


@dataclass
class Copy:
    """One blob to put on ``target``, from the first of ``sources`` that has good bytes."""

    target: int
    sources: list[int]
    blob: bytes
    length: int
    xxh: int
    ok: bool = False
    tried: int = 0


@dataclass
class Job:
    """One chunk record and what the round does for it."""

    ino: int
    chunk: Chunk
    kind: str  # "repair" (copies missing or bad), "move" (rebalance), "tidy" (record only)
    copies: list[Copy] = field(default_factory=list)
    replace: tuple[int, int] | None = None  # move: (from, to)


@dataclass
class Round:
    """What one round saw and did (published as ``heal_status`` when it ends)."""

    epoch: int
    started: float
    states: tuple[str, ...]
    replicas: int
    """Copies each chunk gets: the map's replicas, or fewer when fewer nodes are writable."""
    up: set[int]
    bad: dict[int, set[bytes]]
    wanted: int = 0
    domains: tuple[str, ...] | None = None
    """Each node's failure domain (``Cluster.node_domains``): new copies avoid the domains of
    the copies that stay."""
    """The map's replicas: a chunk with fewer live copies counts as under-replicated."""
    chunks: int = 0
    nbytes: int = 0
    under: int = 0
    under_bytes: int = 0
    unrepairable: int = 0
    bad_copies: int = 0
    node_chunks: dict[int, int] = field(default_factory=dict)
    moves: list[list] = field(default_factory=list)  # [from, to, bytes left] (rebalance)
    copied: int = 0
    copy_time: float = 0.0
    worked: bool = False


def _same_or_new_domain(domains: tuple[str, ...] | None, src: int, dst: int,
                        nodes: Sequence[int]) -> bool:
    """A move keeps a chunk's failure domains apart: ``dst`` is in ``src``'s domain or in one
    no other copy is in."""
    if domains is None or not (0 <= dst < len(domains) and 0 <= src < len(domains)):
        return True
    others = {domains[n] for n in nodes if n != src and 0 <= n < len(domains)}
    return domains[dst] == domains[src] or domains[dst] not in others


def plan_chunk(ino: int, c: Chunk, r: Round, writable_up: Sequence[int]) -> Job | None:
    """What chunk ``c`` needs: None when nothing (the pure part of a round, see the module)."""
    st = r.states
    uniq = list(dict.fromkeys(c.nodes))

    def state(n: int) -> str:
        return st[n] if 0 <= n < len(st) else REMOVED

    def bad(n: int) -> bool:
        return c.blob in r.bad.get(n, ())

    good_active = [n for n in uniq if state(n) == ACTIVE and not bad(n)]
    good_drain = [n for n in uniq if state(n) == DRAINING and not bad(n)]
    repairs = [n for n in uniq if state(n) == ACTIVE and bad(n) and n in r.up]
    r.bad_copies += sum(1 for n in uniq if bad(n))
    if len(good_active) + len(good_drain) < max(r.replicas, r.wanted):
        r.under += 1
        r.under_bytes += c.blob_len
    sources = [n for n in good_active + good_drain if n in r.up] + \
        [n for n in uniq if state(n) == REMOVED and n in r.up and not bad(n)]
    need = r.replicas - len(good_active) - len(repairs)
    targets = list(spread(int.from_bytes(c.blob[:8], "little"), writable_up, need, uniq,
                          r.domains, good_active + good_drain)) if need > 0 else []
    if repairs or targets:
        if not sources:
            r.unrepairable += 1
            return None
        job = Job(ino, c, "repair")
        job.copies = [Copy(t, sources, c.blob, c.blob_len, c.xxh) for t in repairs + targets]
        return job
    if need <= 0 and any(state(n) != ACTIVE for n in uniq):
        return Job(ino, c, "tidy")  # enough live copies: drop draining/removed ones
    for move in r.moves:
        src, dst, left = move
        if left > 0 and src in good_active and src in r.up and dst not in uniq \
                and _same_or_new_domain(r.domains, src, dst, uniq):
            move[2] -= c.blob_len
            job = Job(ino, c, "move", replace=(src, dst))
            job.copies = [Copy(dst, [src] + [n for n in sources if n != src], c.blob,
                                c.blob_len, c.xxh)]
            return job
    return None


def new_nodes(job: Job, r: Round) -> tuple[int, ...]:
    """The record's nodes after ``job``'s successful copies."""
    c = job.chunk
    ok = [cp.target for cp in job.copies if cp.ok]
    if job.kind == "move":
        if not ok or job.replace is None:
            return c.nodes
        src, dst = job.replace
        return tuple(dst if n == src else n for n in c.nodes)
    st = r.states
    uniq = list(dict.fromkeys(c.nodes))
    active = [n for n in uniq if 0 <= n < len(st) and st[n] == ACTIVE]
    live = [n for n in active if c.blob not in r.bad.get(n, ()) or n in ok]
    added = [t for t in ok if t not in uniq]
    enough = len(live) + len(added) >= r.replicas
    kept = [n for n in uniq if n in active or not enough]
    return tuple(kept + added)


def scan_page(t: Txn, after: bytes, limit: int) -> tuple[list[tuple[int, Chunk]], bytes | None]:
    """Up to ``limit`` chunk records after key ``after`` (from the start when empty), as
    ``(ino, chunk)``, and the key to go on from (None at the end)."""
    out: list[tuple[int, Chunk]] = []
    with t.t.cursor(db=t.db["chunk"]) as cur:
        ok = cur.set_range(after) if after else cur.first()
        if ok and after and bytes(cur.key()) == after:
            ok = cur.next()
        last = None
        while ok and len(out) < limit:
            key = bytes(cur.key())
            ino_index = K.split_chunk_key(key)
            out.append((ino_index[0], K.decode_chunk(ino_index, cur.value())))
            last = key
            ok = cur.next()
    return out, (last if ok else None)


def swap_nodes(t: Txn, changes: list[tuple[int, int, bytes, tuple, tuple]]) -> list[bool]:
    """Compare-and-set: point each chunk at its new nodes only if the record still names the
    blob and nodes the healer read."""
    out = []
    db = t.db["chunk"]
    for ino, index, blob, old, new in changes:
        key = K.chunk_key(ino, index)
        raw = t.t.get(key, db=db)
        c = K.decode_chunk((ino, index), raw) if raw is not None else None
        if c is None or c.blob != blob or tuple(c.nodes) != tuple(old):
            out.append(False)
            continue
        t.t.put(key, K.encode_chunk(dataclasses.replace(c, nodes=tuple(new))), db=db)
        out.append(True)
    return out


def count(counts: dict[int, int], nodes: Sequence[int]) -> None:
    """Count one more chunk on each of ``nodes`` (a node listed twice counts once)."""
    for n in dict.fromkeys(nodes):
        counts[n] = counts.get(n, 0) + 1


def live_before(j: Job, r: Round) -> int:
    """Good copies of the job's chunk now: on distinct active or draining nodes, not marked bad."""
    st = r.states
    return sum(1 for n in dict.fromkeys(j.chunk.nodes) if 0 <= n < len(st)
               and st[n] in (ACTIVE, DRAINING) and j.chunk.blob not in r.bad.get(n, ()))


def live_after(j: Job, nodes: Sequence[int], r: Round) -> int:
    """Good copies of the job's chunk once it is on ``nodes``: as ``live_before``, where a copy this
    job made counts even on a node that marked the old one bad."""
    st = r.states
    ok = {cp.target for cp in j.copies if cp.ok}
    return sum(1 for n in dict.fromkeys(nodes) if 0 <= n < len(st) and st[n] in
               (ACTIVE, DRAINING) and (j.chunk.blob not in r.bad.get(n, ()) or n in ok))


def batches(items: list[Copy], limit: int = BATCH_BYTES) -> list[list[Copy]]:
    """Copies in pulls of at most ``limit`` bytes (at least one copy) and BATCH_BLOBS blobs."""
    out: list[list[Copy]] = []
    cur: list[Copy] = []
    size = 0
    for cp in items:
        if cur and (size + cp.length > limit or len(cur) >= BATCH_BLOBS):
            out.append(cur)
            cur, size = [], 0
        cur.append(cp)
        size += cp.length
    if cur:
        out.append(cur)
    return out
