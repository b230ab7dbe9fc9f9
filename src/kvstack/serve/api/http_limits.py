"""Connection-level limits uvicorn lacks: a deadline for a request's headers.

uvicorn closes an idle keep-alive connection (``timeout_keep_alive``) but puts no limit on
a request whose headers arrive one byte at a time: any byte cancels the keep-alive timer,
so a slowloris client held connections open indefinitely (partial
headers were held > 20 s). ``header_deadline_protocol(s)`` is uvicorn's httptools protocol
with one more timer, as nginx's ``client_header_timeout`` and Apache's ``mod_reqtimeout``:

* armed when a connection opens, and on a kept-alive connection when the first byte of
  its next request arrives (an idle kept-alive connection is uvicorn's
  ``timeout_keep_alive``'s business: closing it sooner races a client reusing it; the
  soak caught a router counting those resets as backend failures);
* cancelled when a request's headers are complete;
* on expiry the connection is closed without an answer (the client sent no request).

The body has its own deadline in ``http_errors.read_body`` (408), and the number of
connections is capped by uvicorn's ``limit_concurrency`` (503 past it): ``--max-connections``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger("kvstack.serve")


class _HeaderDeadlineProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None
    _between_requests = False  # a response completed; no byte of the next request yet

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            logger.debug("closing %s: no request headers within %.1f s", self.client,
                         self.header_timeout_s)  # fmt: skip
            self.transport.close()

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._between_requests:
            self._between_requests = False
            self._arm()
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._between_requests = not self.pipeline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def header_deadline_protocol(header_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's ``http=`` protocol class that closes a connection whose request headers
    are not complete within ``header_timeout_s`` seconds (> 0)."""
    assert header_timeout_s > 0, header_timeout_s
    return type(
        "HeaderDeadlineProtocol", (_HeaderDeadlineProtocol,), {"header_timeout_s": header_timeout_s}
    )
