"""router-testbed: router-sidecar's testbed, a distribution of its own beside the product (`testbed/` in the
repository): the replica simulator, the demo, the failover drill and the test tool service, plus the
real-engine launcher the real-engine tests use. The product never imports it."""
