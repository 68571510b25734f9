"""The inode-level filesystem the FUSE mount adapts: every decision of the mount is made here."""

from .core import VFS, VFSConfig

__all__ = ["VFS", "VFSConfig"]
