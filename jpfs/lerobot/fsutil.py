"""Filesystem access for datasets: local paths and fsspec URLs (``jpfs://...``) alike.

Every reader and writer in ``jpfs.lerobot`` goes through these helpers so that a dataset on the
local disk and one inside JPFS take the same code path. Errors name the file they are about.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import tempfile
from collections.abc import Iterator
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

log = logging.getLogger(__name__)

__all__ = [
    "DatasetError",
    "get_fs",
    "join",
    "is_local",
    "read_bytes",
    "read_json",
    "read_jsonl",
    "write_bytes",
    "write_json",
    "jsonl_bytes",
    "local_output",
    "open_input",
    "replace",
    "fsync_file",
]


class DatasetError(ValueError):
    """A dataset is missing a file or holds one that does not match the LeRobot format.

    A ``ValueError`` so the ``jpfs`` command prints it as a one-line error. ``path`` names the file.
    """

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message

    def __reduce__(self):  # survives the trip back from a worker process
        return (type(self), (self.path, self.message))


def get_fs(root: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and the path on it for a local path or an fsspec URL."""
    fs, path = fsspec.core.url_to_fs(str(root))
    path = path.rstrip("/") or "/"
    return fs, path


def join(base: str, rel: str) -> str:
    """``base`` + a '/'-separated relative path (dataset paths are always posix)."""
    return posixpath.join(base, rel) if base != "/" else "/" + rel.lstrip("/")


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True when paths on ``fs`` can be handed straight to libraries that want OS paths."""
    return isinstance(fs, LocalFileSystem)


def read_bytes(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    """A whole file; a missing file raises DatasetError naming it."""
    try:
        with fs.open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise DatasetError(path, "missing") from None


def read_table(fs: fsspec.AbstractFileSystem, path: str, columns: list[str] | None = None):
    """A whole parquet file as a pyarrow Table.

    Never through pyarrow's dataset reader with a source that holds Python objects (a Python
    file, or a buffer over Python bytes): the dataset may release that source on one of its own
    threads while the interpreter exits, which aborts the process ("terminate called without an
    active exception"). Local files are read natively; others are fetched whole and parsed by a
    plain ``ParquetFile``, whose reader is done with its threads when ``read`` returns.
    """
    import pyarrow.parquet as pq

    if is_local(fs):
        return pq.read_table(path, columns=columns)
    return open_parquet(fs, path).read(columns=columns)


def open_parquet(fs: fsspec.AbstractFileSystem, path: str):
    """A ``pyarrow.parquet.ParquetFile``: the file itself when local, its bytes in memory
    otherwise (see ``read_table``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if is_local(fs):
        return pq.ParquetFile(path)
    return pq.ParquetFile(pa.BufferReader(fs.cat_file(path)))


def read_parquet_metadata(fs: fsspec.AbstractFileSystem, path: str):
    """A parquet file's footer, from a native source (see ``read_table``)."""
    return open_parquet(fs, path).metadata


def write_parquet_table(fs: fsspec.AbstractFileSystem, path: str, table) -> None:
    """Write a whole parquet file: natively when local, else encoded in memory and stored in one
    call (pyarrow never holds a Python file object; see ``read_table``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if is_local(fs):
        pq.write_table(table, path)
        return
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    fs.pipe_file(path, sink.getvalue().to_pybytes())


def read_json(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    """A JSON document; missing or malformed files raise DatasetError naming the file."""
    data = read_bytes(fs, path)
    try:
        return json.loads(data)
    except ValueError as e:
        raise DatasetError(path, f"not valid JSON ({e})") from None


def read_jsonl(fs: fsspec.AbstractFileSystem, path: str) -> list[Any]:
    """A JSON-lines file, one object per non-empty line."""
    out = []
    for n, line in enumerate(read_bytes(fs, path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError as e:
            raise DatasetError(path, f"line {n} is not valid JSON ({e})") from None
    return out


def write_bytes(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write a whole file, creating its folder."""
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    with fs.open(path, "wb") as f:
        f.write(data)


def write_json(fs: fsspec.AbstractFileSystem, path: str, obj: Any, indent: int | None = 4) -> None:
    """Write JSON the way LeRobot does (indent 4, UTF-8 kept as is)."""
    write_bytes(fs, path, json.dumps(obj, indent=indent, ensure_ascii=False).encode())


def jsonl_bytes(rows: list[Any]) -> bytes:
    """JSON lines, one compact object per line."""
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows)


@contextlib.contextmanager
def local_output(fs: fsspec.AbstractFileSystem, path: str) -> Iterator[str]:
    """A local OS path to write ``path`` through; uploaded on success when ``fs`` is remote.

    Libraries such as PyAV's mp4 muxer need a seekable local file; on a remote filesystem the
    file is written to a local temporary first and copied up whole.
    """
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    if is_local(fs):
        yield path
        return
    fd, tmp = tempfile.mkstemp(prefix="jpfs-out-", suffix=posixpath.splitext(path)[1])
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would travel with the upload
        fs.put_file(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def open_input(fs: fsspec.AbstractFileSystem, path: str) -> Iterator[str | IO[bytes]]:
    """Something PyAV and pyarrow can open: the OS path when local, else a file object."""
    if is_local(fs):
        if not os.path.exists(path):
            raise DatasetError(path, "missing")
        yield path
        return
    try:
        f = fs.open(path, "rb")
    except FileNotFoundError:
        raise DatasetError(path, "missing") from None
    with f:
        yield f


def replace(fs: fsspec.AbstractFileSystem, src: str, dst: str) -> None:
    """Move a finished temporary file into its final name (atomic on a local filesystem)."""
    fs.makedirs(posixpath.dirname(dst), exist_ok=True)
    if is_local(fs):
        os.replace(src, dst)
    else:
        if fs.exists(dst):
            fs.rm(dst)
        fs.mv(src, dst)


def fsync_file(path: str) -> None:
    """Flush a local file to disk before it is renamed into place (crash safety)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
