"""Reading the request logs of ``kvstack analyze``: formats, timestamps, safety limits.

Three JSONL formats (``--format``): ``tokens`` (``prompt_token_ids``), ``kvstack``
(``prompt_token_ids`` plus the server's ``num_cached_tokens``) and ``openai`` (request
bodies with ``messages`` or ``prompt``, tokenized with ``--tokenizer`` / ``--model``).
Every line may carry a ``timestamp`` (number or ISO 8601) and a session id; when every
request has a timestamp they are sorted by it, else they keep file order.

The log is untrusted input: symlinks and non-regular files are refused, as are files
over ``--max-file-bytes``; lines are streamed with a maximum length and a JSON nesting
limit; malformed lines are reported with their numbers and skipped (``--strict``: the
first one is a ``ConfigError``).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import stat
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kvstack.core.errors import ConfigError, KvstackError

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_FILE_BYTES",
    "DEFAULT_MAX_LINE_BYTES",
    "FORMATS",
    "LogRequest",
    "ParseResult",
    "iter_lines",
    "json_depth",
    "parse_line",
    "read_log",
]

FORMATS = ("openai", "kvstack", "tokens")
DEFAULT_MAX_FILE_BYTES = 512 * 1024 * 1024
DEFAULT_MAX_LINE_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_DEPTH = 64
MAX_TOKEN_ID = 2**31 - 1
MAX_TIMESTAMP = 1e11  # seconds (year 5138): past it a number is not a time
NUM_MALFORMED_SHOWN = 10
_STRING_RE = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_KEEP_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


# ---------------------------------------------------------------------------- input


@dataclass
class LogRequest:
    """One request of the log: prompt token ids and where it came from."""

    line_no: int
    token_ids: array  # 'q' array: compact for long logs
    session_id: str | None = None
    timestamp: float | None = None
    num_cached_tokens: int | None = None  # what the server reported (kvstack format)
    # Segment token ranges (segment reuse; kvstack format, written by ``--request-log``).
    segments: list[tuple[int, int]] | None = None


@dataclass
class ParseResult:
    requests: list[LogRequest]
    num_lines: int = 0
    malformed: list[tuple[int, str]] = field(default_factory=list)  # first few
    num_malformed: int = 0
    ordered_by: str = "file order"


class _Malformed(Exception):
    """A log line that cannot be used; the message says why (reported with its number)."""


def json_depth(line: bytes) -> int:
    """Maximum nesting depth of ``[``/``{`` in a JSON text (brackets in strings ignored)."""
    if line.count(b"[") + line.count(b"{") <= 1:
        return line.count(b"[") + line.count(b"{")
    brackets = _STRING_RE.sub(b"", line).translate(None, _KEEP_BRACKETS)
    depth = best = 0
    for c in brackets:
        depth += 1 if c in (0x5B, 0x7B) else -1
        best = max(best, depth)
    return best


def _open_log(path: str | Path, max_file_bytes: int) -> tuple[int, int]:
    """Open ``path`` read-only without following symlinks; returns (fd, size)."""
    p = Path(path)
    try:
        st = os.lstat(p)
    except OSError as e:
        raise ConfigError(f"cannot read log {str(p)!r}: {e.strerror}") from e
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"refusing to read {str(p)!r}: it is a symlink (pass the real file)")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"refusing to read {str(p)!r}: not a regular file")
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise ConfigError(f"cannot read log {str(p)!r}: {e.strerror}") from e
    size = os.fstat(fd).st_size
    if size > max_file_bytes:
        os.close(fd)
        raise ConfigError(
            f"log {str(p)!r} is {size} bytes, over the limit of {max_file_bytes} "
            "(raise --max-file-bytes)"
        )
    return fd, size


def iter_lines(
    path: str | Path,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    on_bytes: Callable[[int], None] | None = None,
) -> Iterator[tuple[int, bytes | None]]:
    """Stream ``(line number, raw line)``; ``None`` for a line over ``max_line_bytes``."""
    fd, _ = _open_log(path, max_file_bytes)
    total = 0
    with os.fdopen(fd, "rb") as f:
        for line_no in itertools.count(1):
            line = f.readline(max_line_bytes + 1)
            if not line:
                return
            n = len(line)
            too_long = n > max_line_bytes
            while too_long and not line.endswith(b"\n"):  # skip the rest of the line
                line = f.readline(1 << 20)
                if not line:
                    break
                n += len(line)
            total += n
            if total > max_file_bytes:
                raise ConfigError(f"log {str(path)!r} grew past --max-file-bytes while reading")
            if on_bytes is not None:
                on_bytes(n)
            yield line_no, None if too_long else line


def _token_ids(value: Any, what: str) -> array:
    if not isinstance(value, list):
        raise _Malformed(f"{what} must be a list of token ids")
    if not value:
        raise _Malformed(f"{what} is empty")
    for t in value:
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            raise _Malformed(f"{what} holds {_shown(t)}, not a token id")
    return array("q", value)


def _shown(value: Any) -> str:
    """``repr(value)`` cut to 60 characters (a 5,000-digit int cannot even be printed)."""
    try:
        text = repr(value)
    except ValueError:
        return f"<{type(value).__name__} too large to print>"
    return text if len(text) <= 60 else text[:57] + "..."


def _timestamp(value: Any) -> float | None:
    """Seconds as a finite float in ``[0, MAX_TIMESTAMP]`` (``_Malformed`` otherwise: a
    401-digit number overflowed ``float()`` and aborted the whole file)."""
    if value is None:
        return None
    bad = _Malformed(
        f"timestamp {_shown(value)} is neither a number of seconds in [0, {MAX_TIMESTAMP:.0e}] "
        "nor an ISO 8601 time"
    )
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            ts = float(value)
        except OverflowError:
            raise bad from None
    elif isinstance(value, str):
        try:
            ts = datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except (ValueError, OverflowError, OSError):
            raise bad from None
    else:
        raise bad
    if not (math.isfinite(ts) and 0 <= ts <= MAX_TIMESTAMP):
        raise bad
    return ts


def _session(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return str(value)
    raise _Malformed(f"session id {_shown(value)} is not a string")


class _Tokenize:
    """Loads the tokenizer on first use (only the openai format needs one)."""

    def __init__(self, source: str | Path) -> None:
        self.source = source
        self._tok: Any = None

    def get(self) -> Any:
        if self._tok is None:
            from kvstack.model.loader.registry import load_tokenizer

            self._tok = load_tokenizer(self.source)
        return self._tok

    def encode(self, text: str) -> list[int]:
        tokenizer = self.get()
        try:
            return list(tokenizer.encode(text))
        except (KvstackError, ValueError, TypeError) as e:
            raise _Malformed(f"cannot encode prompt: {e}") from e


def _openai_prompts(body: Any, tok: _Tokenize) -> list[array]:
    if not isinstance(body, dict):
        raise _Malformed("request body is not an object")
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise _Malformed("messages must be a list of objects")
        tokenizer = tok.get()
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except (KvstackError, ValueError, TypeError, KeyError) as e:
            raise _Malformed(f"cannot render messages: {e}") from e
        return [_token_ids(list(ids), "rendered messages")]
    if "prompt" not in body:
        raise _Malformed("body has neither 'messages' nor 'prompt'")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [_token_ids(tok.encode(prompt), "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [_token_ids(tok.encode(p), "prompt") for p in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return [_token_ids(p, "prompt") for p in prompt]
    return [_token_ids(prompt, "prompt")]


def _segments(value: Any, num_tokens: int) -> list[tuple[int, int]] | None:
    """Sorted, disjoint ``[start, end)`` ranges inside the prompt (a mark's primer, its
    optional third element, is not part of the range), or a malformed line."""
    if value is None:
        return None
    bad = _Malformed(f"segments {_shown(value)} are not [start, end) ranges of the prompt")
    if not isinstance(value, list):
        raise bad
    out: list[tuple[int, int]] = []
    for mark in value:
        if (
            not isinstance(mark, list)
            or len(mark) not in (2, 3)
            or any(type(x) is not int for x in mark[:2])
            or (len(mark) == 3 and not isinstance(mark[2], list))
        ):
            raise bad
        if not (out[-1][1] if out else 0) <= mark[0] < mark[1] <= num_tokens:
            raise bad
        out.append((mark[0], mark[1]))
    return out


Parsed = tuple[array, str | None, float | None, int | None, list[tuple[int, int]] | None]


def parse_line(obj: Any, fmt: str, session_field: str, tok: _Tokenize | None) -> list[Parsed]:
    """``(token ids, session, timestamp, cached tokens, segments)`` of the request(s) on
    a line."""
    if not isinstance(obj, dict):
        raise _Malformed("line is not a JSON object")
    ts = _timestamp(obj.get("timestamp"))
    if fmt == "openai":
        assert tok is not None
        body = obj.get("body", obj)
        sess = obj.get(session_field)
        if sess is None and isinstance(body, dict):
            sess = body.get(session_field)
        session = _session(sess)
        return [(ids, session, ts, None, None) for ids in _openai_prompts(body, tok)]
    ids = _token_ids(obj.get("prompt_token_ids"), "prompt_token_ids")
    cached = obj.get("num_cached_tokens") if fmt == "kvstack" else None
    if cached is not None and (type(cached) is not int or cached < 0):
        raise _Malformed(f"num_cached_tokens {_shown(cached)} is not a count")
    segments = _segments(obj.get("segments"), len(ids)) if fmt == "kvstack" else None
    return [(ids, _session(obj.get(session_field)), ts, cached, segments)]


def read_log(
    path: str | Path,
    fmt: str = "tokens",
    *,
    session_field: str = "session_id",
    tokenizer: str | Path | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
    strict: bool = False,
    progress: bool = False,
) -> ParseResult:
    """Parse a JSONL request log (streamed; see the module docstring for the safety rules)."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown log format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    tok = _Tokenize(tokenizer or "default") if fmt == "openai" else None
    res = ParseResult([])
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=_file_size(path), unit="B", unit_scale=True, desc="reading", leave=False)
    try:
        lines = iter_lines(path, max_file_bytes, max_line_bytes, bar.update if bar else None)
        for line_no, raw in lines:
            res.num_lines = line_no
            if raw is not None and not raw.strip():
                continue
            try:
                if raw is None:
                    raise _Malformed(f"line longer than {max_line_bytes} bytes")
                if json_depth(raw) > max_depth:
                    raise _Malformed(f"JSON nested deeper than {max_depth} levels")
                try:
                    obj = json.loads(raw)
                except RecursionError as e:
                    raise _Malformed("JSON nested too deeply") from e
                except ValueError as e:
                    raise _Malformed(f"invalid JSON ({e})") from e
                try:
                    parsed = parse_line(obj, fmt, session_field, tok)
                except (ArithmeticError, ValueError, TypeError) as e:  # a check missed it
                    raise _Malformed(f"unreadable value ({type(e).__name__})") from None
                for ids, sess, ts, cached, segs in parsed:
                    res.requests.append(LogRequest(line_no, ids, sess, ts, cached, segs))
            except _Malformed as e:
                if strict:
                    raise ConfigError(f"{path}:{line_no}: malformed line: {e}") from None
                res.num_malformed += 1
                if len(res.malformed) < NUM_MALFORMED_SHOWN:
                    res.malformed.append((line_no, str(e)))
    finally:
        if bar is not None:
            bar.close()
    stamps = [r.timestamp for r in res.requests]
    if res.requests and all(t is not None for t in stamps):
        res.requests.sort(key=lambda r: r.timestamp or 0.0)  # stable: ties keep file order
        res.ordered_by = "timestamp"
    return res


def _file_size(path: str | Path) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0
