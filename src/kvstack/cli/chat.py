"""``kvstack chat``: an interactive chat in the terminal that streams tokens as they come."""

from __future__ import annotations

import argparse

from kvstack.cli.engine_args import (
    add_engine_args,
    add_sampling_args,
    build_llm,
    sampling_from_args,
)
from kvstack.core.errors import KvstackError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser(
        "chat",
        help="interactive chat that streams tokens as they come",
        description="Chat with the model in the terminal; tokens stream as generated.",
    )
    c.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(c)
    add_engine_args(c)
    c.set_defaults(func=cmd_chat, temperature=0.7, max_tokens=256)


def cmd_chat(a: argparse.Namespace) -> int:
    sp = sampling_from_args(a)
    llm = build_llm(a)
    engine = llm.engine
    history: list[dict[str, str]] = []
    if a.system:
        history.append({"role": "system", "content": a.system})
    print("kvstack chat: type a message, /reset to clear the history, Ctrl-D to quit.")
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            continue
        if line.strip() == "/reset":
            history = history[:1] if a.system else []
            continue
        history.append({"role": "user", "content": line})
        ids = llm.tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        try:
            rid = engine.add_request(None, None, sp, prompt_token_ids=ids)
        except KvstackError as e:
            print(f"error: {e}")
            history.pop()
            continue
        print("bot> ", end="", flush=True)
        shown = 0
        text = ""
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id == rid:
                        text = out.outputs[0].text
                        print(text[shown:], end="", flush=True)
                        shown = len(text)
        except KeyboardInterrupt:
            engine.abort_request(rid)
        print()
        history.append({"role": "assistant", "content": text})
