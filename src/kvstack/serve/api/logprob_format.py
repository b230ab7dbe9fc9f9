"""Log-probabilities in the shapes OpenAI and vLLM clients read.

* completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` and
  ``text_offset``, one entry per token; with ``echo`` the prompt's tokens come first and
  the first prompt token, which nothing predicts, has ``null`` logprob and top entries
  (what lm-evaluation-harness reads for loglikelihood)::

      {"tokens": ["The", " sky", " is"], "token_logprobs": [null, -7.1, -0.4],
       "top_logprobs": [null, {" sky": -7.1, ",": -2.3}, {" is": -0.4}],
       "text_offset": [0, 3, 7]}

  ``top_logprobs`` holds at most ``logprobs + 1`` entries (the scored token, then the
  most likely ones), ``text_offset`` is the running length of the token strings;
* chat ``logprobs.content`` (generated tokens only);
* vLLM's ``prompt_logprobs``: ``null`` first, then per prompt token a dict from token id
  (a JSON string key) to ``{"logprob", "rank", "decoded_token"}``: the prompt token itself
  and the ``prompt_logprobs`` most likely ones.

``-inf`` becomes ``-9999.0`` everywhere, as in OpenAI's and vLLM's answers (JSON has no
infinity).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstack.core.request import CompletionOutput, Logprob
from kvstack.model.tokenizer.tokenizer import Tokenizer

FLOOR = -9999.0

Entries = Sequence[dict[int, Logprob] | None]


class TokenIdNames:
    """Names tokens ``token_id:N`` where logprobs show tokens (vLLM's
    ``--return-tokens-as-token-ids``): a token that is not valid UTF-8 alone stays
    identifiable. Passed where a ``Tokenizer`` is, it answers ``decode`` only."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"token_id:{i}" for i in ids)


def token_str(tok: Tokenizer | TokenIdNames, tid: int) -> str:
    return tok.decode([tid], skip_special_tokens=False)


def _lp(x: float) -> float:
    return max(x, FLOOR)


def completion_logprobs(
    tok: Tokenizer | TokenIdNames,
    token_ids: Sequence[int],
    entries: Entries,
    k: int,
    text_offset: int = 0,
) -> dict[str, Any]:
    """OpenAI completions ``logprobs`` of ``token_ids``, ``entries[i]`` scoring token i
    (None: unscored, the first prompt token); offsets start at ``text_offset``."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    pos = text_offset
    for tid, lps in zip(token_ids, entries, strict=False):
        s = token_str(tok, tid)
        tokens.append(s)
        if lps is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(_lp(lps[tid].logprob) if tid in lps else None)
            items = list(lps.items())[: k + 1]
            tops.append({token_str(tok, t): _lp(lp.logprob) for t, lp in items})
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def next_offset(logprobs: dict[str, Any], start: int) -> int:
    """The offset after the last token of a ``completion_logprobs`` result."""
    if not logprobs["tokens"]:
        return start
    return int(logprobs["text_offset"][-1]) + len(logprobs["tokens"][-1])


def prompt_logprobs_json(tok: Tokenizer, entries: Entries | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs`` field (None when the request did not ask for them)."""
    if entries is None:
        return None
    out: list[Any] = []
    for d in entries:
        if d is None:
            out.append(None)
            continue
        out.append(
            {
                str(tid): {
                    "logprob": _lp(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": lp.decoded_token
                    if lp.decoded_token is not None
                    else token_str(tok, tid),
                }
                for tid, lp in d.items()
            }
        )
    return out


def _top_entry(tok: Tokenizer | TokenIdNames, tid: int, lp: Logprob) -> dict[str, Any]:
    s = token_str(tok, tid)
    return {"token": s, "logprob": _lp(lp.logprob), "bytes": list(s.encode())}


def chat_logprobs(
    tok: Tokenizer | TokenIdNames, c: CompletionOutput, start: int, k: int
) -> dict[str, Any]:
    """OpenAI chat ``logprobs.content`` for tokens ``start..`` of ``c``."""
    content = []
    for tid, lps in zip(c.token_ids[start:], (c.logprobs or [])[start:], strict=False):
        chosen = lps.get(tid)
        ranked = sorted(lps.items(), key=lambda kv: -kv[1].logprob)[:k]
        entry: dict[str, Any] = (
            _top_entry(tok, tid, chosen) if chosen else {"token": token_str(tok, tid)}
        )
        entry["top_logprobs"] = [_top_entry(tok, i, lp) for i, lp in ranked]
        content.append(entry)
    return {"content": content}
