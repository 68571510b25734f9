"""Coordination: what needs consensus (the cluster map, shard leader leases) kept in etcd."""
