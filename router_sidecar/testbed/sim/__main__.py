import sys

from router_sidecar.testbed.sim.server import main

sys.exit(main())
