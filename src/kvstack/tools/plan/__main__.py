"""``python -m kvstack.tools.plan``: the same as ``kvstack plan``."""

import sys

from kvstack.tools.plan.cli import main

sys.exit(main())
