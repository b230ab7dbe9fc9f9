"""Deterministic prompts for the offline-throughput benchmark.

Every prompt is the model's chat template applied to

    [system: SYSTEM_PROMPT (136 tokens), user: a distinct question]

with the generation prompt appended, tokenized with the transformers tokenizer loaded from
the default model's GGUF (the same ids kvstack's tokenizer produces). Token layout of one
prompt (default ``prompt_len=200``)::

    | <|im_start|>system\\n | SYSTEM_PROMPT | <|im_end|>\\n<|im_start|>user\\n | question | tail |
    |<-------------------- shared by every prompt: 144 tokens ------------->|<-- 50 -->|<- 6 ->|

where ``tail`` is ``<|im_end|>\\n<|im_start|>assistant\\n``. Each question starts with its own
topic word, so prompts diverge right after the shared 144 tokens; its token ids are cut to the
exact budget that makes every prompt ``prompt_len`` tokens long (the cut may fall mid-sentence,
which does not matter for throughput and keeps token counts exact).

Run directly to print a summary: ``python benchmarks/workload.py --num-prompts 32``.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

SYSTEM_PROMPT = (
    "You are Atlas, a patient and knowledgeable tutor who helps students understand science, "
    "history, mathematics, technology and everyday life. Follow these rules in every answer. "
    "First, restate the question in one short sentence so the student knows you understood it. "
    "Second, explain the core idea in plain language, avoiding jargon unless you define it. "
    "Third, give one concrete example or analogy that a curious teenager would recognise. "
    "Fourth, mention one common misconception and correct it gently. "
    "Finally, end with a single follow-up question that invites the student to think further. "
    "Keep every answer honest, friendly and concise, use short paragraphs, and say so clearly "
    "when you are not sure of a fact."
)

# 32 topics whose first words differ, so that prompts share nothing after the common prefix.
TOPICS = (
    "Photosynthesis",
    "Volcanoes",
    "Black holes",
    "Vaccines",
    "Earthquakes",
    "Rainbows",
    "Oxygen",
    "Magnets",
    "Compilers",
    "Encryption",
    "Inflation",
    "Democracy",
    "Glaciers",
    "Windmills",
    "Batteries",
    "Antibiotics",
    "Honeybees",
    "Lightning",
    "Satellites",
    "Coral reefs",
    "Printing presses",
    "Steam engines",
    "Prime numbers",
    "Probability",
    "Sourdough bread",
    "Jet streams",
    "Submarines",
    "Telescopes",
    "Languages",
    "Mountains",
    "Deserts",
    "Memory",
)

# Eight question forms; prompt i uses topic i % 32 and form i // 32, so up to 256 prompts.
FORMS = (
    "how does {t} work, and why does it matter to people who never study it at school?",
    "what is the single most important fact about {t} that most adults get wrong?",
    "explain the history of how humans first came to understand {t}.",
    "compare {t} with something from daily life that behaves in a similar way.",
    "what would change in the world if {t} suddenly stopped existing tomorrow?",
    "which experiment could a student do at home to learn something about {t}?",
    "what are the open questions that scientists still argue about regarding {t}?",
    "how would you teach {t} to a ten-year-old in five minutes?",
)

# Long enough that every question exceeds its token budget before it is cut.
QUESTION_TAIL = (
    " Please answer step by step, use one everyday example, point out the most common mistake "
    "people make about it, suggest a simple way to remember the idea, and finish with a "
    "question I could explore on my own this weekend with a notebook and a pencil."
)

DEFAULT_PROMPT_LEN = 200


def question(i: int) -> str:
    """Return the text of the ``i``-th user question (distinct for ``i < 256``)."""
    if not 0 <= i < len(TOPICS) * len(FORMS):
        raise ValueError(f"question index {i} out of range 0..{len(TOPICS) * len(FORMS) - 1}")
    topic = TOPICS[i % len(TOPICS)]
    form = FORMS[i // len(TOPICS)]
    return f"{topic}: {form.format(t=topic.lower())}{QUESTION_TAIL}"


@functools.lru_cache(maxsize=2)
def load_tokenizer(folder: str | None = None) -> Any:
    """The transformers tokenizer of the default model's GGUF, or of the HF ``folder`` of
    another model (``offline_throughput.py --model``); cached."""
    from transformers import AutoTokenizer

    from bench_common import find_gguf

    if folder is not None:
        return AutoTokenizer.from_pretrained(folder)
    gguf = find_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _encode(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def build_prompts(
    num_prompts: int, prompt_len: int = DEFAULT_PROMPT_LEN, tokenizer_dir: str | None = None
) -> list[list[int]]:
    """Return ``num_prompts`` prompts of exactly ``prompt_len`` token ids each (the default
    model's tokenizer and chat template, or those of the HF folder ``tokenizer_dir``).

    Deterministic: the same arguments always give the same ids. See the module docstring for
    the layout; the shared prefix is :func:`shared_prefix_len` tokens.
    """
    tok = load_tokenizer(tokenizer_dir)
    marker = "\x00QUESTION\x00"
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": marker},
    ]
    if tok.chat_template is not None:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:  # a GGUF without a template (Gemma 3 270M's): BOS, system text, question
        text = f"{SYSTEM_PROMPT}\n\n{marker}\n"
    head_text, tail_text = text.split(marker)
    head, tail = _encode(tok, head_text), _encode(tok, tail_text)
    if tok.chat_template is None and tok.bos_token_id is not None:
        head = [tok.bos_token_id, *head]
    budget = prompt_len - len(head) - len(tail)
    if budget < 8:
        raise ValueError(
            f"prompt_len {prompt_len} too short: the template alone is "
            f"{len(head) + len(tail)} tokens"
        )
    prompts: list[list[int]] = []
    for i in range(num_prompts):
        q = _encode(tok, question(i))
        if len(q) < budget:
            raise ValueError(f"question {i} has {len(q)} tokens, fewer than its budget {budget}")
        # Special tokens are split off atomically before BPE, so encoding the pieces
        # separately gives the same ids as encoding the whole templated string.
        prompts.append(head + q[:budget] + tail)
    return prompts


def shared_prefix_len(prompts: list[list[int]]) -> int:
    """Length of the token prefix common to all ``prompts``."""
    if not prompts:
        return 0
    n = min(len(p) for p in prompts)
    first = prompts[0]
    for j in range(n):
        if any(p[j] != first[j] for p in prompts[1:]):
            return j
    return n


def describe(prompts: list[list[int]]) -> dict[str, Any]:
    """Summary of a workload for result files: counts, lengths and the shared prefix."""
    lens = [len(p) for p in prompts]
    return {
        "num_prompts": len(prompts),
        "prompt_len_min": min(lens),
        "prompt_len_max": max(lens),
        "prompt_tokens_total": sum(lens),
        "shared_prefix_len": shared_prefix_len(prompts),
    }


def main() -> None:
    """Print a summary of the workload and the first prompt decoded."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN)
    args = parser.parse_args()
    prompts = build_prompts(args.num_prompts, args.prompt_len)
    print(describe(prompts))
    print(load_tokenizer().decode(prompts[0]))


if __name__ == "__main__":
    main()
