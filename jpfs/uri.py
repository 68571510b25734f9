"""Naming files inside JPFS: ``jpfs:/a/b`` on the command line, ``jpfs://a/b`` for fsspec.

Both name the same file, ``/a/b`` from the root of the cluster's namespace. Anything else is a
local path.
"""

from __future__ import annotations

import posixpath

SCHEME = "jpfs:"


def is_jpfs(path: object) -> bool:
    """True for ``jpfs:/...`` and ``jpfs://...`` names."""
    return isinstance(path, str) and path.startswith(SCHEME)


def to_path(uri: str) -> str:
    """The absolute, normalised path inside JPFS: ``jpfs://a/b/`` -> ``/a/b``."""
    if not is_jpfs(uri):
        raise ValueError(f"not a JPFS path: {uri!r} (write jpfs:/dir/file)")
    rest = uri[len(SCHEME):]
    if rest.startswith("//"):
        rest = rest[2:]
    return normalize(rest)


def normalize(path: str) -> str:
    """``a//b/./c/`` -> ``/a/b/c``; ``..`` may not climb above the root."""
    norm = posixpath.normpath("/" + path.lstrip("/"))
    if norm.startswith("//"):
        norm = "/" + norm.lstrip("/")
    return norm


def to_url(path: str) -> str:
    """The fsspec URL for a path inside JPFS: ``/a/b`` -> ``jpfs://a/b``."""
    return "jpfs://" + normalize(path).lstrip("/")


def split(path: str) -> list[str]:
    """The components of a normalised path (empty for the root)."""
    return [c for c in normalize(path).split("/") if c]
