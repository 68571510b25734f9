"""``mount -t fuse.jpfs`` and fstab lines: the helper mount(8) runs (``mount.fuse.jpfs``).

The FUSE tests go through the real mount(8) and umount(8), with ``/sbin/mount.fuse.jpfs``
written by ``jpfs install-mount-helper`` for the test and removed after it; the option
translation and the installer are checked without a mount.
"""

from __future__ import annotations

import configparser
import errno
import importlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fuse_support import force_unmount, jpfs_cli, requires_fuse

import jpfs
from jpfs import localcluster
from jpfs.cli import mount_helper, mount_install
from jpfs.cli.mount_helper import EXIT_FAILURE, EXIT_USAGE, UsageError, mount_flags
from jpfs.fuse.mount import daemon_pid, is_jpfs_mount, mount_entry, state_file

HELPER = Path(mount_install.DEFAULT_PATH)
FILES = {"d/a.txt": b"hello\n", "d/sub/b.bin": os.urandom(300_000)}


# ---- without a mount ---------------------------------------------------------------------------

def test_mount8_options_become_jpfs_mount_flags():
    # What mount(8) passes for `-o ro,allow_other,user,...` (user adds noexec,nosuid,nodev).
    opts = ("ro,noexec,nosuid,nodev,allow_other,cache_size=1G,_netdev,nofail,user,noauto,"
            "defaults,x-systemd.automount,comment=x,no_prefetch,cache-dir=/c,nonempty")
    assert mount_flags(opts.split(",")) == [
        "--read-only", "--allow-other", "--cache-size", "1G", "--no-prefetch", "--cache-dir",
        "/c", "--nonempty", "--kernel-options", "noexec,nosuid,nodev"]
    assert mount_flags(["rw"]) == []


@pytest.mark.parametrize("opt, message", [
    ("bogus", "unknown option 'bogus'"), ("cache_size", "takes a value"),
    ("nonempty=1", "takes no value"), ("foreground", "unknown option"),
    ("ready_fd=3", "unknown option")])
def test_unknown_or_misused_options_are_usage_errors(opt, message):
    with pytest.raises(UsageError, match=message):
        mount_flags([opt])
    assert mount_flags([opt], sloppy=True) == []  # mount -s


def test_usage_errors_exit_1_and_a_missing_cluster_file_32(tmp_path, capsys):
    assert mount_helper.main([str(tmp_path), str(tmp_path), "-o", "bogus"]) == EXIT_USAGE
    assert mount_helper.main([str(tmp_path)]) == EXIT_USAGE
    assert mount_helper.main([str(tmp_path / "none.toml"), str(tmp_path), "-N", "1"]) == \
        EXIT_USAGE
    assert mount_helper.main([str(tmp_path / "none.toml"), str(tmp_path), "-o", "ro"]) == \
        EXIT_FAILURE
    err = capsys.readouterr().err
    assert "unknown option 'bogus'" in err and "none.toml: no such cluster file" in err


def test_installer_writes_a_script_for_this_python_and_keeps_other_files(tmp_path):
    path = tmp_path / "mount.fuse.jpfs"
    jpfs_cli("install-mount-helper", str(path))
    text = path.read_text()
    assert text.startswith(f"#!{sys.executable}\n") and os.access(path, os.X_OK)
    r = subprocess.run([str(path), "x", str(tmp_path), "-o", "bogus"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == EXIT_USAGE and "unknown option" in r.stderr
    jpfs_cli("install-mount-helper", "--remove", str(path))
    assert not path.exists()
    path.write_text("#!/bin/sh\n")  # someone else's helper
    r = jpfs_cli("install-mount-helper", str(path), check=False)
    assert r.returncode == 1 and "--force" in r.stderr and path.read_text() == "#!/bin/sh\n"


def test_the_console_script_entry_point_names_the_helper():
    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).parents[1] / "setup.cfg")
    scripts = dict(line.split(" = ") for line in
                   cfg["options.entry_points"]["console_scripts"].strip().splitlines())
    module, _, name = scripts["mount.fuse.jpfs"].partition(":")
    assert getattr(importlib.import_module(module), name) is mount_helper.main


# ---- real mounts through mount(8) --------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("helpercluster")
    localcluster.up(d, meta_shards=1, storage_nodes=1, sync=False)
    try:
        with jpfs.connect(d) as c:
            for name, data in FILES.items():
                c.makedirs("/" + os.path.dirname(name), exist_ok=True)
                c.write_bytes("/" + name, data)
        yield d / "cluster.toml"
    finally:
        localcluster.down(d, timeout=5)


@pytest.fixture(scope="module")
def helper() -> Iterator[Path]:
    """/sbin/mount.fuse.jpfs for this module's tests (never someone else's, never left)."""
    if (HELPER.exists() or HELPER.is_symlink()) and not mount_install.is_ours(HELPER):
        pytest.skip(f"{HELPER} exists and was not written by jpfs install-mount-helper")
    jpfs_cli("install-mount-helper", str(HELPER))
    try:
        yield HELPER
    finally:
        HELPER.unlink(missing_ok=True)


@pytest.fixture
def mountpoint(tmp_path) -> Iterator[Path]:
    mp = tmp_path / "mnt"
    mp.mkdir()
    try:
        yield mp
    finally:
        force_unmount(mp)


def _options(tmp_path: Path, *more: str) -> str:
    return ",".join([*more, f"cache_dir={tmp_path / 'cache'}", f"log_file={tmp_path / 'log'}",
                     "cache_size=64M", "memory_cache=64M"])


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _umount_and_check(mp: Path) -> None:
    """umount(8) clears the mount, and the daemon it left running exits with it."""
    pid = daemon_pid(str(mp))
    assert pid is not None
    r = _run("umount", str(mp))
    assert r.returncode == 0, r.stderr
    assert not is_jpfs_mount(str(mp)) and mount_entry(str(mp)) is None
    deadline = time.monotonic() + 20
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), f"the mount's daemon {pid} is still running after umount"
    assert not state_file(str(mp)).exists()


@requires_fuse
@pytest.mark.fuse
def test_mount_t_fuse_jpfs_read_only(cluster, helper, mountpoint, tmp_path):
    r = _run("mount", "-t", "fuse.jpfs", str(cluster), str(mountpoint), "-o",
             _options(tmp_path, "ro", "allow_other", "noexec"))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and r.stderr == ""  # mount(8) helpers are quiet
    entry = mount_entry(str(mountpoint))
    assert entry is not None and entry["fstype"] == "fuse.jpfs"
    assert {"ro", "noexec", "nosuid", "nodev"} <= set(entry["options"].split(","))
    for name, data in FILES.items():
        assert (mountpoint / name).read_bytes() == data
    with pytest.raises(OSError) as e:
        (mountpoint / "d" / "new.txt").write_bytes(b"x")
    assert e.value.errno == errno.EROFS
    with pytest.raises(OSError) as e:
        (mountpoint / "d" / "newdir").mkdir()
    assert e.value.errno == errno.EROFS
    _umount_and_check(mountpoint)


@requires_fuse
@pytest.mark.fuse
def test_an_fstab_line_mounts_read_write(cluster, helper, mountpoint, tmp_path):
    fstab = tmp_path / "fstab"
    fstab.write_text(f"{cluster} {mountpoint} fuse.jpfs "
                     f"{_options(tmp_path, '_netdev', 'rw', 'allow_other', 'noauto', 'nofail')}"
                     " 0 0\n")
    r = _run("mount", "-T", str(fstab), str(mountpoint))  # mount MOUNTPOINT, from that fstab
    assert r.returncode == 0, r.stderr
    assert (mountpoint / "d" / "a.txt").read_bytes() == FILES["d/a.txt"]
    (mountpoint / "fstab-wrote.txt").write_bytes(b"written through the mount\n")
    _umount_and_check(mountpoint)
    with jpfs.connect(cluster) as c:
        assert c.read_bytes("/fstab-wrote.txt") == b"written through the mount\n"
        c.remove("/fstab-wrote.txt")


@requires_fuse
@pytest.mark.fuse
def test_failures_exit_nonzero_with_the_reason(cluster, helper, mountpoint, tmp_path):
    r = _run("mount", "-t", "fuse.jpfs", str(tmp_path / "none.toml"), str(mountpoint))
    assert r.returncode == EXIT_FAILURE and "no such cluster file" in r.stderr
    a_file = tmp_path / "file"
    a_file.write_text("")
    r = _run("mount", "-t", "fuse.jpfs", str(cluster), str(a_file), "-o", "ro")
    assert r.returncode == EXIT_FAILURE and "not a directory" in r.stderr
    r = _run("mount", "-t", "fuse.jpfs", str(cluster), str(mountpoint), "-o", "ro,bogus")
    assert r.returncode == EXIT_USAGE and "unknown option 'bogus'" in r.stderr
    r = _run("mount", "-t", "fuse.jpfs", str(cluster), str(mountpoint), "-o", "cache_size=big")
    assert r.returncode == EXIT_USAGE and "--cache-size" in r.stderr
    assert not is_jpfs_mount(str(mountpoint)) and daemon_pid(str(mountpoint)) is None
