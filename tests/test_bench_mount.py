"""``jpfs bench mount`` end to end, at a tiny size. The namespace phase: the workload runs on the
local filesystem, through a naive pyfuse3 passthrough and through a JPFS mount in one run, every
figure comes with its ratios and each daemon's CPU per operation, nothing is left mounted, and a
worker that fails stops the phase at once. The checkpoint phase: torch.save and torch.load of a
state dict locally and through mounts, checked and compared. The tree phase: tar -x and rm -r of
a dataset, checked whole. The read phase with the order announced: every path reaches the mount
through its hint socket before its epoch, and each epoch reports how its time was spread over
its files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from fuse_support import requires_fuse


def _bench_mount(work, *args: str) -> tuple[dict, str]:
    """``jpfs bench mount ARGS --dir WORK --json`` in a fresh interpreter: its JSON result and
    what it printed."""
    proc = subprocess.run(
        [sys.executable, "-m", "jpfs.cli.main", "bench", "mount", *args, "--dir", str(work),
         "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout


@requires_fuse
def test_namespace_phase_against_local_and_a_passthrough(tmp_path):
    work = tmp_path / "w"
    res, out = _bench_mount(work, "--phases", "namespace", "--namespace-ops", "20",
                            "--small-write-files", "4", "--layout-files", "2",
                            "--write-behind")
    assert "vs passthrough" in out
    for via in ("local", "passthrough", "raw-passthrough", "fuse-rw", "fuse-rw-write-behind"):
        ns = res["phases"][via]["namespace"]
        assert set(ns) == {"create", "mkdir", "stat", "rename", "remove", "rmdir",
                           "write_small", "layout_4k"}
        assert all(r["ops_s"] > 0 for r in ns.values())
    rows = {r["what"]: r for r in res["phase_ratios"]}
    assert rows["write_small --write-behind"]["local"] == rows["write_small"]["local"]
    assert rows["create"]["ratio_passthrough"] == pytest.approx(
        rows["create"]["fuse"] / rows["create"]["passthrough"])
    # what each daemon spent per operation (CPU clock ticks: a tiny run may read 0 for one)
    cpu = [r["cpu_ms_per_op"] for r in res["phase_ratios"] if r["phase"] == "namespace"]
    assert len(cpu) == 16 and all(set(c) == {"mount", "shards", "storage"} for c in cpu)
    assert all(v >= 0 for c in cpu for v in c.values())
    assert sum(c["mount"] for c in cpu) > 0 and sum(c["shards"] for c in cpu) > 0
    assert sum(r["passthrough_cpu_ms_per_op"] for r in res["phase_ratios"]
               if r["phase"] == "namespace") > 0
    assert "CPU ms/op" in out
    assert all(r["raw_passthrough"] > 0 for r in res["phase_ratios"])
    # the passthroughs wrote through to their directories, and everything was unmounted
    for src in ("passthrough-src", "raw-src"):
        small = work / src / "ns" / "p0" / "small" / "s00003"
        assert small.stat().st_size == 100 << 10
    with open("/proc/mounts") as f:
        assert str(work) not in f.read()


@requires_fuse
def test_large_phase_against_local_and_a_passthrough(tmp_path):
    """The large-file phase reads the same bytes locally, through the naive passthrough, the
    threaded raw-protocol one and read-write and read-only mounts, cold, and reports each mount
    against the local filesystem and the passthroughs."""
    work = tmp_path / "w"
    res, out = _bench_mount(work, "--phases", "large", "--large-bytes", "6MiB",
                            "--small-read-files", "12")
    for via in ("local", "passthrough", "raw-passthrough", "fuse-rw", "fuse"):
        large = res["phases"][via]["large"]
        assert large["large_1m"]["bytes"] == 6 << 20 and large["large_1m"]["MBps"] > 0
        for name in ("small_4k", "small_whole_x4"):
            assert large[name]["files"] == 12 and large[name]["bytes"] == 12 * (100 << 10)
    assert res["phases"]["raw-passthrough"]["threads"] == 4
    rows = {r["what"]: r for r in res["phase_ratios"]}
    assert set(rows) == {f"{name}{via}" for name in ("large_1m", "small_4k", "small_whole_x4")
                         for via in ("", " read-only")}
    for r in rows.values():
        assert r["ratio"] == pytest.approx(r["fuse"] / r["local"])
        assert r["ratio_passthrough"] == pytest.approx(r["fuse"] / r["passthrough"])
        assert r["raw_passthrough"] > 0
    assert "raw x4 (vs local)" in out
    with open("/proc/mounts") as f:
        assert str(work) not in f.read()


@requires_fuse
def test_tree_phase_unpacks_and_removes_a_dataset_through_a_mount(tmp_path):
    """The tree phase packs a generated LeRobot v2.1 tree in a tar, unpacks it with tar -x and
    removes it with rm -r on the local disk and through a mount (the unpacked tree checked
    whole), and reports each against the local disk with each daemon's CPU per file."""
    work = tmp_path / "w"
    res, _ = _bench_mount(work, "--phases", "tree", "--episodes", "6", "--video-bytes", "20000")
    tree = res["phases"]["tree"]
    assert tree["entries"] > 6 * 3 and tree["bytes"] > 6 * 2 * 20000
    for via in ("local", "fuse-rw"):
        for step in ("tar_x", "rm_r"):
            assert tree[via][step]["files_s"] > 0
    rows = {r["what"]: r for r in res["phase_ratios"]}
    assert set(rows) == {"tar -x", "rm -r"}
    assert set(rows["tar -x"]["cpu_ms_per_op"]) == {"mount", "shards", "storage"}
    with open("/proc/mounts") as f:
        assert str(work) not in f.read()


@requires_fuse
def test_checkpoint_phase_saves_and_loads_back_through_mounts(tmp_path):
    """The checkpoint phase saves a state dict with torch.save and fsync and loads it back cold
    (checked equal), locally and through mounts of a cluster keeping 2 copies, and reports each
    against the local disk with each daemon's CPU per GB."""
    pytest.importorskip("torch", reason="the checkpoint phase needs the torch extra")
    work = tmp_path / "w"
    res, out = _bench_mount(work, "--phases", "checkpoint", "--checkpoint-bytes", "20M")
    ck = res["phases"]["checkpoint"]
    assert ck["replicas"] == 2 and ck["tensor_bytes"] == 20 << 20
    for via in ("local", "fuse-rw"):
        for step in ("save", "load"):
            r = ck[via][step]
            assert r["bytes"] > 20 << 20 and r["GBps"] > 0  # the tensors and torch's archive
    rows = {r["what"]: r for r in res["phase_ratios"]}
    assert set(rows) == {"save (replicas 2)", "load (replicas 2)"}
    for r in rows.values():
        assert r["ratio"] == pytest.approx(r["fuse"] / r["local"])
        assert set(r["cpu_s_per_gb"]) == {"mount", "shards", "storage"}
    assert rows["save (replicas 2)"]["cpu_s_per_gb"]["storage"] > 0  # two copies stored
    # the mount runs beside the storage nodes: it reads their volumes itself
    assert ck["fuse-rw"]["load"]["short_circuit_bytes"] >= ck["tensor_bytes"]
    assert "s/GB" in out
    with open("/proc/mounts") as f:
        assert str(work) not in f.read()


def test_a_failing_namespace_worker_stops_the_phase_at_once(tmp_path):
    """A worker that cannot work (a file lies where its directory should go) breaks the
    phase's barrier: the run fails at once, naming the workers' exits, instead of waiting out
    the barrier's 30-minute timeout."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    t0 = time.monotonic()
    # in a fresh interpreter: the phase forks its workers, which a threaded process should not
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from pathlib import Path; "
         "from jpfs_bench.mount_write import namespace_phase; "
         "namespace_phase(Path(sys.argv[1]), 2, 5, 4096, 1, 1)", str(blocker)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "a namespace worker failed" in proc.stderr
    assert time.monotonic() - t0 < 120


@requires_fuse
def test_read_phase_with_each_epochs_order_announced(tmp_path):
    work = tmp_path / "w"
    res, out = _bench_mount(work, "--episodes", "8", "--cameras", "1", "--frames", "20",
                            "--video-bytes", "16K", "--readers", "2", "--orders", "shuffled",
                            "--via", "local,fuse-hinted")
    files = res["dataset"]["files"]
    runs = {(r["via"], r["epoch"]): r for r in res["runs"]}
    for epoch in (1, 2):
        assert runs[("local", epoch)]["files"] == files
        hinted = runs[("fuse-hinted", epoch)]
        assert hinted["files"] == files and hinted["hinted_paths"] == files
        for r in (runs[("local", epoch)], hinted):  # how the epoch's time was spread
            assert 0 < r["file_ms_p50"] <= r["file_ms_p99"]
            assert 0 < r["first_tenth_share"] <= 1
    assert "fuse-hinted  1 (cold)" in out and "first 10% took" in out
    with open("/proc/mounts") as f:
        assert str(work) not in f.read()


def test_a_mounts_cpu_counts_its_workers():
    """A mount's CPU is its own and its worker processes': a child that burned CPU counts."""
    from jpfs_bench.readers import proc_cpu, tree_cpu

    child = subprocess.Popen([sys.executable, "-c", "import time\nx = 0\n"
                              "for i in range(3_000_000): x += i\nprint('done', flush=True)\n"
                              "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "done"
        burned = proc_cpu(child.pid)  # it sleeps from now on
        assert burned > 0.05
        own = proc_cpu(os.getpid())  # read first: it only grows
        assert tree_cpu(os.getpid()) >= own + burned
    finally:
        child.kill()
        child.wait()


@requires_fuse
def test_read_phase_through_each_engine(tmp_path):
    """The read phase through pyfuse3 and JPFS's own engine (one worker, and one per core):
    every file read in both epochs, and a CPU figure for each (too small here to be more than
    ticks: ``test_a_mounts_cpu_counts_its_workers`` checks that workers count)."""
    work = tmp_path / "w"
    res, out = _bench_mount(work, "--episodes", "6", "--cameras", "1", "--frames", "20",
                            "--video-bytes", "16K", "--readers", "2", "--orders", "shuffled",
                            "--no-drop-caches", "--via", "local,fuse,fuse-jpfs1,fuse-jpfs")
    files = res["dataset"]["files"]
    runs = {(r["via"], r["epoch"]): r for r in res["runs"]}
    for via in ("fuse", "fuse-jpfs1", "fuse-jpfs"):
        for epoch in (1, 2):
            assert runs[(via, epoch)]["files"] == files  # a read error fails the run
        assert runs[(via, 1)]["mount_cpu_us_per_file"] >= 0
    assert "fuse-jpfs1  1 (warm)" in out
    with open("/proc/mounts") as f:
        assert str(work) not in f.read()
