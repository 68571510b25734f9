"""``jpfs bench leadership``, short: the loaded run's figures, and the JSON a script reads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed"),
              pytest.mark.slow]


def test_bench_leadership_counts_calls_and_step_downs(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "jpfs.cli.main", "bench", "leadership", "--seconds", "4",
         "--baseline-seconds", "2", "--busy", "1", "--syncers", "1", "--json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(res) == {"quiet", "busy"}
    for run in res.values():
        assert run["calls"] > 0 and run["calls_per_s"] > 0, run
        assert run["failed"] == 0 and run["stepdowns"] == 0, run
    assert res["busy"]["busy"] == 1 and res["busy"]["syncers"] == 1
    assert "metadata leadership" in out.stdout
