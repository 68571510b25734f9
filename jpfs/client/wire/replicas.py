"""Which replicas a storage client reads first and where its writes go, for one cluster map.

``jpfs.placement`` says where a chunk's copies *should* live; this module says, for a client
that follows the map, which of a chunk's recorded nodes to try in which order (active ones that
are up first, from the client's own first copy), which writable nodes replace a preferred one
that is down, draining or removed, and how one node's share of a call is cut into requests.
It is kept apart from ``storage.py`` (the calls themselves) because it is pure: no sockets,
no trio, so it reads and tests on its own. A ``ReplicaView`` is immutable: a client that
follows a new map builds a new one.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...config import Cluster

ACTIVE, DRAINING, REMOVED = "active", "draining", "removed"


def node_states(cluster: Cluster) -> tuple[str, ...]:
    """Each storage node's state in ``cluster``'s map."""
    return tuple(s.state for s in cluster.storage)


def writable_nodes(cluster: Cluster) -> tuple[int, ...]:
    """The indices of ``cluster``'s active storage nodes, where new writes go."""
    return tuple(cluster.writable_nodes)


class ReplicaView:
    """The storage nodes of one cluster map as one client orders them.

    Args:
        cluster: the map (node states, failure domains, replicas).
        first_copy: which of a chunk's live copies this client reads first, counted round the
            copies (``StorageClient``'s argument of that name).
    """

    __slots__ = ("demoted", "domains", "first_copy", "n_nodes", "replicas", "states",
                 "writable")

    def __init__(self, cluster: Cluster, first_copy: int):
        self.first_copy = first_copy
        self.n_nodes: int = cluster.n_nodes
        self.states: tuple[str, ...] = node_states(cluster)
        self.writable: tuple[int, ...] = writable_nodes(cluster)
        """Active nodes, where new blobs go (``placement.chunk_nodes`` takes this list)."""
        self.domains: tuple[str, ...] = cluster.node_domains
        """Each node's failure domain (copies of a chunk go to distinct ones)."""
        self.replicas: int = cluster.replicas
        self.demoted = frozenset(i for i, st in enumerate(self.states) if st != ACTIVE)
        """Nodes that are not active (read after the active ones)."""

    def state(self, node: int) -> str:
        """``node``'s state in this map (REMOVED for a node it does not name)."""
        return self.states[node] if 0 <= node < len(self.states) else REMOVED

    def order(self, nodes: Sequence[int], down: frozenset[int]) -> Sequence[int]:
        """Replicas to try: active ones that are up first (from this client's ``first_copy``
        round the recorded order), then draining ones, then those known to be down, and
        removed nodes last of all."""
        demoted = self.demoted
        if len(nodes) == 1:
            return nodes
        if not down and not demoted and len(nodes) == 2 and nodes[0] != nodes[1]:
            return nodes if not self.first_copy & 1 else (nodes[1], nodes[0])
        seen = list(dict.fromkeys(nodes))
        k = self.first_copy % len(seen)
        seen = seen[k:] + seen[:k]
        if not down and not demoted:
            return seen
        states = self.states

        def rank(n: int) -> int:
            st = states[n] if 0 <= n < len(states) else REMOVED
            if st == REMOVED:
                return 4
            return (2 if n in down else 0) + (st != ACTIVE)

        return sorted(seen, key=rank)  # stable: recorded order within a rank

    def ring(self, nodes: Sequence[int]) -> list[int]:
        """The preferred writable nodes, then the other writable ones round the ring after
        the last preferred one."""
        ring = self.writable
        ok = frozenset(ring)
        pref = [x for x in dict.fromkeys(nodes) if x in ok]
        last = nodes[-1] if nodes else 0
        start = next((k for k, x in enumerate(ring) if x > last), 0)
        rest = [ring[(start + k) % len(ring)] for k in range(len(ring))]
        return pref + [x for x in rest if x not in pref]

    def apart(self, cands: list[int], need: int, stored: list[int]) -> list[int]:
        """``need`` of ``cands`` (in order), those of failure domains no copy is on yet first:
        a replacement for a preferred node that is down stays out of the other copies'
        domains where it can."""
        doms = self.domains

        def dom(x: int) -> str:
            return doms[x] if 0 <= x < len(doms) else f"#{x}"

        taken = {dom(x) for x in stored}
        picks: list[int] = []
        for x in cands:
            if len(picks) == need:
                return picks
            if dom(x) not in taken:
                taken.add(dom(x))
                picks.append(x)
        return picks + [x for x in cands if x not in picks][:need - len(picks)]


def batches(items: list[int], sizes: Sequence[int], max_bytes: int,
            max_blobs: int) -> list[list[int]]:
    """``items`` (indexes into ``sizes``) cut, in order, into requests of at most
    ``max_bytes`` bytes (a single larger item goes alone) and ``max_blobs`` items."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i in items:
        if cur and (size + sizes[i] > max_bytes or len(cur) >= max_blobs):
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += sizes[i]
    if cur:
        out.append(cur)
    return out
