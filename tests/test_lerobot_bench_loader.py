"""``jpfs bench loader`` beside the official LeRobotDataset, and without it.

Both run the real benchmark (a generated dataset, DataLoader workers) for a fraction of a second
per case: what is checked is the code path and the report, not the figures.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="jpfs bench loader needs torch")

TINY = ["--episodes", "3", "--frames-per-episode", "20-40", "--workers", "1", "--seconds",
        "0.3", "--repeat", "1", "--json"]


def _bench(tmp_path, *extra: str) -> tuple[dict, str]:
    r = subprocess.run([sys.executable, "-m", "jpfs_bench", "loader", "--dir", str(tmp_path),
                        *TINY, *extra], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stdout


def test_bench_loader_says_why_the_lerobot_baseline_is_missing(tmp_path):
    if importlib.util.find_spec("lerobot") is not None:
        fig, out = _bench(tmp_path, "--no-lerobot")
        assert fig["lerobot_skipped"] == "left out (--no-lerobot)"
    else:
        fig, out = _bench(tmp_path)
        assert "lerobot is not installed" in fig["lerobot_skipped"]
        assert "pip install lerobot" in out
    assert "lerobot baseline: skipped:" in out
    assert "lerobot_v30_samples_s" not in fig and "ratio_dropin_vs_lerobot" not in fig
    assert fig["naive_v21_samples_s"] > 0 and fig["batched_v30_samples_s"] > 0
    assert fig["worker_sharing"] == "file_system" and "share by file_system" in out
    # How far each shuffle mixes: distinct episodes in a batch, 1 to min(batch, episodes).
    for key in ("naive_v21", "dropin_v30", "batched_v30", "ring_v30"):
        assert 1 <= fig[f"{key}_episodes_per_batch"] <= 3, key


def test_bench_loader_measures_the_official_lerobot_dataset(tmp_path):
    pytest.importorskip("lerobot", reason="the official baseline needs lerobot (Python >= 3.12: "
                        "pip install lerobot==0.6.1)")
    fig, out = _bench(tmp_path, "--video")
    assert fig["lerobot_skipped"] is None
    assert fig["lerobot_video_backend"] in ("torchcodec", "pyav")
    assert f"video decoded by {fig['lerobot_video_backend']}" in out
    official = fig["lerobot_v30_samples_s"]
    assert official > 0 and fig["lerobot_v30_mb_s"] > 0
    assert 1 <= fig["lerobot_v30_episodes_per_batch"] <= 3
    # The ratios are the same run's figures divided, as printed in the table's last column.
    assert fig["ratio_dropin_vs_lerobot"] == pytest.approx(
        fig["dropin_v30_samples_s"] / official, rel=0.01, abs=0.01)
    assert fig["ratio_batched_vs_lerobot"] == pytest.approx(
        fig["batched_v30_samples_s"] / official, rel=0.01, abs=0.01)
    assert "x lerobot" in out and "ShardDataset vs the official LeRobotDataset" in out
