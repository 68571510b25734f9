"""Prefetch on a real mount: directory scans (in order, strided), random order (bounded waste),
co-access learned across directories, hints, large sequential reads, and --no-prefetch."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
from fuse_support import mounted, requires_fuse

import jpfs
from jpfs import localcluster
from jpfs.client.tools.transfer import import_tree
from jpfs.fuse.mount import daemon_pid, is_jpfs_mount

pytestmark = [requires_fuse, pytest.mark.fuse]

CHUNK = 1 << 20
N_SCAN = 500
EPISODES = 24
EPISODES_2 = 48
CAMERAS = ("observation.images.top", "observation.images.wrist_1")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("pfcluster")
    localcluster.up(d, meta_shards=2, storage_nodes=2, chunk_size=CHUNK, sync=False)
    src = tmp_path_factory.mktemp("pfsrc")
    rng = random.Random(5)
    (src / "scan").mkdir()
    for i in range(N_SCAN):
        (src / "scan" / f"sample_{i:05d}.bin").write_bytes(rng.randbytes(rng.randrange(8000,
                                                                                    24000)))
    # LeRobot-shaped, with our own names: nothing in the prefetcher knows them
    for i in range(EPISODES):
        p = src / "ds" / "data" / "chunk-000" / f"episode_{i:06d}.parquet"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rng.randbytes(30000))
        for cam in CAMERAS:
            v = src / "ds" / "videos" / "chunk-000" / cam / f"episode_{i:06d}.mp4"
            v.parent.mkdir(parents=True, exist_ok=True)
            v.write_bytes(rng.randbytes(60000))
    for i in range(EPISODES_2):  # a second tree, for an epoch that must sweep every directory
        p = src / "ds2" / "data" / f"episode_{i:06d}.parquet"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rng.randbytes(20000))
        for cam in CAMERAS:
            v = src / "ds2" / "videos" / cam / f"episode_{i:06d}.mp4"
            v.parent.mkdir(parents=True, exist_ok=True)
            v.write_bytes(rng.randbytes(60000))
    (src / "big.bin").write_bytes(rng.randbytes(24 * CHUNK))
    with jpfs.connect(d) as c:
        c.run(import_tree, src, "/")
    yield d, src
    localcluster.down(d, timeout=5)


def _read(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _opens(m) -> dict:
    return m.stats()["fuse"]["opens"]


def _delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in b}


def _served_ahead(d: dict) -> int:
    """Opens whose bytes were there before the reader asked."""
    return d["prefetched"] + d["memory"] + d["kernel"]


def test_in_order_scan_hits(cluster, tmp_path):
    """A reader going through a directory in name order finds the files ahead of it fetched
    (a read-write mount: into the mount's cache), in batches."""
    c, src = cluster
    names = sorted(os.listdir(src / "scan"))
    with mounted(c, tmp_path / "m") as m:
        for n in names[:10]:
            _read(m / f"scan/{n}")
        before = _opens(m)
        for n in names[10:]:
            assert _read(m / f"scan/{n}") == (src / "scan" / n).read_bytes()
        d = _delta(before, _opens(m))
        assert _served_ahead(d) >= 0.9 * (N_SCAN - 10), d
        s = m.stats()
        assert s["prefetch"]["batches"] < (N_SCAN - 10) / 4  # batched: many files per call
        assert s["prefetch"]["scan_misses"] == 0


def _scan_from_the_kernel(m, src: Path, names: list[str], start: int) -> None:
    """Read ``names`` of the scan directory in order through a read-only mount, the first
    ``start`` to set the scan going; the rest were given to the kernel's page cache ahead of
    the reader, so most of them cost no request at all, and every byte reads right."""
    for n in names[:start]:
        _read(m / f"scan/{n}")
    before = m.stats()["fuse"]
    for n in names[start:]:
        assert _read(m / f"scan/{n}") == (src / "scan" / n).read_bytes()
    after = m.stats()["fuse"]
    rest = len(names) - start
    d = _delta(before["opens"], after["opens"])
    assert d["fetched"] + d["joined"] + d["disk"] <= 0.1 * rest, d  # waited for a fetch
    assert after["handed_files"] - before["handed_files"] >= 0.6 * rest, after
    assert after["requests_total"] - before["requests_total"] < 0.5 * rest, after
    s = m.stats()["prefetch"]
    assert s["scan_misses"] == 0 and s["batches_cancelled"] == 0, s


def test_an_in_order_reader_of_a_read_only_mount_reads_from_the_kernel(cluster, tmp_path):
    c, src = cluster
    names = sorted(os.listdir(src / "scan"))
    with mounted(c, tmp_path / "m", "--read-only") as m:
        _scan_from_the_kernel(m, src, names, 10)
        assert m.stats()["prefetch"]["batches"] < (N_SCAN - 10) / 4


def test_strided_scan_hits(cluster, tmp_path):
    c, src = cluster
    names = sorted(os.listdir(src / "scan"))[::3]
    with mounted(c, tmp_path / "m", "--read-only") as m:
        _scan_from_the_kernel(m, src, names, 6)


def _shuffled(src: Path, seed: int) -> list[str]:
    """The names of the scan directory in a random order (an epoch's)."""
    names = sorted(os.listdir(src / "scan"))
    random.Random(seed).shuffle(names)
    return names


def _start_epoch(m, names: list[str]) -> None:
    """Read the first 30 of ``names``: out of name order, enough for the directory's sweep."""
    for n in names[:30]:
        _read(m / f"scan/{n}")


def test_random_order_wastes_a_bounded_number_of_bytes(cluster, tmp_path):
    """An epoch in random order: once the directory is seen read out of order, it is fetched
    whole (it fits within the cache share) and given to the kernel's page cache, so the rest
    of the epoch reads without waiting for a fetch; every byte fetched is then read."""
    c, src = cluster
    names = _shuffled(src, 11)
    with mounted(c, tmp_path / "m", "--read-only") as m:
        _start_epoch(m, names)
        before = m.stats()["fuse"]
        for n in names[30:]:
            assert _read(m / f"scan/{n}") == (src / "scan" / n).read_bytes()
        after = m.stats()["fuse"]
        d = _delta(before["opens"], after["opens"])
        waited = d["fetched"] + d["joined"] + d["disk"]
        assert waited <= 0.2 * (N_SCAN - 30), d
        # most files were read with no request at all: the kernel had them
        assert after["handed_files"] >= 0.5 * (N_SCAN - 30), after
        assert after["requests_total"] - before["requests_total"] < 0.5 * (N_SCAN - 30)
        s = m.stats()
        assert s["prefetch"]["sweeps"] == 1
        cache = s["cache"]
        assert cache["prefetched_bytes"] - cache["prefetch_hit_bytes"] <= 16 * 24000, cache


def _shuffled_until_swept(m, names: list[str]) -> None:
    """``_start_epoch``, then wait until the sweep has given most of the rest to the kernel."""
    _start_epoch(m, names)
    deadline = time.monotonic() + 30
    while m.stats()["fuse"]["handed_files"] < 0.8 * (len(names) - 30):
        assert time.monotonic() < deadline, m.stats()
        time.sleep(0.05)


def test_a_swept_directory_is_read_from_the_kernel_and_stays_right_when_it_lets_go(
        cluster, tmp_path):
    """A shuffled epoch on a read-only mount: the swept directory goes to the kernel's page
    cache before it is read, so the rest of the epoch costs almost no requests (the READ of a
    page held back from one file in eight, which tells prefetch how far the reader is); once
    the kernel has dropped those pages and entries, every file still reads right."""
    c, src = cluster
    names = _shuffled(src, 21)
    with mounted(c, tmp_path / "m", "--read-only") as m:
        _shuffled_until_swept(m, names)
        before = m.stats()["fuse"]
        for n in names[30:]:
            assert _read(m / f"scan/{n}") == (src / "scan" / n).read_bytes()
        after = m.stats()["fuse"]
        assert after["requests_total"] - before["requests_total"] <= (N_SCAN - 30) / 4, after
        assert after["handed_reads"] > before["handed_reads"]
        # what the reader read no longer counts as prefetched ahead of it
        s = m.stats()
        assert s["prefetch"]["handed_bytes"] <= 8 * 24000, (s["fuse"], s["prefetch"])
        Path("/proc/sys/vm/drop_caches").write_text("3")  # pages, entries and inodes
        for n in reversed(names):
            assert _read(m / f"scan/{n}") == (src / "scan" / n).read_bytes()


def test_a_mount_told_to_stop_while_it_hands_a_sweep_to_the_kernel_stops(cluster, tmp_path):
    """SIGTERM while a reader is reading a directory being swept and handed to the kernel:
    the mount unmounts and exits promptly and cleanly (a store that waits for a READ's pages
    must not outlive the loop that answers the READ)."""
    c, src = cluster
    names = _shuffled(src, 22)
    with mounted(c, tmp_path / "m", "--read-only") as m:
        _start_epoch(m, names)
        stop = threading.Event()

        def reader() -> None:
            for n in names[30:]:
                if stop.is_set():
                    return
                try:
                    _read(m / f"scan/{n}")
                except OSError:  # the mount went away under it
                    return

        t = threading.Thread(target=reader)
        t.start()
        os.kill(m.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while daemon_pid(str(m.path)) == m.pid:
            assert time.monotonic() < deadline, "the mount did not stop"
            time.sleep(0.05)
        stop.set()
        t.join(10)
        assert not is_jpfs_mount(str(m.path))
        log = (tmp_path / "m.log").read_text()
        assert "Traceback" not in log, log


def test_a_sweep_runs_ahead_of_its_reader_by_kernel_ahead(cluster, tmp_path):
    """``--kernel-ahead`` bounds how far a sweep hands files to the kernel's page cache ahead
    of the readers: with room for a dozen files the sweep waits for the reader and goes on as
    it reads (which then fetches most files itself), and every file reads right."""
    c, src = cluster
    names = _shuffled(src, 24)
    with mounted(c, tmp_path / "m", "--read-only", "--kernel-ahead", "256K") as m:
        _start_epoch(m, names)
        time.sleep(1)  # time enough to hand the whole directory, were it allowed
        s = m.stats()
        assert s["prefetch"]["sweeps"] == 1, s["prefetch"]
        assert s["prefetch"]["handed_bytes"] <= (256 << 10) + 24000, s["prefetch"]
        held_back = s["fuse"]["handed_files"]
        assert held_back <= 40, s["fuse"]
        for n in names[30:]:
            assert _read(m / f"scan/{n}") == (src / "scan" / n).read_bytes()
        assert m.stats()["fuse"]["handed_files"] > held_back, m.stats()["fuse"]


def test_random_subset_beyond_the_cache_share_wastes_little(cluster, tmp_path):
    """Random reads of a directory that does not fit within the cache share: no sweep; what
    a false start fetched and nobody read stays within a few files."""
    c, src = cluster
    picks = random.Random(12).sample(sorted(os.listdir(src / "scan")), 200)
    with mounted(c, tmp_path / "m", "--read-only", "--memory-cache", "8M") as m:
        for n in picks:
            assert _read(m / f"scan/{n}") == (src / "scan" / n).read_bytes()
        s = m.stats()
        assert s["prefetch"]["sweeps"] == 0
        cache = s["cache"]
        assert cache["prefetched_bytes"] - cache["prefetch_hit_bytes"] <= 16 * 24000, cache


def test_coaccess_is_learned_then_hits(cluster, tmp_path):
    c, src = cluster
    order = list(range(EPISODES))
    random.Random(3).shuffle(order)
    with mounted(c, tmp_path / "m", "--read-only") as m:
        base = m / "ds"

        def episode(i: int) -> None:
            _read(base / f"data/chunk-000/episode_{i:06d}.parquet")
            for cam in CAMERAS:
                _read(base / f"videos/chunk-000/{cam}/episode_{i:06d}.mp4")

        for i in order[:4]:
            episode(i)
        before = _opens(m)
        for i in order[4:]:
            episode(i)
        d = _delta(before, _opens(m))
        # at most the parquet of an episode waits for a fetch, never its videos (predicted at
        # its open, or given to the kernel with their swept directory)
        assert d["fetched"] + d["joined"] + d["disk"] <= EPISODES - 4, d
        rules = m.stats()["prefetch"]["rules"]
        assert any(r["from"].startswith("/ds/data/chunk-#/episode_#") and r["hits"] > 0
                   for r in rules), rules


def test_a_shuffled_epoch_sweeps_the_directories_coaccess_predicts(cluster, tmp_path):
    """Co-access predicts each video at its parquet's open, just before the reader wants it;
    in a shuffled epoch the video directories are swept as well (each fits within the cache
    share on its own, not beside the other), so most opens find their bytes already there,
    and every swept byte is read."""
    c, src = cluster
    order = list(range(EPISODES_2))
    random.Random(4).shuffle(order)
    video_dir = 60000 * EPISODES_2
    memory = 3 * video_dir  # the share (half) holds one video directory, not two
    with mounted(c, tmp_path / "m", "--read-only", "--memory-cache", str(memory)) as m:
        base = m / "ds2"
        for i in order:
            assert _read(base / f"data/episode_{i:06d}.parquet") == \
                (src / "ds2" / "data" / f"episode_{i:06d}.parquet").read_bytes()
            for cam in CAMERAS:
                _read(base / f"videos/{cam}/episode_{i:06d}.mp4")
        s = m.stats()
        assert s["prefetch"]["sweeps"] == 1 + len(CAMERAS), s["prefetch"]
        cache = s["cache"]
        assert cache["prefetched_bytes"] - cache["prefetch_hit_bytes"] <= 16 * 60000, cache


def test_a_hinted_shuffled_epoch_sweeps_nothing(cluster, tmp_path):
    """A reader that hints what it opens next (``ShardDataset`` does) may read a subset (its
    rank's share): the mount fetches what was hinted, not whole directories."""
    c, src = cluster
    order = list(range(EPISODES_2))
    random.Random(6).shuffle(order)
    with mounted(c, tmp_path / "m", "--read-only") as m:
        base = m / "ds2"
        paths = [f"ds2/data/episode_{i:06d}.parquet" for i in order] + \
            [f"ds2/videos/{cam}/episode_{i:06d}.mp4" for i in order for cam in CAMERAS]
        m.hint(paths)
        m.wait_for(lambda s: s["cache"]["prefetched"] >= len(paths), what="hinted files fetched")
        for i in order:
            _read(base / f"data/episode_{i:06d}.parquet")
            for cam in CAMERAS:
                _read(base / f"videos/{cam}/episode_{i:06d}.mp4")
        assert m.stats()["prefetch"]["sweeps"] == 0


def test_hinted_paths_are_fetched_before_they_are_opened(cluster, tmp_path):
    c, src = cluster
    names = sorted(os.listdir(src / "scan"))
    rng = random.Random(7)
    picks = rng.sample(names, 100)
    with mounted(c, tmp_path / "m", "--read-only") as m:
        m.hint([str(m / f"scan/{n}") for n in picks[:50]] + [f"scan/{n}" for n in picks[50:]])
        # hint_files counts files picked for a batch, before the batch fetches them: wait for
        # the cache to hold all 100 blobs, or the first open may race the batch
        m.wait_for(lambda s: s["prefetch"]["hint_files"] == 100
                   and s["cache"]["prefetched"] == 100, what="hinted files fetched")
        before = _opens(m)
        for n in picks:
            assert _read(m / f"scan/{n}") == (src / "scan" / n).read_bytes()
        d = _delta(before, _opens(m))
        assert d["prefetched"] == 100, d
        assert m.stats()["prefetch"]["hint_opened"] == 100


def test_large_sequential_reads_read_ahead(cluster, tmp_path):
    c, src = cluster
    want = (src / "big.bin").read_bytes()
    with mounted(c, tmp_path / "m", "--read-only", "--memory-cache", "64M") as m:
        got = bytearray()
        with open(m / "big.bin", "rb", buffering=0) as f:
            while piece := f.read(1 << 20):
                got += piece
        assert got == want
        s = m.stats()
        assert s["prefetch"]["readahead_chunks"] >= 16
        assert s["cache"]["prefetch_hits"] >= 16, s["cache"]  # most chunks were there in time


def test_no_prefetch_turns_it_all_off(cluster, tmp_path):
    c, src = cluster
    names = sorted(os.listdir(src / "scan"))[:100]
    with mounted(c, tmp_path / "m", "--read-only", "--no-prefetch") as m:
        for n in names:
            _read(m / f"scan/{n}")
        s = m.stats()
        assert s["fuse"]["opens"]["fetched"] == 100
        assert s["cache"]["prefetched"] == 0 and s["prefetch"]["listings"] == 0
        m.hint([f"scan/{names[0]}"])  # hints are still checked, but not fetched
        assert m.stats()["prefetch"]["hint_files"] == 0


def test_a_data_loader_hints_a_read_only_mount_through_its_socket(cluster, tmp_path):
    """A --read-only mount is read-only in the kernel: ShardDataset's hints find the socket."""
    pytest.importorskip("torch", reason="jpfs.torch (the hint sender) needs torch")
    from jpfs.torch.readahead import mount_hint

    c, src = cluster
    names = sorted(os.listdir(src / "scan"))[::7][:40]
    with mounted(c, tmp_path / "m", "--read-only") as m:
        hint = mount_hint(str(m / "scan"))
        assert hint is not None
        hint([str(m / f"scan/{n}") for n in names])
        m.wait_for(lambda s: s["prefetch"]["hint_paths"] == 40
                   and s["cache"]["prefetched"] >= 40, what="hinted files fetched")
