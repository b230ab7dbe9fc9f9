"""``kvstack bench serve``'s Speculative Decoding section: vLLM's figures from /metrics."""

from __future__ import annotations

from kvstack.tools.bench.spec_decode import (
    format_spec_decode,
    parse_spec_counters,
    spec_decode_summary,
)


def exposition(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> str:
    labels = 'model_name="m",engine="0"'
    lines = [
        "# TYPE vllm:spec_decode_num_drafts counter",
        f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts}",
        "# TYPE vllm:spec_decode_num_draft_tokens counter",
        f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {draft_tokens}",
        "# TYPE vllm:spec_decode_num_accepted_tokens counter",
        f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {accepted}",
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
    ]
    lines += [
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {n}'
        for i, n in enumerate(per_pos)
    ]
    return "\n".join([*lines, "# TYPE vllm:num_preemptions counter",
                      f"vllm:num_preemptions_total{{{labels}}} 3", ""])  # fmt: skip


def test_summary_is_the_difference_in_vllms_definitions() -> None:
    before = parse_spec_counters(exposition(10, 30, 12, [7, 4, 1]))
    after = parse_spec_counters(exposition(30, 90, 42, [17, 14, 11]))
    s = spec_decode_summary(before, after)
    assert s is not None
    assert s["spec_decode_num_drafts"] == 20 and s["spec_decode_draft_tokens"] == 60
    assert s["spec_decode_accepted_tokens"] == 30
    assert s["spec_decode_acceptance_rate"] == 50.0
    assert s["spec_decode_acceptance_length"] == 2.5
    assert s["spec_decode_per_position_acceptance_rates"] == [0.5, 0.5, 0.5]
    text = format_spec_decode(s)
    assert "Speculative Decoding" in text and "Acceptance length:" in text
    assert "  Position 2:" in text


def test_no_section_without_speculation() -> None:
    assert parse_spec_counters("# TYPE vllm:num_preemptions counter\n") is None
    assert spec_decode_summary(None, None) is None
