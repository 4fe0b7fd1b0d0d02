"""Observability: spans, metrics and structured logs, all views of the machines' named events."""
