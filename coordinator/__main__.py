"""``python -m coordinator`` is the ``groupcoord`` command."""

import sys

from coordinator.cli import main

sys.exit(main())
