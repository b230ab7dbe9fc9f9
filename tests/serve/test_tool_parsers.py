"""Tool-call parsers (``serve/tool_parsers``): each format, bad input, and streaming.

The streaming property: for every text and every way of cutting it into deltas, the
joined content deltas equal ``extract``'s content ("" for None) and the assembled calls
equal ``extract``'s calls (ids aside). ``eager=False`` always; ``eager=True`` except when a
call was already sent and later text is malformed (``test_eager_divergence``).
"""

from __future__ import annotations

import json
import random
import re

import pytest

from kvstack.errors import ConfigError
from kvstack.serve.tool_parsers import (
    TOOL_PARSERS,
    ContentDelta,
    ToolCallDelta,
    ToolParser,
    ToolStreamer,
    tool_parser,
)

Call = tuple[str, dict]


def calls_of(parsed_calls: list) -> list[Call]:
    return [(c.name, json.loads(c.arguments)) for c in parsed_calls]


def stream(
    parser: ToolParser,
    chunks: list[str],
    known: set[str] | None = None,
    eager: bool = True,
) -> tuple[str, list[Call], ToolStreamer]:
    """Feed ``chunks``; the joined content and the calls assembled from the deltas."""
    streamer = ToolStreamer(parser, known_names=known, eager=eager)
    events = [e for c in chunks for e in streamer.feed(c)] + streamer.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    headers: list[ToolCallDelta] = []
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.id is not None:
                assert e.index == len(headers) and e.arguments == "" and e.name
                assert re.fullmatch(r"call_[0-9a-f]{24}", e.id)
                headers.append(e)
                args[e.index] = ""
            else:
                assert e.index in args, "arguments before the call's header"
                args[e.index] += e.arguments
    assert streamer.tool_calls_sent == len(headers)
    calls = [(h.name or "", json.loads(args[h.index])) for h in headers]
    return content, calls, streamer


def cuttings(text: str, seed: int = 0) -> list[list[str]]:
    """Whole, char by char, and random chunk sizes (1-8) under three seeds."""
    cuts = [[text], list(text)]
    for s in range(3):
        rng = random.Random(seed * 31 + s)
        chunks, i = [], 0
        while i < len(text):
            n = rng.randint(1, 8)
            chunks.append(text[i : i + n])
            i += n
        cuts.append(chunks)
    return cuts


def assert_streams_like_extract(
    name: str, text: str, known: set[str] | None = None, eager_too: bool = True
) -> None:
    parser = tool_parser(name)
    want = parser.extract(text, known)
    want_content, want_calls = want.content or "", calls_of(want.tool_calls)
    for seed, chunks in enumerate(cuttings(text)):
        modes = (False, True) if eager_too else (False,)
        for eager in modes:
            content, calls, _ = stream(parser, chunks, known, eager)
            assert (content, calls) == (want_content, want_calls), (name, text, chunks, eager, seed)


# name, text, content, calls
CASES: list[tuple[str, str, str | None, list[Call]]] = [
    # hermes
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "hermes",
        'Let me check.\n<tool_call>{"name":"a","arguments":{"x":1}}</tool_call>\n'
        'between<tool_call>{"name":"b","arguments":{}}</tool_call> after',
        "Let me check.\n",
        [("a", {"x": 1}), ("b", {})],
    ),
    ("hermes", '\n\n<tool_call>{"name": "a", "arguments": {}}</tool_call>', None, [("a", {})]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": }</tool_call>', "<same>", []),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": NaN}}</tool_call>', "<same>", []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', "<same>", []),
    ("hermes", '<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "<same>", []),
    ("hermes", '<tool_call>{"name": "a"}</tool_call>', None, [("a", {})]),
    ("hermes", '<tool_call>{"name": "a", "arguments": "{\\"k\\": 2}"}', None, [("a", {"k": 2})]),
    (
        "hermes",
        '<tool_call>\n{"name": "a", "arguments": {"q": 1}}\n</tool_',
        None,
        [("a", {"q": 1})],
    ),
    ("hermes", "<tool_call>", "<same>", []),
    ("hermes", "plain answer, no tools <tool", "<same>", []),
    ("hermes", "", "", []),
    (
        "hermes",
        '<tool_call>{"name": "météo", "arguments": {"ville": "Zürich", "ciel": "🌧 雨"}}'
        "</tool_call>",
        None,
        [("météo", {"ville": "Zürich", "ciel": "🌧 雨"})],
    ),
    (
        "hermes",
        '<tool_call>{"name": "q", "arguments": {"f": {"tags": ["a", {"b": [1, 2.5, null, true]}],'
        ' "s": "}</tool_call>"}}}</tool_call>',
        "<same>",  # the end tag inside a string ends the block early, as in vLLM
        [],
    ),
    (
        "hermes",
        '<tool_call>{"name": "q", "arguments": {"f": {"tags": ["a", {"b": [1, 2.5, null, true]}]'
        ', "s": "x}{]["}}}</tool_call>',
        None,
        [("q", {"f": {"tags": ["a", {"b": [1, 2.5, None, True]}], "s": "x}{]["}})],
    ),
    # llama3_json
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}', None, [("f", {"a": 1})]),
    (
        "llama3_json",
        '{"name": "f", "arguments": {"a": 1}}; {"name": "g", "parameters": {}}',
        None,
        [("f", {"a": 1}), ("g", {})],
    ),
    (
        "llama3_json",
        '  {"name": "f", "parameters": {}}\n{"name": "g", "parameters": {"x": [1, {"y": "é"}]}}',
        None,
        [("f", {}), ("g", {"x": [1, {"y": "é"}]})],
    ),
    (
        "llama3_json",
        'Sure.<|python_tag|>{"name": "f", "parameters": {"a": "b"}}',
        "Sure.",
        [("f", {"a": "b"})],
    ),
    ("llama3_json", 'Here: {"name": "f", "parameters": {}}', "<same>", []),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}', "<same>", []),
    ("llama3_json", '{"a": 1} is a JSON object', "<same>", []),
    ("llama3_json", '{"name": "f"}', "<same>", []),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")', "<same>", []),
    ("llama3_json", "<|python_tag|>", "<same>", []),
    ("llama3_json", '{"name": "f", "parameters": {}} that is all', None, [("f", {})]),
    ("llama3_json", '{"name": "f", "parameters": {}}; {"a": 1}', "<same>", []),
    (
        "llama3_json",
        '{"name": "f", "parameters": {"p": 1}, "arguments": {"a": 2}}',
        None,
        [("f", {"a": 2})],
    ),
    ("llama3_json", "a <|python_ta", "<same>", []),
    # mistral
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
        None,
        [("f", {"a": 1}), ("g", {})],
    ),
    (
        "mistral",
        'Hello[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}</s>',
        "Hello",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    ("mistral", '[TOOL_CALLS]add{"a": 3.5, "b": 4}', None, [("add", {"a": 3.5, "b": 4})]),
    ("mistral", '[TOOL_CALLS]f[CALL_ID]abc123XYZ[ARGS]{"x": 1}', None, [("f", {"x": 1})]),
    (
        "mistral",
        '[TOOL_CALLS]echo[ARGS]{"text": "[TOOL_CALLS] inside ünïcode"}',
        None,
        [("echo", {"text": "[TOOL_CALLS] inside ünïcode"})],
    ),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": }', "<same>", []),
    ("mistral", "[TOOL_CALLS]Sorry, I cannot {do that}", "<same>", []),
    ("mistral", "[TOOL_CALLS] []", "<same>", []),
    ("mistral", "[TOOL_CALLS]", "<same>", []),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}]', "<same>", []),
    ("mistral", "no calls here [TOOL_CA", "<same>", []),
    # pythonic
    (
        "pythonic",
        '[get_weather(city="Paris", days=3)]',
        None,
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    ("pythonic", '\n[f(a=1, b="x"), g()]\n', None, [("f", {"a": 1, "b": "x"}), ("g", {})]),
    (
        "pythonic",
        '[f(x=[1, -2.5, {\'k\': (True, None)}], y=\'it\\\'s, ]\', z="""a\nb""")]',
        None,
        [("f", {"x": [1, -2.5, {"k": [True, None]}], "y": "it's, ]", "z": "a\nb"})],
    ),
    (
        "pythonic",
        "[météo(ville='Zürich', ciel='🌧')]",
        None,
        [("météo", {"ville": "Zürich", "ciel": "🌧"})],
    ),
    ("pythonic", "[f(a=1),]", None, [("f", {"a": 1})]),
    ("pythonic", "[f\n(a=1),\n  g(\n b=2,\n)]", None, [("f", {"a": 1}), ("g", {"b": 2})]),
    ("pythonic", '[f(x=os.system("echo pwned"))]', "<same>", []),
    ("pythonic", '[f(x=__import__("os"))]', "<same>", []),
    ("pythonic", "[f(1)]", "<same>", []),
    ("pythonic", "[a.b(x=1)]", "<same>", []),
    ("pythonic", "[f(**kw)]", "<same>", []),
    ("pythonic", "[f(x=1)[0]]", "<same>", []),
    ("pythonic", '[f(x=f"{y}")]', "<same>", []),
    ("pythonic", "[f(x=b'raw'), g(y=1j)]", "<same>", []),
    ("pythonic", "[f(x=1e999)]", "<same>", []),
    ("pythonic", "[f(x=1)  # comment\n]", "<same>", []),
    ("pythonic", "[1, 2, 3] are numbers", "<same>", []),
    ("pythonic", "[]", "<same>", []),
    ("pythonic", "[f(x=1) g(y=2)]", "<same>", []),
    ("pythonic", "[f(x=1", "<same>", []),
    ("pythonic", "Sure: [f(x=1)]", "<same>", []),
    ("pythonic", "   ", "   ", []),
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_extract(name: str, text: str, content: str | None, calls: list[Call]) -> None:
    parsed = tool_parser(name).extract(text)
    assert parsed.content == (text if content == "<same>" else content)
    assert calls_of(parsed.tool_calls) == calls
    for call in parsed.tool_calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)


# Texts where eager=True already sent a call before later text turned out malformed.
EAGER_DIVERGES = {'{"name": "f", "parameters": {}}; {"a": 1}'}


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_streaming_matches_extract(
    name: str, text: str, content: str | None, calls: list[Call]
) -> None:
    assert_streams_like_extract(name, text, eager_too=text not in EAGER_DIVERGES)
    if text in EAGER_DIVERGES:
        _, sent, _ = stream(tool_parser(name), list(text), eager=True)
        assert sent and not calls


def test_arguments_are_vllm_json() -> None:
    parsed = tool_parser("hermes").extract(
        '<tool_call>{"name": "f", "arguments": {"city":"Zürich","n":[1,2]}}</tool_call>'
    )
    assert parsed.tool_calls[0].arguments == '{"city": "Zürich", "n": [1, 2]}'
    assert parsed.tool_calls[0].to_openai() == {
        "id": parsed.tool_calls[0].id,
        "type": "function",
        "function": {"name": "f", "arguments": '{"city": "Zürich", "n": [1, 2]}'},
    }


def test_registry() -> None:
    assert TOOL_PARSERS.names() == ("hermes", "llama3_json", "mistral", "pythonic")
    for name in TOOL_PARSERS:
        parser = tool_parser(name)
        assert isinstance(parser, ToolParser) and parser.name == name
    with pytest.raises(ConfigError, match="unknown --tool-call-parser 'nope'; choose one of"):
        tool_parser("nope")


def test_known_names_drop_unknown_calls_like_vllm_validation() -> None:
    text = (
        'Hi <tool_call>{"name": "ghost", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "real", "arguments": {"a": 1}}</tool_call>'
    )
    parser = tool_parser("hermes")
    assert calls_of(parser.extract(text).tool_calls) == [("ghost", {}), ("real", {"a": 1})]
    parsed = parser.extract(text, {"real"})
    assert parsed.content == "Hi " and calls_of(parsed.tool_calls) == [("real", {"a": 1})]
    assert parser.extract(text, set()).tool_calls == []
    for known in ({"real"}, set(), {"ghost", "real"}):
        assert_streams_like_extract("hermes", text, known)
    _, calls, streamer = stream(parser, list(text), {"real"})
    assert calls == [("real", {"a": 1})] and streamer.tool_calls_sent == 1


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
