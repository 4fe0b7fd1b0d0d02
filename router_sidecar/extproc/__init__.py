"""The ext_proc shell: translates Envoy's messages into machine events and decisions back into replies."""
