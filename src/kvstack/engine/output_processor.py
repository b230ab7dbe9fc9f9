"""Turns sampled tokens into text and ``RequestOutput``s: detokenization and stop strings.

vLLM v1 keeps this out of the engine core; here it is a plain object the engine calls
after each step. Text shown to a client never contains a stop string (unless
``include_stop_str_in_output``) and never ends in half a UTF-8 character: while a
request runs, the last ``max(len(stop)) - 1`` characters are held back because they
could be the start of a stop string::

    text so far:  "... the answer is 42\\n\\nQ"      stop = ["\\n\\nQ:"]
    visible:      "... the answer is 42"            held back: "\\n\\nQ"

The incremental detokenizer (``model/tokenizer/detokenizer.py``) does the holding back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstack.core.request import (
    CompletionOutput,
    Logprob,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
)
from kvstack.model.tokenizer.detokenizer import IncrementalDetokenizer
from kvstack.model.tokenizer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvstack.model.runner import RunnerOutput


@dataclass
class SequenceState:
    request: Request
    detok: IncrementalDetokenizer

    def visible_text(self) -> str:
        return self.detok.text


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.seqs: dict[str, SequenceState] = {}
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add(self, parent: ParentState, children: list[Request]) -> None:
        self.parents[parent.request_id] = parent
        for child in children:
            sp = child.sampling_params
            detok = IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=sp.skip_special_tokens,
                stop=sp.stop,
                include_stop_str_in_output=sp.include_stop_str_in_output,
                prompt_ids=child.prompt_token_ids,
            )
            self.seqs[child.request_id] = SequenceState(child, detok)
            self.child_to_parent[child.request_id] = parent.request_id
            parent.children.append(child.request_id)

    def on_new_token(self, req: Request, stream: bool = True) -> bool:
        """Detokenize ``req``'s new tokens; True if a stop string now ends it.

        With ``stream=False`` and no stop strings, text is only decoded once the request
        finishes (offline generation needs no intermediate text).
        """
        seq = self.seqs[req.request_id]
        if not (stream or req.sampling_params.stop or req.is_finished()):
            return False
        fed = len(seq.detok.token_ids)
        new = req.output_token_ids[fed:]
        if new and _ended_by_stop_token(req):
            new = new[:-1]  # vLLM: the EOS or stop token's text is not part of the output
        if len(req.output_token_ids) - fed > 1 and req.sampling_params.stop:
            # Several tokens in one step (speculative decoding): a stop string ends the
            # output at the token that completes it, as one-token steps would.
            for i, token in enumerate(new):
                seq.detok.add_tokens([token])
                if seq.detok.stopped:
                    if fed + i + 1 < len(req.output_token_ids):  # tokens past the stop
                        del req.output_token_ids[fed + i + 1 :]
                        if req.is_finished():  # by a stop rule at a token now dropped
                            req.status = RequestStatus.FINISHED_STOPPED
                    break
        else:
            seq.detok.add_tokens(new)
        if seq.detok.stopped:
            req.stop_reason = seq.detok.stop_reason
            return True
        if req.is_finished():
            seq.detok.finish()
        return False

    def outputs_for(self, request_ids: set[str], final_only: bool = False) -> list[RequestOutput]:
        """RequestOutputs (cumulative text) of the parents of the given child ids.

        ``final_only`` returns only parents whose children have all finished.
        """
        parents = {self.child_to_parent[r] for r in request_ids if r in self.child_to_parent}
        if final_only:
            parents = {p for p in parents if self._all_done(self.parents[p])}
        return [self._build(self.parents[p]) for p in sorted(parents)]

    def _build(self, parent: ParentState) -> RequestOutput:
        outs = []
        cached = 0
        by_tier: dict[str, int] | None = None
        prompt_logprobs = None
        for i, cid in enumerate(parent.children):
            seq = self.seqs[cid]
            req = seq.request
            sp = req.sampling_params
            if req.num_cached_tokens >= cached:
                cached = req.num_cached_tokens
                by_tier = req.cached_tokens_by_tier
            # n > 1: every child scores the prompt; report the one furthest along.
            if req.prompt_logprobs is not None and len(req.prompt_logprobs) > len(
                prompt_logprobs or []
            ):
                prompt_logprobs = req.prompt_logprobs
            outs.append(
                CompletionOutput(
                    index=i,
                    text=seq.visible_text(),
                    token_ids=list(req.output_token_ids),
                    cumulative_logprob=req.cumulative_logprob if sp.logprobs is not None else None,
                    logprobs=list(req.output_logprobs) if sp.logprobs is not None else None,
                    finish_reason=req.status.finish_reason,
                    stop_reason=req.stop_reason,
                )
            )
        children = [self.seqs[c].request for c in parent.children]
        errors = [r.error for r in children if r.error]
        firsts = [r.first_token_time for r in children if r.first_token_time is not None]
        scheds = [r.first_scheduled_time for r in children if r.first_scheduled_time is not None]
        done = [r.finished_time for r in children if r.finished_time is not None]
        metrics = RequestMetrics(
            arrival_time=min(r.arrival_time for r in children),
            first_scheduled_time=min(scheds) if scheds else None,
            first_token_time=min(firsts) if firsts else None,
            finished_time=max(done) if len(done) == len(children) else None,
            num_preemptions=sum(r.num_preemptions for r in children),
        )
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outs,
            finished=all(r.is_finished() for r in children),
            num_cached_tokens=cached,
            num_segment_tokens=max(r.num_segment_tokens for r in children),
            num_pressed_tokens=max(r.num_dropped for r in children),
            segments=_spans(children[0]),
            cached_tokens_by_tier=dict(by_tier) if by_tier is not None else None,
            prompt_logprobs=prompt_logprobs,
            error=errors[0] if errors else None,
            metrics=metrics,
        )

    def release_finished(self, child_ids: Iterable[str]) -> None:
        """Forget the parents of ``child_ids`` whose children have all finished."""
        parents = {self.child_to_parent[c] for c in child_ids if c in self.child_to_parent}
        for pid in [p for p in parents if self._all_done(self.parents[p])]:
            for cid in self.parents.pop(pid).children:
                self.seqs.pop(cid, None)
                self.child_to_parent.pop(cid, None)

    def _all_done(self, parent: ParentState) -> bool:
        return all(self.seqs[c].request.is_finished() for c in parent.children)

    def children_of(self, parent_id: str) -> list[str]:
        st = self.parents.get(parent_id)
        return list(st.children) if st else []


def record_logprobs(
    requests: Mapping[str, Request], result: RunnerOutput, tokenizer: Tokenizer | None = None
) -> None:
    """Append a step's sampled-token and prompt logprobs to their (live) requests, each
    ``Logprob.decoded_token`` filled with its token's text as vLLM's are (with
    ``tokenizer``)."""
    for rid, lp in result.logprobs.items():
        req = requests.get(rid)
        token = result.sampled.get(rid)
        if req is None or token is None:
            continue
        if tokenizer is not None:
            lp = {t: _decoded(tokenizer, t, entry) for t, entry in lp.items()}
        req.output_logprobs.append(lp)
        if token in lp:
            req.cumulative_logprob += lp[token].logprob
    for rid, (_, entries) in result.prompt_logprobs.items():
        req = requests.get(rid)
        if req is not None and req.prompt_logprobs is not None:
            if tokenizer is not None:
                entries = [
                    None if e is None else {t: _decoded(tokenizer, t, x) for t, x in e.items()}
                    for e in entries
                ]
            req.prompt_logprobs.extend(entries)


def _decoded(tokenizer: Tokenizer, token: int, entry: Logprob) -> Logprob:
    if entry.decoded_token is not None:
        return entry
    text = tokenizer.decode([token], skip_special_tokens=False)
    return dataclasses.replace(entry, decoded_token=text)


def _ended_by_stop_token(req: Request) -> bool:
    """True if ``req`` just stopped on EOS or a ``stop_token_ids`` token (its last one),
    whose text vLLM leaves out unless ``include_stop_str_in_output``. Matters only with
    ``skip_special_tokens=False`` or a stop token that is not special."""
    sp = req.sampling_params
    if req.status is not RequestStatus.FINISHED_STOPPED or sp.include_stop_str_in_output:
        return False
    last = req.output_token_ids[-1]
    if req.stop_reason is None:
        return last in req.eos_token_ids and not sp.ignore_eos
    return isinstance(req.stop_reason, int) and req.stop_reason == last


def _spans(req: Request) -> list[list[int]] | None:
    """The segment ranges a request ran with, JSON-ready."""
    return None if req.segments is None else [list(span) for span in req.segments.spans]
