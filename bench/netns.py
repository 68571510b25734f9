"""Simulated hosts on one machine: JPFS servers in network namespaces behind veth pairs with a
round-trip delay and a rate limit, so the cost of network latency (and what prefetch hides of
it) shows on a laptop.

Host ``k`` is namespace ``jpfsb-<pid>-<k>``, joined by a veth pair to a bridge in this
namespace; the bridge has ``10.231.<s>.1`` and host ``k`` has ``10.231.<s>.<k+2>`` (a private /24
of a slot ``s`` no other run on this machine uses). One L2 segment: this namespace reaches every
host and hosts reach each other (metadata shards talk to each other) with no routes, no
forwarding, nothing else addressed.

- Rate: ``tbf`` on both ends of each veth (``--rate 10gbit``).
- Delay: ``netem`` on both ends of each veth (half the RTT each way) where the kernel has it; a
  host then reaches another host in two veth hops (twice the RTT). Kernels built without
  ``sch_netem`` (this project's VMs) get a relay instead (``relay.py``): one process per host,
  listening on the bridge address, that forwards every TCP stream to the daemon, holding each
  piece for half the RTT in each direction (threads sleeping to a deadline: some 0.1 ms late
  under load, which is why the RPC round trip is measured and reported). Clients and the other
  servers dial the relay. It sits in the path at RTT 0 too, so a zero-latency baseline pays the
  same copies and differs only in the delay.

Everything is removed on exit, on exceptions, on SIGINT and SIGTERM, and the leftovers of a run
that was killed (namespaces, veths, relays and daemons of a process that no longer exists) are
removed by the next run. Relays exit by themselves when the process that started them is gone.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from jpfs.localcluster import MODULES, pid_alive

from . import relay
from .harness import stop_like_ctrl_c, wait_port

log = logging.getLogger(__name__)

PREFIX = "jpfsb"
"""Namespaces are ``jpfsb-<owner pid>-<host>``; veth ends here ``jb<owner pid>h<host>``, the
bridge ``jb<owner pid>br``."""
SUBNET = "10.231"
MAX_HOSTS = 64
MAX_SLOTS = 64
_NS_RE = re.compile(rf"^{PREFIX}-(\d+)-(\d+)$")
_VETH_RE = re.compile(r"^jb(\d+)(?:h\d+|br)$")
CMD_TIMEOUT = 20.0


# ---------------------------------------------------------------------- parsing


def parse_rtt(text: str) -> float:
    """``"0.5ms"``, ``"500us"``, ``"2ms"``, ``"0"`` -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*(s|ms|us|µs)?\s*", str(text))
    if not m:
        raise ValueError(f"not a round-trip time: {text!r} (try 0.5ms, 500us)")
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, None: 1e-3}[m.group(2)]
    return float(m.group(1)) * scale


def parse_rate(text: str) -> int:
    """``"10gbit"``, ``"800mbit"``, ``"1gbps"`` (bytes) -> bits per second."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(bit|bps)\s*", str(text).lower())
    if not m:
        raise ValueError(f"not a rate: {text!r} (try 10gbit, 800mbit)")
    n = float(m.group(1)) * 1000 ** " kmgt".index(m.group(2) or " ")
    return int(n * (8 if m.group(3) == "bps" else 1))


# ---------------------------------------------------------------------- commands


def _run(cmd: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=CMD_TIMEOUT)
    if check and r.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {r.stderr.strip() or r.stdout.strip()}")
    return r


def _kill(pids: Sequence[int], grace: float = 5.0) -> None:
    """SIGTERM these processes, SIGKILL those still there after ``grace`` seconds, and wait
    (``grace`` more at most) until those are gone too: a SIGKILLed process ends when the kernel
    has torn it down, which on a loaded host is not at once."""
    left = _signal_and_wait([p for p in pids if p != os.getpid()], signal.SIGTERM, grace)
    _signal_and_wait(left, signal.SIGKILL, grace)


def _signal_and_wait(pids: Sequence[int], sig: int, grace: float) -> list[int]:
    """Send ``sig`` to each of ``pids``; wait up to ``grace`` seconds for them to end; the ones
    still alive."""
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


def namespaces() -> list[str]:
    """The names of the network namespaces (``ip netns list``)."""
    r = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def ns_pids(ns: str) -> list[int]:
    """The processes in namespace ``ns``."""
    r = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in r.stdout.split() if x.isdigit()]


def links() -> list[str]:
    """The names of the network links of this namespace."""
    r = _run(["ip", "-o", "link", "show"], check=False)
    return [line.split(":")[1].strip().split("@")[0] for line in r.stdout.splitlines()
            if line.count(":") >= 2]


def unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None when they can (a probe namespace is
    created and deleted)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or without --hosts)"
    for tool in ("ip", "tc"):
        if not any(os.access(os.path.join(d, tool), os.X_OK)
                   for d in os.environ.get("PATH", "").split(os.pathsep) + ["/usr/sbin",
                                                                             "/sbin"]):
            return f"`{tool}` (iproute2) is not installed: apt-get install -y iproute2"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        r = _run(["ip", "netns", "add", probe], check=False)
        if r.returncode:
            return f"cannot create a network namespace: {r.stderr.strip()}"
    finally:
        if probe in namespaces():
            _run(["ip", "netns", "del", probe], check=False)
    return None


def leftovers(owner_alive: Callable[[int], bool] = pid_alive) -> dict[str, list]:
    """Namespaces, veths and relay processes of runs whose owner process is gone."""
    out: dict[str, list] = {"namespaces": [], "veths": [], "relays": []}
    for ns in namespaces():
        m = _NS_RE.match(ns) or re.match(rf"^{PREFIX}-(\d+)-probe$", ns)
        if m and not owner_alive(int(m.group(1))):
            out["namespaces"].append(ns)
    for name in links():
        m = _VETH_RE.match(name)
        if m and not owner_alive(int(m.group(1))):
            out["veths"].append(name)
    for pid, owner in _relays():
        if not owner_alive(owner):
            out["relays"].append(pid)
    return out


def _relays() -> list[tuple[int, int]]:
    """(pid, owner pid) of every relay process on this machine."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-m" in argv and relay.MODULE.encode() in argv and b"--owner" in argv:
            try:
                found.append((int(d.name), int(argv[argv.index(b"--owner") + 1])))
            except (IndexError, ValueError):
                continue
    return found


def clean_leftovers() -> dict[str, list]:
    """Remove what a crashed run left behind (its daemons in its namespaces included)."""
    found = leftovers()
    _kill(found["relays"])
    for ns in found["namespaces"]:
        _kill(ns_pids(ns))
        _run(["ip", "netns", "del", ns], check=False)
    for name in found["veths"]:
        if name in links():
            _run(["ip", "link", "del", name], check=False)
    if any(found.values()):
        log.warning("removed leftovers of an earlier run: %s", found)
    return found


# ---------------------------------------------------------------------- the hosts


@dataclass(frozen=True)
class Host:
    """One simulated host: its namespace, its veth and its two addresses."""
    index: int
    ns: str
    veth: str
    outer: str  # the bridge's address in this namespace (where relays listen)
    inner: str  # the host's address in its namespace (where daemons listen)


class SimHosts:
    """K simulated hosts; a context manager that removes everything it made on exit.

    Args:
        k: hosts (namespaces).
        rtt: round-trip time in seconds added between this namespace and each host.
        rate: bits per second each way per host (None: unlimited).
        method: "netem", "relay" or "auto" (netem where the kernel has it).
    """

    def __init__(self, k: int, rtt: float = 0.0, rate: int | None = None, method: str = "auto"):
        if not 1 <= k <= MAX_HOSTS:
            raise ValueError(f"--hosts must be between 1 and {MAX_HOSTS}")
        self.k = k
        self.rtt = rtt
        self.rate = rate
        self.method = method
        self.hosts: list[Host] = []
        self.relays: list[subprocess.Popen] = []
        self.relay_ports: dict[tuple[int, int], int] = {}
        self.delay_file: Path | None = None
        self._old_handlers: dict[int, object] = {}
        self._made_ns: list[str] = []
        self._made_links: list[str] = []
        self.bridge = ""

    # ---- lifecycle
    def __enter__(self) -> SimHosts:
        self._trap_signals()
        try:
            self.setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _trap_signals(self) -> None:
        """SIGTERM (and SIGHUP) end the run like Ctrl-C does, so ``finally`` blocks clean up."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, stop_like_ctrl_c)

    def setup(self) -> None:
        """Make the bridge, the namespaces and their links, and the delay (netem or relays); removes
        an earlier run's leftovers first. RuntimeError where namespaces cannot be made here."""
        clean_leftovers()
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        slot = self._free_slot()
        pid = os.getpid()
        self.bridge = f"jb{pid}br"
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._made_links.append(self.bridge)
        _run(["ip", "addr", "add", f"{SUBNET}.{slot}.1/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for k in range(self.k):
            h = Host(k, f"{PREFIX}-{pid}-{k}", f"jb{pid}h{k}", f"{SUBNET}.{slot}.1",
                     f"{SUBNET}.{slot}.{k + 2}")
            _run(["ip", "netns", "add", h.ns])
            self._made_ns.append(h.ns)
            _run(["ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0",
                  "netns", h.ns])
            self._made_links.append(h.veth)
            _run(["ip", "link", "set", h.veth, "master", self.bridge])
            _run(["ip", "link", "set", h.veth, "up"])
            self._ns(h, "ip", "addr", "add", f"{h.inner}/24", "dev", "eth0")
            self._ns(h, "ip", "link", "set", "eth0", "up")
            self._ns(h, "ip", "link", "set", "lo", "up")
            self.hosts.append(h)
        if self.method == "auto":
            self.method = "netem" if self._try_netem(self.hosts[0]) else "relay"
        for h in self.hosts:
            self._shape(h, self.rtt if self.method == "netem" else 0.0, add=True)

    def close(self) -> None:
        """Remove relays, namespaces (and with them the veths); kill what still runs inside."""
        for p in self.relays:
            if p.poll() is None:
                p.terminate()
        for p in self.relays:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.relays = []
        for ns in self._made_ns:
            _kill(ns_pids(ns))
            _run(["ip", "netns", "del", ns], check=False)
        have = links()
        for name in self._made_links:
            if name in have:
                _run(["ip", "link", "del", name], check=False)
        self._made_ns, self._made_links, self.hosts = [], [], []
        if self.delay_file:
            self.delay_file.unlink(missing_ok=True)
            self.delay_file = None
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers = {}

    # ---- shaping
    def _ns(self, h: Host, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run(["ip", "netns", "exec", h.ns, *cmd], check=check)

    def _free_slot(self) -> int:
        used = _run(["ip", "-o", "addr", "show"], check=False).stdout
        for s in range(MAX_SLOTS):
            if f" {SUBNET}.{s}." not in used:
                return s
        raise RuntimeError(f"all {MAX_SLOTS} address slots of {SUBNET}.0.0/16 are in use")

    def _try_netem(self, h: Host) -> bool:
        r = _run(["tc", "qdisc", "add", "dev", h.veth, "root", "netem", "delay", "0ms"],
                 check=False)
        if r.returncode == 0:
            _run(["tc", "qdisc", "del", "dev", h.veth, "root"], check=False)
            return True
        log.info("netem is not available (%s): delaying in a relay", r.stderr.strip())
        return False

    def _qdisc(self, rtt: float) -> list[str]:
        if self.method == "netem":
            q = ["netem", "delay", f"{rtt / 2 * 1e6:.0f}us", "limit", "100000"]
            if self.rate:
                q += ["rate", f"{self.rate}bit"]
            return q
        burst = max(256 << 10, int(self.rate / 8 * 0.002)) if self.rate else 0
        return ["tbf", "rate", f"{self.rate}bit", "burst", str(burst), "latency", "50ms"]

    def _shape(self, h: Host, rtt: float, add: bool) -> None:
        if self.method != "netem" and not self.rate:
            return
        verb = "add" if add else "change"
        q = self._qdisc(rtt)
        _run(["tc", "qdisc", verb, "dev", h.veth, "root", *q])
        self._ns(h, "tc", "qdisc", verb, "dev", "eth0", "root", *q)

    def set_rtt(self, rtt: float) -> None:
        """Change the delay of every host (running daemons and connections keep going)."""
        self.rtt = rtt
        if self.method == "netem":
            for h in self.hosts:
                self._shape(h, rtt, add=False)
        elif self.relays:
            assert self.delay_file is not None
            self.delay_file.write_text(repr(rtt / 2))
            for p in self.relays:
                p.send_signal(signal.SIGHUP)
            time.sleep(0.2)

    # ---- addresses
    def listen_address(self, host: int, port: int) -> str:
        """Where a daemon on ``host`` listens."""
        return f"{self.hosts[host].inner}:{port}"

    def start_relays(self, endpoints: Sequence[tuple[int, int]], work: Path) -> None:
        """With the relay method: one relay per host forwarding ``bridge address:port`` to
        ``host address:port`` for each (host, port) (ports are unique across hosts); no-op
        with netem."""
        if self.method != "relay":
            return
        self.delay_file = work / f"relay-delay-{os.getpid()}"
        self.delay_file.write_text(repr(self.rtt / 2))
        by_host: dict[int, list[int]] = {}
        for host, port in endpoints:
            by_host.setdefault(host, []).append(port)
        for host, ports in sorted(by_host.items()):
            h = self.hosts[host]
            maps = [f"{h.outer}:{p}={h.inner}:{p}" for p in ports]
            log_file = open(work / f"relay-{host}.log", "ab")  # noqa: SIM115 - child's stderr
            try:
                self.relays.append(subprocess.Popen(
                    [sys.executable, "-m", relay.MODULE, "--owner", str(os.getpid()),
                     "--delay-file", str(self.delay_file), *sum((["--map", m] for m in maps),
                                                                 [])],
                    stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                    start_new_session=True))
            finally:
                log_file.close()
            for p in ports:
                wait_port(h.outer, p, self.relays[-1])

    def client_address(self, host: int, port: int) -> str:
        """What clients (and other servers) dial for a daemon on ``host``: the daemon itself
        (netem) or its relay on the bridge address."""
        h = self.hosts[host]
        return f"{h.outer if self.method == 'relay' else h.inner}:{port}"

    def describe(self) -> dict:
        """The setup, as one JSON-able object (for a benchmark's figures)."""
        return {"hosts": self.k, "rtt_ms": self.rtt * 1e3,
                "rate_bit_s": self.rate, "delay_method": self.method,
                "addresses": [h.inner for h in self.hosts]}


# ---------------------------------------------------------------------- a cluster in the hosts


def start_cluster(hosts: SimHosts, directory: Path, *, meta_shards: int, storage_nodes: int,
                  replicas: int = 1, chunk_size: int | None = None) -> Path:
    """Write a cluster file whose servers live on the simulated hosts (meta shard i and storage
    node i on host i mod K) and start the daemons inside their namespaces; returns the cluster
    directory. Stop them with ``jpfs.localcluster.down(directory)`` (pid files as it expects)."""
    from jpfs import config

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "logs").mkdir(exist_ok=True)
    config.new_secret(directory / "secret")
    plan = [("meta", i, i % hosts.k, 7300 + i) for i in range(meta_shards)]
    plan += [("storage", i, i % hosts.k, 7400 + i) for i in range(storage_nodes)]
    cluster = config.Cluster(
        meta=tuple(config.Server(hosts.client_address(h, p), f"meta-{i}")
                   for role, i, h, p in plan if role == "meta"),
        storage=tuple(config.Server(hosts.client_address(h, p), f"storage-{i}")
                      for role, i, h, p in plan if role == "storage"),
        replicas=replicas, chunk_size=chunk_size or config.DEFAULT_CHUNK_SIZE)
    path = directory / "cluster.toml"
    config.write(cluster, path)
    procs = []
    for role, i, h, port in plan:
        cmd = ["ip", "netns", "exec", hosts.hosts[h].ns, sys.executable, "-m",
               MODULES[role],
               "--cluster", str(path), "--index", str(i), "--listen",
               hosts.listen_address(h, port), "--pid-file", str(directory / f"{role}-{i}.pid"),
               "--log-file", str(directory / "logs" / f"{role}-{i}.log"), "--no-sync"]
        with open(directory / "logs" / f"{role}-{i}.out", "ab") as out:
            procs.append((role, i, h, port, subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd=directory,
                start_new_session=True)))
    for role, i, h, port, proc in procs:
        host, p = config.parse_address(hosts.listen_address(h, port))
        try:
            _wait_in_ns(hosts, h, host, p, proc)
        except Exception as e:
            raise RuntimeError(f"{role}-{i} did not start: {e}\n"
                               + _tail(directory / "logs" / f"{role}-{i}.log")) from None
    hosts.start_relays([(h, port) for _, _, h, port, _ in procs], directory)
    return directory


def _wait_in_ns(hosts: SimHosts, h: int, host: str, port: int, proc: subprocess.Popen,
                timeout: float = 30.0) -> None:
    """Wait until ``host:port`` accepts (dialled directly: it is on a veth next to us)."""
    wait_port(host, port, proc, timeout)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> None:
    """``python -m jpfs_bench.netns clean [--dry-run]``: remove (or list) crashed runs'
    leftovers."""
    p = argparse.ArgumentParser(prog="python -m jpfs_bench.netns",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("clean", help="remove leftovers of crashed runs")
    c.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    if args.dry_run:
        print(leftovers())
    else:
        print(clean_leftovers())


if __name__ == "__main__":
    main()
