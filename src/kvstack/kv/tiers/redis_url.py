"""Redis tier URLs: which schemes, what redis-py's ``from_url`` gets, what logs show.

A URL may carry a password (``redis://:PASSWORD@host``, ``redis://USER:PASSWORD@host``);
``redacted`` is the only form that reaches a log line, ``describe()`` or an error message
(``redis://:hunter2@...`` was once printed). No redis import here, so
``spec.py`` parses URLs without loading the client.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
_REDIS_OPTIONS = ("ttl", "timeout", "backoff")  # ours; the rest of the query is redis-py's


def redacted(url: str) -> str:
    """``url`` with its password replaced by ``***`` (user, host and path kept)."""
    u = urlsplit(url)
    if u.password is None:
        return url
    user = u.username or ""
    host = u.netloc.rpartition("@")[2]
    rest = url.split("://", 1)[1][len(u.netloc) :]  # path, query
    return f"{u.scheme}://{user}:***@{host}{rest}"


def redacted_spec(spec: str) -> str:
    """A ``--kv-offload`` value with the password of each Redis URL in it ``***``: the form
    for anything shown outside the process (the ``vllm:cache_config_info`` labels an
    unauthenticated ``GET /metrics`` serves, logs)."""
    return ",".join(
        redacted(part) if part.strip().startswith(REDIS_SCHEMES) else part
        for part in spec.split(",")
    )


def redis_client_url(url: str) -> str:
    """``url`` without kvstack's own options (ttl, timeout, backoff), for ``from_url``."""
    u = urlsplit(url)
    rest = [(k, v) for k, v in parse_qsl(u.query, keep_blank_values=True)
            if k not in _REDIS_OPTIONS]  # fmt: skip
    query = "&".join(f"{k}={v}" for k, v in rest)
    # Not geturl(): it writes unix:///path as unix:/path, which redis-py refuses.
    return f"{u.scheme}://{u.netloc}{u.path}" + (f"?{query}" if query else "")
