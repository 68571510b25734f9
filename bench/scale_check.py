"""``python -m jpfs_bench.scale_check``: the shape of JPFS's scaling on simulated hosts, measured
for docs/scale.md.

S server hosts (metadata shard i and storage node i on host i) and C client hosts are network
namespaces on one bridge (``netns.py``). Each client host runs one process *inside its own
namespace* (joined with setns(2) before it opens a socket), so its traffic leaves through its own
veth and address, as from its own machine; the daemons' CPU and the client processes' CPU are
counted apart. For every (S, C):

  read   one reader per client host reads its share of a LeRobot-shaped dataset whole through
         the native client (``read_many`` per episode, ``--inflight`` episodes in flight), the
         page cache warm (this measures the servers and the network path, not the VM's disk);
         aggregate GB/s and files/s over the span from the common start to the last end.
  meta   one metadata client per client host runs ``jpfs bench meta``'s client (create with
         ``--meta-inflight`` in flight, stat one at a time, stat in flight, batched stat, list,
         remove) in a private directory of its own; aggregate ops/s per phase.

Before them, two measurements without namespaces:

  etcd         a local etcd (as ``jpfs cluster up`` starts one): lease renewals and reads of a
               cluster map of ``--map-shards`` x 3 copies and ``--map-nodes`` storage nodes,
               through the JSON gateway JPFS speaks, then ``--watchers`` watch streams on the map
               and ``--map-changes`` changes fanned out to all: etcd's CPU per renewal, per read
               and per notification, and its memory per stream.
  connections  ``--connections`` idle authenticated connections to one shard and one storage
               daemon: the daemon's memory per connection and CPU per handshake.

Beside each figure: the whole machine's busy CPU over the phase (from /proc/stat, in cores: other
processes on a shared machine included) and the daemons', relays' and clients' CPU seconds, which
says when the run stopped measuring JPFS and started measuring this machine's two cores.

This kernel has no netem, so every server host sits behind a relay process (``relay.py``) in this
namespace: its copies are part of the server-side CPU reported as ``relay``. Shards run with
``--no-sync`` (``netns.start_cluster``), as in ``jpfs bench aggregate --hosts``.

example:
  python -m jpfs_bench.scale_check --servers 1,2 --clients 1,2,4 --json
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import queue as _queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from .harness import Phase, arg_type, size_arg
from .netns import SimHosts, parse_rate, start_cluster
from .readers import Dataset, epoch_order, proc_cpu, scan_dataset, share, worker_main
from .scale_services import measure_connections, measure_etcd

HELP = "aggregate read GB/s and metadata ops/s against 1, 2, 4 simulated client hosts"
DESCRIPTION = __doc__
CLONE_NEWNET = 0x40000000
META_PHASES = ("create", "stat", "stat_inflight", "stat_batched", "list", "remove")


def _ints(text: str) -> list[int]:
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise ValueError(f"a comma-separated list of positive counts, not {text!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m jpfs_bench.scale_check``."""
    p.add_argument("--servers", type=arg_type(_ints), default=[1, 2],
                   help="server hosts to measure, each with one shard and one storage node "
                        "(default 1,2)")
    p.add_argument("--clients", type=arg_type(_ints), default=[1, 2, 4],
                   help="client hosts to measure, one process each (default 1,2,4)")
    p.add_argument("--episodes", type=int, default=600, help="dataset episodes (default 600)")
    p.add_argument("--cameras", type=int, default=2, help="cameras (default 2)")
    p.add_argument("--video-bytes", type=size_arg, default=512 * 1024, metavar="SIZE",
                   help="size of each stand-in mp4 (default 512K)")
    p.add_argument("--inflight", type=int, default=4,
                   help="episodes in flight per reader (default 4)")
    p.add_argument("--rounds", type=int, default=3,
                   help="read epochs per (S, C); the median is reported (default 3)")
    p.add_argument("--files", type=int, default=5000,
                   help="files per metadata client (default 5000)")
    p.add_argument("--meta-inflight", type=int, default=16,
                   help="calls in flight per metadata client for create/remove (default 16)")
    p.add_argument("--rate", type=arg_type(parse_rate), default=None,
                   help="rate limit per host and direction, e.g. 10gbit (default none)")
    p.add_argument("--no-meta", action="store_true", help="skip the metadata phases")
    p.add_argument("--no-read", action="store_true", help="skip the read phases")
    p.add_argument("--no-etcd", action="store_true", help="skip the etcd phase")
    p.add_argument("--connections", type=int, default=2000,
                   help="idle client connections opened to one shard and one storage daemon, "
                        "to measure their memory and handshake CPU (default 2000; 0: skip)")
    p.add_argument("--etcd-tasks", type=int, default=32,
                   help="etcd: leases renewed concurrently, as fast as they go (default 32)")
    p.add_argument("--etcd-seconds", type=float, default=5.0,
                   help="etcd: seconds of renewals (default 5)")
    p.add_argument("--watchers", type=int, default=500,
                   help="etcd: watch streams on the map key (default 500)")
    p.add_argument("--map-changes", type=int, default=20,
                   help="etcd: map changes fanned out to the watchers (default 20)")
    p.add_argument("--map-shards", type=int, default=64,
                   help="etcd: shards (3 copies each) in the map stored (default 64)")
    p.add_argument("--map-nodes", type=int, default=256,
                   help="etcd: storage nodes in the map stored (default 256)")
    p.add_argument("--work", metavar="DIR",
                   help="keep the generated dataset here (reused by the next run)")


# ---------------------------------------------------------------------- processes in a namespace


def enter_netns(ns: str) -> None:
    """Move this process into network namespace ``ns`` (before it opens any socket)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _reader_in_ns(ns: str, spec: dict, go, out) -> None:
    enter_netns(ns)
    worker_main(spec, go, out)


def _meta_in_ns(ns: str, cluster: str, idx: int, directory: str, n: int, inflight: int,
                barrier, out) -> None:
    from .meta import _jpfs_client

    enter_netns(ns)
    _jpfs_client(cluster, idx, directory, n, inflight, barrier, out)


class _ServerHosts:
    """The first ``k`` hosts of a SimHosts, as ``netns.start_cluster`` sees hosts: the servers
    go there; the other hosts are left to clients."""

    def __init__(self, hosts: SimHosts, k: int):
        self._all = hosts
        self.k = k
        self.hosts = hosts.hosts[:k]

    def client_address(self, host: int, port: int) -> str:
        return self._all.client_address(host, port)

    def listen_address(self, host: int, port: int) -> str:
        return self._all.listen_address(host, port)

    def start_relays(self, endpoints, work: Path) -> None:
        self._all.start_relays(endpoints, work)


# ---------------------------------------------------------------------- CPU accounting


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields) - idle) / tick, sum(fields) / tick


class BusySampler:
    """The machine's busy CPU and the CPU of named process groups, sampled every ``period``
    seconds in a thread, so what each used during any span of wall-clock time
    (``time.time()``) can be told afterwards. Groups may gain pids while it runs."""

    def __init__(self, groups: dict[str, list[int]], period: float = 0.05):
        self.groups = groups
        self.period = period
        self.samples: list[tuple[float, float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="busy-sampler")

    def __enter__(self) -> BusySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), machine_busy()[0],
                                 {g: sum(proc_cpu(p) for p in list(pids))
                                  for g, pids in self.groups.items()}))
            self._stop.wait(self.period)

    def span(self, t0: float, t1: float) -> tuple[float, float, dict[str, float]] | None:
        """(seconds, machine busy CPU s, {group: CPU s}) between the first and last samples
        inside ``t0``..``t1``; None when the span holds fewer than two samples."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        a, b = inside[0], inside[-1]
        return b[0] - a[0], b[1] - a[1], {g: b[2][g] - a[2][g] for g in a[2]}


# ---------------------------------------------------------------------- phases


def _receive(out, procs, until: float) -> tuple:
    while True:
        left = until - time.monotonic()
        if left <= 0:
            raise TimeoutError("client processes did not finish in time")
        try:
            msg = out.get(timeout=min(left, 1.0))
        except _queue.Empty:
            dead = [p.name for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"client processes died: {', '.join(dead)}") from None
            continue
        if msg[0] == "error":
            raise RuntimeError(f"client {msg[1]} failed:\n{msg[2]}")
        if msg[0] != "tick":
            return msg


def read_epoch(namespaces: list[str], ds: Dataset, root: str, cluster: str, inflight: int,
               epoch: int, groups: dict[str, list[int]], timeout: float = 600.0) -> dict:
    """One epoch: one native reader per client namespace, each its share of the episodes."""
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    order = epoch_order(len(ds.units), "shuffled", 0, epoch)
    procs = []
    for i, ns in enumerate(namespaces):
        units = [ds.units[k] for k in share(order, i, len(namespaces))]
        spec = {"via": "native", "root": root, "cluster": cluster, "units": units,
                "sizes": [ds.unit_sizes(u) for u in units], "inflight": inflight, "batch": 1,
                "threads": 1, "index": i, "start_timeout": 120.0, "timeout": timeout}
        procs.append(ctx.Process(target=_reader_in_ns, args=(ns, spec, go, out), daemon=True,
                                 name=f"scale-reader-{i}"))
    try:
        for p in procs:
            p.start()
        until = time.monotonic() + 120
        for _ in procs:
            _receive(out, procs, until)  # ready
        with BusySampler(groups) as busy:
            t0 = time.time()
            go.set()
            results = [_receive(out, procs, time.monotonic() + timeout + 30)[2] for _ in procs]
            time.sleep(2 * busy.period)
            t1 = time.time()
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    errors = sum(r["n_errors"] for r in results)
    if errors:
        raise RuntimeError(f"{errors} read errors, e.g. {results[0]['errors'][:3]}")
    files = sum(r["files"] for r in results)
    nbytes = sum(r["bytes"] for r in results)
    if files != ds.files:
        raise RuntimeError(f"read {files} files of {ds.files}")
    secs = max(r["end"] for r in results) - min(r["start"] for r in results)
    sp = busy.span(t0, t1)
    wall, machine, cpu = sp if sp else (secs, 0.0, {g: 0.0 for g in groups})
    cpu["reader"] = sum(r["cpu_s"] for r in results)
    gb = nbytes / 1e9
    return {"GBps": gb / secs, "files_per_s": files / secs, "seconds": secs, "bytes": nbytes,
            "files": files, "machine_busy_cores": round(machine / wall, 2),
            "ours_cores": round(sum(cpu.values()) / wall, 2),
            **{f"{g}_cpu_s_per_GB": round(c / gb, 3) for g, c in cpu.items()}}


def meta_phases(namespaces: list[str], cluster_dir: str, base: str, n: int, inflight: int,
                meta_pids: list[int], relay_pids: list[int]) -> dict:
    """``jpfs bench meta``'s client phases, one client per namespace, private directories."""
    import jpfs

    dirs = [f"{base}/c{i}" for i in range(len(namespaces))]
    c = jpfs.connect(cluster_dir)
    try:
        for d in dirs:
            c.makedirs(d)
        shards = {d: c.stat(d).ino >> 48 for d in dirs}
    finally:
        c.close()
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(len(namespaces)), ctx.Queue()
    procs = [ctx.Process(target=_meta_in_ns, args=(ns, cluster_dir, i, dirs[i], n, inflight,
                                                   barrier, out), name=f"scale-meta-{i}")
             for i, ns in enumerate(namespaces)]
    groups: dict[str, list[int]] = {"shard": meta_pids, "relay": relay_pids, "client": []}
    try:
        with BusySampler(groups) as busy:
            for p in procs:
                p.start()
                groups["client"].append(p.pid or 0)
            got = [_receive(out, procs, time.monotonic() + 900)[1] for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    phases = {name: Phase() for name in META_PHASES}
    for res in got:
        for name, (ops, t0, t1) in res.items():
            phases[name].add(ops, t0, t1)
    out_phases = {}
    for k, v in phases.items():
        row: dict = {"ops_per_s": round(v.rate), "seconds": round(v.seconds, 3)}
        sp = busy.span(v.start, v.end)
        if sp and v.rate:
            secs, machine, cpu = sp
            row["machine_busy_cores"] = round(machine / secs, 2)
            row["ours_cores"] = round(sum(cpu.values()) / secs, 2)
            # each group's CPU over the span, per op at the phase's rate over that span
            row.update({f"{g}_cpu_us_per_op": round(c / (v.rate * secs) * 1e6, 1)
                        for g, c in cpu.items()})
        out_phases[k] = row
    return {"phases": out_phases, "dir_shards": sorted(shards.values())}


# ---------------------------------------------------------------------- the run


def _dataset(args: argparse.Namespace, work: Path) -> Dataset:
    from jpfs.lerobot.generate import generate

    root = work / f"lerobot-{args.episodes}ep-{args.cameras}cam-{args.video_bytes}b"
    if not (root / ".complete").exists():
        shutil.rmtree(root, ignore_errors=True)
        print(f"dataset: generating {args.episodes} episodes in {root}", flush=True)
        generate(str(root), episodes=args.episodes, cameras=args.cameras, video="stub",
                 video_bytes=args.video_bytes, seed=0, progress=False)
        (root / ".complete").touch()
    return scan_dataset(root)


def _import(cluster_dir: Path, ds: Dataset, dest: str) -> float:
    import trio

    import jpfs
    from jpfs.client.tools import import_tree

    async def go() -> dict:
        async with jpfs.aconnect(str(cluster_dir)) as c:
            return (await import_tree(c, ds.root, dest)).as_dict()

    t = time.monotonic()
    st = trio.run(go)
    if st["errors"]:
        raise RuntimeError(f"import failed: {st['errors'][:5]}")
    return time.monotonic() - t


def _pids(d: Path) -> dict[str, list[int]]:
    from jpfs import localcluster

    out: dict[str, list[int]] = {"meta": [], "storage": []}
    for x in localcluster.status(d):
        if x.pid:
            out.setdefault(x.role, []).append(x.pid)
    return out


def measure_servers(s: int, args: argparse.Namespace, ds: Dataset, work: Path) -> list[dict]:
    """Every client count against one cluster of ``s`` server hosts."""
    from jpfs import localcluster

    rows = []
    cmax = max(args.clients)
    with SimHosts(s + cmax, rate=args.rate, method="relay") as hosts:
        d = work / f"cluster-s{s}"
        shutil.rmtree(d, ignore_errors=True)
        try:
            start_cluster(_ServerHosts(hosts, s), d, meta_shards=s, storage_nodes=s)  # type: ignore[arg-type]
            groups = _pids(d)
            groups["relay"] = [p.pid for p in hosts.relays]
            root = "/scale/" + Path(ds.root).name
            secs = 0.0 if args.no_read else _import(d, ds, root)
            print(f"{s} server host(s): cluster up, dataset imported ({secs:.1f} s)", flush=True)
            for c in args.clients:
                client_ns = [h.ns for h in hosts.hosts[s:s + c]]
                row: dict = {"servers": s, "clients": c, "load_avg": os.getloadavg()[0]}
                if not args.no_read:
                    epochs = []
                    for e in range(args.rounds):
                        epochs.append(read_epoch(client_ns, ds, root, str(d / "cluster.toml"),
                                                 args.inflight, e + 1, groups))
                    med = sorted(epochs, key=lambda r: r["GBps"])[len(epochs) // 2]
                    row["read"] = {**med, "GBps_all": [round(r["GBps"], 3) for r in epochs]}
                if not args.no_meta:
                    row["meta"] = meta_phases(client_ns, str(d), f"/scalemeta/c{c}", args.files,
                                              args.meta_inflight, groups["meta"],
                                              groups["relay"])
                rows.append(row)
                _print_row(row)
        finally:
            if (d / "cluster.toml").exists():
                localcluster.down(d, timeout=10)
    return rows


def _print_row(row: dict) -> None:
    print(f"  S={row['servers']} C={row['clients']}", flush=True)
    if "read" in row:
        r = row["read"]
        print(f"    read {r['GBps']:.3f} GB/s ({r['files_per_s']:.0f} files/s; epochs "
              f"{r['GBps_all']}); cores: ours {r['ours_cores']}, machine "
              f"{r['machine_busy_cores']}; CPU s/GB: " + ", ".join(
                  f"{k[:-len('_cpu_s_per_GB')]} {v}" for k, v in r.items()
                  if k.endswith("_cpu_s_per_GB")), flush=True)
    for k, v in row.get("meta", {}).get("phases", {}).items():
        print(f"    {k:13} {v['ops_per_s']:>7}/s; cores ours {v.get('ours_cores')} machine "
              f"{v.get('machine_busy_cores')}; CPU us/op: " + ", ".join(
                  f"{g[:-len('_cpu_us_per_op')]} {x}" for g, x in v.items()
                  if g.endswith("_cpu_us_per_op")), flush=True)


def run(args: argparse.Namespace) -> dict:
    """Run every (servers, clients) configuration on simulated hosts (needs root); the figures."""
    if os.geteuid() != 0:
        raise SystemExit("scale_check needs root (network namespaces)")
    if args.work:
        work = Path(args.work).resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="jpfs-scale-"))
    try:
        print(f"scale_check: servers {args.servers}, client hosts {args.clients}; load "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        etcd = None
        if not args.no_etcd:
            etcd = measure_etcd(args, work)
            print(f"etcd: {etcd}", flush=True)
        conns = None
        if args.connections > 0:
            conns = measure_connections(args.connections, work)
            print(f"connections: {conns}", flush=True)
        rows: list[dict] = []
        dataset = None
        if not (args.no_read and args.no_meta):
            ds = _dataset(args, work)
            dataset = {"files": ds.files, "bytes": ds.bytes, "episodes": len(ds.units)}
            print(f"dataset: {ds.files} files in {len(ds.units)} episodes, "
                  f"{ds.bytes / 1e9:.2f} GB", flush=True)
            for s in args.servers:
                rows += measure_servers(s, args, ds, work)
        return {"benchmark": "scale_check", "etcd": etcd, "connections": conns,
                "dataset": dataset,
                "files_per_meta_client": args.files, "inflight": args.inflight,
                "meta_inflight": args.meta_inflight, "rate_bit_s": args.rate,
                "cores": os.cpu_count(), "rows": rows,
                "median_load": statistics.median(r["load_avg"] for r in rows) if rows else None}
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m jpfs_bench.scale_check`` (not a ``jpfs bench`` subcommand: a check for one
    document, root only)."""
    from .runner import run as run_one

    p = argparse.ArgumentParser(prog="python -m jpfs_bench.scale_check",
                                description=__doc__.replace("``", ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--json", action="store_true",
                   help="print the figures as one JSON object on the last line")
    return run_one(sys.modules[__name__], p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
