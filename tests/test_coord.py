"""The etcd client and the cluster map, against a real etcd process."""

from __future__ import annotations

import dataclasses
import json

import pytest
import trio

from jpfs import config, localcluster
from jpfs.coord import clustermap
from jpfs.coord.etcd import Etcd, EtcdError

pytestmark = pytest.mark.skipif(localcluster.shutil.which("etcd") is None,
                                reason="etcd is not installed (apt install etcd-server)")


@pytest.fixture(scope="module")
def etcd_url(tmp_path_factory):
    d = tmp_path_factory.mktemp("etcd")
    url = localcluster.start_etcd(d)
    yield url
    localcluster.stop(d, "etcd", 0)


def _base(url: str, name: str) -> config.Cluster:
    nodes = tuple(config.Server(f"127.0.0.1:{7400 + i}", f"storage-{i}") for i in range(2))
    shard = (config.Server("127.0.0.1:7301", "meta-0"), config.Server("127.0.0.1:7302", "m"))
    return config.Cluster(meta=(shard[0],), meta_replicas=(shard,), storage=nodes,
                          secret=b"s", name=name, etcd=(url,), replicas=2)


async def test_keys_compare_and_swap_and_leases(etcd_url):
    async with Etcd([etcd_url]) as etcd:
        assert await etcd.get("/t/none") is None
        rev = await etcd.put("/t/a", b"1")
        kv = await etcd.get("/t/a")
        assert kv is not None and kv.value == b"1" and kv.mod_revision == rev
        assert not await etcd.put_if("/t/a", b"2", mod_revision=0)  # exists: create-only fails
        assert not await etcd.put_if("/t/a", b"2", mod_revision=rev - 1)
        assert await etcd.put_if("/t/a", b"2", mod_revision=rev)
        assert await etcd.put_if("/t/b", b"x", mod_revision=0)
        assert sorted(k.key for k in await etcd.get_prefix("/t/")) == [b"/t/a", b"/t/b"]
        lease = await etcd.grant(5)
        assert await etcd.put_if("/t/leader", b"me", mod_revision=0, lease=lease)
        assert 0 < await etcd.keepalive(lease) <= 5
        await etcd.revoke(lease)
        assert await etcd.get("/t/leader") is None  # revoking the lease deletes its keys
        assert await etcd.keepalive(lease) == 0.0


async def test_unreachable_etcd_is_a_clear_error():
    async with Etcd(["http://127.0.0.1:1"], timeout=0.5) as etcd:
        with pytest.raises(EtcdError, match="etcd did not answer at http://127.0.0.1:1"):
            await etcd.get("/x")


async def test_map_updates_reach_followers_in_order(etcd_url):
    base = _base(etcd_url, "follow")
    async with Etcd([etcd_url]) as etcd:
        first = await clustermap.create_map(etcd, base)
        assert first.epoch > 0 and first.meta_replicas == base.meta_replicas
        follower = clustermap.MapFollower(first)
        seen: list[config.Cluster] = []
        follower.subscribe(seen.append)
        async with trio.open_nursery() as nursery:
            await follower.start(nursery)

            def add_node(c: config.Cluster) -> config.Cluster:
                return dataclasses.replace(c, storage=c.storage + (config.Server("127.0.0.1:9"),))

            def drain(c: config.Cluster) -> config.Cluster:
                nodes = list(c.storage)
                nodes[0] = dataclasses.replace(nodes[0], state="draining")
                return dataclasses.replace(c, storage=tuple(nodes))

            second = await clustermap.update_map(etcd, first, add_node)
            third = await clustermap.update_map(etcd, first, drain)
            with trio.fail_after(10):
                while follower.cluster.epoch < third.epoch:
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
    assert [c.epoch for c in seen] == [second.epoch, third.epoch]
    assert follower.cluster.n_nodes == 3 and follower.cluster.writable_nodes == (1, 2)


async def test_update_map_survives_a_concurrent_change(etcd_url):
    base = _base(etcd_url, "race")
    async with Etcd([etcd_url]) as etcd:
        await clustermap.create_map(etcd, base)

        async def add(port: int) -> None:
            await clustermap.update_map(etcd, base, lambda c: dataclasses.replace(
                c, storage=c.storage + (config.Server(f"127.0.0.1:{port}"),)))

        async with trio.open_nursery() as nursery:
            for port in range(9000, 9008):
                nursery.start_soon(add, port)
        final = await clustermap.read_map(etcd, base)
    assert sorted(s.address for s in final.storage[2:]) == [f"127.0.0.1:{p}"
                                                             for p in range(9000, 9008)]


def test_a_cluster_file_that_names_etcd_loads_the_map(etcd_url, tmp_path):
    base = _base(etcd_url, "fromfile")
    clustermap.update_map_sync(base, lambda current: current or base)
    (tmp_path / "secret").write_text("s\n")
    path = tmp_path / "cluster.toml"
    config.write(dataclasses.replace(base, path=path), path)
    assert "[[meta]]" not in path.read_text()
    loaded = config.load(path)
    assert loaded.secret == b"s" and loaded.meta_replicas == base.meta_replicas
    assert loaded.storage == base.storage and loaded.epoch > 0 and loaded.replicas == 2
    doc = json.loads(json.dumps(config.map_document(loaded)))
    assert config.from_map(doc, loaded, loaded.epoch) == loaded


def test_a_missing_map_or_etcd_names_the_fix(etcd_url, tmp_path):
    (tmp_path / "secret").write_text("s\n")
    path = tmp_path / "cluster.toml"
    path.write_text(f'[cluster]\nname = "nomap"\netcd = ["{etcd_url}"]\n')
    with pytest.raises(ValueError, match="has no map for cluster 'nomap'"):
        config.load(path)
    path.write_text('[cluster]\nname = "x"\netcd = ["http://127.0.0.1:1"]\n')
    with pytest.raises(ValueError, match="cannot read the cluster map from etcd"):
        config.load(path)
    path.write_text(f'[cluster]\netcd = ["{etcd_url}"]\n[[meta]]\naddress = "127.0.0.1:1"\n')
    with pytest.raises(ValueError, match="do not mix"):
        config.load(path)


def test_a_map_not_signed_with_the_secret_is_refused(etcd_url, tmp_path):
    base = _base(etcd_url, "signed")
    clustermap.update_map_sync(base, lambda current: current or base)
    (tmp_path / "secret").write_text("another secret\n")
    path = tmp_path / "cluster.toml"
    config.write(dataclasses.replace(base, path=path), path)
    with pytest.raises(ValueError, match="not signed with this cluster's secret"):
        config.load(path)
    forged = config.map_document(dataclasses.replace(base, secret=b""))  # no mac at all
    with pytest.raises(ValueError, match="not signed"):
        config.from_map(forged, base, 1)
