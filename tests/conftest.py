"""Shared fixtures: real JPFS clusters of daemon processes on loopback ports."""

from __future__ import annotations

import importlib.util
import re

import pytest

from jpfs import localcluster

# A test module that imports torch (or jpfs.torch) at its top level is skipped, with this reason,
# on an interpreter without torch: CI's Python 3.12 run has no torch build on local disk.
HAS_TORCH = importlib.util.find_spec("torch") is not None
_IMPORTS_TORCH = re.compile(r"^(?:import|from) (?:torch|jpfs\.torch)\b", re.M)


class _NeedsTorch(pytest.Module):
    def collect(self):
        pytest.skip("needs torch (pip install -e '.[torch]'); this interpreter has none",
                    allow_module_level=True)


def pytest_pycollect_makemodule(module_path, parent):
    if not HAS_TORCH and _IMPORTS_TORCH.search(module_path.read_text()):
        return _NeedsTorch.from_parent(parent, path=module_path)
    return None


@pytest.fixture
def make_cluster(tmp_path_factory):
    """Start clusters of real daemons; all are stopped at teardown.

    ``make_cluster(meta_shards=3, storage_nodes=0, **options)`` returns the cluster directory.
    ``sync=False`` by default: kill -9 loses nothing without fsync (the page cache survives a
    process); the fsync path is exercised where a test asks for it.
    """
    made = []

    def make(meta_shards: int = 3, storage_nodes: int = 0, *, sync: bool = False, **options):
        d = tmp_path_factory.mktemp("cluster")
        localcluster.up(d, meta_shards=meta_shards, storage_nodes=storage_nodes, sync=sync,
                        **options)
        made.append(d)
        return d

    yield make
    for d in made:
        localcluster.down(d, timeout=5)


@pytest.fixture(scope="module")
def meta_cluster(tmp_path_factory):
    """One 3-shard metadata cluster shared by a module's tests (each works in its own dir)."""
    d = tmp_path_factory.mktemp("meta")
    localcluster.up(d, meta_shards=3, storage_nodes=0, sync=False)
    yield d
    localcluster.down(d, timeout=5)


@pytest.fixture(scope="module")
def client(meta_cluster):
    import jpfs

    c = jpfs.connect(meta_cluster, dir_cache_ttl=0)
    yield c
    c.close()
