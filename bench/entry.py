"""Bench's own entry: every benchmark module, its options, and how one is run.

``python -m jpfs_bench NAME ...`` and ``python -m jpfs_bench.NAME ...`` (what torchrun starts)
run a benchmark without the ``jpfs`` command; ``jpfs bench NAME`` builds its parsers from
``COMMANDS`` and runs them through ``run``. Bench never imports ``jpfs.cli``: the edge goes one
way, cli -> bench.

Every module in ``COMMANDS`` provides::

    HELP: str                                  one line for `jpfs bench --help`
    DESCRIPTION: str                           the subcommand's own --help text
    def add_arguments(parser) -> None          its options (keep heavy imports out of module level)
    def run(args) -> dict                      do the work, print a human-readable report, and
                                               return the figures
"""

from __future__ import annotations

import sys

from . import aggregate, convert, gen, heal, leadership, loader, meta, mount, read, soak
from .runner import run, standalone

__all__ = ["COMMANDS", "main", "run", "standalone"]

COMMANDS = {"gen": gen, "meta": meta, "read": read, "loader": loader, "aggregate": aggregate,
            "convert": convert, "mount": mount, "heal": heal, "leadership": leadership,
            "soak": soak}
"""The benchmarks by subcommand name, in the order `--help` lists them."""


def main(argv: list[str] | None = None) -> int:
    """``python -m jpfs_bench NAME [options]``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m jpfs_bench {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    return standalone(COMMANDS[argv[0]], argv[0], argv[1:])
