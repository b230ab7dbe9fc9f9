"""Per-step sampling metadata: the sampling parameters of the rows that sample, as tensors.

``SamplingBatch.build(requests, vocab_size)`` runs once per engine step over the B
requests that sample a token in that step (in the same order as the rows of the logits
handed to ``Sampler``). Everything the sampler needs is resolved here, so the sampler
itself is a short sequence of batched tensor operations:

- per-row parameters as ``[B]`` tensors (temperature, top-p, top-k, min-p, penalties);
- flags (``all_greedy``, ``no_top_k``, ``no_penalties``, ...) so that features no row
  uses cost nothing; the all-greedy, no-extras step is one ``max`` over the logits;
- penalties as sparse, de-duplicated ``(row, token)`` index pairs (tokens seen in the
  prompt or output, for repetition) and ``(row, token, count)`` triples (output counts,
  for presence / frequency), built only for rows that use them: a few hundred entries
  instead of a ``[B, V]`` tensor, so applying them costs a gather and a scatter;
- sparse ``(row, token, value)`` triples for ``logit_bias`` and ``(row, token)`` pairs for
  the stop tokens that ``min_tokens`` bans and for the last token of each ``bad_words``
  sequence whose other tokens end the output so far (vLLM's rule);
- for the rows with ``allowed_token_ids``, their row indices and a ``[A, V]`` mask of the
  tokens they may sample;
- one ``torch.Generator`` per seeded random row, seeded from ``(seed, number of output
  tokens so far)``. The noise a seeded request sees at output position t therefore
  depends only on its seed and t: the same tokens come out whether it runs alone or in
  a batch, at any row, and after preemption and recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstack.core.request import Request

GREEDY_TEMPERATURE = 1e-5
"""A row whose temperature is below this samples greedily (``SamplingParams.greedy``)."""

_MASK64 = (1 << 64) - 1
_F32_MAX = torch.finfo(torch.float32).max


def _splitmix64(x: int) -> int:
    """One round of the splitmix64 mixer (Steele et al. 2014) on a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """Seed (in ``[0, 2**63)``) for a request's generator at output position ``step``.

    Any Python int is accepted as ``seed`` (negative or wider than 64 bits: it is
    reduced modulo 2**64). Neighbouring seeds and steps give unrelated streams.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64)) >> 1


def make_generator(seed: int, step: int) -> torch.Generator:
    """A fresh CPU generator for a seeded request at output position ``step``."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(step_seed(seed, step))
    return gen


@dataclass
class SamplingBatch:
    """Sampling metadata of the B rows that sample in one step (see module docstring).

    Per-row tensors cover all B rows. ``top_k`` holds ``vocab_size`` where disabled;
    ``temperature`` holds 1.0 for greedy rows (they never divide by it). The ``no_*``
    flags for top-k / top-p / min-p look only at random rows, because greedy rows ignore
    those parameters; penalties, ``logit_bias`` and ``min_tokens`` apply to every row.
    """

    num_rows: int
    vocab_size: int
    temperature: torch.Tensor  # [B] float32
    top_p: torch.Tensor  # [B] float32, 1.0 = disabled
    top_k: torch.Tensor  # [B] int64, vocab_size = disabled
    min_p: torch.Tensor  # [B] float32, 0.0 = disabled
    presence_penalties: torch.Tensor  # [B] float32
    frequency_penalties: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    greedy_rows: torch.Tensor  # [G] int64 row indices
    random_rows: torch.Tensor  # [R] int64 row indices (G + R = B)
    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    no_penalties: bool  # no presence, frequency or repetition penalty in any row
    no_repetition_penalty: bool
    no_presence_frequency: bool
    # (rows, token_ids, counts): each distinct output token of each row with a presence or
    # frequency penalty, and how often it occurs in that row's output.
    output_token_counts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (rows, token_ids): each distinct token of the prompt or output of each row with a
    # repetition penalty.
    seen_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows, token_ids, values), each [N]; None when no row has a logit_bias.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (rows, token_ids), each [N]: stop tokens banned while len(output) < min_tokens.
    min_tokens_ban: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows [A], mask [A, V] bool, True = may be sampled) of rows with allowed_token_ids.
    allowed_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows, token_ids), each [N]: tokens that would complete one of the row's bad_words.
    bad_words_ban: tuple[torch.Tensor, torch.Tensor] | None = None
    # (position among random_rows, generator) for each seeded random row.
    seeded: list[tuple[int, torch.Generator]] = field(default_factory=list)
    # Per row: number of top logprobs requested (0 = only the sampled token) or None.
    num_logprobs: list[int | None] = field(default_factory=list)
    max_num_logprobs: int | None = None  # max over rows of num_logprobs; None if no row asks

    @property
    def needs_logits_processing(self) -> bool:
        """True when allowed_token_ids, bad_words, logit_bias, min_tokens or a penalty
        changes some logit this step."""
        return (
            self.allowed_tokens is not None
            or self.bad_words_ban is not None
            or self.logit_bias is not None
            or self.min_tokens_ban is not None
            or not self.no_penalties
        )

    @property
    def logprob_rows(self) -> list[int]:
        """Rows that asked for logprobs, in order."""
        return [i for i, n in enumerate(self.num_logprobs) if n is not None]

    @classmethod
    def build(cls, requests: list[Request], vocab_size: int) -> SamplingBatch:
        """Collect the sampling metadata of ``requests`` (one row each, in order)."""
        v = vocab_size
        temps: list[float] = []
        top_ps: list[float] = []
        top_ks: list[int] = []
        min_ps: list[float] = []
        presence: list[float] = []
        frequency: list[float] = []
        repetition: list[float] = []
        greedy_rows: list[int] = []
        random_rows: list[int] = []
        bias_rows: list[int] = []
        bias_toks: list[int] = []
        bias_vals: list[float] = []
        ban_rows: list[int] = []
        ban_toks: list[int] = []
        seeded: list[tuple[int, torch.Generator]] = []
        num_logprobs: list[int | None] = []
        no_top_k = no_top_p = no_min_p = True

        for row, req in enumerate(requests):
            sp = req.sampling_params
            num_out = len(req.output_token_ids)
            top_k = sp.top_k if 0 < sp.top_k < v else v
            greedy = sp.temperature < GREEDY_TEMPERATURE
            if greedy:
                greedy_rows.append(row)
                temps.append(1.0)
            else:
                if sp.seed is not None:
                    seeded.append((len(random_rows), make_generator(sp.seed, num_out)))
                random_rows.append(row)
                # float32's largest finite value at most: an infinite temperature makes
                # a masked logit's -inf / inf a NaN, and a NaN row samples a banned token.
                temps.append(min(sp.temperature, _F32_MAX))
                no_top_k = no_top_k and top_k >= v
                no_top_p = no_top_p and sp.top_p >= 1.0
                no_min_p = no_min_p and sp.min_p <= 0.0
            top_ks.append(top_k)
            top_ps.append(sp.top_p)
            min_ps.append(sp.min_p)
            presence.append(sp.presence_penalty)
            frequency.append(sp.frequency_penalty)
            repetition.append(sp.repetition_penalty)
            for tok, val in sp.logit_bias.items():
                bias_rows.append(row)
                bias_toks.append(int(tok))
                bias_vals.append(float(val))
            if num_out < sp.min_tokens:
                banned = set(sp.stop_token_ids)
                if not sp.ignore_eos:
                    banned |= req.eos_token_ids
                for tok in sorted(banned):
                    if 0 <= tok < v:
                        ban_rows.append(row)
                        ban_toks.append(tok)
            num_logprobs.append(sp.logprobs)

        no_rep = all(r == 1.0 for r in repetition)
        no_pf = all(p == 0.0 for p in presence) and all(f == 0.0 for f in frequency)
        batch = cls(
            num_rows=len(requests),
            vocab_size=v,
            temperature=torch.tensor(temps, dtype=torch.float32),
            top_p=torch.tensor(top_ps, dtype=torch.float32),
            top_k=torch.tensor(top_ks, dtype=torch.int64),
            min_p=torch.tensor(min_ps, dtype=torch.float32),
            presence_penalties=torch.tensor(presence, dtype=torch.float32),
            frequency_penalties=torch.tensor(frequency, dtype=torch.float32),
            repetition_penalties=torch.tensor(repetition, dtype=torch.float32),
            greedy_rows=torch.tensor(greedy_rows, dtype=torch.int64),
            random_rows=torch.tensor(random_rows, dtype=torch.int64),
            all_greedy=not random_rows,
            all_random=not greedy_rows,
            no_top_k=no_top_k,
            no_top_p=no_top_p,
            no_min_p=no_min_p,
            no_penalties=no_rep and no_pf,
            no_repetition_penalty=no_rep,
            no_presence_frequency=no_pf,
            seeded=seeded,
            num_logprobs=num_logprobs,
            max_num_logprobs=max((n for n in num_logprobs if n is not None), default=None),
        )
        if bias_rows:
            batch.logit_bias = (
                torch.tensor(bias_rows, dtype=torch.int64),
                torch.tensor(bias_toks, dtype=torch.int64),
                torch.tensor(bias_vals, dtype=torch.float32),
            )
        if ban_rows:
            batch.min_tokens_ban = (
                torch.tensor(ban_rows, dtype=torch.int64),
                torch.tensor(ban_toks, dtype=torch.int64),
            )
        batch.allowed_tokens, batch.bad_words_ban = _vocab_constraints(requests, v)
        if not no_pf:
            rows = [i for i in range(len(requests)) if presence[i] != 0.0 or frequency[i] != 0.0]
            keys, counts = torch.unique(
                _token_keys(rows, [requests[i].output_token_ids for i in rows], v),
                return_counts=True,
            )
            batch.output_token_counts = (keys // v, keys % v, counts.to(torch.float32))
        if not no_rep:
            rows = [i for i in range(len(requests)) if repetition[i] != 1.0]
            seqs = [requests[i].prompt_token_ids for i in rows]
            seqs += [requests[i].output_token_ids for i in rows]
            keys = torch.unique(_token_keys(rows + rows, seqs, v))
            batch.seen_tokens = (keys // v, keys % v)
        return batch


def _vocab_constraints(
    requests: list[Request], vocab_size: int
) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """``(allowed_tokens, bad_words_ban)`` of a batch (see ``SamplingBatch``)."""
    allowed_rows: list[int] = []
    allowed_ids: list[list[int]] = []
    ban_rows: list[int] = []
    ban_toks: list[int] = []
    for row, req in enumerate(requests):
        sp = req.sampling_params
        if sp.allowed_token_ids is not None:
            allowed_rows.append(row)
            allowed_ids.append(sp.allowed_token_ids)
        for tok in bad_word_bans(sp.bad_words_token_ids or [], req.output_token_ids):
            ban_rows.append(row)
            ban_toks.append(tok)
    allowed = None
    if allowed_rows:
        mask = torch.zeros(len(allowed_rows), vocab_size, dtype=torch.bool)
        lengths = torch.tensor([len(ids) for ids in allowed_ids], dtype=torch.int64)
        local = torch.repeat_interleave(torch.arange(len(allowed_rows)), lengths)
        mask[local, torch.tensor([t for ids in allowed_ids for t in ids], dtype=torch.int64)] = True
        allowed = (torch.tensor(allowed_rows, dtype=torch.int64), mask)
    banned = None
    if ban_rows:
        banned = (
            torch.tensor(ban_rows, dtype=torch.int64),
            torch.tensor(ban_toks, dtype=torch.int64),
        )
    return allowed, banned


def plain_greedy(req: Request) -> bool:
    """True when ``req``'s next token is the argmax of the raw logits: greedy, no
    logprobs, and nothing that ``SamplingBatch`` would make change a logit (allowed
    tokens, bad words, bias, min_tokens, penalties). The runner then skips building a
    batch (a batch-1 decode step's largest Python cost after the forward)."""
    sp = req.sampling_params
    return (
        sp.temperature < GREEDY_TEMPERATURE
        and sp.logprobs is None
        and not sp.logit_bias
        and len(req.output_token_ids) >= sp.min_tokens
        and sp.presence_penalty == 0.0
        and sp.frequency_penalty == 0.0
        and sp.repetition_penalty == 1.0
        and sp.allowed_token_ids is None
        and not sp.bad_words_token_ids
    )


def bad_word_bans(words: list[list[int]], output: list[int]) -> list[int]:
    """Tokens to ban after ``output``: the last token of each word (a token sequence)
    whose other tokens are the end of ``output`` (a one-token word: always)."""
    n = len(output)
    out = []
    for word in words:
        k = len(word) - 1
        if k <= n and (k == 0 or output[n - k :] == word[:-1]):
            out.append(word[-1])
    return out


def _token_keys(rows: list[int], seqs: list[list[int]], vocab_size: int) -> torch.Tensor:
    """Flat ``row * vocab_size + token`` keys of the tokens of ``seqs[j]`` in row ``rows[j]``."""
    if not rows:
        return torch.empty(0, dtype=torch.int64)
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    row_idx = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    tok_idx = torch.cat([torch.tensor(s, dtype=torch.int64) for s in seqs])
    return row_idx * vocab_size + tok_idx
