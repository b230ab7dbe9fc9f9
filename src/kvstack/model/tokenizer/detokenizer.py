"""Streaming detokenization and stop strings.

Decoding one token at a time is wrong for byte-level BPE: an emoji or a CJK character is
often split over two or three tokens, and decoding a lone piece gives U+FFFD. Like vLLM we
keep two offsets into the generated ids::

    ids:     t0 t1 t2 t3 t4 t5 t6
                   ^prefix  ^read
    prefix_text = decode(ids[prefix:read])        (already emitted)
    new_text    = decode(ids[prefix:])            (with the new tokens)
    delta       = new_text[len(prefix_text):]     unless new_text ends in U+FFFD

Decoding from ``prefix`` (not ``read``) gives the decoder context, so tokenizers that
strip a leading space at the start of a sequence do not lose spaces mid-stream. While the
tail is an incomplete UTF-8 character the delta is held back; ``finish()`` flushes what is
left, so the concatenation of all deltas equals ``tokenizer.decode(all_ids)``.

Stop strings: the text is searched for each stop string as it grows; on a match the text
is cut before the stop string (or after it with ``include_stop_str_in_output``) and the
stream ends. Until then the stream holds back any tail that could still become a stop
string, so a client never sees a partial stop string that is later cut off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def find_stop(text: str, stop: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """Earliest ``(index, stop_string)`` of any stop string in ``text[start:]``, or None."""
    best: tuple[int, str] | None = None
    for s in stop:
        if not s:
            continue
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
            best = (i, s)
    return best


def check_stop_strings(
    text: str,
    stop: Sequence[str],
    include_stop_str_in_output: bool = False,
    start: int = 0,
) -> tuple[str, str | None]:
    """``(text truncated at the first stop string, that stop string)``, or ``(text, None)``.

    ``start`` skips a prefix already known to hold no complete stop string.
    """
    hit = find_stop(text, stop, start)
    if hit is None:
        return text, None
    index, matched = hit
    end = index + len(matched) if include_stop_str_in_output else index
    return text[:end], matched


def stop_holdback(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas that are safe to stream.

    ``add_tokens(ids)`` returns the new text (possibly ``""``); ``finish()`` returns the
    held-back remainder. After a stop string matched, ``stop_reason`` is that string,
    ``stopped`` is True and further tokens are ignored. ``text`` is everything emitted.
    ``prompt_ids`` (optional) gives the decoder context for the first generated tokens; the
    prompt itself is never emitted.
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        prompt_ids: Sequence[int] = (),
        context_tokens: int = 6,
    ) -> None:
        self._tok = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._ids: list[int] = list(prompt_ids[-context_tokens:]) if prompt_ids else []
        if REPLACEMENT_CHAR in self._decode(self._ids):  # a split character: no clean context
            self._ids = []
        self._n_context = len(self._ids)
        self._prefix = 0
        self._read = self._n_context
        self._decoded = ""  # all decoded output text (without stop truncation)
        self._searched = 0  # text[:searched] holds no complete stop string
        self.text = ""  # emitted so far
        self.stop_reason: str | None = None

    @property
    def stopped(self) -> bool:
        """True once a stop string has matched."""
        return self.stop_reason is not None

    @property
    def token_ids(self) -> list[int]:
        """The generated ids fed so far (prompt context excluded)."""
        return self._ids[self._n_context :]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _raw_delta(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text) :]
        return ""

    def add_tokens(self, ids: int | Sequence[int]) -> str:
        """Feed new token ids; return the text that may now be streamed."""
        if self.stopped:
            return ""
        self._ids.extend([ids] if isinstance(ids, int) else ids)
        self._decoded += self._raw_delta()
        return self._emit(final=False)

    def finish(self) -> str:
        """End of generation: return everything still held back."""
        if self.stopped:
            return ""
        full = self._decode(self.token_ids)
        if self._n_context == 0 and full.startswith(self._decoded):
            self._decoded = full
        else:  # decoded with prompt context: only flush the undecoded tail
            self._decoded += self._decode(self._ids[self._prefix :])[
                len(self._decode(self._ids[self._prefix : self._read])) :
            ]
        self._prefix = self._read = len(self._ids)
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        text = self._decoded
        if self.stop:
            longest = max(len(s) for s in self.stop)
            truncated, matched = check_stop_strings(
                text,
                self.stop,
                self.include_stop_str_in_output,
                start=max(0, self._searched - longest + 1),
            )
            self._searched = len(text)
            if matched is not None:
                self.stop_reason = matched
                delta = truncated[len(self.text) :]
                self.text = truncated
                return delta
        safe = len(text)
        if self.stop and not final and not self.include_stop_str_in_output:
            safe -= stop_holdback(text, self.stop)
        if safe <= len(self.text):
            return ""
        delta = text[len(self.text) : safe]
        self.text += delta
        return delta
