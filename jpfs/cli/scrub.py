"""``jpfs scrub status|start|repair``: the storage nodes' scrubbers and the repair of bad copies."""

from __future__ import annotations

import argparse
import time

from ..config import format_size
from .common import add_json, connect, plural, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scrub", help="verify stored data and repair bad copies",
                       description="Every storage node re-reads its blobs at a bounded rate "
                       "(jpfs-storage --scrub-rate, default 32MiB/s; --scrub-pause between "
                       "passes) and marks those that fail their xxh3 checksum; it stops serving "
                       "them, so reads use another replica. `repair` writes a good replica's "
                       "bytes back over each bad copy.")
    ssub = p.add_subparsers(dest="scrub_command", metavar="ACTION")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    st = ssub.add_parser("status", help="scrub progress and bad blobs per storage node")
    add_json(st)
    st.set_defaults(func=cmd_status)

    go = ssub.add_parser("start", help="start a scrub pass now (instead of after the pause)")
    go.add_argument("--node", type=int, action="append",
                    help="only this storage node (repeat for several; default all)")
    add_json(go)
    go.set_defaults(func=cmd_start)

    rp = ssub.add_parser("repair", help="replace bad copies with good replicas",
                         description="List every node's bad blobs, find their files in the "
                         "metadata, read each from a replica whose copy verifies and write it "
                         "back to the node with the bad copy. A blob with no good copy "
                         "(replicas 1, or every copy bad) is reported with its file's path. "
                         "Exit status 1 when something could not be repaired.")
    rp.add_argument("--dry-run", action="store_true", help="say what would be repaired")
    add_json(rp)
    rp.set_defaults(func=cmd_repair)


def describe(s: dict) -> list[str]:
    """A node's scrub status in a few cells (also for ``jpfs cluster status``)."""
    if s.get("error"):
        return [f"scrub: {s['error']}"]
    if not s.get("enabled", True):
        cells = ["scrub off"]
    elif s.get("state") == "scrubbing":
        cells = [f"scrub pass {s.get('passes', 0) + 1} {s.get('progress', 0.0):.0%} "
                 f"{format_size(s.get('bytes_per_s', 0.0))}/s"]
    else:
        nxt = s.get("next_pass")
        wait = f", next in {_duration(nxt - time.time())}" if nxt else ""
        cells = [f"scrub {plural(s.get('passes', 0), 'pass', 'passes')} done{wait}"]
    cells.append(f"bad {s.get('bad_blobs', 0):,} (found {s.get('bad_found', 0):,}, "
                 f"repaired {s.get('repaired', 0):,})")
    return cells


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def cmd_status(args: argparse.Namespace) -> int:
    from ..client.tools.scrub import status

    client = connect(args)
    try:
        nodes = client.run(status)
    finally:
        client.close()
    if args.json:
        print_json({"nodes": nodes})
        return 0
    for i, s in enumerate(nodes):
        extra = "" if s.get("error") else \
            f", verified {format_size(s.get('bytes_verified', 0))} in all passes"
        print(f"storage-{i}: " + ", ".join(describe(s)) + extra)
    return 1 if any(s.get("error") for s in nodes) else 0


def cmd_start(args: argparse.Namespace) -> int:
    from ..client.tools.scrub import start

    client = connect(args)
    try:
        nodes = client.run(start, args.node)
    finally:
        client.close()
    if args.json:
        print_json({"nodes": nodes})
    else:
        for s in nodes:
            print(f"storage-{s['node']}: " + ", ".join(describe(s)))
    return 1 if any(s.get("error") for s in nodes) else 0


def cmd_repair(args: argparse.Namespace) -> int:
    from ..client.tools.scrub import repair

    client = connect(args)
    try:
        report = client.run(lambda ac: repair(ac, dry_run=args.dry_run))
    finally:
        client.close()
    if args.json:
        print_json(report.as_dict())
        return 0 if report.clean else 1
    for node, why in sorted(report.errors.items()):
        print(f"storage-{node}: {why}")
    verb = "would repair" if args.dry_run else "repaired"
    print(f"{plural(report.bad, 'bad blob')} on the storage nodes; {verb} "
          f"{len(report.repaired):,}")
    for x in report.repaired:
        print(f"  {verb} blob {x['blob']} on storage-{x['node']} from storage-{x['from']}")
    for x in report.unrepairable:
        print(f"  cannot repair {x['path']} (chunk {x['chunk']}): blob {x['blob']} on "
              f"storage-{x['node']} is bad ({x['reason']}) and {x['why']}")
    if report.unreferenced:
        print(f"  {plural(len(report.unreferenced), 'bad blob')} no file uses "
              "(jpfs gc deletes them)")
    return 0 if report.clean else 1
