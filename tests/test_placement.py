"""Placement: pure functions, checked over many files and seeds (no daemons)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from jpfs import config
from jpfs.placement import chunk_nodes, spread


def _hosts(n_hosts: int, per_host: int) -> tuple[str, ...]:
    """Failure domains of ``n_hosts * per_host`` daemons numbered host by host (8 daemons of a
    machine get consecutive indices: the case that put every copy on one host)."""
    return tuple(f"10.0.0.{i // per_host}" for i in range(n_hosts * per_host))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("replicas", [2, 3])
def test_copies_land_on_distinct_hosts_when_there_are_enough(seed, replicas):
    domains = _hosts(8, 8)
    nodes = list(range(len(domains)))
    rng = random.Random(seed)
    for _ in range(2000):
        ino, parent = rng.getrandbits(48), rng.getrandbits(48)
        n = rng.choice([1, 1, 1, 5])
        for index in range(n):
            got = chunk_nodes(ino, parent, index, n, nodes, replicas, rng.randrange(9), domains)
            assert len(set(got)) == replicas
            assert len({domains[x] for x in got}) == replicas, got


def test_without_domains_or_with_one_the_ring_is_unchanged():
    nodes = list(range(6))
    rng = random.Random(7)
    for _ in range(500):
        ino, parent = rng.getrandbits(48), rng.getrandbits(48)
        plain = chunk_nodes(ino, parent, 0, 1, nodes, 3)
        assert chunk_nodes(ino, parent, 0, 1, nodes, 3, 0, ("127.0.0.1",) * 6) == plain
        start = nodes.index(plain[0])
        assert plain == tuple(nodes[(start + k) % 6] for k in range(3))


def test_fewer_hosts_than_copies_uses_every_host_then_fills():
    domains = ("a", "a", "a", "b", "b", "b")
    for ino in range(300):
        got = chunk_nodes(ino, 1, 0, 4, list(range(6)), 3, 0, domains)
        assert len(set(got)) == 3 and {domains[x] for x in got} == {"a", "b"}


def test_a_directory_run_still_packs_together():
    domains = _hosts(4, 4)
    nodes = list(range(16))
    runs = {chunk_nodes(ino, 42, 0, 1, nodes, 2, 3, domains) for ino in range(100)}
    assert len(runs) == 1  # one-chunk files of a run: the same nodes, whatever their inode


def test_spread_avoids_the_hosts_of_the_copies_that_stay():
    domains = _hosts(4, 4)
    writable = list(range(16))
    for key in range(500):
        keep = [key % 16]
        got = spread(key, writable, 2, exclude=keep, domains=domains, keep=keep)
        assert len({domains[x] for x in (*keep, *got)}) == 3


@pytest.mark.parametrize("seed", range(3))
def test_load_stays_even_across_nodes(seed):
    domains = _hosts(4, 4)
    rng = random.Random(seed)
    load: Counter[int] = Counter()
    for _ in range(20000):
        for x in chunk_nodes(rng.getrandbits(48), rng.getrandbits(48), 0, 2, list(range(16)), 3,
                             0, domains):
            load[x] += 1
    mean = sum(load.values()) / 16
    assert max(load.values()) < 1.25 * mean and min(load.values()) > 0.75 * mean


def test_the_map_carries_a_domain_and_defaults_to_the_host():
    a = config.Server("10.1.2.3:7401")
    b = config.Server("10.1.2.4:7401", domain="rack-7")
    c = config.Cluster(meta=(config.Server("10.0.0.1:7301"),), storage=(a, b), secret=b"s")
    assert c.node_domains == ("10.1.2.3", "rack-7")
    assert config.from_map(config.map_document(c), c, 1).node_domains == c.node_domains
