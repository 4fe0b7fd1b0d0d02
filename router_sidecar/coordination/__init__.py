"""Coordination through etcd: the `Store` interface, the journal, attempt leases and fences, replica
heartbeats and progress, the replica registry, tool-call records."""
