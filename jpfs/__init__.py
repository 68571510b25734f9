"""JPFS: a parallel filesystem for robot-learning training data.

``jpfs.connect()`` gives a blocking Client for a cluster; ``jpfs.aconnect()`` the trio one.
"""

from __future__ import annotations

from .errors import JPFSError

__version__ = "0.1.0"

__all__ = ["JPFSError", "__version__"]
