"""KV events on vLLM's wire: msgpack ``KVEventBatch`` over ZMQ PUB + ROUTER replay.

The subscriber here is what llm-d's KV indexer does: a SUB socket, frames
``(topic, seq, payload)``, the payload decoded by an *independent* decoder (msgspec typed
structs mirroring vLLM 0.32's ``vllm/distributed/kv_events.py``, ``tests/vllm_wire.py``,
unknown fields forbidden), and the block hashes recomputed from the token ids with
vLLM's algorithm, from scratch (the salt as vLLM 0.32's tagged first-block extra key).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cbor2
import pytest
import zmq

from kvstack import LLM, SamplingParams
from kvstack.core.errors import ConfigError
from kvstack.kv.events import AllBlocksCleared as KvAllCleared
from kvstack.kv.events import BlockRemoved as KvRemoved
from kvstack.kv.events import BlockStored as KvStored
from kvstack.kv.vllm_hashing import hash_block_tokens, hash_prompt, none_hash, sha256, sha256_cbor
from kvstack.serve.events.config import KVEventsConfig
from kvstack.serve.events.vllm import VllmEventTranslator
from kvstack.serve.events.zmq import END_SEQ, ZmqKVEventPublisher
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_hf_folder
from vllm_wire import DECODER, AllBlocksCleared, BlockStored, KVEventBatch

BS = 16


def scratch_sha256_cbor(token_ids: list[int], salt: str | None = None) -> list[bytes]:
    """vLLM's chain written out again: SHA-256 of canonical CBOR of (parent, tokens, extra);
    vLLM 0.32's ``generate_block_hash_extra_keys`` puts ``("cache_salt", salt)`` in the
    first block's extra keys."""
    h = lambda v: hashlib.sha256(cbor2.dumps(v, canonical=True)).digest()  # noqa: E731
    parent, out = h("vllm-none-hash"), []
    for b in range(len(token_ids) // BS):
        extra = (("cache_salt", salt),) if b == 0 and salt is not None else None
        parent = h((parent, tuple(token_ids[b * BS : (b + 1) * BS]), extra))
        out.append(parent)
    return out


def test_hashes_equal_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Values printed by vLLM 0.32's own ``vllm.utils.hashing`` for the same inputs."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    n = none_hash(sha256_cbor)
    assert n.hex() == "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
    assert sha256_cbor((n, (1, 2, 3, 4), None)).hex().startswith("58d0879dff3800f6")
    assert sha256((n, (1, 2, 3, 4), None)).hex().startswith("250f0efb99449b77")
    # vLLM 0.32's hash_block_tokens(fn, None, (1, 2, 3, 4), (("cache_salt", "salt"),)):
    salted = (("cache_salt", "salt"),)
    assert (
        hash_block_tokens(sha256_cbor, n, (1, 2, 3, 4), salted)
        .hex()
        .startswith("f6e0156f627fccb75f469a5d")
    )
    assert (
        hash_block_tokens(sha256, none_hash(sha256), (1, 2, 3, 4), salted)
        .hex()
        .startswith("ea3c4408f0636c8042423e5a")
    )
    assert hash_prompt("sha256_cbor", [1, 2, 3, 4], 4, "salt")[0].hex().startswith("f6e0156f")
    ids = list(range(100, 150))
    assert hash_prompt("sha256_cbor", ids, BS) == scratch_sha256_cbor(ids)
    assert hash_prompt("sha256_cbor", ids, BS, "s") == scratch_sha256_cbor(ids, "s")
    monkeypatch.setenv("PYTHONHASHSEED", "7")  # vLLM seeds NONE_HASH from it when set
    assert none_hash(sha256_cbor) == sha256_cbor("7")


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    cfg = tiny_llama_config()
    d = write_hf_folder(tmp_path_factory.mktemp("tiny") / "hf", cfg, random_llama_weights(cfg))
    yield LLM(str(d), dtype="float32", num_blocks=64, max_model_len=256, block_size=BS)


def config(**kw: Any) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, **kw)


def subscribe(pub: ZmqKVEventPublisher, topic: str = "") -> zmq.Socket[Any]:
    """A SUB socket that has seen the publisher (ZMQ drops what a joining SUB misses)."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    sub.connect(pub.endpoint)
    for _ in range(200):
        pub.put(KvAllCleared())  # harmless probe
        if sub.poll(50):
            while sub.poll(100):  # the probes in flight
                sub.recv_multipart()
            return sub
    raise AssertionError("the subscriber never connected")


def receive(sub: zmq.Socket[Any], want_events: int) -> list[tuple[int, KVEventBatch]]:
    out, n = [], 0
    while n < want_events and sub.poll(5000):
        _topic, seq, payload = sub.recv_multipart()
        batch = DECODER.decode(payload)
        out.append((int.from_bytes(seq, "big"), batch))
        n += len(batch.events)
    return out


def test_llm_d_style_subscriber_decodes_batches_and_recomputes_hashes(llm: LLM) -> None:
    tr = VllmEventTranslator("sha256_cbor")
    cfg = config(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv")
    pub = ZmqKVEventPublisher(cfg, tr, llm.engine.kv_events)
    try:
        sub = subscribe(pub, "kv")
        prompts = [list(range(5, 5 + 40)), list(range(5, 5 + 36)) + [299] * 12]
        sp = SamplingParams(max_tokens=2, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        llm.reset_prefix_cache()
        got = receive(sub, 3)
        seqs = [s for s, _ in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap
        events = [e for _, b in got for e in b.events]
        assert all(b.data_parallel_rank == 0 and b.ts > 1e9 for _, b in got)
        stored = [e for e in events if isinstance(e, BlockStored)]
        by_hash = {h: e for e in stored for h in e.block_hashes}
        for p in prompts:  # every full block an indexer hashes is announced under that hash
            for i, h in enumerate(scratch_sha256_cbor(p)):
                ev = by_hash[h]
                assert ev.medium == "GPU" and ev.block_size == BS and ev.lora_id is None
                assert ev.group_idx == 0 and ev.extra_keys == [None] * len(ev.block_hashes)
                j = ev.block_hashes.index(h)
                assert ev.token_ids[j * BS : (j + 1) * BS] == p[i * BS : (i + 1) * BS]
        # The shared first two blocks were announced once; the second prompt's third
        # block's parent is named by vLLM's hash (in its run, or as parent_block_hash).
        assert sum(len(e.block_hashes) for e in stored) == len(by_hash)
        want = scratch_sha256_cbor(prompts[1])
        third = by_hash[want[2]]
        j = third.block_hashes.index(want[2])
        parent = third.block_hashes[j - 1] if j > 0 else third.parent_block_hash
        assert parent == want[1]
        assert isinstance(events[-1], AllBlocksCleared)
        # Replay from seq 0: every batch published, in order, then the end marker.
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        assert pub.replay_endpoint is not None
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(5000)
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            assert topic == b"kv"
            replayed.append(int.from_bytes(seq, "big"))
            DECODER.decode(payload)
        assert replayed == list(range(pub.num_batches))
        sub.close(0)
        dealer.close(0)
    finally:
        pub.close()
    llm.engine.check_integrity()


class Stuck(VllmEventTranslator):
    """A translator that blocks until released: the publisher thread stalls."""

    def __init__(self) -> None:
        super().__init__("sha256_cbor")
        import threading

        self.gate = threading.Event()

    def translate(self, ev: Any) -> dict[str, Any] | None:
        self.gate.wait(30)
        return super().translate(ev)


def test_a_stalled_publisher_drops_and_counts_never_blocks_the_engine() -> None:
    tr = Stuck()
    pub = ZmqKVEventPublisher(config(endpoint="tcp://127.0.0.1:*", max_queue_size=4), tr)
    try:
        ev = KvStored([b"\x01" * 16], None, list(range(BS)), BS)
        for _ in range(1000):  # returns at once although nothing is being sent
            pub.put(ev)
        assert 990 <= pub.num_dropped <= 1000 - 4
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt_string(zmq.SUBSCRIBE, "")
        sub.connect(pub.endpoint)
        tr.gate.set()
        sub2 = subscribe(pub)  # drains the backlog, then the probes
        sub2.close(0)
        sub.close(0)
        # After drops, the next batch begins with AllBlocksCleared (the index resets).
        assert pub.num_batches >= 1 and not pub._pending_reset
    finally:
        pub.close()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown field 'endpont'"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be bool"),
        ('{"hwm": true}', "hwm must be int"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher 'kafka'"),
        ('{"buffer_steps": 0}', "buffer_steps must be at least 1"),
        ('{"endpoint": "localhost:5557"}', "is not a ZMQ endpoint"),
    ],
)
def test_malformed_config_is_one_clear_error(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match="--kv-events-config") as e:
        KVEventsConfig.parse(text)
    assert message in str(e.value)


def test_vllm_spelling_parses_and_an_endpoint_that_cannot_bind_is_a_clear_error() -> None:
    c = KVEventsConfig.parse(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",'
        ' "replay_endpoint": "tcp://*:5558", "topic": "kv"}'
    )
    assert c.publishes and c.replay_endpoint == "tcp://*:5558" and c.topic == "kv"
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": false}').publishes
    first = ZmqKVEventPublisher(
        config(endpoint="tcp://127.0.0.1:*"), VllmEventTranslator("builtin")
    )
    try:
        with pytest.raises(ConfigError, match="cannot use endpoint"):
            ZmqKVEventPublisher(config(endpoint=first.endpoint.replace("127.0.0.1", "*")),
                                VllmEventTranslator("builtin"))  # fmt: skip
    finally:
        first.close()


def test_int_block_hashes_are_vllms_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.32 publishes each hash's low 64 bits as an int unless
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (what llm-d keys by); so does kvstack."""
    from kvstack.serve.events.vllm import int_block_hashes_from_env

    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    assert int_block_hashes_from_env() is True
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert int_block_hashes_from_env() is False
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "yes")
    with pytest.raises(ConfigError, match="must be 0 or 1"):
        int_block_hashes_from_env()
    ids = list(range(32))
    tr = VllmEventTranslator("sha256_cbor", int_hashes=True)
    first = tr.translate(KvStored([b"\x01" * 16], None, ids[:BS], BS, cache_salt="s"))
    second = tr.translate(KvStored([b"\x02" * 16], b"\x01" * 16, ids[BS:], BS))
    want = [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in scratch_sha256_cbor(ids, "s")]
    assert first is not None and second is not None
    assert first["block_hashes"] == want[:1] and first["extra_keys"] == [["s"]]
    assert second["block_hashes"] == want[1:] and second["parent_block_hash"] == want[0]
    removed = tr.translate(KvRemoved([b"\x02" * 16]))
    assert removed is not None and removed["block_hashes"] == want[1:]


def test_untranslatable_and_builtin(tmp_path: Path) -> None:
    """A stored run whose parent the translator never saw is skipped, never guessed."""
    tr = VllmEventTranslator("sha256_cbor")
    assert tr.translate(KvStored([b"\x02" * 16], b"\x09" * 16, list(range(BS)), BS)) is None
    assert tr.num_untranslatable == 1
    b = VllmEventTranslator("builtin").translate(KvStored([b"\x02" * 16], None, [1] * BS, BS))
    assert b is not None and b["block_hashes"] == [b"\x02" * 16]


def test_salted_prompts_publish_vllms_salted_hashes(llm: LLM) -> None:
    """vLLM 0.32 keys a salted prompt's first block with ``("cache_salt", salt)`` and
    publishes the salt, untagged, in that block's ``extra_keys``: kvstack does both."""
    tr = VllmEventTranslator("sha256_cbor")
    pub = ZmqKVEventPublisher(config(endpoint="tcp://127.0.0.1:*"), tr, llm.engine.kv_events)
    try:
        sub = subscribe(pub)
        ids = list(range(200, 248))
        sp = SamplingParams(max_tokens=1, ignore_eos=True)
        llm.generate([{"prompt_token_ids": ids, "cache_salt": "tenant-1"}], sp, use_tqdm=False)
        llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        stored = [e for _, b in receive(sub, 2) for e in b.events if isinstance(e, BlockStored)]
        salted, plain = scratch_sha256_cbor(ids, "tenant-1"), scratch_sha256_cbor(ids)
        assert hash_prompt("sha256_cbor", ids, BS, "tenant-1") == salted
        assert not set(salted) & set(plain)  # isolation: no block shared
        by_first = {e.block_hashes[0]: e for e in stored}
        s, p = by_first[salted[0]], by_first[plain[0]]
        assert s.block_hashes == salted and s.parent_block_hash is None
        assert s.extra_keys == [("tenant-1",), None, None]
        assert p.block_hashes == plain and p.extra_keys == [None, None, None]
        sub.close(0)
    finally:
        pub.close()
    llm.reset_prefix_cache()


@pytest.mark.parametrize("salt", ["", "a/b", "x" * 129, "a@b", "nul\0"])
def test_salts_vllm_refuses_are_refused(llm: LLM, salt: str) -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": [1, 2, 3], "cache_salt": salt}], use_tqdm=False)


def test_a_kv_events_endpoint_that_cannot_bind_fails_before_the_model_loads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvstack.cli import main
    from server_util import free_port

    taken = zmq.Context.instance().socket(zmq.PUB)
    taken.bind("tcp://*:0")
    try:
        port = taken.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        cfg = f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{port}"}}'
        # A model that does not exist: had it been loaded first, the error would name it.
        argv = ["serve", "/nonexistent/model.gguf", "--port", str(free_port()),
                "--kv-events-config", cfg]  # fmt: skip
        assert main(argv) == 2
    finally:
        taken.close(0)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot use endpoint" in err[0] and "nonexistent" not in err[0]
