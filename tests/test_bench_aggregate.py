"""``jpfs bench aggregate`` and ``jpfs bench read``: exact accounting, every JSON field, the
plot, FUSE counters and torchrun ranks, on tiny real runs (real daemons, real files, real
mounts). Speed is never asserted here; bench/ measures it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fuse_support import requires_fuse
from jpfs_bench import read as read_bench
from jpfs_bench.readers import epoch_order, scan_dataset, share
from signal_support import foreground_signals

ROW_FIELDS = {"via", "epoch", "rtt_ms", "cold", "cache", "files", "bytes", "expected_files",
              "expected_bytes", "seconds", "GBps", "files_per_s", "latency_ms",
              "client_cpu_s_per_GB", "server_cpu_s_per_GB", "prefetch_hit_rate", "fuse_opens",
              "fuse_requests_per_file", "errors", "n_errors", "timed_out", "vs_local", "rounds",
              "GBps_rounds", "files_per_s_rounds", "page_cache_dropped_by_others"}
TOP_FIELDS = {"benchmark", "dataset", "hosts_world", "clients_per_host", "readers", "order",
              "epochs", "rounds", "via", "inflight", "batch", "threads", "cluster", "network",
              "load_avg", "results", "targets"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A tiny LeRobot v2.1 dataset from the generator (real parquet, stand-in mp4s)."""
    from jpfs.lerobot.generate import generate

    root = tmp_path_factory.mktemp("bench") / "tiny"
    generate(str(root), episodes=6, cameras=2, frames_per_episode=30, video="stub",
             video_bytes=20_000, seed=3, progress=False)
    return root


def truth(root: Path) -> tuple[int, int]:
    """Files and bytes under data/ and videos/, counted independently of the benchmark."""
    files = size = 0
    for top in ("data", "videos"):
        for dirpath, _, names in os.walk(root / top):
            for n in names:
                files += 1
                size += os.path.getsize(os.path.join(dirpath, n))
    return files, size


def cli(*args: str, timeout: float = 240, **kw) -> dict:
    """Run ``jpfs bench ...`` and parse the JSON object on its last line."""
    proc = subprocess.run([sys.executable, "-m", "jpfs.cli.main", "bench", *args, "--json"],
                          capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_rows(result: dict, files: int, nbytes: int) -> None:
    assert TOP_FIELDS <= set(result), TOP_FIELDS - set(result)
    assert result["results"]
    for r in result["results"]:
        assert ROW_FIELDS <= set(r), ROW_FIELDS - set(r)
        assert (r["files"], r["bytes"]) == (files, nbytes), r["via"]
        assert (r["expected_files"], r["expected_bytes"]) == (files, nbytes)
        assert r["n_errors"] == 0 and not r["timed_out"]
        assert r["GBps"] > 0 and r["files_per_s"] > 0 and r["seconds"] > 0
        assert r["latency_ms"]["p50"] is not None and r["latency_ms"]["p99"] >= \
            r["latency_ms"]["p50"]
        assert r["client_cpu_s_per_GB"] is not None
        if r["via"] == "local" or "local" not in result["via"]:
            assert r["vs_local"] is None
        else:
            assert r["vs_local"]["GBps"] > 0
        if r["via"] != "local":
            assert r["server_cpu_s_per_GB"] is not None


# ---------------------------------------------------------------------- pure parts


def test_shares_partition_every_epoch():
    for n, total in ((10, 3), (7, 7), (3, 5), (1000, 8)):
        for order in ("shuffled", "name"):
            o = epoch_order(n, order, seed=1, epoch=2)
            parts = [share(o, i, total) for i in range(total)]
            flat = [k for p in parts for k in p]
            assert sorted(flat) == list(range(n))  # each unit read once, by one reader
    assert epoch_order(50, "shuffled", 0, 1) != epoch_order(50, "shuffled", 0, 2)
    assert epoch_order(50, "shuffled", 0, 1) == epoch_order(50, "shuffled", 0, 1)


def test_scan_groups_episodes(dataset):
    ds = scan_dataset(dataset)
    files, nbytes = truth(dataset)
    assert (ds.files, ds.bytes) == (files, nbytes)
    assert len(ds.units) == 6
    for k, unit in enumerate(ds.units):
        assert len(unit) == 3 and unit[0].endswith(f"episode_{k:06d}.parquet")
        assert all(f"episode_{k:06d}" in p for p in unit)


# ---------------------------------------------------------------------- aggregate


def test_aggregate_local_native_exact_and_complete(dataset, tmp_path):
    files, nbytes = truth(dataset)
    png = tmp_path / "agg.png"
    res = cli("aggregate", "--dataset", str(dataset), "--via", "local,native", "--clients", "2",
              "--epochs", "2", "--rounds", "2", "--no-drop", "--no-progress",
              "--work", str(tmp_path / "w"), "--plot", str(png))
    check_rows(res, files, nbytes)
    assert [(r["via"], r["epoch"]) for r in res["results"]] == [
        ("local", 1), ("local", 2), ("native", 1), ("native", 2)]  # warm after its own cold
    assert res["readers"] == 2 and res["hosts_world"] == 1
    assert all(r["rounds"] == 2 and len(r["GBps_rounds"]) == 2 for r in res["results"])
    assert all(r["GBps"] in r["GBps_rounds"] for r in res["results"])
    assert res["dataset"] == {"root": str(dataset), "files": files, "episodes": 6,
                              "bytes": nbytes}
    assert res["results"][0]["cold"] is False  # --no-drop: epoch 1 is reported as not cold
    assert res["cluster"]["import"]["files"] + res["cluster"]["import"]["skipped"] > files
    assert {"native_warm_GBps_vs_local", "native_cold_GBps_vs_local"} <= set(res["targets"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # nothing of the cluster is left running
    for pid_file in (tmp_path / "w" / "cluster").glob("*.pid"):
        pytest.fail(f"{pid_file} left behind")


@requires_fuse
def test_aggregate_fuse_counts_opens_and_prefetch(dataset, tmp_path):
    files, nbytes = truth(dataset)
    res = cli("aggregate", "--dataset", str(dataset), "--via", "fuse,fuse-noprefetch",
              "--clients", "1", "--epochs", "2", "--no-drop", "--no-progress",
              "--work", str(tmp_path / "w"))
    check_rows(res, files, nbytes)
    by = {(r["via"], r["epoch"]): r for r in res["results"]}
    for via in ("fuse", "fuse-noprefetch"):
        first = by[via, 1]
        # every file opened once, or given to the kernel before it was read (no open)
        assert sum(first["fuse_opens"].values()) + first["fuse_handed"] == files
        assert first["fuse_requests_per_file"] > 0
        assert first["prefetch_hit_rate"] is not None
    assert by["fuse-noprefetch", 1]["prefetch_hit_rate"] == 0
    assert res["targets"]["fuse_epoch1_files_prefetch_vs_none"] > 0
    mounts = Path("/proc/mounts").read_text()
    assert str(tmp_path / "w") not in mounts  # unmounted


TORCHRUN = shutil.which("torchrun", path=f"{Path(sys.executable).parent}{os.pathsep}"
                                        f"{os.environ.get('PATH', '')}")


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun (torch) is not installed")
def test_aggregate_under_torchrun_counts_every_rank(dataset, tmp_path):
    files, nbytes = truth(dataset)
    proc = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "jpfs_bench.aggregate",
         "--dataset", str(dataset), "--via", "local,native", "--clients", "1", "--epochs", "1",
         "--no-drop", "--no-progress", "--work", str(tmp_path / "w"), "--json"],
        capture_output=True, text=True, timeout=240)
    # the rank that failed first speaks before the others' "connection closed": show it all
    # (torchrun's own warning lines left out)
    stderr = "\n".join(line for line in proc.stderr.splitlines()
                       if not line.startswith(("W1", "I1")))
    assert proc.returncode == 0, proc.stdout[-3000:] + stderr[:6000] + "\n...\n" + stderr[-2000:]
    objs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    rank0 = [o for o in objs if o.get("benchmark") == "aggregate"]
    assert len(rank0) == 1 and {"rank": 1} in objs  # rank 0 alone prints the aggregate
    res = rank0[0]
    assert res["hosts_world"] == 2 and res["readers"] == 2
    check_rows(res, files, nbytes)  # the two ranks together read everything, once


# ---------------------------------------------------------------------- read


def test_read_bench_exact_and_complete(tmp_path, capsys):
    import argparse

    p = argparse.ArgumentParser()
    read_bench.add_arguments(p)
    args = p.parse_args(["--episodes", "12", "--large", "9M", "--rounds", "1", "--batch", "8",
                         "--no-progress", "--work", str(tmp_path / "w")])
    res = read_bench.run(args)
    tree = Path(res["small"]["root"])
    files, nbytes = truth(tree)
    assert (res["small"]["files"], res["small"]["bytes"]) == (files, nbytes) == (
        24, res["small"]["bytes"])
    for name, *_ in read_bench.WORKLOADS:
        r = res["warm"][name]
        want = (1, 9 << 20) if name.startswith("large") else (files, nbytes)
        assert (r["files"], r["bytes"]) == want, name
        assert r["GBps"] > 0 and r["vs_sendfile"] > 0
        assert r["client_cpu_s_per_GB"] is not None
    assert res["warm"]["sendfile"]["GBps"] > 0
    for name in read_bench.COLD:
        r = res["cold"][name]
        assert r["cache"] and r["files"] in (1, files)
    assert set(res["targets"]) == {"warm_small_native_vs_sendfile",
                                   "warm_large_native_vs_sendfile",
                                   "cold_small_native_files_vs_local"}
    assert all(t["value"] is not None for t in res["targets"].values())
    out = capsys.readouterr().out
    assert "vs sendfile" in out and "targets:" in out
    assert not list((tmp_path / "w" / "cluster").glob("*.pid"))


@pytest.mark.slow
@requires_fuse
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_fuse_run_unmounts_and_stops_the_cluster(dataset, tmp_path, sig):
    work = tmp_path / "w"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jpfs.cli.main", "bench", "aggregate", "--dataset", str(dataset),
         "--via", "fuse", "--clients", "1", "--epochs", "500", "--no-drop", "--no-progress",
         "--work", str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=foreground_signals)
    try:
        deadline = time.monotonic() + 120
        while str(work) not in Path("/proc/mounts").read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("no mount came up: " + (proc.stderr.read() if proc.poll() is not None
                                                    else "timeout"))
            time.sleep(0.1)
        daemons = [int(p.read_text()) for p in (work / "cluster").glob("*.pid")]
        assert daemons
        time.sleep(1.0)
        proc.send_signal(sig)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert str(work) not in Path("/proc/mounts").read_text()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in daemons) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in daemons)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
