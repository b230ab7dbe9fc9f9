"""``python -m kvstack.tools.analyze``: the same as ``kvstack analyze``."""

import sys

from kvstack.tools.analyze.cli import main

sys.exit(main())
