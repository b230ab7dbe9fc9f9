"""Server-side conversation state of the Responses API: stored responses and the KV kept
for their next turn.

``ResponsesStore`` keeps what ``store: true`` asks for, bounded three ways
(``ConversationOptions``): at most ``responses_max_stored`` responses, each for
``responses_ttl`` seconds, all of them within ``responses_max_bytes`` (the body's JSON
plus the conversation and its token ids); past a bound the oldest go first. Ids are
``resp_`` + 48 random hex digits (``secrets.token_hex``: 192 bits), so holding an id is
the capability to read or continue that conversation; an expired or evicted id answers
404 exactly as one never issued.

``ConversationPins``: a stored turn's continuation is known to start with its tokens, so
their cached KV is kept with a *soft pin* (``KVCacheManager.pin_cached_prefix``) for
``responses_pin_ttl`` seconds or until the next turn has run: soft pins stay within
``responses_pin_fraction`` of the pool and are the first KV released when the pool runs
short, so they never make a request wait. The next turn reports how many of its prompt
tokens were pinned for it (``kvstack_pinned_tokens`` next to ``cached_tokens``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstack.serve.async_engine import AsyncEngine
from kvstack.serve.conversation_options import ConversationOptions

logger = logging.getLogger("kvstack.serve")


def new_response_id() -> str:
    """``resp_`` + 48 random hex digits (unguessable: ``secrets``, not ``uuid``)."""
    return "resp_" + secrets.token_hex(24)


@dataclass
class StoredResponse:
    """One stored turn: the body ``GET`` returns and what the next turn continues from."""

    id: str
    body: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation through this answer (no instructions)
    prompt_ids: list[int]
    output_ids: list[int]
    cache_salt: str | None = None
    render_key: str = ""  # instructions, tools, template kwargs (``responses_prompt``)
    created: float = 0.0  # the store's clock when stored (``ResponsesStore.put``)
    pinned: list[int] = field(default_factory=list)  # token ids softly pinned, [] if none
    size: int = 0

    def __post_init__(self) -> None:
        text = json.dumps(self.body) + json.dumps(self.messages)
        self.size = len(text.encode()) + 8 * (len(self.prompt_ids) + len(self.output_ids))


class ResponsesStore:
    """Stored responses, oldest first, within count, age and byte bounds."""

    def __init__(
        self, opts: ConversationOptions, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.opts = opts
        self.clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, None if unknown or expired (then it is dropped)."""
        rec = self._items.get(response_id)
        if rec is not None and self.clock() - rec.created > self.opts.responses_ttl:
            self._drop(response_id)
            return None
        return rec

    def put(self, rec: StoredResponse) -> list[StoredResponse]:
        """Store ``rec``; returns the responses dropped to make room (expired first,
        then the oldest), for their pins to be released. A response larger than the
        whole byte bound is not stored (returned as dropped itself)."""
        dropped = self.expire()
        if rec.size > self.opts.responses_max_bytes:
            return [*dropped, rec]
        rec.created = self.clock()
        self._items[rec.id] = rec
        self.num_bytes += rec.size
        while (
            len(self._items) > self.opts.responses_max_stored
            or self.num_bytes > self.opts.responses_max_bytes
        ):
            dropped.append(self._drop(next(iter(self._items))))
        return dropped

    def delete(self, response_id: str) -> StoredResponse | None:
        return self._drop(response_id) if self.get(response_id) is not None else None

    def expire(self) -> list[StoredResponse]:
        """Drop every response past its age (the oldest are first: stop at a young one)."""
        now, out = self.clock(), []
        while self._items:
            first = next(iter(self._items.values()))
            if now - first.created <= self.opts.responses_ttl:
                break
            out.append(self._drop(first.id))
        return out

    def _drop(self, response_id: str) -> StoredResponse:
        rec = self._items.pop(response_id)
        self.num_bytes -= rec.size
        return rec


class ConversationPins:
    """Soft pins of stored turns' next-turn prefixes, released after ``responses_pin_ttl``
    seconds, when the next turn has run, or when the response leaves the store."""

    def __init__(self, engine: AsyncEngine, opts: ConversationOptions) -> None:
        self.engine = engine
        self.opts = opts
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.num_pinned_turns = 0  # turns whose prefix got pinned
        self.num_pinned_hits = 0  # next turns that found their prefix pinned

    async def pin(self, rec: StoredResponse, ids: list[int]) -> None:
        """Softly pin the cached full blocks of ``ids`` for ``rec``'s next turn."""
        if self.opts.responses_pin_fraction <= 0:
            return
        share = self.opts.responses_pin_fraction
        n = await self.engine.pin_cached(ids, rec.cache_salt, share)
        if not n:
            return
        rec.pinned = ids[:n]
        self.num_pinned_turns += 1
        loop = asyncio.get_running_loop()
        self._timers[rec.id] = loop.call_later(
            self.opts.responses_pin_ttl, lambda: loop.create_task(self.release(rec))
        )

    async def release(self, rec: StoredResponse) -> None:
        """Release ``rec``'s pin if it holds one (idempotent)."""
        timer = self._timers.pop(rec.id, None)
        if timer is not None:
            timer.cancel()
        if rec.pinned:
            ids, rec.pinned = rec.pinned, []
            try:
                await self.engine.unpin_prefix(ids, rec.cache_salt)
            except Exception:  # the engine stopped: its pins went with it
                logger.debug("unpin of %s failed", rec.id, exc_info=True)

    def hit(self, rec: StoredResponse, prompt_ids: list[int]) -> int:
        """How many of ``prompt_ids`` the previous turn ``rec`` had pinned for it."""
        n = 0
        for a, b in zip(rec.pinned, prompt_ids, strict=False):
            if a != b:
                break
            n += 1
        if n:
            self.num_pinned_hits += 1
        return n
