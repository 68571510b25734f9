"""The per-node FUSE mount: unchanged programs read (and write) JPFS as a local tree.

A thin layer over ``jpfs.client.vfs.core`` (the inode-level filesystem, where every decision is):

- ``operations``: pyfuse3 Operations: translate, call the VFS, translate back; the one place
  errors become FUSEError, and the one place requests on ``.jpfs`` are sent to ``control``
- ``notifier``: how the VFS reaches the kernel's caches (notify_store, invalidation)
- ``lowlevel``: FALLOCATE, served through libfuse's operations table (pyfuse3 lacks it)
- ``control``: the ``.jpfs`` directory (stats, metrics, prefetch hints), which answers every
  request on its inodes and handles (``ControlTree``)
- ``hints``: the prefetch-hint socket of read-only mounts
- ``stats``: request counters, Prometheus families
- ``mount``: serving, background start, unmount
"""
