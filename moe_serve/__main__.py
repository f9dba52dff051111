"""python -m moe_serve: the `moe-serve` command line."""

import sys

from moe_serve.cli import main

sys.exit(main())
