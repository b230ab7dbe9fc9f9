"""Which ops endpoints need the API key: ``--open-endpoints`` (SECURITY.md).

With ``--api-key``, every ``/v1/*`` and cache endpoint needs the key; ``/health`` and
``/version`` never do (probes carry none); of ``OPS_ENDPOINTS`` the open ones are
``--open-endpoints`` (default ``metrics,openapi``, as vLLM leaves ``/metrics`` to
Prometheus). ``/tokenize`` and ``/detokenize`` cost CPU and ``/load`` reveals load and
model id, so they need the key by default. Light (no FastAPI): ``server`` and ``context``
share it.
"""

from __future__ import annotations

from kvstack.core.errors import ConfigError

OPS_ENDPOINTS = ("tokenize", "detokenize", "load", "metrics", "openapi")
DEFAULT_OPEN_ENDPOINTS = "metrics,openapi"


def open_endpoints(text: str) -> frozenset[str]:
    """``--open-endpoints`` as a set: comma-separated names of ``OPS_ENDPOINTS``, or
    ``none``/empty for none (``ConfigError`` for anything else)."""
    names = {n.strip() for n in text.split(",") if n.strip()} - {"none"}
    unknown = sorted(names - set(OPS_ENDPOINTS))
    if unknown:
        raise ConfigError(
            f"--open-endpoints: unknown {unknown}; choose from {', '.join(OPS_ENDPOINTS)} or none"
        )
    return frozenset(names)
