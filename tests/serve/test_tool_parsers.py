"""Tool-call parsers (``serve/tool_parsers``): each format's extraction, the same through
streaming, vLLM's argument JSON, the registry, and known-name filtering.

The streaming property: for every text and every way of cutting it into deltas, the
joined content deltas equal ``extract``'s content ("" for None) and the assembled calls
equal ``extract``'s calls (ids aside). ``eager=False`` always; ``eager=True`` except when a
call was already sent and later text is malformed (``test_eager_divergence`` in
``test_tool_streaming.py``).
"""

from __future__ import annotations

import json
import re

import pytest

from kvstack.core.errors import ConfigError
from kvstack.serve.chat.tool_parsers import TOOL_PARSERS, ToolParser, tool_parser
from tool_parser_util import Call, assert_streams_like_extract, calls_of, stream

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
