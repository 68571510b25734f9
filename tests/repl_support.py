"""Waiting on a replicated cluster's state in tests: who leads each shard, copies that follow
it, loops in other processes that make progress. Every wait has a deadline (``WAIT``) and fails
with the state it saw last."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import trio

from jpfs import config
from jpfs.errors import JPFSError
from jpfs.proto import replica as R
from jpfs.rpc import Pool

WAIT = 60.0
"""Deadline of every wait on the cluster's state (seconds)."""


async def repl_status(pool: Pool, j: int, shard: int, **kw) -> R.ReplStatus:
    """Copy ``j``'s replication status (``pool`` calls shard ``shard``'s copies by index),
    decoded once."""
    return R.REPL_STATUS.decode(await pool.call(j, R.REPL_STATUS, R.StatusReq(shard), **kw))


async def repl_digest(pool: Pool, j: int, shard: int, **kw) -> R.ReplDigest:
    """Copy ``j``'s digest of its records (``repl_status``'s ``pool``), decoded once."""
    return R.REPL_DIGEST.decode(await pool.call(j, R.REPL_DIGEST, R.StatusReq(shard), **kw))


def statuses(c: config.Cluster, shard: int) -> list[R.ReplStatus | None]:
    """Every copy's replication status; None for one that does not answer within a second
    (killed, or stopped)."""
    addresses = [s.address for s in c.meta_replicas[shard]]

    async def ask() -> list[R.ReplStatus | None]:
        out: list[R.ReplStatus | None] = [None] * len(addresses)
        async with trio.open_nursery() as nursery:
            pool = Pool(nursery, addresses, c.secret, role="meta", retry_for=0.0,
                        peer_timeout=0.5, timeout=1.0)

            async def one(j: int) -> None:
                with contextlib.suppress(JPFSError):
                    out[j] = await repl_status(pool, j, shard)

            async with trio.open_nursery() as calls:
                for j in range(len(addresses)):
                    calls.start_soon(one, j)
            pool.close()
        return out

    return trio.run(ask)


def wait(what: str, check, state) -> object:
    """Wait until ``check()`` is true (returns its value); past ``WAIT`` seconds fail with
    ``state()``, what was seen last."""
    deadline = time.monotonic() + WAIT
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {WAIT:.0f} s; last seen: {state()}")
        time.sleep(0.05)


def leader(c: config.Cluster, shard: int, other_than: int | None = None) -> tuple[int, int]:
    """(replica, term) of the copy that leads ``shard`` (and is not ``other_than``)."""
    seen: list = []

    def check():
        seen[:] = statuses(c, shard)
        leaders = [(s.replica, s.term) for s in seen
                   if s is not None and s.role == "leader" and s.replica != other_than]
        return leaders[0] if len(leaders) == 1 else None

    return wait(f"a leader of shard {shard} other than {other_than}", check, lambda: seen)


def steady(c: config.Cluster) -> None:
    """Every copy of every shard runs and follows one leader, none installing a snapshot:
    the next fault then takes at most one copy of a shard away."""
    for shard in range(c.n_shards):
        seen: list = []

        def check(shard=shard, seen=seen):
            seen[:] = statuses(c, shard)
            if any(s is None or s.resyncing for s in seen):
                return False
            leaders = [s.replica for s in seen if s.role == "leader"]
            return len(leaders) == 1 and all(s.leader == leaders[0] for s in seen)

        wait(f"every copy of shard {shard} following one leader", check, lambda seen=seen: seen)


def pid(d: Path, name: str) -> int:
    """The pid a local cluster's daemon ``name`` wrote."""
    return int((d / f"{name}.pid").read_text())


class LoopProgress:
    """Kept by a loop in another process (it imports this module: the tests' folder is on the
    ``PYTHONPATH`` they start it with): the calls it made and the failures it met, written to
    ``OUT.progress`` at once whole (``write``), for ``progress`` and ``made_progress``."""

    def __init__(self, out: str):
        self.out = out
        self.calls = 0
        self.failures: list[str] = []

    def write(self) -> None:
        """Publish the counts (a rename: a reader never sees half a file)."""
        tmp = f"{self.out}.progress.tmp"
        with open(tmp, "w") as f:
            json.dump({"calls": self.calls, "failed": len(self.failures)}, f)
        os.replace(tmp, f"{self.out}.progress")


def progress(outs: list[Path]) -> list[dict]:
    """What each loop last wrote to ``OUT.progress`` (``calls``, ``failed``)."""
    got = []
    for out in outs:
        try:
            got.append(json.loads(Path(f"{out}.progress").read_text()))
        except (OSError, ValueError):
            got.append({"calls": 0, "failed": 0})
    return got


def made_progress(outs: list[Path], procs: list[subprocess.Popen], calls: int) -> None:
    """Both loops made ``calls`` more calls (they are not stuck behind the last fault)."""
    start = [p["calls"] for p in progress(outs)]

    def check():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a loop ended early (status {p.returncode}): "
                                     f"{progress(outs)}")
        return all(p["calls"] >= s + calls for p, s in zip(progress(outs), start, strict=True))

    wait(f"both loops making {calls} more calls", check, lambda: progress(outs))


def elections(d: Path) -> int:
    """Elections won so far, from the copies' logs."""
    return sum(p.read_text(errors="replace").count(" leads (term ")
               for p in (d / "logs").glob("meta-*.log"))


class Loops:
    """A loop ``script`` in one process per tree and way in, started as ``python -c SCRIPT
    CLUSTER_FILE TOP STOP_FILE OUT WHERE`` (``WHERE``: ``native``, or a mount point); the loop
    keeps a ``LoopProgress`` in ``OUT``, runs until ``STOP_FILE`` exists and then writes its
    results to ``OUT``. On exit, whatever still runs is killed."""

    def __init__(self, script: str, d: Path, tops: list[str], wheres: list[str]):
        from jpfs import localcluster

        self.stop_file = d / "stop"
        self.outs = [d / f"loop{w}.json" for w in range(len(tops))]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.procs = [subprocess.Popen(
            [sys.executable, "-c", script, str(localcluster.cluster_file(d)), top,
             str(self.stop_file), str(out), where], env=env)
            for top, out, where in zip(tops, self.outs, wheres, strict=True)]

    def __enter__(self) -> Loops:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def progress(self) -> list[dict]:
        """Each loop's counts so far."""
        return progress(self.outs)

    def made_progress(self, calls: int) -> None:
        """Wait until every loop made ``calls`` more calls."""
        made_progress(self.outs, self.procs, calls)

    def stop(self) -> list[dict]:
        """Stop the loops and return what each wrote."""
        self.stop_file.touch()
        for p in self.procs:
            p.wait(timeout=WAIT)
        return [json.loads(out.read_text()) for out in self.outs]
