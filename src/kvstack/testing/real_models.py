"""A real model in kvstack against transformers reading the same GGUF, float32.

Used by the slow real-weight test of Qwen2.5-Coder-0.5B-Instruct
(``tests/model/test_qwen_real.py``) and by ``benchmarks/real_model_check.py`` for the 1.5B,
whose float32 copies (kvstack's and transformers') need ~7 GB together.

The reference is transformers' own GGUF reader (``from_pretrained(dir, gguf_file=...)``:
it dequantizes every tensor with gguf-py and builds ``Qwen2ForCausalLM``) with the
tokenizer and chat template transformers builds from the same file; kvstack runs with
``--quantization none`` (dequantized weights, so the comparison is of the arithmetic, not
of a packed format) and prefix caching off (``prefill_logits`` writes the KV pool
directly). A greedy divergence counts only where the reference's top-2 logit gap is at
least ``TIE_GAP`` (a real difference, not a numerical tie); the logit deviation is the
largest absolute difference over every position of every prompt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstack.core.request import SamplingParams
from kvstack.engine.llm import LLM
from kvstack.model.attention import AttentionMetadata, PrefillSeq

TIE_GAP = 1e-3  # fp32 logits of a 24-28-layer model differ by ~1e-4..1e-3 between GEMMs

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
Chat = tuple[list[dict[str, Any]], list[dict[str, Any]] | None]  # (messages, tools)

# Prompts generated from: a coding question, a system prompt, and a tool call request.
CHATS: list[Chat] = [
    ([{"role": "user", "content": "Write a Python function that reverses a string."}], None),
    (
        [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "What does a KV cache store in a transformer?"},
        ],
        None,
    ),
    ([{"role": "user", "content": "What's the weather in Paris right now?"}], [WEATHER_TOOL]),
]
# Rendered only (no generation): a finished tool call, its result and a reply.
TOOL_TURNS: Chat = (
    [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temp": 18, "sky": "clear"}'},
        {"role": "assistant", "content": "It is 18 °C and clear in Paris."},
        {"role": "user", "content": "And in Lyon? 🌧"},
    ],
    [WEATHER_TOOL],
)
TEMPLATE_CASES: list[Chat] = [*CHATS, TOOL_TURNS, (TOOL_TURNS[0][1:], None)]


@dataclass
class PromptCheck:
    """One chat prompt: the two greedy continuations and the logits' largest deviation."""

    prompt_tokens: int
    ids_equal: bool  # kvstack's tokenized chat template == transformers'
    reference: list[int]
    kvstack: list[int]
    first_difference: int | None  # step where the tokens first differ, None if never
    gap_there: float | None  # the reference's top-2 gap at that step
    max_logit_diff: float  # over every prompt position
    argmax_equal: bool  # the prompt's per-position argmax, kvstack vs reference

    @property
    def tokens_ok(self) -> bool:
        tie = self.first_difference is None or (self.gap_there or 0.0) < TIE_GAP
        return self.ids_equal and tie


@dataclass
class RealModelCheck:
    """Everything compared for one model (``ok`` when every check held)."""

    model: str
    path: str
    template_mismatches: list[int] = field(default_factory=list)  # TEMPLATE_CASES indices
    prompts: list[PromptCheck] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    def ok(self, logit_atol: float) -> bool:
        return not self.template_mismatches and all(
            p.tokens_ok and p.argmax_equal and p.max_logit_diff < logit_atol for p in self.prompts
        )


def load_reference(path: Path) -> tuple[Any, Any]:
    """transformers' float32 model and tokenizer read from the GGUF at ``path``."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None
    return model, tok


def load_kvstack(model: str) -> LLM:
    """kvstack's float32, unquantized engine of ``model``, prefix caching off."""
    return LLM(
        model, dtype="float32", quantization="none", num_blocks=256, enable_prefix_caching=False
    )


def render(tok: Any, chat: Chat, ours: bool) -> str:
    """The chat template's text for ``chat`` (generation prompt added), kvstack's or
    transformers' tokenizer."""
    messages, tools = chat
    if ours:
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    else:
        out = tok.apply_chat_template(
            messages, add_generation_prompt=True, tools=tools, tokenize=False
        )
    return str(out)


def template_mismatches(llm: LLM, hf_tok: Any) -> list[int]:
    """Indices of ``TEMPLATE_CASES`` whose text differs between the two renderers."""
    return [
        i
        for i, chat in enumerate(TEMPLATE_CASES)
        if render(llm.tokenizer, chat, True) != render(hf_tok, chat, False)
    ]


def prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """kvstack's logits at every position of ``ids``: one prefill into slots 0..n-1 of
    the engine's pool (no request holds them: prefix caching is off)."""
    engine, n = llm.engine, len(ids)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        num_decodes=0,
        decode_block_tables=None,
        decode_context_lens=None,
        decode_bias=None,
        prefills=[PrefillSeq(0, n, n, None, None)],
    )
    with torch.no_grad():
        return engine.model.forward(
            torch.tensor(ids), torch.arange(n), meta, engine.kv_storage, None
        ).float()


def reference_greedy(
    hf: Any, ids: list[int], new_tokens: int
) -> tuple[Any, list[int], list[float]]:
    """transformers' logits at every prompt position, then its greedy tokens and each
    step's top-2 logit gap (a plain loop over its forward and KV cache: no logits
    processors), as ``kvstack.testing.families.hf_greedy`` but keeping the prefill's logits."""
    tokens: list[int] = []
    gaps: list[float] = []
    past, x, prompt_logits = None, torch.tensor([ids]), None
    with torch.no_grad():
        for _ in range(new_tokens):
            out = hf(x, past_key_values=past, use_cache=True)
            past = out.past_key_values
            if prompt_logits is None:
                prompt_logits = out.logits[0].float()
            top2 = out.logits[0, -1].float().topk(2)
            tokens.append(int(top2.indices[0]))
            gaps.append(float(top2.values[0] - top2.values[1]))
            x = torch.tensor([[tokens[-1]]])
    return prompt_logits, tokens, gaps


def check_prompt(
    llm: LLM, hf: Any, hf_tok: Any, chat: Chat, new_tokens: int, seconds: dict[str, float]
) -> PromptCheck:
    """Greedy tokens and prompt logits of one chat prompt, kvstack vs transformers (the
    prompt is transformers' tokenization of its own rendering); adds the time each side
    took to ``seconds``."""
    ids = hf_tok.encode(render(hf_tok, chat, False), add_special_tokens=False)
    ours_ids = llm.tokenizer.apply_chat_template(chat[0], tools=chat[1], tokenize=True)
    start = time.perf_counter()
    ref, want, gaps = reference_greedy(hf, ids, new_tokens)
    mid = time.perf_counter()
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=sp, use_tqdm=False)
    got = list(out[0].outputs[0].token_ids)
    ours = prefill_logits(llm, ids)
    seconds["transformers"] = round(seconds.get("transformers", 0.0) + mid - start, 1)
    seconds["kvstack"] = round(seconds.get("kvstack", 0.0) + time.perf_counter() - mid, 1)
    first = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)
    return PromptCheck(
        prompt_tokens=len(ids),
        ids_equal=ours_ids == ids,
        reference=want,
        kvstack=got,
        first_difference=first,
        gap_there=None if first is None else gaps[first],
        max_logit_diff=float((ours - ref).abs().max()),
        argmax_equal=bool(torch.equal(ours.argmax(-1), ref.argmax(-1))),
    )


def check_real_model(
    model: str, path: Path, llm: LLM, hf: Any, hf_tok: Any, new_tokens: int
) -> RealModelCheck:
    """Chat templates, then each of ``CHATS``: greedy tokens and logits."""
    result = RealModelCheck(model=model, path=str(path))
    result.template_mismatches = template_mismatches(llm, hf_tok)
    for chat in CHATS:
        result.prompts.append(check_prompt(llm, hf, hf_tok, chat, new_tokens, result.seconds))
    return result
