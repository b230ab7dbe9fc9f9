"""``kvstack eval``: what a KV codec or press costs in quality, memory and speed.

Every variant (a ``--kv-cache-dtype`` codec, or a ``--kv-press`` at one ratio) runs the
model on the same inputs as the baseline (``auto``: the KV cache in the model's
``--dtype``), each with a fresh :class:`~kvstack.engine.llm.LLM` (one engine alive at a time),
and is compared on:

(a) teacher-forced quality: ``LLM.score`` of every corpus text from its middle on (prompt
    run in chunks of 512 tokens, so later chunks read earlier chunks' KV back through the
    codec): mean KL(baseline || variant) per token in nats, top-1 agreement, perplexities;
(b) greedy agreement: ``--greedy-tokens`` greedy tokens after each text's first half;
    share of positions with the baseline's token, mean length of the identical prefix;
(c) needle (passkey) retrieval accuracy (:mod:`.tasks`: what works for the 135M model);
(d) memory and speed: KV bytes per token, tokens that fit in ``--memory`` (and the ratio
    to a bf16 cache), and ``--batch`` requests of a 512-token prompt generating 64 tokens:
    output tokens / wall time of ``generate`` (the ratio to the baseline), and the decode
    phase alone (tokens after the last prompt chunk / time after it).

The corpus is seeded synthetic prose (TextMaker, see :mod:`.corpus`), real English shipped
offline with Python (``--corpus real``: the Language Reference's prose from
``pydoc_data.topics``), or text the model wrote itself (``--corpus generated``). The
needle task's calibration is measured in every run (the baseline's accuracy per length,
``needle_task.calibration`` in the JSON). The modules: ``config`` (variants and settings),
``corpus`` (the texts), ``tasks`` (needle prompts, the speed test), ``runner``
(:func:`run_eval`), ``report`` (statistics, table, JSON, plot), ``cli`` (the command line).
"""

from kvstack.tools.eval.cli import add_eval_args, main, run_eval_cli
from kvstack.tools.eval.config import (
    BASELINE,
    DEFAULT_CODECS,
    DEFAULTS,
    EvalConfig,
    Variant,
    codec_variant,
    press_variant,
)
from kvstack.tools.eval.runner import run_eval

__all__ = [
    "BASELINE",
    "DEFAULTS",
    "DEFAULT_CODECS",
    "EvalConfig",
    "Variant",
    "add_eval_args",
    "codec_variant",
    "main",
    "press_variant",
    "run_eval",
    "run_eval_cli",
]
