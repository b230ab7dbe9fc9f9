"""Structured outputs offline: grammar masks in the vectorized sampler (agents' output constraints).

A tiny random model (byte-level tokenizer, so every string is reachable) keeps these fast;
the default model's outputs are checked in ``tests/serve/test_tools.py``. Every output is
validated against its constraint; constrained runs are batch-, chunk- and
preemption-invariant in fp32, and the engine's integrity check covers the matchers.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from kvstack import LLM, SamplingParams
from kvstack.core.errors import InvalidRequestError
from kvstack.core.structured_outputs import MAX_SPEC_BYTES, SpecTooLargeError, closed_objects
from kvstack.core.structured_outputs import StructuredOutputsParams as SO
from kvstack.model.structured.bitmask import StepMask, allocate_bitmask, apply_bitmask
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tier": {"enum": ["free", "pro", "enterprise"]},
    },
    "required": ["name", "age", "tier"],
}
PROMPTS = ["Customer:", "Give me JSON", "A profile of Ann", "x"]
OPTS: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "num_blocks": 96}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    cfg = tiny_llama_config()
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_gguf(path, cfg, random_llama_weights(cfg, seed=3))
    return str(path)


@pytest.fixture(scope="module")
def llm(model_path: str) -> LLM:
    return LLM(model_path, **OPTS)


def greedy(so: SO | None, **kw: Any) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=kw.pop("max_tokens", 96), structured_outputs=so, **kw
    )


def texts(llm: LLM, prompts: list[str], sp: SamplingParams) -> list[str]:
    outs = llm.generate(prompts, sp, check_integrity=True)
    assert llm.engine.structured.num_requests == 0, "grammar state outlived its requests"
    return [c.text for o in outs for c in o.outputs]


def test_bitmask_kernel_matches_reference(llm: LLM) -> None:
    gen = torch.Generator().manual_seed(0)
    for vocab in (320, 49152, 49153):
        logits = torch.randn(6, vocab, generator=gen)
        bits = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=gen)
        bits = bits.to(torch.int32)
        bits[1] = -1  # an all-allowed row
        rows = torch.tensor([4, 0, 2])
        ref, got = logits.clone(), logits.clone()
        apply_bitmask(ref, rows, bits)
        StepMask(rows, bits).apply(got)
        assert torch.equal(ref, got)
        allowed = (bits[0, 5] >> 3) & 1
        assert (ref[4, 5 * 32 + 3] == logits[4, 5 * 32 + 3]) == bool(allowed)
        assert torch.equal(ref[[1, 3, 5]], logits[[1, 3, 5]])  # rows without a mask
    assert torch.equal(allocate_bitmask(2, 40), torch.full((2, 2), -1, dtype=torch.int32))


def test_json_schema_outputs_validate(llm: LLM) -> None:
    for ws in (True, False):
        so = SO(json=SCHEMA, disable_any_whitespace=ws)
        outs = llm.generate(PROMPTS, greedy(so, max_tokens=120), check_integrity=True)
        for c in (o.outputs[0] for o in outs):
            if not ws and c.finish_reason == "length":
                continue  # flexible whitespace: a random model may pad until max_tokens
            assert c.finish_reason == "stop", c.text
            value = json.loads(c.text)
            jsonschema.validate(value, SCHEMA)
            assert set(value) == {"name", "age", "tier"}  # objects closed (closed_objects)
            if ws:
                assert " " not in c.text.replace(value["name"], "")
    obj = SO(json_object=True, disable_any_whitespace=True)
    for out in llm.generate(PROMPTS[:2], greedy(obj, max_tokens=64), check_integrity=True):
        c = out.outputs[0]  # a random model's strings may run to max_tokens
        assert c.text.startswith("{") and (c.finish_reason == "length" or json.loads(c.text))


def test_regex_choice_and_grammars(llm: LLM) -> None:
    for text in texts(llm, PROMPTS, greedy(SO(regex=r"[a-z]{2,5}-[0-9]{3}"))):
        assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", text), text
    choices = ["red", "green", "blue light"]
    assert set(texts(llm, PROMPTS, greedy(SO(choice=choices)))) <= set(choices)
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/\n'
    gbnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9] [0-9]? [0-9]?\n'
    for grammar in (lark, gbnf):
        for text in texts(llm, PROMPTS, greedy(SO(grammar=grammar), max_tokens=40)):
            assert re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", text) or len(text) >= 39, text


def test_constrained_rows_are_batch_chunk_and_preemption_invariant(
    llm: LLM, model_path: str
) -> None:
    so = SO(json=SCHEMA, disable_any_whitespace=True)
    sp = greedy(so, max_tokens=48)
    alone = [texts(llm, [p], sp)[0] for p in PROMPTS]
    plain = texts(llm, PROMPTS, greedy(None, max_tokens=24))
    mixed = llm.generate(
        PROMPTS + PROMPTS, [sp] * 4 + [greedy(None, max_tokens=24)] * 4, check_integrity=True
    )
    assert [o.outputs[0].text for o in mixed[:4]] == alone
    assert [o.outputs[0].text for o in mixed[4:]] == plain  # batch mates are untouched
    # 80 tokens of KV: each request fits alone, the four together do not (preemptions).
    opts = {**OPTS, "num_blocks": 20, "block_size": 4, "max_num_batched_tokens": 8}
    opts["max_model_len"] = 80
    small = LLM(model_path, **opts)
    assert texts(small, PROMPTS, sp) == alone
    assert small.engine.scheduler.num_preemptions_total > 0, "the test expected preemptions"
    assert small.engine.num_free_blocks == small.engine.kv_manager.num_blocks


def test_n_seeds_logprobs_and_length(llm: LLM) -> None:
    so = SO(choice=["alpha", "beta", "gamma"])
    sp = SamplingParams(
        temperature=1.0, n=4, seed=7, max_tokens=8, logprobs=3, structured_outputs=so
    )
    out = llm.generate(["Pick:"], sp, check_integrity=True)[0]
    for c in out.outputs:
        assert c.text in {"alpha", "beta", "gamma"} and c.finish_reason == "stop"
        assert c.logprobs is not None
        for tid, lps in zip(c.token_ids, c.logprobs, strict=True):
            assert lps[tid].logprob > float("-inf")
            for lp in lps.values():  # top tokens: only those the grammar allowed are finite
                assert lp.logprob <= 0.0
    cut = llm.generate(["Customer:"], greedy(SO(json=SCHEMA), max_tokens=3))[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3
    assert llm.engine.structured.num_requests == 0


@pytest.mark.parametrize(
    ("so", "message"),
    [
        (SO(regex="(unclosed"), "invalid regex"),
        (SO(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "invalid json"),
        (SO(json="{not json"), "not valid JSON"),
        (SO(grammar="start: undefined_rule"), "invalid grammar"),
        (SO(choice=[]), "non-empty list"),
        (SO(regex="a", choice=["b"]), "exactly one"),
        (SO(), "exactly one"),
    ],
)
def test_bad_constraints_are_rejected_before_queueing(llm: LLM, so: SO, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as e:
        llm.generate(["x"], greedy(so))
    assert e.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_blocks == llm.engine.kv_manager.num_blocks


def test_huge_constraints_are_bounded(llm: LLM) -> None:
    with pytest.raises(SpecTooLargeError):
        llm.generate(["x"], greedy(SO(regex="a" * (MAX_SPEC_BYTES + 1))))
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(300):  # compiles within the parser limits or is refused, never hangs
        deep = {"type": "array", "items": deep}
    try:
        llm.generate(["x"], greedy(SO(json=deep), max_tokens=4))
    except InvalidRequestError as e:
        assert e.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()


def test_grammars_are_cached_by_constraint(llm: LLM) -> None:
    mgr = llm.engine.structured
    before = mgr.num_compiled
    for _ in range(3):
        texts(llm, ["x"], greedy(SO(regex=r"cache-[0-9]"), max_tokens=8))
    assert mgr.num_compiled == before + 1 and mgr.num_cache_hits >= 2


def test_closed_objects_follows_xgrammar_strict_mode() -> None:
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"x": {}}}},
        "$defs": {"d": {"properties": {"y": {}}, "additionalProperties": True}},
        "anyOf": [{"properties": {"z": {}}}],
    }
    got = closed_objects(schema)
    assert got["additionalProperties"] is False
    assert got["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in got["properties"]  # a name map, not a schema
    assert got["$defs"]["d"]["additionalProperties"] is True  # stated: kept
    assert got["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # input unchanged
    assert closed_objects({"type": "object"}) == {"type": "object"}  # json_object stays open


def test_constraints_on_the_pytorch_path_in_float32(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # float32 logits need no copy, so the sampler got the forward's inference tensor and
    # the PyTorch mask's in-place write raised "Inplace update to inference tensor
    # outside InferenceMode": the step failed (the C++ kernel path did not).
    monkeypatch.setenv("KVSTACK_NO_KERNELS", "1")
    want = r"[a-z]{2,5}-[0-9]{3}"
    so = SO(regex=want)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=1, max_tokens=16,
                             structured_outputs=so)  # fmt: skip
    for sp in (greedy(so), sampled):
        for c in (o.outputs[0] for o in llm.generate(PROMPTS, sp, check_integrity=True)):
            assert c.finish_reason == "stop" and re.fullmatch(want, c.text), c
