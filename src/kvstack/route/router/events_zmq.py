"""Follow one backend's ZMQ KV events (vLLM's wire) into the router's ``VllmEventIndex``.

What llm-d's KV-event subscriber does, with vLLM's replay socket used to fill gaps.
One :class:`ZmqEventFollower` per backend, an asyncio task on ``zmq.asyncio`` sockets
(every wait is a non-blocking ``await`` with a deadline; the router's event loop never
blocks on a peer):

* a SUB socket connects to the backend's PUB endpoint (vLLM binds ``tcp://*:5557``)
  and subscribes to ``topic``; frames are ``(topic, seq as 8 bytes big-endian,
  KVEventBatch msgpack)`` (``vllm_events.decode_batch``);
* a socket monitor tells connects from losses: on every ZMTP handshake the follower
  asks the ROUTER replay endpoint for every buffered batch from ``next_seq`` (0 the
  first time: the history the publisher still holds), applies them in order, and marks
  the replica fresh; a disconnect (the publisher died, or missed ZMTP heartbeats for
  ``heartbeat_timeout_s``) marks it stale (``suspend``: the policy falls back to its
  approximate index) until the next handshake;
* a PUB frame sent before the subscription reached the publisher is lost without a
  trace until the next one shows the gap, so a connected follower that heard nothing
  for ``probe_s`` asks the replay socket for seqs from ``next_seq`` (an empty answer
  when nothing was lost);
* a live batch whose seq skips ahead is a gap: the follower replays the missing seqs
  (a fresh DEALER per request, ``replay_timeout_s`` per frame); what the replay cannot
  deliver (no replay endpoint, an evicted buffer, a timeout) empties the replica's view
  (``clear``): a view is a subset of the cache, never a guess. A seq below
  ``next_seq`` that no replay of this connection delivered means the publisher
  restarted (numbering from 0 again): the view is cleared and replayed from 0;
* ``AllBlocksCleared`` empties the view (``VllmEventIndex.apply``); a malformed batch is
  counted and treated as a loss.

Invariants: the task never ends by itself (an error is logged, makes the replica stale
and the sockets are made again after a backoff of 0.5 s doubling to 5 s); ``stop``
closes every socket; seqs are applied in increasing order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvstack.route.policy.vllm_events import MalformedBatchError, VllmBatch, decode_batch
from kvstack.route.policy.vllm_index import VllmEventIndex
from kvstack.route.router.follower_task import FollowerTask

logger = logging.getLogger("kvstack.route.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
OFF_LOOP_BYTES = 256 * 1024  # larger payloads are decoded in a worker thread
HANDSHAKE = zmq.EVENT_HANDSHAKE_SUCCEEDED
LOST = zmq.EVENT_DISCONNECTED


@dataclass(frozen=True)
class ZmqEndpoint:
    """A backend's publisher: PUB ``endpoint`` and optional ROUTER ``replay_endpoint``."""

    endpoint: str
    replay_endpoint: str | None = None


class ZmqEventFollower(FollowerTask):
    """Keeps ``index`` in step with the ZMQ KV events of one backend (module docstring)."""

    index: VllmEventIndex
    task_prefix = "kv-events-zmq"

    def __init__(
        self,
        replica_id: str,
        endpoint: ZmqEndpoint,
        index: VllmEventIndex,
        *,
        topic: str = "",
        replay_timeout_s: float = 2.0,
        probe_s: float | None = 2.0,
        heartbeat_s: float = 1.0,
        heartbeat_timeout_s: float = 5.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.endpoint = endpoint
        self.index = index
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.probe_s = probe_s
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._ctx = context or zmq.asyncio.Context.instance()
        self.next_seq: int | None = None  # the seq the next applied batch must have
        self._replayed_from: int | None = None  # lowest seq a replay of this connection sent
        self.connected = False
        self.counts = dict.fromkeys(
            ("connects", "disconnects", "batches", "replays", "replayed_batches",
             "gaps_filled", "gaps_unfilled", "restarts", "malformed"), 0,
        )  # fmt: skip
        self.last_error: str | None = None

    # -- the EventSource protocol ----------------------------------------------------------

    async def restart(self) -> None:
        """Reconnect from scratch: the view is cleared and rebuilt by a replay from 0."""
        await self.stop()
        self.index.clear(self.replica_id)
        self.index.suspend(self.replica_id)
        self.next_seq = None
        self.start()

    def state(self) -> dict[str, Any]:
        space = self.index.keyspace(self.replica_id)  # what the events taught the router
        return {
            "source": "zmq", "endpoint": self.endpoint.endpoint,
            "replay_endpoint": self.endpoint.replay_endpoint, "connected": self.connected,
            "fresh": self.fresh, "next_seq": self.next_seq, **self.counts,
            "block_size": space[0] if space else None,
            "int_hashes": space[1] if space else None,
            "blocks": self.index.num_blocks(self.replica_id), "last_error": self.last_error,
        }  # fmt: skip

    # -- the loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.5
        while True:
            try:
                await self._follow()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug or a ZMQ error: stale, say why, start over
                self.last_error = f"{type(e).__name__}: {e}"
                logger.exception("kv events (zmq) of %s failed; reconnecting", self.replica_id)
                self.index.suspend(self.replica_id)
            self.connected = False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _follow(self) -> None:
        """One SUB socket (ZMQ reconnects it by itself) until an error or cancellation."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.HEARTBEAT_IVL, int(self.heartbeat_s * 1000))
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.heartbeat_timeout_s * 1000))
        sub.setsockopt(zmq.RECONNECT_IVL, 500)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        monitor = sub.get_monitor_socket(HANDSHAKE | LOST)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        probe_ms = None if self.probe_s is None else int(self.probe_s * 1000)
        try:
            sub.connect(self.endpoint.endpoint)
            while True:
                ready = dict(await poller.poll(probe_ms))
                if not ready and self.connected and self.endpoint.replay_endpoint is not None:
                    await self._fill(self.next_seq or 0, None)  # idle: a lost last batch?
                    continue
                if monitor in ready:
                    await self._on_monitor(parse_monitor_message(await monitor.recv_multipart()))
                if sub in ready:
                    await self._on_frames(await sub.recv_multipart())
        finally:
            self.connected = False
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _on_monitor(self, event: Mapping[str, Any]) -> None:
        if event["event"] == HANDSHAKE:
            self.connected = True
            self.counts["connects"] += 1
            self._replayed_from = None
            logger.info("following kv events (zmq) of %s at %s", self.replica_id,
                        self.endpoint.endpoint)  # fmt: skip
            await self._fill(self.next_seq or 0, None)
            self.index.resume(self.replica_id)
        elif event["event"] == LOST and self.connected:
            self.connected = False
            self.counts["disconnects"] += 1
            self.last_error = "publisher disconnected"
            logger.warning("kv events (zmq) of %s lost; routing to it is approximate until "
                           "it reconnects", self.replica_id)  # fmt: skip
            self.index.suspend(self.replica_id)

    async def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._malformed(f"a PUB message of {len(frames)} frames")
            return
        seq = int.from_bytes(frames[1], "big")
        if self.next_seq is not None and seq < self.next_seq:
            if self._replayed_from is not None and seq >= self._replayed_from:
                return  # already applied from the replay
            self.counts["restarts"] += 1
            logger.warning("kv events (zmq) of %s restarted at seq %d (expected %d)",
                           self.replica_id, seq, self.next_seq)  # fmt: skip
            self.index.clear(self.replica_id)
            self.next_seq = None
            await self._fill(0, seq)
        elif self.next_seq is not None and seq > self.next_seq:
            await self._fill(self.next_seq, seq)
        if self.next_seq is not None and seq < self.next_seq:
            return  # the replay covered it
        batch = await self._decode(frames[2])
        if batch is not None:
            self._apply(seq, batch)
        self.next_seq = seq + 1

    def _apply(self, seq: int, batch: VllmBatch) -> None:
        self.index.apply(self.replica_id, batch.events)
        self.counts["batches"] += 1
        self.next_seq = seq + 1

    async def _fill(self, first: int, until: int | None) -> None:
        """Replay seqs ``first ..`` (below ``until`` if given). A hole is a loss: the view
        is cleared and continues from the next seq there is; only the first history of a
        view (``next_seq`` None) may start late (older batches left the buffer)."""
        if until is not None and first >= until:
            self.next_seq = until
            return
        initial = self.next_seq is None
        got = await self._replay(first)
        if got:
            low = got[0][0]
            prev = self._replayed_from
            self._replayed_from = low if prev is None else min(low, prev)
        wanted = first
        for seq, payload in got:
            if seq < wanted:
                continue
            if until is not None and seq >= until:
                break
            if seq > wanted and not (initial and wanted == first):
                self._lost(wanted, seq)
            batch = await self._decode(payload)
            if batch is not None:
                self._apply(seq, batch)
                self.counts["replayed_batches"] += 1
            wanted = seq + 1
        if until is None:
            return  # (re)connect: whatever the publisher still buffers
        if wanted >= until:
            self.counts["gaps_filled"] += 1
        else:
            self._lost(wanted, until)
        self.next_seq = until

    def _lost(self, first: int, until: int) -> None:
        self.counts["gaps_unfilled"] += 1
        logger.warning(
            "kv events (zmq) of %s: seqs %d..%d lost (not in the replay); the "
            "replica's view restarts empty",
            self.replica_id,
            first,
            until - 1,
        )
        self.index.clear(self.replica_id)

    async def _replay(self, first: int) -> list[tuple[int, bytes]]:
        """Every buffered ``(seq, payload)`` with seq >= ``first``; [] without a replay
        endpoint, or what arrived before a frame took longer than ``replay_timeout_s``."""
        if self.endpoint.replay_endpoint is None:
            return []
        self.counts["replays"] += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.endpoint.replay_endpoint)
            await dealer.send_multipart((b"", first.to_bytes(8, "big")))
            while True:
                if not await dealer.poll(int(self.replay_timeout_s * 1000)):
                    self.last_error = f"replay from seq {first} timed out"
                    return out
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self._malformed(f"a replay message of {len(frames)} frames")
                    return out
                if frames[2] == END_SEQ:
                    return out
                out.append((int.from_bytes(frames[2], "big"), frames[3]))
        finally:
            dealer.close(linger=0)

    async def _decode(self, payload: bytes) -> VllmBatch | None:
        try:
            if len(payload) > OFF_LOOP_BYTES:
                return await asyncio.to_thread(decode_batch, payload)
            return decode_batch(payload)
        except MalformedBatchError as e:
            self._malformed(str(e))
            self.index.clear(self.replica_id)  # its events are unknown: a loss
            return None

    def _malformed(self, why: str) -> None:
        if self.counts["malformed"] == 0:
            logger.warning("kv events (zmq) of %s: malformed (%s)", self.replica_id, why)
        self.counts["malformed"] += 1
        self.last_error = f"malformed: {why}"
