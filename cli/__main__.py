import sys

from moe_serve.cli import main

sys.exit(main())
