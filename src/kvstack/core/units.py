"""Memory sizes: ``parse_size`` for ``2GiB``-style options and two formatters for reports.

Layer 0 (imports only ``kvstack.core.errors``). ``KiB/MiB/GiB`` are powers of 1024, ``K/M/G``
(with or without ``B``) powers of 1000, as in ``--kv-cache-memory 2GiB`` or ``1.5G``.
"""

from __future__ import annotations

import re

from kvstack.core.errors import ConfigError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4}
_BINARY = (("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def parse_size(text: str | int) -> int:
    """Parse a memory size such as ``2GiB``, ``512MiB``, ``1.5G`` or ``1048576`` to bytes.

    An int is returned as is; any other text, or a size that is not positive, raises
    ``ConfigError`` with an example of the syntax.
    """
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ConfigError(f"cannot parse memory size {text!r} (examples: 2GiB, 512MiB, 1000000)")
    number, unit = float(m.group(1)), (m.group(2) or "").upper()
    if "I" in unit:
        scale = 1024 ** "KMGT".index(unit[0]) * 1024
    else:
        scale = _UNITS[unit.rstrip("B") if unit != "B" else "B"]
    value = int(number * scale)
    if value <= 0:
        raise ConfigError(f"memory size must be positive, got {text!r}")
    return value


def format_size(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches, one decimal: ``1.5 GiB``, ``12 B``."""
    for unit, scale in _BINARY:
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def format_size_exact(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it: ``1 GiB``, ``1536 MiB``."""
    for unit, scale in _BINARY:
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"
