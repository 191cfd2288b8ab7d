"""``python -m instruments``: the headless CLI (see ``instruments.cli``)."""

import sys

from instruments.cli import main

if __name__ == "__main__":  # a spawned child (the server's engine core) imports this as well
    sys.exit(main())
