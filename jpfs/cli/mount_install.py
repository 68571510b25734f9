"""``jpfs install-mount-helper``: put ``mount.fuse.jpfs`` where mount(8) looks for it.

Apart from the helper itself (``mount_helper``, which runs the whole ``jpfs`` command and so
imports ``main``) so that ``main`` can register this command without importing it back: the
script written here names the helper's module as text.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

PROG = "mount.fuse.jpfs"
DEFAULT_PATH = "/sbin/mount.fuse.jpfs"
MARKER = "written by `jpfs install-mount-helper`"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "install-mount-helper", help="install mount.fuse.jpfs for mount(8) and /etc/fstab",
        description="Write PATH (default /sbin/mount.fuse.jpfs), the helper mount(8) runs for "
        "`mount -t fuse.jpfs CLUSTER MOUNTPOINT -o OPTIONS` and fstab lines of type fuse.jpfs; "
        "it runs this Python, with this jpfs installed.")
    p.add_argument("path", nargs="?", default=DEFAULT_PATH, metavar="PATH")
    p.add_argument("--force", action="store_true",
                   help="replace a file at PATH that this command did not write")
    p.add_argument("--remove", action="store_true", help="remove the helper instead")
    p.set_defaults(func=cmd_install)


def helper_script() -> str:
    """The program written at PATH: this Python running the helper's ``main``."""
    return (f"#!{sys.executable}\n# {PROG}: {MARKER} (mount -t fuse.jpfs)\n"
            "import sys\n\nfrom jpfs.cli.mount_helper import main\n\nsys.exit(main())\n")


def is_ours(path: Path) -> bool:
    """True when PATH holds a helper this command wrote (so it may replace or remove it)."""
    try:
        with path.open(errors="replace") as f:
            return MARKER in f.read(4096)
    except OSError:
        return False


def cmd_install(args: argparse.Namespace) -> int:
    """Write (or with ``--remove`` remove) the helper, refusing a file it did not write."""
    path = Path(args.path)
    exists = path.exists() or path.is_symlink()
    if exists and not args.force and not is_ours(path):
        raise FileExistsError(17, "exists and was not written by jpfs install-mount-helper "
                              "(--force replaces it)", str(path))
    if args.remove:
        if exists:
            path.unlink()
        print(f"removed {path}" if exists else f"{path}: not installed")
        return 0
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(helper_script())
    tmp.chmod(0o755)
    os.replace(tmp, path)
    print(f"installed {path}: `mount -t fuse.jpfs CLUSTER MOUNTPOINT -o ro,allow_other` and "
          "fstab lines of type fuse.jpfs now mount JPFS")
    return 0


__all__ = ["DEFAULT_PATH", "MARKER", "PROG", "cmd_install", "helper_script", "is_ours",
           "register"]
