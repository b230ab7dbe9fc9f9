"""``kvstack generate``: completions for prompts (arguments or a JSONL file), JSONL out."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvstack.cli.engine_args import (
    add_engine_args,
    add_sampling_args,
    build_llm,
    sampling_from_args,
)
from kvstack.core.errors import ConfigError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    g = sub.add_parser(
        "generate",
        help="generate completions for prompts (arguments or a JSONL file)",
        description="Generate completions offline; writes one JSON object per completion.",
    )
    g.add_argument("prompts", nargs="*", help="prompt texts")
    g.add_argument("--input", help="JSONL file: strings or {prompt: ...} / {messages: [...]}")
    g.add_argument("--output", help="write JSONL here instead of stdout")
    g.add_argument("--chat", action="store_true", help="wrap text prompts in the chat template")
    g.add_argument("--token-ids", action="store_true", help="include output token ids")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_sampling_args(g)
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)


def read_jsonl_prompts(path: str) -> list[Any]:
    """Lines: a JSON string, or an object with "prompt" (text) or "messages" (chat)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"input file {path!r} does not exist") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"input file {path!r} is not valid UTF-8 ({e.reason})") from None
    except OSError as e:
        raise ConfigError(f"cannot read input file {path!r}: {e.strerror}") from None
    items: list[Any] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if isinstance(obj, str):
            items.append(obj)
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            items.append(obj["prompt"])
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            items.append(obj["messages"])
        else:
            raise ConfigError(f"{path}:{n}: expected a string or an object with prompt/messages")
    return items


def cmd_generate(a: argparse.Namespace) -> int:
    items: list[Any] = list(a.prompts)
    if a.input:
        items += read_jsonl_prompts(a.input)
    if not items:
        raise ConfigError("no prompts: pass PROMPT arguments or --input FILE.jsonl")
    sp = sampling_from_args(a)
    llm = build_llm(a)
    token_ids = []
    for item in items:
        if isinstance(item, list) or a.chat:
            msgs = item if isinstance(item, list) else [{"role": "user", "content": item}]
            ids = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        else:
            ids = llm.tokenizer.encode(item) if item else []
        token_ids.append(ids)
    outputs = llm.generate(sampling_params=sp, prompt_token_ids=token_ids, use_tqdm=not a.quiet)
    lines = []
    for i, (item, out) in enumerate(zip(items, outputs, strict=True)):
        for c in out.outputs:
            rec = {
                "index": i,
                "n": c.index,
                "prompt": item,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "num_prompt_tokens": len(out.prompt_token_ids),
                "num_output_tokens": len(c.token_ids),
                "num_cached_tokens": out.num_cached_tokens,
            }
            if a.token_ids:
                rec["token_ids"] = c.token_ids
            lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
    if a.output:
        try:
            with open(a.output, "w", encoding="utf-8") as f:
                f.writelines(lines)
        except OSError as e:
            raise ConfigError(f"cannot write output file {a.output!r}: {e.strerror}") from None
    else:
        sys.stdout.writelines(lines)
    if a.print_stats:
        print(json.dumps(llm.get_stats().to_dict()), file=sys.stderr)
    return 0
