"""``serve/chat/tool_prompt.py``: the Hermes-style fallback for templates without tools.

The strongest check: a ChatML template (SmolLM2's) fed ``fallback_messages`` renders the
same prompt, byte for byte, as Qwen 2.5's own tool template fed the original messages.
"""

from __future__ import annotations

import copy
import json

import pytest

from kvstack.core.errors import InvalidRequestError
from kvstack.model.tokenizer.chat_template import render_chat_template
from kvstack.serve.chat.tool_parsers import tool_parser
from kvstack.serve.chat.tool_prompt import (
    fallback_messages,
    template_messages_with_tools,
    template_supports_tools,
    tools_system_prompt,
)

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen2.5-Instruct's chat template (tokenizer_config.json), as published.
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def call(name: str, arguments: str, id_: str = "call_1") -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Zürich, and the time?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            call("get_weather", '{"city": "Paris"}', "call_a"),
            call("get_weather", '{"city":"Zürich"}', "call_b"),
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_b", "name": "get_weather", "content": "rain"},
    {"role": "assistant", "content": "Checking the time.", "tool_calls": [call("get_time", "")]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
]

SECTION = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}'
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def test_tools_section_exact() -> None:
    assert tools_system_prompt([TIME]) == SECTION
    assert tools_system_prompt([TIME], "You must call get_time.") == (
        SECTION + "\n\nYou must call get_time."
    )


def test_fallback_exact_messages() -> None:
    before = copy.deepcopy(CONVERSATION)
    out = fallback_messages(CONVERSATION, [TIME])
    assert before == CONVERSATION  # inputs untouched
    assert out == [
        {"role": "system", "content": "You are terse.\n\n" + SECTION},
        {"role": "user", "content": "Weather in Paris and Zürich, and the time?"},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}'
            "\n</tool_call>",
        },
        {
            "role": "user",
            "content": '<tool_response>\n{"temp": 21}\n</tool_response>\n'
            "<tool_response>\nrain\n</tool_response>",
        },
        {
            "role": "assistant",
            "content": 'Checking the time.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
            "</tool_call>",
        },
        {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"},
    ]


def test_fallback_inserts_system_and_desc() -> None:
    out = fallback_messages([{"role": "user", "content": "hi"}], [TIME], "Call get_time.")
    assert out == [
        {"role": "system", "content": SECTION + "\n\nCall get_time."},
        {"role": "user", "content": "hi"},
    ]
    assert fallback_messages([{"role": "user", "content": "hi"}], []) == [
        {"role": "user", "content": "hi"}
    ]


def test_fallback_through_chatml_equals_qwen25_template() -> None:
    tools = [WEATHER, TIME]
    qwen = render_chat_template(
        QWEN25_TEMPLATE, template_messages_with_tools(CONVERSATION), tools=tools
    )
    chatml = render_chat_template(SMOLLM2_TEMPLATE, fallback_messages(CONVERSATION, tools))
    assert chatml == qwen
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n' in chatml


def test_model_answer_in_the_fallback_format_parses_back() -> None:
    """What the prompt asks for is exactly what the hermes parser reads."""
    assistant = fallback_messages(CONVERSATION, [TIME])[2]["content"]
    parsed = tool_parser("hermes").extract(assistant)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Zürich"}),
    ]


def test_template_messages_with_tools_like_vllm() -> None:
    msgs = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": []},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                call("a", '{"k": [1, 2]}'),
                call("b", "not json"),
                call("c", "[1]"),
                call("d", ""),
                {"type": "function", "function": {"name": "e", "arguments": {"z": 1}}},
            ],
        },
    ]
    before = copy.deepcopy(msgs)
    out = template_messages_with_tools(msgs)
    assert msgs == before
    assert out[1] == {"role": "assistant", "content": ""}  # empty tool_calls dropped
    args = [c["function"]["arguments"] for c in out[2]["tool_calls"]]
    assert args == [{"k": [1, 2]}, {}, {}, {}, {"z": 1}]
    assert out[2]["tool_calls"][0]["id"] == "call_1"


@pytest.mark.parametrize(
    "bad", [["x"], [{"type": "code", "function": {}}], [{"type": "function"}], "call"]
)
def test_malformed_tool_calls_are_400(bad: object) -> None:
    msgs = [{"role": "assistant", "content": None, "tool_calls": bad}]
    for fn in (template_messages_with_tools, lambda m: fallback_messages(m, [TIME])):
        with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.tool_calls"):
            fn(msgs)


def test_template_supports_tools() -> None:
    assert template_supports_tools(QWEN25_TEMPLATE)
    assert not template_supports_tools(SMOLLM2_TEMPLATE)
    assert not template_supports_tools("{{ 'We have tools.' }} tools {{ messages }}")
    assert template_supports_tools(
        "{%- if not tools is defined %}{%- set tools = none %}{%- endif %}{{ tools }}"
    )
    assert template_supports_tools("{% for t in tools %}{{ t }}{% break %}{% endfor %}")
    assert template_supports_tools("{{ tools | tojson }} {% unknowntag %}")  # parse fails
