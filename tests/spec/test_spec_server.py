"""Speculation through the server and the CLI: vLLM's spec_decode families in /metrics,
a 400 for a request that cannot speculate, one-line CLI errors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvstack.cli import main
from kvstack.config.engine import EngineConfig
from kvstack.serve.server import ServerOptions, build_server
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_hf_folder

K = 3


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    cfg = tiny_llama_config()
    d = write_hf_folder(tmp_path_factory.mktemp("tiny") / "hf", cfg, random_llama_weights(cfg))
    engine = EngineConfig.from_options(
        model=str(d), dtype="float32", num_blocks=64, max_model_len=256, kv_press="knorm",
        speculative_config=f'{{"method": "ngram", "num_speculative_tokens": {K}, '
        '"prompt_lookup_min": 1, "prompt_lookup_max": 3}',
    )  # fmt: skip
    llm, _, app, _ = build_server(engine, ServerOptions(served_model_name="tiny"))
    prompt = [5, 6, 7, 8, 9] * 8
    with TestClient(app) as c:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0}
        ok = c.post("/v1/completions", json=body)
        bad = c.post("/v1/completions", json={**body, "kv_press_every": 4})
        text = c.get("/metrics").text
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == llm.engine.kv_manager.num_blocks
    yield {
        "ok": ok,
        "bad": bad,
        "families": {f.name: f for f in text_string_to_metric_families(text)},
        "stats": llm.engine.stats().spec_decode,
    }


def test_spec_decode_families_are_vllms(served: dict[str, Any]) -> None:
    assert served["ok"].status_code == 200, served["ok"].text
    fams, stats = served["families"], served["stats"]
    assert stats["num_drafts"] > 0
    for name, key in (
        ("vllm:spec_decode_num_drafts", "num_drafts"),
        ("vllm:spec_decode_num_draft_tokens", "num_draft_tokens"),
        ("vllm:spec_decode_num_accepted_tokens", "num_accepted_tokens"),
    ):
        fam = fams[name]
        assert fam.type == "counter"
        (sample,) = [s for s in fam.samples if s.name == name + "_total"]
        assert sample.labels == {"model_name": "tiny", "engine": "0"}
        assert sample.value == stats[key]
    per_pos = fams["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos.type == "counter"
    samples = [s for s in per_pos.samples if s.name.endswith("_total")]
    assert [s.labels["position"] for s in samples] == [str(i) for i in range(K)]
    assert all(s.labels["model_name"] == "tiny" and s.labels["engine"] == "0" for s in samples)
    assert [s.value for s in samples] == stats["accepted_per_pos"]
    assert sum(s.value for s in samples) == stats["num_accepted_tokens"]


def test_a_request_that_cannot_speculate_is_a_400(served: dict[str, Any]) -> None:
    bad = served["bad"]
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert "kv_press_every" in err["message"] and "speculative" in err["message"]
    assert err["type"] == "BadRequestError"


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 0}', "positive integer"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', '"model" names the draft'),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "unknown speculative method"),
        ("{oops", "not valid JSON"),
    ],
)
def test_cli_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], value: str, needle: str
) -> None:
    for command in ("generate", "serve"):
        argv = [command, "--speculative-config", value]
        code = main([*argv, "hi"] if command == "generate" else argv)
        err = capsys.readouterr().err
        assert code == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvstack: error:") and needle in lines[0]
