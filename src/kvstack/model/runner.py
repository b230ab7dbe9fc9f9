"""ModelRunner: turns a ``SchedulerOutput`` into tensors, runs the model, samples.

The runner never sees hashes or free lists: only token ids, positions, block tables.
Single-token rows (decodes) come first, so attention batches them (``model/attention.py``).
A request verifying a draft (``spec/``) is a short chunk: its last token, then the draft
tokens, every row's logits kept for ``model/sampling/rejection.py``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from kvstack.core.request import Logprob, Request
from kvstack.kv.storage import KVStorage
from kvstack.model.allocator import tune_host_allocator
from kvstack.model.arch.decoder import LlamaModel
from kvstack.model.attention import (
    KERNEL_CHUNK_ROWS,
    AttentionMetadata,
    KernelRows,
    KernelSeq,
    PrefillSeq,
    make_kernel_rows,
)
from kvstack.model.group_meta import group_metadata, virtual_tables
from kvstack.model.kernels.loader import load_kernels
from kvstack.model.sampling.logit_capture import LogitCapture
from kvstack.model.sampling.metadata import plain_greedy
from kvstack.model.sampling.rejection import RejectionSampler
from kvstack.model.sampling.sampler import Sampler, SamplingBatch, compute_prompt_logprobs
from kvstack.model.segment_rows import append_rows, rows_on_paged_kernel, segment_rows
from kvstack.sched.output import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from kvstack.kv.press.coordinator import PressCoordinator
    from kvstack.model.structured.manager import StructuredOutputManager


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, Logprob]] = field(default_factory=dict)
    # Prompt logprobs computed this step: request id -> (first position, entries).
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob]]]] = field(default_factory=dict)
    # Presses: per request whose press needs them, the queries of the rows of its chunk
    # inside the press's window, per layer ``[w, heads, head_dim]`` float32.
    press_queries: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    # Structured outputs: requests whose grammar ended with this step's token ("done")
    # or rejected it (an error message); the engine finishes them.
    grammar_stops: dict[str, str] = field(default_factory=dict)
    # Speculative decoding: per verified request, the draft tokens kept before its
    # ``sampled`` token (the correction or bonus).
    accepted: dict[str, list[int]] = field(default_factory=dict)


def _row_ids(s: ScheduledRequest) -> list[int]:
    """The input tokens of a scheduled chunk: the request's, then its draft rows."""
    d = s.draft_token_ids
    return s.request.tokens(s.num_computed_tokens, s.num_new_tokens - len(d)) + d


def _layer_lens(req: Request) -> list[int] | None:
    """Kept tokens per layer of a press that gave layers different budgets, else None."""
    return None if req.press is None else req.press.layer_lens


@dataclass
class StepInputs:
    """One step's flattened rows: decodes first, then prefill chunks."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # KV slot of each row's token
    prefills: list[PrefillSeq] = field(default_factory=list)
    # C++ attention path: each short chunk's (block table, KV tokens before it, length),
    # and the segment repair rows after every chunk (table, context lengths, first row).
    kernel_seqs: list[tuple[list[int], int, int]] | None = None
    kernel_tail: list[tuple[list[int], list[int], int]] = field(default_factory=list)


@dataclass
class LogitPlan:
    """Rows whose logits the step needs: the last row of each sampling request, plus
    whole prompt chunks of requests that asked for prompt logprobs."""

    rows: list[int] = field(default_factory=list)
    sample_pos: list[int] = field(default_factory=list)  # index into rows of each sampling row
    sample_reqs: list[Request] = field(default_factory=list)
    # (scheduled request, first index into rows, count) of prompt-logprob chunks
    prompt_lp: list[tuple[ScheduledRequest, int, int]] = field(default_factory=list)
    # Requests verifying a draft: all their rows, in order, after the rows above.
    verify: list[ScheduledRequest] = field(default_factory=list)


def _wants_prompt_logprobs(s: ScheduledRequest) -> bool:
    """True if this chunk covers prompt positions whose logprobs are still missing.

    ``request.prompt_logprobs`` holds entries for prompt positions ``0 .. len - 1``
    (position 0 is None); row j of the chunk predicts position ``c + j + 1``. After a
    preemption the recomputed chunks skip positions already recorded.
    """
    req = s.request
    have = req.prompt_logprobs
    if req.sampling_params.prompt_logprobs is None or have is None:
        return False
    end = min(s.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens - 1)
    return end >= len(have)


class DraftFiller(Protocol):
    """What fills a step's draft rows before it runs (``spec/drafter.py``'s ``Drafter``)."""

    def fill(self, runner: ModelRunner, scheduled: list[ScheduledRequest]) -> None: ...


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv: KVStorage,
        press: PressCoordinator | None = None,
        structured: StructuredOutputManager | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        # The longest prefill chunk the C++ kernel takes: every chunk for a codec whose
        # rows read their own block exactly (kivi2: the kernel sums each row alone, so
        # chunked == whole prefill; README "Chunk sizes and 2-bit codes").
        self.kernel_chunk_rows = sys.maxsize if kv.codec.own_block_exact else KERNEL_CHUNK_ROWS
        self.block_size = kv.block_size
        self.vocab_size = model.config.vocab_size
        self.num_layers = model.config.num_layers
        self.groups = kv.groups if kv.groups is not None and kv.groups.hybrid else None
        self.layer_groups = kv.groups.layer_groups() if kv.groups is not None else []
        tune_host_allocator()  # no page faults on each step's activations
        self.kernels = load_kernels()
        self.sampler = Sampler(kernels=self.kernels)
        self.rejection_sampler = RejectionSampler(self.sampler)
        # Presses: which rows' queries a press needs (``PressCoordinator.capture_rows``).
        self.press = press
        self.structured = structured  # grammar masks of constrained requests
        # Request id -> where to keep the full next-token log-distributions of its prompt
        # (``kvstack eval`` teacher forcing; only requests with prompt_logprobs).
        self.capture_logits: dict[str, LogitCapture] = {}
        self.drafter: DraftFiller | None = None  # draft_model speculation (spec/drafter.py)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step: inputs -> forward -> prompt logprobs and sampling."""
        if out.is_empty:
            return RunnerOutput()
        if self.drafter is not None:  # the draft model's guesses replace the placeholders
            self.drafter.fill(self, out.scheduled)
        scheduled, phys = out.scheduled, None
        if self.groups is not None:  # hybrid KV manager: one table per group
            scheduled, phys = virtual_tables(scheduled, self.groups.num_groups)
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        kernel, chunk_rows = self._kernel_attention(scheduled), self.kernel_chunk_rows
        # Short chunks for the C++ kernel right after the decodes (KernelRows); fresh
        # prompts of equal length side by side so SDPA batches them.
        prefills = sorted(
            (s for s in scheduled if s.num_new_tokens != 1),
            key=lambda s: (
                not (kernel and s.num_new_tokens <= chunk_rows),
                s.num_computed_tokens > 0,
                s.num_new_tokens,
            ),
        )
        ordered = decodes + prefills
        inputs = StepInputs()
        if kernel:
            inputs.kernel_seqs = []
        repair = segment_rows(out.scheduled, self.kv, self.model, self.kernels, kernel)
        self._decode_inputs(decodes, inputs)
        self._prefill_inputs(prefills, len(decodes), inputs)
        paged = bool(repair) and rows_on_paged_kernel(self.kernels, self.model, kernel)
        tail = inputs.kernel_tail if paged else None  # segment reuse's repair rows
        append_rows(repair, self.block_size, inputs.ids, inputs.positions, inputs.slots,
                    inputs.prefills, tail)  # fmt: skip
        meta = self._metadata(decodes, inputs, self._press_rows(ordered))
        if phys is not None:
            group_metadata(meta, phys, self.layer_groups, self.block_size)
        plan = self._logit_plan(ordered)
        result = RunnerOutput()
        if meta.capture_rows:
            result.press_queries = meta.captured
        logits = self._forward(inputs, meta, plan.rows)
        if plan.rows:
            for s, first, n in plan.prompt_lp:
                self._prompt_logprobs(s, logits[first : first + n], result)
            self._sample(logits, plan, result)
            self._verify(logits, plan, result)
        return result

    # ------------------------------------------------------------------ inputs
    def decode_rows(self, rows: list[ScheduledRequest]) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions and attention metadata of one-token rows, built exactly as a decode
        step's (the hybrid manager's per-group tables included): what a draft forward over
        this runner's KV cache needs (``spec/drafter.py``)."""
        phys = None
        if self.groups is not None:
            rows, phys = virtual_tables(rows, self.groups.num_groups)
        inputs = StepInputs(kernel_seqs=[] if self._kernel_attention(rows) else None)
        self._decode_inputs(rows, inputs)
        meta = self._metadata(rows, inputs, {})
        if phys is not None:
            group_metadata(meta, phys, self.layer_groups, self.block_size)
        return torch.tensor(inputs.positions), meta

    def _decode_inputs(self, decodes: list[ScheduledRequest], inputs: StepInputs) -> None:
        """One row per decode. After a press (token eviction) a token's KV slot is its position
        minus the tokens the press dropped (``Request.num_kv_tokens``); positions (RoPE)
        keep counting."""
        bs = self.block_size
        for s in decodes:
            c = s.num_computed_tokens
            kc = c - s.request.num_dropped
            inputs.ids.extend(_row_ids(s))
            inputs.positions.append(c)
            inputs.slots.append(s.block_ids[kc // bs] * bs + kc % bs)

    def _prefill_inputs(
        self, prefills: list[ScheduledRequest], row: int, inputs: StepInputs
    ) -> None:
        """Rows of each prefill chunk from ``row`` on, and its attention metadata: fresh
        prompts of one length (no earlier KV, identity codec) share one causal SDPA call;
        others attend to their block table through a mask."""
        bs = self.block_size
        metas, chunk_rows = inputs.prefills, self.kernel_chunk_rows
        for s in prefills:
            c, n = s.num_computed_tokens, s.num_new_tokens
            kc = c - s.request.num_dropped
            inputs.ids.extend(_row_ids(s))
            inputs.positions.extend(range(c, c + n))
            blocks = s.block_ids[: -(-(kc + n) // bs)]
            if inputs.kernel_seqs is not None and n <= chunk_rows:  # C++ attention
                inputs.slots.extend(blocks[t // bs] * bs + t % bs for t in range(kc, kc + n))
                inputs.kernel_seqs.append((blocks, kc, n))
                row += n
                continue
            p = torch.arange(kc, kc + n)  # KV slots (= positions unless pressed)
            table = torch.tensor(blocks, dtype=torch.long)
            inputs.slots.extend((table[p // bs] * bs + p % bs).tolist())
            if kc == 0 and self.kv.codec.identity:
                last = metas[-1] if metas else None
                if last is not None and last.block_ids is None and last.q_len == n:
                    last.num_seqs += 1
                else:
                    metas.append(PrefillSeq(row, n, n, None, None))
            else:
                mask = torch.arange(kc + n)[None, :] <= p[:, None]
                seq = PrefillSeq(row, n, kc + n, table, mask, offset_causal=True)
                lens = _layer_lens(s.request)
                if lens is not None:  # per-layer press budgets: mask slots m_l .. M - 1
                    seq.layer_masks = []
                    for m in lens:
                        lm = mask.clone()
                        lm[:, m : max(lens)] = False
                        seq.layer_masks.append(lm)
                metas.append(seq)
            row += n

    def _metadata(
        self,
        decodes: list[ScheduledRequest],
        inputs: StepInputs,
        capture_rows: dict[str, tuple[int, int]],
    ) -> AttentionMetadata:
        """Attention metadata: decode block tables, context lengths and (fallback path,
        codecs, uneven press budgets) additive masks."""
        bs = self.block_size
        dec_tables = dec_bias = dec_lens = None
        layer_bias = None
        if decodes and inputs.kernel_seqs is None:  # else KernelRows covers them
            ctx = [s.num_computed_tokens - s.request.num_dropped + 1 for s in decodes]
            max_blocks = -(-max(ctx) // bs)
            table_rows = [
                s.block_ids[:max_blocks] + [0] * (max_blocks - min(len(s.block_ids), max_blocks))
                for s in decodes
            ]
            dec_tables = torch.tensor(table_rows, dtype=torch.long)
            dec_lens = torch.tensor(ctx, dtype=torch.long)
            uneven = [i for i, s in enumerate(decodes) if _layer_lens(s.request) is not None]
            if self.kernels is None or not self.kv.codec.identity or uneven:
                over = torch.arange(max_blocks * bs)[None, :] >= dec_lens[:, None]
                dec_bias = torch.zeros(over.shape, dtype=torch.float32).masked_fill_(
                    over, float("-inf")
                )[:, None, None, :]
            if uneven:  # per-layer press budgets: layer l masks its slots m_l .. M - 1
                assert dec_bias is not None
                layer_bias = dec_bias.expand(self.num_layers, *dec_bias.shape).clone()
                for i in uneven:
                    lens = _layer_lens(decodes[i].request)
                    assert lens is not None
                    for layer, m in enumerate(lens):
                        layer_bias[layer, i, :, :, m : max(lens)] = float("-inf")
        return AttentionMetadata(
            slot_mapping=torch.tensor(inputs.slots, dtype=torch.long),
            num_decodes=len(decodes),
            decode_block_tables=dec_tables,
            decode_context_lens=dec_lens,
            decode_bias=dec_bias,
            prefills=inputs.prefills,
            kernels=self.kernels,
            decode_layer_bias=layer_bias,
            capture_rows=capture_rows,
            kernel_rows=None if inputs.kernel_seqs is None else self._kernel_rows(decodes, inputs),
        )

    def _kernel_attention(self, scheduled: list[ScheduledRequest]) -> bool:
        """True when decodes and short chunks can go to the C++ ``paged_attention``:
        kernels built, an unencoded cache or a codec the kernel reads (a ``KernelView``),
        no press that gave layers different budgets."""
        codec = self.kv.codec
        return (
            self.kernels is not None
            and (codec.identity or (codec.engine_kernel and codec.kernel_view(0) is not None))
            and all(_layer_lens(s.request) is None for s in scheduled)
        )

    def _kernel_rows(
        self, decodes: list[ScheduledRequest], inputs: StepInputs
    ) -> KernelRows | None:
        """Block tables and context lengths of the kernel's rows (None if there are
        none): decode ``i`` reads table ``i``; row ``j`` of a short chunk after ``kc`` KV
        tokens attends ``kc + j + 1``; a segment repair row at ``p``, ``p + 1``."""
        assert inputs.kernel_seqs is not None
        bs = self.block_size
        seqs: list[KernelSeq] = []
        for s in decodes:
            kc = s.num_computed_tokens - s.request.num_dropped + 1
            seqs.append((s.block_ids[: -(-kc // bs)], [kc]))
        seqs += [(b, list(range(kc + 1, kc + n + 1))) for b, kc, n in inputs.kernel_seqs]
        return make_kernel_rows(seqs, not inputs.kernel_seqs, inputs.kernel_tail)

    def _press_rows(self, ordered: list[ScheduledRequest]) -> dict[str, tuple[int, int]]:
        """Presses: per request, the step's rows ``[r0, r1)`` whose queries its press needs
        (``PressCoordinator.capture_rows`` decides which rows of its chunk)."""
        rows: dict[str, tuple[int, int]] = {}
        if self.press is None or not self.press.states:
            return rows
        row = 0
        for s in ordered:
            n = s.num_new_tokens
            span = self.press.capture_rows(s.request, s.num_computed_tokens, n)
            if span is not None:
                rows[s.request.request_id] = (row + span[0], row + span[1])
            row += n
        return rows

    @staticmethod
    def _logit_plan(ordered: list[ScheduledRequest]) -> LogitPlan:
        plan = LogitPlan()
        row = 0
        for s in ordered:  # sampling rows first, then every row of each draft
            n = s.num_new_tokens
            if s.draft_token_ids:
                plan.verify.append(s)
            elif _wants_prompt_logprobs(s):
                plan.prompt_lp.append((s, len(plan.rows), n))
                plan.rows.extend(range(row, row + n))
                if s.samples:
                    plan.sample_pos.append(len(plan.rows) - 1)
                    plan.sample_reqs.append(s.request)
            elif s.samples:
                plan.sample_pos.append(len(plan.rows))
                plan.rows.append(row + n - 1)
                plan.sample_reqs.append(s.request)
            row += n
        row = 0
        for s in ordered:
            if s.draft_token_ids:
                plan.rows.extend(range(row, row + s.num_new_tokens))
            row += s.num_new_tokens
        return plan

    # ------------------------------------------------------------------ forward, outputs
    def _forward(
        self, inputs: StepInputs, meta: AttentionMetadata, logit_rows: list[int]
    ) -> torch.Tensor:
        """Logits of ``logit_rows`` (the forward pass writes every row's KV either way).
        Rows ``0 .. n - 1`` of an n-row step (a decode-only step) go as None: no gather."""
        every = logit_rows == list(range(len(inputs.ids)))
        rows = None if every else torch.tensor(logit_rows, dtype=torch.long)
        ids, positions = torch.tensor(inputs.ids), torch.tensor(inputs.positions)
        return self.model.forward(ids, positions, meta, self.kv, rows, float_logits=False)

    def _sample(self, logits: torch.Tensor, plan: LogitPlan, result: RunnerOutput) -> None:
        if not plan.sample_reqs:
            return
        so = (
            self.structured
            if self.structured is not None and self.structured.num_requests
            else None
        )
        every_row = len(plan.sample_pos) == logits.shape[0]  # sample_pos is then 0, 1, ...
        rows = logits if every_row else logits[plan.sample_pos]
        if so is None and all(plain_greedy(r) for r in plan.sample_reqs):
            ids = self.sampler.greedy_only(rows)  # no SamplingBatch to build
            if ids is not None:
                for req, token in zip(plan.sample_reqs, ids, strict=True):
                    result.sampled[req.request_id] = token
                return
        batch = SamplingBatch.build(plan.sample_reqs, self.vocab_size)
        mask = None if so is None else so.bitmask_for(plan.sample_reqs)
        sampled = self.sampler(rows, batch, mask)
        for i, req in enumerate(plan.sample_reqs):
            token = sampled.sampled_token_ids[i]
            result.sampled[req.request_id] = token
            lp = sampled.logprobs[i]
            if lp is not None:
                result.logprobs[req.request_id] = lp
            verdict = None if mask is None or so is None else so.accept(req.request_id, token)
            if verdict is not None:
                result.grammar_stops[req.request_id] = verdict

    def _verify(self, logits: torch.Tensor, plan: LogitPlan, result: RunnerOutput) -> None:
        """Speculative decoding: keep each draft's accepted prefix and one token."""
        if not plan.verify:
            return
        first = len(plan.rows) - sum(s.num_new_tokens for s in plan.verify)
        drafts = [(s.request, s.draft_token_ids) for s in plan.verify]
        runs = self.rejection_sampler(logits[first:], drafts)
        for (req, _), run in zip(drafts, runs, strict=True):
            result.accepted[req.request_id] = run[:-1]
            result.sampled[req.request_id] = run[-1]

    def _prompt_logprobs(
        self, s: ScheduledRequest, logits: torch.Tensor, result: RunnerOutput
    ) -> None:
        """Row j (position c + j) predicts prompt token c + j + 1; record the missing ones."""
        req = s.request
        assert req.prompt_logprobs is not None
        c = s.num_computed_tokens
        k = req.sampling_params.prompt_logprobs or 0
        first = len(req.prompt_logprobs)  # first prompt position still without an entry
        if first <= c:  # positions after copied segment KV: no row scored them
            req.prompt_logprobs.extend([None] * (c + 1 - first))
            first = c + 1
        end = min(c + s.num_new_tokens, req.num_prompt_tokens - 1)  # last row's target + 1
        rows = slice(first - 1 - c, end - c)
        targets = torch.tensor(req.prompt_token_ids[first : end + 1], dtype=torch.long)
        capture = self.capture_logits.get(req.request_id)
        if capture is not None:  # quality evaluation: keep whole distributions
            capture.add(first, logits[rows])
        entries = compute_prompt_logprobs(logits[rows], targets, k)
        result.prompt_logprobs[req.request_id] = (first, entries)
