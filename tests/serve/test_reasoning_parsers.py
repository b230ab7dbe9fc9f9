"""Reasoning parsers over recorded outputs: the finished split and every streamed cut.

The outputs are what DeepSeek-R1 and Qwen3 write (the think block's spacing as their
chat templates and generations have it), plus the edge cases: no think block, an
unclosed one (cut by ``max_tokens``), markers split across deltas, blank heads.
"""

from __future__ import annotations

import pytest

from kvstack.core.errors import ConfigError
from kvstack.serve.chat.reasoning_parsers import (
    REASONING_PARSERS,
    check_template,
    reasoning_parser,
    template_markers,
)

QWEN3_THINKING = "<think>\nThe user asks for 2+2. That is 4.\n</think>\n\nThe answer is 4."
R1_OPENED_IN_PROMPT = "Okay, 2+2 is 4.\n</think>\n\n**4**"
CASES = {
    # (parser, text): (reasoning, content)
    ("qwen3", QWEN3_THINKING): ("\nThe user asks for 2+2. That is 4.\n", "\n\nThe answer is 4."),
    ("qwen3", "Plain answer, thinking off."): (None, "Plain answer, thinking off."),
    ("qwen3", "<think>\n\n</think>\n\nHi"): ("\n\n", "\n\nHi"),
    ("qwen3", "<think>cut short by max_to"): ("cut short by max_to", None),
    ("qwen3", "  <think>a</think>b"): ("a", "b"),
    ("qwen3", "<thin"): (None, "<thin"),
    ("qwen3", "a <think>b</think>"): (None, "a <think>b</think>"),
    ("deepseek_r1", R1_OPENED_IN_PROMPT): ("Okay, 2+2 is 4.\n", "\n\n**4**"),
    ("deepseek_r1", "<think>x</think>y"): ("x", "y"),
    ("deepseek_r1", "still thinking when cut"): ("still thinking when cut", None),
    ("deepseek_r1", "done</think>"): ("done", None),
    ("deepseek_r1", "reason</thi"): ("reason</thi", None),
    ("deepseek_r1", ""): (None, None),
}


@pytest.mark.parametrize(("name", "text"), list(CASES))
def test_split_of_recorded_outputs(name: str, text: str) -> None:
    split = reasoning_parser(name).split(text)
    assert (split.reasoning, split.content) == CASES[(name, text)]


@pytest.mark.parametrize(("name", "text"), list(CASES))
def test_every_two_and_three_way_cut_streams_the_same_split(name: str, text: str) -> None:
    parser = reasoning_parser(name)
    want = parser.split(text)
    cuts = [(i, j) for i in range(len(text) + 1) for j in range(i, len(text) + 1)]
    for i, j in cuts:
        stream = parser.stream()
        got_r, got_c = "", ""
        for piece in (text[:i], text[i:j], text[j:]):
            r, c = stream.feed(piece)
            got_r, got_c = got_r + r, got_c + c
        r, c = stream.finish()
        got_r, got_c = got_r + r, got_c + c
        assert (got_r or None, got_c or None) == (want.reasoning, want.content), (i, j)


def test_token_by_token_stream_sends_reasoning_before_the_end_marker() -> None:
    """Reasoning flows while the model thinks (only a possible marker prefix is held)."""
    stream = reasoning_parser("qwen3").stream()
    assert stream.feed("<think>") == ("", "")
    assert stream.feed("step one") == ("step one", "")
    assert stream.feed(" </th") == (" ", "")
    assert stream.in_reasoning
    assert stream.feed("ink>\n\nAnswer") == ("", "\n\nAnswer")
    assert not stream.in_reasoning


QWEN3_TEMPLATE_EXCERPT = (
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}"
    "{%- endif %}{{- '<|im_start|>' + message.role + '\\n<think>\\n' }}"
)
CHATML = "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' }}"


def test_template_check_names_the_templates_markers() -> None:
    assert check_template("qwen3", QWEN3_TEMPLATE_EXCERPT, "m").name == "qwen3"
    assert check_template("deepseek_r1", "<｜Assistant｜><think>\\n", "m").name == "deepseek_r1"
    with pytest.raises(ConfigError) as e:
        check_template("qwen3", CHATML, "tiny")
    msg = str(e.value)
    assert "never writes <think> or </think>" in msg and "<|im_start|>, <|im_end|>" in msg
    with pytest.raises(ConfigError, match="no chat template"):
        check_template("deepseek_r1", None, "tiny")
    with pytest.raises(ConfigError, match="choose one of: deepseek_r1, qwen3"):
        reasoning_parser("granite")
    assert template_markers("[INST] x [/INST]<s>") == ["[INST]", "[/INST]", "<s>"]
    assert REASONING_PARSERS.names() == ("deepseek_r1", "qwen3")
