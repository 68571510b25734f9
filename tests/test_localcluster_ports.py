"""The ports a local cluster gives its daemons: never one port to two daemons.

A cluster's ports are all chosen before its daemons start, each free when chosen; drawn at random
from 12,000 ports, two of a cluster's ten would be the same once in a few hundred clusters, and
one daemon would then answer at the other's address (seen as a metrics request answered by a
storage node)."""

from __future__ import annotations

from jpfs import localcluster


def test_ports_handed_out_are_never_handed_out_again_soon():
    ports = [localcluster._free_port() for _ in range(1500)]  # ~94 repeats expected at random
    assert len(set(ports)) == len(ports)
    low = localcluster._ephemeral_low()
    assert all(p < low for p in ports)  # below the range outgoing connections use

