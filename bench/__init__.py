"""JPFS benchmarks and workload generators (installed as ``jpfs_bench``); public API only."""
