"""The testbed, not the product: the replica simulator, the demo, the test tool service and the real-engine
launcher."""
