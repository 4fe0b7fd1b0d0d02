"""router-sidecar: honest failover for streaming LLM requests behind Envoy."""

import os

# Our processes fork only to exec (Envoy, etcd, config validation): gRPC's fork handlers have nothing to
# protect there, and running them while its threads were busy aborted the child before its exec (seen as
# Envoy "exited with -6 during start-up"). Set before anything imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
