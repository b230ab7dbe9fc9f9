"""vLLM's ZMQ KV-event publisher: a PUB socket plus a ROUTER replay socket.

Frames, as vLLM's ``ZmqEventPublisher`` sends them (``vllm/distributed/kv_events.py``):

* PUB: ``(topic, seq as 8-byte big-endian, msgpack KVEventBatch)`` per batch; ``seq``
  counts batches from 0 with no gap (a subscriber that sees a gap asks for a replay).
* ROUTER replay: a DEALER/REQ client sends ``(b"", start_seq as 8 bytes)``; it gets back
  ``(b"", topic, seq, payload)`` for every buffered batch with ``seq >= start_seq``
  (the last ``buffer_steps``), then ``(b"", b"", -1 as 8 signed bytes, b"")``.

The engine never waits for a subscriber: events go from the engine (and offload I/O)
threads into a bounded queue (``max_queue_size``); when it is full the event is dropped
and counted (``kvstack:kv_events_dropped_total``) and the next batch starts with
``AllBlocksCleared``, so an indexer resets rather than keeps a wrong view. PUB drops
at its high-water mark (``hwm``) without blocking, as ZMQ PUB sockets do. One
publisher thread translates (``kv_events_vllm.py``), encodes and sends; it batches
what is queued when it wakes (vLLM: one batch per engine step).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgpack
import zmq

from kvstack.core.errors import ConfigError
from kvstack.kv.events import KVEvent, KVEventLog
from kvstack.serve.events.config import KVEventsConfig
from kvstack.serve.events.vllm import VllmEventTranslator

logger = logging.getLogger("kvstack.serve")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_BATCH = 1024  # events per batch at most


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard, ``::`` and ipc/inproc endpoints; connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKVEventPublisher:
    """Publishes ``events`` on vLLM's wire until ``close()``.

    Sockets are bound (or connected) in the constructor, so an endpoint that cannot bind
    is a ``ConfigError`` at once: ``kvstack serve`` builds the publisher before the model
    loads (like the HTTP socket) and calls ``start`` once the engine exists. Given a
    ``translator``, the constructor starts at once.
    """

    def __init__(
        self,
        config: KVEventsConfig,
        translator: VllmEventTranslator | None = None,
        events: KVEventLog | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.config = config
        self.translator = VllmEventTranslator("builtin")
        self.num_dropped = 0  # events the full queue refused
        self.num_batches = 0
        self._pending_reset = False
        self._queue: queue.Queue[KVEvent] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket[Any] | None = None
        try:
            self.endpoint = _attach(self._pub, config.endpoint, "endpoint")
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint: str | None = _attach(
                    self._replay, config.replay_endpoint, "replay_endpoint", bind=True
                )
        except ConfigError:
            self._close_sockets()
            raise
        self._running = False
        self._thread: threading.Thread | None = None
        if translator is not None:
            self.start(translator, events)

    def start(self, translator: VllmEventTranslator, events: KVEventLog | None = None) -> None:
        """Start the publisher thread (once): translate with ``translator``, follow ``events``."""
        if self._thread is not None:
            return
        self.translator = translator
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="kvstack-kv-events", daemon=True)
        self._thread.start()
        if events is not None:
            events.subscribe(self.put)
        logger.info(
            "KV events: ZMQ PUB on %s (replay %s), %s hashes", self.endpoint,
            self.config.replay_endpoint, translator.algo,
        )  # fmt: skip

    def put(self, event: KVEvent) -> None:
        """Queue one event; never blocks (a full queue drops it and counts the drop)."""
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.num_dropped += 1
            self._pending_reset = True

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout_s``), stop the thread, close sockets."""
        deadline = time.monotonic() + timeout_s
        while self._thread is not None and not self._queue.empty():
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._close_sockets()

    # ------------------------------------------------------------------ publisher thread
    def _loop(self) -> None:
        while self._running:
            try:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                first = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            except Exception:
                logger.exception("KV events: replay failed")
                continue
            batch = [first]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._publish(batch)
            except Exception:  # a bug in one batch must not stop publishing
                logger.exception("KV events: publishing a batch failed")

    def _publish(self, batch: list[KVEvent]) -> None:
        out: list[dict[str, Any]] = []
        if self._pending_reset:
            self._pending_reset = False
            self.translator.reset()
            out.append({"type": "AllBlocksCleared"})
        for ev in batch:
            if (e := self.translator.translate(ev)) is not None:
                out.append(e)
        if not out:
            return
        payload = msgpack.packb([time.time(), out, 0], use_bin_type=True)
        seq = self.num_batches
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.num_batches += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frame = self._replay.recv_multipart()
        if len(frame) != 3:
            logger.warning("KV events: invalid replay request of %d frames", len(frame))
            return
        client, _, start = frame
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


def _attach(sock: zmq.Socket[Any], endpoint: str, what: str, bind: bool = False) -> str:
    """Bind or connect ``sock`` (vLLM's rule; the replay socket always binds)."""
    try:
        if bind or is_bind_endpoint(endpoint):
            sock.bind(endpoint)
            last = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            return last or endpoint
        sock.connect(endpoint)
        return endpoint
    except zmq.ZMQError as e:
        raise ConfigError(f"--kv-events-config: cannot use {what} {endpoint!r}: {e}") from None
