"""The "Speculative Decoding" section of ``kvstack bench serve`` (as ``vllm bench serve``).

vLLM's ``benchmarks/serve.py`` reads the server's ``vllm:spec_decode_*`` counters from
``/metrics`` before and after the run and reports their difference: acceptance rate
(accepted / draft tokens, in %), acceptance length (1 + accepted / drafts: with the bonus
token), drafts, draft tokens, accepted tokens and the per-position acceptance rates
(accepted at position i / drafts). The same here, with the same JSON keys
(``spec_decode_acceptance_rate`` ...). A server without speculation has none of the
families: no section.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvstack.tools.bench.client import auth_headers

_PREFIX = "vllm:spec_decode_"


@dataclass
class SpecCounters:
    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The ``vllm:spec_decode_*`` counters of a Prometheus exposition (None: absent)."""
    out = SpecCounters()
    found = False
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith(_PREFIX):
            continue
        for s in fam.samples:
            if not s.name.endswith("_total"):
                continue
            found = True
            key = s.name.removeprefix(_PREFIX).removesuffix("_total")
            if key == "num_accepted_tokens_per_pos":
                pos = int(s.labels["position"])
                out.accepted_per_pos[pos] = out.accepted_per_pos.get(pos, 0.0) + s.value
            elif key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                setattr(out, key, getattr(out, key) + s.value)
    return out if found else None


def fetch_spec_counters(
    base_url: str, api_key: str | None, timeout: float = 10.0
) -> SpecCounters | None:
    """``GET {base_url}/metrics`` parsed; None when unreachable or without speculation."""
    req = urllib.request.Request(f"{base_url}/metrics", headers=auth_headers(api_key))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (OSError, urllib.error.URLError, ValueError):
        return None
    return parse_spec_counters(text)


def spec_decode_summary(
    before: SpecCounters | None, after: SpecCounters | None
) -> dict[str, Any] | None:
    """vLLM's figures of the run from the counters before and after it."""
    if before is None or after is None:
        return None
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    positions = sorted(set(before.accepted_per_pos) | set(after.accepted_per_pos))
    per_pos = [
        (after.accepted_per_pos.get(p, 0.0) - before.accepted_per_pos.get(p, 0.0)) / drafts
        if drafts
        else 0.0
        for p in positions
    ]
    return {
        "spec_decode_acceptance_rate": 100.0 * accepted / draft_tokens if draft_tokens else 0.0,
        "spec_decode_acceptance_length": 1.0 + accepted / drafts if drafts else 0.0,
        "spec_decode_num_drafts": int(drafts),
        "spec_decode_draft_tokens": int(draft_tokens),
        "spec_decode_accepted_tokens": int(accepted),
        "spec_decode_per_position_acceptance_rates": per_pos,
    }


def format_spec_decode(s: dict[str, Any]) -> str:
    """The report section, in ``vllm bench serve``'s layout."""
    lines = [
        "{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-"),
        "{:<40} {:<10.2f}".format("Acceptance rate (%):", s["spec_decode_acceptance_rate"]),
        "{:<40} {:<10.2f}".format("Acceptance length:", s["spec_decode_acceptance_length"]),
        "{:<40} {:<10}".format("Drafts:", s["spec_decode_num_drafts"]),
        "{:<40} {:<10}".format("Draft tokens:", s["spec_decode_draft_tokens"]),
        "{:<40} {:<10}".format("Accepted tokens:", s["spec_decode_accepted_tokens"]),
    ]
    rates = s["spec_decode_per_position_acceptance_rates"]
    if rates:
        lines.append("Per-position acceptance (%):")
        lines += [
            "{:<40} {:<10.2f}".format(f"  Position {i}:", 100 * r) for i, r in enumerate(rates)
        ]
    lines.append("=" * 50)
    return "\n".join(lines)
