"""contrib/systemd: the unit files load cleanly (``systemd-analyze verify``) and start the
daemons with flags they take; the etcd drop-in's settings are ones systemd and etcd take.

The units name /usr/local/bin (``pip install jpfs`` as root); the check rewrites that to this
interpreter's scripts, so verify also finds the programs it would run.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

UNITS = Path(__file__).parents[1] / "contrib" / "systemd"
BIN = Path(sys.executable).parent
INSTANCES = {"jpfs-meta@.service": "jpfs-meta@0.service",
             "jpfs-storage@.service": "jpfs-storage@1.service",
             "mnt-jpfs.mount": "mnt-jpfs.mount"}
DROP_INS = {"etcd-jpfs.conf"}
"""Drop-ins for other packages' units (Debian's etcd-server)."""

requires_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (apt install systemd) to verify the unit files")


def test_the_units_are_all_checked():
    assert sorted(p.name for p in UNITS.iterdir()) == sorted([*INSTANCES, *DROP_INS])


@requires_analyze
def test_systemd_analyze_verify_accepts_the_units(tmp_path):
    for name in INSTANCES:
        text = (UNITS / name).read_text().replace("/usr/local/bin/", f"{BIN}/")
        (tmp_path / name).write_text(text)
    # the drop-in's [Service] settings, in a unit of their own
    drop_in = (UNITS / "etcd-jpfs.conf").read_text()
    (tmp_path / "etcd-jpfs.service").write_text(
        f"[Unit]\nDescription=etcd, JPFS's drop-in\n{drop_in}ExecStart={shutil.which('true')}\n")
    r = subprocess.run(["systemd-analyze", "verify", *INSTANCES.values(), "etcd-jpfs.service"],
                       cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr.strip() == "" and r.stdout.strip() == "", \
        r.stdout + r.stderr


@pytest.mark.parametrize("unit, program", [("jpfs-meta@.service", "jpfs-meta"),
                                           ("jpfs-storage@.service", "jpfs-storage")])
def test_exec_start_uses_flags_the_daemon_takes(unit, program):
    exec_start = re.search(r"^ExecStart=(\S+) (.*)$", (UNITS / unit).read_text(), re.M)
    assert exec_start is not None and exec_start[1] == f"/usr/local/bin/{program}"
    helps = subprocess.run([str(BIN / program), "--help"], capture_output=True, text=True,
                           check=True, timeout=60).stdout
    flags = re.findall(r"(--[a-z-]+)", exec_start[2])
    assert "--cluster" in flags and "--index" in flags
    for flag in flags:
        assert re.search(rf"{flag}\b", helps), f"{program} takes no {flag}"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.mark.skipif(shutil.which("etcd") is None,
                    reason="etcd is not installed (apt install etcd-server)")
def test_etcd_takes_the_drop_ins_timing(tmp_path):
    """etcd started with the drop-in's environment (as systemd gives it) runs with its
    heartbeat and election timeout."""
    env = dict(os.environ)
    for line in (UNITS / "etcd-jpfs.conf").read_text().splitlines():
        if line.startswith("Environment="):
            key, value = line.removeprefix("Environment=").split("=", 1)
            env[key] = value
    client, peer = _free_ports(2)
    log = tmp_path / "etcd.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["etcd", "--data-dir", str(tmp_path / "d"),
             "--listen-client-urls", f"http://127.0.0.1:{client}",
             "--advertise-client-urls", f"http://127.0.0.1:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
            env=env, stdout=out, stderr=out)
    try:
        # etcd 3.4 logs "heartbeat = 250ms", 3.5 "heartbeat-interval":"250ms"
        heartbeat = re.compile(r'heartbeat(-interval)?"? ?[=:] ?"?(\d+m?s)')
        election = re.compile(r'election(-timeout)?"? ?[=:] ?"?(\d+(\.\d+)?m?s)')
        deadline = time.monotonic() + 30
        while not (election.search(log.read_text()) and heartbeat.search(log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        text = log.read_text()
        assert heartbeat.search(text)[2] == "250ms", text
        assert election.search(text)[2] in ("2500ms", "2.5s"), text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
