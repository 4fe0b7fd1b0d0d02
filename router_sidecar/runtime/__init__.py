"""Runners: the CLI, the gateway (Envoy + sidecar supervised as one unit), the replica agent, Envoy config
rendering and process supervision."""
