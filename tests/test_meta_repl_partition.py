"""A network partition on simulated hosts (bench/netns.py: a namespace per host, `ip link set
down` cuts one off): a shard leader cut off from the majority stops acknowledging, the other
side elects a new leader and goes on, and once the link is back the old leader resyncs and
no acknowledged write is lost."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import repl_support as rs
import trio
from jpfs_bench import netns
from jpfs_bench.harness import free_port

from jpfs import config
from jpfs.client.wire.meta import MetaClient
from jpfs.coord import clustermap
from jpfs.errors import JPFSError
from jpfs.proto import replica as R

pytestmark = [
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed"),
    pytest.mark.skipif(netns.unavailable() is not None,
                       reason=f"simulated hosts: {netns.unavailable()}"),
    pytest.mark.slow,
]

COPIES = 3
PORT = 7360

# A client inside the cut-off host's namespace: it can still reach the old leader there.
INSIDE = r"""
import sys, json, os, time, trio
from jpfs.rpc import Pool
from jpfs.proto import meta as P, replica as R
from jpfs.errors import JPFSError
address, secret, parent = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3])
async def main():
    async with trio.open_nursery() as n:
        pool = Pool(n, [address], secret, role="meta", retry_for=0.0)
        out = {}
        try:
            await pool.call(0, P.CREATE, P.CreateReq(parent, b"cut-off", 0o644, 0, 0, True,
                            time.time_ns().to_bytes(8, "big") + os.urandom(8)), timeout=6.0)
            out["create"] = "acknowledged"
        except JPFSError as e:
            out["create"] = e.strerror
        out["status"] = R.REPL_STATUS.decode(await pool.call(
            0, R.REPL_STATUS, R.StatusReq(0), timeout=2.0)).as_dict()
        pool.close()
        n.cancel_scope.cancel()
    print(json.dumps(out))
trio.run(main)
"""


def _start_etcd(d: Path, host: str) -> tuple[subprocess.Popen, str]:
    client, peer = free_port(host), free_port()
    url, peer_url = f"http://{host}:{client}", f"http://127.0.0.1:{peer}"
    out = open(d / "etcd.log", "ab")  # noqa: SIM115 - the child's output
    proc = subprocess.Popen(
        ["etcd", "--name", "p", "--data-dir", str(d / "etcd"), "--listen-client-urls", url,
         "--advertise-client-urls", url, "--listen-peer-urls", peer_url,
         "--initial-advertise-peer-urls", peer_url, "--initial-cluster", f"p={peer_url}"],
        stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True)
    out.close()
    return proc, url


def _cluster(d: Path, hosts: netns.SimHosts, etcd_url: str) -> config.Cluster:
    config.new_secret(d / "secret")
    copies = tuple(config.Server(hosts.client_address(j, PORT + j), f"meta-0-r{j}")
                   for j in range(COPIES))
    cluster = config.Cluster(meta=(copies[0],), meta_replicas=(copies,), etcd=(etcd_url,),
                             path=d / "cluster.toml")
    secret = (d / "secret").read_bytes().strip()
    deadline = time.monotonic() + 30
    while True:
        try:
            clustermap.update_map_sync(dataclasses.replace(cluster, secret=secret),
                                       lambda current: current or cluster)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    config.write(cluster, d / "cluster.toml")
    return config.load(d / "cluster.toml")


def _start_copies(d: Path, hosts: netns.SimHosts) -> list[subprocess.Popen]:
    procs = []
    for j in range(COPIES):
        cmd = ["ip", "netns", "exec", hosts.hosts[j].ns, sys.executable, "-m",
               "jpfs_daemon.meta.main", "--cluster", str(d / "cluster.toml"), "--index", "0",
               "--replica", str(j), "--listen", hosts.listen_address(j, PORT + j),
               "--log-file", str(d / f"meta-0-r{j}.log"), "--no-sync"]
        with open(d / f"meta-0-r{j}.out", "ab") as out:
            procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=out, start_new_session=True))
    for j, proc in enumerate(procs):
        host, port = config.parse_address(hosts.listen_address(j, PORT + j))
        netns.wait_port(host, port, proc, 30.0)
    hosts.start_relays([(j, PORT + j) for j in range(COPIES)], d)
    return procs


async def _statuses(meta: MetaClient) -> list[R.ReplStatus | None]:
    pool = meta.pool.pools[0]  # type: ignore[union-attr]
    out: list[R.ReplStatus | None] = []
    for j in range(COPIES):
        try:
            out.append(await rs.repl_status(pool, j, 0, timeout=1.0))
        except JPFSError:
            out.append(None)
    return out


async def _leader(meta: MetaClient, exclude: int | None = None) -> int:
    with trio.fail_after(30):
        while True:
            for s in await _statuses(meta):
                if s and s.role == "leader" and s.replica != exclude:
                    return s.replica
            await trio.sleep(0.1)


def test_a_leader_cut_off_from_the_majority_stops_acknowledging(tmp_path):
    with netns.SimHosts(COPIES) as hosts:
        etcd, url = _start_etcd(tmp_path, hosts.hosts[0].outer)
        procs: list[subprocess.Popen] = []
        try:
            cluster = _cluster(tmp_path, hosts, url)
            procs = _start_copies(tmp_path, hosts)
            trio.run(_scenario, tmp_path, hosts, cluster)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
            etcd.terminate()
            etcd.wait(timeout=10)


async def _scenario(d: Path, hosts: netns.SimHosts, cluster: config.Cluster) -> None:
    async with trio.open_nursery() as nursery:
        meta = MetaClient(nursery, cluster, attempt_timeout=3.0)
        old = await _leader(meta)
        top = (await meta.mkdir(1, b"d")).attr
        acked = []
        for i in range(20):
            await meta.create(top.ino, f"before-{i}".encode(), 0o644)
            acked.append(f"before-{i}")
        veth = hosts.hosts[old].veth
        subprocess.run(["ip", "link", "set", veth, "down"], check=True)
        try:
            inside = await trio.to_thread.run_sync(lambda: subprocess.run(
                ["ip", "netns", "exec", hosts.hosts[old].ns, sys.executable, "-c", INSIDE,
                 hosts.listen_address(old, PORT + old), cluster.secret.decode(),
                 str(top.ino)], capture_output=True, text=True, timeout=60))
            assert inside.returncode == 0, inside.stderr
            seen = json.loads(inside.stdout)
            assert seen["create"] != "acknowledged"  # no majority: never answered as done
            new = await _leader(meta, exclude=old)
            for i in range(20):
                await meta.create(top.ino, f"during-{i}".encode(), 0o644)
                acked.append(f"during-{i}")
            # the cut-off copy has stopped leading (asked again from inside its host)
            inside = await trio.to_thread.run_sync(lambda: subprocess.run(
                ["ip", "netns", "exec", hosts.hosts[old].ns, sys.executable, "-c", INSIDE,
                 hosts.listen_address(old, PORT + old), cluster.secret.decode(),
                 str(top.ino)], capture_output=True, text=True, timeout=60))
            seen = json.loads(inside.stdout)
            assert seen["status"]["role"] == "follower", seen
            assert "not the leader" in seen["create"], seen
        finally:
            subprocess.run(["ip", "link", "set", veth, "up"], check=True)
        with trio.fail_after(60):
            while True:
                got = await _statuses(meta)
                if all(got) and len({(s.term, s.seq) for s in got if s}) == 1:
                    break
                await trio.sleep(0.2)
        assert new != old
        names = [e.name.decode() async for e in meta.readdir(top.ino, plus=False)]
        assert sorted(names) == sorted(acked)
        meta.close()
        nursery.cancel_scope.cancel()
