"""``jpfs lerobot verify`` against conversions whose parquet differs from SRC's in representation
only (what LeRobot's official converter writes: ``list<float>`` for v2.1's
``fixed_size_list<float>[n]``), and against ones that differ in values or types.

The DST data files are real parquet rewritten here with pyarrow.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from jpfs.lerobot.convert import convert
from jpfs.lerobot.dataset import load_meta
from jpfs.lerobot.generate import generate
from jpfs.lerobot.verify import verify

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("verify")
    src, dst = base / "src", base / "dst"
    generate(str(src), episodes=5, cameras=1, video="stub", frames_per_episode=(4, 9),
             state_dim=5, action_dim=4, seed=2, progress=False)
    convert(str(src), str(dst), data_file_mb=0.003, workers=1, progress=False)
    assert len(load_meta(str(dst)).data_files) >= 2
    return src, dst


def _rewrite(dst: Path, out: Path, change: Callable[[pa.Table], pa.Table]) -> Path:
    """A copy of ``dst`` whose every data file is ``change(table)``, written with pyarrow."""
    shutil.copytree(dst, out)
    for rel in load_meta(str(out)).data_files:
        path = out / rel
        md = pq.read_metadata(path)
        table = pq.read_table(path)
        pq.write_table(change(table), path, row_group_size=max(1, md.num_rows))
    return out


def _as_lists(table: pa.Table) -> pa.Table:
    """fixed_size_list columns as variable-length lists, as the official converter writes."""
    fields = [pa.field(f.name, pa.list_(f.type.value_type), f.nullable)
              if pa.types.is_fixed_size_list(f.type) else f for f in table.schema]
    return table.cast(pa.schema(fields, metadata=table.schema.metadata))


def test_representation_differences_are_notes(pair, tmp_path):
    src, dst = pair
    official = _rewrite(dst, tmp_path / "official", _as_lists)
    assert pq.read_schema(next(official.glob("data/*/*.parquet"))).field("action").type == \
        pa.list_(pa.float32())
    report = verify(str(src), str(official), workers=2, progress=False)
    assert report["ok"], report["problems"]
    assert report["frames_checked"] == load_meta(str(src)).total_frames
    text = "\n".join(report["notes"])
    assert re.search(r"'action' stored as list<\w+: float> in DST, "
                     r"fixed_size_list<\w+: float>\[4\] in SRC", text), text
    assert "'observation.state'" in text
    # The command says so too, and succeeds.
    proc = subprocess.run([sys.executable, "-m", "jpfs.cli.main", "lerobot", "verify", str(src),
                           str(official), "--no-progress"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "note: column 'action' stored as list<" in proc.stdout
    # A faithful conversion has no notes at all.
    assert verify(str(src), str(dst), workers=1, progress=False)["notes"] == []


def test_a_changed_value_in_a_list_column_is_a_problem(pair, tmp_path):
    src, dst = pair

    def nudge(table: pa.Table) -> pa.Table:
        t = _as_lists(table)
        rows = t.column("action").to_pylist()
        rows[1] = [rows[1][0] + 1e-3, *rows[1][1:]]
        i = t.schema.get_field_index("action")
        return t.set_column(i, "action", pa.array(rows, pa.list_(pa.float32())))

    bad = _rewrite(dst, tmp_path / "nudged", nudge)
    report = verify(str(src), str(bad), workers=1, progress=False)
    assert not report["ok"]
    assert report["problem_count"] == len(load_meta(str(bad)).data_files)  # one per file
    assert all("values of ['action'] differ from SRC" in p for p in report["problems"])


def test_another_logical_type_or_a_missing_column_is_a_problem(pair, tmp_path):
    src, dst = pair

    def widen(table: pa.Table) -> pa.Table:
        i = table.schema.get_field_index("observation.state")
        return table.set_column(i, "observation.state",
                                pc.cast(table.column(i), pa.list_(pa.float64())))

    report = verify(str(src), str(_rewrite(dst, tmp_path / "f64", widen)), workers=1,
                    progress=False)
    assert not report["ok"]
    assert re.search(r"column 'observation.state' is list<\w+: double>, SRC has "
                     r"fixed_size_list<\w+: float>\[5\]", report["problems"][0])

    report = verify(str(src), str(_rewrite(dst, tmp_path / "drop",
                                           lambda t: t.drop_columns(["frame_index"]))),
                    workers=1, progress=False)
    assert not report["ok"] and "columns ['frame_index'] missing" in report["problems"][0]
