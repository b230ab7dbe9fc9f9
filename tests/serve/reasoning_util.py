"""A tiny random Qwen3 with a Qwen3-style chat template, for reasoning and Responses tests.

The template keeps what matters of Qwen3's: an assistant turn after the last user
message is rendered with its ``<think>`` block (``reasoning_content``, or split out of the
content at ``</think>``), earlier ones without it; ``enable_thinking: false`` writes an
empty think block into the generation prompt.
"""

from __future__ import annotations

from pathlib import Path

from kvstack import LLM
from kvstack.testing.families import tiny_family_config
from kvstack.testing.tiny_models import random_llama_weights, write_gguf

QWEN3_STYLE_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}"
    "{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content or '' -%}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is defined "
    "and m.reasoning_content else '' -%}"
    "{%- if not reasoning and '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and reasoning -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' "
    "+ content.lstrip('\\n') + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)


def tiny_qwen3(folder: Path, num_blocks: int = 256, block_size: int = 16) -> LLM:
    """The tiny Qwen3 (2 layers, vocab 320, context 2048) with the Qwen3-style template."""
    cfg = tiny_family_config("qwen3", max_position_embeddings=2048)
    path = write_gguf(folder / "tiny-qwen3.gguf", cfg, random_llama_weights(cfg, seed=3))
    return LLM(
        str(path), dtype="float32", chat_template=QWEN3_STYLE_TEMPLATE, num_blocks=num_blocks,
        block_size=block_size, max_model_len=2048, max_num_batched_tokens=2048,
    )  # fmt: skip
