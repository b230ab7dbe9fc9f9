"""Segment primers (segment reuse, ``serve/chat/segment_primers.py``) on the real default model.

A mark ``[start, end, primer]`` has its entry computed as ``[BOS][primer][segment]``;
the primer's whole blocks are a shared lead computed once (``kv/segments.py``). Checked
here: a segment placed right after the very text it was primed with equals a full
prefill (the copy is then the KV computed in place); two segments with one primer
compute it once; the shared lead goes with a reset and survives a tight pool; entries
with a primer go to the offload tier and come back.
"""

from __future__ import annotations

import torch

from kvstack import LLM, SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PRIMER_TEXT = (
    '{"type": "function", "function": {"name": "get_time", "description": "The time '
    'now in a city, with its zone and the date there."}}\n'
)
TOOLS = [
    '{"type": "function", "function": {"name": "get_tide", "description": "High and low '
    'tides of a harbour for one day."}}\n',
    '{"type": "function", "function": {"name": "book_guide", "description": "Book a guide '
    'to walk across the bay sands."}}\n',
]
ASK = "<|im_start|>user\nWhen is high tide at Morecambe?<|im_end|>\n<|im_start|>assistant\n"


def prompt(llm: LLM, order: list[int], primed: bool) -> tuple[list[int], list[list[object]]]:
    """``[sink][primer]`` (``primed``) or ``[sink][system]``, then the tools of ``order``
    (marked with the primer), then the question."""

    def enc(text: str) -> list[int]:
        return llm.tokenizer.encode(text, add_special_tokens=False)

    planner = llm.engine.scheduler.segments
    assert planner is not None
    primer = enc(PRIMER_TEXT)
    ids = [*planner.cache.sink, *(primer if primed else enc("<|im_start|>system\nTools:\n"))]
    marks: list[list[object]] = []
    for i in order:
        tool = enc(TOOLS[i])
        marks.append([len(ids), len(ids) + len(tool), primer])
        ids += tool
    return ids + enc(ASK), marks


def test_a_segment_after_its_own_primer_equals_full_prefill() -> None:
    """Placed where its fill computed it (after the same sink and primer), a segment's
    copy is the KV computed in place: ratio 0 scores like a full prefill (float32)."""
    kw = dict(dtype="float32", num_blocks=120, block_size=16)
    seg = LLM("default", **kw, segment_recompute_ratio=0.0, segment_recompute_tokens=0)
    ref = LLM("default", **kw, segment_cache="none", prefix_cache="none")
    ids, marks = prompt(seg, [0], primed=True)
    lead = 1 + len(marks[0][2])  # type: ignore[arg-type]
    assert lead >= 32  # two whole blocks shared, the rest in the entry
    after = marks[0][1] + 1  # type: ignore[operator]  # (the copy's last row has no logits)
    got = seg.score(ids, start=after, segments=marks)
    want = ref.score(ids, start=after)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)  # (fp16 rows)
    cache = seg.engine.scheduler.segments.cache  # type: ignore[union-attr]
    (shared,) = cache.leads
    assert len(shared) == lead // 16 * 16
    n = marks[0][1] - marks[0][0]  # type: ignore[operator]
    assert cache.counters.computed_tokens == lead + n  # the lead once, then the rest
    seg.engine.check_integrity()


def test_one_primer_is_computed_once_and_goes_with_a_reset() -> None:
    """Two tools with one primer, in both orders: the lead's blocks computed once; the
    tokens do not depend on a tight pool that evicts entries and the lead; a reset
    returns every block."""
    roomy = LLM("default", dtype="float32", num_blocks=120, segment_recompute_ratio=0.15)
    asks = [prompt(roomy, order, primed=False) for order in ([0, 1], [1, 0], [1])]
    want = [o.outputs[0].token_ids for o in roomy.generate(
        prompt_token_ids=[a[0] for a in asks], sampling_params=SP,
        segments=[a[1] for a in asks], check_integrity=True, use_tqdm=False,
    )]  # fmt: skip
    cache = roomy.engine.scheduler.segments.cache  # type: ignore[union-attr]
    lead = 1 + len(asks[0][1][0][2])  # type: ignore[arg-type]
    tools = sum(m[1] - m[0] for m in asks[0][1])  # type: ignore[misc]
    assert cache.counters.computed_tokens == lead // 16 * 16 + 2 * (lead % 16) + tools
    assert len(cache.leads) == 1
    roomy.reset_prefix_cache()
    assert not cache.leads and not cache.entries
    assert roomy.engine.num_free_blocks == roomy.engine.kv_manager.num_blocks
    tight = LLM(
        "default", dtype="float32", num_blocks=40, max_num_seqs=2,
        segment_recompute_ratio=0.15, segment_max_fraction=0.3,
    )  # fmt: skip
    got = [o.outputs[0].token_ids for o in tight.generate(
        prompt_token_ids=[a[0] for a in asks * 2], sampling_params=SP,
        segments=[a[1] for a in asks * 2], check_integrity=True, use_tqdm=False,
    )]  # fmt: skip
    assert got == want * 2
    tight.engine.check_integrity()
    assert tight.engine.num_free_blocks == tight.engine.kv_manager.num_blocks


def test_primed_entries_come_back_from_the_offload_tier() -> None:
    llm = LLM("default", dtype="float32", num_blocks=120, kv_offload="host:16MiB")
    ids, marks = prompt(llm, [1, 0], primed=False)

    def run() -> list[int]:
        out = llm.generate(
            prompt_token_ids=[ids], sampling_params=SP, segments=[marks], use_tqdm=False
        )
        return out[0].outputs[0].token_ids

    first = run()
    before = llm.get_stats().segments
    assert llm.engine.flush_offload(30)
    llm.reset_prefix_cache()
    assert run() == first
    after = llm.get_stats().segments
    assert after["computed_tokens"] == before["computed_tokens"]  # nothing recomputed
    assert after["loaded_tokens"] == sum(m[1] - m[0] for m in marks)  # type: ignore[misc]
    llm.engine.check_integrity()


def test_a_primer_one_step_cannot_compute_is_dropped() -> None:
    """A 64-token step budget cannot compute the primer's shared blocks: the request runs
    without it (the same tokens as with no primer), nothing refused, nothing leaked."""
    llm = LLM("default", dtype="float32", num_blocks=120, max_num_batched_tokens=64)
    ids, marks = prompt(llm, [0, 1], primed=False)
    long = llm.tokenizer.encode(PRIMER_TEXT * 3, add_special_tokens=False)
    assert len(long) > 64 + 16  # its whole blocks alone exceed the step budget
    bare = [m[:2] for m in marks]
    marks = [[*m[:2], long] for m in marks]
    outs = llm.generate(
        prompt_token_ids=[ids, ids], sampling_params=SP, segments=[marks, bare],
        check_integrity=True, use_tqdm=False,
    )  # fmt: skip
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    cache = llm.engine.scheduler.segments.cache  # type: ignore[union-attr]
    assert not cache.leads and len(cache.entries) == 2  # the bare entries, shared by both
    llm.engine.check_integrity()
