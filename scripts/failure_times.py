"""Time to fail (or to succeed over a replica) with one daemon down, through the ``jpfs`` CLI.

Run: ``.venv/bin/python scripts/failure_times.py [--mount]``. Starts throw-away local clusters in
a temporary directory, kills one daemon at a time with SIGKILL, and times each command from its
start to its exit, printing one line per case (seconds, exit status, the last line of stderr).
The figures in README's "When a daemon is down" and design-notes' "Failure" come from it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jpfs
from jpfs import localcluster
from jpfs.placement import shard_of

JPFS = str(Path(sys.executable).with_name("jpfs"))


def run(cluster: Path, *argv: str, timeout: float = 120) -> dict:
    """One CLI command against ``cluster``: wall time, exit status, last stderr line."""
    t0 = time.monotonic()
    p = subprocess.run([JPFS, "--cluster", str(cluster), *argv], capture_output=True,
                       timeout=timeout)
    secs = time.monotonic() - t0
    err = [ln for ln in p.stderr.decode(errors="replace").splitlines() if ln.strip()]
    return {"seconds": round(secs, 2), "rc": p.returncode, "stderr": err[-1] if err else ""}


def dir_on(client, shard: int, prefix: str) -> str:
    """A new directory under / whose inode (and so its entries) lives on ``shard``."""
    for i in range(1000):
        name = f"/{prefix}{i}"
        client.mkdir(name)
        if shard_of(client.stat(name).ino) == shard:
            return name
    raise RuntimeError(f"no directory landed on shard {shard}")


def file_on_node(client, node: int, prefix: str) -> str:
    """A new one-chunk file whose only copy is on storage node ``node``."""
    for i in range(1000):
        d = f"/{prefix}{i}"
        client.makedirs(d)
        client.write_bytes(f"{d}/f", os.urandom(1000))
        if client.layout(f"{d}/f").chunks[0].nodes == (node,):
            return f"{d}/f"
    raise RuntimeError(f"no file landed on node {node}")


def silent_listener() -> tuple[socket.socket, threading.Event]:
    """A loopback TCP listener that accepts connections and never answers (a hung daemon)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    stop = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue
        for s in held:
            s.close()

    threading.Thread(target=accept, daemon=True).start()
    return srv, stop


def hung_read(d: Path) -> dict:
    """A long-lived client (a mount, a training job) whose connection to a node is up when the
    node hangs (SIGSTOP): time its next read of a file with one copy there."""
    with jpfs.connect(d) as c:
        c.write_bytes("/hung", os.urandom(1000))
        c.read_bytes("/hung")
        node = c.layout("/hung").chunks[0].nodes[0]
        pid = int((d / f"storage-{node}.pid").read_text())
        # replicas 2: the other copy would answer; make this one the only one to be sure
        localcluster.stop(d, "storage", 1 - node, sig=signal.SIGKILL)
        c.read_bytes("/hung")
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            c.read_bytes("/hung")
            res = {"rc": 0, "stderr": ""}
        except OSError as e:
            res = {"rc": e.errno, "stderr": str(e)}
        finally:
            os.kill(pid, signal.SIGCONT)
        return {"seconds": round(time.monotonic() - t0, 2), **res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mount", action="store_true", help="also time a read through a mount")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows: list[tuple[str, dict]] = []
    root = Path(tempfile.mkdtemp(prefix="jpfs-failure-"))
    try:
        # replicas 1: a shard and a storage node down
        d = root / "r1"
        localcluster.up(d, meta_shards=2, storage_nodes=2, replicas=1, sync=False)
        with jpfs.connect(d) as c:
            on1 = dir_on(c, 1, "d")
            c.write_bytes(f"{on1}/x", b"x")
            lone = file_on_node(c, 1, "n")
            tree = "/t"
            for i in range(20):
                c.makedirs(f"{tree}/s{i}")
                c.write_bytes(f"{tree}/s{i}/f", os.urandom(1000))
        cf = d / "cluster.toml"
        localcluster.stop(d, "meta", 1, sig=signal.SIGKILL)
        rows.append(("ls, shard down", run(cf, "ls", f"jpfs:{on1}")))
        rows.append(("du, shard down", run(cf, "du", f"jpfs:{on1}")))
        localcluster.start(d, "meta", 1, sync=False)
        localcluster.stop(d, "storage", 1, sig=signal.SIGKILL)
        rows.append(("cat, replicas 1, node down", run(cf, "cat", f"jpfs:{lone}")))
        out = root / "export"
        rows.append(("export, replicas 1, node down", run(cf, "export", "--no-progress",
                                                          f"jpfs:{tree}", str(out))))
        if args.mount:
            mp = root / "mnt"
            mp.mkdir()
            subprocess.run([JPFS, "mount", "--read-only", "--no-prefetch", str(d), str(mp)],
                           check=True)
            try:
                t0 = time.monotonic()
                try:
                    (mp / lone.lstrip("/")).read_bytes()
                    res = {"rc": 0, "stderr": ""}
                except OSError as e:
                    res = {"rc": e.errno, "stderr": str(e)}
                rows.append(("mount read, replicas 1, node down",
                             {"seconds": round(time.monotonic() - t0, 2), **res}))
            finally:
                subprocess.run([JPFS, "umount", str(mp)])
        localcluster.start(d, "storage", 1, sync=False)
        rows.append(("export rerun, node back", run(cf, "export", "--no-progress",
                                                    f"jpfs:{tree}", str(out))))
        # a silent shard: the cluster file points shard 1 at a listener that never answers
        srv, stop = silent_listener()
        silent = root / "silent.toml"
        text = cf.read_text()
        addr = jpfs.config.load(cf).meta[1].address
        silent.write_text(text.replace(addr, f"127.0.0.1:{srv.getsockname()[1]}"))
        shutil.copy(d / "secret", root / "secret")
        rows.append(("ls, shard silent", run(silent, "ls", f"jpfs:{on1}")))
        stop.set()
        srv.close()
        localcluster.down(d, timeout=5)
        # replicas 2: reads fail over to the other copy
        d2 = root / "r2"
        localcluster.up(d2, meta_shards=1, storage_nodes=2, replicas=2, sync=False)
        with jpfs.connect(d2) as c:
            c.write_bytes("/f", os.urandom(1000))
        localcluster.stop(d2, "storage", 0, sig=signal.SIGKILL)
        rows.append(("cat, replicas 2, node down", run(d2 / "cluster.toml", "cat", "jpfs:/f")))
        localcluster.start(d2, "storage", 0, sync=False)
        rows.append(("running client, node hung", hung_read(d2)))
        localcluster.down(d2, timeout=5)
    finally:
        for sub in ("r1", "r2"):
            if (root / sub / "cluster.toml").exists():
                localcluster.down(root / sub, timeout=5)
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(dict(rows), indent=1))
        return
    for name, r in rows:
        print(f"{name:36} {r['seconds']:6.2f} s  rc {r['rc']}  {r['stderr'][:160]}")


if __name__ == "__main__":
    main()
