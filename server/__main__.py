"""python -m moe_serve.server [MODEL ...] [options]: the same as `moe-serve serve`."""

import sys

from moe_serve.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
