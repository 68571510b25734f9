"""What ``jpfs bench aggregate`` reads through: this process's rank (torchrun), the dataset, the
cluster (started, attached to, or on simulated hosts) and the FUSE mounts; ``Setup`` makes them
and undoes everything it made on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from .harness import free_port
from .readers import Dataset, scan_dataset

log = logging.getLogger(__name__)


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
        """Whether the job spans several hosts (more ranks than this host runs)."""
        return self.world > self.local_world

    def barrier(self) -> None:
        """Wait for every rank (nothing without torch.distributed)."""
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
        """Leave the process group, if one was made."""
        if self.dist and self.dist.is_initialized():
            self.dist.destroy_process_group()


# ---------------------------------------------------------------------- caches


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
        """Mount ``via`` afresh (empty caches, a new cache directory) in the background; the
        mountpoint."""
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
        """The mountpoint of ``via`` (KeyError if it is not mounted)."""
        return self.points[via]

    def pid(self, via: str) -> int | None:
        """The mount daemon's pid (its CPU is client CPU)."""
        return self.pids.get(via)

    def stats(self, via: str) -> dict:
        """The mount's ``.jpfs/stats``, or ``{}`` if it cannot be read."""
        import json

        try:
            return json.loads((self.points[via] / ".jpfs" / "stats").read_text())
        except (OSError, ValueError, KeyError):
            return {}

    def umount(self, via: str) -> None:
        """Unmount ``via`` (lazily and forced if a plain unmount fails) and remove its caches."""
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
        """Unmount every mount."""
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
    """Opens by outcome during an epoch, files prefetch gave the kernel before they were read
    (a read-only mount: no open at all), and the prefetch hit rate: files whose bytes were
    already prefetched (opens, and those given to the kernel), over files that needed bytes
    (not those the kernel cache served)."""
    fb, fa = before.get("fuse") or {}, after.get("fuse") or {}
    b, a = fb.get("opens", {}), fa.get("opens", {})
    opens = {k: a.get(k, 0) - b.get(k, 0) for k in a}
    handed = fa.get("handed_files", 0) - fb.get("handed_files", 0)
    needed = sum(v for k, v in opens.items() if k not in ("kernel", "empty", "write")) + handed
    return {"opens": opens, "handed": handed,
            "prefetch_hit_rate": (opens.get("prefetched", 0) + handed) / needed
            if needed else None,
            "fuse_requests": fa.get("requests_total", 0) - fb.get("requests_total", 0)}


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
        from jpfs.client.tools import import_tree

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

    moved = {role: tuple(config.Server(f"127.0.0.1:{free_port()}", srv.data) for srv in servers)
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
