"""The gRPC shell facing Envoy: ext_proc servicers (downstream, upstream, replica side), the access log and
EDS. They translate messages into machine inputs and carry out the machines' decisions."""
