"""``jpfs bench NAME``: benchmarks and workload generators from the ``jpfs_bench`` package.

Every module in ``jpfs_bench.entry.COMMANDS`` (bench's own entry, also ``python -m jpfs_bench``)
provides::

    HELP: str                                  one line for `jpfs bench --help`
    DESCRIPTION: str                           the subcommand's own --help text
    def add_arguments(parser) -> None          its options (keep heavy imports out of module level)
    def run(args) -> dict                      do the work, print a human-readable report, and
                                               return the figures

Every subcommand takes ``--json``: the returned dict is then printed as one JSON object on the
last line of stdout, so scripts can parse it.
"""

from __future__ import annotations

import argparse
import re

DESCRIPTION = """\
Benchmarks and LeRobot-shaped workload generators. Each benchmark measures JPFS beside a
baseline (the local filesystem, loopback sendfile, a naive loader) in the same run, and prints
a report; with --json its figures follow as one JSON object on the last line.

examples:
  jpfs bench gen /tmp/ds --episodes 100 --cameras 2   # a LeRobot v2.1-shaped dataset
  jpfs bench read --json                               # native client vs local disk
  jpfs bench NAME --help                               # what NAME measures, and its options
"""


def _readable(text: str) -> str:
    """Module docstrings are reStructuredText; --help shows them as plain text: ``x`` -> x,
    a closing ``::`` -> ``:``."""
    text = re.sub(r"``([^`]+)``", r"\1", text)
    return re.sub(r"::$", ":", text, flags=re.M)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks and LeRobot-shaped workload generators",
                       description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    bsub = p.add_subparsers(dest="bench", metavar="NAME")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    from jpfs_bench import entry  # the one edge between cli and bench; bench never imports cli

    for name, module in entry.COMMANDS.items():
        bp = bsub.add_parser(name, help=module.HELP,
                             description=_readable(module.DESCRIPTION),
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(bp)
        bp.add_argument("--json", action="store_true",
                        help="print the figures as one JSON object on the last line")
        bp.set_defaults(func=lambda args, m=module: entry.run(m, args))
