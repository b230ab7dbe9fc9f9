"""``python -m kvstack.tools.eval``: the same as ``kvstack eval``."""

import sys

from kvstack.tools.eval.cli import main

sys.exit(main())
