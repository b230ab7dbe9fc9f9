"""``kvstack profile``: an operator-level profile of prefill and decode on this machine.

After OpScale (arXiv 2608.13499: operators of prefill and decode scale differently, so
provision per operator): ``run`` drives a real engine through a prefill phase and a decode
phase, ``instrument`` times every operator call and counts its FLOPs and bytes,
``bounds`` measures this machine's roofline (memory bandwidth, GEMM throughput),
``report`` turns them into the table, the JSON (``kvstack plan --profile`` reads it) and
the roofline PNG; ``cli`` is the command line.
"""

from kvstack.tools.profile.bounds import MachineBounds, measure_bounds
from kvstack.tools.profile.cli import add_profile_args, main, run_profile
from kvstack.tools.profile.report import SCHEMA, build_report, format_table, plot_roofline
from kvstack.tools.profile.run import PhaseResult, Workload, run_workload

__all__ = [
    "SCHEMA",
    "MachineBounds",
    "PhaseResult",
    "Workload",
    "add_profile_args",
    "build_report",
    "format_table",
    "main",
    "measure_bounds",
    "plot_roofline",
    "run_profile",
    "run_workload",
]
