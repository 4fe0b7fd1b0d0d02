import sys

from router_sidecar.runtime.cli import main

sys.exit(main())
