"""python -m server [MODEL ...] [options]: the same as `moe-serve serve`."""

import sys

from server.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
