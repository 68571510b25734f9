"""``jpfs bench soak``, short: ShardDataset epochs over ``jpfs://`` and through a mount while
leaders, storage nodes and etcd are killed and paused. Every sample of every epoch arrives
exactly once and equal to the source, and each fault's dip is reported."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from fuse_support import requires_fuse

pytestmark = [pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed"),
              pytest.mark.slow, pytest.mark.fuse,
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]


@requires_fuse
def test_epochs_through_faults_deliver_every_sample_once(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "jpfs.cli.main", "bench", "soak", "--episodes", "40",
         "--epochs", "2", "--fault-every", "1", "--json"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["exactly_once_and_equal"], res["epochs"]
    assert set(res["epochs"]) == {"jpfs 0", "jpfs 1", "mount 0", "mount 1"}
    for name, epoch in res["epochs"].items():
        assert epoch["samples"] == res["samples_per_epoch"], name
    # the fault loop runs only while the epochs do: each of these met an epoch's opening (its
    # metadata reads) or its samples; those that began among the samples report their dip
    assert len(res["faults"]) >= 2, res["faults"]
    for e in res["epochs"].values():
        for f in e["faults"]:
            assert f["lowest_per_s"] >= 0 and f["fault"] in {x["fault"] for x in res["faults"]}
