"""Deterministic, tokenizer-aware synthetic workloads for prefix-cache studies.

Every workload is a list of chat requests (OpenAI ``messages``) whose ``prompt_token_ids``
are the model's chat template applied to the messages, exactly what the engine prefills.
Text comes from fixed word lists drawn with ``random.Random`` seeded by ``seed`` (see
:mod:`.text`), measured with the real tokenizer, so lengths land within a few tokens of
their targets and the same arguments always give the same ids.

**Hit rate** = cached prompt tokens / prompt tokens. :func:`ideal_hit_rate` is its upper
bound with an infinite cache: for each request (rounds in order), the longest run of full
blocks that an earlier prompt already contained, never the whole prompt. Layouts
(``H`` = template header, ``=`` shared, ``.`` private to one request)::

    random         |H|.......... prompt_len (200) .........|     nothing shared beyond H
    shared-prefix  |H=system of its group==|....question...|     groups of 32 requests;
                   |<-- shared_prefix_len (144) -->|        |    prompt_len 200 in all
    multi-turn     |H=system (400)=|u0..|a0..|u1..|a1..|u2..|    turn k resends turn k-1's
                   |== shared by all ==|<- turn k-1 prompt ->|    prompt + a(k-1) + u(k)
    few-shot       |H=preamble=|=task=|=8 shots (family)=|.q.|   shots fixed per family
    rag-qa         |H=system=|== document d (1000) ==|.q.|       d ~ Zipf over num_docs
    agent-tools    |H=instructions + <tools> JSON (1500)=|.user (40).| (+ turns: rounds)
    agent-loop     |H=system (150)=|=tools (8 of 16)=|u0|c0|r0|a0|u1|c1|r1|a1|...  forced
                   tool calls (c), their results (r) and answers (a): see .agent
    agent-tools-shuffled  |H|sys|tool 7|tool 2|tool 15|.user.|  3-8 of 20 tools, any order
    rag-shuffled          |H|sys|doc 12|doc 3|doc 27|.q.|     3-5 of 30 docs, any order
                   (see .shuffled: only segment reuse shares these; ``segments`` marks them)

``round`` orders dependencies: turn k of a conversation is round k and needs turn k-1's
reply; single-turn workloads are all round 0. In multi-turn histories the assistant replies
are synthetic fixed text (``assistant_len`` tokens): the real engine's replies differ, so a
benchmark resending these histories prefills those tokens rather than reusing the decode's
KV; the ideal hit rate counts only prompt tokens that an earlier *prompt* contained.
agent-loop's requests here carry scripted tool calls; ``kvstack bench serve --workload
agent-loop`` runs it live instead, each request built from the server's previous reply
(:mod:`.agent`: a JSONL file cannot express that dependency).

Run ``python -m kvstack.tools.workloads NAME --num-requests N --out FILE.jsonl``. The modules:
``spec`` (knobs and requests), ``text`` (word lists and the token-budgeted text maker),
``builders`` (one per workload), ``agent`` and ``agent_pool`` (agent-loop's sessions and
tool pool), ``stats`` (ideal hit rate, summary), ``jsonl`` (files),
``cli`` (the command line).
"""

from kvstack.tools.workloads.builders import build_workload, make_spec, make_workload
from kvstack.tools.workloads.cli import main
from kvstack.tools.workloads.jsonl import read_jsonl, write_jsonl
from kvstack.tools.workloads.spec import (
    DEFAULTS,
    GROUP_SIZE,
    WORKLOADS,
    WorkloadRequest,
    WorkloadSpec,
    parse_knob,
)
from kvstack.tools.workloads.stats import ideal_hit_rate, summarize

__all__ = [
    "DEFAULTS",
    "GROUP_SIZE",
    "WORKLOADS",
    "WorkloadRequest",
    "WorkloadSpec",
    "build_workload",
    "ideal_hit_rate",
    "main",
    "make_spec",
    "make_workload",
    "parse_knob",
    "read_jsonl",
    "summarize",
    "write_jsonl",
]
