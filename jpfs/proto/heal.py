"""The metadata shards' healing methods (ids 80-99), merged into ``jpfs.proto.meta.METHODS``.

Each shard's leader runs a healer (``jpfs_daemon.meta.heal``) over the chunk records it owns:
it restores R live copies of every chunk, moves chunks off draining nodes and rebalances onto
new ones. These methods let clients (``jpfs node list``, ``jpfs cluster status``) and the other
shards see how far it is.

``heal_status()`` -> a map, ``HEAL_KEYS`` below.
``heal_kick()`` -> the same, after asking for a round now (a map change does this by itself).
"""

from __future__ import annotations

from typing import NamedTuple

from ..rpc import Method


class HealNoArgs(NamedTuple):
    """``heal_status``, ``heal_kick``: no arguments."""


HEAL_STATUS = Method(80, "heal_status", HealNoArgs, dict, idempotent=True)
HEAL_KICK = Method(81, "heal_kick", HealNoArgs, dict, idempotent=True)

HEAL_METHODS = (HEAL_STATUS, HEAL_KICK)
"""What ``jpfs.proto.meta`` adds to its method table."""

HEAL_KEYS = (
    "shard",              # this shard's index
    "leader",             # whether this process heals (followers do not)
    "enabled",            # False with --heal-rate 0
    "state",              # "idle", "scanning", "copying", "follower" or "off"
    "rounds",             # full scans of the shard's chunk records completed
    "round_started",      # when the current (or last) round began (seconds since the epoch)
    "round_epoch",        # the map epoch at the start of the last completed round
    "last_round",         # when the last completed round ended, or None
    "scanned",            # chunk records scanned in the current round so far
    "chunks",             # chunk records in the last completed round
    "bytes",              # their blob bytes (one copy each)
    "under_replicated",   # chunks with fewer than R live copies, as the last round left them
    "under_bytes",        # their bytes
    "unrepairable",       # chunks with no readable copy left to copy from (last round)
    "bad_copies",         # copies the storage nodes marked bad, named by this shard's chunks
    "node_chunks",        # {node: chunks naming it} as the last round left them
    "to_move",            # {draining node: chunks still naming it} as the last round left them
    "clean_rounds",       # {draining node: consecutive rounds that found no chunk naming it}
    "repaired_chunks",    # chunks given back a copy (new copy or bad copy replaced), ever
    "repaired_bytes",     # bytes copied for them, ever
    "moved_chunks",       # chunks moved by rebalance or drain, ever
    "moved_bytes",        # bytes copied for them, ever
    "copy_failures",      # copies that failed (source down, bad bytes, ...), ever
    "pending",            # copies queued in the current round
    "rate_limit",         # bytes/s this shard copies at most
    "bytes_per_s",        # copy rate of the last round that copied, pacing included
    "rebalance",          # the last rebalance decision: {"mean", "spread", "from", "to", ...}
    "error",              # the last round's failure, or None
)
