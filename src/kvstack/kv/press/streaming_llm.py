"""StreamingLLM: attention sinks + a recent window (Xiao et al., "Efficient Streaming
Language Models with Attention Sinks", ICLR 2024).

The first ``SINKS`` tokens soak up attention mass whatever their content, so they are
always kept; of the rest only the most recent survive. No scores, no queries.
"""

from __future__ import annotations

import torch

from kvstack.kv.press.base import Press, PressInput


class StreamingLLMPress(Press):
    name = "streaming_llm"
    paper = "Xiao et al., ICLR 2024"
    SINKS = 4

    def select(self, inp: PressInput) -> list[torch.Tensor]:
        n, kvh = inp.n, inp.keys[0].shape[1]
        m = self.kept(inp)
        sinks = min(self.SINKS, m)
        idx = torch.cat((torch.arange(sinks), torch.arange(n - (m - sinks), n)))
        return [idx.expand(kvh, -1) for _ in range(inp.num_layers)]
