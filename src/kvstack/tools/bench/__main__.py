"""``python -m kvstack.tools.bench``: the same as ``kvstack bench serve``."""

import sys

from kvstack.tools.bench.cli import main

sys.exit(main())
