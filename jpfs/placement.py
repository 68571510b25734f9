"""Where things live: pure functions shared by clients and servers.

Every client computes placement itself, so no lookup service sits on the hot path.

- An inode id carries its metadata shard in its top ``SHARD_BITS`` bits.
- A directory's entries live on the directory's own shard; a new file's inode is allocated on its
  parent's shard (``create`` is one local transaction); a new directory goes to the shard chosen by
  hashing (parent, name), so big trees spread over all shards.
- File bytes are stored in chunks. A small file (one chunk) goes to the storage nodes chosen by its
  *parent directory* and the run of files it was written with, so neighbours are packed next to
  each other on the same volumes and one batched read serves many of them, while a big directory
  still spreads over every node. Chunk ``i`` of a large file goes to node ``(h(ino) + i)``,
  striping the file over all nodes. Replicas are the next nodes round the ring.

Placement runs over the *writable* nodes (the cluster map's active ones, in index order): a
draining or removed node takes no new bytes, and a node added to the map takes its share of new
writes at once. The chosen nodes are recorded with each chunk, so nothing moves by itself when
the map changes: the metadata shards' healers move what must move (``jpfs_daemon.meta.heal``).
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

SHARD_BITS = 16
COUNTER_BITS = 64 - SHARD_BITS
COUNTER_MASK = (1 << COUNTER_BITS) - 1
MAX_SHARDS = 1 << SHARD_BITS


def make_ino(shard: int, counter: int) -> int:
    """The inode id for ``counter`` allocated on ``shard``."""
    if not 0 <= shard < MAX_SHARDS or not 0 < counter <= COUNTER_MASK:
        raise ValueError(f"inode out of range: shard {shard} counter {counter}")
    return (shard << COUNTER_BITS) | counter


def shard_of(ino: int) -> int:
    """The metadata shard that owns inode ``ino``."""
    return ino >> COUNTER_BITS


def _h64(*parts: int | bytes) -> int:
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.to_bytes(8, "little", signed=False))
    return h.intdigest()


def new_dir_shard(parent: int, name: bytes, n_shards: int) -> int:
    """The shard a new directory ``parent/name`` is allocated on."""
    return _h64(parent, name) % n_shards if n_shards > 1 else 0


def _ring(start: int, nodes: Sequence[int], replicas: int,
          domains: Sequence[str] | None = None, taken: Sequence[str] = ()) -> tuple[int, ...]:
    """``replicas`` of ``nodes`` round the ring from ``start``; with ``domains`` (each node's
    failure domain, by node index), nodes of domains not yet holding a copy (nor in ``taken``)
    come first, so the copies of a chunk survive the loss of any one host while there are as
    many hosts as copies. With one domain this is the plain ring."""
    n = len(nodes)
    if n <= 0:
        raise ValueError("the cluster has no writable storage nodes (all draining or removed?)")
    r = min(replicas, n)
    order = [nodes[(start + k) % n] for k in range(n)]
    if domains is None:
        return tuple(order[:r])
    groups: dict[str, list[int]] = {}  # domains in the order the ring meets them
    for x in order:
        groups.setdefault(domains[x] if 0 <= x < len(domains) else f"#{x}", []).append(x)
    first: list[int] = []
    for d, members in groups.items():
        if d in taken:
            continue
        # the first copy is the ring's own; later ones take a node of their domain by ``start``
        # too, not its first, or the first node of every domain would hold most second copies
        first.append(members[0] if not first else members[start % len(members)])
        if len(first) == r:
            return tuple(first)
    rest = [x for x in order if x not in first]
    return tuple(first + rest[:r - len(first)])


def chunk_nodes(
    ino: int, parent: int, index: int, n_chunks: int, nodes: int | Sequence[int], replicas: int,
    group: int = 0, domains: Sequence[str] | None = None,
) -> tuple[int, ...]:
    """The storage nodes (primary first) for chunk ``index`` of a file with ``n_chunks`` chunks.

    ``nodes`` are the writable node indices (``Cluster.writable_nodes``), or a count ``n`` for
    nodes ``0..n-1``. One-chunk files follow their parent directory and ``group``, a run of
    neighbouring files written together (an import batch): a run packs back to back on one
    node, and the runs of a big directory spread over all nodes. Chunks of larger files stripe
    over the nodes starting at a per-file offset. ``domains`` (``Cluster.node_domains``) keeps
    a chunk's copies on distinct failure domains where there are enough.
    """
    ring = range(nodes) if isinstance(nodes, int) else nodes
    n = len(ring)
    if n <= 0:
        return _ring(0, ring, replicas)
    if n_chunks <= 1 and index == 0:
        start = _h64(b"dir", parent, group) % n
    else:
        start = (_h64(b"file", ino) + index) % n
    return _ring(start, ring, replicas, domains)


def spread(key: int, nodes: Sequence[int], count: int, exclude: Sequence[int] = (),
           domains: Sequence[str] | None = None, keep: Sequence[int] = ()) -> tuple[int, ...]:
    """``count`` of ``nodes`` not in ``exclude``, round the ring from ``h(key)``: where a healer
    puts the new copies of a chunk (deterministic, so a rescan proposes the same targets).
    With ``domains``, nodes outside the failure domains of the copies that stay (``keep``)
    come first."""
    free = [x for x in nodes if x not in exclude]
    if not free or count <= 0:
        return ()
    start = _h64(b"heal", key) % len(free)
    taken = [domains[x] for x in keep if 0 <= x < len(domains)] if domains is not None else []
    return _ring(start, free, count, domains, taken)


def chunk_span(offset: int, length: int, chunk_size: int) -> range:
    """Indexes of the chunks that bytes ``[offset, offset + length)`` touch."""
    if length <= 0:
        return range(0)
    return range(offset // chunk_size, (offset + length - 1) // chunk_size + 1)


def n_chunks(size: int, chunk_size: int) -> int:
    """How many chunks a file of ``size`` bytes spans."""
    return (size + chunk_size - 1) // chunk_size
