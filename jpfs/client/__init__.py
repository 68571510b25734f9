"""The client side: the services' clients, the path-level API, and the VFS under the mount.

One reader (``reader``), one writer (``writer``), one blob cache (``cache``) and one prefetcher
(``prefetch``) serve both the path-level client (``client``, ``blocking``, ``files``) and the
inode-level VFS (``vfs``, with ``inodes`` and ``handles``) that the FUSE mount adapts.
"""

from .blocking import Client, connect
from .client import AsyncClient, Entry, aconnect

__all__ = ["AsyncClient", "Client", "Entry", "aconnect", "connect"]
