"""Rejection sampling of draft tokens (speculative decoding): which guesses are kept.

Leviathan et al., "Fast Inference from Transformers via Speculative Decoding" (ICML
2023), and Chen et al., "Accelerating Large Language Model Decoding with Speculative
Sampling" (2023): with target distribution ``p`` and draft distribution ``q``, accept a
draft token ``x`` with probability ``min(1, p(x) / q(x))``; on rejection sample from
``norm(max(0, p - q))``. Every proposer here is deterministic (``spec/base.py``), so
``q`` is a point mass on ``x`` and the rule becomes (vLLM's ``NO_DRAFT_PROBS`` case in
``v1/sample/rejection_sampler.py``)::

    accept x            with probability p(x)        (u ~ U[0, 1) in float64; p(x) >= u)
    else sample from    p with x removed, renormalized (the exponential race, as the
                        sampler: argmax(p' / e), e ~ Exp(1); no renormalization needed)

which yields exactly ``p``: P(x) = p(x); P(y != x) = (1 - p(x)) p(y) / (1 - p(x)) = p(y).
``p`` is the plain sampler's distribution of that row (``sampler.random_probs``:
logits processors, temperature, top-k, top-p, min-p), renormalized. Greedy rows keep a
draft token iff it is the row's argmax (the same argmax the sampler takes, on the same
logits), so greedy output is token-identical to one-token steps whenever the logits of
a row do not depend on how many rows the step has.

Rows of one verified request with draft ``d1 .. dk``::

    row:       0      1      ...   k
    input:     t      d1           dk            (t: the last real token)
    checks:    d1     d2           -             row j's distribution decides d(j+1)
    result:    d1 .. da kept (all rows 0 .. a-1 accepted), then one token from row a:
               the correction (rejected d(a+1) removed) or, when a = k, the bonus

Deviations from vLLM: a draft token with ``p(x) = 0`` is never accepted (vLLM accepts it
when ``u`` is exactly 0, probability 2^-53); seeded requests use one generator per
output position (``sampling_metadata.make_generator(seed, num_output + j)``: first the
uniform of row j, then the race's noise if row j samples), so a seeded request's tokens
do not depend on its batch mates; vLLM uses one generator per request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstack.model.sampler import Sampler, apply_logits_processors, random_probs, sanitize
from kvstack.model.sampling_metadata import SamplingBatch, make_generator
from kvstack.request import Request

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
        batch = SamplingBatch.build(reqs, logits.shape[1])
        kernels = self.sampler.kernels
        if kernels is not None and batch.all_greedy and not batch.needs_logits_processing:
            ids = kernels.greedy_argmax(logits)  # as the sampler's greedy fast path
            if bool((ids >= 0).all()):
                return self._runs(ids.tolist(), None, drafts)
        x = apply_logits_processors(logits.float(), batch)
        row_max = x.amax(dim=-1)
        if not bool(torch.isfinite(row_max).all()):
            x = sanitize(x)
            row_max = x.amax(dim=-1)
        probs = None if batch.all_greedy else random_probs(x, row_max, batch)
        return self._runs(x.argmax(dim=-1).tolist(), probs, drafts)

    def _runs(
        self,
        targets: list[int],
        probs: torch.Tensor | None,
        drafts: Sequence[tuple[Request, list[int]]],
    ) -> list[list[int]]:
        """``probs``: the random rows' distributions, in row order (None: all greedy)."""
        out: list[list[int]] = []
        row = rrow = 0
        for req, draft in drafts:
            n = len(draft) + 1
            if req.sampling_params.greedy:
                out.append(greedy_run(targets[row : row + n], draft))
            else:
                assert probs is not None
                out.append(self.random_run(probs[rrow : rrow + n], draft, req))
                rrow += n
            row += n
        return out

    def random_run(self, probs: torch.Tensor, draft: Sequence[int], req: Request) -> list[int]:
        """Kept tokens of a random row group; ``probs`` ``[k + 1, V]`` (not normalized)."""
        p = probs / probs.sum(dim=-1, keepdim=True)
        k = len(draft)
        seed = req.sampling_params.seed
        num_out = len(req.output_token_ids)
        gens: list[torch.Generator | None] = (
            [make_generator(seed, num_out + j) for j in range(k + 1)]
            if seed is not None
            else [self.sampler.generator] * (k + 1)
        )
        p_draft = p[torch.arange(k), torch.tensor(list(draft), dtype=torch.long)].tolist()
        for j in range(k):
            u = float(torch.rand(1, dtype=torch.float64, generator=gens[j]))
            if p_draft[j] > 0.0 and p_draft[j] >= u:
                continue
            rest = p[j].clone()
            rest[draft[j]] = 0.0  # p with the rejected token removed
            return [*draft[:j], _race(rest, gens[j])]
        return [*draft, _race(p[k], gens[k])]


def _race(p: torch.Tensor, gen: torch.Generator | None) -> int:
    """A sample of the (unnormalized) distribution ``p``: ``argmax(p / e)``, e ~ Exp(1)."""
    e = torch.empty_like(p).uniform_(generator=gen).clamp_min_(_F32_TINY).log_().neg_()
    return int((p / e).argmax())
