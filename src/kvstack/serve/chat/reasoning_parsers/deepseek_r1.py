"""DeepSeek-R1's reasoning format (vLLM's ``deepseek_r1`` parser).

R1's chat template ends the generation prompt with ``<think>\\n``, so the output usually
starts inside the reasoning and only writes ``</think>``; an output that writes ``<think>``
itself is read the same way. Everything before ``</think>`` is reasoning (all of it when
``</think>`` never comes), everything after is content.
"""

from __future__ import annotations

from kvstack.serve.chat.reasoning_parsers.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    opens_in_prompt = True

    def template_markers_missing(self, template: str) -> list[str]:
        """R1-style templates write ``<think>`` (the prompt opens the reasoning) and strip
        ``</think>`` from history; either marker shows the template knows the format."""
        return [] if (self.start in template or self.end in template) else [self.start]
