"""The agent-loop workload's tool pool: 16 realistic OpenAI function schemas.

The pool is data (``kvstack/tools/data/agent_tools.json``): each tool is an OpenAI
``tools`` entry in the style of OpenAI's strict function calling
(``additionalProperties: false``, enums, bounded integers, patterns, bounded strings),
three example tasks a user could ask for it (the text of a user turn and the arguments an
ideal model would call it with: the scripted calls of the JSONL form of the workload) and
the fields its synthetic results carry. The tools: get_weather, search_docs, run_sql,
send_email, create_calendar_event, get_stock_price, translate_text, book_flight,
get_order_status, create_ticket, read_file, web_search, convert_currency, get_directions,
set_reminder, lookup_customer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any


@dataclass(frozen=True)
class PoolTool:
    """One tool of :data:`TOOL_POOL`."""

    schema: dict[str, Any]  # {"type": "function", "function": {name, description, parameters}}
    examples: tuple[tuple[str, dict[str, Any]], ...]  # (user request, ideal arguments)
    result_fields: tuple[str, ...]  # keys of its synthetic result, besides "status"

    @property
    def name(self) -> str:
        return str(self.schema["function"]["name"])

    @property
    def parameters(self) -> dict[str, Any]:
        return dict(self.schema["function"]["parameters"])


def load_pool() -> tuple[PoolTool, ...]:
    """The tools of ``data/agent_tools.json``, in file order."""
    path = resources.files("kvstack.tools").joinpath("data", "agent_tools.json")
    rows = json.loads(path.read_text(encoding="utf-8"))["tools"]
    return tuple(
        PoolTool(
            {"type": "function", "function": row["function"]},
            tuple((ex["user"], ex["arguments"]) for ex in row["examples"]),
            tuple(row["result_fields"]),
        )
        for row in rows
    )


TOOL_POOL: tuple[PoolTool, ...] = load_pool()
POOL_SIZE = len(TOOL_POOL)
