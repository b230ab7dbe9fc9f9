"""``kvstack analyze LOGS.jsonl``: is my traffic cacheable?

Replays a request log through the engine's *own* prefix cache (``KVCacheManager`` with
the hash-chain cache and its LRU / LFU / adaptive eviction policies) at several cache
sizes and reports hit rates, the within- vs cross-session split, the most shared
prefixes and the knee of the hit-rate-vs-size curve. Inspired by kv-cache-analyzer and
vLLM's proposed ``analyze-prefix-cache`` tool.

Replay (per policy and cache size, requests one at a time, in timestamp order when every
line has one, else file order), exactly what the scheduler does at admission::

    computed = kv.get_computed_blocks(req)                      # longest cached prefix
    kv.allocate_slots(req, req.num_tokens - len(computed) * bs, computed)
    req.num_computed_tokens = req.num_tokens                    # prefill done
    kv.free(req)                                                # finished: full blocks stay cached

A request larger than the pool (``allocate_slots`` returns None) counts as a miss.
Hit tokens are ``len(computed) * block_size``. Like the engine, the analyzer never
reuses a prompt's last token: a hit covers at most ``(n - 1) // block_size`` blocks, so
even an infinite cache cannot reach a 100 % token hit rate.

Policies besides the engine's: ``none`` (no cache: 0 hits) and ``oracle``, Belady's MIN
(L. A. Belady, "A study of replacement algorithms for a virtual-storage computer",
IBM Systems Journal 5(2), 1966): evict the cached block whose next use lies farthest in
the future. It is plugged into the same ``KVCacheManager`` as an ``EvictionPolicy``
that is told the future, and serves as the practical upper bound for any online policy
(with chained prefix blocks it is not provably optimal, but parents are always needed
no later than their children, so it keeps chains intact).

Within vs cross session: a hit block is *within-session* when the first request that
stored its hash in the log (= the first request whose full blocks include it) has the
same session id as the hitting request; otherwise (another session, or no session id)
it is *cross-session*.

The log is untrusted input: symlinks and non-regular files are refused, as are files
over ``--max-file-bytes``; lines are streamed with a maximum length and a JSON nesting
limit; malformed lines are reported with their numbers and skipped (``--strict``: the
first one is a ``ConfigError``).
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import os
import re
import stat
import sys
from array import array
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

from kvstack.config import parse_size
from kvstack.errors import ConfigError, KvstackError
from kvstack.kv.hashing import BlockHash, hash_blocks, root_hash
from kvstack.kv.manager import KVCacheManager
from kvstack.kv.policies import EvictionPolicy
from kvstack.request import Request, SamplingParams
from kvstack.tools.analyze_report import (
    check_cache_regression,
    find_knee,
    format_report,
    write_plot,
)

__all__ = [
    "AnalyzeOptions",
    "LogRequest",
    "OraclePolicy",
    "ParseResult",
    "PolicyResult",
    "add_analyze_args",
    "analyze",
    "check_cache_regression",
    "find_knee",
    "read_log",
    "replay",
    "run_analyze",
]

FORMATS = ("openai", "kvstack", "tokens")
ALL_POLICIES = ("lru", "lfu", "adaptive", "oracle", "none")
ENGINE_POLICIES = ("lru", "lfu", "adaptive")
DEFAULT_MAX_FILE_BYTES = 512 * 1024 * 1024
DEFAULT_MAX_LINE_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_DEPTH = 64
MAX_TOKEN_ID = 2**31 - 1
NUM_MALFORMED_SHOWN = 10
KNEE_TOLERANCE = 0.02
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


@dataclass
class ParseResult:
    requests: list[LogRequest]
    num_lines: int = 0
    malformed: list[tuple[int, str]] = field(default_factory=list)  # first few
    num_malformed: int = 0
    ordered_by: str = "file order"


class _Malformed(Exception):
    pass


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
            raise _Malformed(f"{what} holds {t!r}, not a token id")
    return array("q", value)


def _timestamp(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    raise _Malformed(f"timestamp {value!r} is neither a number nor an ISO 8601 time")


def _session(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return str(value)
    raise _Malformed(f"session id {value!r} is not a string")


class _Tokenize:
    """Loads the tokenizer on first use (only the openai format needs one)."""

    def __init__(self, source: str | Path) -> None:
        self.source = source
        self._tok: Any = None

    def get(self) -> Any:
        if self._tok is None:
            from kvstack.model.registry import load_tokenizer

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


def parse_line(
    obj: Any, fmt: str, session_field: str, tok: _Tokenize | None
) -> list[tuple[array, str | None, float | None, int | None]]:
    """``(token ids, session, timestamp, cached tokens)`` of the request(s) on a line."""
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
        return [(ids, session, ts, None) for ids in _openai_prompts(body, tok)]
    ids = _token_ids(obj.get("prompt_token_ids"), "prompt_token_ids")
    cached = obj.get("num_cached_tokens") if fmt == "kvstack" else None
    if cached is not None and (type(cached) is not int or cached < 0):
        raise _Malformed(f"num_cached_tokens {cached!r} is not a count")
    return [(ids, _session(obj.get(session_field)), ts, cached)]


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
                for ids, sess, ts, cached in parse_line(obj, fmt, session_field, tok):
                    res.requests.append(LogRequest(line_no, ids, sess, ts, cached))
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


# ---------------------------------------------------------------------------- oracle


class OraclePolicy(EvictionPolicy):
    """Belady's MIN (1966): evict the candidate whose next use is farthest in the future.

    ``uses[key]`` is the sorted list of request indices that will *hit* ``key`` (the
    block lies within their first ``(n - 1) // block_size`` blocks); ``advance(t)`` sets
    the clock to request ``t``. A key's next use is its first use ``>= clock``, or
    infinity. Candidates sit in a max-heap of ``(next use, release order)`` with lazy
    deletion; since a next use only changes when the clock passes it, ``advance``
    re-pushes the candidates the previous request needed. Ties evict the earliest
    released key (a chain's tail is released first, and its parent is never needed
    later than it).
    """

    name: ClassVar[str] = "oracle"
    INF: ClassVar[int] = sys.maxsize

    def __init__(
        self,
        capacity: int,
        uses: dict[BlockHash, list[int]],
        needs: Sequence[Sequence[BlockHash]],
    ) -> None:
        super().__init__(capacity)
        self.uses = uses
        self.needs = needs
        self.clock = 0
        self._cached: set[Hashable] = set()
        self._cand: dict[Hashable, int] = {}  # candidate -> release sequence number
        self._heap: list[tuple[int, int, Hashable]] = []
        self._seq = itertools.count()

    def next_use(self, key: Hashable) -> int:
        uses = self.uses.get(key, ())  # type: ignore[call-overload]
        i = bisect.bisect_left(uses, self.clock)
        return uses[i] if i < len(uses) else self.INF

    def _push(self, key: Hashable) -> None:
        heapq.heappush(self._heap, (-self.next_use(key), self._cand[key], key))

    def advance(self, t: int) -> None:
        """Move the clock to request ``t`` (requests are replayed in index order)."""
        old, self.clock = self.clock, t
        for i in range(old, t):
            for key in self.needs[i] if i < len(self.needs) else ():
                if key in self._cand:
                    self._push(key)
        if len(self._heap) > 2 * len(self._cand) + 64:
            self._heap = [(-self.next_use(k), s, k) for k, s in self._cand.items()]
            heapq.heapify(self._heap)

    def on_insert(self, key: Hashable) -> None:
        if key in self._cached:
            raise KeyError(f"eviction policy misuse: key {key!r} is already cached")
        self._cached.add(key)

    def on_hit(self, key: Hashable) -> None:
        if key not in self._cached:
            raise KeyError(f"eviction policy misuse: key {key!r} is not cached")

    def on_release(self, key: Hashable) -> None:
        if key not in self._cached or key in self._cand:
            raise KeyError(f"eviction policy misuse: key {key!r} is not held")
        self._cand[key] = next(self._seq)
        self._push(key)

    def on_acquire(self, key: Hashable) -> None:
        if key not in self._cand:
            raise KeyError(f"eviction policy misuse: key {key!r} is not a candidate")
        del self._cand[key]

    def on_remove(self, key: Hashable) -> None:
        if key not in self._cached:
            raise KeyError(f"eviction policy misuse: key {key!r} is not cached")
        self._cached.discard(key)
        self._cand.pop(key, None)

    def victim(self) -> Hashable:
        heap = self._heap
        while heap:
            neg, seq, key = heap[0]
            if self._cand.get(key) == seq and -neg == self.next_use(key):
                return key
            heapq.heappop(heap)
        raise IndexError("no eviction candidates")

    def clear(self) -> None:
        self._cached.clear()
        self._cand.clear()
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._cand)

    def __contains__(self, key: object) -> bool:
        return key in self._cand

    def check_integrity(self) -> None:
        assert self._cand.keys() <= self._cached, "candidate that is not cached"


# ---------------------------------------------------------------------------- replay


@dataclass(frozen=True)
class PolicyResult:
    """Replay of the log through one policy at one cache size."""

    policy: str
    cache_size_tokens: int
    num_blocks: int
    num_requests: int
    prompt_tokens: int
    hit_tokens: int
    hit_requests: int
    within_session_hit_tokens: int
    cross_session_hit_tokens: int
    oversized_requests: int  # larger than the whole pool: counted as misses
    evicted_blocks: int

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        return self.hit_requests / self.num_requests if self.num_requests else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["token_hit_rate"] = round(self.token_hit_rate, 6)
        d["request_hit_rate"] = round(self.request_hit_rate, 6)
        d["prefill_tokens_saved"] = self.hit_tokens
        return d


@dataclass
class _Prepared:
    """Per-request hashes and facts every replay shares."""

    hashes: list[list[BlockHash]]  # full blocks of each prompt
    needs: list[list[BlockHash]]  # hittable blocks: the first (n - 1) // bs
    uses: dict[BlockHash, list[int]]
    sessions: list[str]  # session key (unique per request when it has none)
    first_storer: dict[BlockHash, str]


def prepare(requests: Sequence[LogRequest], block_size: int) -> _Prepared:
    root = root_hash(model_id="", salt=None)  # what KVCacheManager(model_id="") uses
    hashes, needs = [], []
    uses: dict[BlockHash, list[int]] = {}
    sessions: list[str] = []
    first: dict[BlockHash, str] = {}
    for i, r in enumerate(requests):
        hs = hash_blocks(r.token_ids.tolist(), block_size, root)
        need = hs[: (len(r.token_ids) - 1) // block_size]
        hashes.append(hs)
        needs.append(need)
        for h in need:
            uses.setdefault(h, []).append(i)
        sess = f"s:{r.session_id}" if r.session_id is not None else f"r:{i}"
        sessions.append(sess)
        for h in hs:
            first.setdefault(h, sess)
    return _Prepared(hashes, needs, uses, sessions, first)


def replay(
    requests: Sequence[LogRequest],
    policy: str,
    cache_size_tokens: int,
    block_size: int = 16,
    prepared: _Prepared | None = None,
    on_request: Callable[[], None] | None = None,
) -> PolicyResult:
    """Serve ``requests`` one at a time through a ``KVCacheManager`` (module docstring)."""
    if policy not in ALL_POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; choose from: {', '.join(ALL_POLICIES)}")
    num_blocks = cache_size_tokens // block_size
    if num_blocks < 1:
        raise ConfigError(
            f"cache size {cache_size_tokens} tokens is smaller than one block ({block_size})"
        )
    prep = prepared if prepared is not None else prepare(requests, block_size)
    prompt_tokens = sum(len(r.token_ids) for r in requests)
    if policy == "none":
        if on_request is not None:
            for _ in requests:
                on_request()
        return PolicyResult(
            policy, cache_size_tokens, num_blocks, len(requests), prompt_tokens, 0, 0, 0, 0, 0, 0
        )
    engine_policy = policy if policy in ENGINE_POLICIES else "lru"
    kv = KVCacheManager(
        num_blocks, block_size, prefix_cache="hash", eviction_policy=engine_policy, model_id=""
    )
    oracle: OraclePolicy | None = None
    if policy == "oracle":
        assert kv.cache is not None
        oracle = OraclePolicy(num_blocks, prep.uses, prep.needs)
        kv.cache.policy = oracle  # nothing is cached yet; the pool asks cache.policy
    hit_tokens = hit_requests = within = oversized = 0
    sp = SamplingParams(max_tokens=1)
    for i, r in enumerate(requests):
        if oracle is not None:
            oracle.advance(i)
        req = Request(f"a{i}", r.token_ids.tolist(), sp)
        computed = kv.get_computed_blocks(req)
        if oracle is not None and kv.block_hashes(req) != prep.hashes[i]:
            raise AssertionError("oracle hashes differ from the KV manager's block hashes")
        if kv.allocate_slots(req, req.num_tokens - len(computed) * block_size, computed) is None:
            oversized += 1
        else:
            req.num_computed_tokens = req.num_tokens
            kv.free(req)
            if computed:
                hit_requests += 1
                hit_tokens += len(computed) * block_size
                sess = prep.sessions[i]
                within += block_size * sum(
                    1 for h in prep.hashes[i][: len(computed)] if prep.first_storer[h] == sess
                )
        if on_request is not None:
            on_request()
    assert kv.prefix_hit_tokens == hit_tokens
    return PolicyResult(
        policy,
        cache_size_tokens,
        num_blocks,
        len(requests),
        prompt_tokens,
        hit_tokens,
        hit_requests,
        within,
        hit_tokens - within,
        oversized,
        kv.pool.num_evicted_blocks,
    )


# ---------------------------------------------------------------------------- analysis


def shared_prefixes(
    requests: Sequence[LogRequest], prep: _Prepared, block_size: int, top: int = 10
) -> list[dict[str, Any]]:
    """The longest block-aligned prefixes shared by >= 2 requests, most reused first.

    A prefix (a chain hash) is reported when at least two requests contain it and it is
    longer than every shared extension of it with the same frequency, i.e. no child
    prefix is contained in as many requests. Ranked by ``reuse_tokens`` = length x
    (frequency - 1), the prefill an infinite cache saves on it.
    """
    count: dict[BlockHash, int] = {}
    where: dict[BlockHash, tuple[int, int]] = {}  # first (request, block index)
    best_child: dict[BlockHash, int] = {}
    for i, hs in enumerate(prep.hashes):
        for b, h in enumerate(hs):
            count[h] = count.get(h, 0) + 1
            where.setdefault(h, (i, b))
    for hs in prep.hashes:
        for parent, child in itertools.pairwise(hs):
            if count[child] > best_child.get(parent, 0):
                best_child[parent] = count[child]
    out: list[dict[str, Any]] = []
    for h, c in count.items():
        if c >= 2 and best_child.get(h, 0) < c:
            i, b = where[h]
            length = (b + 1) * block_size
            out.append(
                {
                    "length_tokens": length,
                    "frequency": c,
                    "reuse_tokens": length * (c - 1),
                    "first_line": requests[i].line_no,
                    "head_token_ids": requests[i].token_ids[: min(length, 8)].tolist(),
                }
            )
    out.sort(key=lambda d: (-d["reuse_tokens"], -d["length_tokens"], d["first_line"]))
    return out[:top]


def ideal_hit_rate(requests: Sequence[LogRequest], prep: _Prepared, block_size: int) -> float:
    """Token hit rate of an infinite cache (every earlier full block is reusable)."""
    seen: set[BlockHash] = set()
    hits = total = 0
    for i, r in enumerate(requests):
        for h in prep.needs[i]:
            if h not in seen:
                break
            hits += block_size
        seen.update(prep.hashes[i])
        total += len(r.token_ids)
    return hits / total if total else 0.0


def auto_cache_sizes(requests: Sequence[LogRequest], prep: _Prepared, bs: int) -> list[int]:
    """Up to 8 geometric sizes (block multiples) from one that fits the largest request to
    one that holds every distinct block next to the largest request (an infinite cache)."""
    distinct = len({h for hs in prep.hashes for h in hs})
    largest = max((-(-len(r.token_ids) // bs) for r in requests), default=1)
    lo, hi = largest, max(distinct + largest, largest)
    n = 8
    ratio = (hi / lo) ** (1 / (n - 1))
    return sorted({round(lo * ratio**k) * bs for k in range(n)})


def model_kv_bytes_per_token(model: str | Path, dtype_bytes: int) -> int | None:
    """KV bytes per token of ``model`` from its config alone, or None if not loadable."""
    try:
        from kvstack.model.gguf import read_gguf_config
        from kvstack.model.registry import model_format, resolve_model_path
        from kvstack.model.safetensors import config_from_hf, read_hf_config

        path = resolve_model_path(model)
        if model_format(path) == "gguf":
            cfg = read_gguf_config(path)
        else:
            cfg = config_from_hf(read_hf_config(path), path)
        return cfg.kv_bytes_per_token(dtype_bytes)
    except (KvstackError, OSError, ValueError, KeyError):
        return None


@dataclass
class AnalyzeOptions:
    block_size: int = 16
    cache_sizes: list[int] | None = None  # tokens; None: auto
    policies: tuple[str, ...] = ALL_POLICIES
    model: str | None = None
    kv_dtype_bytes: int = 2
    progress: bool = False


def analyze(parsed: ParseResult, opts: AnalyzeOptions) -> dict[str, Any]:
    """The JSON report of a parsed log (see ``analyze_report.format_report``)."""
    bs = opts.block_size
    if bs < 1:
        raise ConfigError(f"block size must be >= 1, got {bs}")
    reqs = parsed.requests
    prep = prepare(reqs, bs)
    sizes = sorted(set(opts.cache_sizes)) if opts.cache_sizes else auto_cache_sizes(reqs, prep, bs)
    for s in sizes:
        if s < bs:
            raise ConfigError(f"cache size {s} tokens is smaller than one block ({bs} tokens)")
    bar = None
    tick: Callable[[], None] | None = None
    if opts.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(opts.policies) * len(sizes) * len(reqs), desc="replay", leave=False)
        tick = bar.update
    try:
        results = [
            replay(reqs, p, s, bs, prep, tick).to_json() for p in opts.policies for s in sizes
        ]
    finally:
        if bar is not None:
            bar.close()
    prompt_tokens = sum(len(r.token_ids) for r in reqs)
    knees = {}
    for p in opts.policies:
        curve = [(r["cache_size_tokens"], r["token_hit_rate"]) for r in results if r["policy"] == p]
        knees[p] = find_knee(curve, KNEE_TOLERANCE)
    prefixes = shared_prefixes(reqs, prep, bs)
    kvb = model_kv_bytes_per_token(opts.model, opts.kv_dtype_bytes) if opts.model else None
    if kvb is not None:
        for d in prefixes:
            d["kv_bytes"] = d["length_tokens"] * kvb
    cached = [r.num_cached_tokens for r in reqs]
    report: dict[str, Any] = {
        "version": 1,
        "block_size": bs,
        "num_requests": len(reqs),
        "num_prompt_tokens": prompt_tokens,
        "num_sessions": len({r.session_id for r in reqs if r.session_id is not None}),
        "num_lines": parsed.num_lines,
        "num_malformed_lines": parsed.num_malformed,
        "malformed_lines": [{"line": n, "error": e} for n, e in parsed.malformed],
        "ordered_by": parsed.ordered_by,
        "cache_sizes": sizes,
        "policies": list(opts.policies),
        "ideal_hit_rate": round(ideal_hit_rate(reqs, prep, bs), 6),
        "results": results,
        "knees": knees,
        "knee_tolerance": KNEE_TOLERANCE,
        "shared_prefixes": prefixes,
        "notes": [
            "the last prompt token is never reused (a hit covers at most (n-1)//block_size "
            "blocks), as in the engine",
            "a hit block is within-session when the first request that stored it has the "
            "same session id",
        ],
    }
    if kvb is not None:
        report["kv_bytes_per_token"] = kvb
    if reqs and all(c is not None for c in cached):
        report["observed_hit_rate"] = round(
            sum(c or 0 for c in cached) / prompt_tokens if prompt_tokens else 0.0, 6
        )
    return report


# ---------------------------------------------------------------------------- CLI


def _sizes(text: str) -> list[int]:
    try:
        out = [int(parse_size(t.strip())) for t in text.split(",") if t.strip()]
    except ConfigError as e:
        raise argparse.ArgumentTypeError(f"bad cache size list {text!r}: {e}") from None
    if not out:
        raise argparse.ArgumentTypeError("empty cache size list")
    return out


def _policies(text: str) -> tuple[str, ...]:
    out = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in out if p not in ALL_POLICIES]
    if bad or not out:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(bad) or text!r}; choose from: {', '.join(ALL_POLICIES)}"
        )
    return out


def add_analyze_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstack analyze``."""
    parser.add_argument("log", help="request log, one JSON object per line")
    parser.add_argument("--format", choices=FORMATS, default="tokens", help="log format")
    parser.add_argument("--model", default=None, help="model name or path (tokenizer, KV size)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer source (default: --model)")
    parser.add_argument(
        "--cache-size",
        type=_sizes,
        default=None,
        help="cache sizes in tokens, comma separated (default: doubling sizes up to all blocks)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--session-field", default="session_id")
    parser.add_argument("--policy", type=_policies, default=ALL_POLICIES, help="lru,lfu,...")
    parser.add_argument("--kv-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--output-json", default=None, help="write the report as JSON")
    parser.add_argument("--plot", default=None, help="write a hit-rate-vs-size PNG")
    parser.add_argument("--baseline", default=None, help="earlier report.json to compare to")
    parser.add_argument("--tolerance", type=float, default=0.02, help="allowed hit-rate drop")
    parser.add_argument("--max-file-bytes", default="512MB", help="refuse larger logs")
    parser.add_argument("--max-line-bytes", default="8MiB", help="longer lines are malformed")
    parser.add_argument("--strict", action="store_true", help="stop at the first bad line")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _load_baseline(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"cannot read baseline report {path!r}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise ConfigError(f"{path!r} is not a kvstack analyze report (no 'results' list)")
    return data


def run_analyze(args: argparse.Namespace) -> int:
    """Run ``kvstack analyze``; 0 on success, 1 on a hit-rate regression vs ``--baseline``.

    User errors raise ``ConfigError`` (the CLI prints one line and exits 2).
    """
    baseline = _load_baseline(args.baseline) if args.baseline else None
    if args.tolerance < 0:
        raise ConfigError(f"--tolerance must be >= 0, got {args.tolerance}")
    progress = not args.quiet
    parsed = read_log(
        args.log,
        args.format,
        session_field=args.session_field,
        tokenizer=args.tokenizer or args.model,
        max_file_bytes=parse_size(args.max_file_bytes),
        max_line_bytes=parse_size(args.max_line_bytes),
        strict=args.strict,
        progress=progress,
    )
    if parsed.num_malformed:
        print(
            f"warning: {parsed.num_malformed} malformed line(s) skipped"
            + "".join(f"\n  line {n}: {e}" for n, e in parsed.malformed),
            file=sys.stderr,
        )
    if not parsed.requests:
        raise ConfigError(f"no valid requests in {args.log!r}")
    opts = AnalyzeOptions(
        block_size=args.block_size,
        cache_sizes=args.cache_size,
        policies=tuple(args.policy),
        model=args.model,
        kv_dtype_bytes=4 if args.kv_dtype == "float32" else 2,
        progress=progress,
    )
    report = analyze(parsed, opts)
    report["log"] = str(args.log)
    report["format"] = args.format
    print(format_report(report))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.plot:
        write_plot(report, args.plot)
    if baseline is not None:
        if baseline.get("block_size") not in (None, report["block_size"]):
            print(
                f"warning: baseline block size {baseline.get('block_size')} != "
                f"{report['block_size']}; hit rates are not directly comparable",
                file=sys.stderr,
            )
        regressions = check_cache_regression(report, baseline, args.tolerance)
        for line in regressions:
            print(f"regression: {line}", file=sys.stderr)
        if regressions:
            return 1
        print(f"no hit-rate regression vs {args.baseline} (tolerance {args.tolerance})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstack analyze", description=__doc__.split("\n")[0])
    add_analyze_args(parser)
    try:
        return run_analyze(parser.parse_args(argv))
    except KvstackError as e:
        print(f"kvstack analyze: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
