import sys

from router_testbed.epp.server import main

sys.exit(main())
