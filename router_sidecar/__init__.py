"""router-sidecar: honest failover for streaming LLM requests behind Envoy."""
