"""Rejection sampling of draft tokens (speculative decoding): which guesses are kept.

Leviathan et al., "Fast Inference from Transformers via Speculative Decoding" (ICML
2023), and Chen et al., "Accelerating Large Language Model Decoding with Speculative
Sampling" (2023): with target distribution ``p`` and draft distribution ``q``, accept a
draft token ``x`` with probability ``min(1, p(x) / q(x))``; on rejection sample from
``norm(max(0, p - q))``. Every proposer here is deterministic (``spec/base.py``), so
``q`` is a point mass on ``x`` and the rule becomes (vLLM's ``NO_DRAFT_PROBS`` case in
``v1/sample/rejection_sampler.py``)::

    accept x with probability p(x), else sample from p with x removed, renormalized

which yields exactly ``p``: P(x) = p(x); P(y != x) = (1 - p(x)) p(y) / (1 - p(x)) = p(y).

Both halves are drawn with one exponential race per row, the sampler's own
(``sampler.py``): ``y = argmax(p / e)``, ``e ~ Exp(1)`` per token, then ``x`` is kept iff
``x == y``. ``P(y = x) = p(x)`` (accept with probability p(x)), and given ``y != x``, ``y``
is distributed as ``p`` without ``x``, renormalized: the same rule, and ``y`` is the
token the sampler itself would have drawn with the same noise. ``p`` is the sampler's
distribution of the row (``sampler.random_probs``: logits processors, temperature,
top-k, top-p, min-p). Greedy rows are the same rule with ``e = 1``: a draft is kept iff
it is the row's argmax (the sampler's argmax, on the same logits)::

    row:       0      1      ...   k
    input:     t      d1           dk            (t: the last real token)
    target:    y0     y1           yk            y_j = argmax(p_j / e_j)
    result:    d1 .. da while d(j+1) == y_j, then y_a (the correction, or the bonus
               when a = k): the tokens one-token steps would have produced

Deviation from vLLM (same distribution, different draws): vLLM tests acceptance with a
separate uniform ``u <= p(x)`` and draws the correction from a second race; here one race
per row decides both, with the noise the sampler uses at that output position
(``sampling_metadata.make_generator(seed, num_output + j)`` for a seeded request), so a
seeded request's tokens are the ones it gets without speculation, whatever its draft
length or batch mates (up to the last-bit differences of a row's logits in a longer
forward, as for greedy rows). A draft token with ``p(x) = 0`` is never kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstack.core.request import Request
from kvstack.model.sampling.metadata import SamplingBatch, make_generator
from kvstack.model.sampling.sampler import Sampler, apply_logits_processors, random_probs, sanitize

_F32_TINY = torch.finfo(torch.float32).tiny


def greedy_run(targets: Sequence[int], draft: Sequence[int]) -> list[int]:
    """Kept tokens of a greedy row group: drafts while they equal the row's argmax, then
    the argmax of the first row that disagrees (or of the last row: the bonus)."""
    a = 0
    while a < len(draft) and draft[a] == targets[a]:
        a += 1
    return [*draft[:a], targets[a]]


class RejectionSampler:
    """Verifies the drafts of one step: ``logits`` ``[R, V]`` hold, request after request,
    the ``len(draft) + 1`` rows of each ``(request, draft)`` in ``drafts``."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(
        self, logits: torch.Tensor, drafts: Sequence[tuple[Request, list[int]]]
    ) -> list[list[int]]:
        """Per request, the tokens to append: kept drafts, then one sampled token."""
        reqs = [req for req, d in drafts for _ in range(len(d) + 1)]
        if logits.shape[0] != len(reqs):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(reqs)} draft rows")
        kernels = self.sampler.kernels
        if kernels is not None and all(_plain_greedy(r) for r, _ in drafts):
            ids = kernels.greedy_argmax(logits)  # as the sampler's greedy fast path
            if bool((ids >= 0).all()):
                return _runs(ids.tolist(), drafts)
        batch = SamplingBatch.build(reqs, logits.shape[1])
        x = apply_logits_processors(logits.float(), batch)
        row_max = x.amax(dim=-1)
        if not bool(torch.isfinite(row_max).all()):
            x = sanitize(x)
            row_max = x.amax(dim=-1)
        targets = x.argmax(dim=-1)
        if not batch.all_greedy:
            probs = random_probs(x, row_max, batch)
            targets[batch.random_rows] = probs.div_(self._noise(probs, drafts)).argmax(dim=-1)
        return _runs(targets.tolist(), drafts)

    def _noise(
        self, probs: torch.Tensor, drafts: Sequence[tuple[Request, list[int]]]
    ) -> torch.Tensor:
        """Exp(1) noise for the random rows (in order): a seeded request's row j from
        ``make_generator(seed, num_output + j)``, drawn as ``Sampler._exponential_noise``
        draws it; the others from the sampler's generator."""
        u = torch.empty_like(probs)
        u.uniform_(generator=self.sampler.generator)
        row = 0
        for req, draft in drafts:
            sp = req.sampling_params
            if sp.greedy:
                continue
            if sp.seed is not None:
                num_out = len(req.output_token_ids)
                for j in range(len(draft) + 1):
                    u[row + j].uniform_(generator=make_generator(sp.seed, num_out + j))
            row += len(draft) + 1
        return u.clamp_min_(_F32_TINY).log_().neg_()


def _plain_greedy(req: Request) -> bool:
    """A greedy request with no logits processor (the sampler's fast-path condition)."""
    sp = req.sampling_params
    return (
        sp.greedy
        and not sp.logit_bias
        and sp.allowed_token_ids is None
        and not sp.bad_words_token_ids
        and len(req.output_token_ids) >= sp.min_tokens
        and not (sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0)
    )


def _runs(targets: list[int], drafts: Sequence[tuple[Request, list[int]]]) -> list[list[int]]:
    """``greedy_run`` of each request's rows of ``targets``."""
    out: list[list[int]] = []
    row = 0
    for _, draft in drafts:
        n = len(draft) + 1
        out.append(greedy_run(targets[row : row + n], draft))
        row += n
    return out
