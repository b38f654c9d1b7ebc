"""`python -m vramtrace.cli ...`, as the `vramtrace` console script."""

import sys

from . import main

sys.exit(main())
