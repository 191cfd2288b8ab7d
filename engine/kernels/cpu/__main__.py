"""``python -m engine.kernels.cpu build``: compile the CPU kernel for this machine."""

import sys

from engine.kernels.cpu import main

sys.exit(main())
