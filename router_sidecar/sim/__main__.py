import sys

from router_sidecar.sim.server import main

sys.exit(main())
