"""The JPFS server side (installed as ``jpfs_daemon``): metadata shards and storage nodes."""
