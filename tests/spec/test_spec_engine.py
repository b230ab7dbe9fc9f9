"""Speculative decoding in the engine: greedy output token-identical to one-token steps.

Tiny random model in float32 (``kvstack.testing.tiny_models``). ``OracleProposer``
replaces prompt lookup where a test needs drafts of a known quality: it proposes the
reference continuation, cut at a random point and followed by a wrong token, so every
verification outcome (all kept, rejected at each position, empty) occurs. After every
step: ``check_integrity()`` and no block hashed past a request's real tokens.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvstack import LLM
from kvstack.core.errors import ConfigError, InvalidRequestError
from kvstack.core.request import Request, RequestOutput, SamplingParams
from kvstack.core.structured_outputs import StructuredOutputsParams
from kvstack.engine.llm_engine import LLMEngine
from kvstack.kv.codecs.int8 import Int8Codec
from kvstack.kv.codecs.kivi import Kivi2Codec
from kvstack.kv.events import BlockStored
from kvstack.kv.manager import KVCacheManager
from kvstack.spec.config import SpeculativeConfig
from kvstack.spec.speculator import (
    Speculator,
    next_draft_len,
    no_speculation_reason,
    pause_after,
)
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_hf_folder

VOCAB = 320
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_llama_config()
    return write_hf_folder(tmp_path_factory.mktemp("tiny") / "hf", cfg, random_llama_weights(cfg))


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    base = [rng.randrange(3, 259) for _ in range(24)]
    out = [base * 2, base[:10] * 3, [rng.randrange(3, 259) for _ in range(150)]]
    out += [base * 2 + [7, 8, 9], [rng.randrange(3, 259) for _ in range(17)]]
    return out


class OracleProposer:
    """Drafts from known greedy continuations: a correct prefix of random length, then
    (mostly) a wrong token; records what it proposed."""

    def __init__(self, prompts: Sequence[list[int]], outputs: Sequence[list[int]]) -> None:
        self.refs = [(list(p), list(o)) for p, o in zip(prompts, outputs, strict=True)]
        self.rng = random.Random(11)
        self.num_proposed = 0

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        ids = list(token_ids)
        for prompt, out in self.refs:
            if ids[: len(prompt)] == prompt and ids[len(prompt) :] == out[: len(ids) - len(prompt)]:
                pos = len(ids) - len(prompt)
                true = out[pos : pos + k]
                cut = self.rng.randint(0, len(true))
                draft = true[:cut]
                if cut < k and self.rng.random() < 0.8:
                    draft.append((out[pos + cut] + 1) % VOCAB if pos + cut < len(out) else 5)
                self.num_proposed += bool(draft)
                return draft[:k]
        return []


def llm(model_dir: Path, spec: dict[str, object] | None, **opts: object) -> LLM:
    opts = {"num_blocks": 128, **opts}  # (the default 2 GiB pool costs seconds to allocate)
    return LLM(str(model_dir), dtype="float32", seed=0, speculative_config=spec, **opts)


def reference(model_dir: Path, ps: list[list[int]], sps: list[SamplingParams]) -> list[list[int]]:
    """Each prompt alone, one token per step (no speculation)."""
    plain = llm(model_dir, None, num_blocks=256)
    return [plain.generate(prompt_token_ids=[p], sampling_params=sp)[0].outputs[0].token_ids
            for p, sp in zip(ps, sps, strict=True)]  # fmt: skip


def check_hashes(eng: LLMEngine) -> None:
    """Every hashed block of a running request covers real tokens only, with their hash."""
    kv = eng.kv_manager
    assert isinstance(kv, KVCacheManager)
    for rid, blocks in kv.req_blocks.items():
        req = eng.scheduler.requests[rid]
        hashes = kv.block_hashes(req)
        for i, b in enumerate(blocks):
            if b.block_hash is not None:
                assert i < req.num_tokens // kv.block_size, f"{rid}: block {i} hashed early"
                assert b.block_hash == hashes[i]


def run(
    eng: LLMEngine, ps: list[list[int]], sps: list[SamplingParams], stagger: int = 0
) -> list[list[int]]:
    """Add the prompts (``stagger`` steps apart) and step to the end, checking each step."""
    pending = list(enumerate(zip(ps, sps, strict=True)))
    done: dict[str, RequestOutput] = {}
    step = 0
    while pending or eng.has_unfinished_requests():
        idle = not eng.has_unfinished_requests()
        if pending and (not stagger or step % stagger == 0 or idle):
            batch = pending[:1] if stagger else list(pending)
            del pending[: len(batch)]
            for i, (p, sp) in batch:
                eng.add_request(f"q{i}", None, sp, prompt_token_ids=p)
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        eng.check_integrity()
        check_hashes(eng)
        step += 1
    assert eng.num_free_blocks == eng.kv_manager.num_blocks, "KV blocks leaked"
    return [done[f"q{i}"].outputs[0].token_ids for i in range(len(ps))]


def stored_tokens_are_real(eng: LLMEngine, seqs: list[list[int]]) -> None:
    """Every BlockStored event holds tokens that some final sequence has at that place."""
    bs = eng.kv_manager.block_size
    for ev in eng.kv_events.drain().events:
        if isinstance(ev, BlockStored):
            toks = ev.token_ids
            assert any(
                seq[j : j + len(toks)] == toks for seq in seqs for j in range(0, len(seq), bs)
            ), "an unverified token was published"


def test_greedy_is_identical_under_batching_chunking_and_prefix_hits(model_dir: Path) -> None:
    ps = prompts()
    # A penalized request never speculates; it shares the steps of the others.
    penalized = SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3
    )
    sps = [GREEDY, GREEDY, GREEDY, penalized, GREEDY]
    want = reference(model_dir, ps, sps)
    spec = llm(model_dir, NGRAM, num_blocks=256, max_num_batched_tokens=64, block_size=8)
    eng = spec.engine
    oracle = OracleProposer(ps, want)
    assert eng.speculator is not None
    eng.speculator.proposer = oracle
    got = run(eng, ps, sps, stagger=3)
    assert got == want
    again = run(eng, ps, sps)  # all at once; prompts now hit the prefix cache
    assert again == want
    stats = eng.stats()
    assert stats.prefix_hit_tokens > 0
    sd = stats.spec_decode
    assert sd["num_drafts"] > 20 and 0 < sd["num_accepted_tokens"] < sd["num_draft_tokens"]
    stored_tokens_are_real(eng, [p + o for p, o in zip(ps, want, strict=True)])


def test_greedy_is_identical_with_ngram_and_preemption(model_dir: Path) -> None:
    ps = prompts()
    sps = [GREEDY] * len(ps)
    want = reference(model_dir, ps, sps)
    # 30 blocks of 8 tokens cannot hold all five requests: the newest are preempted.
    eng = llm(model_dir, NGRAM, num_blocks=30, block_size=8, max_num_seqs=5).engine
    got = run(eng, ps, sps)
    assert got == want
    assert eng.scheduler.num_preemptions_total > 0
    assert eng.stats().spec_decode["num_drafts"] > 0


def test_stops_inside_an_accepted_run_end_where_plain_decoding_does(model_dir: Path) -> None:
    ps = prompts()[:1]
    plain_llm = llm(model_dir, None)
    full = plain_llm.generate(prompt_token_ids=ps, sampling_params=GREEDY)[0].outputs[0].token_ids
    # With 5-token drafts always right, the steps after the prefill append outputs
    # 1..6, 7..12, ...: a stop at output 9 or 10 lies inside the second accepted run.
    first = next((i for i in (9, 10) if full[i] not in full[:i]), 9)
    stop_text = plain_llm.tokenizer.decode(full[first - 1 : first + 1])
    cases = [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[full[first]]),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop_text]),
    ]
    spec = llm(model_dir, {**NGRAM, "num_speculative_tokens": 5})
    eng = spec.engine
    assert eng.speculator is not None
    oracle = OracleProposer(ps, [full])  # always the whole true continuation:
    oracle.rng.random = lambda: 1.0  # type: ignore[method-assign]
    oracle.rng.randint = lambda a, b: b  # type: ignore[method-assign]
    eng.speculator.proposer = oracle
    for sp in cases:
        plain = plain_llm.generate(prompt_token_ids=ps, sampling_params=sp)[0].outputs[0]
        before = eng.stats().spec_decode["num_accepted_tokens"]
        out = spec.generate(prompt_token_ids=ps, sampling_params=sp)[0].outputs[0]
        assert out.token_ids == plain.token_ids, sp
        assert (out.text, out.finish_reason) == (plain.text, plain.finish_reason)
        assert len(out.token_ids) <= 11  # it stopped inside the second run
        assert eng.stats().spec_decode["num_accepted_tokens"] >= before + 5
        eng.check_integrity()
        assert eng.num_free_blocks == eng.kv_manager.num_blocks


def test_greedy_is_identical_with_a_kv_codec_and_logprobs(model_dir: Path) -> None:
    """A per-token codec (int8) rolls back; a request asking for logprobs decodes one
    token per step (no drafts) with its logprobs, next to speculating ones."""
    ps = prompts()[:3]
    lp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    sps = [GREEDY, lp, GREEDY]
    plain = llm(model_dir, None, kv_cache_dtype="int8", num_blocks=256)
    want = [plain.generate(prompt_token_ids=[p], sampling_params=sp)[0].outputs[0]
            for p, sp in zip(ps, sps, strict=True)]  # fmt: skip
    spec = llm(model_dir, NGRAM, kv_cache_dtype="int8", num_blocks=256)
    got = spec.generate(prompt_token_ids=ps, sampling_params=sps)
    assert [o.outputs[0].token_ids for o in got] == [w.token_ids for w in want]
    assert got[1].outputs[0].logprobs is not None and want[1].logprobs is not None
    assert len(got[1].outputs[0].logprobs) == 20
    assert [sorted(d) for d in got[1].outputs[0].logprobs] == [sorted(d) for d in want[1].logprobs]
    assert spec.engine.stats().spec_decode["num_drafts"] > 0
    spec.engine.check_integrity()


def test_who_speculates() -> None:
    def reason(**kw: object) -> str | None:
        sp = SamplingParams(**kw)  # type: ignore[arg-type]
        return no_speculation_reason(Request("r", [1, 2], sp))

    assert reason() is None
    assert reason(temperature=0.7, top_k=5, seed=1, logit_bias={3: 1.0}) is None
    assert reason(allowed_token_ids=[3, 4]) is None
    assert reason(logprobs=0) == "logprobs"
    assert reason(repetition_penalty=1.1) == reason(presence_penalty=0.5) == "penalties"
    assert reason(min_tokens=3) == "min_tokens"
    so = StructuredOutputsParams(regex="[ab]+")
    assert reason(structured_outputs=so) == "structured_outputs"
    sp = SamplingParams(bad_words=["x"])
    sp.bad_words_token_ids = [[5]]
    assert no_speculation_reason(Request("r", [1], sp)) == "bad_words"


def expected_counts(k: int, max_tokens: int, correct: bool) -> dict[str, object]:
    """vLLM's counters (and the engine's steps) for one greedy request whose drafts are
    always the true continuation (``correct``) or always wrong; the draft length follows
    ``next_draft_len``, and repeated misses pause proposals (``pause_after``)."""
    drafts = draft_tokens = accepted = 0
    per_pos = [0] * k
    steps = 1  # the prefill samples the first token
    left, length, misses, pause = max_tokens - 1, k, 0, 0
    while left > 0:
        steps += 1
        d = 0 if pause else min(length, left - 1)  # the scheduler leaves room for the bonus
        pause = max(0, pause - 1)
        a = d if correct else 0
        if d > 0:
            drafts, draft_tokens, accepted = drafts + 1, draft_tokens + d, accepted + a
            for i in range(a):
                per_pos[i] += 1
            length = next_draft_len(d, a, k)
            misses = 0 if a else misses + 1
            pause = pause_after(misses)
        left -= a + 1
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "accepted_per_pos": per_pos,
        "steps": steps,
    }


class FixedProposer:
    def __init__(self, prompt: list[int], out: list[int], correct: bool) -> None:
        self.prompt, self.out, self.correct = prompt, out, correct

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        pos = len(token_ids) - len(self.prompt)
        true = self.out[pos : pos + k]
        return true if self.correct else [(t + 1) % VOCAB for t in true]


@pytest.mark.parametrize("correct", [True, False])
def test_counters_follow_vllms_definitions(model_dir: Path, correct: bool) -> None:
    ps = prompts()[:1]
    sp = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)
    full = reference(model_dir, ps, [sp])[0]
    k = 3
    spec = llm(model_dir, {**NGRAM, "num_speculative_tokens": k})
    eng = spec.engine
    assert eng.speculator is not None
    eng.speculator.proposer = FixedProposer(ps[0], full, correct)
    out = spec.generate(prompt_token_ids=ps, sampling_params=sp)[0]
    assert out.outputs[0].token_ids == full
    sd = eng.stats().spec_decode
    want = expected_counts(k, 23, correct)
    assert eng.num_steps == want.pop("steps")
    assert {key: sd[key] for key in want} == want
    assert sd["acceptance_rate"] == (1.0 if correct else 0.0)


def test_seeded_sampling_gives_the_tokens_of_plain_decoding(model_dir: Path) -> None:
    """One race per row with the sampler's own noise: a seeded request samples exactly
    what it samples without speculation, alone or in a batch of unseeded ones."""
    ps = prompts()
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=30, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    want = reference(model_dir, ps[:1], [sp])[0]
    eng = llm(model_dir, NGRAM, num_blocks=256).engine
    assert eng.speculator is not None
    # Drafts of the tokens plain decoding sampled, cut short or with a wrong token.
    eng.speculator.proposer = OracleProposer(ps[:1], [want])
    got = run(eng, ps, [sp, other, other, other, other], stagger=2)
    assert got[0] == want
    sd = eng.stats().spec_decode
    assert 0 < sd["num_accepted_tokens"] < sd["num_draft_tokens"]


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({"max_num_batched_tokens": 4}, "num_speculative_tokens=4 needs 5 rows"),
        ({"max_model_len": 5, "block_size": 4}, "num_speculative_tokens=4 needs 5 rows"),
        ({"kv_press": "knorm", "kv_press_ratio": 0.5, "kv_press_every": 8}, "kv-press-every"),
    ],
)
def test_engines_that_cannot_roll_back_are_refused(
    model_dir: Path, opts: dict[str, object], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        llm(model_dir, NGRAM, **opts)


def test_a_codec_that_cannot_roll_back_is_refused() -> None:
    # kivi2 needs head_dim % 32 == 0 (the tiny model has 16): the check itself, then.
    assert Kivi2Codec.rolls_back is False and Int8Codec.rolls_back is True
    with pytest.raises(ConfigError, match="kivi2: the codec encodes a block once it fills"):
        Speculator.check_engine(SpeculativeConfig("ngram", 4), 2048, 512, 999, "kivi2", False, None)


def test_a_repressing_request_is_a_400_and_nothing_leaks(model_dir: Path) -> None:
    eng = llm(model_dir, NGRAM, kv_press="knorm", kv_press_ratio=0.5).engine
    sp = SamplingParams(temperature=0.0, max_tokens=8, kv_press_every=4)
    with pytest.raises(InvalidRequestError, match="kv_press_every"):
        eng.add_request("bad", None, sp, prompt_token_ids=prompts()[0])
    # A press that runs once, after the prompt, can roll back: drafts start after it.
    pressed = run(eng, prompts()[:2], [GREEDY, GREEDY])
    assert all(len(o) == 40 for o in pressed)
    stats = eng.stats()
    assert stats.num_pressed_requests == 2 and stats.spec_decode["num_drafts"] > 0
