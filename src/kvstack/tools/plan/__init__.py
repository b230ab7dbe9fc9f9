"""``kvstack plan``: the KV-cache capacity planner, how many requests fit on a GPU set.

The modules: ``specs`` resolves the inputs (model shapes and GPU memory from the registries
in ``kvstack/tools/data/`` or a ``config.json``), ``sizing`` computes the :class:`Plan`
(its docstring states the formulas), ``report`` prints it, ``cli`` is the command line.
``kvstack deploy k8s`` takes its autoscaling threshold from :func:`make_plan`.
"""

from kvstack.tools.plan.cli import add_plan_args, main, run_plan
from kvstack.tools.plan.report import fmt_bytes, format_plan
from kvstack.tools.plan.sizing import Plan, make_plan
from kvstack.tools.plan.specs import (
    DTYPE_BYTES,
    GB,
    GiB,
    GpuSpec,
    MiB,
    ModelSpec,
    estimate_params,
    known_gpus,
    known_models,
    model_from_hf_config,
    parse_tokens,
    resolve_gpu,
    resolve_model,
)

__all__ = [
    "DTYPE_BYTES",
    "GB",
    "GiB",
    "GpuSpec",
    "MiB",
    "ModelSpec",
    "Plan",
    "add_plan_args",
    "estimate_params",
    "fmt_bytes",
    "format_plan",
    "known_gpus",
    "known_models",
    "main",
    "make_plan",
    "model_from_hf_config",
    "parse_tokens",
    "resolve_gpu",
    "resolve_model",
    "run_plan",
]
