"""``kvstack serve --request-log FILE``: one JSON line per finished request.

The lines are what ``kvstack analyze`` replays (prompt token ids, cached tokens, TTFT),
appended and flushed as each request finishes, from the engine thread only.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kvstack.core.request import RequestOutput
from kvstack.serve.output_stream import RequestInfo

logger = logging.getLogger("kvstack.serve")


class RequestLog:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, out: RequestOutput, info: RequestInfo, now: float, reason: str | None) -> None:
        record: dict[str, Any] = {
            "timestamp": info.arrival_wall,
            "request_id": out.request_id,
            "endpoint": info.endpoint,
            "session_id": info.session_id,
            "prompt_token_ids": out.prompt_token_ids,
            "num_prompt_tokens": len(out.prompt_token_ids),
            "num_cached_tokens": out.num_cached_tokens,
            "num_segment_tokens": out.num_segment_tokens,
            "segments": out.segments,
            "num_output_tokens": info.num_tokens,
            "ttft_s": None if info.first_token is None else info.first_token - info.arrival,
            "e2e_s": now - info.arrival,
            "finish_reason": reason,
        }
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file; a final flush that fails (a full disk) is logged, not raised."""
        try:
            self._file.close()
        except OSError as e:
            logger.warning("request log: closing failed: %s", e)
