"""A whole JPFS cluster of real daemon processes on loopback, in one directory.

``up(DIR)`` writes ``DIR/cluster.toml`` and a secret on first use, then starts every daemon that is
not running (``python -m jpfs_daemon.meta.server ...``): data in ``DIR/meta-<i>`` and
``DIR/storage-<i>``, logs in ``DIR/logs``, pid files ``DIR/<role>-<i>.pid``. A later ``up`` on the
same directory restarts stopped daemons on their data (on their old ports when those are free).
This is what ``jpfs cluster up``, the tests and the benchmarks use.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import config

MODULES = {"meta": "jpfs_daemon.meta.server", "storage": "jpfs_daemon.storage.server"}
DEFAULT_META_SHARDS = 2
DEFAULT_STORAGE_NODES = 2
START_TIMEOUT = 30.0
EXIT_ADDRESS_IN_USE = 98  # what a daemon exits with when its port is taken


@dataclass(frozen=True)
class Daemon:
    """One daemon of a local cluster as ``status`` finds it."""

    role: str
    index: int
    address: str
    pid: int | None
    alive: bool

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_port(host: str = "127.0.0.1") -> int:
    """A free port *below* the ephemeral range: a port the kernel hands out for outgoing
    connections could be taken by one while its daemon is down, and a restart would then fail
    to bind its own address."""
    low = max(1025, _ephemeral_low() - 12000)
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, _ephemeral_low())
        with socket.socket() as s:
            try:
                s.bind((host, port))
                return port
            except OSError:
                continue
    with socket.socket() as s:  # crowded machine: let the kernel choose
        s.bind((host, 0))
        return s.getsockname()[1]


def _read_pid(path: Path) -> int | None:
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    # a zombie child of ours still "exists": treat as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return None
    except OSError:
        pass
    return pid


def cluster_file(directory: str | os.PathLike) -> Path:
    """The cluster file of a local cluster directory."""
    return Path(directory) / "cluster.toml"


def up(
    directory: str | os.PathLike,
    *,
    meta_shards: int | None = None,
    storage_nodes: int | None = None,
    replicas: int | None = None,
    chunk_size: int | None = None,
    sync: bool = True,
    metrics: bool = False,
    extra_args: dict[str, list[str]] | None = None,
    env: dict[str, str] | None = None,
) -> config.Cluster:
    """Create (first time) and start the cluster in ``directory``; returns its config.

    ``metrics``: give every daemon a Prometheus port, recorded in the cluster file."""
    d = Path(directory).resolve()
    (d / "logs").mkdir(parents=True, exist_ok=True)
    path = cluster_file(d)
    if path.exists():
        cluster = config.load(path)
        for what, asked, have in (("meta shards", meta_shards, cluster.n_shards),
                                  ("storage nodes", storage_nodes, cluster.n_nodes),
                                  ("replicas", replicas, cluster.replicas),
                                  ("chunk size", chunk_size, cluster.chunk_size)):
            if asked is not None and asked != have:
                raise ValueError(f"{path} already has {have} {what}; cannot change it to {asked} "
                                 "(start a new cluster in another directory)")
        if metrics and not all(s.metrics for s in cluster.meta + cluster.storage):
            raise ValueError(f"{path} was created without metrics ports: add `metrics = "
                             "\"HOST:PORT\"` to its daemons' entries, then restart them")
    else:
        n_meta = DEFAULT_META_SHARDS if meta_shards is None else meta_shards
        n_storage = DEFAULT_STORAGE_NODES if storage_nodes is None else storage_nodes
        if n_meta < 1:
            raise ValueError("a cluster needs at least one metadata shard")
        config.new_secret(d / "secret")
        def server(role: str, i: int) -> config.Server:
            return config.Server(f"127.0.0.1:{_free_port()}", f"{role}-{i}",
                                 f"127.0.0.1:{_free_port()}" if metrics else None)

        cluster = config.Cluster(
            meta=tuple(server("meta", i) for i in range(n_meta)),
            storage=tuple(server("storage", i) for i in range(n_storage)),
            replicas=replicas or 1,
            chunk_size=chunk_size or config.DEFAULT_CHUNK_SIZE,
            path=path,
        )
        if cluster.storage and cluster.replicas > cluster.n_nodes:
            raise ValueError(f"replicas = {cluster.replicas} needs at least that many storage "
                             "nodes")
        config.write(cluster, path)
        cluster = config.load(path)
    started = []
    for role, servers in (("meta", cluster.meta), ("storage", cluster.storage)):
        for i in range(len(servers)):
            if _read_pid(d / f"{role}-{i}.pid") is None:
                started.append(_spawn(d, role, i, sync, (extra_args or {}).get(role, []), env))
    for role, i, proc in started:
        _wait_started(d, role, i, proc, sync, (extra_args or {}).get(role, []), env)
    return config.load(path)


def start(directory: str | os.PathLike, role: str, index: int, *, sync: bool = True,
          env: dict[str, str] | None = None, extra_args: list[str] | None = None) -> int:
    """Start one stopped daemon (tests use ``env`` for fault points); returns its pid."""
    d = Path(directory).resolve()
    _, _, proc = _spawn(d, role, index, sync, extra_args or [], env)
    return _wait_started(d, role, index, proc, sync, extra_args or [], env)


def _wait_started(d: Path, role: str, index: int, proc: subprocess.Popen, sync: bool,
                  extra: list[str], env: dict[str, str] | None) -> int:
    """Wait until the daemon listens; if its old port was taken meanwhile, move it to a free
    one (rewriting cluster.toml) and start it again."""
    for _ in range(5):
        cluster = config.load(cluster_file(d))
        server = (cluster.meta if role == "meta" else cluster.storage)[index]
        if _wait_listening(d, role, index, proc, server):
            return proc.pid
        _move(d, cluster, role, index)
        _, _, proc = _spawn(d, role, index, sync, extra, env)
    raise RuntimeError(f"{role}-{index}: could not find a free port")


def _move(d: Path, cluster: config.Cluster, role: str, index: int) -> None:
    """Give one daemon a new free port in cluster.toml."""
    servers = list(cluster.meta if role == "meta" else cluster.storage)
    host, _ = config.parse_address(servers[index].address)
    servers[index] = dataclasses.replace(servers[index], address=f"{host}:{_free_port(host)}")
    if role == "meta":
        updated = dataclasses.replace(cluster, meta=tuple(servers))
    else:
        updated = dataclasses.replace(cluster, storage=tuple(servers))
    config.write(updated, cluster_file(d))


def _spawn(d: Path, role: str, index: int, sync: bool, extra: list[str],
           env: dict[str, str] | None = None):
    log = d / "logs" / f"{role}-{index}.log"
    cmd = [sys.executable, "-m", MODULES[role], "--cluster", str(cluster_file(d)),
           "--index", str(index), "--pid-file", str(d / f"{role}-{index}.pid"),
           "--log-file", str(log), *extra]
    if not sync:
        cmd.append("--no-sync")
    with open(d / "logs" / f"{role}-{index}.out", "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True, cwd=d,
                                env={**os.environ, **env} if env else None)
    return role, index, proc


def _wait_listening(d: Path, role: str, index: int, proc: subprocess.Popen,
                    server: config.Server) -> bool:
    """True once it listens; False if it exited because its address was taken."""
    host, port = server.host_port
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if proc.returncode == EXIT_ADDRESS_IN_USE:
                return False
            raise RuntimeError(f"{role}-{index} exited with status {proc.returncode}:\n"
                               + _tail(d, role, index))
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{role}-{index} did not start listening on {server.address} within "
                       f"{START_TIMEOUT:.0f}s:\n" + _tail(d, role, index))


def _tail(d: Path, role: str, index: int, lines: int = 20) -> str:
    text = ""
    for suffix in (".log", ".out"):
        try:
            text += (d / "logs" / f"{role}-{index}{suffix}").read_text(errors="replace")
        except OSError:
            pass
    return "\n".join(text.splitlines()[-lines:])


def status(directory: str | os.PathLike) -> list[Daemon]:
    """Every daemon of the cluster in ``directory``: its address, pid and whether it runs."""
    d = Path(directory).resolve()
    cluster = config.load(cluster_file(d))
    out = []
    for role, servers in (("meta", cluster.meta), ("storage", cluster.storage)):
        for i, s in enumerate(servers):
            pid = _read_pid(d / f"{role}-{i}.pid")
            out.append(Daemon(role, i, s.address, pid, pid is not None))
    return out


def stop(directory: str | os.PathLike, role: str, index: int, *, sig: int = signal.SIGTERM,
         timeout: float = 15.0) -> bool:
    """Stop one daemon (SIGKILL after ``timeout``); False if it was not running."""
    d = Path(directory).resolve()
    pid_file = d / f"{role}-{index}.pid"
    pid = _read_pid(pid_file)
    if pid is None:
        pid_file.unlink(missing_ok=True)
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5
        time.sleep(0.02)
    pid_file.unlink(missing_ok=True)
    return True


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not; a child of ours is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # reap it if it is our child
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill(directory: str | os.PathLike, role: str, index: int) -> bool:
    """``kill -9`` one daemon (crash tests)."""
    return stop(directory, role, index, sig=signal.SIGKILL)


def down(directory: str | os.PathLike, timeout: float = 15.0) -> list[str]:
    """Stop every daemon of the cluster; returns the names of those that were running."""
    stopped = []
    for dmn in status(directory):
        if stop(directory, dmn.role, dmn.index, timeout=timeout):
            stopped.append(dmn.name)
    return stopped


__all__ = ["Daemon", "cluster_file", "down", "kill", "start", "status", "stop", "up"]
