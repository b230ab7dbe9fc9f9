"""The command line of ``kvstack eval`` (and ``python -m kvstack.tools.eval``).

Options and their checks (:func:`add_eval_args`), then the run (:func:`run_eval_cli`: the
measurements of :mod:`.runner`, the table, the JSON, markdown and plot outputs).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kvstack.tools.eval.report as rep
from kvstack.config.choices import to_dtype
from kvstack.core.errors import ConfigError
from kvstack.core.units import parse_size
from kvstack.tools.command import run_tool
from kvstack.tools.eval.config import (
    DEFAULT_CODECS,
    DEFAULTS,
    EvalConfig,
    codec_variant,
    press_variant,
    weight_variant,
)
from kvstack.tools.eval.runner import run_eval
from kvstack.tools.eval.tasks import DECODE_PROMPT_TOKENS

PROG = "python -m kvstack.tools.eval"


def _opt(args: argparse.Namespace, name: str, kind: type = int) -> Any:
    """Option ``name`` parsed (a number, or a comma list when its default is a list)."""
    text, default = getattr(args, name), DEFAULTS[name][int(bool(args.quick))]
    if text is None:
        return default
    opt = "--" + name.replace("_", "-")
    try:
        out = [kind(t.strip()) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"{opt} must be a number or a comma list of numbers: {text!r}") from None
    if not out:
        raise ConfigError(f"{opt} is empty")
    if not isinstance(default, list) and len(out) != 1:
        raise ConfigError(f"{opt} takes one number, got {text!r}")
    return out if isinstance(default, list) else out[0]


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstack eval`` (list defaults shown as full / --quick)."""
    parser.add_argument(
        "--kv-cache-dtype",
        default=",".join(DEFAULT_CODECS),
        help="comma list of KV codecs to compare with 'auto' (default: %(default)s; "
        "'none' for no codec, e.g. to compare presses only)",
    )
    parser.add_argument(
        "--kv-press",
        default=None,
        help="comma list of presses to compare as well (streaming_llm, snapkv, h2o, "
        "pyramidkv, knorm, defensivekv, layer_defensivekv), each at every --kv-press-ratios",
    )
    parser.add_argument(
        "--kv-press-ratios",
        default="0.5,0.8",
        help="fractions of KV each press removes (default %(default)s; 0.8 = a 20%% budget)",
    )
    parser.add_argument(
        "--quantization",
        default=None,
        help="comma list of weight schemes to compare as well (int8, int4, gguf), each "
        "alone or stacked with a KV codec as SCHEME+CODEC (e.g. gguf+int8)",
    )
    parser.add_argument("--model", default="default", help="model (default: SmolLM2-135M)")
    parser.add_argument(
        "--dtype",
        default="auto",
        type=to_dtype,  # 'auto' resolved from the CPU's ISA, as the engine's --dtype
        choices=("auto", "bfloat16", "float32"),
        help="model dtype (default auto: bfloat16 with AVX512-BF16 or AMX, else float32)",
    )
    parser.add_argument("--quick", action="store_true", help="small settings (minutes on a CPU)")
    for name, what in (
        ("contexts", "text lengths in tokens for teacher-forced quality and greedy agreement"),
        ("num-texts", "texts per context length"),
        ("greedy-tokens", "greedy tokens generated after each text's first half"),
        ("needle-lengths", "passkey prompt lengths in tokens"),
        ("needle-depths", "needle depths, fractions of the haystack"),
        ("needle-trials", "random pass keys per (length, depth) cell"),
        ("batch", f"requests of {DECODE_PROMPT_TOKENS} prompt tokens in the speed test"),
    ):
        full, quick = (
            str(v).strip("[]").replace(" ", "") for v in DEFAULTS[name.replace("-", "_")]
        )
        parser.add_argument(
            f"--{name}", default=None, help=f"{what} (default {full}; quick {quick})"
        )
    parser.add_argument(
        "--memory", default="1GiB", help="KV memory for the capacity column (default 1GiB)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of texts and keys")
    parser.add_argument(
        "--corpus",
        default="prose",
        choices=("prose", "real", "generated"),
        help="texts for (a) and (b): seeded synthetic prose (default; perplexity ~50, flat "
        "distributions), real English shipped with Python (the Language Reference's prose "
        "in pydoc_data.topics), or text the model generates itself first (perplexity ~1.6)",
    )
    parser.add_argument("--output", default="eval-results.json", help="JSON results file")
    parser.add_argument("--plot", default=None, help="write a quality-vs-memory PNG here")
    parser.add_argument("--markdown", default=None, help="write the table as markdown here")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def run_eval_cli(args: argparse.Namespace) -> int:
    """``kvstack eval``: user errors raise ``ConfigError`` (one line, exit code 2)."""
    codecs = [c.strip() for c in str(args.kv_cache_dtype).split(",") if c.strip()]
    if codecs == ["none"]:
        codecs = []
    variants = [codec_variant(c) for c in codecs]
    presses = [p.strip() for p in str(args.kv_press or "").split(",") if p.strip()]
    try:
        ratios = [float(r) for r in str(args.kv_press_ratios).split(",") if r.strip()]
    except ValueError:
        raise ConfigError(
            f"--kv-press-ratios must be numbers, got {args.kv_press_ratios!r}"
        ) from None
    variants += [press_variant(p, r) for p in presses for r in ratios]
    weights = [w.strip() for w in str(args.quantization or "").split(",") if w.strip()]
    variants += [weight_variant(w) for w in weights]
    config = EvalConfig(
        variants=variants,
        model=args.model,
        dtype=args.dtype,
        contexts=_opt(args, "contexts"),
        num_texts=_opt(args, "num_texts"),
        greedy_tokens=_opt(args, "greedy_tokens"),
        needle_lengths=_opt(args, "needle_lengths"),
        needle_depths=_opt(args, "needle_depths", float),
        needle_trials=_opt(args, "needle_trials"),
        memory=int(parse_size(args.memory)),
        batch=_opt(args, "batch"),
        seed=args.seed,
        quick=bool(args.quick),
        corpus=str(args.corpus),
        progress=not args.quiet,
    )
    config.validate()  # cheap checks before any model is loaded
    for path in (args.output, args.plot, args.markdown):
        if path and not Path(path).resolve().parent.is_dir():
            raise ConfigError(f"cannot write {path!r}: no such directory")
    if args.plot:
        rep.check_plot_available()
    report = run_eval(config)
    print(rep.format_table(report))
    rep.write_json(report, args.output)
    written = [args.output]
    if args.markdown:
        rep.write_text(rep.format_markdown(report), args.markdown)
        written.append(args.markdown)
    if args.plot:
        rep.write_plot(report, args.plot)
        written.append(args.plot)
    print(f"wrote {', '.join(written)}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvstack.tools.eval ...``: the same as ``kvstack eval``."""
    return run_tool(
        PROG,
        add_eval_args,
        run_eval_cli,
        argv,
        description="What each KV codec or press costs: quality, memory and speed.",
    )
