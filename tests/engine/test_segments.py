"""Segment reuse on the real default model, float32.

Documents are marked as segments and sent in different orders; the engine computes each
one standalone once, copies it (keys re-rotated) into every request that holds it and
repairs a share of its tokens. Checked here: ratio 1.0 gives the tokens of a full
prefill; the copied layer-0 keys equal keys computed in place; results do not depend on
the pool (preemption, eviction, chunking); bad marks are refused with nothing leaked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvstack import LLM, SamplingParams
from kvstack.core.errors import ConfigError, InvalidRequestError
from kvstack.core.request import RequestStatus
from kvstack.model.segment_rows import rows_on_paged_kernel
from kvstack.testing.redis_server import LocalRedis

DOCS = [
    "Document A: The river Lune flows through Lancaster. Its bridges date from the "
    "eighteenth century and the quay once handled trade with the West Indies.",
    "Document B: Kendal is known for mint cake, a sugar confection carried by climbers "
    "on Everest in 1953. The town sits on the river Kent.",
    "Document C: Morecambe Bay has fast tides and quicksand; guides have led walkers "
    "across the sands for centuries, and the bay hosts many wading birds.",
]
ASKS = [
    ((0, 1, 2), "Which town is known for mint cake?"),
    ((2, 0, 1), "Where are the quicksands?"),
    ((1, 2, 0), "What river flows through Lancaster?"),
    ((1, 0), "Name a bridge town."),
]
SP = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


NOTES = [d.replace("Document", "Note") for d in DOCS]  # other segments, same lengths
Ask = tuple[tuple[int, ...], str]


def build(
    llm: LLM, order: tuple[int, ...], question: str, docs: list[str] = DOCS
) -> tuple[list[int], list[tuple[int, int]]]:
    """A chat prompt with the documents of ``order`` marked as segments."""
    enc = llm.tokenizer.encode
    ids = enc("<|im_start|>system\nAnswer from the documents.\n", add_special_tokens=False)
    spans = []
    for i in order:
        doc = enc(docs[i] + "\n", add_special_tokens=False)
        spans.append((len(ids), len(ids) + len(doc)))
        ids += doc
    ids += enc(
        f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    return ids, spans


def run(llm: LLM, asks: list[Ask] = ASKS, notes: list[Ask] = (), **kw: Any) -> list[list[int]]:
    built = [build(llm, order, q) for order, q in asks]
    built += [build(llm, order, q, NOTES) for order, q in notes]
    outs = llm.generate(
        prompt_token_ids=[ids for ids, _ in built],
        sampling_params=SP,
        segments=[spans for _, spans in built],
        check_integrity=True,
        use_tqdm=False,
        **kw,
    )
    eng = llm.engine
    eng.check_integrity()
    assert eng.num_free_blocks == eng.kv_manager.num_blocks  # nothing leaked (idle entries free)
    return [o.outputs[0].token_ids for o in outs]


def _held(llm: LLM) -> tuple[int, tuple[int, ...]]:
    """Blocks the segment entries hold, and the sink every segment follows."""
    planner = llm.engine.scheduler.segments
    return (0, ()) if planner is None else (planner.cache.num_blocks, planner.cache.sink)


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return run(LLM("default", dtype="float32", segment_cache="none", num_blocks=300))


def test_full_recompute_equals_full_prefill(plain: list[list[int]]) -> None:
    llm = LLM("default", dtype="float32", num_blocks=300, segment_recompute_ratio=1.0)
    assert run(llm) == plain
    seg = llm.get_stats().segments
    # Three documents computed once each (after the sink), reused by the later requests.
    sink = len(_held(llm)[1])
    docs = [llm.tokenizer.encode(d + "\n", add_special_tokens=False) for d in DOCS]
    assert seg["computed_tokens"] == sum(len(d) + sink for d in docs)
    assert seg["hit_tokens"] > 0 and seg["recomputed_tokens"] == seg["placed_tokens"]


def test_full_recompute_with_a_kv_codec() -> None:
    """int8 KV: copies are decoded, re-rotated and encoded again; ratio 1.0 rewrites them
    all, so the tokens equal the codec's own full prefill."""
    kw = dict(dtype="float32", num_blocks=300, kv_cache_dtype="int8")
    want = run(LLM("default", **kw, segment_cache="none"), ASKS[:2])
    assert run(LLM("default", **kw, segment_recompute_ratio=1.0), ASKS[:2]) == want


def test_partial_repair_computes_less_and_is_independent_of_the_pool() -> None:
    roomy = LLM("default", dtype="float32", num_blocks=300, segment_recompute_ratio=0.15)
    want = run(roomy, ASKS, ASKS)
    s = roomy.get_stats()
    assert 0 < s.segments["recomputed_tokens"] < s.segments["placed_tokens"]
    # A tight pool and a small step budget: chunked prefill stops at segments, entries
    # are evicted and recomputed, requests are preempted; the tokens stay the same.
    tight = LLM(
        "default",
        dtype="float32",
        num_blocks=24,
        max_num_seqs=4,
        max_model_len=256,
        max_num_batched_tokens=64,
        segment_recompute_ratio=0.15,
        segment_max_fraction=0.4,
    )
    assert run(tight, ASKS * 2, ASKS) == want[:4] * 2 + want[4:]
    t = tight.get_stats()
    assert t.num_preemptions > 0 and t.segments["evicted"] > 0


def test_tokens_between_segments_run_with_the_copies() -> None:
    """Documents separated by template tokens (outside the marks): every copy and every
    separator of a request go in one step, the separators as rows of its forward; ratio
    1.0 still gives a full prefill's tokens, and separators are not counted as repaired
    segment tokens."""

    def gapped(llm: LLM) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
        built = [build(llm, order, q) for order, q in ASKS[:3]]
        line = llm.tokenizer.encode("---\n", add_special_tokens=False)
        prompts, marks = [], []
        for ids, spans in built:
            out, moved, at = [], [], 0
            for a, b in spans:  # a separator before every document but the first
                out += ids[at:a] + (line if moved else [])
                moved.append((len(out), len(out) + b - a))
                out += ids[a:b]
                at = b
            prompts.append(out + ids[at:])
            marks.append(moved)
        return prompts, marks

    kw: dict[str, Any] = dict(dtype="float32", num_blocks=300)
    plain = LLM("default", **kw, segment_cache="none")
    prompts, marks = gapped(plain)
    want = [o.outputs[0].token_ids for o in plain.generate(
        prompt_token_ids=prompts, sampling_params=SP, use_tqdm=False)]  # fmt: skip
    llm = LLM("default", **kw, segment_recompute_ratio=1.0)
    for i, (ids, spans) in enumerate(zip(prompts, marks, strict=True)):
        steps = llm.engine.stats().num_steps
        (out,) = llm.generate(prompt_token_ids=[ids], sampling_params=SP,
                              segments=[spans], use_tqdm=False)  # fmt: skip
        assert out.outputs[0].token_ids == want[i]
        if i > 0:  # entries ready: prefix hit, one step of copies + separators, 11 decodes
            assert llm.engine.stats().num_steps - steps <= 1 + SP.max_tokens, i
    seg = llm.get_stats().segments
    assert seg["recomputed_tokens"] == seg["placed_tokens"]
    llm.engine.check_integrity()


def test_one_steps_repair_rows_fit_its_token_budget(plain: list[list[int]]) -> None:
    """Ratio 1.0 under a 64-token step budget: three adjacent documents' repair rows
    (~135) cannot share one step, so the copies spread over steps (a document's first
    token computed in place as the chunk, the rest of its first tokens repaired next
    step); the tokens stay a full prefill's and every request finishes (before, the
    request waited forever for a budget its rows could never fit)."""
    llm = LLM("default", dtype="float32", num_blocks=300, max_num_batched_tokens=64,
              max_model_len=256, segment_recompute_ratio=1.0)  # fmt: skip
    eng = llm.engine
    for i, (order, q) in enumerate(ASKS):
        ids, spans = build(llm, order, q)
        eng.add_request(str(i), None, SP, prompt_token_ids=ids, segments=spans)
    done: dict[str, list[int]] = {}
    for _ in range(400):  # a bound instead of a hang
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        eng.check_integrity()
        if not eng.has_unfinished_requests():
            break
    assert [done.get(str(i)) for i in range(len(ASKS))] == plain
    seg = llm.get_stats().segments
    assert seg["recomputed_tokens"] == seg["placed_tokens"]


def test_bf16_repair_rows_run_at_their_positions() -> None:
    """bf16: the repair rows (and the probe's) of a request run as one sparse sequence on
    the C++ causal prefill kernel, row ``i`` at its position (``csrc/prefill_attention.cpp``;
    checked against SDPA in ``tests/model/test_causal_attention.py``); on a CPU without
    AVX512-BF16, as decode-like rows of the paged kernel."""
    llm = LLM("default", dtype="bfloat16", num_blocks=300, segment_recompute_ratio=0.5)
    runner = llm.engine.runner
    kernels = runner.kernels
    if kernels is None or not kernels.causal_attention_available():
        assert rows_on_paged_kernel(kernels, llm.engine.model, kernels is not None) == (
            kernels is not None
        )
        return
    sparse: list[torch.Tensor] = []

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(kernels, name)

        def causal_attention(self, *args: Any) -> torch.Tensor:
            if len(args) > 5 and args[5] is not None:
                sparse.append(args[5])
            return kernels.causal_attention(*args)

    runner.kernels = Spy()
    run(llm, ASKS[:3])
    layers = llm.engine.model.config.num_layers
    # Requests 2 and 3 copy cached entries: 2 probe layers and every layer of the step.
    assert len(sparse) >= 2 * (layers + 2), len(sparse)
    assert all(bool((p[1:] > p[:-1]).all()) for p in sparse)


def _run_until(llm: LLM, rid: str, position: int) -> list[int]:
    eng = llm.engine
    while eng.scheduler.requests[rid].num_computed_tokens < position:
        eng.step()
        eng.check_integrity()
    return eng.kv_manager.get_block_ids(rid)


def _keys(llm: LLM, blocks: list[int], positions: range) -> torch.Tensor:
    """Layer 0's keys at ``positions`` of a request with block table ``blocks``."""
    keys = llm.engine.kv_storage.layer(0).gather(torch.tensor(blocks))[0].flatten(0, 1)
    return keys[torch.tensor(list(positions))]


@pytest.mark.parametrize(("block_size", "primer"), [(16, 0), (8, 0), (16, 37)])
def test_placed_keys_equal_keys_computed_in_place(block_size: int, primer: int) -> None:
    """Layer 0's KV depends only on token and position: a copy re-rotated from the
    standalone positions must equal the keys computed in place (float32, 1e-5), at odd
    offsets and across block boundaries; also after a primer whose two whole blocks are
    a shared lead (the copy's source positions start past it)."""
    kw = dict(dtype="float32", num_blocks=200, block_size=block_size)
    seg = LLM("default", **kw, segment_recompute_ratio=0.0, segment_recompute_tokens=0)
    ref = LLM("default", **kw, segment_cache="none", prefix_cache="none")
    for pad in (0, 3, block_size + 5):
        ids, spans = build(seg, (0, 2, 1), "Which bay?")
        ids = ids[:1] + [198] * pad + ids[1:]
        spans = [(a + pad, b + pad, [198] * primer) for a, b in spans]
        seg.engine.add_request(f"s{pad}", None, SP, prompt_token_ids=ids, segments=spans)
        ref.engine.add_request(f"r{pad}", None, SP, prompt_token_ids=ids)
        end = spans[-1][1]
        got = _keys(seg, _run_until(seg, f"s{pad}", end), range(spans[0][0], end))
        want = _keys(ref, _run_until(ref, f"r{pad}", end), range(spans[0][0], end))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        seg.engine.abort_request(f"s{pad}")
        ref.engine.abort_request(f"r{pad}")
    seg.engine.check_integrity()
    assert len(seg.engine.scheduler.segments.cache.leads) == (primer > 0)  # type: ignore[union-attr]


def test_shared_entry_is_held_until_every_request_copied_it() -> None:
    """Two requests hold document A's entry while a long prefix keeps them from copying
    it; a flood of other segments must evict around it, never it."""
    llm = LLM(
        "default", dtype="float32", num_blocks=40, max_num_batched_tokens=64,
        segment_max_fraction=0.5,
    )  # fmt: skip
    eng = llm.engine
    doc = list(range(1000, 1040))
    a_start, a_end = 200, 200 + len(doc)
    for rid, filler in (("x", 11), ("y", 13)):
        ids = [filler] * a_start + doc + [5, 6, 7]
        eng.add_request(rid, None, SP, prompt_token_ids=ids, segments=[(a_start, a_end)])
    eng.step()  # both requests look the entry up: one fill, both hold it
    eng.step()
    planner = eng.scheduler.segments
    assert planner is not None
    (entry,) = planner.cache.entries.values()
    assert entry.ready and entry.users == 2
    flood = [[1] + [300 + i] * 30 + [4] for i in range(6)]
    for i, ids in enumerate(flood):
        eng.add_request(f"f{i}", None, SP, prompt_token_ids=ids, segments=[(1, 31)])
    while eng.has_unfinished_requests():
        eng.step()
        eng.check_integrity()
        if entry.users:
            assert planner.cache.entries.get(entry.key) is entry
    assert entry.users == 0


@pytest.mark.parametrize(
    ("spans", "match"),
    [
        ([(5, 5)], "empty"),
        ([(5, 9), (8, 12)], "overlaps"),
        ([(5, 400)], "outside"),
        ([(-1, 3)], "outside"),
        ([(1, 2, 3, 4)], "start, end"),
        ([("a", "b")], "start, end"),
        ([(1, 9, 3)], "primer is a list of token ids"),
        ([(1, 9, [1, -2])], "primer is a list of token ids"),
        ([(1, 9, [10**9])], "not below"),
        ([(1, 9, [1] * 513)], "at most 512"),
        ("0-9", "token ranges"),
    ],
)
def test_bad_marks_are_refused(spans: Any, match: str) -> None:
    llm = _shared_llm()
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(prompt_token_ids=[list(range(20, 60))], segments=[spans], use_tqdm=False)
    _nothing_left(llm)


def test_bad_settings_are_refused() -> None:
    llm = _shared_llm()
    ids = list(range(20, 60))
    for sp, match in (
        (SamplingParams(segment_recompute_ratio=1.5), r"\[0, 1\]"),
        (SamplingParams(segment_recompute_tokens=-2), "non-negative"),
        (SamplingParams(kv_press="knorm", kv_press_ratio=0.5), "press"),
    ):
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate(prompt_token_ids=[ids], sampling_params=sp, segments=[[(3, 9)]])
    with pytest.raises(InvalidRequestError, match="per prompt"):
        llm.generate(prompt_token_ids=[ids, ids], segments=[[(3, 9)]])
    with pytest.raises(InvalidRequestError, match="at most"):  # longer than one step computes
        llm.generate(prompt_token_ids=[list(range(600))], segments=[[(1, 599)]])
    _nothing_left(llm)
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        LLM("default", segment_recompute_ratio=2.0)
    slab = LLM("default", kv_layout="contiguous", num_blocks=64, max_model_len=512)
    with pytest.raises(InvalidRequestError, match="paged"):
        slab.generate(prompt_token_ids=[ids], segments=[[(3, 9)]])
    off = LLM("default", segment_cache="none", num_blocks=64)  # marks ignored
    assert off.generate(prompt_token_ids=[ids], sampling_params=SP, segments=[[(3, 9)]])


_LLM: LLM | None = None


def _shared_llm() -> LLM:
    global _LLM
    if _LLM is None:
        _LLM = LLM("default", num_blocks=64, max_num_batched_tokens=2048)
    return _LLM


def _nothing_left(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    eng.check_integrity()
    assert eng.num_free_blocks == eng.kv_manager.num_blocks
    assert RequestStatus.WAITING not in {r.status for r in eng.scheduler.requests.values()}


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with LocalRedis() as server:
        yield server.url


@pytest.mark.parametrize("tier", ["host", "redis"])
def test_entries_go_to_the_offload_tier_and_come_back(
    tier: str, request: pytest.FixtureRequest
) -> None:
    """Entries are stored write-through in the offload tier (host memory, or Redis shared
    by replicas); after a device reset a miss is loaded from there instead of computed,
    and gives the same tokens."""
    spec = "host:64MiB" if tier == "host" else request.getfixturevalue("redis_url")
    llm = LLM("default", dtype="float32", num_blocks=300, kv_offload=spec)
    first = run(llm, ASKS[:2])
    before = llm.get_stats().segments
    assert llm.engine.flush_offload(30)
    llm.reset_prefix_cache()  # the device forgets every entry; the host tier keeps them
    assert run(llm, ASKS[:2]) == first
    after = llm.get_stats().segments
    assert after["computed_tokens"] == before["computed_tokens"]  # nothing recomputed
    sink = len(_held(llm)[1])  # every distinct document came back from the host tier
    assert after["loaded_tokens"] == before["computed_tokens"] - len(DOCS) * sink
