"""Presses (token eviction): what each keeps on synthetic KV, and on the real default model (fp32)
that ratio 0 is no press, that reclaimed blocks really return to the pool while the
request goes on, and that pressed requests never change the outputs of unpressed ones,
mixed with prefix reuse, preemption and a KV codec."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch

from kvstack import LLM, SamplingParams
from kvstack.config.engine import CacheConfig
from kvstack.core.errors import ConfigError, InvalidRequestError
from kvstack.kv.press import PRESSES, PressInput, make_press
from kvstack.kv.press.base import window_attention
from kvstack.kv.press.pyramidkv import pyramid_budgets
from kvstack.kv.press.state import PressState

L, N, KVH, H, D = 3, 200, 2, 4, 16


def synthetic(seed: int = 0, n: int = N) -> PressInput:
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, KVH, D, generator=g) for _ in range(L)]
    values = [torch.randn(n, KVH, D, generator=g) for _ in range(L)]
    queries = [torch.randn(256, H, D, generator=g) for _ in range(L)]
    return PressInput(keys, values, queries, D**-0.5)


@pytest.mark.parametrize("name", sorted(PRESSES))
@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.8])
def test_every_press_keeps_sorted_unique_tokens_within_budget(name: str, ratio: float) -> None:
    press = make_press(name, ratio)
    keep = press.select(synthetic())
    assert len(keep) == L
    m = max(1, int(N * (1 - ratio)))  # kvpress's compute_n_kept
    for idx in keep:
        assert idx.shape[0] == KVH and 0 < idx.shape[1] <= N
        assert (idx[:, 1:] > idx[:, :-1]).all(), "indices must be sorted and unique"
        assert idx.min() >= 0 and idx.max() < N
    sizes = [idx.shape[1] for idx in keep]
    if ratio == 0.0:
        assert sizes == [N] * L  # ratio 0 keeps everything
    elif name in ("pyramidkv", "layer_defensivekv"):
        assert abs(sum(sizes) / L - m) <= 2  # budgets move between layers, mean m
    else:
        assert sizes == [m] * L


def test_streaming_llm_keeps_sinks_and_recent() -> None:
    keep = make_press("streaming_llm", 0.5).select(synthetic())
    want = list(range(4)) + list(range(N - 96, N))
    assert keep[0][0].tolist() == want and keep[0][1].tolist() == want


def test_knorm_keeps_the_smallest_key_norms() -> None:
    inp = synthetic()
    inp.keys[0][7, 0] *= 100  # a huge key on head 0 goes first
    keep = make_press("knorm", 0.5).select(inp)
    assert 7 not in keep[0][0].tolist()
    norms = inp.keys[1][:, 1].norm(dim=-1)
    assert set(keep[1][1].tolist()) == set(norms.argsort()[:100].tolist())


def test_window_attention_is_causal_and_normalized() -> None:
    inp = synthetic()
    probs = window_attention(inp.queries[0][-8:], inp.keys[0], inp.scale)  # type: ignore[index]
    assert probs.shape == (H, 8, N)
    assert torch.allclose(probs.sum(-1), torch.ones(H, 8), atol=1e-5)
    for i in range(8):
        assert (probs[:, i, N - 8 + i + 1 :] == 0).all()


def test_snapkv_keeps_its_window_and_what_the_window_reads() -> None:
    inp = synthetic()
    assert inp.queries is not None
    for layer in range(L):  # every window query looks hard at token 50 on every head
        inp.queries[layer][-64:, :, 0] = 2.0
        inp.keys[layer][50, :, 0] = 20.0
    keep = make_press("snapkv", 0.5).select(inp)  # 100 kept: the window's 64 + 36 voted
    for idx in keep:
        assert 50 in idx[0].tolist() and 50 in idx[1].tolist()
        assert set(range(N - 64, N)) <= set(idx[0].tolist())


def test_defensivekv_keeps_a_token_one_query_needs_badly() -> None:
    """Mean aggregation (SnapKV) can drop a token only one window query relies on;
    DefensiveKV's worst-case (max) aggregation keeps it."""
    inp = synthetic(3)
    q = inp.queries[0]
    assert q is not None
    target = 20
    inp.keys[0][target] = 0
    inp.keys[0][target, :, 0] = 40.0  # huge logit for a query with a large first channel
    q[-64:, :, 0] = -1.0
    q[-5, :, 0] = 1.0  # only this one window query attends to the target
    defensive = make_press("defensivekv", 0.8).select(inp)[0]
    snap = make_press("snapkv", 0.8).select(inp)[0]
    assert target in defensive[0].tolist()
    assert target not in snap[0].tolist()


def test_pyramid_budgets_are_kvpress_schedule_with_its_fallback() -> None:
    """kvpress 0.5.5's ``get_layer_budget`` on SmolLM2's 30 layers: at n = 662, ratio 0.5
    the bottom layer's share is capped at n - window (598) and the top keeps its window
    (64); at ratio 0.8 the pyramid's smallest layer would keep fewer than the window, so
    every layer keeps round(662 * 0.2) = 132 (kvpress's SnapKV fallback)."""
    b = pyramid_budgets(662, 0.5, 30, 64, 20)
    assert b == sorted(b, reverse=True) and (b[0], b[-1]) == (598, 64)
    assert b[1] == round(598 - (598 - 64) / 29)
    assert math.isclose(sum(b) / 30, 331, abs_tol=0.5)
    assert pyramid_budgets(662, 0.8, 30, 64, 20) == [132] * 30
    assert pyramid_budgets(400, 0.75, 30, 64, 20) == [100] * 30  # (36 / 20 < 64)
    assert pyramid_budgets(60, 0.5, 30, 64, 20) == [30] * 30  # shorter than the window
    # One layer: kvpress gives layer 0 the bottom budget (steps 0), whatever the mean.
    assert pyramid_budgets(1000, 0.5, 1, 64, 20) == [936]


def test_pyramid_budgets_count_model_layers_when_windows_are_skipped() -> None:
    """On a sliding-window model the press sees the full-attention layers only (layers 0
    and 2 of 3 here); each keeps its *model* layer's budget, as kvpress's
    ``get_layer_budget(module)`` on Gemma 3 (``layer_idx`` of ``num_hidden_layers``)."""
    inp = synthetic(n=662)
    part = PressInput(
        [inp.keys[0], inp.keys[2]], [inp.values[0], inp.values[2]],
        [inp.queries[0], inp.queries[2]] if inp.queries else None, inp.scale,
        layers=(0, 2), total_layers=3,
    )  # fmt: skip
    press = make_press("pyramidkv", 0.5)
    budgets = pyramid_budgets(662, 0.5, 3, press.window, press.BETA)
    kept = press.select(part)
    assert [k.shape[1] for k in kept] == [budgets[0], budgets[2]]
    whole = press.select(inp)
    assert torch.equal(kept[1], whole[2]) and torch.equal(kept[0], whole[0])


def test_bad_press_settings() -> None:
    with pytest.raises(ConfigError, match="unknown kv_press 'zip'"):
        CacheConfig(kv_press="zip", kv_press_ratio=0.5)
    with pytest.raises(ConfigError, match=r"\[0, 1\)"):
        CacheConfig(kv_press="snapkv", kv_press_ratio=1.0)
    with pytest.raises(ConfigError, match="paged layout"):
        CacheConfig(kv_press="snapkv", kv_press_ratio=0.5, kv_layout="contiguous")


# ---------------------------------------------------------------------- engine
TEXT = (
    "A lighthouse keeper wrote in her log every evening: the wind, the ships that passed, "
    "the colour of the sea and the birds on the rocks. "
) * 8
SP = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("default", dtype="float32", num_blocks=48, max_num_seqs=4)


def run(llm: LLM, prompts: list[str], sps: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate(prompts, sps, check_integrity=True)
    eng = llm.engine
    eng.check_integrity()
    assert eng.num_free_blocks == eng.kv_manager.num_blocks  # nothing leaked
    return [o.outputs[0].token_ids for o in outs]


def test_ratio_zero_is_no_press(llm: LLM) -> None:
    plain = run(llm, [TEXT], [SP])
    for name in ("snapkv", "layer_defensivekv"):
        zero = SamplingParams(
            temperature=0.0, max_tokens=16, ignore_eos=True, kv_press=name, kv_press_ratio=0.0
        )
        assert run(llm, [TEXT], [zero]) == plain


def test_reclaimed_blocks_return_to_the_pool_and_the_request_goes_on(llm: LLM) -> None:
    eng = llm.engine
    sp = SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, kv_press="snapkv", kv_press_ratio=0.75
    )
    rid = eng.new_request_id()
    eng.add_request(rid, TEXT, sp)
    before = eng.stats().num_reclaimed_blocks
    first = eng.step()  # prefill + first token, then the press
    assert first and not first[0].finished
    req = eng.scheduler.requests[rid]
    n = len(req.prompt_token_ids)
    kept = n - req.num_dropped
    assert req.press_applied and req.num_dropped == n - int(n * (1 - 0.75))
    held = len(eng.kv_manager.req_blocks[rid])
    assert held == -(-kept // 16)  # only the survivors' blocks are held
    assert eng.stats().num_reclaimed_blocks - before == -(-n // 16) - held
    assert eng.num_free_blocks == eng.kv_manager.num_blocks - held
    eng.check_integrity()
    outs = []
    while eng.has_unfinished_requests():
        outs.extend(eng.step())
        eng.check_integrity()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 40
    assert outs[-1].num_pressed_tokens == n - kept  # the web view's timeline shows it
    # (Its budget, 60 of 241 tokens, is below SnapKV's 64-query window: the text may be
    # only whitespace, but the request decodes on.)
    assert outs[-1].outputs[0].text, "a pressed request must still produce text"


def test_pressed_requests_never_change_unpressed_outputs(llm: LLM) -> None:
    system = "Answer as the lighthouse keeper, briefly. " + TEXT
    qs = ["What did you log today?", "Which birds were on the rocks?", "How was the sea?"]
    prompts = [system + q for q in qs]
    alone = run(llm, prompts[:2], [SP, SP])  # unpressed requests, no pressed neighbour
    # Now with pressed neighbours (sharing the same prefix, so their first blocks are
    # prefix-cache hits), in a pool of 48 blocks where requests are preempted.
    pressed = [
        SamplingParams(
            temperature=0.0, max_tokens=16, ignore_eos=True, kv_press=p, kv_press_ratio=0.8
        )
        for p in ("snapkv", "pyramidkv", "streaming_llm")
    ]
    mixed = run(
        llm,
        [prompts[2], prompts[0], prompts[2], prompts[1], prompts[2]],
        [pressed[0], SP, pressed[1], SP, pressed[2]],
    )
    assert [mixed[1], mixed[3]] == alone
    st = llm.get_stats()
    assert st.num_pressed_requests >= 3 and st.prefix_hit_tokens > 0
    # A later unpressed request reusing the prefix the pressed ones computed is unchanged.
    assert run(llm, [prompts[0]], [SP]) == alone[:1]


def test_press_with_a_codec_and_preemption() -> None:
    tight = LLM(
        "default",
        dtype="float32",
        num_blocks=40,
        max_num_seqs=3,
        kv_cache_dtype="kivi2",
        kv_press="h2o",
        kv_press_ratio=0.5,
    )
    outs = run(tight, [TEXT + " One.", TEXT + " Two.", TEXT + " Three."], [SP, SP, SP])
    assert all(len(o) == 16 for o in outs)
    assert tight.get_stats().num_reclaimed_blocks > 0


def test_a_press_without_free_blocks_is_skipped_and_counted() -> None:
    """The survivors need fresh blocks while the old ones are held: with none free the
    press is skipped, the request decodes on unpressed, and the skip is counted by reason
    (``EngineStats.press_skipped``, ``kvstack:press_skipped_total{reason}``)."""
    from prometheus_client import generate_latest

    from kvstack.serve.metrics.server import ServerMetrics

    tight = LLM("default", dtype="float32", num_blocks=5, max_num_seqs=1)
    ids = tight.tokenizer.encode(TEXT, add_special_tokens=False)[:64]  # 4 blocks, 1 free
    sp = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, kv_press="streaming_llm",
        kv_press_ratio=0.5,
    )  # fmt: skip
    out = tight.generate(prompt_token_ids=[ids], sampling_params=sp, check_integrity=True)
    assert len(out[0].outputs[0].token_ids) == 8
    st = tight.get_stats()
    assert st.num_pressed_requests == 0
    assert st.press_skipped == {"no_free_blocks": 1, "window_incomplete": 0, "error": 0}
    metrics = ServerMetrics("m")
    metrics.update_engine(st, tight.engine.kv_manager.stats())
    text = generate_latest(metrics.registry).decode()
    assert 'kvstack:press_skipped_total{model_name="m",reason="no_free_blocks"} 1.0' in text
    assert 'kvstack:press_skipped_total{model_name="m",reason="error"} 0.0' in text


def test_a_press_missing_window_queries_is_skipped_not_run_on_part(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should the runner ever not capture the whole window, the press does not vote with
    what it has: it is skipped and counted (``window_incomplete``)."""
    from kvstack.kv.press.coordinator import PressCoordinator

    real = PressCoordinator.capture_rows

    def half(req: Any, num_computed: int, num_new: int) -> tuple[int, int] | None:
        span = real(req, num_computed, num_new)
        return None if span is None else (span[0] + (span[1] - span[0]) // 2, span[1])

    monkeypatch.setattr(PressCoordinator, "capture_rows", staticmethod(half))
    before = dict(llm.get_stats().press_skipped)
    sp = replace(SP, kv_press="snapkv", kv_press_ratio=0.5)
    assert len(run(llm, [TEXT], [sp])[0]) == 16
    after = llm.get_stats().press_skipped
    assert after["window_incomplete"] == before["window_incomplete"] + 1
    assert after["no_free_blocks"] == before["no_free_blocks"]


def test_bad_per_request_press_is_rejected(llm: LLM) -> None:
    cases = [
        ({"kv_press": "zip"}, "unknown kv_press"),
        ({"kv_press": "snapkv", "kv_press_ratio": -0.1}, r"\[0, 1\)"),
        ({"kv_press_ratio": 0.5}, "needs a kv_press"),
        ({"kv_press": "snapkv", "kv_press_ratio": 0.5, "kv_press_after": 0}, "at least 1"),
    ]
    for kwargs, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            llm.generate([TEXT], SamplingParams(max_tokens=2, **kwargs))  # type: ignore[arg-type]
    assert llm.engine.num_free_blocks == llm.engine.kv_manager.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("name", ["streaming_llm", "snapkv"])
def test_press_every_holds_the_budget_while_decoding(llm: LLM, name: str) -> None:
    """``kv_press_every=8``: after the prompt's press, the request's KV never grows past
    budget + 8 slots however long it decodes; each re-press returns blocks at once and
    the positions keep counting (the request produces all its tokens). SnapKV scores
    with the queries of the tokens decoded since the last press."""
    eng = llm.engine
    sp = SamplingParams(
        temperature=0.0, max_tokens=48, ignore_eos=True, kv_press=name, kv_press_ratio=0.75,
        kv_press_every=8,
    )  # fmt: skip
    rid = eng.new_request_id()
    eng.add_request(rid, TEXT, sp)
    before = eng.stats()
    eng.step()
    req = eng.scheduler.requests[rid]
    assert req.press is not None
    budget = req.press.budget
    n = len(req.prompt_token_ids)
    assert budget == max(1, int(n * (1 - 0.75))) and req.num_kv_tokens == budget  # kvpress
    peak, outs = 0, []
    while eng.has_unfinished_requests():
        outs.extend(eng.step())
        eng.check_integrity()
        if not req.is_finished():
            peak = max(peak, req.num_kv_tokens)
            assert len(eng.kv_manager.req_blocks[rid]) <= -(-(budget + 8) // 16)
    assert peak <= budget + 8
    after = eng.stats()
    assert after.num_represses - before.num_represses == (48 - 1) // 8  # every 8 tokens
    assert after.num_pressed_requests - before.num_pressed_requests == 1
    # Every token is produced. (No check on what they say: kvpress's SnapKV, which
    # kvstack's SnapKV matches, re-pressed to 25 % every 8 tokens, decodes this prompt into
    # whitespace.)
    assert len(outs[-1].outputs[0].token_ids) == 48 and outs[-1].outputs[0].text
    assert req.num_dropped == req.num_computed_tokens - req.num_kv_tokens
    assert eng.num_free_blocks == eng.kv_manager.num_blocks


def test_press_every_leaves_unpressed_neighbours_alone(llm: LLM) -> None:
    prompts = [TEXT + " What did she log?", TEXT + " Which birds came?"]
    alone = run(llm, prompts, [SP, SP])
    holding = SamplingParams(
        temperature=0.0, max_tokens=32, ignore_eos=True, kv_press="knorm", kv_press_ratio=0.5,
        kv_press_every=4,
    )  # fmt: skip
    mixed = run(llm, [prompts[0], TEXT, prompts[1]], [SP, holding, SP])
    assert [mixed[0], mixed[2]] == alone


def test_bad_press_every_is_rejected(llm: LLM) -> None:
    cases = [
        ({"kv_press": "snapkv", "kv_press_ratio": 0.5, "kv_press_every": 0}, "at least 1"),
        ({"kv_press_every": 8}, "needs a kv_press"),
        ({"kv_press": "pyramidkv", "kv_press_ratio": 0.5, "kv_press_every": 8}, "one budget"),
    ]
    for kwargs, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            llm.generate([TEXT], SamplingParams(max_tokens=2, **kwargs))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs a --kv-press"):
        CacheConfig(kv_press_every=8)
    with pytest.raises(ConfigError, match="one budget"):
        CacheConfig(kv_press="layer_defensivekv", kv_press_ratio=0.5, kv_press_every=8)
    assert llm.engine.num_free_blocks == llm.engine.kv_manager.num_blocks


@pytest.mark.slow
def test_press_coordinator_integrity_through_abort_and_preemption() -> None:
    """The press coordinator holds state exactly for the live pressed requests (none once
    they finish or are aborted; none for a ratio-0 request), resets a preempted request's
    press and applies it again, and never holds more queries than the press's window."""
    tight = LLM(
        "default",
        dtype="float32",
        num_blocks=13,
        max_num_seqs=4,
        kv_press="snapkv",
        kv_press_ratio=0.5,
        kv_press_every=6,
    )
    eng, coord = tight.engine, tight.engine.press
    text = TEXT[: len(TEXT) * 3 // 8]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    rids = [eng.add_request(None, text + s, sp) for s in (" One.", " Two.", " Three.", "")]
    reqs = [eng.scheduler.requests[r] for r in rids]
    victim = eng.add_request(None, text + " Four.", sp)
    unpressed = eng.add_request(None, text, replace(sp, max_tokens=8, kv_press_ratio=0.0))
    assert eng.scheduler.requests[unpressed].press is None
    assert set(coord.states) == {*rids, victim}
    aborted = windows = False
    while eng.has_unfinished_requests():
        eng.step()
        eng.check_integrity()  # includes coord.check_integrity(eng.scheduler.requests)
        st = coord.states.get(victim)
        if not aborted and st is not None and st.applied:
            eng.abort_request(victim)
            aborted = True
            assert victim not in coord.states
            coord.check_integrity(eng.scheduler.requests)
        windows = windows or any(s.window is not None for s in coord.states.values())
    assert aborted and windows and not coord.states
    assert eng.scheduler.num_preemptions_total > 0
    preempted = [r for r in reqs if r.num_preemptions > 0]
    assert preempted and all(r.press is not None and r.press.applied for r in preempted)
    assert all(len(r.output_token_ids) == 24 for r in reqs)
    assert eng.num_free_blocks == eng.kv_manager.num_blocks
    # The check catches state kept for a request that is gone.
    coord.states["ghost"] = PressState(make_press("snapkv", 0.5), point=8)
    with pytest.raises(AssertionError, match="press states"):
        coord.check_integrity(eng.scheduler.requests)


def test_a_pressed_request_with_a_tier_hit_loads_nothing_past_its_cap() -> None:
    """A press caps the prefix a request may adopt (its window's queries must be
    computed). Tier blocks loaded before the press compacts the table are forgotten with
    the old table; when the device hit alone reaches the cap, the tier's offer is dropped
    (nothing written). Tokens equal a run without the tier; no block leaks."""
    kw: dict[str, Any] = {"dtype": "float32", "num_blocks": 48, "max_num_seqs": 2}
    pressed = replace(SP, kv_press="snapkv", kv_press_ratio=0.5)
    plain = LLM("default", **kw)
    ids = plain.tokenizer.encode(TEXT + " Where?")
    want = plain.generate(prompt_token_ids=[ids], sampling_params=pressed)[0].outputs[0].token_ids
    tiered = LLM("default", kv_offload="host:64MiB", **kw)
    connector = tiered.engine.connector
    assert connector is not None

    def tokens(prompt: list[int], sp: SamplingParams) -> list[int]:
        out = tiered.generate(prompt_token_ids=[prompt], sampling_params=sp, check_integrity=True)
        tiered.engine.check_integrity()
        assert tiered.engine.num_free_blocks == tiered.engine.kv_manager.num_blocks
        return list(out[0].outputs[0].token_ids)

    tokens(ids, SP)  # every block goes to the host tier
    assert connector.flush(30)
    tiered.reset_prefix_cache()
    assert tokens(ids, pressed) == want, "tier blocks loaded, then the table pressed"
    tiered.reset_prefix_cache()
    tokens(ids[:-20], SP)  # the device holds all but the tail; the tier has the rest
    loaded = connector.num_loaded_blocks
    assert tokens(ids, pressed) == want, "the device hit reaches the press cap"
    assert connector.num_loaded_blocks == loaded  # the tier's offer was dropped
