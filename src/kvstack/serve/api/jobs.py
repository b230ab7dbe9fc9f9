"""A request's jobs (one per prompt; each with its output stream and per-choice state),
their outputs merged with bounded memory, and the ``usage`` they add up to. Shared by the
completions, chat and Responses handlers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvstack.core.request import RequestOutput
from kvstack.serve.chat.reasoning_parsers import ReasoningStream
from kvstack.serve.chat.tool_calls import ChoiceToolStream
from kvstack.serve.output_stream import OutputStream


@dataclass
class ChoiceState:
    """What one choice of a streamed request has sent so far."""

    text_sent: int = 0
    lp_sent: int = 0
    role_sent: bool = False
    done: bool = False
    tools: ChoiceToolStream | None = None  # chat requests with tools
    reasoning: ReasoningStream | None = None  # chat with --reasoning-parser
    echoed: bool = False
    offset: int = 0  # text_offset of the next completions logprobs token
    ids_sent: int = 0  # token ids streamed (return_token_ids)


@dataclass
class Job:
    """One prompt of a request: its stream and what has been streamed so far."""

    index: int
    stream: OutputStream
    prompt_ids: list[int]
    prompt_text: str | None
    last: RequestOutput | None = None
    choices: dict[int, ChoiceState] = field(default_factory=dict)


def usage(jobs: list[Job]) -> dict[str, Any]:
    """OpenAI's ``usage`` over every job of a request, with kvstack's extensions."""
    prompt = sum(len(j.prompt_ids) for j in jobs)
    completion = sum(len(c.token_ids) for j in jobs if j.last for c in j.last.outputs)
    cached = sum(j.last.num_cached_tokens for j in jobs if j.last)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    segment = sum(j.last.num_segment_tokens for j in jobs if j.last)
    if segment:  # extension (segment reuse): prompt tokens copied from reusable segments
        out["prompt_tokens_details"]["kvstack_segment_tokens"] = segment
    # Extension (offload tiers on): where the cached tokens came from.
    splits = [j.last.cached_tokens_by_tier for j in jobs if j.last]
    if splits and all(s is not None for s in splits):
        by_tier: dict[str, int] = {}
        for split in splits:
            for tier, n in (split or {}).items():
                by_tier[tier] = by_tier.get(tier, 0) + n
        out["kvstack_cached_tokens"] = by_tier
    return out


Item = tuple[Job, RequestOutput | BaseException]


def merged_outputs(jobs: list[Job]) -> tuple[AsyncIterator[Item], list[asyncio.Task[None]]]:
    """Every job's outputs as they come, a failed stream's exception as its last item.
    One job (the common case) streams directly; several are merged by the returned
    tasks, which the caller cancels when it stops early.

    The merge queue holds one item: a pump whose put waits leaves its stream's newer
    outputs to coalesce in the stream's one-slot buffer, as one prompt's do
    (``output_stream.OutputSlot``). So a reader that stops reading holds two outputs per
    prompt (in its pump's hand, in its slot) and the queued one; an unbounded queue held
    every step's cumulative output (4 prompts x n=16, 600 steps: 2,399 items, 356 MiB).
    """
    if len(jobs) == 1:
        return _single(jobs[0]), []
    merged: asyncio.Queue[tuple[Job, RequestOutput | BaseException | None]] = asyncio.Queue(1)

    async def pump(job: Job) -> None:
        try:
            async for out in job.stream:
                await merged.put((job, out))
        except BaseException as exc:
            await merged.put((job, exc))
            return
        await merged.put((job, None))

    async def many() -> AsyncIterator[Item]:
        remaining = len(jobs)
        while remaining:
            job, item = await merged.get()
            if item is None:
                remaining -= 1
            else:
                yield job, item

    return many(), [asyncio.create_task(pump(j)) for j in jobs]


async def _single(job: Job) -> AsyncIterator[Item]:
    try:
        async for out in job.stream:
            yield job, out
    except BaseException as exc:
        yield job, exc
