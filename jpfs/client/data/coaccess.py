"""Co-access rules: which file a reader opens after which, learned from the numbers in paths.

When opening ``A/x_42.parquet`` is followed by opening ``B/cam/x_42.mp4`` (the same number in
the name), the pairing "A/x_N -> B/cam/x_N" is a rule candidate; the prefetcher counts them and,
once a rule is seen twice, opening a file of shape A predicts its partners. Nothing about
LeRobot is built in: numbers in a path (not in its extension) are the variables. Pure functions
and records; the prefetcher keeps the counts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DIGITS = re.compile(r"\d+")


@dataclass
class Rule:
    """A learned pairing and how it fared (seen, predicted, hits, misses; dropped when its
    predictions go unused)."""

    parts: tuple
    seen: int = 0
    predicted: int = 0
    hits: int = 0
    misses: int = 0
    dropped: bool = False


@dataclass
class Opened:
    """A path as rules see it: its body (no extension), shape (numbers as NULs), numbers."""

    path: str
    body: str
    """The path without its file extension (numbers in ``.mp4`` are not numbers)."""
    shape: str
    runs: list[str]
    base_run: int
    """Index in ``runs`` of the last number in the file name (-1 when it has none)."""


def shape_of(path: str) -> Opened:
    r"""A path's shape (numbers replaced by ``\0``) and its numbers."""
    base = path.rsplit("/", 1)[-1]
    stem, dot, ext = base.rpartition(".")
    cut = len(ext) + 1 if dot and stem and len(ext) <= 8 else 0
    body = path[:len(path) - cut]
    runs = _DIGITS.findall(body)
    shape = _DIGITS.sub("\0", body) + path[len(body):]
    nb = len(_DIGITS.findall(base[:len(base) - cut]))
    return Opened(path, body, shape, runs, len(runs) - 1 if nb else -1)


def pairing(a: Opened, b: Opened) -> tuple | None:
    """The rule that makes ``b``'s path from ``a``'s numbers: a tuple of literal strings and
    indexes into ``a``'s numbers. None unless the number in ``b``'s file name comes from ``a``
    (that is the evidence that they belong together)."""
    if b.base_run < 0 or a.shape == b.shape:
        return None
    parts: list = []
    pos = 0
    mapped_base = False
    for k, m in enumerate(_DIGITS.finditer(b.body)):
        run = m.group()
        j = _match(a.runs, run, k)
        if j is None:
            continue
        if k == b.base_run:
            mapped_base = True
        parts.append(b.path[pos:m.start()])
        parts.append(j)
        pos = m.end()
    if not mapped_base:
        return None
    parts.append(b.path[pos:])
    return tuple(parts)


def _match(runs: list[str], run: str, k: int) -> int | None:
    """Index of ``run`` among ``runs`` (the same position preferred, else the last one)."""
    if k < len(runs) and runs[k] == run:
        return k
    for j in range(len(runs) - 1, -1, -1):
        if runs[j] == run:
            return j
    return None


def apply_rule(parts: tuple, runs: list[str]) -> str | None:
    """The path a rule makes from a file's numbers (None if the file has too few)."""
    out = []
    for p in parts:
        if isinstance(p, int):
            if p >= len(runs):
                return None
            out.append(runs[p])
        else:
            out.append(p)
    return "".join(out)


__all__ = ["Opened", "Rule", "apply_rule", "pairing", "shape_of"]
