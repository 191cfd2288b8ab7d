"""``python -m engine.kernels build``: compile the CPU kernel for this machine."""

import sys

from engine.kernels import main

sys.exit(main())
