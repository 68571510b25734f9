"""A metadata shard: LMDB store with group commit, namespace operations, cross-shard
transactions (``coordinator``), fsck and gc scans, and the ``jpfs-meta`` server."""
