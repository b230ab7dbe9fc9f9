"""Word lists, sentence templates and a token-budgeted text maker for synthetic workloads.

Text is plain English-like prose assembled from fixed word lists with a seeded
``random.Random``, so it is deterministic and tokenizes to roughly one token per word.
:class:`TextMaker` measures every space-separated chunk with the real tokenizer: byte-level
BPE pre-tokenizers split text at spaces (a space attaches to the word after it), so the
token count of ``" ".join(chunks)`` is the sum of the chunks' counts and a target length
is hit to within a few tokens without re-encoding the whole text.
"""

from __future__ import annotations

import json
import random
from typing import Any, Protocol


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


NOUNS = _words(
    "river city garden engine market teacher student window bridge forest signal planet "
    "library harbor village machine kitchen doctor farmer painter camera battery bottle "
    "mountain island ocean valley desert storm cloud morning evening winter summer journey "
    "project report budget schedule meeting customer product network server database "
    "question answer problem solution method system process record message letter "
    "picture story history language number pattern circle square triangle museum theater "
    "orchestra recipe harvest bakery train station airport highway tunnel lighthouse "
    "telescope microscope notebook pencil keyboard screen printer robot sensor satellite"
)
VERBS = _words(
    "builds carries changes checks collects describes designs explains follows guides "
    "improves measures moves opens organizes protects reads repairs shapes shares studies "
    "supports tests tracks watches writes balances connects covers delivers discovers "
    "records reviews reaches prepares visits compares"
)
ADJECTIVES = _words(
    "quiet bright careful small large ancient modern simple complex gentle rapid steady "
    "curious honest practical patient narrow wide warm cold fresh early late clear hidden "
    "useful strong light heavy green golden silver wooden local remote"
)
ADVERBS = _words(
    "slowly quickly carefully often rarely quietly openly always usually gently clearly "
    "safely easily"
)
PLACES = _words("north south east west coast center edge harbor valley")
NAMES = _words(
    "Atlas Beacon Cedar Delta Ember Falcon Garnet Harbor Iris Juniper Kestrel Lumen Meridian "
    "Nova Onyx Pioneer Quartz Raven Sierra Tundra Umber Vega Willow Xenon Yarrow Zephyr"
)
QUESTION_OPENERS = (
    "Question:",
    "Quick question:",
    "Please explain this:",
    "Help me understand this:",
    "Can you check this:",
    "I wonder about this:",
    "Is this right?",
    "Why is this so?",
    "Summarize this:",
    "One more thing:",
)

SENTENCES = (
    "The {adj} {noun} {verb} the {noun2} {adv}.",
    "Every {noun} near the {place} {verb} a {adj} {noun2}.",
    "A {adj} {noun} {adv} {verb} the {noun2} in the {place}.",
    "When the {noun} {verb} the {noun2}, the {adj} {noun3} {verb2} it {adv}.",
    "Our {noun} {verb} each {adj} {noun2} before the {noun3} {verb2} anything.",
    "In the {place}, one {adj} {noun} {verb} the {noun2} and the {noun3}.",
    "The {noun} {adv} {verb} {count} {adj} {noun2}s.",
    "Nobody expected that the {noun} {verb} the {adj} {noun2}.",
)

# (family instruction, input label, output label) for few-shot task families.
TASK_FAMILIES = (
    ("Classify the mood of each passage as calm, tense or joyful.", "Passage", "Mood"),
    ("Extract the main object and the place from each report.", "Report", "Extraction"),
    ("Rewrite each note as one short formal sentence.", "Note", "Formal"),
    ("Give a title of at most five words for each story.", "Story", "Title"),
    ("Decide whether each claim is supported by the text.", "Claim", "Verdict"),
    ("List the two most important words of each message.", "Message", "Keywords"),
)


def sys_user(system: str, user: str) -> list[dict[str, str]]:
    """Messages of one system and one user turn."""
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


class TokenizerLike(Protocol):
    """What the workloads need from :class:`kvstack.model.tokenizer.tokenizer.Tokenizer`."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]: ...


class TextMaker:
    """Seeded prose of a requested token length, measured with ``tokenizer``."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self.tok = tokenizer
        self._cost: dict[str, int] = {}

    def count(self, text: str) -> int:
        """Exact token count of ``text`` (no special tokens added)."""
        return len(self.tok.encode(text, add_special_tokens=False))

    def _chunk_cost(self, chunk: str) -> int:
        cost = self._cost.get(chunk)
        if cost is None:
            cost = self._cost[chunk] = self.count(" " + chunk)
        return cost

    def template_overheads(self) -> tuple[int, int, int]:
        """Template tokens before a system message's text, between it and the user's, after.

        Special tokens are split off before BPE, so these add up with the content's counts.
        """
        rendered = self.tok.apply_chat_template(sys_user("\x00S\x00", "\x00U\x00"))
        head, rest = str(rendered).split("\x00S\x00")
        mid, tail = rest.split("\x00U\x00")
        return self.count(head), self.count(mid), self.count(tail)

    def sentence(self, rng: random.Random) -> str:
        """One random sentence from :data:`SENTENCES`."""
        return rng.choice(SENTENCES).format(
            adj=rng.choice(ADJECTIVES),
            noun=rng.choice(NOUNS),
            noun2=rng.choice(NOUNS),
            noun3=rng.choice(NOUNS),
            verb=rng.choice(VERBS),
            verb2=rng.choice(VERBS),
            adv=rng.choice(ADVERBS),
            place=rng.choice(PLACES),
            count=rng.randint(2, 99),
        )

    def text(self, rng: random.Random, n_tokens: int, lead: str = "") -> str:
        """``lead`` followed by random sentences, about ``n_tokens`` tokens in all.

        Whole chunks are added while they fit, so the result is at most a few tokens short
        of ``n_tokens`` (or just ``lead`` when that is already longer).
        """
        chunks = lead.split()
        used = self.count(" ".join(chunks)) if chunks else 0
        while used < n_tokens:
            for chunk in self.sentence(rng).split():
                cost = self._chunk_cost(chunk) if chunks else self.count(chunk)
                if used + cost > n_tokens:
                    return " ".join(chunks) if chunks else chunk
                chunks.append(chunk)
                used += cost
        return " ".join(chunks)


def tool_schema(rng: random.Random, maker: TextMaker, index: int, desc_len: int) -> dict[str, Any]:
    """An OpenAI-style function schema with a seeded name, description and parameters."""
    verb = rng.choice(VERBS).rstrip("s")
    name = f"{verb}_{rng.choice(ADJECTIVES)}_{rng.choice(NOUNS)}_{index}"
    props: dict[str, Any] = {}
    for _ in range(rng.randint(2, 4)):
        pname = f"{rng.choice(NOUNS)}_{rng.choice(('id', 'name', 'count', 'limit', 'mode'))}"
        kind = rng.choice(("string", "integer", "boolean"))
        props[pname] = {"type": kind, "description": maker.text(rng, rng.randint(5, 10))}
    required = sorted(props)[: rng.randint(1, len(props))]
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": maker.text(rng, desc_len),
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


def tool_block(rng: random.Random, maker: TextMaker, n_tokens: int) -> tuple[str, list[str]]:
    """``<tools>`` block of one JSON schema per line, about ``n_tokens`` tokens; tool names."""
    lines: list[str] = []
    names: list[str] = []
    used = maker.count("<tools>\n</tools>")
    while n_tokens - used >= 40:
        desc = min(rng.randint(15, 40), max(5, n_tokens - used - 70))
        line = json.dumps(tool_schema(rng, maker, len(lines), desc))
        cost = maker.count(line + "\n")
        if lines and used + cost > n_tokens + 40:
            break
        lines.append(line)
        names.append(json.loads(line)["function"]["name"])
        used += cost
    return "<tools>\n" + "\n".join(lines) + "\n</tools>", names


def persona(g: int) -> str:
    """A distinct name for group ``g``."""
    return NAMES[g % len(NAMES)] + (f"-{g // len(NAMES)}" if g >= len(NAMES) else "")


def few_shot_messages(
    rng: random.Random, maker: TextMaker, preamble: str, family: int, shots: int, shot_len: int
) -> list[dict[str, str]]:
    """System message (shared preamble + this family's task) and ``shots`` example pairs.

    Each example is an input of 3/5 of ``shot_len`` tokens and an answer of the rest.
    """
    task, in_label, out_label = TASK_FAMILIES[family % len(TASK_FAMILIES)]
    if family >= len(TASK_FAMILIES):
        task += f" (variant {family // len(TASK_FAMILIES)})"
    msgs = [{"role": "system", "content": f"{preamble}\n\nTask: {task}"}]
    n_in = shot_len * 3 // 5
    for _ in range(shots):
        msgs.append({"role": "user", "content": maker.text(rng, n_in, f"{in_label}:")})
        answer = maker.text(rng, shot_len - n_in, f"{out_label}:")
        msgs.append({"role": "assistant", "content": answer})
    return msgs


def agent_system(
    rng: random.Random, maker: TextMaker, intro_len: int, tools_len: int
) -> tuple[str, list[str]]:
    """Agent system prompt: instructions, the ``<tools>`` block, the call format; tool names."""
    lead = "You are an agent that completes tasks by calling the tools listed below."
    intro = maker.text(rng, intro_len, lead)
    tools, names = tool_block(rng, maker, tools_len)
    how = 'To call a tool, reply with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
    return f"{intro}\n\n{tools}\n\n{how}", names


def tool_call_reply(
    rng: random.Random, maker: TextMaker, names: list[str], step: int, n_tokens: int
) -> str:
    """A synthetic assistant turn: one tool call and filler text, about ``n_tokens``."""
    call = {"name": rng.choice(names), "arguments": {"step": step}}
    return maker.text(rng, n_tokens, f"<tool_call>{json.dumps(call)}</tool_call> Done.")
