"""A whole JPFS cluster of real daemon processes on loopback, in one directory.

``up(DIR)`` writes ``DIR/cluster.toml`` and a secret on first use, then starts every daemon that is
not running (``python -m jpfs_daemon.meta.main ...``): data in ``DIR/meta-<i>`` and
``DIR/storage-<i>``, logs in ``DIR/logs``, pid files ``DIR/<role>-<i>.pid``. A later ``up`` on the
same directory restarts stopped daemons on their data (on their old ports when those are free).
This is what ``jpfs cluster up``, the tests and the benchmarks use.

With ``etcd=True`` the cluster keeps its shape in a cluster map (``jpfs.coord.clustermap``) in an
etcd process of its own (data ``DIR/etcd``, log ``DIR/logs/etcd.log``); the cluster file then says
only where etcd is. Such a cluster can grow: ``up`` with more shards or storage nodes than it has
appends them to the map and starts them. Each shard may have several copies (``meta_replicas``),
daemons ``meta-<i>`` (copy 0) and ``meta-<i>-r<j>``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import config
from .coord import clustermap

MODULES = {"meta": "jpfs_daemon.meta.main", "storage": "jpfs_daemon.storage.server"}
DEFAULT_META_SHARDS = 2
DEFAULT_STORAGE_NODES = 2
DEFAULT_META_REPLICAS = 3
"""Copies per shard ``jpfs cluster up`` makes (a leader and two followers: any one daemon can
die); ``localcluster.up`` itself defaults to 1 (tests that need no replication)."""
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
    replica: int = 0
    """Which copy of a metadata shard (0 for storage nodes and unreplicated shards)."""

    @property
    def name(self) -> str:
        """``meta-1``, ``meta-1-r2`` or ``storage-0`` (``daemon_name``)."""
        return daemon_name(self.role, self.index, self.replica)


def daemon_name(role: str, index: int, replica: int = 0) -> str:
    """``meta-1``, ``meta-1-r2`` (copy 2 of shard 1), ``storage-0``, ``etcd``."""
    if role == "etcd":
        return "etcd"
    return f"{role}-{index}" + (f"-r{replica}" if replica else "")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_HANDED_OUT: collections.OrderedDict[int, None] = collections.OrderedDict()
"""Ports this process handed out lately, newest last: free when checked, but not yet bound by
the daemons they were chosen for (a cluster's daemons start after all its ports are chosen)."""
_HANDED_OUT_MAX = 2048


def _free_port(host: str = "127.0.0.1") -> int:
    """A free port *below* the ephemeral range: a port the kernel hands out for outgoing
    connections could be taken by one while its daemon is down, and a restart would then fail
    to bind its own address. Never one handed out lately: a cluster of ten daemons drawing from
    12,000 ports would otherwise give two of them the same port once in a few hundred clusters,
    and one daemon would serve the other's address."""
    low = max(1025, _ephemeral_low() - 12000)
    rng = random.Random()
    port = None
    for _ in range(200):
        candidate = rng.randrange(low, _ephemeral_low())
        if candidate in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, candidate))
            except OSError:
                continue
        port = candidate
        break
    if port is None:
        with socket.socket() as s:  # crowded machine: let the kernel choose
            s.bind((host, 0))
            port = s.getsockname()[1]
    _HANDED_OUT[port] = None
    while len(_HANDED_OUT) > _HANDED_OUT_MAX:
        _HANDED_OUT.popitem(last=False)
    return port


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
    etcd: bool = False,
    meta_replicas: int | None = None,
) -> config.Cluster:
    """Create (first time) and start the cluster in ``directory``; returns its config.

    ``metrics``: give every daemon a Prometheus port, recorded in the cluster file or map.
    ``etcd``: keep the shape in a cluster map in a local etcd (a new cluster only; an existing
    directory keeps its kind), which lets a later ``up`` with more ``meta_shards`` or
    ``storage_nodes`` grow the running cluster. ``meta_replicas``: copies of each shard (etcd
    clusters; default 1). ``replicas`` defaults to 2 for an etcd cluster with 2 or more storage
    nodes (a lost disk loses nothing), 1 otherwise.

    A daemon that does not start fails the call, and the daemons it started (etcd too) are
    stopped: a cluster that does not come up is left as it was, nothing of it running behind
    the error."""
    d = Path(directory).resolve()
    (d / "logs").mkdir(parents=True, exist_ok=True)
    path = cluster_file(d)
    etcd_ran = _read_pid(d / "etcd.pid") is not None
    try:
        return _up(d, path, meta_shards, storage_nodes, replicas, chunk_size, sync, metrics,
                   extra_args, env, etcd, meta_replicas)
    except BaseException:
        if not etcd_ran:
            _stop_pid_file(d / "etcd.pid", signal.SIGTERM, 5.0)
        raise


def _up(d: Path, path: Path, meta_shards: int | None, storage_nodes: int | None,
        replicas: int | None, chunk_size: int | None, sync: bool, metrics: bool,
        extra_args: dict[str, list[str]] | None, env: dict[str, str] | None, etcd: bool,
        meta_replicas: int | None) -> config.Cluster:
    if path.exists():
        cluster = _existing(d, path, meta_shards, storage_nodes, replicas, chunk_size, metrics,
                            meta_replicas)
    else:
        cluster = _create(d, path, meta_shards, storage_nodes, replicas, chunk_size, metrics,
                          etcd, meta_replicas)
    started = []
    for role, index, replica in _daemons(cluster):
        if _read_pid(d / f"{daemon_name(role, index, replica)}.pid") is None:
            started.append(_spawn(d, role, index, sync, (extra_args or {}).get(role, []), env,
                                  replica))
    try:
        for role, index, proc, replica in started:
            _wait_started(d, role, index, proc, sync, (extra_args or {}).get(role, []), env,
                          replica)
    except BaseException:
        # by the handles we hold: a daemon may not have written its pid file yet
        for role, index, proc, replica in started:
            _end(proc)
            stop(d, role, index, timeout=5.0, replica=replica)  # one restarted on a new port
        raise
    return config.load(path)


def _end(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """Stop a daemon this process started (SIGTERM, SIGKILL after ``timeout``) and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _daemons(cluster: config.Cluster) -> list[tuple[str, int, int]]:
    """(role, index, replica) of every daemon the cluster runs (removed nodes do not run)."""
    out = [("meta", i, j) for i, copies in enumerate(cluster.meta_replicas)
           for j in range(len(copies))]
    out += [("storage", i, 0) for i, s in enumerate(cluster.storage) if s.state != "removed"]
    return out


def _server(role: str, i: int, metrics: bool, replica: int = 0) -> config.Server:
    return config.Server(f"127.0.0.1:{_free_port()}", daemon_name(role, i, replica),
                         f"127.0.0.1:{_free_port()}" if metrics else None)


def _create(d: Path, path: Path, meta_shards: int | None, storage_nodes: int | None,
            replicas: int | None, chunk_size: int | None, metrics: bool, etcd: bool,
            meta_replicas: int | None) -> config.Cluster:
    n_meta = DEFAULT_META_SHARDS if meta_shards is None else meta_shards
    n_storage = DEFAULT_STORAGE_NODES if storage_nodes is None else storage_nodes
    n_copies = meta_replicas or 1
    if n_meta < 1:
        raise ValueError("a cluster needs at least one metadata shard")
    if n_copies < 1 or n_copies > 1 and not etcd:
        raise ValueError("meta_replicas must be at least 1, and more than 1 needs etcd (the "
                         "shard leaders' leases live there)")
    if replicas is None:
        replicas = 2 if etcd and n_storage >= 2 else 1
    if n_storage and replicas > n_storage:
        raise ValueError(f"replicas = {replicas} needs at least that many storage nodes")
    secret = config.new_secret(d / "secret")
    shards = tuple(tuple(_server("meta", i, metrics, j) for j in range(n_copies))
                   for i in range(n_meta))
    cluster = config.Cluster(
        meta=tuple(copies[0] for copies in shards),
        storage=tuple(_server("storage", i, metrics) for i in range(n_storage)),
        replicas=replicas, chunk_size=chunk_size or config.DEFAULT_CHUNK_SIZE, path=path,
        meta_replicas=shards, secret=secret,
        etcd=(start_etcd(d),) if etcd else (),
    )
    if etcd:
        clustermap.update_map_sync(cluster, lambda current: current or cluster)
    config.write(cluster, path)
    return config.load(path)


def _existing(d: Path, path: Path, meta_shards: int | None, storage_nodes: int | None,
              replicas: int | None, chunk_size: int | None, metrics: bool,
              meta_replicas: int | None) -> config.Cluster:
    """Load an existing cluster (starting its etcd), growing it if asked for more."""
    text = path.read_text()
    if "etcd" in text and (d / "etcd").is_dir():
        start_etcd(d)
    cluster = config.load(path)
    grow = {"meta shards": (meta_shards, cluster.n_shards),
            "storage nodes": (storage_nodes, cluster.n_nodes)}
    fixed = {"replicas": (replicas, cluster.replicas),
             "chunk size": (chunk_size, cluster.chunk_size),
             "metadata copies per shard": (meta_replicas, cluster.n_meta_replicas)}
    for what, (asked, have) in fixed.items():
        if asked is not None and asked != have:
            raise ValueError(f"{path} already has {have} {what}; cannot change it to {asked} "
                             "(start a new cluster in another directory)")
    for what, (asked, have) in grow.items():
        if asked is not None and asked < have:
            raise ValueError(f"{path} has {have} {what}; a cluster does not shrink (drain "
                             "storage nodes with `jpfs node drain`)")
        if asked is not None and asked > have and not cluster.etcd:
            raise ValueError(f"{path} has {have} {what} and no cluster map, so it cannot grow "
                             "(a cluster made with `jpfs cluster up` (etcd) can)")
    if metrics and not all(s.metrics for s in cluster.meta + cluster.storage):
        raise ValueError(f"{path} was created without metrics ports: add `metrics = "
                         "\"HOST:PORT\"` to its daemons' entries, then restart them")
    if cluster.etcd and ((meta_shards or 0) > cluster.n_shards
                         or (storage_nodes or 0) > cluster.n_nodes):
        def grown(current: config.Cluster | None) -> config.Cluster:
            assert current is not None
            copies = current.n_meta_replicas
            shards = current.meta_replicas + tuple(
                tuple(_server("meta", i, metrics, j) for j in range(copies))
                for i in range(current.n_shards, max(meta_shards or 0, current.n_shards)))
            nodes = current.storage + tuple(
                _server("storage", i, metrics)
                for i in range(current.n_nodes, max(storage_nodes or 0, current.n_nodes)))
            return dataclasses.replace(current, meta=tuple(c[0] for c in shards),
                                       meta_replicas=shards, storage=nodes)
        cluster = clustermap.update_map_sync(cluster, grown)
    return cluster


def start(directory: str | os.PathLike, role: str, index: int, *, sync: bool = True,
          env: dict[str, str] | None = None, extra_args: list[str] | None = None,
          replica: int = 0) -> int:
    """Start one stopped daemon (tests use ``env`` for fault points); returns its pid."""
    d = Path(directory).resolve()
    _, _, proc, _ = _spawn(d, role, index, sync, extra_args or [], env, replica)
    return _wait_started(d, role, index, proc, sync, extra_args or [], env, replica)


def _server_of(cluster: config.Cluster, role: str, index: int, replica: int) -> config.Server:
    return cluster.meta_replicas[index][replica] if role == "meta" else cluster.storage[index]


def _wait_started(d: Path, role: str, index: int, proc: subprocess.Popen, sync: bool,
                  extra: list[str], env: dict[str, str] | None, replica: int = 0) -> int:
    """Wait until the daemon listens; if its old port was taken meanwhile, move it to a free
    one (rewriting cluster.toml or the map) and start it again."""
    for _ in range(5):
        cluster = config.load(cluster_file(d))
        server = _server_of(cluster, role, index, replica)
        if _wait_listening(d, daemon_name(role, index, replica), proc, server):
            return proc.pid
        _move(d, cluster, role, index, replica)
        _, _, proc, _ = _spawn(d, role, index, sync, extra, env, replica)
    raise RuntimeError(f"{daemon_name(role, index, replica)}: could not find a free port")


def _move(d: Path, cluster: config.Cluster, role: str, index: int, replica: int = 0) -> None:
    """Give one daemon a new free port in cluster.toml (or the map)."""
    def moved(current: config.Cluster | None) -> config.Cluster:
        assert current is not None
        old = _server_of(current, role, index, replica)
        host, _ = config.parse_address(old.address)
        server = dataclasses.replace(old, address=f"{host}:{_free_port(host)}")
        if role == "storage":
            nodes = list(current.storage)
            nodes[index] = server
            return dataclasses.replace(current, storage=tuple(nodes))
        shards = [list(c) for c in current.meta_replicas]
        shards[index][replica] = server
        copies = tuple(tuple(c) for c in shards)
        return dataclasses.replace(current, meta=tuple(c[0] for c in copies),
                                   meta_replicas=copies)
    if cluster.etcd:
        clustermap.update_map_sync(cluster, moved)
    else:
        config.write(moved(cluster), cluster_file(d))


def _spawn(d: Path, role: str, index: int, sync: bool, extra: list[str],
           env: dict[str, str] | None = None, replica: int = 0):
    name = daemon_name(role, index, replica)
    log = d / "logs" / f"{name}.log"
    cmd = [sys.executable, "-m", MODULES[role], "--cluster", str(cluster_file(d)),
           "--index", str(index), "--pid-file", str(d / f"{name}.pid"),
           "--log-file", str(log), *extra]
    if replica or role == "meta" and config.load(cluster_file(d)).n_meta_replicas > 1:
        cmd += ["--replica", str(replica)]
    if not sync:
        cmd.append("--no-sync")
    with open(d / "logs" / f"{name}.out", "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True, cwd=d,
                                env={**os.environ, **env} if env else None)
    return role, index, proc, replica


def _wait_listening(d: Path, name: str, proc: subprocess.Popen, server: config.Server) -> bool:
    """True once it listens; False if it exited because its address was taken."""
    host, port = server.host_port
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if proc.returncode == EXIT_ADDRESS_IN_USE:
                return False
            raise RuntimeError(f"{name} exited with status {proc.returncode}:\n"
                               + _tail(d, name))
        try:
            with socket.create_connection((host, port), timeout=0.5):
                pass
        except OSError:
            time.sleep(0.05)
            continue
        if _listens(proc.pid, port) is not False:
            return True
        time.sleep(0.05)  # someone else holds the port: ours will exit with status 98
    raise RuntimeError(f"{name} did not start listening on {server.address} within "
                       f"{START_TIMEOUT:.0f}s:\n" + _tail(d, name))


def _listens(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds the listening socket on TCP ``port`` (Linux: the socket
    inodes of /proc/net/tcp* against the process's fds); None if /proc cannot tell. A port
    that answers is not proof: another process may have taken it while the daemon was down."""
    inodes = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        fds = os.listdir(f"/proc/{pid}/fd")
    except (OSError, IndexError, ValueError):
        return None
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


# ---- the local etcd of a cluster with a map

ETCD_BINARY = "etcd"
ETCD_TUNING = ("--heartbeat-interval", "250", "--election-timeout", "2500")
"""etcd's timing for a loaded host, as its tuning guide sets it where the defaults (100 ms
heartbeats, a 1 s election timeout) are too tight: the timeout ten heartbeats. A local etcd has
one member, so no election of its own turns on it; a cluster of members on training nodes
should use the same. It also sets etcd's shortest lease (1.5 election timeouts: 3.75 s, under
the shards' 5 s)."""
ETCD_NICE = -10
"""etcd's CPU priority where this process may raise it (root): the tuning guide's advice, so
the map and the shards' leases are answered ahead of a busy host's other work."""


def _raise_priority() -> None:
    """In the child before exec: a higher CPU priority for etcd, where allowed."""
    with contextlib.suppress(OSError):
        os.nice(ETCD_NICE)


def start_etcd(directory: str | os.PathLike) -> str:
    """Start (or find running) the etcd of the cluster in ``directory``; its client URL.

    Ports are kept in ``DIR/etcd.ports``, so a restart serves the URL the cluster file names."""
    d = Path(directory).resolve()
    (d / "logs").mkdir(parents=True, exist_ok=True)
    ports_file = d / "etcd.ports"
    if ports_file.exists():
        client, peer = (int(x) for x in ports_file.read_text().split())
    else:
        client, peer = _free_port(), _free_port()
        ports_file.write_text(f"{client} {peer}\n")
    url = f"http://127.0.0.1:{client}"
    if _read_pid(d / "etcd.pid") is not None:
        return url
    exe = shutil.which(ETCD_BINARY)
    if exe is None:
        raise RuntimeError("etcd is not installed (Debian: apt install etcd-server; "
                           "scripts/setup.sh installs it)")
    peer_url = f"http://127.0.0.1:{peer}"
    cmd = [exe, "--name", "jpfs", "--data-dir", str(d / "etcd"),
           "--listen-client-urls", url, "--advertise-client-urls", url,
           "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
           "--initial-cluster", f"jpfs={peer_url}",
           "--auto-compaction-mode", "revision", "--auto-compaction-retention", "10000",
           *ETCD_TUNING]
    with open(d / "logs" / "etcd.log", "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True, cwd=d, preexec_fn=_raise_priority)
    (d / "etcd.pid").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"etcd exited with status {proc.returncode}:\n"
                               + _tail(d, "etcd"))
        try:
            clustermap._gateway((url,), "/v3/kv/range", {"key": "Lw=="}, timeout=0.5)
            return url
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"etcd did not answer at {url} within {START_TIMEOUT:.0f}s:\n"
                       + _tail(d, "etcd"))


def _tail(d: Path, name: str, lines: int = 20) -> str:
    text = ""
    for suffix in (".log", ".out"):
        try:
            text += (d / "logs" / f"{name}{suffix}").read_text(errors="replace")
        except OSError:
            pass
    return "\n".join(text.splitlines()[-lines:])


def status(directory: str | os.PathLike) -> list[Daemon]:
    """Every daemon of the cluster in ``directory``: its address, pid and whether it runs."""
    d = Path(directory).resolve()
    out = []
    if (d / "etcd.ports").exists():
        pid = _read_pid(d / "etcd.pid")
        client = (d / "etcd.ports").read_text().split()[0]
        out.append(Daemon("etcd", 0, f"127.0.0.1:{client}", pid, pid is not None))
        if pid is None:
            return out  # the map is in etcd: nothing else can be named without it
    cluster = config.load(cluster_file(d))
    for role, index, replica in _daemons(cluster):
        pid = _read_pid(d / f"{daemon_name(role, index, replica)}.pid")
        out.append(Daemon(role, index, _server_of(cluster, role, index, replica).address, pid,
                          pid is not None, replica))
    return out


def stop(directory: str | os.PathLike, role: str, index: int, *, sig: int = signal.SIGTERM,
         timeout: float = 15.0, replica: int = 0) -> bool:
    """Stop one daemon (SIGKILL after ``timeout``); False if it was not running."""
    d = Path(directory).resolve()
    return _stop_pid_file(d / f"{daemon_name(role, index, replica)}.pid", sig, timeout)


def _stop_pid_file(pid_file: Path, sig: int, timeout: float) -> bool:
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


def kill(directory: str | os.PathLike, role: str, index: int, replica: int = 0) -> bool:
    """``kill -9`` one daemon (crash tests)."""
    return stop(directory, role, index, sig=signal.SIGKILL, replica=replica)


def down(directory: str | os.PathLike, timeout: float = 15.0) -> list[str]:
    """Stop every daemon of the cluster (etcd last); returns the names of those that ran.

    Every daemon with a pid file in the directory is stopped, not only those the map names:
    a node that was drained and removed may still run, and without etcd the map names none."""
    d = Path(directory).resolve()
    stopped = []
    try:
        daemons = [x for x in status(d) if x.role != "etcd"]
    except (OSError, ValueError):  # no map to read (etcd gone, a broken file): pid files only
        daemons = []
    for dmn in daemons:
        if stop(d, dmn.role, dmn.index, timeout=timeout, replica=dmn.replica):
            stopped.append(dmn.name)
    for pid_file in sorted(d.glob("*.pid"), key=lambda p: p.stem == "etcd"):  # etcd last
        if _stop_pid_file(pid_file, signal.SIGTERM, timeout):
            stopped.append(pid_file.stem)
    return stopped


__all__ = ["Daemon", "cluster_file", "daemon_name", "down", "kill", "start", "start_etcd",
           "status", "stop", "up"]
