"""A real model in kvstack against transformers reading the same GGUF, float32.

Used by the slow real-weight test of Qwen2.5-Coder-0.5B-Instruct
(``tests/model/test_qwen_real.py``) and by ``benchmarks/real_model_check.py`` for the 1.5B,
whose float32 copy needs ~7 GB: the reference runs first and is freed before kvstack loads.

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

import gc
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
    gc.collect()  # the loader's dequantized numpy copies: a second model's worth of memory
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


@dataclass
class Reference:
    """What transformers gives for one model: each ``TEMPLATE_CASES`` chat rendered, and
    per ``CHATS`` prompt its ids, logits at every position, greedy tokens and the top-2
    logit gap of each greedy step. Kept so the reference can be freed before kvstack
    loads (only one float32 copy of the model in memory at a time)."""

    texts: list[str]
    ids: list[list[int]]
    logits: list[torch.Tensor]
    tokens: list[list[int]]
    gaps: list[list[float]]
    seconds: float


def reference_greedy(
    hf: Any, ids: list[int], new_tokens: int
) -> tuple[torch.Tensor, list[int], list[float]]:
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
    if prompt_logits is None:
        raise ValueError(f"new_tokens must be at least 1, got {new_tokens}")
    return prompt_logits, tokens, gaps


def run_reference(hf: Any, hf_tok: Any, new_tokens: int) -> Reference:
    """transformers' side of every check (the prompts are its own tokenization of its
    own rendering)."""
    start = time.perf_counter()
    ref = Reference([render(hf_tok, c, False) for c in TEMPLATE_CASES], [], [], [], [], 0.0)
    for chat in CHATS:
        ids = hf_tok.encode(render(hf_tok, chat, False), add_special_tokens=False)
        logits, tokens, gaps = reference_greedy(hf, ids, new_tokens)
        ref.ids.append(ids)
        ref.logits.append(logits)
        ref.tokens.append(tokens)
        ref.gaps.append(gaps)
    ref.seconds = round(time.perf_counter() - start, 1)
    return ref


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


def check_prompt(llm: LLM, ref: Reference, i: int, new_tokens: int) -> PromptCheck:
    """kvstack's greedy tokens and prompt logits for ``CHATS[i]`` against ``ref``'s."""
    messages, tools = CHATS[i]
    ids, want, gaps = ref.ids[i], ref.tokens[i], ref.gaps[i]
    ours_ids = llm.tokenizer.apply_chat_template(messages, tools=tools, tokenize=True)
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=sp, use_tqdm=False)
    got = list(out[0].outputs[0].token_ids)
    ours = prefill_logits(llm, ids)
    first = next((k for k, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)
    return PromptCheck(
        prompt_tokens=len(ids),
        ids_equal=ours_ids == ids,
        reference=want,
        kvstack=got,
        first_difference=first,
        gap_there=None if first is None else gaps[first],
        max_logit_diff=float((ours - ref.logits[i]).abs().max()),
        argmax_equal=bool(torch.equal(ours.argmax(-1), ref.logits[i].argmax(-1))),
    )


def check_real_model(
    model: str, path: Path, llm: LLM, ref: Reference, new_tokens: int
) -> RealModelCheck:
    """kvstack's side: chat templates, then each of ``CHATS``' greedy tokens and logits."""
    result = RealModelCheck(model=model, path=str(path))
    result.template_mismatches = [
        i
        for i, chat in enumerate(TEMPLATE_CASES)
        if render(llm.tokenizer, chat, True) != ref.texts[i]
    ]
    start = time.perf_counter()
    result.prompts = [check_prompt(llm, ref, i, new_tokens) for i in range(len(CHATS))]
    result.seconds = {"transformers": ref.seconds, "kvstack": round(time.perf_counter() - start, 1)}
    return result
