"""``python -m kvstack.tools.workloads NAME --num-requests N --out FILE.jsonl``."""

import sys

from kvstack.tools.workloads.cli import main

sys.exit(main())
