"""Pure parts of the mount, called directly: hint parsing and co-access rules."""

from __future__ import annotations

import errno

import pytest

from jpfs.client.data.coaccess import apply_rule, pairing, shape_of
from jpfs.errors import JPFSError
from jpfs.fuse.control import parse_hints


def test_hint_lines_in_every_accepted_form():
    text = (b"/mnt/j/data/a.parquet\n"
            b"data/b.parquet\r\n"
            b"  jpfs:/data/c.parquet  \n"
            b"jpfs://data/d.parquet\n"
            b"\n# a comment\n"
            b"/mnt/j/videos/../data/e.parquet\n")
    assert parse_hints(text, "/mnt/j") == ["/data/a.parquet", "/data/b.parquet",
                                           "/data/c.parquet", "/data/d.parquet",
                                           "/data/e.parquet"]


@pytest.mark.parametrize("line, why", [
    (b"\xff\xfe\n", "not UTF-8"),
    (b"data/a\x01b\n", "control characters"),
    (b"/etc/passwd\n", "not under the mount point"),
    (b"/mnt/jx/file\n", "not under the mount point"),
    (b"/mnt/j\n", "does not name a file"),
    (b"x" * 5000 + b"\n", "longer than"),
])
def test_bad_hint_lines_are_rejected_clearly(line, why):
    with pytest.raises(JPFSError) as e:
        parse_hints(b"data/ok\n" + line, "/mnt/j")
    assert e.value.errno == errno.EINVAL
    assert why in e.value.strerror and "line 2" in e.value.strerror


def test_hint_paths_never_leave_the_mount():
    # as in the kernel, ".." at the root is the root: the path stays inside the mount
    assert parse_hints(b"../../etc/passwd\n", "/mnt/j") == ["/etc/passwd"]


def test_co_access_rule_maps_numbers_not_names():
    a = shape_of("/ds/data/chunk-000/episode_000042.parquet")
    b = shape_of("/ds/videos/chunk-000/observation.images.cam_1/episode_000042.mp4")
    rule = pairing(a, b)
    assert rule == ("/ds/videos/chunk-", 0, "/observation.images.cam_1/episode_", 1, ".mp4")
    other = shape_of("/ds/data/chunk-003/episode_003017.parquet")
    assert other.shape == a.shape
    assert apply_rule(rule, other.runs) == \
        "/ds/videos/chunk-003/observation.images.cam_1/episode_003017.mp4"


def test_unrelated_files_make_no_rule():
    a = shape_of("/ds/data/chunk-000/episode_000042.parquet")
    assert pairing(a, shape_of("/ds/videos/chunk-000/cam/episode_000043.mp4")) is None
    assert pairing(a, shape_of("/ds/data/chunk-000/episode_000043.parquet")) is None  # same shape
    assert pairing(a, shape_of("/ds/meta/info.json")) is None  # no number in the name
