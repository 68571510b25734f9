"""A storage node: append-only volumes with an LMDB blob index (``store``) and the
``jpfs-storage`` server (batched sendfile reads, group-committed puts, compaction)."""
