"""python -m moe_serve.exporters FORMAT SRC DST [options]: the same as `moe-serve export`."""

import sys

from moe_serve.cli import main

if __name__ == "__main__":
    sys.exit(main(["export", *sys.argv[1:]]))
