"""The metadata shards' healing methods (ids 80-99), merged into ``jpfs.proto.meta.METHODS``.

Each shard's leader runs a healer (``jpfs_daemon.meta.heal``) over the chunk records it owns:
it restores R live copies of every chunk, moves chunks off draining nodes and rebalances onto
new ones. These methods let clients (``jpfs node list``, ``jpfs cluster status``) and the other
shards see how far it is.

``heal_status()`` -> ``HealStatus.to_wire()``: a map, one key per field (``HEAL_KEYS``).
``heal_kick()`` -> the same, after asking for a round now (a map change does this by itself).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..rpc import Method
from .records import from_map


class HealNoArgs(NamedTuple):
    """``heal_status``, ``heal_kick``: no arguments."""


class HealStatus(NamedTuple):
    """``heal_status``, ``heal_kick``: a shard's healer, its state and the counts of its last
    round (those of the round under way where it has found more). Wire: a map, one key per
    field, in this order (``HEAL_KEYS``); operators read it as JSON."""

    shard: int
    """This shard's index."""
    leader: bool
    """Whether this process heals (followers do not)."""
    enabled: bool
    """False with --heal-rate 0."""
    state: str
    """``"idle"``, ``"scanning"``, ``"copying"``, ``"follower"`` or ``"off"``."""
    rounds: int
    """Full scans of the shard's chunk records completed."""
    round_started: float | None
    """When the current (or last) round began (seconds since the epoch)."""
    round_epoch: int
    """The map epoch at the start of the last completed round (-1: none yet)."""
    last_round: float | None
    """When the last completed round ended, or None."""
    scanned: int
    """Chunk records scanned in the current round so far."""
    chunks: int
    """Chunk records in the last completed round."""
    bytes: int
    """Their blob bytes (one copy each)."""
    under_replicated: int
    """Chunks with fewer than R live copies, as the last round left them."""
    under_bytes: int
    """Their bytes."""
    unrepairable: int
    """Chunks with no readable copy left to copy from (last round)."""
    bad_copies: int
    """Copies the storage nodes marked bad, named by this shard's chunks."""
    node_chunks: dict[int, int]
    """``{node: chunks naming it}`` as the last round left them."""
    to_move: dict[int, int]
    """``{draining node: chunks still naming it}`` as the last round left them."""
    clean_rounds: dict[int, int]
    """``{draining node: consecutive rounds that found no chunk naming it}``."""
    repaired_chunks: int
    """Chunks given back a copy (new copy or bad copy replaced), ever."""
    repaired_bytes: int
    """Bytes copied for them, ever."""
    moved_chunks: int
    """Chunks moved by rebalance or drain, ever."""
    moved_bytes: int
    """Bytes copied for them, ever."""
    copy_failures: int
    """Copies that failed (source down, bad bytes, ...), ever."""
    pending: int
    """Copies queued in the current round."""
    rate_limit: float
    """Bytes/s this shard copies at most."""
    bytes_per_s: float
    """Copy rate of the last round that copied, pacing included."""
    rebalance: dict[str, Any]
    """The last rebalance decision: ``{"mean", "spread", "allowed", "moves", ...}``."""
    error: str | None
    """The last round's failure, or None."""

    @classmethod
    def from_wire(cls, w: dict) -> HealStatus:
        """The status from its map."""
        return from_map(cls, w)

    def to_wire(self) -> dict:
        """The map the shard sends."""
        return self._asdict()

    def as_dict(self) -> dict:
        """The status as JSON reports print it (the wire's map)."""
        return self._asdict()


HEAL_KEYS = HealStatus._fields
"""The keys of a ``heal_status`` answer, in order."""

HEAL_STATUS = Method(80, "heal_status", HealNoArgs, HealStatus, idempotent=True)
HEAL_KICK = Method(81, "heal_kick", HealNoArgs, HealStatus, idempotent=True)

HEAL_METHODS = (HEAL_STATUS, HEAL_KICK)
"""What ``jpfs.proto.meta`` adds to its method table."""
