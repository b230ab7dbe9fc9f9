"""``--kv-offload`` specs: which tiers, in which order, with which budgets.

Grammar (comma-separated, order = lookup order, each kind at most once)::

    host:SIZE[:POLICY]                  e.g. host:2GiB        host:512MiB:lfu
    disk:PATH:SIZE[:POLICY]             e.g. disk:/var/cache/kvstack:20GiB
    redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?ttl=S&timeout=S&backoff=S]
                                        e.g. redis://127.0.0.1:6379?ttl=3600
    rediss://...  (TLS)   unix:///PATH/redis.sock[?db=N&...]

A Redis URL is read by redis-py's ``from_url`` (ACL user, TLS, unix sockets); the
password never reaches a log or an error message (``redacted``).

``SIZE`` as ``--kv-cache-memory`` (2GiB, 512MiB, 1e9); ``POLICY`` ``lru`` (default) or
``lfu``. Every mistake raises one ``ConfigError`` naming the bad part.

Tier kinds are registered in ``TIERS`` (name -> ``TierKind``: how to parse a spec part,
how to build the tier); a new tier adds one entry and its module in ``kv/tiers/``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

from kvstack.core.errors import ConfigError
from kvstack.core.registry import Registry
from kvstack.kv.tiers.base import OffloadTier
from kvstack.kv.tiers.block_format import BlockLayout
from kvstack.kv.tiers.redis_url import REDIS_SCHEMES, redacted

TIER_POLICIES = ("lru", "lfu")
EXAMPLE = "host:2GiB,disk:/tmp/kvstack-kv:20GiB,redis://127.0.0.1:6379"


@dataclass(frozen=True)
class TierSpec:
    kind: str  # host | disk | redis
    capacity_bytes: int = 0
    policy: str = "lru"
    path: str = ""
    url: str = ""
    ttl_s: int = 86400
    timeout_s: float = 0.25
    backoff_s: float = 5.0


def _bad(part: str, why: str) -> ConfigError:
    return ConfigError(f"bad --kv-offload tier {part!r}: {why} (example: {EXAMPLE})")


def _size_and_policy(part: str, fields: list[str]) -> tuple[int, str]:
    from kvstack.core.units import parse_size

    policy = "lru"
    if fields and fields[-1].lower() in TIER_POLICIES:
        policy = fields.pop().lower()
    if len(fields) != 1 or not fields[0]:
        raise _bad(part, "expected a size such as 2GiB")
    try:
        return parse_size(fields[0]), policy
    except ConfigError as e:
        raise _bad(part, str(e)) from None


def _redis(part: str) -> TierSpec:
    u = urlsplit(part)
    shown = redacted(part)
    try:
        u.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as e:
        raise _bad(shown, str(e)) from None
    if u.scheme == "unix":
        if not u.path:
            raise _bad(shown, "a unix socket URL needs a path: unix:///run/redis.sock")
    elif not u.hostname:
        raise _bad(shown, "no host")
    elif u.path.strip("/") and not u.path.strip("/").isdigit():
        raise _bad(shown, "the path must be a database number such as /0")
    opts = {"ttl": 86400.0, "timeout": 0.25, "backoff": 5.0}
    for key, value in parse_qsl(u.query, keep_blank_values=True):
        if key == "db" and value.isdigit():
            continue
        if key not in opts:
            raise _bad(shown, f"unknown option {key!r} (ttl, timeout, backoff, db)")
        try:
            opts[key] = float(value)
        except ValueError:
            raise _bad(shown, f"{key} must be a number of seconds") from None
        if opts[key] <= 0:
            raise _bad(shown, f"{key} must be positive")
    return TierSpec(
        "redis",
        url=part,
        ttl_s=max(1, int(opts["ttl"])),
        timeout_s=opts["timeout"],
        backoff_s=opts["backoff"],
    )


def _host(part: str) -> TierSpec:
    size, policy = _size_and_policy(part, part.split(":")[1:])
    return TierSpec("host", capacity_bytes=size, policy=policy)


def _disk(part: str) -> TierSpec:
    fields = part.split(":")[1:]
    policy = "lru"
    if fields and fields[-1].lower() in TIER_POLICIES:
        policy = fields.pop().lower()
    if len(fields) < 2 or not fields[0]:
        raise _bad(part, "expected disk:PATH:SIZE")
    path = ":".join(fields[:-1])
    size, _ = _size_and_policy(part, fields[-1:])
    return TierSpec("disk", capacity_bytes=size, policy=policy, path=path)


def _build_host(s: TierSpec, layout: BlockLayout) -> OffloadTier:
    from kvstack.kv.tiers.host import HostTier

    return HostTier(layout, s.capacity_bytes, s.policy)


def _build_disk(s: TierSpec, layout: BlockLayout) -> OffloadTier:
    from kvstack.kv.tiers.disk import DiskTier

    try:
        return DiskTier(layout, s.path, s.capacity_bytes, s.policy)
    except OSError as e:
        raise ConfigError(f"--kv-offload disk path {s.path!r} is not usable: {e}") from e


def _build_redis(s: TierSpec, layout: BlockLayout) -> OffloadTier:
    from kvstack.kv.tiers.redis_tier import RedisTier  # (imports the redis client)

    return RedisTier(layout, s.url, s.ttl_s, s.timeout_s, s.backoff_s)


@dataclass(frozen=True)
class TierKind:
    """One kind of tier: a spec part starting with ``prefix`` is read by ``parse``;
    ``build`` makes the tier."""

    prefixes: tuple[str, ...]
    parse: Callable[[str], TierSpec]
    build: Callable[[TierSpec, BlockLayout], OffloadTier]

    def matches(self, part: str) -> bool:
        return any(part.startswith(p) or part == p.rstrip(":") for p in self.prefixes)


TIERS: Registry[TierKind] = Registry("offload tier")
TIERS.add("host", TierKind(("host:",), _host, _build_host), "host:SIZE[:lru|lfu] (RAM)")
TIERS.add("disk", TierKind(("disk:",), _disk, _build_disk), "disk:PATH:SIZE[:lru|lfu] (files)")
TIERS.add(
    "redis", TierKind(REDIS_SCHEMES, _redis, _build_redis),
    "redis://[USER:PASSWORD@]HOST:PORT[/DB], rediss://..., unix:///PATH (shared)",
)  # fmt: skip


def parse_offload_spec(text: str | None) -> list[TierSpec]:
    """Parse a ``--kv-offload`` value; ``None`` or ``""`` means no tiers."""
    if not text:
        return []
    specs: list[TierSpec] = []
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            raise _bad(raw, "empty tier")
        kinds = [k for _, k in TIERS.items() if k.matches(part)]
        if not kinds:
            raise _bad(redacted(part), "a tier is host:SIZE, disk:PATH:SIZE or redis://HOST:PORT")
        spec = kinds[0].parse(part)
        if any(s.kind == spec.kind for s in specs):
            raise _bad(redacted(part), f"{spec.kind} is given twice")
        specs.append(spec)
    return specs


def build_tiers(specs: list[TierSpec], layout: BlockLayout) -> list[OffloadTier]:
    return [TIERS.get(s.kind).build(s, layout) for s in specs]
