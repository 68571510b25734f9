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
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .readers import (
    Dataset,
    epoch_order,
    interrupt_on_sigterm,
    page_cache_drops,
    percentile,
    proc_cpu,
    run_readers,
    scan_dataset,
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
    from .netns import parse_rtt

    try:
        return [parse_rtt(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _rate(text: str) -> int:
    from .netns import parse_rate

    try:
        return parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size(text: str) -> int:
    from jpfs.config import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", metavar="DIR",
                   help="a local LeRobot dataset (default: generate one with --episodes ...)")
    g.add_argument("--episodes", type=int, default=300,
                   help="episodes of the generated dataset (default 300)")
    g.add_argument("--cameras", type=int, default=2, help="cameras (default 2)")
    g.add_argument("--video-bytes", type=_size, default=512 * 1024, metavar="SIZE",
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
    g.add_argument("--rtt", type=_rtts, default=[],
                   help="round-trip delay(s) to the hosts, e.g. 0.5ms or 0.2ms,1ms (RTT 0 is "
                        "always measured first as the baseline)")
    g.add_argument("--rate", type=_rate, default=None,
                   help="rate limit per host and direction, e.g. 10gbit")
    g.add_argument("--delay-method", choices=("auto", "netem", "relay"), default="auto",
                   help="auto: netem where the kernel has it, else a delaying relay")
    g = p.add_argument_group("output")
    g.add_argument("--plot", metavar="PNG", help="write a chart of GB/s and files/s here")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


# ---------------------------------------------------------------------- ranks (torchrun)


class Ranks:
    """This process's place in a torchrun job (a single process without one)."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.dist = None
        if self.world > 1:
            try:
                import torch.distributed as dist
            except ImportError:
                raise SystemExit("WORLD_SIZE > 1 needs torch.distributed (pip install torch)"
                                 ) from None
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            self.dist = dist

    @property
    def multi_host(self) -> bool:
        return self.world > self.local_world

    def barrier(self) -> None:
        if self.dist:
            self.dist.barrier()

    def bcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.dist:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (on every rank)."""
        if not self.dist:
            return [obj]
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.dist and self.dist.is_initialized():
            self.dist.destroy_process_group()


# ---------------------------------------------------------------------- caches


def drop_caches(files: list[Path] | None = None) -> dict:
    """Empty the page cache (``sync``, then ``drop_caches``); where that is not permitted,
    evict the given files' pages with posix_fadvise (their own pages only)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return {"method": "drop_caches", "cold": True}
    except OSError as e:
        why = e.strerror
    evicted = 0
    for p in files or []:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            evicted += 1
        finally:
            os.close(fd)
    return {"method": f"fadvise ({evicted} files; drop_caches: {why})", "cold": evicted > 0}


def _files_under(*dirs: Path) -> list[Path]:
    out = []
    for d in dirs:
        for root, _, names in os.walk(d):
            out += [Path(root) / n for n in names]
    return out


# ---------------------------------------------------------------------- FUSE mounts


class Mounts:
    """One FUSE mount per via on this host (fuse, fuse-noprefetch), remounted empty for a cold
    epoch (fresh memory and disk caches)."""

    def __init__(self, cluster_file: str, work: Path):
        self.cluster_file = cluster_file
        self.work = work
        self.points: dict[str, Path] = {}
        self.pids: dict[str, int] = {}
        self.generation = 0

    def mount(self, via: str) -> Path:
        from jpfs.fuse import mount as fm

        self.umount(via)
        self.generation += 1
        mp = self.work / f"mnt-{via}"
        mp.mkdir(parents=True, exist_ok=True)
        cache = self.work / f"fuse-cache-{via}-{self.generation}"
        opts = fm.MountOptions(**_mount_kwargs(self.cluster_file, str(mp), str(cache),
                                               prefetch=via == "fuse", log_file=str(
                                                   self.work / f"mount-{via}.log")))
        self.pids[via] = fm.start_background(opts)
        self.points[via] = mp
        return mp

    def path(self, via: str) -> Path:
        return self.points[via]

    def pid(self, via: str) -> int | None:
        """The mount daemon's pid (its CPU is client CPU)."""
        return self.pids.get(via)

    def stats(self, via: str) -> dict:
        import json

        try:
            return json.loads((self.points[via] / ".jpfs" / "stats").read_text())
        except (OSError, ValueError, KeyError):
            return {}

    def umount(self, via: str) -> None:
        from jpfs.fuse import mount as fm

        mp = self.points.pop(via, None)
        self.pids.pop(via, None)
        if mp is None:
            return
        try:
            fm.unmount(str(mp))
        except Exception as e:  # noqa: BLE001 - cleanup goes on with the next mount
            log.warning("unmounting %s: %s; forcing", mp, e)
            with contextlib.suppress(Exception):
                fm.unmount(str(mp), lazy=True, force=True)
        for old in self.work.glob(f"fuse-cache-{via}-*"):
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        for via in list(self.points):
            self.umount(via)


def _mount_kwargs(cluster_file: str, mp: str, cache: str, *, prefetch: bool,
                  log_file: str) -> dict:
    """MountOptions for a read-only dataset mount (the fields the mount module defines)."""
    import dataclasses

    from jpfs.fuse.mount import MountOptions

    wanted = {"cluster": cluster_file, "mountpoint": mp, "cache_dir": cache,
              "prefetch": prefetch, "read_only": True, "log_file": log_file}
    names = {f.name for f in dataclasses.fields(MountOptions)}
    return {k: v for k, v in wanted.items() if k in names}


def prefetch_summary(before: dict, after: dict) -> dict:
    """Opens by outcome during an epoch, and the prefetch hit rate: opens whose bytes were
    already prefetched, over opens that needed bytes (not those the kernel cache served)."""
    b = (before.get("fuse") or {}).get("opens", {})
    a = (after.get("fuse") or {}).get("opens", {})
    opens = {k: a.get(k, 0) - b.get(k, 0) for k in a}
    needed = sum(v for k, v in opens.items() if k not in ("kernel", "empty", "write"))
    rb = (before.get("fuse") or {}).get("requests_total", 0)
    ra = (after.get("fuse") or {}).get("requests_total", 0)
    return {"opens": opens, "prefetch_hit_rate": opens.get("prefetched", 0) / needed
            if needed else None, "fuse_requests": ra - rb}


# ---------------------------------------------------------------------- the cluster


class Setup:
    """Dataset, cluster and (simulated) hosts for one run; everything made is undone on exit."""

    def __init__(self, args: argparse.Namespace, ranks: Ranks):
        self.args = args
        self.ranks = ranks
        self.stack = contextlib.ExitStack()
        self.work: Path | None = None
        self.dataset: Dataset | None = None
        self.cluster_dir: Path | None = None
        self.cluster_file: str | None = None
        self.local_servers = False  # their page cache is ours to drop, their CPU ours to count
        self.daemon_pids: list[int] = []
        self.hosts = None
        self.jpfs_root = ""
        self.mounts: Mounts | None = None
        self.import_stats: dict | None = None
        self.drops_mark = 0
        """Page-cache drops counted when the last epoch ended."""

    def __enter__(self) -> Setup:
        try:
            self._setup()
        except BaseException:
            self.stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def _setup(self) -> None:
        args, ranks = self.args, self.ranks
        if args.work:
            self.work = Path(args.work).resolve()
            self.work.mkdir(parents=True, exist_ok=True)
        else:
            self.work = Path(tempfile.mkdtemp(prefix=f"jpfs-aggregate-{ranks.rank}-"))
            self.stack.callback(shutil.rmtree, self.work, True)
        needs_cluster = any(v != "local" for v in args.via)
        if ranks.multi_host and needs_cluster and not args.cluster:
            raise SystemExit("across hosts, pass --cluster FILE (a cluster every host reaches)")
        if ranks.multi_host and not args.dataset and "local" in args.via:
            raise SystemExit("across hosts, --via local needs --dataset DIR (a dataset every "
                             "host has)")
        # the dataset: rank 0 generates (if asked) and lists it; every rank gets the listing
        listing = None
        if ranks.rank == 0:
            root = Path(args.dataset) if args.dataset else self._generate()
            listing = scan_dataset(root)
            if not listing.units:
                raise SystemExit(f"{root}: no files under data/ or videos/")
        self.dataset = ranks.bcast(listing)
        if "local" in args.via and not Path(self.dataset.root).is_dir():
            raise SystemExit(f"rank {ranks.rank}: {self.dataset.root} is not here: pass "
                             "--dataset DIR present on every host, or leave out --via local")
        if not needs_cluster:
            return
        name = Path(self.dataset.root).name or "dataset"
        self.jpfs_root = f"{args.jpfs_path.rstrip('/')}/{name}"
        info = None
        if ranks.rank == 0:
            info = self._cluster()
            self._import()
        info = ranks.bcast(info)
        self.cluster_file, self.local_servers = info["file"], info["local"]
        if args.cluster:  # every host reads its own copy of the cluster file
            from jpfs import config

            self.cluster_file = str(config.find_cluster_file(args.cluster).resolve())
        if any(v.startswith("fuse") for v in args.via):
            self.mounts = Mounts(self.cluster_file, self.work)
            self.stack.callback(self.mounts.close)
        ranks.barrier()

    def _generate(self) -> Path:
        from jpfs.lerobot.generate import generate

        args = self.args
        root = self.work / (f"lerobot-{args.episodes}ep-{args.cameras}cam-"
                            f"{args.video_bytes}b-s{args.seed}")
        done = root / ".complete"
        if done.exists():
            print(f"dataset: reusing {root}", flush=True)
            return root
        shutil.rmtree(root, ignore_errors=True)
        print(f"dataset: generating {args.episodes} episodes x {args.cameras} cameras "
              f"(LeRobot v2.1, stand-in mp4s of {args.video_bytes} bytes) in {root}", flush=True)
        generate(str(root), episodes=args.episodes, cameras=args.cameras, video="stub",
                 video_bytes=args.video_bytes, seed=args.seed, progress=not args.no_progress)
        done.touch()
        return root

    def _cluster(self) -> dict:
        """Start (or attach to) the cluster; returns what the other ranks need."""
        from jpfs import config, localcluster

        args = self.args
        if args.cluster:
            c = config.load(args.cluster)
            hosts = {config.parse_address(s.address)[0] for s in c.meta + c.storage}
            local = all(_is_local(h) for h in hosts)
            d = c.path.parent if c.path else None
            if local and d is not None:
                self.daemon_pids = [x.pid for x in _status(d) if x.pid]
                self.cluster_dir = d
            return {"file": str(c.path), "local": local}
        d = self.work / "cluster"
        nodes = args.storage_nodes or (args.hosts or 2)
        if args.hosts:
            from .netns import SimHosts, start_cluster

            if d.exists() and not (d / "cluster.toml").exists():
                shutil.rmtree(d)
            self.hosts = self.stack.enter_context(SimHosts(
                args.hosts, rtt=0.0, rate=args.rate, method=args.delay_method))
            self.stack.callback(_down, d)
            _reset_addresses(d)
            start_cluster(self.hosts, d, meta_shards=args.meta_shards, storage_nodes=nodes)
        else:
            self.stack.callback(_down, d)
            _loopback_addresses(d)
            localcluster.up(d, meta_shards=args.meta_shards, storage_nodes=nodes, sync=False)
        self.cluster_dir = d
        self.daemon_pids = [x.pid for x in _status(d) if x.pid]
        return {"file": str(d / "cluster.toml"), "local": True}

    def _import(self) -> None:
        import trio
        from tqdm import tqdm

        import jpfs
        from jpfs.client.transfer import import_tree

        ds = self.dataset
        bar = tqdm(total=ds.bytes, unit="B", unit_scale=True, desc="import",
                   disable=self.args.no_progress, leave=False)

        async def go() -> dict:
            async with jpfs.aconnect(self.cluster_file or str(self.cluster_dir)) as c:
                st = await import_tree(c, ds.root, self.jpfs_root,
                                       progress=lambda f, b: bar.update(b))
                return st.as_dict()

        t = time.monotonic()
        try:
            self.import_stats = trio.run(go)
        finally:
            bar.close()
        self.import_stats["seconds"] = round(time.monotonic() - t, 2)
        if self.import_stats["errors"]:
            raise RuntimeError(f"import failed: {self.import_stats['errors'][:5]}")
        print(f"imported into {self.jpfs_root}: {self.import_stats['files']} files copied, "
              f"{self.import_stats['skipped']} already there "
              f"({self.import_stats['seconds']:.1f} s)", flush=True)

    def cache_files(self) -> list[Path]:
        """What fadvise evicts where drop_caches is not permitted."""
        out = _files_under(Path(self.dataset.root)) if self.dataset else []
        if self.cluster_dir:
            out += [p for p in _files_under(self.cluster_dir) if p.suffix not in (".log",
                                                                                 ".out")]
        return out


def _status(d: Path) -> list:
    from jpfs import localcluster

    try:
        return localcluster.status(d)
    except (OSError, ValueError):
        return []


def _down(d: Path) -> None:
    from jpfs import localcluster

    if (d / "cluster.toml").exists():
        localcluster.down(d, timeout=10)


def _loopback_addresses(d: Path) -> None:
    """A kept cluster that last ran on simulated hosts moves back to loopback ports."""
    import dataclasses

    from jpfs import config

    path = d / "cluster.toml"
    if not path.exists():
        return
    c = config.load(path)
    if all(s.host_port[0].startswith("127.") for s in c.meta + c.storage):
        return

    def free() -> int:
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            return sk.getsockname()[1]

    moved = {role: tuple(config.Server(f"127.0.0.1:{free()}", srv.data) for srv in servers)
             for role, servers in (("meta", c.meta), ("storage", c.storage))}
    config.write(dataclasses.replace(c, **moved), path)


def _reset_addresses(d: Path) -> None:
    """A kept namespaced cluster gets new addresses each run: its data stays, its file is
    rewritten (indices, not addresses, are what metadata records)."""
    (d / "cluster.toml").unlink(missing_ok=True)


def _is_local(host: str) -> bool:
    if host in ("localhost", "::1") or host.startswith("127.") or host.startswith("10.231."):
        return True
    try:
        return host in {socket.gethostbyname(socket.gethostname())}
    except OSError:
        return False


# ---------------------------------------------------------------------- measuring


def measure_rtt(cluster_file: str, n: int = 100) -> dict:
    """Median and p99 round trip of a metadata getattr (the cheapest RPC), in ms."""
    import trio

    from jpfs import config
    from jpfs.client.meta import MetaClient
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
    needed = sum(v for k, v in opens.items() if k not in ("kernel", "empty", "write"))
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
        "prefetch_hit_rate": (opens.get("prefetched", 0) / needed) if needed else None,
        "fuse_opens": opens or None,
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
                            _check(row)
                            raw.append({**row, "round": rnd})
        if ranks.rank != 0:
            return {"rank": ranks.rank}
        rows = merge_rounds(raw)
        _ratios(rows)
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


def merge_rounds(raw: list[dict]) -> list[dict]:
    """One row per (via, epoch, RTT): the round with the median GB/s (so its latencies and CPU
    figures belong together), with every round's GB/s and files/s alongside."""
    groups: dict[tuple, list[dict]] = {}
    for r in raw:
        groups.setdefault((r["via"], r["epoch"], r["rtt_ms"]), []).append(r)
    out = []
    for rs in groups.values():
        mid = sorted(rs, key=lambda r: r["GBps"])[len(rs) // 2]
        out.append({**mid, "rounds": len(rs),
                    "GBps_rounds": [r["GBps"] for r in rs],
                    "files_per_s_rounds": [r["files_per_s"] for r in rs],
                    "page_cache_dropped_by_others": any(r["page_cache_dropped_by_others"]
                                                        for r in rs)})
    return out


def _check(row: dict) -> None:
    if row["n_errors"] or row["timed_out"]:
        raise RuntimeError(f"{row['via']} epoch {row['epoch']}: {row['n_errors']} read "
                           f"error(s){' and a timeout' if row['timed_out'] else ''}: "
                           f"{row['errors'][:5]}")
    if row["files"] != row["expected_files"] or row["bytes"] != row["expected_bytes"]:
        raise RuntimeError(f"{row['via']} epoch {row['epoch']}: read {row['files']} files / "
                           f"{row['bytes']} bytes, expected {row['expected_files']} / "
                           f"{row['expected_bytes']}")


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _ratios(rows: list[dict]) -> None:
    """Each row's GB/s and files/s against local in the same epoch (local has no RTT)."""
    for r in rows:
        base = next((b for b in rows if b["via"] == "local" and b["epoch"] == r["epoch"]), None)
        r["vs_local"] = None if base is None or r["via"] == "local" else {
            "GBps": r["GBps"] / base["GBps"] if base["GBps"] else None,
            "files_per_s": r["files_per_s"] / base["files_per_s"] if base["files_per_s"]
            else None}


def targets(rows: list[dict]) -> dict:
    """The issue's target ratios, where this run measured them (None otherwise)."""
    def get(via: str, epoch: int, rtt: float | None = None) -> dict | None:
        cands = [r for r in rows if r["via"] == via and r["epoch"] == epoch
                 and (r["rtt_ms"] or 0) == (rtt or 0)]
        return cands[0] if cands else None

    def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
        return a[key] / b[key] if a and b and b[key] else None

    last = max((r["epoch"] for r in rows), default=1)
    warm = last if last > 1 else None
    out: dict[str, Any] = {}
    if warm:
        out["native_warm_GBps_vs_local"] = ratio(get("native", warm), get("local", warm), "GBps")
        out["fuse_warm_GBps_vs_local"] = ratio(get("fuse", warm), get("local", warm), "GBps")
    out["native_cold_GBps_vs_local"] = ratio(get("native", 1), get("local", 1), "GBps")
    out["fuse_epoch1_files_prefetch_vs_none"] = ratio(get("fuse", 1), get("fuse-noprefetch", 1),
                                                      "files_per_s")
    rtts = sorted({r["rtt_ms"] for r in rows if r["rtt_ms"]})
    for rtt in rtts:
        for via in ("fuse", "native", "fuse-noprefetch"):
            for ep in (1, warm) if warm else (1,):
                k = f"{via}_epoch{ep}_files_rtt{rtt:g}ms_vs_rtt0"
                v = ratio(get(via, ep, rtt), get(via, ep, 0.0), "files_per_s")
                if v is not None:
                    out[k] = v
    return out


TARGETS = {
    "native_warm_GBps_vs_local": ("native warm GB/s vs local warm", None),
    "fuse_warm_GBps_vs_local": ("FUSE warm GB/s vs local warm", None),
    "native_cold_GBps_vs_local": ("native cold GB/s vs local cold", None),
    "fuse_epoch1_files_prefetch_vs_none": ("FUSE epoch 1 files/s, prefetch vs none", None),
}


def report(result: dict) -> None:
    from .harness import fmt_rate, print_table

    rows = result["results"]
    headers = ["via", "epoch", "GB/s", "files/s", "vs local", "p50 ms", "p99 ms",
               "CPU s/GB cli", "srv", "prefetch"]
    has_rtt = any(r["rtt_ms"] is not None for r in rows)
    if has_rtt:
        headers.insert(1, "rtt")
    table = []
    for r in rows:
        vs = r.get("vs_local")
        state = "cold" if r["cold"] else ("warm" if r["epoch"] > 1 else "not cold")
        if r["page_cache_dropped_by_others"]:
            state += "*"
        row = [r["via"], f"{r['epoch']} {state}",
               f"{r['GBps']:.2f}", fmt_rate(r["files_per_s"]),
               "-" if not vs or vs["GBps"] is None else f"{vs['GBps']:.2f}x",
               _f(r["latency_ms"]["p50"]), _f(r["latency_ms"]["p99"]),
               _f(r["client_cpu_s_per_GB"]), _f(r["server_cpu_s_per_GB"]),
               "-" if r["prefetch_hit_rate"] is None else f"{r['prefetch_hit_rate']:.0%}"]
        if has_rtt:
            row.insert(1, "-" if r["rtt_ms"] is None else f"{r['rtt_ms']:g}ms")
        table.append(row)
    print()
    rounds = f"; median of {result['rounds']} rounds" if result["rounds"] > 1 else ""
    print_table(headers, table, title=f"aggregate reads: {result['dataset']['files']} files, "
                f"{result['dataset']['bytes'] / 1e9:.2f} GB, {result['readers']} reader "
                f"process(es){rounds}; load {result['load_avg']}")
    notes = sorted({r["cache"] for r in rows if r["epoch"] == 1})
    print("epoch 1 caches: " + "; ".join(notes))
    if any(r["page_cache_dropped_by_others"] for r in rows):
        print("* another process dropped the page cache during this measurement (shared "
              "machine): its figure is not what its label says")
    t = {k: v for k, v in result["targets"].items() if v is not None}
    if t:
        print("ratios:")
        for k, v in t.items():
            label = TARGETS.get(k, (k.replace("_", " "), None))[0]
            goal = " (target >= 0.50)" if k.startswith("fuse_") and "_rtt" in k \
                and "noprefetch" not in k else ""
            print(f"  {label}: {v:.2f}x{goal}")


def _f(x: float | None) -> str:
    return "-" if x is None else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def plot(result: dict, path: str) -> None:
    """Grouped bars: GB/s and files/s per via, epoch (and RTT), with ratios to local."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    groups = []
    for r in rows:
        g = (r["epoch"], r["rtt_ms"] or 0)
        if g not in groups:
            groups.append(g)
    vias = list(dict.fromkeys(r["via"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(1, len(vias))
    for ax, key, label in ((axes[0], "GBps", "GB/s"), (axes[1], "files_per_s", "files/s")):
        for j, via in enumerate(vias):
            xs, ys, tags = [], [], []
            for i, (ep, rtt) in enumerate(groups):
                r = next((x for x in rows if x["via"] == via and x["epoch"] == ep
                          and (x["rtt_ms"] or 0) == rtt), None)
                if r is None and via == "local":
                    r = next((x for x in rows if x["via"] == "local" and x["epoch"] == ep),
                             None)
                if r is None:
                    continue
                xs.append(i + (j - (len(vias) - 1) / 2) * width)
                ys.append(r[key])
                vs = r.get("vs_local")
                tags.append((f"{vs[key]:.2f}x" if vs and vs.get(key) else "")
                            + ("*" if r.get("page_cache_dropped_by_others") else ""))
            bars = ax.bar(xs, ys, width, label=via)
            for b, tag in zip(bars, tags, strict=True):
                if tag:
                    ax.annotate(tag, (b.get_x() + b.get_width() / 2, b.get_height()),
                                ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"epoch {ep} ({'cold' if ep == 1 else 'warm'})"
                            + (f"\nrtt {rtt:g} ms" if rtt else "") for ep, rtt in groups],
                           fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    ds = result["dataset"]
    fig.suptitle(f"jpfs bench aggregate: {ds['files']} files, {ds['bytes'] / 1e9:.2f} GB, "
                 f"{result['readers']} readers; ratios vs local, same epoch; load "
                 f"{result['load_avg'][0]:g} on {os.cpu_count()} CPUs", fontsize=10)
    if any(r.get("page_cache_dropped_by_others") for r in rows):
        fig.text(0.01, 0.01, "* another process dropped the page cache during this measurement",
                 fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """``python -m jpfs_bench.aggregate`` (what torchrun can start without the jpfs script)."""
    from .entry import standalone

    return standalone(sys.modules[__name__], "aggregate", argv)


if __name__ == "__main__":
    raise SystemExit(main())
