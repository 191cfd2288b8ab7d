"""``python -m instruments``: the headless CLI (see ``instruments.cli``)."""

import sys

from instruments.cli import main

sys.exit(main())
