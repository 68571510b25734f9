"""Steady metadata leadership on a busy host: leader step-downs per hour, and failed calls.

A cluster of two shards with three copies each (etcd leases) runs beside ``--busy`` processes
that spin on the CPU (by default two per core: a training node's DataLoader workers) and
``--syncers`` that write and fdatasync on the cluster's disk (a checkpoint or log writer), while
``--writers`` processes loop over mkdir, create, rename, unlink and rmdir through the native
client for ``--seconds``. Nothing is killed, so every step-down counted (a copy's log saying
it stops leading) is spurious: a leader that was alive but late. Reported: step-downs and
elections per hour, the calls made and how many failed (a program would have seen each), and
the load average over the run. The baseline is the same cluster and loop with no busy
processes or syncers, measured first in the same run (``--baseline-seconds``; 0 skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .harness import fmt_rate, print_table, temporary_cluster

HELP = "leader step-downs per hour and failed calls on a host kept busy"
DESCRIPTION = __doc__

# One loop of changes through the native client; a failed call is counted and the loop goes
# on (its tree may then hold leftovers: it starts its next round under a new name).
WRITER = r"""
import json, os, sys, time
import jpfs

cluster_file, top, until, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
client = jpfs.connect(cluster_file)
client.mkdir(top)
calls = failed = 0
errors = {}
i = 0
while time.time() < until:
    d = f"{top}/d{i}"
    for fn, args in ((client.mkdir, (d,)), (client.create, (f"{d}/x",)),
                     (client.rename, (f"{d}/x", f"{top}/f{i}")), (client.unlink, (f"{top}/f{i}",)),
                     (client.rmdir, (d,))):
        calls += 1
        try:
            fn(*args)
        except OSError as e:
            failed += 1
            errors[str(e)[:160]] = errors.get(str(e)[:160], 0) + 1
    i += 1
client.close()
with open(out, "w") as f:
    json.dump({"calls": calls, "failed": failed, "errors": errors}, f)
"""

SPIN = "while True: pass"
SYNC = r"""
import os, sys
path = sys.argv[1]
block = os.urandom(1 << 20)
with open(path, "wb") as f:
    while True:
        for _ in range(4):
            f.write(block)
        f.flush()
        os.fdatasync(f.fileno())
        if f.tell() > 256 << 20:
            f.seek(0)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``jpfs bench leadership``."""
    p.add_argument("--seconds", type=float, default=600.0,
                   help="length of the loaded run (default 600)")
    p.add_argument("--baseline-seconds", type=float, default=60.0,
                   help="length of the unloaded run before it (default 60; 0 skips it)")
    p.add_argument("--busy", type=int, default=2 * (os.cpu_count() or 1),
                   help="processes spinning on the CPU (default two per core)")
    p.add_argument("--syncers", type=int, default=2,
                   help="processes writing 4 MiB and fdatasync-ing it in a loop on the "
                        "cluster's disk, as a checkpoint or a log writer does (default 2)")
    p.add_argument("--writers", type=int, default=2,
                   help="processes looping over namespace changes (default 2)")


def _count(d: Path, needle: str) -> int:
    return sum(p.read_text(errors="replace").count(needle)
               for p in (d / "logs").glob("meta-*.log"))


def _measure(d: Path, seconds: float, busy: int, syncers: int, writers: int, tag: str) -> dict:
    from jpfs import localcluster

    stepdowns0, elections0 = _count(d, " stops leading "), _count(d, " leads (term ")
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
    spinners += [subprocess.Popen([sys.executable, "-c", SYNC, str(d / f"{tag}-sync{k}")])
                 for k in range(syncers)]
    outs = [d / f"{tag}-writer{w}.json" for w in range(writers)]
    until = time.time() + seconds
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(localcluster.cluster_file(d)),
                               f"/{tag}-w{w}", str(until), str(out)], env=env)
             for w, out in enumerate(outs)]
    loads = []
    try:
        while any(p.poll() is None for p in procs):
            time.sleep(min(5.0, max(0.1, until - time.time())))
            loads.append(os.getloadavg()[0])
        elapsed = time.monotonic() - t0
    finally:
        for p in spinners + procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    results = [json.loads(o.read_text()) for o in outs if o.exists()]
    hours = elapsed / 3600
    stepdowns = _count(d, " stops leading ") - stepdowns0
    elections = _count(d, " leads (term ") - elections0
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    for k in range(syncers):
        (d / f"{tag}-sync{k}").unlink(missing_ok=True)
    return {"seconds": round(elapsed, 1), "busy": busy, "syncers": syncers, "writers": writers,
            "load_avg": round(sum(loads) / len(loads), 2) if loads else load0,
            "stepdowns": stepdowns, "elections": elections,
            "stepdowns_per_hour": round(stepdowns / hours, 1),
            "calls": sum(r["calls"] for r in results),
            "failed": sum(r["failed"] for r in results) + (writers - len(results)),
            "calls_per_s": round(sum(r["calls"] for r in results) / elapsed, 1),
            "errors": errors}


def run(args: argparse.Namespace) -> dict:
    """Run the unloaded baseline, then the loaded run, on one cluster; their figures."""
    out: dict = {}
    with temporary_cluster(2, 0, etcd=True, meta_replicas=3) as d:
        if args.baseline_seconds > 0:
            out["quiet"] = _measure(d, args.baseline_seconds, 0, 0, args.writers, "quiet")
        out["busy"] = _measure(d, args.seconds, args.busy, args.syncers, args.writers, "busy")
    rows = [[k, f"{r['seconds']:.0f} s", r["busy"], r["syncers"], r["load_avg"], r["stepdowns"],
             r["stepdowns_per_hour"], r["elections"], r["calls"], r["failed"],
             fmt_rate(r["calls_per_s"])] for k, r in out.items()]
    print_table(["run", "length", "spinners", "syncers", "load", "step-downs", "per hour",
                 "elections", "calls", "failed", "calls/s"], rows,
                title="metadata leadership: 2 shards x 3 copies, nothing killed")
    for k, r in out.items():
        for e, n in r["errors"].items():
            print(f"  {k}: {n} x {e}")
    return out


if __name__ == "__main__":
    from .runner import standalone

    sys.exit(standalone(sys.modules[__name__], "leadership"))
