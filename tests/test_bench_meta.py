"""``jpfs bench meta``: every phase measured against the local baseline, the shard's ceiling,
and the JSON object a script reads from the last line."""

from __future__ import annotations

import json
import subprocess
import sys

from jpfs_bench.meta import PHASES


def test_bench_meta_reports_every_phase_and_the_ceiling(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "jpfs.cli.main", "bench", "meta", "--shards", "1", "--clients", "1",
         "--files", "300", "--no-sync", "--json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    one = res["configs"]["1"]
    for layout in ("private", "shared"):
        assert set(one[layout]) == set(PHASES)
        for phase, r in one[layout].items():
            assert r["ops_per_s"] > 0 and r["ratio_vs_local"] > 0, (layout, phase)
    for phase in ("create", "stat"):
        r = res["ceiling"][phase]
        assert r["ops_per_s"] > 0 and r["shard_cpu_us_per_op"] > 0 and r["ratio_vs_local"] > 0
    assert "one shard's ceiling" in out.stdout
