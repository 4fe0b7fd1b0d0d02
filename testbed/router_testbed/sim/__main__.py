import sys

from router_testbed.sim.server import main

sys.exit(main())
