"""Qwen3's reasoning format (vLLM's ``qwen3`` parser).

A thinking Qwen3 output opens with ``<think>`` and closes it with ``</think>\\n\\n`` before
the answer; with ``enable_thinking: false`` the template writes an empty think block into
the prompt and the output is plain content. Qwen3's template drops the reasoning of
assistant turns before the last user message when it renders history
(``serve/reasoning_history.py`` measures what that costs the prefix cache).
"""

from __future__ import annotations

from kvstack.serve.chat.reasoning_parsers.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    opens_in_prompt = False
