"""``jpfs bench aggregate``: aggregate read bandwidth of a LeRobot dataset, side by side.

C client processes (per host) each read their share of the episodes whole (the parquet and every
camera mp4), in shuffled or name order, for E epochs: the first cold (caches dropped: the page
cache, so the servers' volumes and the local tree, and the clients' caches emptied), the rest
warm, back to back. The same units in the same order are read

  local      from the dataset's local copy with open/readinto: the baseline;
  native     through the native client (read_many per episode, --inflight at once per process);
  fuse       through a FUSE mount per host (one per via), read with open/readinto like local;
  fuse-noprefetch   the same mount with prefetch off.

Reported per via and epoch: aggregate GB/s and files/s (all bytes over the span from the common
start to the last reader's end), per-file latency p50/p99, client CPU seconds per GB (reader
processes, plus the mount daemon for FUSE), server CPU seconds per GB (local daemons), the
prefetch hit rate (FUSE: opens served from prefetched bytes), and each figure's ratio to local in
the same epoch of the same run.

Simulated hosts (root only): --hosts K puts every server in its own network namespace behind a
veth pair; --rtt adds a round-trip delay (netem, or a delaying relay where the kernel has no
netem), --rate a rate limit (tbf). With --rtt, every setting is measured at RTT 0 first, so each
delayed figure has its zero-latency baseline from the same run.

Under torchrun each rank is a host: it runs --clients reader processes on its share, ranks start
each epoch together (gloo barrier), and rank 0 prints the aggregate over all ranks. Rank 0 starts
the cluster and imports the dataset unless --cluster names a running one (required across hosts).

examples:
  jpfs bench aggregate                                  # generated dataset, local vs native
  jpfs bench aggregate --via local,native,fuse,fuse-noprefetch --epochs 3 --plot agg.png
  jpfs bench aggregate --hosts 2 --rtt 0.5ms --rate 10gbit --via local,native,fuse
  torchrun --nproc_per_node=2 --no-python jpfs bench aggregate --clients 1 --episodes 50
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import sys
import time
from collections.abc import Iterator

from .aggregate_report import add_ratios, check, merge_rounds, plot, report, targets
from .aggregate_setup import Ranks, Setup, prefetch_summary
from .harness import arg_type, drop_caches, size_arg
from .netns import parse_rate, parse_rtt
from .readers import (
    epoch_order,
    interrupt_on_sigterm,
    page_cache_drops,
    percentile,
    proc_cpu,
    run_readers,
    share,
)

log = logging.getLogger(__name__)

HELP = "aggregate read GB/s and files/s of a LeRobot dataset: local vs native vs FUSE"
DESCRIPTION = __doc__
VIAS = ("local", "native", "fuse", "fuse-noprefetch")
LATENCY_SAMPLE = 200_000
"""Per-file latencies kept per rank for the percentiles (a uniform sample beyond this)."""


def _vias(text: str) -> list[str]:
    out = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in out if v not in VIAS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"--via takes {','.join(VIAS)} (got {text!r})")
    return list(dict.fromkeys(out))


def _rtts(text: str) -> list[float]:
    return [parse_rtt(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``jpfs bench aggregate`` (the dataset, the clients, the vias, the epochs)."""
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", metavar="DIR",
                   help="a local LeRobot dataset (default: generate one with --episodes ...)")
    g.add_argument("--episodes", type=int, default=300,
                   help="episodes of the generated dataset (default 300)")
    g.add_argument("--cameras", type=int, default=2, help="cameras (default 2)")
    g.add_argument("--video-bytes", type=size_arg, default=512 * 1024, metavar="SIZE",
                   help="size of each generated stand-in mp4 (default 512K)")
    g.add_argument("--seed", type=int, default=0, help="dataset and shuffle seed (default 0)")
    g = p.add_argument_group("reading")
    g.add_argument("--via", type=_vias, default=["local", "native"],
                   help="comma-separated: local,native,fuse,fuse-noprefetch (default "
                        "local,native)")
    g.add_argument("--clients", type=int, default=2,
                   help="reader processes per host (default 2)")
    g.add_argument("--order", choices=("shuffled", "name"), default="shuffled",
                   help="episode order, reshuffled per epoch (default shuffled)")
    g.add_argument("--epochs", type=int, default=2,
                   help="epochs per via: the first cold, the rest warm (default 2)")
    g.add_argument("--rounds", type=int, default=1,
                   help="repeat everything and report the median round of each figure (default "
                        "1; 3 steadies a shared machine)")
    g.add_argument("--inflight", type=int, default=4,
                   help="native: episodes in flight per process (default 4)")
    g.add_argument("--batch", type=int, default=1,
                   help="native: episodes per read_many call (default 1)")
    g.add_argument("--threads", type=int, default=1,
                   help="local and FUSE: reader threads per process (default 1)")
    g.add_argument("--no-drop", action="store_true",
                   help="do not drop the page cache before epoch 1 (it is then reported as "
                        "not cold; client caches are still emptied)")
    g.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one epoch may take before it is cut short (default 600)")
    g = p.add_argument_group("cluster")
    g.add_argument("--cluster", metavar="FILE",
                   help="use this running cluster instead of starting one (needed across hosts)")
    g.add_argument("--jpfs-path", default="/bench/aggregate",
                   help="where the dataset is imported in JPFS (default /bench/aggregate/NAME)")
    g.add_argument("--meta-shards", type=int, default=2, help="metadata shards (default 2)")
    g.add_argument("--storage-nodes", type=int, default=None,
                   help="storage nodes (default 2, or --hosts)")
    g.add_argument("--work", metavar="DIR",
                   help="keep the generated dataset, cluster and mounts here (reused by the "
                        "next run with the same DIR; default: a temporary directory)")
    g = p.add_argument_group("simulated hosts (root; network namespaces)")
    g.add_argument("--hosts", type=int, default=0,
                   help="put the servers on K simulated hosts (network namespaces)")
    g.add_argument("--rtt", type=arg_type(_rtts), default=[],
                   help="round-trip delay(s) to the hosts, e.g. 0.5ms or 0.2ms,1ms (RTT 0 is "
                        "always measured first as the baseline)")
    g.add_argument("--rate", type=arg_type(parse_rate), default=None,
                   help="rate limit per host and direction, e.g. 10gbit")
    g.add_argument("--delay-method", choices=("auto", "netem", "relay"), default="auto",
                   help="auto: netem where the kernel has it, else a delaying relay")
    g = p.add_argument_group("output")
    g.add_argument("--plot", metavar="PNG", help="write a chart of GB/s and files/s here")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


# ---------------------------------------------------------------------- measuring


def measure_rtt(cluster_file: str, n: int = 100) -> dict:
    """Median and p99 round trip of a metadata getattr (the cheapest RPC), in ms."""
    import trio

    from jpfs import config
    from jpfs.client.wire import MetaClient
    from jpfs.types import ROOT_INO

    async def go() -> list[float]:
        async with trio.open_nursery() as nursery:
            mc = MetaClient(nursery, config.load(cluster_file))
            await mc.getattr(ROOT_INO)
            lat = []
            for _ in range(n):
                t = time.perf_counter()
                await mc.getattr(ROOT_INO)
                lat.append(time.perf_counter() - t)
            mc.close()
            nursery.cancel_scope.cancel()
        return lat

    lat = trio.run(go)
    return {"p50_ms": round(percentile(lat, 0.5) * 1e3, 3),
            "p99_ms": round(percentile(lat, 0.99) * 1e3, 3)}


def run_epoch(setup: Setup, via: str, epoch: int, rtt: float | None) -> dict:
    """One epoch of one via on this rank; on rank 0, the aggregate over all ranks."""
    args, ranks, ds = setup.args, setup.ranks, setup.dataset
    cold = epoch == 1
    order = epoch_order(len(ds.units), args.order, args.seed, epoch)
    total = ranks.world * args.clients
    mount_pid = None
    if via.startswith("fuse"):
        if cold or via not in setup.mounts.points:
            setup.mounts.mount(via)
        root = str(setup.mounts.path(via)) + setup.jpfs_root
        mount_pid = setup.mounts.pid(via)
    elif via == "native":
        root = setup.jpfs_root
    else:
        root = ds.root
    specs = []
    for c in range(args.clients):
        mine = share(order, ranks.rank * args.clients + c, total)
        units = [ds.units[k] for k in mine]
        specs.append({"via": "native" if via == "native" else "local", "root": root,
                      "cluster": setup.cluster_file, "units": units,
                      "sizes": [ds.unit_sizes(u) for u in units], "inflight": args.inflight,
                      "batch": args.batch, "threads": args.threads})
    expect_files = sum(len(u) for s in specs for u in s["units"])
    expect_bytes = sum(sum(z) for s in specs for z in s["sizes"])
    cache: dict = {"method": "none (warm epoch)", "cold": False}
    # the daemons' CPU is counted once, by rank 0 (the host that started or attached them)
    servers = setup.daemon_pids if setup.local_servers and ranks.rank == 0 else []
    marks: dict = {}

    def before_go() -> None:
        nonlocal cache
        if cold and args.no_drop:
            cache = {"method": "not dropped (--no-drop)", "cold": False}
        elif cold and ranks.local_rank != 0:
            cache = {"method": "dropped by local rank 0", "cold": None}
        elif cold:
            cache = drop_caches(setup.cache_files())
            if setup.cluster_file and not setup.local_servers and via != "local":
                cache = {**cache, "cold": False,
                         "method": cache["method"] + "; remote servers' caches not dropped"}
        ranks.barrier()  # every host's drop is done before anyone takes its marks
        if via.startswith("fuse"):
            marks["fuse"] = setup.mounts.stats(via)
        # a warm epoch counts drops since the previous epoch ended (it warmed the caches)
        marks["drops"] = page_cache_drops() if cold else setup.drops_mark
        marks["server_cpu"] = sum(proc_cpu(p) for p in servers)
        marks["mount_cpu"] = proc_cpu(mount_pid) if mount_pid else 0.0
        ranks.barrier()  # and everyone starts together

    bar = _bar(setup, f"{via} epoch {epoch} ({'cold' if cold else 'warm'})"
               + (f" rtt {rtt * 1e3:g}ms" if rtt else ""), expect_files)
    try:
        res = run_readers(specs, before_go=before_go, timeout=args.timeout,
                          progress=lambda f, b: bar.update(f))
    finally:
        bar.close()
    setup.drops_mark = page_cache_drops()
    disturbed = setup.drops_mark != marks.get("drops")
    server_cpu = sum(proc_cpu(p) for p in servers) - marks.get("server_cpu", 0.0)
    mount_cpu = (proc_cpu(mount_pid) - marks.get("mount_cpu", 0.0)) if mount_pid else 0.0
    pf = prefetch_summary(marks.get("fuse", {}), setup.mounts.stats(via)) \
        if via.startswith("fuse") else None
    lat = [x for r in res for x in r["latencies"]]
    if len(lat) > LATENCY_SAMPLE:
        lat = random.Random(0).sample(lat, LATENCY_SAMPLE)
    mine = {
        "files": sum(r["files"] for r in res), "bytes": sum(r["bytes"] for r in res),
        "expect_files": expect_files, "expect_bytes": expect_bytes,
        "seconds": max(r["end"] for r in res) - min(r["start"] for r in res),
        "client_cpu_s": sum(r["cpu_s"] for r in res) + mount_cpu,
        "server_cpu_s": server_cpu if servers else None, "latencies": lat,
        "errors": [e for r in res for e in r["errors"]][:20],
        "n_errors": sum(r["n_errors"] for r in res),
        "timed_out": any(r["timed_out"] for r in res), "cache": cache, "prefetch": pf,
        "disturbed": disturbed,
    }
    every = ranks.gather(mine)
    if ranks.rank != 0:
        return {}
    return _combine(every, via, epoch, rtt, cold)


def _combine(every: list[dict], via: str, epoch: int, rtt: float | None, cold: bool) -> dict:
    files = sum(r["files"] for r in every)
    nbytes = sum(r["bytes"] for r in every)
    secs = max(r["seconds"] for r in every)
    lat = [x for r in every for x in r["latencies"]]
    gb = nbytes / 1e9
    server = [r["server_cpu_s"] for r in every if r["server_cpu_s"] is not None]
    pf = [r["prefetch"] for r in every if r["prefetch"]]
    opens: dict[str, int] = {}
    for p in pf:
        for k, v in p["opens"].items():
            opens[k] = opens.get(k, 0) + v
    handed = sum(p.get("handed", 0) for p in pf)
    needed = sum(v for k, v in opens.items() if k not in ("kernel", "empty", "write")) + handed
    return {
        "via": via, "epoch": epoch, "rtt_ms": None if rtt is None else rtt * 1e3,
        "cold": cold and all(r["cache"]["cold"] for r in every if r["cache"]["cold"] is not None),
        "cache": every[0]["cache"]["method"],
        "files": files, "bytes": nbytes,
        "expected_files": sum(r["expect_files"] for r in every),
        "expected_bytes": sum(r["expect_bytes"] for r in every),
        "seconds": secs, "GBps": gb / secs if secs else 0.0,
        "files_per_s": files / secs if secs else 0.0,
        "latency_ms": {"p50": _ms(percentile(lat, 0.5)), "p99": _ms(percentile(lat, 0.99))},
        "client_cpu_s_per_GB": sum(r["client_cpu_s"] for r in every) / gb if gb else None,
        "server_cpu_s_per_GB": sum(server) / gb if server and gb else None,
        "prefetch_hit_rate": ((opens.get("prefetched", 0) + handed) / needed) if needed
        else None,
        "fuse_opens": opens or None,
        "fuse_handed": handed if pf else None,
        "fuse_requests_per_file": (sum(p["fuse_requests"] for p in pf) / files)
        if pf and files else None,
        "errors": [e for r in every for e in r["errors"]][:20],
        "n_errors": sum(r["n_errors"] for r in every),
        "timed_out": any(r["timed_out"] for r in every),
        "page_cache_dropped_by_others": any(r["disturbed"] for r in every),
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def _bar(setup: Setup, desc: str, total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="file", desc=desc, leave=False,
                disable=setup.args.no_progress or setup.ranks.rank != 0)


# ---------------------------------------------------------------------- the run


def _settings(args: argparse.Namespace) -> list[float | None]:
    if not args.hosts:
        if args.rtt or args.rate:
            raise SystemExit("--rtt and --rate need --hosts K (simulated hosts)")
        return [None]
    rtts = [r for r in args.rtt if r > 0]
    return [0.0, *dict.fromkeys(rtts)]


@contextlib.contextmanager
def _ranks() -> Iterator[Ranks]:
    r = Ranks()
    try:
        yield r
    finally:
        r.close()


def run(args: argparse.Namespace) -> dict:
    """Run ``jpfs bench aggregate`` (on every torchrun rank): print the report on rank 0 and return
    the figures."""
    if min(args.clients, args.epochs, args.inflight, args.threads, args.rounds, args.batch) < 1:
        raise SystemExit("--clients, --epochs, --rounds, --inflight, --batch and --threads must "
                         "be at least 1")
    settings = _settings(args)
    with interrupt_on_sigterm(), _ranks() as ranks, Setup(args, ranks) as setup:
        ds = setup.dataset
        if ranks.rank == 0:
            print(f"jpfs bench aggregate: {ds.files} files in {len(ds.units)} episodes, "
                  f"{ds.bytes / 1e9:.2f} GB; {ranks.world} host(s) x {args.clients} readers; "
                  f"{args.order} order; {args.epochs} epoch(s) per via (first cold); "
                  f"native {args.inflight} episode(s) in flight x {args.batch} per call, "
                  f"local/FUSE {args.threads} thread(s); load {_load()}", flush=True)
        raw: list[dict] = []
        network: list[dict] = []
        for rnd in range(1, args.rounds + 1):
            for rtt in settings:
                if rtt is not None and setup.hosts is not None:
                    setup.hosts.set_rtt(rtt)
                    if ranks.rank == 0:
                        m = measure_rtt(setup.cluster_file)
                        network.append({"round": rnd, "rtt_ms": rtt * 1e3,
                                        "measured_rpc_ms": m})
                        print(f"RTT {rtt * 1e3:g} ms ({setup.hosts.method}): metadata RPC "
                              f"round trip p50 {m['p50_ms']:.3f} ms, p99 {m['p99_ms']:.3f} ms",
                              flush=True)
                # one via's epochs back to back: a warm epoch follows the epoch that warmed
                # it, with no other via's cache drop in between
                for via in args.via:
                    if via == "local" and rtt:
                        continue  # local reads cross no network: measured once
                    for epoch in range(1, args.epochs + 1):
                        row = run_epoch(setup, via, epoch, rtt)
                        if ranks.rank == 0:
                            check(row)
                            raw.append({**row, "round": rnd})
        if ranks.rank != 0:
            return {"rank": ranks.rank}
        rows = merge_rounds(raw)
        add_ratios(rows)
        result = {
            "benchmark": "aggregate",
            "dataset": {"root": ds.root, "files": ds.files, "episodes": len(ds.units),
                        "bytes": ds.bytes},
            "hosts_world": ranks.world, "clients_per_host": args.clients,
            "readers": ranks.world * args.clients, "order": args.order,
            "epochs": args.epochs, "rounds": args.rounds, "via": args.via,
            "inflight": args.inflight,
            "batch": args.batch, "threads": args.threads,
            "cluster": {"file": setup.cluster_file, "local_servers": setup.local_servers,
                        "import": setup.import_stats} if setup.cluster_file else None,
            "network": ({**setup.hosts.describe(), "settings": network}
                        if setup.hosts is not None else None),
            "load_avg": _load(), "results": rows, "targets": targets(rows),
        }
        report(result)
        if args.plot:
            plot(result, args.plot)
            result["plot"] = args.plot
            print(f"chart: {args.plot}")
        return result


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> int:
    """``python -m jpfs_bench.aggregate`` (what torchrun can start without the jpfs script)."""
    from .runner import standalone

    return standalone(sys.modules[__name__], "aggregate", argv)


if __name__ == "__main__":
    raise SystemExit(main())
