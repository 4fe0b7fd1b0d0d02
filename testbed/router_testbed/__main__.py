import sys

from router_testbed.cli import main

sys.exit(main())
