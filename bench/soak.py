"""A training job through faults: ShardDataset epochs over ``jpfs://`` and through a mount while
a loop kills or pauses a random metadata leader, storage node or etcd and brings it back.

The cluster: 2 shards of 3 copies on etcd, 3 storage nodes, 2 replicas of every chunk. The
dataset: a generated LeRobot v2.1 tree (tabular: the faults, not video decoding, are under
test), imported into JPFS and mounted read-only. Every ``--fault-every`` seconds one fault, in
turn: a shard leader SIGKILLed and restarted once another copy leads, a shard leader
SIGSTOPped until another copy leads, a storage node SIGKILLed and restarted 2 s later, etcd
SIGSTOPped for 3 s. Each epoch (a DataLoader with ``--workers`` workers, shuffled by epoch) is
checked sample by sample against the same dataset read from the local disk: every sample
delivered exactly once and equal to the source. Reported: the wait for an epoch's first sample
(opening the dataset: metadata reads that may meet a fault), samples/s over the run, the lowest
rate of any second in the 10 s after a fault began (the dip) beside the run's median second,
and the seconds until a second's rate came back to 80 % of that median (the recovery).
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .harness import Mount, print_table, temporary_cluster

HELP = "ShardDataset epochs through killed and paused daemons: exactly once, and the dip"
DESCRIPTION = __doc__

FAULTS = ("kill_leader", "pause_leader", "kill_storage", "pause_etcd")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``jpfs bench soak``."""
    p.add_argument("--episodes", type=int, default=200, help="episodes generated (default 200)")
    p.add_argument("--epochs", type=int, default=4, help="epochs per way in (default 4)")
    p.add_argument("--via", default="jpfs,mount",
                   help="ways in, comma-separated: jpfs (jpfs:// URLs, the native client) and "
                        "mount (a read-only mount's paths) (default both)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    p.add_argument("--fault-every", type=float, default=4.0,
                   help="seconds between the end of one fault and the next (default 4)")
    p.add_argument("--seed", type=int, default=0, help="the faults' order and the shuffle")


def _reference(root: str) -> dict[int, dict[str, Any]]:
    from jpfs.torch import ShardDataset

    ds = ShardDataset(root, shuffle=False, video=False, worker_sharing=None)
    return {int(s["index"]): s for s in ds}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    a, b = ({k: v for k, v in x.items() if not k.startswith("_")} for x in (a, b))
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
               for k in a)


class Faults:
    """The fault loop, on a thread of its own: one fault every ``every`` seconds, in turn, each
    recorded with when it began and ended."""

    def __init__(self, d: Path, every: float, seed: int):
        self.d = d
        self.every = every
        self.rnd = random.Random(seed)
        self.log: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="faults", daemon=True)

    def __enter__(self) -> Faults:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        if self.error is not None and exc[0] is None:
            raise RuntimeError(f"the fault loop failed: {self.error!r}") from self.error

    def _run(self) -> None:
        try:
            k = 0
            while not self.stop.wait(self.every):
                kind = FAULTS[k % len(FAULTS)]
                k += 1
                t0 = time.monotonic()
                what = getattr(self, kind)()
                self.log.append({"fault": kind, "what": what, "start": t0,
                                 "end": time.monotonic()})
        except BaseException as e:  # reported by __exit__
            self.error = e

    def _pid(self, name: str) -> int:
        return int((self.d / f"{name}.pid").read_text())

    def kill_leader(self) -> str:
        """SIGKILL a shard's leader; restart it once another copy leads."""
        from jpfs import localcluster

        from .heal_meta import _leader

        shard = self.rnd.randrange(2)
        victim = _leader(self.d, shard)
        localcluster.kill(self.d, "meta", shard, replica=victim)
        self._new_leader(shard, victim)
        localcluster.start(self.d, "meta", shard, replica=victim)
        return f"shard {shard} copy {victim}"

    def pause_leader(self) -> str:
        """SIGSTOP a shard's leader until another copy leads."""
        from jpfs import localcluster

        from .heal_meta import _leader

        shard = self.rnd.randrange(2)
        victim = _leader(self.d, shard)
        pid = self._pid(localcluster.daemon_name("meta", shard, victim))
        signal_pid(pid, signal.SIGSTOP)
        try:
            self._new_leader(shard, victim)
        finally:
            signal_pid(pid, signal.SIGCONT)
        return f"shard {shard} copy {victim}"

    def _new_leader(self, shard: int, old: int, timeout: float = 60.0) -> None:
        from .heal_meta import _leader

        deadline = time.monotonic() + timeout
        while _leader(self.d, shard, timeout=timeout) == old:
            if time.monotonic() > deadline:
                raise RuntimeError(f"shard {shard}: copy {old} still leads after {timeout} s")
            time.sleep(0.2)

    def kill_storage(self) -> str:
        """SIGKILL a storage node; restart it 2 s later."""
        from jpfs import localcluster

        node = self.rnd.randrange(3)
        localcluster.kill(self.d, "storage", node)
        time.sleep(2.0)
        localcluster.start(self.d, "storage", node)
        return f"storage node {node}"

    def pause_etcd(self) -> str:
        """SIGSTOP etcd for 3 s."""
        pid = self._pid("etcd")
        signal_pid(pid, signal.SIGSTOP)
        try:
            time.sleep(3.0)
        finally:
            signal_pid(pid, signal.SIGCONT)
        return "etcd"


def signal_pid(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid``."""
    import os

    os.kill(pid, sig)


def _epoch(root: str, epoch: int, seed: int, workers: int, storage_options: dict | None,
           reference: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One shuffled epoch through a DataLoader: the time each sample arrived, and every sample
    that was missing, repeated or unequal to the source."""
    from torch.utils.data import DataLoader

    from jpfs.torch import ShardDataset

    began = time.monotonic()
    ds = ShardDataset(root, shuffle=True, seed=seed, video=False,
                      storage_options=storage_options)
    ds.set_epoch(epoch)
    seen: dict[int, int] = {}
    wrong: list[int] = []
    times: list[float] = []
    loader = DataLoader(ds, batch_size=None, num_workers=workers)
    for s in loader:
        times.append(time.monotonic())
        i = int(s["index"])
        seen[i] = seen.get(i, 0) + 1
        if i not in reference or not _same(s, reference[i]):
            wrong.append(i)
    return {"times": times, "began": began, "missing": sorted(set(reference) - set(seen)),
            "repeated": sorted(i for i, n in seen.items() if n > 1), "wrong": sorted(wrong)}


def _rates(times: list[float]) -> tuple[float, list[tuple[float, int]]]:
    """The median samples per whole second, and (second start, samples) for every second."""
    if not times:
        return 0.0, []
    t0 = times[0]
    counts: dict[int, int] = {}
    for t in times:
        counts[int(t - t0)] = counts.get(int(t - t0), 0) + 1
    last = int(times[-1] - t0)
    seconds = [(t0 + k, counts.get(k, 0)) for k in range(last)]  # whole seconds only
    return (statistics.median(n for _, n in seconds) if seconds else float(len(times)),
            seconds)


def _dips(faults: list[dict[str, Any]], seconds: list[tuple[float, int]], median: float
          ) -> list[dict[str, Any]]:
    """For each fault that began within the epoch: the lowest second in the 10 s from its start,
    and the seconds from its start to the end of the first second after that low that was
    back to 80 % of the median (0 when it never fell below)."""
    out = []
    if not seconds:
        return out
    first, last = seconds[0][0], seconds[-1][0] + 1
    for f in faults:
        if not first <= f["start"] < last:
            continue
        window = [(t, n) for t, n in seconds if f["start"] - 1 < t < f["start"] + 10]
        low_t, low = min(window, key=lambda x: x[1])
        recovered: float | None = 0.0
        if low < 0.8 * median:
            back = next((t for t, n in seconds if t > low_t and n >= 0.8 * median), None)
            recovered = round(back + 1 - f["start"], 1) if back is not None else None
        out.append({"fault": f["fault"], "what": f["what"],
                    "lasted_s": round(f["end"] - f["start"], 2), "lowest_per_s": low,
                    "recovered_s": recovered})
    return out


def _slowest(recoveries: list[float | None]) -> str:
    if not recoveries:
        return "-"
    if None in recoveries:
        return "not within the epoch"
    return f"{max(r for r in recoveries if r is not None):.1f}"


def run(args: argparse.Namespace) -> dict:
    """Generate and import the dataset, then run the epochs through the faults; the figures."""
    from jpfs import localcluster
    from jpfs.lerobot.generate import generate

    vias = [v.strip() for v in args.via.split(",") if v.strip()]
    unknown = set(vias) - {"jpfs", "mount"}
    if unknown:
        raise ValueError(f"unknown --via {sorted(unknown)} (choose from jpfs, mount)")
    work = Path(tempfile.mkdtemp(prefix="jpfs-soak-"))
    src = str(work / "ds")
    generate(src, format="v2.1", episodes=args.episodes, cameras=0, frames_per_episode=(20, 60),
             seed=args.seed, progress=False)
    reference = _reference(src)
    out: dict[str, Any] = {"samples_per_epoch": len(reference), "episodes": args.episodes,
                           "workers": args.workers, "epochs": {}}
    with temporary_cluster(2, 3, etcd=True, meta_replicas=3, replicas=2) as d:
        cluster_file = str(localcluster.cluster_file(d))
        subprocess.run([sys.executable, "-m", "jpfs.cli.main", "--cluster", cluster_file,
                        "import", src, "jpfs:/ds"], check=True, capture_output=True)
        mount = Mount(cluster_file, work, "fuse", 0) if "mount" in vias else None
        try:
            with Faults(d, args.fault_every, args.seed) as faults:
                for via in vias:
                    root = "jpfs://ds" if mount is None or via == "jpfs" else str(mount.mp / "ds")
                    opts = {"cluster": cluster_file} if via == "jpfs" else None
                    for epoch in range(args.epochs):
                        got = _epoch(root, epoch, args.seed, args.workers, opts, reference)
                        times, began = got.pop("times"), got.pop("began")
                        median, seconds = _rates(times)
                        took = times[-1] - times[0] if len(times) > 1 else 0.0
                        out["epochs"][f"{via} {epoch}"] = {
                            **got, "samples": len(times), "seconds": round(took, 1),
                            "first_sample_s": round(times[0] - began, 2) if times else None,
                            "median_per_s": median,
                            "per_s": round(len(times) / took, 1) if took else None,
                            "faults": _dips(faults.log, seconds, median)}
            out["faults"] = [{k: v for k, v in f.items() if k not in ("start", "end")}
                             for f in faults.log]
        finally:
            if mount is not None:
                mount.close()
    ok = all(not (e["missing"] or e["repeated"] or e["wrong"]) for e in out["epochs"].values())
    out["exactly_once_and_equal"] = ok
    rows = [[k, e["samples"], f"{e['first_sample_s']} s", f"{e['seconds']} s", e["per_s"],
             e["median_per_s"],
             len(e["faults"]),
             min((f["lowest_per_s"] for f in e["faults"]), default="-"),
             _slowest([f["recovered_s"] for f in e["faults"]]),
             "yes" if not (e["missing"] or e["repeated"] or e["wrong"]) else
             f"NO: {len(e['missing'])} missing, {len(e['repeated'])} repeated, "
             f"{len(e['wrong'])} unequal"] for k, e in out["epochs"].items()]
    print_table(["epoch", "samples", "first sample", "took", "per s", "median second", "faults",
                 "lowest second", "slowest recovery (s)", "exactly once, equal"], rows,
                title=f"soak: {len(reference)} samples per epoch, faults every "
                      f"{args.fault_every:.3g} s")
    for f in out.get("faults", []):
        print(f"  {f['fault']}: {f['what']}")
    return out


if __name__ == "__main__":
    from .runner import standalone

    sys.exit(standalone(sys.modules[__name__], "soak"))
