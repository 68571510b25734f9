"""The `jpfs` command as an operator meets it: real daemons, the real CLI in a subprocess, and
what its output says (aligned status, one path rule, errors that say what to do)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jpfs import localcluster


def jpfs(*args: str, cluster=None, check: bool | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "JPFS_CLUSTER": str(cluster)} if cluster else dict(os.environ)
    if not cluster:
        env.pop("JPFS_CLUSTER", None)
    r = subprocess.run([sys.executable, "-m", "jpfs.cli.main", *args], capture_output=True,
                       text=True, env=env, timeout=120)
    if check is True:
        assert r.returncode == 0, r.stderr
    if check is False:
        assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    return r


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    localcluster.up(d, meta_shards=2, storage_nodes=2, sync=False)
    yield d
    localcluster.down(d, timeout=5)


def test_status_columns_line_up_and_a_down_daemon_says_how_to_restart(make_cluster):
    d = make_cluster(meta_shards=2, storage_nodes=2)
    localcluster.stop(d, "storage", 1)
    r = jpfs("cluster", "status", "--dir", str(d), check=False)
    table = r.stdout.split("\n\n")[0]  # then healing and scrub lines
    rows = [line for line in table.splitlines() if line.startswith("  ")]
    assert [row.split()[0] for row in rows] == ["daemon", "meta-0", "meta-1", "storage-0",
                                                "storage-1"]
    for column in ("address", "state"):  # every row's cell starts where the header's does
        at = rows[0].index(column)
        assert all(row[at - 2:at] == "  " and row[at] != " " for row in rows), r.stdout
    down = rows[-1]
    assert "DOWN" in down and "127.0.0.1:" in down and "storage-1.log" in down
    assert "volumes" in rows[3] and "inodes" in rows[1]  # the others keep their figures
    assert f"jpfs cluster up --dir {d}" in r.stdout

    r = jpfs("cluster", "up", "--dir", str(d), check=True)
    assert "started 1 daemon (storage-1); 3 already running" in r.stdout
    r = jpfs("cluster", "up", "--dir", str(d), check=True)
    assert "all 4 daemons already running; nothing started" in r.stdout
    assert jpfs("cluster", "status", "--dir", str(d)).returncode == 0


def test_plain_paths_are_local_and_jpfs_paths_are_echoed_as_written(cluster, tmp_path):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "f").write_bytes(b"one")
    (src / "g").write_bytes(b"two!")
    r = jpfs("import", str(src), "jpfs:/plain", "--no-progress", cluster=cluster, check=True)
    assert "2 files" in r.stdout and "1 directory" in r.stdout

    r = jpfs("ls", "/plain", cluster=cluster, check=False)
    assert r.stderr.startswith("jpfs ls: /plain: a local path") and "jpfs:/plain" in r.stderr
    assert sorted(jpfs("ls", "jpfs:/plain", cluster=cluster, check=True).stdout.split()) == [
        "a", "g"]
    r = jpfs("stat", "jpfs:/plain/missing", cluster=cluster, check=False)
    assert r.stderr.startswith("jpfs stat: jpfs:/plain/missing: ")
    r = jpfs("cat", "jpfs:/plain/a", cluster=cluster, check=False)
    assert r.stderr.strip() == "jpfs cat: jpfs:/plain/a: is a directory"
    r = jpfs("rm", "/plain/g", cluster=cluster, check=False)  # nothing removed by a local path
    assert jpfs("cat", "jpfs:/plain/g", cluster=cluster, check=True).stdout == "two!"

    r = jpfs("du", "jpfs:/plain", cluster=cluster, check=True)  # du(1)'s order
    assert [line.split()[-1] for line in r.stdout.splitlines()] == ["jpfs:/plain/a",
                                                                    "jpfs:/plain"]
    assert "1 file " in r.stdout and "2 files" in r.stdout


def test_import_and_lerobot_say_what_is_wrong_and_what_to_do(cluster, tmp_path):
    missing = tmp_path / "nope"
    r = jpfs("import", str(missing), "jpfs:/x", cluster=cluster, check=False)
    assert r.stderr.startswith(f"jpfs import: {missing}: no such local directory")
    afile = tmp_path / "file.bin"
    afile.write_bytes(b"x")
    r = jpfs("import", str(afile), "jpfs:/x", cluster=cluster, check=False)
    assert "jpfs cp FILE jpfs:/DST" in r.stderr
    r = jpfs("import", str(tmp_path), "x", cluster=cluster, check=False)
    assert "write jpfs:/x" in r.stderr

    r = jpfs("lerobot", "info", str(tmp_path), check=False)
    assert r.stderr.startswith(f"jpfs lerobot info: {tmp_path}: not a LeRobot dataset")
    assert "meta/info.json" in r.stderr and "root" in r.stderr
    r = jpfs("lerobot", "convert", "jpfs:/a", "jpfs:/a/out", cluster=cluster, check=False)
    assert r.stderr.startswith("jpfs lerobot convert: jpfs:/a/out: the destination is inside "
                               "the source jpfs:/a")
    assert "jpfs:/a-v3.0" in r.stderr and "jpfs://" not in r.stderr


@pytest.mark.parametrize("body, key", [
    ("meta = 5", "meta must be an array of tables"),
    ("meta = [5]", "meta[0] must be a table"),
    ('[[meta]]\naddress = 7301', "meta[0].address must be a string"),
    ('[cluster]\nreplicas = "2"\n[[meta]]\naddress = "127.0.0.1:1"', "cluster.replicas"),
])
def test_a_cluster_file_of_the_wrong_shape_names_the_bad_key(tmp_path, body, key):
    (tmp_path / "secret").write_text("s\n")
    (tmp_path / "cluster.toml").write_text(body + "\n")
    r = jpfs("--cluster", str(tmp_path), "ls", "jpfs:/", check=False)
    assert r.stderr.startswith(f"jpfs ls: {tmp_path / 'cluster.toml'}: {key}"), r.stderr


def test_gc_says_what_the_grace_period_kept_and_why_nothing_was_compacted(make_cluster):
    import jpfs as jp

    d = make_cluster(meta_shards=1, storage_nodes=1)
    with jp.connect(d) as c:
        c.write_bytes("/keep", b"k" * 1000)
        c.write_bytes("/gone", b"g" * 1000)
        c.remove("/gone")
    r = jpfs("gc", cluster=d, check=True)  # default grace: the removed blob is too young
    assert "kept 1 unreferenced younger than --grace 600s" in r.stdout
    assert "compaction reclaimed nothing" in r.stdout and "--min-dead" not in r.stdout
    r = jpfs("gc", "--grace", "0", "--min-dead", "0.9", cluster=d, check=True)
    assert "deleted 1" in r.stdout and "kept" not in r.stdout
    assert "compaction reclaimed nothing" in r.stdout and "--min-dead 0.9" in r.stdout


def test_help_reads_as_plain_text():
    r = jpfs("bench", "--help", check=True)
    assert "``" not in r.stdout and "examples:" in r.stdout
    r = jpfs("bench", "read", "--help", check=True)
    assert "``" not in r.stdout
    r = jpfs("--help", check=True)
    assert "any other path is a local one" in r.stdout
