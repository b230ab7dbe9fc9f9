"""Vectorized token sampler: logits of the rows that sample → one token id per row.

Order of operations (as vLLM v1)::

    logits [B, V] float32
      → allowed_token_ids (every other token := -inf) → bad_words (the token that would
        complete a bad word := -inf)
      → logit_bias (sparse add)  → min_tokens (stop tokens of short outputs := -inf)
      → penalties: repetition (divide positive / multiply negative logits of tokens seen in
        the prompt or output), then frequency and presence on output counts (OpenAI)
      → structured outputs: tokens the row's grammar forbids := -inf
      → sanitize, only if some row max is not finite (NaN := -inf, +inf := float32 max,
        a row with no finite logit := all 0, then the grammar's mask again)
      = "processed logits"  ──► logprobs = log_softmax(processed)   (before temperature)
      → greedy rows: argmax
      → random rows: z = (x - max) / temperature → top-k mask on z → probs = softmax(z)
                     → top-p and min-p as one per-row probability threshold
                     → argmax(probs / q), q ~ Exponential(1)

With the C++ kernels, a step whose rows are all greedy with nothing to process (no
logits processor, grammar or logprobs) takes ``greedy_argmax`` on the logits as the
lm_head left them (bf16 or float32): the same first-maximum index as ``argmax`` of the
float32 logits, without the float32 copy; a row with a NaN or no finite maximum sends
the step down the full path above.

Logprobs are those of the processed distribution: after allowed_token_ids, bad_words,
bias, min_tokens and penalties, before temperature, top-k, top-p and min-p (clients see
the model's view of each token, not the truncated sampling distribution). A token banned
by min_tokens, bad_words or allowed_token_ids has logprob -inf.

The exponential race ``argmax(p / q)`` samples exactly from ``p`` (the Gumbel-max trick
in the linear domain; ``p`` need not be normalized). q = -log(u), u uniform: one batched
draw for unseeded rows, and for each seeded row a draw from its own generator (see
``sampling_metadata``), so a seeded row's tokens do not depend on the batch around it.
Every per-row operation here (elementwise maths, softmax, cumsum, top-k, sort) computes
a row independently of the others, which keeps seeded rows bit-for-bit batch-invariant.

Top-k keeps every token tied with the k-th largest value; top-p keeps the smallest set of
most likely tokens whose mass reaches p (plus ties of its least likely member); min-p
keeps tokens with ``p >= min_p * p_max``. All three always keep the most likely token,
so no row is ever fully masked. Top-p avoids sorting the vocabulary: it looks at the
64 most likely tokens, then 1,024, and sorts a row only if its nucleus is larger still;
each stage gives exactly the answer a full sort would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstack.core.request import Logprob
from kvstack.model.kernels.loader import Kernels
from kvstack.model.sampling.metadata import SamplingBatch
from kvstack.model.structured.bitmask import StepMask

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "apply_logits_processors",
    "apply_top_k",
    "compute_prompt_logprobs",
    "random_probs",
    "sanitize",
    "top_p_threshold",
]

_NEG_INF = float("-inf")
_F32_MAX = torch.finfo(torch.float32).max
_F32_TINY = torch.finfo(torch.float32).tiny
_TOP_P_STAGES = (64, 1024)  # candidate counts tried before a full sort (see top_p_threshold)


@dataclass
class SamplerOutput:
    """Result of one sampling step, one entry per row (same order as the batch).

    ``logprobs[i]`` is None when row i did not ask for logprobs; otherwise a dict whose
    first entry is the sampled token (with its rank: 1 + number of tokens strictly more
    likely) followed by the row's top-N tokens in descending order with ranks 1..N. When
    the sampled token is among the top-N it appears once.
    """

    sampled_token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]


class Sampler:
    """Samples one token per row from ``[B, V]`` logits using a ``SamplingBatch``.

    ``generator`` (optional) drives the noise of unseeded random rows; by default torch's
    global generator does (so ``torch.manual_seed`` makes a run reproducible).
    """

    def __init__(
        self, generator: torch.Generator | None = None, kernels: Kernels | None = None
    ) -> None:
        self.generator = generator
        # torch.ops.kvstack: greedy_argmax picks greedy tokens straight from bf16 logits.
        self.kernels = kernels

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch, mask: StepMask | None = None
    ) -> SamplerOutput:
        """Sample one token per row. ``logits`` is not modified, except by a ``mask``.

        ``mask`` (structured outputs) sets the logits of tokens a row's grammar forbids to
        -inf after the logits processors (in place: the caller passes logits it owns, as
        the runner's gathered rows are; an inference tensor, the forward's own float32
        logits, is copied first); a row left with no finite logit samples uniformly
        among the tokens its grammar allows.
        """
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits shape {tuple(logits.shape)} != ({batch.num_rows}, V)")
        if logits.shape[1] != batch.vocab_size:
            raise ValueError(f"logits vocab {logits.shape[1]} != batch vocab {batch.vocab_size}")
        if batch.num_rows == 0:
            return SamplerOutput([], [])
        if (
            self.kernels is not None
            and mask is None
            and batch.all_greedy
            and batch.max_num_logprobs is None
            and not batch.needs_logits_processing
        ):  # the common greedy step: no float32 copy of the logits
            ids = self.kernels.greedy_argmax(logits)
            if bool((ids >= 0).all()):  # else a row needs sanitizing: the full path below
                return SamplerOutput(ids.tolist(), [None] * batch.num_rows)

        x = apply_logits_processors(logits.float(), batch)
        if mask is not None:
            if x.is_inference():  # float32 logits straight from the forward: no copy yet,
                x = x.clone()  # and an in-place write outside inference mode raises
            mask.apply(x)
        row_max = x.amax(dim=-1)  # vectorized, ~15x cheaper than argmax / max(dim)
        if not bool(torch.isfinite(row_max).all()):
            x = sanitize(x)
            if mask is not None:
                mask.apply(x)
            row_max = x.amax(dim=-1)

        if batch.all_random:
            token_ids = self._sample_random(x, row_max, batch)
        else:
            token_ids = x.argmax(dim=-1)
            if not batch.all_greedy:
                token_ids[batch.random_rows] = self._sample_random(x, row_max, batch)

        sampled = token_ids.tolist()
        if batch.max_num_logprobs is None:
            return SamplerOutput(sampled, [None] * batch.num_rows)
        rows = batch.logprob_rows
        if len(rows) == batch.num_rows:
            lp_in, lp_ids = x, token_ids
        else:
            index = torch.tensor(rows, dtype=torch.int64)
            lp_in, lp_ids = x[index], token_ids[index]
        dicts = _logprob_dicts(
            torch.log_softmax(lp_in, dim=-1), lp_ids, [batch.num_logprobs[r] or 0 for r in rows]
        )
        logprobs: list[dict[int, Logprob] | None] = [None] * batch.num_rows
        for r, d in zip(rows, dicts, strict=True):
            logprobs[r] = d
        return SamplerOutput(sampled, logprobs)

    def greedy_only(self, logits: torch.Tensor) -> list[int] | None:
        """Argmax of each row of raw logits (every row ``plain_greedy``; no batch to
        build), or None when the kernels are missing or a row needs sanitizing (then
        the caller takes ``__call__``)."""
        if self.kernels is None:
            return None
        ids: list[int] = self.kernels.greedy_argmax(logits).tolist()
        return ids if min(ids) >= 0 else None

    def _sample_random(
        self, x: torch.Tensor, row_max: torch.Tensor, batch: SamplingBatch
    ) -> torch.Tensor:
        """Token ids [R] for the random rows of the processed logits ``x``."""
        probs = random_probs(x, row_max, batch)
        return probs.div_(self._exponential_noise(probs, batch)).argmax(dim=-1)

    def _exponential_noise(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Exponential(1) noise shaped like ``probs`` (seeded rows use their generators).

        Drawn as -log(u), u ~ U[0, 1): ~5x faster than ``Tensor.exponential_`` on CPU. u is
        clamped away from 0, so q lies in (0, 88]: ``probs / q`` is finite and a masked 0
        stays 0 (a q of 0 would turn it into 0/0).
        """
        u = torch.empty_like(probs)
        if len(batch.seeded) < probs.shape[0]:
            u.uniform_(generator=self.generator)
        for pos, gen in batch.seeded:
            u[pos].uniform_(generator=gen)
        return u.clamp_min_(_F32_TINY).log_().neg_()


def random_probs(x: torch.Tensor, row_max: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The sampling distribution [R, V] of the random rows of the processed logits ``x``:
    temperature, top-k, softmax, then top-p / min-p zeroing (not renormalized: the
    exponential race does not need it; ``model/sampling/rejection.py`` renormalizes)."""
    sel = None if batch.all_random else batch.random_rows
    z = x if sel is None else x[sel]
    # Shift each row's max to 0 before scaling: no overflow to +inf, no inf - inf.
    z = (z - _pick(row_max, sel).unsqueeze(1)).div_(_pick(batch.temperature, sel).unsqueeze(1))
    if not batch.no_top_k:
        apply_top_k(z, _pick(batch.top_k, sel))
    probs = torch.softmax(z, dim=-1)
    thr = None if batch.no_top_p else top_p_threshold(probs, _pick(batch.top_p, sel))
    if not batch.no_min_p:
        min_thr = _pick(batch.min_p, sel) * probs.amax(dim=-1)
        thr = min_thr if thr is None else torch.maximum(thr, min_thr)
    if thr is not None:
        probs.masked_fill_(probs < thr.unsqueeze(1), 0.0)
    return probs


def _pick(t: torch.Tensor, sel: torch.Tensor | None) -> torch.Tensor:
    return t if sel is None else t[sel]


def apply_logits_processors(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """allowed_token_ids, bad_words, logit_bias, min_tokens, then penalties (vLLM's order).
    Returns ``logits`` itself if none apply, else a new tensor (the input is never
    modified)."""
    if not batch.needs_logits_processing:
        return logits
    x = logits.clone()
    if batch.allowed_tokens is not None:
        rows, allowed = batch.allowed_tokens
        x[rows] = x[rows].masked_fill_(~allowed, _NEG_INF)
    if batch.bad_words_ban is not None:
        rows, toks = batch.bad_words_ban
        x.index_put_((rows, toks), torch.tensor(_NEG_INF))
    if batch.logit_bias is not None:
        rows, toks, vals = batch.logit_bias
        x.index_put_((rows, toks), vals, accumulate=True)
    if batch.min_tokens_ban is not None:
        rows, toks = batch.min_tokens_ban
        x.index_put_((rows, toks), torch.tensor(_NEG_INF))
    if batch.seen_tokens is not None:  # repetition penalty (HF / vLLM)
        rows, toks = batch.seen_tokens
        vals = x[rows, toks]
        r = batch.repetition_penalties[rows]
        x[rows, toks] = torch.where(vals > 0, vals / r, vals * r)
    if batch.output_token_counts is not None:  # frequency and presence penalties (OpenAI)
        rows, toks, counts = batch.output_token_counts
        delta = batch.frequency_penalties[rows] * counts + batch.presence_penalties[rows]
        x.index_put_((rows, toks), -delta, accumulate=True)
    return x


def sanitize(x: torch.Tensor) -> torch.Tensor:
    """NaN → -inf, +inf → float32 max, rows with no finite logit → all zeros (uniform)."""
    x = torch.nan_to_num(x, nan=_NEG_INF, posinf=_F32_MAX, neginf=_NEG_INF)
    dead = torch.isneginf(x.amax(dim=-1))
    if bool(dead.any()):
        x[dead] = 0.0
    return x


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Set (in place) to -inf every logit below its row's k-th largest; ties are kept.

    ``top_k`` [R] int64; ``k >= V`` disables a row. Uses ``topk`` up to the largest enabled
    k rather than a full sort.
    """
    vocab = logits.shape[1]
    enabled = top_k < vocab
    k_max = int(torch.where(enabled, top_k, 0).max()) if top_k.numel() else 0
    if k_max == 0:
        return logits
    kth = logits.topk(k_max, dim=-1).values.gather(1, (top_k.clamp(max=k_max) - 1).unsqueeze(1))
    kth.masked_fill_(~enabled.unsqueeze(1), _NEG_INF)
    return logits.masked_fill_(logits < kth, _NEG_INF)


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest probability in the top-p nucleus (0.0 where ``top_p >= 1``).

    Every row keeps at least its most likely token, whatever ``top_p`` in (0, 1] is: a
    ``top_p`` below float32's smallest subnormal arrives here as 0.

    ``probs`` [R, V] is a (top-k renormalized) distribution per row. The nucleus is the
    smallest set of most likely tokens whose mass reaches p: sorted by descending
    probability, a token is in it when the mass of the tokens before it is ``< p`` (as
    vLLM's and HF's ``cumsum(ascending) <= 1 - p`` masks). Keeping ``probs >= threshold``
    keeps the nucleus and any token tied with its least likely member.

    Rather than sorting V tokens per row, each row first looks at its 64 largest
    probabilities, then 1,024, then all V (sorted), stopping at the first stage whose
    mass reaches p (then no later token can be in the nucleus). Prefix sums of the same
    sorted values are the same at every stage, so all stages give the same threshold.
    """
    n_rows, vocab = probs.shape
    thr = probs.new_zeros(n_rows)
    todo = torch.nonzero(top_p < 1.0).flatten()
    stages = [c for c in _TOP_P_STAGES if c < vocab] + [vocab]
    for c in stages:
        if todo.numel() == 0:
            break
        rows, p = probs[todo], top_p[todo].to(probs.dtype).unsqueeze(1)
        if c == vocab:
            vals = rows.sort(dim=-1, descending=True).values
        else:
            vals = rows.topk(c, dim=-1).values
        cum = vals.cumsum(dim=-1)
        mass_before = torch.cat([cum.new_zeros(len(todo), 1), cum[:, :-1]], dim=1)
        # >= 1: the first token has mass_before 0 < p, and where p itself rounds to 0
        # in float32 (a top_p of 1e-46 or 1e-320, valid values) the most likely is kept.
        n_keep = (mass_before < p).sum(dim=-1).clamp_min_(1)
        found = vals.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1)
        done = torch.ones_like(n_keep, dtype=torch.bool) if c == vocab else cum[:, -1] >= p[:, 0]
        thr[todo[done]] = found[done]
        todo = todo[~done]
    return thr


def _logprob_dicts(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]
) -> list[dict[int, Logprob]]:
    """Per row: {token: Logprob(lp, rank)} then the row's top-``num_top[i]`` tokens.

    ``logprobs`` [N, V] log-probabilities, ``token_ids`` [N] the tokens to report.
    """
    tok_lp = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > tok_lp).sum(dim=-1, dtype=torch.int32).add_(1).tolist()
    tok_lp_list = tok_lp.squeeze(1).tolist()
    tok_list = token_ids.tolist()
    n_max = max(num_top, default=0)
    top_lp: list[list[float]] = []
    top_ids: list[list[int]] = []
    if n_max > 0:
        top = logprobs.topk(min(n_max, logprobs.shape[1]), dim=-1)
        top_lp, top_ids = top.values.tolist(), top.indices.tolist()
    out: list[dict[int, Logprob]] = []
    for i, n in enumerate(num_top):
        d = {tok_list[i]: Logprob(tok_lp_list[i], ranks[i])}
        rank = 0
        for j in range(min(n, len(top_ids[i]) if top_ids else 0)):
            # Tied values share a rank (1 + number strictly more likely), as the sampled
            # token's rank does; the sampled token keeps the entry computed above.
            if j == 0 or top_lp[i][j] != top_lp[i][j - 1]:
                rank = j + 1
            d.setdefault(top_ids[i][j], Logprob(top_lp[i][j], rank))
        out.append(d)
    return out


def compute_prompt_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor | Sequence[int],
    k: int,
    chunk_size: int = 256,
) -> list[dict[int, Logprob]]:
    """Prompt logprobs: for each position, the actual next prompt token plus the top-k.

    ``logits`` [P, V] are the model's raw logits at positions 0..P-1 and ``target_ids`` [P]
    the prompt tokens at positions 1..P (the token each position predicts). Returns P
    dicts, each shaped as ``SamplerOutput.logprobs`` entries. Works in chunks of
    ``chunk_size`` rows so a long prompt never materializes a [P, V] float32 copy.
    """
    targets = torch.as_tensor(target_ids, dtype=torch.int64)
    if logits.dim() != 2 or targets.shape != (logits.shape[0],):
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)}")
    out: list[dict[int, Logprob]] = []
    for start in range(0, logits.shape[0], chunk_size):
        x = logits[start : start + chunk_size].float()
        if not bool(torch.isfinite(x.amax(dim=-1)).all()):
            x = sanitize(x)
        lp = torch.log_softmax(x, dim=-1)
        tgt = targets[start : start + chunk_size]
        out.extend(_logprob_dicts(lp, tgt, [k] * tgt.shape[0]))
    return out
