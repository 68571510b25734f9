"""The per-node FUSE mount: unchanged programs read (and write) JPFS as a local tree.

- ``operations``: pyfuse3 Operations over the client (the one place errors become FUSEError)
- ``inodes``, ``handles``: what the mount knows about the kernel's inodes and open files
- ``control``: the ``.jpfs`` directory (stats, metrics, prefetch hints)
- ``stats``: request and open counters, Prometheus families
- ``mount``: serving, background start, unmount

Caching and prefetch live in ``jpfs.client.cache`` and ``jpfs.client.prefetch``.
"""
