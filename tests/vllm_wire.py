"""vLLM 0.32's KV-event structs (``vllm/distributed/kv_events.py``), re-declared with msgspec.

An independent codec for the tests: the same field names, order, defaults and msgspec
options as vLLM's (``EventBatch``: ``array_like``, ``omit_defaults``; events: tagged
structs with ``omit_defaults``), so ``ENCODER.encode`` produces the bytes vLLM's
publisher would and ``DECODER`` refuses what vLLM's own decoder would refuse (unknown
fields forbidden). ``FakePublisher`` serves frames on vLLM's PUB + ROUTER replay wire.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, forbid_unknown_fields=True):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, forbid_unknown_fields=True):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, forbid_unknown_fields=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class FakePublisher:
    """vLLM's ``ZmqEventPublisher`` wire without vLLM: a PUB (an XPUB, to see subscribers)
    and a ROUTER replay socket bound on loopback (or ``endpoints``), one thread owning both
    that publishes what ``send`` queues and answers replay requests from the buffer.

    ``send(seq, payload)`` publishes one frame; ``send(..., skip=True)`` only buffers it
    (a frame the subscriber misses but the replay has); ``forget(seq)`` removes it from
    the buffer (a replay cannot fill that gap). ``subscribed`` is set once a subscription
    arrived (frames sent before it are lost, as ZMQ loses them)."""

    def __init__(self, topic: str = "kv", endpoints: tuple[str, str] | None = None) -> None:
        ctx = zmq.Context.instance()
        self.topic = topic.encode()
        pub_ep, replay_ep = endpoints or ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.bind(pub_ep)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.bind(replay_ep)
        self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: dict[int, bytes] = {}
        self.replays: list[int] = []  # start seqs asked for
        self.subscribed = threading.Event()
        self._ops: queue.Queue[tuple[str, int, bytes]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def send(self, seq: int, payload: bytes, skip: bool = False) -> None:
        self._ops.put(("skip" if skip else "send", seq, payload))

    def forget(self, seq: int) -> None:
        self._ops.put(("forget", seq, b""))

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pub, zmq.POLLIN)
        poller.register(self.replay, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(10))
            if self.pub in ready and self.pub.recv().startswith(b"\x01"):
                self.subscribed.set()
            if self.replay in ready:
                self._answer(*self.replay.recv_multipart())
            while not self._ops.empty():
                op, seq, payload = self._ops.get()
                if op == "forget":
                    self.buffer.pop(seq, None)
                else:
                    self.buffer[seq] = payload
                if op == "send":
                    self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self._ops.task_done()
        self.pub.close(0)
        self.replay.close(0)

    def _answer(self, client: bytes, _empty: bytes, start: bytes) -> None:
        first = int.from_bytes(start, "big")
        self.replays.append(first)
        for seq in sorted(self.buffer):
            if seq >= first:
                frame = (client, b"", self.topic, seq.to_bytes(8, "big"), self.buffer[seq])
                self.replay.send_multipart(frame)
        self.replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def settle(self) -> None:
        """Wait until every queued operation ran."""
        self._ops.join()

    def close(self) -> None:
        """Closes both sockets: the subscriber's connection drops (a dead publisher)."""
        self._stop.set()
        self._thread.join(2)
