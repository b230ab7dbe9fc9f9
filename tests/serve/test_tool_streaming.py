"""Tool-call streaming (``serve/tool_parsers``' ``ToolStreamer``): held and released
content, the OpenAI delta shape, eager mode's divergence, the lifecycle, and random,
hostile and long outputs streamed like ``extract`` parses them."""

from __future__ import annotations

import json
import random

import pytest

from kvstack.serve.chat.tool_parsers import (
    TOOL_PARSERS,
    ContentDelta,
    ToolCallDelta,
    ToolStreamer,
    tool_parser,
)
from tool_parser_util import calls_of, cuttings, stream


def test_content_is_held_only_while_it_could_be_a_marker() -> None:
    s = ToolStreamer(tool_parser("hermes"))
    assert s.feed("Hello <tool_") == [ContentDelta("Hello ")]
    assert s.feed("call>") == []
    events = s.feed('{"name": "f", "arguments": {}}</tool_call>')
    assert [e.to_openai() for e in events if isinstance(e, ToolCallDelta)][1] == {
        "index": 0,
        "function": {"arguments": "{}"},
    }
    assert s.feed(" trailing") == [] and s.finish() == []

    m = ToolStreamer(tool_parser("mistral"))
    assert m.feed("ok [TOOL_CA") == [ContentDelta("ok ")]
    assert m.feed("T") == [ContentDelta("[TOOL_CAT")]

    blank = ToolStreamer(tool_parser("hermes"))
    assert blank.feed("\n\n") == [] and blank.finish() == [ContentDelta("\n\n")]


def test_header_then_arguments_in_openai_shape() -> None:
    s = ToolStreamer(tool_parser("pythonic"))
    events = s.feed('[f(a=1), g(b="x")')
    assert [type(e) for e in events] == [ToolCallDelta, ToolCallDelta]
    head, args = (e.to_openai() for e in events)
    assert head == {
        "index": 0,
        "id": head["id"],
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    assert args == {"index": 0, "function": {"arguments": '{"a": 1}'}}
    rest = s.feed("]") + s.finish()
    assert [e.to_openai()["index"] for e in rest] == [1, 1] and s.tool_calls_sent == 2


def test_not_tool_calls_is_released_early() -> None:
    """Once the held text cannot become calls, it streams as content at once."""
    py = ToolStreamer(tool_parser("pythonic"))
    assert py.feed("[1,") == [ContentDelta("[1,")]
    assert py.feed(" 2]") == [ContentDelta(" 2]")]
    llama = ToolStreamer(tool_parser("llama3_json"))
    assert llama.feed('{"a": 1}') == [ContentDelta('{"a": 1}')]
    hermes = ToolStreamer(tool_parser("hermes"))
    assert hermes.feed("<tool_call>{oops}</tool_call>") == [
        ContentDelta("<tool_call>{oops}</tool_call>")
    ]
    assert hermes.feed(" more") == [ContentDelta(" more")] and hermes.finish() == []


def test_eager_divergence() -> None:
    """eager=True cannot take back a sent call when a later one is malformed."""
    text = 'x<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{broken}</tool_call>'
    parser = tool_parser("hermes")
    assert parser.extract(text).content == text and parser.extract(text).tool_calls == []
    content, calls, _ = stream(parser, list(text), eager=True)
    assert calls == [("a", {})] and content == "x\n<tool_call>{broken}</tool_call>"
    assert stream(parser, list(text), eager=False)[:2] == (text, [])


def test_streamer_lifecycle() -> None:
    s = ToolStreamer(tool_parser("hermes"))
    assert s.feed("") == [] and s.finish() == [] and s.finish() == []
    with pytest.raises(RuntimeError):
        s.feed("late")


PIECES = {
    "hermes": ["<tool_call>", "</tool_call>", "{bad", "}", "{", '"', "text", "\n", "<tool"],
    "llama3_json": ["<|python_tag|>", '{"x": 1}', "; ", "\n", "{", "}", "prose", "<|py", '"'],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]abc", "[", "]", "{", "}", "hi", "[TOOL_CA"],
    "pythonic": ["[", "]", ", ", ",", "(", ")", "1", "\n", "'", '"', "x=", "text", "#"],
}
VALUES = [
    "é🌧",
    'a "q" ]}),',
    "</tool_call>",
    "two\nlines 'q' end",
    "back\\slash",
    0,
    -3,
    2.5,
    True,
    None,
    [1, {"k": "v"}],
]


def python_literal(value: object, rng: random.Random) -> str:
    """``repr``, or for a plain string sometimes a raw triple-quoted literal."""
    if isinstance(value, str) and "\\" not in value and rng.random() < 0.4:
        return " + value + "
    return repr(value)


def random_output(name: str, rng: random.Random) -> str:
    """A well-formed output of the format (prose, then 1-3 calls), often then mangled."""
    calls = [
        (f"f{j}", {f"k{i}": rng.choice(VALUES) for i in range(rng.randint(0, 3))})
        for j in range(rng.randint(1, 3))
    ]
    prose = rng.choice(["", "", "Sure. ", "\n", "Let me check:\n"])
    if name == "hermes":
        blocks = [json.dumps({"name": n, "arguments": a}) for n, a in calls]
        text = prose + "".join(f"<tool_call>\n{b}\n</tool_call>\n" for b in blocks)
    elif name == "llama3_json":
        objs = [json.dumps({"name": n, "parameters": a}) for n, a in calls]
        lead = rng.choice(["", "<|python_tag|>", prose + "<|python_tag|>"])
        text = lead + rng.choice(["; ", "\n", " "]).join(objs)
    elif name == "mistral":
        if rng.random() < 0.5:
            items = [{"name": n, "arguments": a} for n, a in calls]
            text = prose + "[TOOL_CALLS] " + json.dumps(items)
        else:
            text = prose + "".join(
                f"[TOOL_CALLS]{n}{rng.choice(['', '[ARGS]', '[CALL_ID]x9[ARGS]'])}{json.dumps(a)}"
                for n, a in calls
            )
    else:
        text = (
            "["
            + ", ".join(
                n + "(" + ", ".join(f"{k}={python_literal(v, rng)}" for k, v in a.items()) + ")"
                for n, a in calls
            )
            + "]"
        )
    for _ in range(rng.choice([0, 0, 1, 2])):
        i = rng.randint(0, len(text))
        op = rng.random()
        if op < 0.4:
            text = text[:i] + rng.choice(PIECES[name]) + text[i:]
        elif op < 0.7:
            text = text[:i] + text[i + 1 :]
        else:
            text = text[:i]
    return text


@pytest.mark.parametrize("name", sorted(PIECES))
def test_random_outputs_stream_like_extract(name: str) -> None:
    """Random well-formed and mangled outputs: eager=False always agrees with extract;
    eager=True too, unless it had already sent a call and extract found none."""
    rng = random.Random(name)
    parser = tool_parser(name)
    with_calls = 0
    for _ in range(250):
        text = random_output(name, rng)
        want = parser.extract(text)
        want_pair = (want.content or "", calls_of(want.tool_calls))
        with_calls += bool(want.tool_calls)
        for chunks in cuttings(text, rng.randint(0, 99))[1:3]:
            assert stream(parser, chunks, eager=False)[:2] == want_pair, (text, chunks)
            content, calls, streamer = stream(parser, chunks, eager=True)
            if (content, calls) != want_pair:
                assert want.tool_calls == [] and streamer.tool_calls_sent > 0, (text, chunks)
    assert 100 < with_calls < 240  # both valid and broken outputs were tried


def test_hostile_input_never_raises() -> None:
    deep = "[" * 50_000 + "]" * 50_000
    for name in TOOL_PARSERS:
        parser = tool_parser(name)
        for text in (
            f'<tool_call>{{"name": "f", "arguments": {deep}}}</tool_call>',
            f'{{"name": "f", "parameters": {{"a": {deep}}}}}',
            f'[TOOL_CALLS]f{{"a": {deep}}}',
            f"[f(a={deep})]",
            "[f(a=" + "(" * 5000 + "1" + ")" * 5000 + ")]",
            "\x00<tool_call>\x00</tool_call>[\x00]",
        ):
            parsed = parser.extract(text)
            assert parsed.content == text and parsed.tool_calls == []
            content, calls, _ = stream(
                parser, [text[i : i + 4096] for i in range(0, len(text), 4096)]
            )
            assert (content, calls) == (text, [])


def test_streaming_long_outputs() -> None:
    """Long outputs fed 3 characters at a time: 200 calls, or one call whose 18 kB
    argument is full of commas, brackets and escapes, in both modes (no timed assertion:
    `--durations` shows this test if streaming turns quadratic)."""
    code = "a, b] (c} \\n" * 1500
    many = [(f"f{i}", {"a": i, "s": "x, ]"}) for i in range(200)]
    outputs = {
        "hermes": "".join(
            f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in many
        ),
        "llama3_json": "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in many),
        "mistral": "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in many),
        "pythonic": "[" + ", ".join(f"{n}(a={a['a']}, s={a['s']!r})" for n, a in many) + "]",
    }
    long_ones = {
        "hermes": f'<tool_call>{{"name": "f", "arguments": {{"code": {json.dumps(code)}}}}}',
        "llama3_json": f'{{"name": "f", "parameters": {{"code": {json.dumps(code)}}}}}',
        "mistral": f"[TOOL_CALLS]f[ARGS]{{{json.dumps('code')}: {json.dumps(code)}}}",
        "pythonic": f"[f(code={code!r}, more=[{', '.join(map(str, range(1500)))}])]",
    }
    for name in TOOL_PARSERS:
        for out, n_calls in ((outputs[name], 200), (long_ones[name], 1)):
            chunks = [out[i : i + 3] for i in range(0, len(out), 3)]
            for eager in (True, False):
                _, calls, _ = stream(tool_parser(name), chunks, eager=eager)
                assert len(calls) == n_calls, (name, n_calls, eager)
