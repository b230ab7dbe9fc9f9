"""A resumable scanner for one element of a Python list literal (``pythonic``'s lexer).

It finds the ``,`` or ``]`` that ends an element, skipping brackets and string literals
(single, double, triple-quoted, with escapes), without tokenizing the element: regular
expressions jump from one bracket, quote or comma to the next and over a string's body.
``ElementScan`` keeps where a scan stopped, so while a stream grows the text (it only
ever appends) each character is looked at about once, however long the arguments. The
element itself is then read by ``ast`` (``pythonic.parse_call``).

What Python allows and this scanner does not: ``#`` comments (``INVALID``; the ``pythonic``
format takes none). A single-quoted string holding a raw newline is ``INVALID`` as in
Python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

INCOMPLETE = -1
INVALID = -2

_OPEN = {"(": ")", "[": "]", "{": "}"}
_CLOSE = frozenset(_OPEN.values())
_STRUCTURE = re.compile(r"[\"'#()\[\]{},]")
# A string's body up to its closing quote: any character but the quote, a backslash or
# (single-quoted) a newline, or an escape pair. In a triple-quoted body a quote counts
# only when the two characters after it are known not to close the string, so a scan
# never stops inside a quote run and resuming where it stopped is exact.
_SINGLE = {q: re.compile(rf"(?:[^{q}\\\n]|\\.)*", re.DOTALL) for q in "'\""}
_TRIPLE = {q: re.compile(rf"(?:[^{q}\\]|\\.|{q}(?=[^{q}]|{q}[^{q}]))*", re.DOTALL) for q in "'\""}


@dataclass
class ElementScan:
    """Where the scan of one element stopped; resume with the text grown."""

    k: int  # next offset to look at
    stack: list[str] = field(default_factory=list)  # closing brackets still expected
    quote: str = ""  # delimiter of the string literal being read, "" outside one


def _string_rest(text: str, scan: ElementScan) -> int:
    """Read the open string from ``scan.k``: its end, or ``INCOMPLETE`` / ``INVALID``."""
    quote = scan.quote
    body = _TRIPLE if len(quote) == 3 else _SINGLE
    m = body[quote[0]].match(text, scan.k)
    stop = m.end() if m else scan.k
    scan.k = stop
    if text.startswith(quote, stop):
        return stop + len(quote)
    if len(quote) == 1 and text.startswith("\n", stop):
        return INVALID
    return INCOMPLETE  # the text ends (maybe inside an escape or a quote run)


def run(text: str, scan: ElementScan) -> int:
    """Continue ``scan``: the offset of the ``,`` / ``]`` ending the element, else a code."""
    while True:
        if scan.quote:
            end = _string_rest(text, scan)
            if end < 0:
                return end
            scan.k, scan.quote = end, ""
            continue
        m = _STRUCTURE.search(text, scan.k)
        if m is None:
            scan.k = len(text)
            return INCOMPLETE
        k = m.start()
        c = text[k]
        if c in "'\"":
            if text.startswith(c * 3, k):
                scan.quote, scan.k = c * 3, k + 3
            elif text[k + 1 :] in ("", c):
                scan.k = k  # ' or '' at the end: an empty string or a triple quote?
                return INCOMPLETE
            else:
                scan.quote, scan.k = c, k + 1
            continue
        if c == "#":
            return INVALID
        if c in _OPEN:
            scan.stack.append(_OPEN[c])
        elif c in _CLOSE:
            if not scan.stack:
                return k if c == "]" else INVALID
            if scan.stack.pop() != c:
                return INVALID
        elif not scan.stack:  # a comma between elements
            return k
        scan.k = k + 1


def element_end(text: str, i: int) -> int:
    """One-shot ``run`` of the element starting at ``text[i]``."""
    return run(text, ElementScan(i))
