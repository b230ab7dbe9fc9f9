"""What a request's output must match: vLLM's ``StructuredOutputsParams``.

Exactly one constraint is set per request (vLLM's rule)::

    json         a JSON schema (dict or its text)      response_format json_schema, guided_json
    json_object  any JSON object                       response_format json_object
    regex        a regular expression (Rust syntax)    guided_regex
    choice       one of a list of strings              guided_choice
    grammar      a Lark or GBNF grammar                guided_grammar

The grammar engine (``model/structured/``) compiles the constraint into a matcher that
masks the vocabulary at each step; this module only checks the shape of the request, so
it stays in layer 0 (imports nothing but the errors). ``key()`` identifies a compiled
grammar: equal keys share one compilation (the manager's cache).

Limits (bad input must not cost unbounded compile time or memory): a constraint's text
is at most ``MAX_SPEC_BYTES`` (a larger one is rejected with status 413), a choice list
at most ``MAX_CHOICES`` entries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvstack.core.errors import InvalidRequestError

MAX_SPEC_BYTES = 64 * 1024
MAX_CHOICES = 1024
MAX_SCHEMA_DEPTH = 128  # nesting of a JSON schema (objects and arrays)
KINDS = ("json", "json_object", "regex", "choice", "grammar")


class SpecTooLargeError(InvalidRequestError):
    """A constraint larger than ``MAX_SPEC_BYTES`` (the server answers 413)."""


@dataclass
class StructuredOutputsParams:
    """One output constraint; ``param`` names the request field it came from (errors)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # vLLM's option: no whitespace between JSON tokens beyond single separators.
    disable_any_whitespace: bool = False
    # JSON only: the whitespace allowed between tokens (a regex; vLLM's
    # guided_whitespace_pattern). None: the backend's default.
    whitespace_pattern: str | None = None
    param: str = field(default="structured_outputs", compare=False)

    @property
    def kind(self) -> str:
        set_kinds = self._set_kinds()
        return set_kinds[0] if set_kinds else ""

    def _set_kinds(self) -> list[str]:
        present = {
            "json": self.json is not None,
            "json_object": bool(self.json_object),
            "regex": self.regex is not None,
            "choice": self.choice is not None,
            "grammar": self.grammar is not None,
        }
        return [k for k in KINDS if present[k]]

    def spec_text(self) -> str:
        """The constraint as one string (schemas as compact JSON)."""
        kind = self.kind
        if kind == "json":
            if isinstance(self.json, str):
                return self.json
            return json.dumps(self.json, ensure_ascii=False, separators=(",", ":"))
        if kind == "json_object":
            return '{"type":"object"}'
        if kind == "choice":
            return json.dumps(self.choice, ensure_ascii=False)
        return str(self.regex if kind == "regex" else self.grammar)

    def key(self) -> tuple[str, str, bool, str | None]:
        return (self.kind, self.spec_text(), self.disable_any_whitespace, self.whitespace_pattern)

    def validate(self) -> None:
        """Raise ``InvalidRequestError`` (param set) unless exactly one valid constraint."""
        kinds = self._set_kinds()
        if len(kinds) != 1:
            what = "none" if not kinds else ", ".join(kinds)
            raise InvalidRequestError(
                f"structured outputs need exactly one of {', '.join(KINDS)}; got {what}",
                param=self.param,
            )
        kind = kinds[0]
        if kind == "json" and not isinstance(self.json, dict | str):
            raise InvalidRequestError("a JSON schema must be an object", param=self.param)
        if kind == "json" and isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except (ValueError, RecursionError) as e:
                raise InvalidRequestError(
                    f"the JSON schema is not valid JSON: {e}", param=self.param
                ) from None
            if not isinstance(parsed, dict | bool):
                raise InvalidRequestError("a JSON schema must be an object", param=self.param)
        if kind == "json" and _depth(self.json if isinstance(self.json, dict) else parsed) > (
            MAX_SCHEMA_DEPTH
        ):
            raise InvalidRequestError(
                f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels", param=self.param
            )
        if kind == "choice":
            self._check_choices()
        if kind in ("regex", "grammar") and not str(self.regex or self.grammar or "").strip():
            raise InvalidRequestError(f"the {kind} is empty", param=self.param)
        try:
            size = len(self.spec_text().encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidRequestError(
                f"the {kind} is not valid Unicode (a lone surrogate)", param=self.param
            ) from None
        if size > MAX_SPEC_BYTES:
            raise SpecTooLargeError(
                f"the {kind} constraint is larger than {MAX_SPEC_BYTES} bytes", param=self.param
            )

    def _check_choices(self) -> None:
        c = self.choice
        if not isinstance(c, list) or not c or not all(isinstance(s, str) and s for s in c):
            raise InvalidRequestError(
                "choice must be a non-empty list of non-empty strings", param=self.param
            )
        if len(c) > MAX_CHOICES:
            raise InvalidRequestError(f"at most {MAX_CHOICES} choices", param=self.param)


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value (iterative: never recurses)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists
    ``properties`` and says nothing about other keys, as xgrammar's strict mode does (vLLM's
    default backend; vLLM's guidance backend does it with ``disable_additional_properties``).
    Without it a small model invents keys until ``max_tokens``. The input is not changed."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in schema[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [closed_objects(sub) for sub in schema[key]]
    for key in _SCHEMAS:
        if key in schema:
            out[key] = closed_objects(schema[key])
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if isinstance(schema.get("properties"), dict) and not any(k in schema for k in open_keys):
        out["additionalProperties"] = False
    return out
