import sys

from router_sidecar.runtime.cli import main

# Guarded: the request parser's worker process (spawned) imports this module again as __mp_main__.
if __name__ == "__main__":
    sys.exit(main())
