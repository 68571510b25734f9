"""Simulated hosts (``--hosts``): real network namespaces, veths, a bridge, shaping and relays,
always removed: after a run, after Ctrl-C or SIGTERM in the middle of one, and when a crashed
run left them behind. Skipped, with the reason, where namespaces cannot be created."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jpfs_bench import netns
from signal_support import foreground_signals

from jpfs import localcluster

REASON = netns.unavailable()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}"),
              pytest.mark.slow]


def made_by(pid: int) -> dict[str, list]:
    """Namespaces, links and relays that the run with process id ``pid`` owns."""
    return {"namespaces": [n for n in netns.namespaces() if n.startswith(f"{netns.PREFIX}-{pid}-")],
            "links": [x for x in netns.links() if x.startswith(f"jb{pid}h") or x == f"jb{pid}br"],
            "relays": [r for r, owner in netns._relays() if owner == pid]}


def daemons_left(cluster: Path) -> dict[str, str]:
    """The daemons whose pid files ``cluster`` holds that still run: name -> their state."""
    left = {}
    for pid_file in cluster.glob("*.pid"):
        daemon = int(pid_file.read_text())
        if localcluster.pid_alive(daemon):
            try:
                state = Path(f"/proc/{daemon}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                state = "?"
            left[pid_file.name] = f"daemon {daemon}, state {state}"
    return left


def nothing_left(pid: int, cluster: Path) -> None:
    """Nothing of run ``pid`` is left: 10 s for what the kernel still tears down (a namespace
    whose last process is ending, a process killed at the run's end)."""
    deadline = time.monotonic() + 10
    while (any(made_by(pid).values()) or daemons_left(cluster)) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(made_by(pid).values()), made_by(pid)
    assert not daemons_left(cluster), daemons_left(cluster)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from jpfs_bench.read import make_tree

    root = tmp_path_factory.mktemp("netns") / "tree"
    make_tree(root, episodes=8, cameras=2, parquet_bytes=20_000, video_bytes=50_000, seed=1)
    return root


def command(dataset: Path, work: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jpfs.cli.main", "bench", "aggregate", "--dataset",
            str(dataset), "--via", "local,native", "--clients", "1", "--epochs", "1",
            "--no-drop", "--no-progress", "--work", str(work), "--hosts", "2", "--rtt",
            "0.5ms", "--rate", "1gbit", *extra]


def test_parse_units():
    assert netns.parse_rtt("0.5ms") == pytest.approx(0.0005)
    assert netns.parse_rtt("500us") == pytest.approx(0.0005)
    assert netns.parse_rtt("0") == 0.0
    assert netns.parse_rate("10gbit") == 10_000_000_000
    assert netns.parse_rate("100mbps") == 800_000_000
    for bad in ("fast", "1 parsec"):
        with pytest.raises(ValueError):
            netns.parse_rtt(bad)
        with pytest.raises(ValueError):
            netns.parse_rate(bad)


def test_run_on_simulated_hosts_measures_both_rtts_and_cleans_up(dataset, tmp_path):
    proc = subprocess.Popen(command(dataset, tmp_path / "w", "--json"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    net = res["network"]
    assert net["hosts"] == 2 and net["delay_method"] in ("netem", "relay")
    assert [s["rtt_ms"] for s in net["settings"]] == [0.0, 0.5]
    assert all(s["measured_rpc_ms"]["p50_ms"] > 0 for s in net["settings"])
    rows = [(r["via"], r["rtt_ms"]) for r in res["results"]]
    assert rows == [("local", 0.0), ("native", 0.0), ("native", 0.5)]
    files = sum(len(n) for _, _, n in os.walk(dataset))
    assert all(r["files"] == files and r["n_errors"] == 0 for r in res["results"])
    # the cluster file named only the simulated hosts' addresses
    assert all(a.startswith("10.231.") for a in net["addresses"])
    nothing_left(proc.pid, tmp_path / "w" / "cluster")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_run_cleans_up(dataset, tmp_path, sig):
    # far more epochs than the test waits for: the signal must find the run still reading
    proc = subprocess.Popen(command(dataset, tmp_path / "w", "--epochs", "100000"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=foreground_signals)
    try:
        deadline = time.monotonic() + 120
        # wait until the hosts and daemons are up and reading has begun
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail("the run ended before it was interrupted: " + proc.stderr.read())
            if len(made_by(proc.pid)["relays"]) == 2 or (
                    made_by(proc.pid)["namespaces"]
                    and list((tmp_path / "w" / "cluster").glob("storage-*.pid"))):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the simulated hosts never came up")
        time.sleep(1.0)
        assert proc.poll() is None, "the run ended before it was interrupted"
        proc.send_signal(sig)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, proc.stderr.read()[-3000:]
    nothing_left(proc.pid, tmp_path / "w" / "cluster")


def test_leftovers_of_a_dead_run_are_removed():
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that is gone: what a kill -9'd run leaves as owner
    ns, bridge = f"{netns.PREFIX}-{dead.pid}-0", f"jb{dead.pid}br"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True)
        subprocess.run(["ip", "link", "add", bridge, "type", "bridge"], check=True)
        subprocess.run(["ip", "link", "add", f"jb{dead.pid}h0", "type", "veth", "peer", "name",
                        "eth0", "netns", ns], check=True)
        found = netns.leftovers()
        assert ns in found["namespaces"] and bridge in found["veths"]
        netns.clean_leftovers()
        assert not any(made_by(dead.pid).values())
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
