import sys

from router_sidecar.cli import main

sys.exit(main())
