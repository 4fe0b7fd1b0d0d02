"""The sidecar's own copy of the Envoy v3 API messages it exchanges with Envoy.

`*_pb2` modules are generated from proto/router_sidecar/wire/*.proto by scripts/gen_protos.sh (do not
edit them). The messages keep only the fields the sidecar reads or writes, with Envoy's field numbers and
types, under the proto package `router_sidecar.wire.v1`, so they never clash with Envoy's own generated
modules in the descriptor pool. `services` registers the gRPC methods Envoy calls, by Envoy's paths.
"""
