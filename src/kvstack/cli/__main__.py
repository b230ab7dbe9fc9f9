"""``python -m kvstack.cli``: the ``kvstack`` command."""

from __future__ import annotations

import sys

from kvstack.cli import main

sys.exit(main())
