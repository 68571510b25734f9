"""How one benchmark module runs: its figures as JSON, or as a program of its own.

Apart from ``entry`` so that a benchmark module run as ``python -m jpfs_bench.NAME`` (what
torchrun starts) reaches ``standalone`` without importing ``entry``, which imports every
benchmark: the edges go entry -> each benchmark -> runner, never back.
"""

from __future__ import annotations

import argparse
import json
import re
import sys


def _plain(text: str) -> str:
    """A module docstring (reStructuredText) as --help shows it: ``x`` -> x, ``::`` -> ``:``."""
    return re.sub(r"::$", ":", re.sub(r"``([^`]+)``", r"\1", text), flags=re.M)


def run(module, args: argparse.Namespace) -> int:
    """Run one benchmark; with ``--json`` its figures end stdout as one JSON object."""
    result = module.run(args)
    if args.json:
        sys.stdout.flush()
        print(json.dumps(result, sort_keys=True, default=str))
    return 0


def standalone(module, name: str, argv: list[str] | None = None) -> int:
    """Run one benchmark module as its own program, with the options of ``jpfs bench NAME``."""
    p = argparse.ArgumentParser(prog=f"jpfs bench {name}", description=_plain(module.DESCRIPTION),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(p)
    p.add_argument("--json", action="store_true",
                   help="print the figures as one JSON object on the last line")
    return run(module, p.parse_args(argv))
