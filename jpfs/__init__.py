"""JPFS: a parallel filesystem for robot-learning training data.

``jpfs.connect()`` gives a blocking Client for a cluster; ``jpfs.aconnect()`` the trio one.
"""

from __future__ import annotations

from .errors import JPFSError

__version__ = "0.1.0"

__all__ = ["JPFSError", "__version__", "aconnect", "connect"]


def connect(cluster=None, **options):
    """A blocking Client for ``cluster`` (cluster file or directory; default $JPFS_CLUSTER)."""
    from .client import connect as _connect

    return _connect(cluster, **options)


def aconnect(cluster=None, **options):
    """``async with jpfs.aconnect() as client:`` — the trio client."""
    from .client import aconnect as _aconnect

    return _aconnect(cluster, **options)
