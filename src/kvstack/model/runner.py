"""ModelRunner: turns a ``SchedulerOutput`` into tensors, runs the model, samples.

The runner never sees hashes or free lists: only token ids, positions, block tables.
It reorders the step's requests so single-token rows (decodes) come first, which lets
attention batch them (see ``model/attention.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstack.kv.storage import KVStorage
from kvstack.model.attention import AttentionMetadata, PrefillSeq
from kvstack.model.kernels import load_kernels
from kvstack.model.llama import LlamaModel
from kvstack.model.sampler import Sampler, SamplingBatch, compute_prompt_logprobs
from kvstack.request import Logprob, Request
from kvstack.sched.output import ScheduledRequest, SchedulerOutput


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, Logprob]] = field(default_factory=dict)
    # Prompt logprobs computed this step: request id -> (first position, entries).
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob]]]] = field(default_factory=dict)
    # Era 5: per request whose prompt a press will compress after this step, the queries
    # of its last rows, per layer ``[w, heads, head_dim]`` float32.
    press_queries: dict[str, list[torch.Tensor]] = field(default_factory=dict)


def _tokens(req: Request, start: int, n: int) -> list[int]:
    p = req.num_prompt_tokens
    if start + n <= p:
        return req.prompt_token_ids[start : start + n]
    if start >= p:
        return req.output_token_ids[start - p : start - p + n]
    return (req.prompt_token_ids + req.output_token_ids)[start : start + n]


@dataclass
class LogitCapture:
    """Next-token log-distributions of prompt positions ``>= start`` (fp16, ``[n, vocab]``).

    The row kept for prompt position ``p >= 1`` is the distribution the model gave the
    token at ``p`` from tokens ``0 .. p - 1`` (what ``prompt_logprobs`` scores).
    """

    start: int  # first prompt position to keep
    rows: list[torch.Tensor] = field(default_factory=list)

    def add(self, first: int, logits: torch.Tensor) -> None:
        """``logits[j]`` scores prompt position ``first + j``."""
        skip = max(0, self.start - first)
        if skip < logits.shape[0]:
            self.rows.append(torch.log_softmax(logits[skip:].float(), -1).to(torch.float16))

    def logprobs(self) -> torch.Tensor:
        return torch.cat(self.rows) if self.rows else torch.empty(0)


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


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVStorage) -> None:
        self.model = model
        self.kv = kv
        self.block_size = kv.block_size
        self.vocab_size = model.config.vocab_size
        self.num_layers = model.config.num_layers
        self.sampler = Sampler()
        self.kernels = load_kernels()
        # Request id -> where to keep the full next-token log-distributions of its prompt
        # (``kvstack eval`` teacher forcing; only requests with prompt_logprobs).
        self.capture_logits: dict[str, LogitCapture] = {}

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if out.is_empty:
            return RunnerOutput()
        bs = self.block_size
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        # Fresh prompts of equal length sit side by side so attention batches them.
        prefills = sorted(
            (s for s in out.scheduled if s.num_new_tokens != 1),
            key=lambda s: (s.num_computed_tokens > 0, s.num_new_tokens),
        )
        ordered = decodes + prefills

        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        # After a press (era 5) a token's KV slot is its position minus the tokens the
        # press dropped (``Request.num_kv_tokens``); positions (RoPE) keep counting.
        for s in decodes:
            c = s.num_computed_tokens
            kc = c - s.request.num_dropped
            ids.extend(_tokens(s.request, c, 1))
            pos.append(c)
            slots.append(s.block_ids[kc // bs] * bs + kc % bs)
        prefill_meta: list[PrefillSeq] = []
        row = len(decodes)
        for s in prefills:
            c, n = s.num_computed_tokens, s.num_new_tokens
            kc = c - s.request.num_dropped
            ids.extend(_tokens(s.request, c, n))
            p = torch.arange(kc, kc + n)  # KV slots (= positions unless pressed)
            table = torch.tensor(s.block_ids[: -(-(kc + n) // bs)], dtype=torch.long)
            slots.extend((table[p // bs] * bs + p % bs).tolist())
            pos.extend(range(c, c + n))
            c = kc
            if c == 0 and self.kv.codec.identity:
                last = prefill_meta[-1] if prefill_meta else None
                if last is not None and last.block_ids is None and last.q_len == n:
                    last.num_seqs += 1
                else:
                    prefill_meta.append(PrefillSeq(row, n, n, None, None))
            else:
                mask = torch.arange(c + n)[None, :] <= p[:, None]
                seq = PrefillSeq(row, n, c + n, table, mask)
                lens = s.request.kv_layer_lens
                if lens is not None:  # per-layer press budgets: mask slots m_l .. M - 1
                    seq.layer_masks = []
                    for m in lens:
                        lm = mask.clone()
                        lm[:, m : max(lens)] = False
                        seq.layer_masks.append(lm)
                prefill_meta.append(seq)
            row += n

        dec_tables = dec_bias = dec_lens = None
        layer_bias = None
        if decodes:
            ctx = [s.num_computed_tokens - s.request.num_dropped + 1 for s in decodes]
            max_blocks = -(-max(ctx) // bs)
            table_rows = [
                s.block_ids[:max_blocks] + [0] * (max_blocks - min(len(s.block_ids), max_blocks))
                for s in decodes
            ]
            dec_tables = torch.tensor(table_rows, dtype=torch.long)
            dec_lens = torch.tensor(ctx, dtype=torch.long)
            uneven = [i for i, s in enumerate(decodes) if s.request.kv_layer_lens is not None]
            if self.kernels is None or not self.kv.codec.identity or uneven:
                over = torch.arange(max_blocks * bs)[None, :] >= dec_lens[:, None]
                dec_bias = torch.zeros(over.shape, dtype=torch.float32).masked_fill_(
                    over, float("-inf")
                )[:, None, None, :]
            if uneven:  # per-layer press budgets: layer l masks its slots m_l .. M - 1
                assert dec_bias is not None
                layer_bias = dec_bias.expand(self.num_layers, *dec_bias.shape).clone()
                for i in uneven:
                    lens = decodes[i].request.kv_layer_lens
                    assert lens is not None
                    for layer, m in enumerate(lens):
                        layer_bias[layer, i, :, :, m : max(lens)] = float("-inf")

        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            num_decodes=len(decodes),
            decode_block_tables=dec_tables,
            decode_context_lens=dec_lens,
            decode_bias=dec_bias,
            prefills=prefill_meta,
            kernels=self.kernels,
            decode_layer_bias=layer_bias,
            capture_rows=self._press_rows(ordered),
        )

        # Rows whose logits we need: the last row of each sampling request, plus whole
        # prompt chunks of requests that asked for prompt logprobs.
        logit_rows: list[int] = []
        sample_pos: list[int] = []  # index into logit_rows of each sampling row
        sample_reqs: list[Request] = []
        prompt_lp: list[tuple[ScheduledRequest, int, int]] = []  # (s, first logit idx, count)
        row = 0
        for s in ordered:
            n = s.num_new_tokens
            if _wants_prompt_logprobs(s):
                prompt_lp.append((s, len(logit_rows), n))
                logit_rows.extend(range(row, row + n))
                if s.samples:
                    sample_pos.append(len(logit_rows) - 1)
                    sample_reqs.append(s.request)
            elif s.samples:
                sample_pos.append(len(logit_rows))
                logit_rows.append(row + n - 1)
                sample_reqs.append(s.request)
            row += n

        result = RunnerOutput()
        if meta.capture_rows:
            result.press_queries = meta.captured
        if not logit_rows:
            self.model.forward(
                torch.tensor(ids),
                torch.tensor(pos),
                meta,
                self.kv,
                torch.empty(0, dtype=torch.long),
            )
            return result
        logits = self.model.forward(
            torch.tensor(ids),
            torch.tensor(pos),
            meta,
            self.kv,
            torch.tensor(logit_rows, dtype=torch.long),
        )
        for s, first, n in prompt_lp:
            self._prompt_logprobs(s, logits[first : first + n], result)
        if sample_reqs:
            batch = SamplingBatch.build(sample_reqs, self.vocab_size)
            sampled = self.sampler(logits[sample_pos], batch)
            for i, req in enumerate(sample_reqs):
                result.sampled[req.request_id] = sampled.sampled_token_ids[i]
                lp = sampled.logprobs[i]
                if lp is not None:
                    result.logprobs[req.request_id] = lp
        return result

    @staticmethod
    def _press_rows(ordered: list[ScheduledRequest]) -> dict[str, tuple[int, int]]:
        """Rows whose queries a press needs: the last ``press.window`` rows of each request
        whose prompt this step completes and that has a press still to apply, and every
        row of a pressed request that presses again while decoding (``press_every``)."""
        rows: dict[str, tuple[int, int]] = {}
        row = 0
        for s in ordered:
            req, n = s.request, s.num_new_tokens
            press = req.press
            done = s.num_computed_tokens + n >= req.press_point
            repress = req.press_applied and req.press_every is not None
            if press is not None and press.window and done and (repress or not req.press_applied):
                rows[req.request_id] = (row + n - min(press.window, n), row + n)
            row += n
        return rows

    def _prompt_logprobs(
        self, s: ScheduledRequest, logits: torch.Tensor, result: RunnerOutput
    ) -> None:
        """Row j (position c + j) predicts prompt token c + j + 1; record the missing ones."""
        req = s.request
        assert req.prompt_logprobs is not None
        c = s.num_computed_tokens
        k = req.sampling_params.prompt_logprobs or 0
        first = len(req.prompt_logprobs)  # first prompt position still without an entry
        end = min(c + s.num_new_tokens, req.num_prompt_tokens - 1)  # last row's target + 1
        rows = slice(first - 1 - c, end - c)
        targets = torch.tensor(req.prompt_token_ids[first : end + 1], dtype=torch.long)
        capture = self.capture_logits.get(req.request_id)
        if capture is not None:  # quality evaluation: keep whole distributions
            capture.add(first, logits[rows])
        entries = compute_prompt_logprobs(logits[rows], targets, k)
        result.prompt_logprobs[req.request_id] = (first, entries)
