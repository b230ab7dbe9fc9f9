"""The engine loop survives faults outside the model (a request-log write error)."""

from __future__ import annotations

import errno
import io
from pathlib import Path

from fastapi.testclient import TestClient

from kvstack import LLM
from kvstack.serve.api.app import ServerConfig, create_app
from kvstack.serve.async_engine import AsyncEngine
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf


class FullDisk(io.StringIO):
    """A log file on a full disk: every write, flush and close fails with ENOSPC."""

    def write(self, s: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failing_request_log_loses_no_output(tmp_path: Path) -> None:
    cfg = tiny_llama_config()
    write_gguf(tmp_path / "t.gguf", cfg, random_llama_weights(cfg))
    llm = LLM(str(tmp_path / "t.gguf"), dtype="float32", num_blocks=32)
    engine = AsyncEngine(llm.engine, request_log=str(tmp_path / "requests.jsonl"))
    assert engine._request_log is not None
    engine._request_log._file.close()
    engine._request_log._file = FullDisk()
    with TestClient(create_app(engine, ServerConfig(model_name="tiny"))) as client:
        for _ in range(3):  # each write fails; every request still completes
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"]
        body = {"prompt": "hi", "max_tokens": 3, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as s:
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert client.get("/health").status_code == 200
    assert engine.num_log_errors == 4
    assert llm.engine.num_free_blocks == llm.engine.kv_manager.num_blocks
