"""Real storage daemons on loopback, for tests (until ``jpfs cluster up`` replaces this).

``StorageCluster(root, n, replicas)`` writes ``root/cluster.toml`` (with a dummy [[meta]] entry:
the storage tests need no metadata server) and starts, kills and restarts ``jpfs-storage``
processes (``python -m jpfs_daemon.storage.server``). The ``storage_cluster`` fixture makes them
and stops them all in teardown; import it into a test module to use it.

Run as a script, this file is also the worker of the multi-process test (see ``worker``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jpfs import config

HOST = "127.0.0.1"


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int) -> list[int]:
    """Ports that were free a moment ago, below the ephemeral range.

    A port from the ephemeral range (what binding port 0 gives) can be taken as the source port
    of any outgoing connection on the machine while its daemon is down, and the daemon then
    cannot bind it again on restart.
    """
    lo, hi = _ephemeral_range()
    pool = range(10000, lo) if lo > 12000 else range(hi + 1, 65535)
    ports: list[int] = []
    for port in random.sample(pool, min(len(pool), 200)):
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError("no free ports")


class StorageCluster:
    """A cluster file plus ``n`` storage daemon processes on loopback."""

    def __init__(
        self,
        root: Path,
        n: int = 3,
        replicas: int = 2,
        *,
        chunk_size: int = config.DEFAULT_CHUNK_SIZE,
        args: tuple[str, ...] = (),
    ):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.path = self.root / "cluster.toml"
        config.new_secret(self.root / "secret")
        ports = free_ports(n + 1)
        cluster = config.Cluster(
            meta=(config.Server(f"{HOST}:{ports[-1]}", "meta-0"),),
            storage=tuple(config.Server(f"{HOST}:{p}", f"storage-{i}")
                          for i, p in enumerate(ports[:n])),
            replicas=replicas,
            chunk_size=chunk_size,
        )
        config.write(cluster, self.path)
        self.cluster = config.load(self.path)
        self.args = tuple(args)
        self.procs: list[subprocess.Popen | None] = [None] * n

    @property
    def n(self) -> int:
        return len(self.procs)

    def data_dir(self, i: int) -> Path:
        return self.cluster.data_dir("storage", i)

    def log_path(self, i: int) -> Path:
        return self.root / f"storage-{i}.log"

    def log(self, i: int) -> str:
        p = self.log_path(i)
        return p.read_text() if p.exists() else ""

    def start(self, i: int, *, env: dict[str, str] | None = None, args: tuple[str, ...] = (),
              wait: bool = True) -> subprocess.Popen:
        """Start daemon ``i`` (with extra ``env`` and ``args``) and wait until it accepts."""
        if self.procs[i] is not None and self.procs[i].poll() is None:
            raise RuntimeError(f"storage daemon {i} is already running")
        cmd = [sys.executable, "-m", "jpfs_daemon.storage.server", "--cluster", str(self.path),
               "--index", str(i), "--log-file", str(self.log_path(i)), *self.args, *args]
        proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.procs[i] = proc
        if wait:
            self.wait_ready(i)
        return proc

    def start_all(self) -> None:
        for i in range(self.n):
            self.start(i, wait=False)
        for i in range(self.n):
            self.wait_ready(i)

    def wait_ready(self, i: int, timeout: float = 20.0) -> None:
        """Block until daemon ``i`` accepts connections (or fail with its log)."""
        host, port = self.cluster.storage[i].host_port
        proc = self.procs[i]
        give_up = time.monotonic() + timeout
        while True:
            if proc is not None and proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"storage daemon {i} exited with {proc.returncode}:\n"
                                   f"{err}\n{self.log(i)}")
            try:
                socket.create_connection((host, port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > give_up:
                    raise TimeoutError(
                        f"storage daemon {i} did not start:\n{self.log(i)}") from None
                time.sleep(0.02)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to daemon ``i`` and wait for it to exit; its exit code."""
        proc = self.procs[i]
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            rc = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        if proc.stderr:
            proc.stderr.close()
        self.procs[i] = None
        return rc

    def wait_exit(self, i: int, timeout: float = 15.0) -> int:
        """Wait for daemon ``i`` to exit on its own (a crash hook); its exit code."""
        proc = self.procs[i]
        assert proc is not None
        rc = proc.wait(timeout=timeout)
        if proc.stderr:
            proc.stderr.close()
        self.procs[i] = None
        return rc

    def stop(self, i: int) -> int:
        return self.kill(i, signal.SIGTERM)

    def stop_all(self) -> None:
        for i in range(self.n):
            self.stop(i)


@pytest.fixture
def storage_cluster(tmp_path):
    """A factory: ``storage_cluster(n=3, replicas=2, args=(...))`` -> a started StorageCluster."""
    made: list[StorageCluster] = []

    def make(n: int = 3, replicas: int = 2, **kw) -> StorageCluster:
        sc = StorageCluster(tmp_path / f"cluster{len(made)}", n, replicas, **kw)
        made.append(sc)
        sc.start_all()
        return sc

    yield make
    for sc in made:
        sc.stop_all()


# ---------------------------------------------------------------------- deterministic test data


def blob_data(blob: bytes, size: int) -> bytes:
    """The bytes a test stores under ``blob``: derived from the id, so any mix-up shows."""
    return random.Random(blob).randbytes(size)


# ---------------------------------------------------------------------- multi-process worker


async def _worker(cluster_path: str, seed: int, count: int) -> list:
    import trio

    from jpfs.client.wire.storage import StorageClient
    from jpfs.placement import chunk_nodes

    cluster = config.load(cluster_path)
    rng = random.Random(seed)
    written: list = []
    async with trio.open_nursery() as nursery:
        client = StorageClient(nursery, cluster)

        async def writer(k: int) -> None:
            left = count // 4
            while left > 0:
                batch = []
                for _ in range(min(left, rng.randint(1, 40))):
                    bid = os.urandom(16)
                    size = rng.choice((0, 1, 100, 4096, 65536, 200_000))
                    nodes = chunk_nodes(rng.randint(1, 1 << 40), rng.randint(1, 50), 0, 1,
                                        cluster.n_nodes, cluster.replicas)
                    batch.append((bid, nodes, blob_data(bid, size)))
                res = await client.put(batch)
                for (bid, _, data), (nodes, xxh) in zip(batch, res, strict=True):
                    written.append([bid.hex(), list(nodes), len(data), xxh])
                left -= len(batch)
                await reader()

        async def reader() -> None:
            from jpfs.types import Chunk
            sample = rng.sample(written, min(len(written), 30))
            chunks = [Chunk(0, bytes.fromhex(h), tuple(n), size, size, xxh)
                      for h, n, size, xxh in sample]
            got = await client.get(chunks)
            for c, view in zip(chunks, got, strict=True):
                if bytes(view) != blob_data(c.blob, c.blob_len):
                    raise AssertionError(f"worker {seed}: blob {c.blob.hex()} came back wrong")

        async with trio.open_nursery() as inner:
            for k in range(4):
                inner.start_soon(writer, k)
        client.close()
    return written


def worker(cluster_path: str, seed: int, count: int) -> None:
    """Write ``count`` blobs with several tasks while reading back random earlier ones; print
    what was written as JSON lines of [id hex, nodes, size, xxh]."""
    import trio

    written = trio.run(_worker, cluster_path, seed, count)
    json.dump(written, sys.stdout)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        raise SystemExit("usage: storage_cluster.py worker CLUSTER SEED COUNT")
