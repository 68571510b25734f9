"""``jpfs import s3://...``: imports from an object store, against a real S3 API server.

The server is moto's server mode (``moto_server``), started here as a separate process on
127.0.0.1 with a free port; the data is a LeRobot-shaped tree uploaded to it with s3fs, imported
into real JPFS daemons with the ``jpfs`` command, and read back through the native client.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import jpfs

s3fs = pytest.importorskip("s3fs")
if shutil.which("moto_server", path=os.path.dirname(sys.executable)) is None:
    pytest.skip("needs moto's server (pip install 'moto[server]')", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
CHUNK = 64 * 1024
BUCKET = "robot-data"
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
         "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server process on loopback; yields its endpoint URL."""
    port = _free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"),
                             "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"moto_server did not start (see {log.name})") from None
            time.sleep(0.2)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def _fs(endpoint: str):
    return s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=endpoint,
                             skip_instance_cache=True)


@pytest.fixture(scope="module")
def uploaded(s3, tmp_path_factory):
    """A small LeRobot v2.1 dataset plus a multi-chunk file and an empty one, in the bucket."""
    from jpfs.lerobot.generate import generate

    local = tmp_path_factory.mktemp("src") / "ds"
    generate(str(local), episodes=6, cameras=2, video="stub", video_bytes=3000,
             frames_per_episode=(5, 9), progress=False)
    (local / "extra").mkdir()
    (local / "extra" / "big.bin").write_bytes(os.urandom(3 * CHUNK + 123))
    (local / "extra" / "empty").write_bytes(b"")
    fs = _fs(s3)
    fs.mkdir(BUCKET)
    fs.put(str(local), f"{BUCKET}/datasets/ds", recursive=True)
    files = {str(p.relative_to(local)): p.read_bytes() for p in local.rglob("*") if p.is_file()}
    assert len(fs.find(f"{BUCKET}/datasets/ds")) == len(files)
    return files


def _import(cluster: Path, endpoint: str, *extra: str, progress: bool = False):
    env = {**os.environ, **CREDS, "JPFS_CLUSTER": str(cluster)}
    cmd = [sys.executable, "-m", "jpfs.cli.main", "import", f"s3://{BUCKET}/datasets/ds",
           "jpfs:/imported/ds", "-o", f"endpoint_url={endpoint}", "-o", "skip_instance_cache=true",
           *extra]
    if not progress:
        cmd.append("--json")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return r if progress else json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_import_from_s3_copies_resumes_and_follows_changes(make_cluster, s3, uploaded):
    d = make_cluster(meta_shards=2, storage_nodes=2, chunk_size=CHUNK)
    first = _import(d, s3, "--parallel", "3")
    assert first["files"] == len(uploaded) and first["errors"] == []
    assert first["bytes"] == sum(len(b) for b in uploaded.values())
    fs = _fs(s3)
    with jpfs.connect(d) as c:
        for rel, want in uploaded.items():
            assert c.read_bytes(f"/imported/ds/{rel}") == want, rel
        # The store's modification time is kept: what resume compares.
        info = fs.info(f"{BUCKET}/datasets/ds/meta/info.json")
        got = c.stat("/imported/ds/meta/info.json").mtime_ns
        assert abs(got / 1e9 - info["LastModified"].timestamp()) < 1e-3
        assert c.layout("/imported/ds/extra/big.bin").attr.size == 3 * CHUNK + 123
        # A directory's small files went out as one packed batch (one node).
        data = sorted(c.listdir("/imported/ds/data/chunk-000"))
        nodes = {c.layout(f"/imported/ds/data/chunk-000/{n}").chunks[0].nodes for n in data}
        assert len(nodes) == 1
    again = _import(d, s3)
    assert again["files"] == 0 and again["skipped"] == len(uploaded)
    # An interrupted import: what is missing (or changed in the store) is copied, nothing else.
    with jpfs.connect(d) as c:
        c.remove("/imported/ds/extra/big.bin")
        c.remove("/imported/ds/data/chunk-000/episode_000003.parquet")
    time.sleep(1.1)  # S3 times have (at best) millisecond resolution; make the change visible
    changed = b'{"task_index": 0, "task": "new"}\n'
    fs.pipe(f"{BUCKET}/datasets/ds/meta/tasks.jsonl", changed)
    third = _import(d, s3)
    assert third["files"] == 3 and third["skipped"] == len(uploaded) - 3
    with jpfs.connect(d) as c:
        assert c.read_bytes("/imported/ds/meta/tasks.jsonl") == changed
        assert c.read_bytes("/imported/ds/extra/big.bin") == uploaded["extra/big.bin"]


def test_import_from_s3_shows_progress_and_reads_as_a_dataset(make_cluster, s3, uploaded,
                                                              monkeypatch):
    d = make_cluster(meta_shards=1, storage_nodes=1, chunk_size=CHUNK)
    r = _import(d, s3, progress=True)
    total = sum(len(b) for b in uploaded.values())
    # tqdm's last refresh: the total is known (listed first) and reached.
    assert f"files={len(uploaded)}/{len(uploaded)}" in r.stderr, r.stderr
    assert "100%" in r.stderr
    assert f"{len(uploaded)} files" in r.stdout and str(total) not in r.stderr.splitlines()[0]
    from jpfs.lerobot.dataset import load_meta

    # jpfs:// reaches the cluster $JPFS_CLUSTER names now, not one an earlier test's cached
    # filesystem reached (tests/test_fsspec_clusters.py).
    monkeypatch.setenv("JPFS_CLUSTER", str(d))
    meta = load_meta("jpfs://imported/ds")
    assert len(meta.episodes) == 6


def test_import_url_errors_say_what_is_missing(make_cluster, tmp_path):
    d = make_cluster(meta_shards=1, storage_nodes=1)
    env = {**os.environ, "JPFS_CLUSTER": str(d)}
    cli = [sys.executable, "-m", "jpfs.cli.main", "import"]
    r = subprocess.run(cli + ["nosuchproto://a/b", "jpfs:/x"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "fsspec knows no nosuchproto:// filesystem" in r.stderr
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        r = subprocess.run(cli + ["gs://bucket/x", "jpfs:/x"], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode != 0 and "needs a package that is not installed" in r.stderr
        assert "gcsfs" in r.stderr
    r = subprocess.run(cli + [f"file://{tmp_path}/none", "jpfs:/x"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no such directory" in r.stderr


def test_import_over_http_from_a_directory_listing(make_cluster, tmp_path):
    """https:// and http:// trees (a web server's directory index, read by fsspec's http
    filesystem): no modification times there, so a rerun compares sizes."""
    pytest.importorskip("aiohttp")
    src = tmp_path / "site"
    (src / "a" / "b").mkdir(parents=True)
    files = {"top.txt": b"top", "a/one.bin": os.urandom(5000), "a/b/two.bin": os.urandom(70_000),
             "a/b/three.json": b"{}"}
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1",
                               str(port), "--directory", str(src)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None
                time.sleep(0.1)
        d = make_cluster(meta_shards=1, storage_nodes=1, chunk_size=CHUNK)
        env = {**os.environ, "JPFS_CLUSTER": str(d)}
        cmd = [sys.executable, "-m", "jpfs.cli.main", "import", f"http://127.0.0.1:{port}/",
               "jpfs:/web", "--json"]
        runs = []
        for _ in range(2):
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
        assert runs[0]["files"] == len(files) and runs[0]["errors"] == []
        assert runs[1]["files"] == 0 and runs[1]["skipped"] == len(files)
        with jpfs.connect(d) as c:
            for rel, data in files.items():
                assert c.read_bytes(f"/web/{rel}") == data, rel
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.mark.slow
def test_import_from_s3_killed_then_resumed(make_cluster, s3, tmp_path):
    fs = _fs(s3)
    local = tmp_path / "many"
    for i in range(400):
        sub = local / f"d{i // 100}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i:04d}").write_bytes(os.urandom(8000))
    fs.put(str(local), f"{BUCKET}/many", recursive=True)
    d = make_cluster(meta_shards=1, storage_nodes=1, chunk_size=CHUNK)
    env = {**os.environ, **CREDS, "JPFS_CLUSTER": str(d)}
    cmd = [sys.executable, "-m", "jpfs.cli.main", "import", f"s3://{BUCKET}/many", "jpfs:/many",
           "-o", f"endpoint_url={s3}", "--parallel", "1", "--no-progress", "--json"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with jpfs.connect(d) as c:  # kill it once part of the tree has landed
        deadline = time.monotonic() + 60
        while not (c.exists("/many/d0") and c.listdir("/many/d0")):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
    proc.kill()
    proc.wait()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    second = json.loads(r.stdout.strip().splitlines()[-1])
    # Killed part way: the rerun copies only what had not landed.
    assert second["skipped"] > 0 and second["files"] > 0
    assert second["files"] + second["skipped"] == 400
    with jpfs.connect(d) as c:
        for i in range(400):
            rel = f"d{i // 100}/f{i:04d}"
            assert c.read_bytes(f"/many/{rel}") == (local / rel).read_bytes(), rel
