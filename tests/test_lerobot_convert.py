"""``jpfs lerobot convert / verify / info`` on tiny generated datasets with real encoded videos.

Outputs are checked independently of ``verify`` too: data rows read back with pyarrow, videos
decoded with PyAV, file boundaries recomputed from the source sizes. Interruption is a real
``SIGKILL`` of a real ``jpfs lerobot convert`` process group.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import av
import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jpfs.lerobot import layout
from jpfs.lerobot.convert import JOURNAL_DIR, convert, group_by_size, uncompressed_size
from jpfs.lerobot.dataset import load_meta
from jpfs.lerobot.fsutil import DatasetError
from jpfs.lerobot.generate import generate
from jpfs.lerobot.summary import describe
from jpfs.lerobot.verify import verify

REPO = Path(__file__).resolve().parents[1]
MB = 1024 * 1024
SHAPE = dict(cameras=2, frames_per_episode=(5, 15), resolution=(64, 48), state_dim=6,
             action_dim=6, tasks=3, rewards=True, progress=False)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("conv") / "src"
    generate(str(root), episodes=9, seed=11, **SHAPE)
    return root


@pytest.fixture(scope="module")
def limits(src: Path) -> dict:
    """Limits that put about 2-3 episodes in each file, and 2 files per chunk folder."""
    meta = load_meta(str(src))
    data = [uncompressed_size(pq.read_metadata(src / ep.data_file)) for ep in meta.episodes]
    vids = [(src / ep.videos[meta.video_keys[0]].path).stat().st_size for ep in meta.episodes]
    return dict(data_file_mb=2.5 * max(data) / MB, video_file_mb=2.5 * max(vids) / MB,
                chunks_size=2)


@pytest.fixture(scope="module")
def clean(src: Path, limits: dict, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("conv") / "clean"
    convert(str(src), str(dst), workers=1, progress=False, **limits)
    return dst


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jpfs.cli.main", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _limit_args(limits: dict) -> list[str]:
    return ["--data-file-mb", repr(limits["data_file_mb"]), "--video-file-mb",
            repr(limits["video_file_mb"]), "--files-per-chunk", str(limits["chunks_size"])]


def test_data_rows_equal_and_files_follow_the_size_rule(src: Path, clean: Path, limits: dict):
    old, new = load_meta(str(src)), load_meta(str(clean))
    assert new.version == "v3.0"
    want = pa.concat_tables([pq.read_table(src / f) for f in old.data_files])
    got = pa.concat_tables([pq.read_table(clean / f) for f in new.data_files])
    assert got.schema.remove_metadata() == want.schema.remove_metadata()
    assert got.equals(want)
    # Rollover rule: a new file starts when current size + next episode >= the limit.
    limit = int(limits["data_file_mb"] * MB)
    sizes = {ep.index: uncompressed_size(pq.read_metadata(src / ep.data_file))
             for ep in old.episodes}
    by_file: dict[str, list[int]] = {}
    for ep in new.episodes:
        by_file.setdefault(ep.data_file, []).append(ep.index)
    files = list(by_file)
    assert len(files) > 2
    for n, f in enumerate(files):
        eps = by_file[f]
        for k in range(1, len(eps)):
            assert sum(sizes[e] for e in eps[:k]) + sizes[eps[k]] < limit
        if n + 1 < len(files):
            assert sum(sizes[e] for e in eps) + sizes[by_file[files[n + 1]][0]] >= limit
    _check_chunk_folders(files, limits["chunks_size"])
    # One parquet row group per episode: a loader reads an episode without its neighbours.
    for f, eps in by_file.items():
        md = pq.read_metadata(clean / f)
        lengths = [new.episode(e).length for e in eps]
        assert [md.row_group(i).num_rows for i in range(md.num_row_groups)] == lengths


def test_row_group_rows_packs_episodes(src: Path, limits: dict, tmp_path: Path):
    dst = tmp_path / "packed"
    convert(str(src), str(dst), workers=1, progress=False, row_group_rows=10**6, **limits)
    meta = load_meta(str(dst))
    for f in meta.data_files:
        assert pq.read_metadata(dst / f).num_row_groups == 1
    assert verify(str(src), str(dst), workers=1, progress=False)["ok"]


def _check_chunk_folders(files: list[str], per_chunk: int) -> None:
    """chunk-NNN/file-MMM numbering: files 0..per_chunk-1 in a chunk, then the next chunk."""
    expect = []
    chunk = file = 0
    for _ in files:
        expect.append((chunk, file))
        chunk, file = layout.next_chunk_file(chunk, file, per_chunk)
    got = [(int(f.split("chunk-")[1][:3]), int(f.split("file-")[1][:3])) for f in files]
    assert got == expect
    assert max(c for c, _ in got) >= 1  # the test really crossed a chunk folder


def test_videos_concatenated_with_continuous_pts(src: Path, clean: Path, limits: dict):
    old, new = load_meta(str(src)), load_meta(str(clean))
    fps = new.fps
    for key in new.video_keys:
        files = new.video_files()
        files = [f for f in files if f"/{key}/" in f]
        assert len(files) > 1  # rollover happened
        _check_chunk_folders(files, limits["chunks_size"])
        for f in files:
            eps = [ep for ep in new.episodes if ep.videos[key].path == f]
            with av.open(str(clean / f)) as c:
                s = c.streams.video[0]
                times = [Fraction(fr.pts) * s.time_base for fr in c.decode(s)]
            total = sum(ep.length for ep in eps)
            assert times == [Fraction(i, fps) for i in range(total)]
            start = 0
            for ep in eps:
                seg = ep.videos[key]
                assert seg.from_timestamp == pytest.approx(start / fps, abs=1e-9)
                assert seg.to_timestamp == pytest.approx((start + ep.length) / fps, abs=1e-9)
                start += ep.length
        # Each source episode's compressed frames are copied, not re-encoded.
        ep = old.episodes[-1]
        with av.open(str(src / ep.videos[key].path)) as c:
            want = [bytes(p) for p in c.demux(c.streams.video[0]) if p.size]
        seg = new.episode(ep.index).videos[key]
        with av.open(str(clean / seg.path)) as c:
            s = c.streams.video[0]
            got = [bytes(p) for p in c.demux(s)
                   if p.size and seg.from_timestamp - 1e-6 <= p.pts * s.time_base
                   < seg.to_timestamp - 1e-6]
        assert got == want


def test_verify_passes_and_catches_corruption(src: Path, clean: Path, tmp_path: Path):
    report = verify(str(src), str(clean), workers=1, progress=False)
    meta = load_meta(str(src))
    assert report["ok"], report["problems"]
    assert report["frames_checked"] == meta.total_frames
    assert report["episode_videos_checked"] == len(meta.episodes) * len(meta.video_keys)

    bad = tmp_path / "bad"
    shutil.copytree(clean, bad)
    new = load_meta(str(bad))
    victim = new.data_files[1]
    t = pq.read_table(bad / victim)
    col = t.column("next.reward").to_pylist()
    col[0] += 0.5
    t = t.set_column(t.schema.get_field_index("next.reward"), "next.reward",
                     pa.array(col, pa.float32()))
    pq.write_table(t, bad / victim)
    k0, k1 = new.video_keys
    v0 = new.episodes[0].videos[k0].path
    v1 = new.episodes[0].videos[k1].path
    shutil.copy(bad / v1, bad / v0)  # another camera's frames under this camera's name
    report = verify(str(src), str(bad), workers=1, progress=False)
    assert not report["ok"]
    text = "\n".join(report["problems"])
    assert victim in text and "next.reward" in text
    assert v0 in text


def test_parallel_workers_give_identical_output(src: Path, clean: Path, limits: dict,
                                                tmp_path: Path):
    before = _tree(src)
    for executor in ("process", "thread"):
        dst = tmp_path / executor
        figures = convert(str(src), str(dst), workers=2, executor=executor, progress=False,
                          **limits)
        assert figures["workers"] == 2
        assert _tree(dst) == _tree(clean), executor
    assert _tree(src) == before  # SRC is only read


def test_kill_during_convert_then_rerun(src: Path, clean: Path, limits: dict, tmp_path: Path):
    dst = tmp_path / "killed"
    done = dst / JOURNAL_DIR / "done"
    proc = _cli("lerobot", "convert", str(src), str(dst), "--workers", "2", "--no-progress",
                *_limit_args(limits), start_new_session=True)
    n_tasks = len(_tree(clean)) - 4  # every file but the 4 meta files is one task
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if done.exists() and len(list(done.iterdir())) >= 2:
            break
        time.sleep(0.002)
    assert proc.poll() is None, "convert finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = len(list(done.iterdir()))
    print(f"killed after {finished} of {n_tasks} output files")
    assert finished < n_tasks
    # Not a valid dataset, and nothing at a final name is half-written.
    assert not (dst / layout.INFO_PATH).exists()
    with pytest.raises(DatasetError, match="info.json"):
        load_meta(str(dst))
    with pytest.raises(DatasetError, match="unfinished"):
        describe(str(dst))
    want = _tree(clean)
    for name, data in _tree(dst).items():
        if not name.startswith(JOURNAL_DIR):
            assert data == want[name], f"{name} is incomplete at its final name"
    rerun = _cli("lerobot", "convert", str(src), str(dst), "--workers", "2", "--no-progress",
                 "--json", *_limit_args(limits))
    out, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, err
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["resumed"] and figures["tasks_resumed"] >= finished
    assert _tree(dst) == _tree(clean)


def test_rerun_with_other_limits_keeps_only_valid_files(src: Path, limits: dict,
                                                        tmp_path: Path):
    dst = tmp_path / "half"
    n = 0
    keys = _plan_keys(src, limits)
    n_data = sum(1 for k in keys if k.startswith("data-"))
    stop_at = n_data + 2  # all data files and two video files finish, then an interrupt

    def stop(task):
        nonlocal n
        n += 1
        if n == stop_at:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(str(src), str(dst), workers=1, progress=False, on_task_done=stop, **limits)
    # Same limits for video, 3x for data: the data files change, the finished video files stay.
    other = dict(limits, data_file_mb=limits["data_file_mb"] * 3)
    figures = convert(str(src), str(dst), workers=1, progress=False, **other)
    fresh = tmp_path / "fresh"
    convert(str(src), str(fresh), workers=1, progress=False, **other)
    assert _tree(dst) == _tree(fresh)
    assert figures["tasks_resumed"] == 2


def _plan_keys(src: Path, limits: dict) -> list[str]:
    from jpfs.lerobot.convert import plan_conversion

    return [t.key for t in plan_conversion(str(src), progress=False, **limits).tasks]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _assert_not_valid(dst: Path) -> None:
    assert not (dst / layout.INFO_PATH).exists()


def test_missing_meta_file(src: Path, tmp_path: Path):
    bad = _copy(src, tmp_path / "src")
    (bad / layout.V21_EPISODES_STATS_PATH).unlink()
    with pytest.raises(DatasetError, match=r"episodes_stats\.jsonl: missing"):
        convert(str(bad), str(tmp_path / "dst"), workers=1, progress=False)
    _assert_not_valid(tmp_path / "dst")


def test_wrong_schema_names_the_file(src: Path, tmp_path: Path):
    bad = _copy(src, tmp_path / "src")
    meta = load_meta(str(bad))
    victim = bad / meta.episodes[4].data_file
    t = pq.read_table(victim)
    t = t.set_column(t.schema.get_field_index("frame_index"), "frame_index",
                     t.column("frame_index").cast(pa.float64()))
    pq.write_table(t, victim)
    with pytest.raises(DatasetError, match=rf"{victim.name}.*frame_index.*double"):
        convert(str(bad), str(tmp_path / "dst"), workers=1, progress=False)
    _assert_not_valid(tmp_path / "dst")
    pq.write_table(t.drop_columns(["action"]), victim)
    with pytest.raises(DatasetError, match=rf"{victim.name}.*missing \['action'\]"):
        convert(str(bad), str(tmp_path / "dst2"), workers=1, progress=False)


def test_truncated_mp4_names_the_file_then_rerun_finishes(src: Path, limits: dict,
                                                          tmp_path: Path):
    bad = _copy(src, tmp_path / "src")
    meta = load_meta(str(bad))
    victim = bad / meta.episodes[5].videos[meta.video_keys[1]].path
    good = victim.read_bytes()
    victim.write_bytes(good[: len(good) // 2])
    dst = tmp_path / "dst"
    proc = _cli("lerobot", "convert", str(bad), str(dst), "--workers", "2", "--executor",
                "process", "--no-progress", *_limit_args(limits))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert str(victim) in err and "truncated" in err
    assert "Traceback" not in err
    _assert_not_valid(dst)
    victim.write_bytes(good)  # the user fixes the source and reruns
    convert(str(bad), str(dst), workers=1, progress=False, **limits)
    assert verify(str(bad), str(dst), workers=1, progress=False)["ok"]


def test_video_with_fewer_frames_than_the_episode(src: Path, tmp_path: Path):
    bad = _copy(src, tmp_path / "src")
    meta = load_meta(str(bad))
    key = meta.video_keys[0]
    short, other = meta.episodes[2], meta.episodes[3]
    assert short.length != other.length
    shutil.copy(bad / other.videos[key].path, bad / short.videos[key].path)
    with pytest.raises(DatasetError, match=rf"{short.videos[key].path}.*frames"):
        convert(str(bad), str(tmp_path / "dst"), workers=1, progress=False)


def test_refuses_non_empty_destination_and_same_place(src: Path, tmp_path: Path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    with pytest.raises(DatasetError, match="not empty"):
        convert(str(src), str(dst), workers=1, progress=False)
    assert _tree(dst) == {"notes.txt": b"mine"}
    with pytest.raises(ValueError, match="differ from the source"):
        convert(str(src), str(src / "inside"), workers=1, progress=False)


def test_fsspec_destination(src: Path, clean: Path, limits: dict):
    """A non-local filesystem (fsspec memory://) takes the same path as jpfs:// will."""
    url = "memory://jpfs-test/v30"
    fs = fsspec.filesystem("memory")
    try:
        convert(str(src), url, workers=2, executor="thread", progress=False, **limits)
        meta = load_meta(url)
        assert [e.data_file for e in meta.episodes] == \
            [e.data_file for e in load_meta(str(clean)).episodes]
        for rel, data in _tree(clean).items():
            assert fs.cat_file(f"/jpfs-test/v30/{rel}") == data, rel
        assert verify(str(src), url, workers=1, progress=False)["ok"]
    finally:
        if fs.exists("/jpfs-test"):
            fs.rm("/jpfs-test", recursive=True)


def test_cli_info_and_verify(src: Path, clean: Path):
    for root in (src, clean):
        proc = _cli("lerobot", "info", str(root), "--json")
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        d = json.loads(out.strip().splitlines()[-1])
        meta = load_meta(str(root))
        assert (d["version"], d["episodes"], d["frames"]) == (
            meta.version, len(meta.episodes), meta.total_frames)
        assert set(d["cameras"]) == set(meta.video_keys)
        assert d["parts"]["data"]["files"] == len(meta.data_files)
        assert "LeRobot" in out
    proc = _cli("lerobot", "verify", str(src), str(clean), "--workers", "1", "--no-progress")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "match" in out


def test_bench_convert_runs(tmp_path: Path):
    """`jpfs bench convert` end to end at a tiny size: figures present and consistent."""
    proc = _cli("bench", "convert", "--episodes", "4", "--frames-per-episode", "5-9",
                "--workers", "1,2", "--repeat", "1", "--via", "local,memory://bench-test",
                "--dir", str(tmp_path), "--json")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    d = json.loads(out.strip().splitlines()[-1])
    runs = d["convert"]["runs"]
    assert [r["workers"] for r in runs] == [1, 2] and runs[0]["speedup"] == 1.0
    assert d["convert"]["file_reduction"] > 1
    checks = {c["frames"]: c for c in d["convert"]["verify"]}
    assert set(checks) == {"sample", "full"}
    assert 0 < checks["sample"]["video_frames_decoded"] <= checks["full"]["video_frames_decoded"]
    assert checks["full"]["video_frames_decoded"] == 2 * d["frames"] * d["cameras"]
    for via in ("local", "memory://bench-test"):
        for pattern in ("scan", "episodes"):
            res = d["read"][via][pattern]
            assert res["v2.1"]["frames"] == res["v3.0"]["frames"] == d["frames"]
            assert res["v2.1"]["ratio"] == 1.0


@given(st.lists(st.integers(1, 50), max_size=40), st.integers(1, 120), st.integers(1, 4))
def test_group_by_size_rule(sizes: list[int], limit: int, per_chunk: int):
    groups = group_by_size(sizes, limit, per_chunk)
    assert [i for _, _, g in groups for i in g] == list(range(len(sizes)))
    for n, (_, _, g) in enumerate(groups):
        for k in range(1, len(g)):
            assert sum(sizes[i] for i in g[:k]) + sizes[g[k]] < limit
        if n + 1 < len(groups):
            assert sum(sizes[i] for i in g) + sizes[groups[n + 1][2][0]] >= limit
    _check_numbering([(c, f) for c, f, _ in groups], per_chunk)


def _check_numbering(ids: list[tuple[int, int]], per_chunk: int) -> None:
    chunk = file = 0
    for got in ids:
        assert got == (chunk, file)
        chunk, file = layout.next_chunk_file(chunk, file, per_chunk)
