"""Backend addresses: URL validation and DNS discovery (a Kubernetes headless Service).

:class:`DnsDiscovery` re-resolves a name's A/AAAA records every ``interval`` seconds and
hands the resulting ``http://ADDRESS:PORT`` set to a callback (``BackendPool.sync_discovered``
adds the new backends and removes the vanished ones). A failed lookup keeps the current
set: health checks already eject dead backends, and a DNS hiccup must not empty the pool.
This is how the Gateway API Inference Extension's endpoint picker and SGLang's router
follow pods without talking to the Kubernetes API.

The router sends its API key and the clients' ``Authorization`` to every backend, so a DNS
answer is trusted only so far (a key leak otherwise): loopback, link-local (cloud metadata
at 169.254.169.254), unspecified and multicast addresses are dropped unless a
``--discover-allow`` network holds them, and at most ``max_backends`` addresses are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from urllib.parse import urlsplit

from kvstack.core.errors import ConfigError

logger = logging.getLogger("kvstack.route")

Resolver = Callable[[str, int], Awaitable[Iterable[str]]]
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
MAX_DISCOVERED = 64


def parse_networks(cidrs: Iterable[str]) -> tuple[Network, ...]:
    """``--discover-allow`` values (``127.0.0.0/8``, ``::1``) as networks."""
    out = []
    for c in cidrs:
        try:
            out.append(ipaddress.ip_network(c.strip(), strict=False))
        except ValueError as e:
            raise ConfigError(
                f"--discover-allow wants a CIDR (10.0.0.0/8, ::1), got {c!r}: {e}"
            ) from None
    return tuple(out)


def refused_reason(address: str, allow: Sequence[Network]) -> str | None:
    """Why a discovered ``address`` is not used (None: it is): not an IP, or loopback /
    link-local / unspecified / multicast outside every ``allow`` network."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return "not an IP address"
    if any(ip.version == n.version and ip in n for n in allow):
        return None
    for kind in ("loopback", "link_local", "unspecified", "multicast"):
        if getattr(ip, f"is_{kind}"):
            return f"{kind.replace('_', '-')} (allow it with --discover-allow)"
    return None


def normalize_url(url: str) -> str:
    """``http(s)://host[:port]`` with the scheme lower-cased and no trailing slash."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as e:
        raise ConfigError(f"malformed backend URL {url!r}: {e}") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"malformed backend URL {url!r}: expected http://HOST:PORT")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ConfigError(f"malformed backend URL {url!r}: give only scheme, host and port")
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"backend URL {url!r}: port must be in 1..65535")
    return f"{parts.scheme.lower()}://{parts.netloc}"


def parse_dns_target(target: str) -> tuple[str, int]:
    """``HOST:PORT`` → ``(host, port)`` for ``--discover-dns``."""
    host, sep, port_s = target.strip().rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ConfigError(f"--discover-dns wants HOST:PORT (port 1..65535), got {target!r}")
    return host.strip("[]"), int(port_s)


async def resolve_addresses(host: str, port: int) -> list[str]:
    """The A/AAAA addresses of ``host`` (``socket.gaierror`` if the name does not resolve)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def address_url(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


class DnsDiscovery:
    """Calls ``sync(urls)`` with the backends ``target`` (``HOST:PORT``) resolves to."""

    def __init__(
        self,
        target: str,
        sync: Callable[[set[str]], Awaitable[None]],
        *,
        interval: float = 5.0,
        resolver: Resolver | None = None,
        allow: Sequence[Network] = (),
        max_backends: int = MAX_DISCOVERED,
    ) -> None:
        self.host, self.port = parse_dns_target(target)
        self.allow = tuple(allow)
        self.max_backends = max_backends
        self.refused: dict[str, str] = {}  # address -> why, of the last answer
        self.sync = sync
        self.interval = interval
        self.resolver: Resolver = resolver or resolve_addresses
        self.last_error: str | None = None
        self.lookups = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="router-dns")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def accept(self, addresses: list[str]) -> list[str]:
        """The addresses of one answer the router may send keys to (sorted, capped)."""
        refused = {a: why for a in addresses if (why := refused_reason(a, self.allow))}
        for a, why in refused.items():
            if a not in self.refused:
                logger.warning("DNS %s: ignoring %s: %s", self.host, a, why)
        self.refused = refused
        kept = sorted(a for a in addresses if a not in refused)
        if len(kept) > self.max_backends:
            logger.warning("DNS %s: %d addresses, keeping the first %d", self.host,
                           len(kept), self.max_backends)  # fmt: skip
        return kept[: self.max_backends]

    async def _run(self) -> None:
        while True:
            try:
                addresses = list(await self.resolver(self.host, self.port))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self.last_error is None:
                    logger.warning("DNS lookup of %s failed (%s); keeping the current backends",
                                   self.host, e)  # fmt: skip
                self.last_error = str(e) or type(e).__name__
            else:
                if self.last_error is not None:
                    logger.info("DNS lookup of %s works again", self.host)
                self.last_error = None
                self.lookups += 1
                try:
                    await self.sync({address_url(a, self.port) for a in self.accept(addresses)})
                except Exception:  # a bad address must not end discovery
                    logger.exception("applying the DNS answer for %s failed", self.host)
            await asyncio.sleep(self.interval)
