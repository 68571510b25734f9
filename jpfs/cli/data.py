"""Data commands: ``jpfs import``, ``export``, ``cp``, ``cat``, ``du``, ``gc``.

Paths inside JPFS are written ``jpfs:/a/b``; anything else is a local path (the rule of every
``jpfs`` command).
"""

from __future__ import annotations

import argparse
import errno
import os
import posixpath
import sys
import time

from .. import uri
from ..config import format_size
from ..errors import JPFSError
from .common import (
    NEXT_STEP,
    PATH_RULE,
    add_json,
    connect,
    jpfs_path,
    plural,
    print_json,
    report,
    shown,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import", help="copy a local tree or an object store prefix into JPFS (parallel, packed, "
        "resumable)",
        description="Make jpfs:/DST a copy of SRC (DST holds SRC's entries): a local directory "
        "or an fsspec URL (s3://bucket/prefix, gs://..., hf://datasets/..., https://...) whose "
        "package is installed (s3fs, gcsfs, huggingface_hub, aiohttp). Each directory's small "
        "files are sent in name order in batches, so they are packed next to each other on the "
        "storage nodes. A rerun skips files already there with the same size and modification "
        "time (size alone where the store keeps no time), so an interrupted import resumes.")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="jpfs:/DST")
    p.add_argument("-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option for the URL's filesystem, e.g. -o endpoint_url=http://host:9000 "
                   "-o anon=true (values are JSON where they parse as JSON); repeatable")
    _transfer_options(p)
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("export", help="copy a JPFS tree to a local directory (resumable)",
                       description="Make the local directory DST a copy of jpfs:/SRC; a rerun "
                       "skips files already there with the same size and modification time.")
    p.add_argument("src", metavar="jpfs:/SRC")
    p.add_argument("dst", metavar="DST")
    _transfer_options(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("cp", help="copy files between local paths and JPFS",
                       description="Copy SRC to DST; either may be jpfs:/... (with an existing "
                       "directory as DST, copy into it). -r copies directory trees.")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("-r", "--recursive", action="store_true", help="copy directories")
    p.set_defaults(func=cmd_cp)

    p = sub.add_parser("cat", help="write JPFS files to standard output",
                       description="Write JPFS files to standard output. " + PATH_RULE)
    p.add_argument("paths", nargs="+", metavar="jpfs:/PATH")
    p.set_defaults(func=cmd_cat)

    p = sub.add_parser("du", help="space used under JPFS paths",
                       description="Apparent sizes (the bytes files hold) and file counts, "
                       "totalled per directory as du(1) does: each directory after the "
                       "directories inside it, in name order, the argument last. " + PATH_RULE)
    p.add_argument("paths", nargs="*", default=["jpfs:/"], metavar="jpfs:/PATH",
                   help="directories (default jpfs:/)")
    p.add_argument("-s", "--summarize", action="store_true",
                   help="only one total per argument")
    p.add_argument("-H", "--human", action="store_true", help="sizes as 1.5 MiB")
    add_json(p)
    p.set_defaults(func=cmd_du)

    p = sub.add_parser("gc", help="reclaim space of deleted and overwritten data",
                       description="Mark every blob a file points at, delete the others (older "
                       "than --grace seconds, so writes in flight are safe) from the storage "
                       "nodes, and compact volumes with enough dead space. Safe to interrupt and "
                       "rerun.")
    p.add_argument("--grace", type=float, default=600.0,
                   help="only collect blobs older than this many seconds (default 600)")
    p.add_argument("--min-dead", type=float, default=0.3,
                   help="compact volumes with at least this dead share (default 0.3)")
    p.add_argument("--no-compact", action="store_true", help="delete, but do not compact")
    p.add_argument("--dry-run", action="store_true", help="count what would be collected")
    add_json(p)
    p.set_defaults(func=cmd_gc)


def _transfer_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parallel", type=int, default=4, help="batches in flight (default 4)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json(p)


def _need_jpfs(text: str, what: str) -> str:
    if not uri.is_jpfs(text):
        raise JPFSError(errno.EINVAL, f"{what} must be a JPFS path: write "
                        f"jpfs:/{text.lstrip('/')} (plain paths are local)", text)
    return uri.to_path(text)


def _bar(args, total_files: int | None, total_bytes: int | None, desc: str):
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                disable=args.no_progress or args.json, dynamic_ncols=True,
                postfix={"files": f"0/{total_files}" if total_files is not None else 0})


def _run_transfer(args, fn, src, dst, totals, **options) -> int:
    from ..client.tools import transfer

    client = connect(args)
    files_done = 0
    bar = _bar(args, totals[0], totals[1], desc=args.command)
    if options.pop("listed", False):  # a remote tree's totals come once it is listed
        totals = [None, None]

        def listed(files: int, nbytes: int) -> None:
            totals[:] = [files, nbytes]
            bar.total = nbytes
            bar.refresh()

        options["on_listed"] = listed

    def tick(files: int, nbytes: int) -> None:
        nonlocal files_done
        files_done += files
        bar.update(nbytes)
        bar.set_postfix(files=f"{files_done}/{totals[0]}" if totals[0] is not None
                        else files_done, refresh=False)

    t0 = time.monotonic()
    try:
        stats = client.run(getattr(transfer, fn), src, dst, parallel=args.parallel,
                           progress=tick, **options)
    finally:
        bar.close()
        client.close()
    secs = time.monotonic() - t0
    result = {**stats.as_dict(), "seconds": round(secs, 3),
              "bytes_per_s": round(stats.bytes / secs) if secs else None}
    if args.json:
        print_json(result)
    else:
        print(f"{args.command}: {plural(stats.files, 'file')}, {format_size(stats.bytes)} in "
              f"{secs:.1f}s ({format_size(stats.bytes / secs if secs else 0)}/s, "
              f"{stats.files / secs if secs else 0:,.0f} files/s); skipped {stats.skipped:,} "
              f"unchanged; {plural(stats.dirs, 'directory', 'directories')}")
    return _failures(args.command, stats)


def _failures(command: str, stats) -> int:
    """List what a batch copy could not copy (the rest was copied) and how to finish it; the
    exit status: 1 when something failed."""
    if not stats.errors:
        return 0
    for e in stats.errors[:20]:
        print(f"  error: {e}", file=sys.stderr)
    if len(stats.errors) > 20:
        print(f"  ... and {len(stats.errors) - 20:,} more", file=sys.stderr)
    hint = f"; if a daemon is down, {NEXT_STEP}" if any(
        "refused" in e or "did not answer" in e or "unreach" in e for e in stats.errors) else ""
    print(f"jpfs {command}: {plural(len(stats.errors), 'failure')}, the rest was copied; "
          f"rerun the same command to copy what failed (what was copied is skipped){hint}",
          file=sys.stderr)
    return 1


def _storage_options(pairs: list[str]) -> dict:
    import json

    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise JPFSError(errno.EINVAL, "a storage option is KEY=VALUE", pair)
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def cmd_import(args: argparse.Namespace) -> int:
    from ..client.tools.transfer import is_url, scan_local

    dst = _need_jpfs(args.dst, "the destination")
    if is_url(args.src):
        return _run_transfer(args, "import_tree", args.src, dst, (None, None), listed=True,
                             storage_options=_storage_options(args.storage_option))
    if args.storage_option:
        raise JPFSError(errno.EINVAL, "--storage-option is for URL sources (s3://...)",
                        args.src)
    if not os.path.isdir(args.src):
        if not os.path.exists(args.src):
            raise FileNotFoundError(errno.ENOENT, "no such local directory (jpfs import DIR "
                                    "jpfs:/DST copies the directory DIR into JPFS)", args.src)
        raise NotADirectoryError(errno.ENOTDIR, "a file, not a directory (import copies "
                                 "directory trees; copy one file with jpfs cp FILE jpfs:/DST)",
                                 args.src)
    totals = scan_local(args.src) if not args.no_progress else (None, None)
    return _run_transfer(args, "import_tree", args.src, dst, totals)


def cmd_export(args: argparse.Namespace) -> int:
    src = _need_jpfs(args.src, "the source")
    return _run_transfer(args, "export_tree", src, args.dst, (None, None))


def cmd_cp(args: argparse.Namespace) -> int:
    src_j, dst_j = uri.is_jpfs(args.src), uri.is_jpfs(args.dst)
    client = connect(args)
    try:
        if src_j and not dst_j:
            src = uri.to_path(args.src)
            dst = args.dst
            if client.isdir(src):
                if not args.recursive:
                    raise IsADirectoryError(21, "is a directory (use -r)", src)
                from ..client.tools.transfer import export_tree
                return _failures("cp", client.run(export_tree, src, dst))
            if os.path.isdir(dst):
                dst = os.path.join(dst, posixpath.basename(src))
            client.get(src, dst)
        elif dst_j and not src_j:
            dst = uri.to_path(args.dst)
            if os.path.isdir(args.src):
                if not args.recursive:
                    raise IsADirectoryError(21, "is a directory (use -r)", args.src)
                from ..client.tools.transfer import import_tree
                return _failures("cp", client.run(import_tree, args.src, dst))
            if client.isdir(dst):
                dst = posixpath.join(dst, os.path.basename(args.src))
            client.put(args.src, dst)
        elif src_j and dst_j:
            _copy_within(client, uri.to_path(args.src), uri.to_path(args.dst), args.recursive)
        else:
            raise JPFSError(errno.EINVAL, "neither SRC nor DST is a JPFS path: write the JPFS "
                            "side as jpfs:/PATH (plain paths are local; cp(1) copies local "
                            "files)")
    finally:
        client.close()
    return 0


def _copy_within(client, src: str, dst: str, recursive: bool) -> None:
    attr = client.stat(src)
    if client.isdir(dst):
        dst = posixpath.join(dst, posixpath.basename(src))
    if not attr.is_dir:
        with client.open(src, "rb") as fi, client.open(dst, "wb") as fo:
            while piece := fi.read(4 << 20):
                fo.write(piece)
        return
    if not recursive:
        raise IsADirectoryError(21, "is a directory (use -r)", src)
    client.makedirs(dst, exist_ok=True)
    for e in client.scandir(src):
        _copy_within(client, e.path, posixpath.join(dst, e.name), True)


def cmd_cat(args: argparse.Namespace) -> int:
    client = connect(args)
    out = sys.stdout.buffer
    status = 0
    try:
        for p in args.paths:
            try:
                with client.open(jpfs_path(p), "rb") as f:
                    while piece := f.read(4 << 20):
                        out.write(piece)
            except JPFSError as e:  # as cat(1): say which file, go on with the next
                out.flush()
                report("jpfs cat", p, e)
                status = 1
        out.flush()
    finally:
        client.close()
    return status


def cmd_du(args: argparse.Namespace) -> int:
    """Apparent sizes (what the files hold), totalled per directory like du(1)."""
    tops = [(p, jpfs_path(p)) for p in args.paths]  # every path checked before any work
    client = connect(args)
    rows, status = [], 0
    try:
        for given, top in tops:
            try:
                attr = client.stat(top)
            except OSError as e:
                report("jpfs du", given, e)
                status = 1
                continue
            if not attr.is_dir:  # a file counts for itself, as in du(1)
                rows.append({"path": top, "shown": given, "bytes": attr.size, "files": 1})
                continue
            own: dict[str, list[int]] = {}
            stack = [top]
            while stack:  # as du(1): a directory that cannot be read is named, the rest counted
                d = stack.pop()
                try:
                    entries = client.scandir(d)
                except OSError as e:
                    report("jpfs du", given if d == top else shown(d), e)
                    status = 1
                    if d == top:
                        break
                    continue
                files = [e for e in entries if not e.is_dir()]
                own[d] = [sum(e.attr.size for e in files), len(files)]
                stack.extend(e.path for e in entries if e.is_dir())
            if top not in own:
                continue
            total = {d: [0, 0] for d in own}
            for d, (nbytes, nfiles) in own.items():
                cur = d
                while True:
                    total[cur][0] += nbytes
                    total[cur][1] += nfiles
                    if cur == top:
                        break
                    cur = posixpath.dirname(cur)
            dirs = [top] if args.summarize else sorted(total, key=_after_its_subdirs)
            rows += [{"path": d, "shown": given if d == top else shown(d),
                      "bytes": total[d][0], "files": total[d][1]} for d in dirs]
    finally:
        client.close()
    if args.json:
        print_json([{k: r[k] for k in ("path", "bytes", "files")} for r in rows])
    else:
        for r in rows:
            size = format_size(r["bytes"]) if args.human else str(r["bytes"])
            print(f"{size:>12}  {plural(r['files'], 'file'):>13}  {r['shown']}")
    return status


def _after_its_subdirs(path: str) -> tuple[str, ...]:
    """du(1)'s order: depth first in name order, each directory right after its subtree."""
    return (*uri.split(path), "\U0010ffff")


def cmd_gc(args: argparse.Namespace) -> int:
    from ..client.tools.gc import collect

    client = connect(args)
    try:
        report = client.run(lambda ac: collect(ac, grace=args.grace,
                                               min_dead_ratio=args.min_dead,
                                               compact=not args.no_compact,
                                               dry_run=args.dry_run))
    finally:
        client.close()
    if args.json:
        print_json(report)
        return 0
    print(f"live blobs: {report['live_blobs']:,} (named by files)")
    for node, r in report["nodes"].items():
        if "error" in r:
            print(f"  storage-{node}: skipped ({r['error']})")
            continue
        line = f"  storage-{node}: scanned {plural(r['scanned'], 'blob')}, " \
               f"{'would delete' if args.dry_run else 'deleted'} {r['deleted']:,}"
        if r["kept_by_grace"]:
            line += f", kept {r['kept_by_grace']:,} unreferenced younger than --grace " \
                    f"{args.grace:g}s (writes may still be in flight; a later gc takes them)"
        c = r.get("compact")
        if c is not None:
            line += "; " + _compaction(c, r, args.min_dead)
        print(line)
    return 0


def _compaction(c: dict, r: dict, min_dead: float) -> str:
    """What compaction did on one node, and why it reclaimed nothing when it did not (``r``:
    the node's gc report, its bytes counted after compaction)."""
    if c.get("bytes_reclaimed"):
        return (f"compaction rewrote {plural(c.get('volumes_compacted', 0), 'volume')}, "
                f"reclaimed {format_size(c['bytes_reclaimed'])}")
    dead = r.get("dead_bytes", 0)
    if not dead:
        return "compaction reclaimed nothing: no dead bytes in any volume"
    return (f"compaction reclaimed nothing: {format_size(dead)} dead ({r['dead_share']:.0%} of "
            f"this node), but no sealed volume is at least {min_dead:.0%} dead (--min-dead "
            f"{min_dead:g}; the volume being written is never compacted)")
