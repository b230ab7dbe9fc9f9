"""``python -m kvstack.tools.profile``: the same as ``kvstack profile``."""

import sys

from kvstack.tools.profile.cli import main

sys.exit(main())
