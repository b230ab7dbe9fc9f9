"""The texts ``kvstack eval`` scores (teacher-forced quality and greedy agreement).

Corpus (``--corpus``)
    ``prose`` (default): seeded synthetic English prose from
    :class:`~kvstack.tools.workloads.text.TextMaker` (fixed word lists and sentence
    templates, so license-clean and identical on every machine), cut to exactly the
    requested number of tokens. It is not natural text: the words are random within a
    handful of templates, so the model's perplexity on it is high (tens) and the
    teacher-forced metrics measure how a codec perturbs the model on prose whose *syntax*
    is predictable in context and whose *content* is not.

    ``real``: real human-written English shipped offline with every Python: the prose of
    the Python Language Reference as the standard library's ``pydoc_data.topics`` holds it
    (what ``help("assignment")`` prints; PSF license), its indented code and grammar
    blocks left out (:func:`real_corpus`). The text is fixed per Python version (the
    report records it).

    ``generated``: text the model writes itself (:func:`generated_corpus`; perplexity
    ~1.6), which costs minutes of CPU decoding per text.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstack.tools.workloads.text import TextMaker, TokenizerLike

if TYPE_CHECKING:
    from kvstack.engine.llm import LLM


@dataclass
class EvalText:
    """One corpus text: ``context`` tokens, the ``index``-th of that length."""

    context: int
    index: int
    token_ids: list[int]


def has_chat_template(tokenizer: TokenizerLike) -> bool:
    """Whether the model is a chat model (its GGUF or folder carries a chat template)."""
    return bool(getattr(tokenizer, "chat_template", None))


def make_text_ids(tokenizer: TokenizerLike, n_tokens: int, rng: random.Random) -> list[int]:
    """Exactly ``n_tokens`` token ids of TextMaker prose (a few extra made, then cut)."""
    maker = TextMaker(tokenizer)
    ids = tokenizer.encode(maker.text(rng, n_tokens + 32), add_special_tokens=False)
    while len(ids) < n_tokens:  # TextMaker lands a few tokens short at most; be safe
        ids += tokenizer.encode(" " + maker.sentence(rng), add_special_tokens=False)
    return ids[:n_tokens]


def make_corpus(
    tokenizer: TokenizerLike, contexts: list[int], num_texts: int, seed: int = 0
) -> list[EvalText]:
    """``num_texts`` texts of every length in ``contexts``, each seeded by (seed, length, i)."""
    out = []
    for ctx in contexts:
        for i in range(num_texts):
            rng = random.Random(f"kvstack-eval-{seed}-{ctx}-{i}")
            out.append(EvalText(ctx, i, make_text_ids(tokenizer, ctx, rng)))
    return out


REAL_SOURCE = "the Python Language Reference (pydoc_data.topics), prose only"
MIN_PARAGRAPH_WORDS = 10


def reference_manual_text() -> str:
    """The prose of the Python Language Reference shipped with this Python, one string.

    Topics in sorted order, each from ``pydoc_data.topics``; lines indented (code,
    grammar, tables) or made of ``*``/``=``/``-`` underlines are left out, and so are
    paragraphs of fewer than ``MIN_PARAGRAPH_WORDS`` words (headings, command lists), so
    what remains is the manual's English paragraphs, separated by blank lines.
    """
    from pydoc_data.topics import topics

    parts = []
    for name in sorted(topics):
        lines = [
            line
            for line in topics[name].splitlines()
            if not line.strip() or (not line.startswith((" ", "\t")) and line.strip("*=-~^ "))
        ]
        paragraphs = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip().split("\n\n")
        parts += [p for p in paragraphs if len(p.split()) >= MIN_PARAGRAPH_WORDS]
    return "\n\n".join(parts)


def real_corpus(
    tokenizer: TokenizerLike, contexts: list[int], num_texts: int, seed: int = 0
) -> list[EvalText]:
    """``num_texts`` texts of every length in ``contexts`` cut from the reference manual's
    prose (:func:`reference_manual_text`), each starting at a paragraph chosen by
    (seed, length, i) and wrapping around; exactly ``context`` tokens each."""
    text = reference_manual_text()
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    out = []
    for ctx in contexts:
        for i in range(num_texts):
            rng = random.Random(f"kvstack-eval-real-{seed}-{ctx}-{i}")
            start = rng.randrange(len(paragraphs))
            ids: list[int] = []
            j = start
            while len(ids) < ctx:
                chunk = paragraphs[j % len(paragraphs)] + "\n\n"
                ids += tokenizer.encode(chunk, add_special_tokens=False)
                j += 1
                if j - start > len(paragraphs):  # the whole manual is shorter than ctx
                    break
            if len(ids) < ctx:
                raise ValueError(f"the reference manual has fewer than {ctx} tokens")
            out.append(EvalText(ctx, i, ids[:ctx]))
    return out


GEN_TOPICS = (
    "the history of lighthouses and the people who kept them",
    "how bread is made, from growing wheat to baking",
    "how a small town changed over a hundred years",
    "the life of honeybees through the seasons",
)


def generated_corpus(
    llm: LLM, contexts: list[int], num_texts: int, seed: int = 0
) -> list[EvalText]:
    """Texts the model writes itself.

    A chat prompt asks for a long essay on one of ``GEN_TOPICS`` (a base model continues
    the essay's title line); the model samples the rest (temperature 0.7, top-p 0.95,
    seeded, EOS ignored) up to ``context`` tokens. Its own text has low perplexity (~1.6),
    so top-1 agreement measures the KV method rather than near-ties in flat distributions
    (synthetic prose: perplexity ~50).
    """
    from kvstack.core.request import SamplingParams

    prompts, params, keys = [], [], []
    for ctx in contexts:
        for i in range(num_texts):
            topic = GEN_TOPICS[(i + ctx) % len(GEN_TOPICS)]
            ids = essay_prompt(llm.tokenizer, topic)
            prompts.append(ids)
            params.append(
                SamplingParams(
                    temperature=0.7,
                    top_p=0.95,
                    seed=seed * 1000 + ctx + i,
                    max_tokens=ctx - len(ids),
                    ignore_eos=True,
                )
            )
            keys.append((ctx, i))
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [
        EvalText(ctx, i, (p + list(o.outputs[0].token_ids))[:ctx])
        for (ctx, i), p, o in zip(keys, prompts, outs, strict=True)
    ]


def essay_prompt(tokenizer: TokenizerLike, topic: str) -> list[int]:
    """The request for an essay on ``topic``: a chat turn, or for a base model (no chat
    template) the essay's title line as plain text to continue."""
    if not has_chat_template(tokenizer):
        return tokenizer.encode(f"A long, detailed essay about {topic}\n\n")
    msg = [{"role": "user", "content": f"Write a long, detailed essay about {topic}."}]
    ids = tokenizer.apply_chat_template(msg, tokenize=True)
    assert isinstance(ids, list)
    return ids
