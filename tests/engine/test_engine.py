"""Engine API, sampling features and bad input on the real default model (bf16)."""

from __future__ import annotations

import pytest

from kvstack import LLM, SamplingParams
from kvstack.core.errors import InvalidRequestError
from kvstack.core.request import RequestStatus


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("default", dtype="bfloat16", max_num_seqs=8, max_model_len=512)


def assert_clean(llm: LLM) -> None:
    eng = llm.engine
    eng.check_integrity()
    assert not eng.has_unfinished_requests()
    assert eng.num_free_blocks == eng.kv_manager.num_blocks, "KV blocks leaked"


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", SamplingParams(), "empty"),
        ("hi", SamplingParams(max_tokens=0), "max_tokens"),
        ("hi", SamplingParams(max_tokens=-3), "max_tokens"),
        ("hi", SamplingParams(temperature=-0.5), "temperature"),
        ("hi", SamplingParams(top_p=0.0), "top_p"),
        ("hi", SamplingParams(top_p=1.5), "top_p"),
        ("hi", SamplingParams(n=0), "n must"),
        ("hi", SamplingParams(logit_bias={10**9: 1.0}), "logit_bias"),
        ("word " * 600, SamplingParams(), "context length"),
        ("hi", SamplingParams(max_tokens=10_000), "max_model_len"),
    ],
)
def test_bad_input_is_rejected_and_engine_survives(
    llm: LLM, prompt: str, params: SamplingParams, match: str
) -> None:
    eng = llm.engine
    ok = eng.add_request("ok", "Hello", SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(InvalidRequestError, match=match):
        eng.add_request("bad", prompt, params)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
        eng.check_integrity()
    assert [o.request_id for o in outs if o.finished] == [ok]
    assert_clean(llm)


def test_bad_token_ids(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate(prompt_token_ids=[[1, 2, 10**7]])
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate(prompt_token_ids=[[1, -1]])
    assert_clean(llm)


def test_one_bad_prompt_in_a_batch_queues_nothing(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", "", "also fine"], SamplingParams(max_tokens=2))
    assert_clean(llm)


def test_abort_frees_blocks_and_others_finish(llm: LLM) -> None:
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    a = eng.add_request(None, "Tell me a story about a dragon.", sp)
    b = eng.add_request(None, "List three colours.", sp)
    for _ in range(3):
        eng.step()
    assert eng.num_free_blocks < eng.kv_manager.num_blocks
    eng.abort_request(a)
    eng.check_integrity()
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = o
    assert b in done and done[b].finished and len(done[b].outputs[0].token_ids) == 20
    assert a not in done
    assert_clean(llm)


def test_stop_string_and_finish_reasons(llm: LLM) -> None:
    base = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=24))
    text = base[0].outputs[0].text
    assert base[0].outputs[0].finish_reason in ("length", "stop")
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    )[0].outputs[0]
    assert stop not in out.text
    assert text.startswith(out.text)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    incl = llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert incl.text.endswith(stop)
    assert_clean(llm)


def test_seeded_sampling_is_reproducible_and_n(llm: LLM) -> None:
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, n=3)
    first = llm.generate("Write a word:", sp)[0]
    assert len(first.outputs) == 3
    # The same seeded request alone, and inside a batch with other requests.
    again = llm.generate(
        ["Another prompt", "Write a word:"], [SamplingParams(temperature=1.0, max_tokens=5), sp]
    )[1]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1, "children should differ"
    assert_clean(llm)


def test_logprobs_and_prompt_logprobs(llm: LLM) -> None:
    sp = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2)
    out = llm.generate("The sky is", sp)[0]
    comp = out.outputs[0]
    assert comp.logprobs is not None and len(comp.logprobs) == 5
    for tok, lp in zip(comp.token_ids, comp.logprobs, strict=True):
        assert tok in lp and lp[tok].rank == 1  # greedy picks the top token
        assert len(lp) >= 3
    assert comp.cumulative_logprob is not None and comp.cumulative_logprob <= 0
    assert out.prompt_logprobs is not None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None
    for tok, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert lp is not None and tok in lp
    assert_clean(llm)


def test_chat_and_eos(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=64)
    )
    comp = out[0].outputs[0]
    assert comp.text.strip()
    if comp.finish_reason == "stop":
        assert comp.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert_clean(llm)


def test_abort_status_visible(llm: LLM) -> None:
    eng = llm.engine
    rid = eng.add_request(None, "Count to ten:", SamplingParams(max_tokens=50))
    req = eng.scheduler.requests[rid]
    eng.step()
    eng.abort_request(rid)
    assert req.status == RequestStatus.FINISHED_ABORTED
    assert_clean(llm)


def test_colliding_child_id_is_rejected_whole(llm: LLM) -> None:
    eng = llm.engine
    eng.add_request("x#1", "Hello", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request("x", "Hello", SamplingParams(max_tokens=2, n=2))
    assert "x#0" not in eng.scheduler.requests
    eng.abort_request("x#1")
    assert_clean(llm)
