"""Every ``vllm serve`` flag on ``kvstack serve``: what each one does here.

``vllm_serve_flags.txt`` (beside this module) is the list of vLLM's ``vllm serve`` flags,
one argparse action a line, copied from vLLM ``VLLM_VERSION``'s parser. A flag kvstack
already declares (``ServerOptions``, ``EngineConfig``, ``vllm_args``) works as kvstack's
option; ``ALIASES`` are vLLM's other spellings of those. Every other flag is added to the
parser by ``add_vllm_flags`` and judged at start-up by ``check_vllm_flags`` with its
``Policy``:

* ``ignored``: GPU-only, multi-machine or vLLM-internal tuning whose absence changes no
  answer (CUDA graphs, NCCL, expert parallelism, Mamba state, multimodal limits on a
  text model). Accepted; one start-up log line says why.
* ``neutral``: accepted (and logged) while its value is one kvstack already behaves as
  (``--api-server-count 1``, ``--runner generate``); any other value is refused.
* ``refused``: a feature kvstack does not have, whose absence would change answers
  (``--lora-modules``, ``--logits-processors``): a ``ConfigError`` naming the flag and
  why, never a silent fallback. Its "off" spelling (``--no-...``) is accepted.

Invariant (``tests/cli/test_vllm_flag_list.py``): every flag in the list parses on
``kvstack serve`` and resolves to exactly one of "kvstack's own", an alias or a policy.
"""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from kvstack.cli.vllm_flag_policies import FAMILIES, POLICIES, Policy
from kvstack.core.errors import ConfigError

VLLM_VERSION = "0.33.0"
DEST_PREFIX = "vllm_flag__"
logger = logging.getLogger("kvstack.serve")

# vLLM's spellings of flags kvstack declares under another name: flag -> kvstack's flag.
ALIASES = {
    "-q": "--quantization",
    "-pp": "--pipeline-parallel-size",
    "-tp": "--tensor-parallel-size",
    "-dp": "--data-parallel-size",
    "-sc": "--speculative-config",
    "-cc": "--compilation-config",
    "--device-memory-utilization": "--gpu-memory-utilization",
    "--disable-auto-tool-choice": "--no-enable-auto-tool-choice",
    "--disable-prefix-caching": "--no-enable-prefix-caching",
    "--disable-chunked-prefill": "--no-enable-chunked-prefill",
}


@dataclass(frozen=True)
class VllmFlag:
    """One argparse action of ``vllm serve``: its dest, spellings and how many values.

    ``switches`` maps each spelling of an argument-less flag to the value it stores
    (``--enable-x`` True, ``--disable-x`` False); ``takes`` is "0" for those, else
    argparse's nargs ("1", "+", "?").
    """

    dest: str
    strings: tuple[str, ...]
    takes: str
    switches: tuple[tuple[str, bool], ...] = ()


@cache
def vllm_serve_flags() -> tuple[VllmFlag, ...]:
    """The checked-in list of vLLM's ``vllm serve`` flags (``vllm_serve_flags.txt``)."""
    text = resources.files("kvstack.cli").joinpath("vllm_serve_flags.txt").read_text("utf-8")
    out = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        dest, spellings, takes = (p.strip() for p in line.split("|"))
        if takes == "0":
            pairs = tuple((s.split("=")[0], s.endswith("=1")) for s in spellings.split())
            out.append(VllmFlag(dest, tuple(s for s, _ in pairs), takes, pairs))
        else:
            out.append(VllmFlag(dest, tuple(spellings.split()), takes))
    return tuple(out)


def policy_of(dest: str) -> Policy | None:
    """The policy of vLLM's option ``dest``: its own entry, else its family's."""
    if dest in POLICIES:
        return POLICIES[dest]
    for pattern, policy in FAMILIES:
        if re.fullmatch(pattern, dest):
            return policy
    return None


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Add every vLLM flag ``parser`` lacks: aliases onto kvstack's actions, the rest
    under dest ``vllm_flag__<vLLM dest>`` (absent from the namespace unless given)."""
    known = parser._option_string_actions
    group = parser.add_argument_group(
        f"vLLM {VLLM_VERSION} flags kvstack accepts (see docs/serving/vllm_compat.md)"
    )
    for flag in vllm_serve_flags():
        missing = [s for s in flag.strings if s not in known]
        if not missing or flag.dest == "config":  # --config: expanded before parsing
            continue
        for s in [s for s in missing if s in ALIASES]:
            action = known[ALIASES[s]]
            action.option_strings = [*action.option_strings, s]
            known[s] = action
        own = _same_dest_switches(flag, known)
        for s in [s for s in missing if s in own]:
            group.add_argument(s, dest=own[s][0], action="store_const", const=own[s][1],
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # fmt: skip
        rest = [s for s in missing if s not in ALIASES and s not in own]
        if rest:
            _add_own(group, flag, rest)


def _same_dest_switches(
    flag: VllmFlag, known: dict[str, argparse.Action]
) -> dict[str, tuple[str, bool]]:
    """vLLM's other spelling of a kvstack switch of the same name (``--disable-log-requests``
    beside kvstack's ``--enable-log-requests``): spelling -> (dest, value it stores)."""
    dests = {known[s].dest for s, _ in flag.switches if s in known}
    if flag.dest not in dests:
        return {}
    return {s: (flag.dest, v) for s, v in flag.switches if s not in known}


def _add_own(group: argparse._ArgumentGroup, flag: VllmFlag, strings: list[str]) -> None:
    policy = policy_of(flag.dest)
    text = f"vLLM's flag, {policy.kind}: {policy.reason}" if policy else "vLLM's flag"
    dest = DEST_PREFIX + flag.dest
    if flag.takes == "0":
        values = dict(flag.switches)
        for s in strings:
            group.add_argument(s, dest=dest, action="store_const", const=values[s],
                               default=argparse.SUPPRESS, help=text.replace("%", "%%"))  # fmt: skip
        return
    nargs = None if flag.takes == "1" else flag.takes
    group.add_argument(*strings, dest=dest, nargs=nargs, default=argparse.SUPPRESS,
                       metavar="VALUE", help=text.replace("%", "%%"))  # fmt: skip


def given_vllm_flags(ns: argparse.Namespace) -> dict[str, Any]:
    """vLLM dest -> value of the ``add_vllm_flags`` flags given on the command line."""
    return {k[len(DEST_PREFIX) :]: v for k, v in vars(ns).items() if k.startswith(DEST_PREFIX)}


def check_vllm_flags(ns: argparse.Namespace) -> list[str]:
    """``ConfigError`` for the first refused flag given; else one note per ignored one
    (the caller logs them once at start-up)."""
    notes = []
    spelled = {f.dest: f.strings[0] for f in vllm_serve_flags()}
    for dest, value in given_vllm_flags(ns).items():
        flag = spelled.get(dest, "--" + dest.replace("_", "-"))
        policy = policy_of(dest)
        if policy is None:  # the list and the table disagree: a bug, said plainly
            raise ConfigError(f"{flag}: vLLM's flag has no kvstack policy")
        notes.append(policy.judge(flag, value))
    return notes


def apply_vllm_flags(ns: argparse.Namespace) -> None:
    """Check the vLLM flags given, set the kvstack options of the mapped ones in ``ns``
    and log one line for each (what it became, or why it has no effect)."""
    notes = check_vllm_flags(ns)
    for dest, value in given_vllm_flags(ns).items():
        policy = policy_of(dest)
        if policy is not None and policy.maps_to is not None and value is not False:
            setattr(ns, policy.maps_to, policy.convert(value))
    if getattr(ns, "dtype", None) in ("half", "float16", "fp16"):
        notes.append(
            f"--dtype {ns.dtype}: served in bfloat16, the 16-bit type kvstack's CPU kernels "
            "compute in (same memory as float16, wider exponent range)"
        )
    for note in notes:
        logger.warning("%s", note)
