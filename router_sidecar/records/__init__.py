"""Our own records, defined once in proto/router_sidecar/records/ (the generated `records_pb2`), and their
JSON and header mapping (`codec`). Writers build the messages; readers parse into them."""
