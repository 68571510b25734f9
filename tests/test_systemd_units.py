"""contrib/systemd: the unit files load cleanly (``systemd-analyze verify``) and start the
daemons with flags they take.

The units name /usr/local/bin (``pip install jpfs`` as root); the check rewrites that to this
interpreter's scripts, so verify also finds the programs it would run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).parents[1] / "contrib" / "systemd"
BIN = Path(sys.executable).parent
INSTANCES = {"jpfs-meta@.service": "jpfs-meta@0.service",
             "jpfs-storage@.service": "jpfs-storage@1.service",
             "mnt-jpfs.mount": "mnt-jpfs.mount"}

requires_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (apt install systemd) to verify the unit files")


def test_the_units_are_all_checked():
    assert sorted(p.name for p in UNITS.iterdir()) == sorted(INSTANCES)


@requires_analyze
def test_systemd_analyze_verify_accepts_the_units(tmp_path):
    for name in INSTANCES:
        text = (UNITS / name).read_text().replace("/usr/local/bin/", f"{BIN}/")
        (tmp_path / name).write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", *INSTANCES.values()], cwd=tmp_path,
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
