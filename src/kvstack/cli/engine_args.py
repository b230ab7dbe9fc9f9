"""Flags shared by the engine commands: the engine options and the sampling parameters.

The engine flags are derived from ``EngineConfig``'s declarations (``kvstack.config.engine``):
a new engine option appears here, in ``LLM(**options)`` and in ``EngineConfig.from_cli_args``
without being written again. ``--print-stats`` and ``-v`` are options of the command,
not of the engine.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvstack.config.engine import ENGINE, KV, EngineConfig
from kvstack.config.vllm_args import add_cli_flags
from kvstack.core.options import add_arguments
from kvstack.core.request import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` option (groups "engine" and "KV cache management")."""
    groups = add_arguments(p, EngineConfig)
    groups[KV].add_argument(
        "--print-stats",
        action="store_true",
        help="print engine counters (prefix hits, evictions, KV waste) to stderr at exit",
    )
    groups[ENGINE].add_argument(
        "-v", "--verbose", action="store_true", help="log what the engine does"
    )
    add_cli_flags(p.add_argument_group("vLLM engine flags (kvstack.config.vllm_args)"))


def build_llm(a: argparse.Namespace) -> Any:
    """The ``LLM`` the engine flags in ``a`` describe (loads the model)."""
    from kvstack.engine.llm import LLM

    return LLM.from_config(EngineConfig.from_cli_args(a))


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--min-tokens", type=int, default=0, help="tokens before EOS may stop")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely (0 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help=">1 discourages repeats")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    g.add_argument("-n", type=int, default=1, help="completions per prompt")


def sampling_from_args(a: argparse.Namespace) -> SamplingParams:
    """The validated ``SamplingParams`` of ``add_sampling_args``' flags."""
    sp = SamplingParams(
        n=a.n,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        min_p=a.min_p,
        seed=a.sampling_seed,
        presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty,
        repetition_penalty=a.repetition_penalty,
        stop=list(a.stop),
        ignore_eos=a.ignore_eos,
        max_tokens=a.max_tokens,
        min_tokens=a.min_tokens,
    )
    sp.validate()
    return sp
