"""Structured outputs with llguidance (guidance-ai/llguidance), as vLLM's ``guidance`` backend.

Why llguidance (``benchmarks/grammar_backends.py`` on the default model's 49,152-token
vocabulary; the README has the table): it compiles the test schemas in about a
millisecond where xgrammar takes up to ten times as long, so a new schema per request
costs nothing; xgrammar's masks are faster (a few us a token against tens of us), but
both stay far below a decode step. llguidance covers JSON schema, regex, Lark with
embedded JSON schemas (``%json``, used for forced tool calls) and GBNF natively, rolls
back (speculation), and ships as one small wheel, while xgrammar pulls in triton
(hundreds of MB) on a CPU-only install.

Mapping of constraints (vLLM's ``vllm/v1/structured_output/backend_guidance.py`` does the
same): a schema through ``grammar_from_json_schema`` with flexible whitespace unless
``disable_any_whitespace`` (bounded by ``JSON_WHITESPACE`` unless the request gives a
``whitespace_pattern``), objects closed where the schema leaves other keys open
(``closed_objects``: xgrammar's strict default, which vLLM users get); ``json_object``
as the schema ``{"type": "object"}``; a regex as a regex grammar (Rust ``regex``
syntax); a choice as the Lark rule ``start: "a" | "b"`` (JSON-quoted literals); a
grammar as Lark, or GBNF when it uses ``::=``. Each grammar is checked with the
tokenizer and bounded ``LLParserLimits`` at compile time, so an invalid or unsupported
one is a 400 before anything is queued.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.torch
import torch

from kvstack.core.errors import InvalidRequestError
from kvstack.core.structured_outputs import StructuredOutputsParams, closed_objects
from kvstack.model.structured.backend import GrammarMatcher

# Bounded grammar size and per-step work (llguidance's defaults are 500k symbols and
# 200k lexer fuel per step; these keep a hostile grammar under ~50 ms of compile time).
_MAX_GRAMMAR_SIZE = 200_000
_INITIAL_LEXER_FUEL = 1_000_000
_STEP_LEXER_FUEL = 200_000


# Whitespace allowed between JSON tokens unless a request sets its own: enough for
# pretty-printed JSON (a line break, then an indent), never an endless run. llguidance's
# and xgrammar's default (vLLM's) is any run of whitespace, which a small model sampling
# at temperature 1 can fill until max_tokens.
JSON_WHITESPACE = r"(\r?\n)?[ \t]{0,20}"


class LLGuidanceMatcher:
    """One request's position in its grammar (wraps ``llguidance.LLMatcher``)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        return bool(self.matcher.consume_token(token))

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())

    def error(self) -> str | None:
        return _short(self.matcher.get_error()) or None if self.matcher.is_error() else None


class LLGuidanceGrammar:
    """A compiled constraint: a fresh matcher is a deep copy of the compiled one."""

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self.template = template

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.template.deep_copy())


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) of a validated constraint."""
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
            if not params.disable_any_whitespace:
                options["whitespace_pattern"] = params.whitespace_pattern or JSON_WHITESPACE
            schema = json.loads(params.spec_text())
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(closed_objects(schema)) if kind == "json" else schema,
                defaults=options,  # type: ignore[arg-type]  # JsonCompileOptions (TypedDict)
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(str(params.regex))
        if kind == "choice":
            alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice or [])
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alts}\n")
        text = str(params.grammar)
        return llguidance.grammar_from("gbnf" if "::=" in text else "lark", text)
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"invalid {kind}: {e}", param=params.param) from None


class LLGuidanceBackend:
    """llguidance over one tokenizer (its ``tokenizers`` JSON), EOS = the model's stops."""

    def __init__(self, vocab_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = llguidance.LLTokenizer(
            vocab_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )
        self.limits = llguidance.LLParserLimits(
            max_grammar_size=_MAX_GRAMMAR_SIZE,
            initial_lexer_fuel=_INITIAL_LEXER_FUEL,
            step_lexer_fuel=_STEP_LEXER_FUEL,
            verbose_errors=False,  # errors never quote the parser state or whole grammar
        )
        self.executor = llguidance.LLExecutor()

    def compile(self, params: StructuredOutputsParams) -> LLGuidanceGrammar:
        grammar = grammar_text(params)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=self.limits)
        if error and not error.startswith("WARNING"):
            raise InvalidRequestError(f"invalid {params.kind}: {_short(error)}", param=params.param)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise InvalidRequestError(
                f"invalid {params.kind}: {_short(matcher.get_error())}", param=params.param
            )
        return LLGuidanceGrammar(matcher)

    def fill_bitmask(self, rows: list[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        pairs = []
        for m, row in rows:
            assert isinstance(m, LLGuidanceMatcher), "a matcher of another backend"
            pairs.append((m.matcher, row))
        llguidance.torch.fill_next_token_bitmask_par(self.executor, pairs, bitmask)


def _short(message: str, limit: int = 500) -> str:
    """An llguidance error, one line, bounded (errors can quote the whole grammar)."""
    line = " ".join(message.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
