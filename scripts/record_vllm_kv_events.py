"""Record KV event batches exactly as vLLM publishes them, for tests/route/test_router_zmq.py.

Run with vLLM's own interpreter (not kvstack's): it drives vLLM's ``BlockPool`` with
``enable_kv_cache_events`` through a scripted sequence of prompts (a salted one
included), publishes every step's events with vLLM's ``ZmqEventPublisher`` (so the
payload is vLLM's msgspec encoding of ``KVEventBatch``, byte for byte) and records the
``(seq, payload)`` frames a SUB socket receives::

    /work/main/.bench-venvs/vllm/bin/python scripts/record_vllm_kv_events.py \\
        tests/route/data/vllm_kv_events.json

The batches (block size 16, three 16-token blocks per prompt):

0. store A (unsalted) and A's tokens with cache_salt "tenant-1"
1. store C = A's first 32 tokens + 16 others (hits A's two blocks, stores one)
2. evict everything (BlockRemoved)   3. store A again   4. reset_prefix_cache
5. store C again (all three blocks new)

for each of vLLM's SHA-256 algorithms (``sha256``, ``sha256_cbor``), PYTHONHASHSEED
unset (vLLM's fixed NONE_HASH seed).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import zmq
from vllm import SamplingParams
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request
from vllm.version import __version__

BS = 16
A = list(range(1000, 1048))
C = A[:32] + list(range(5000, 5016))
SALT = "tenant-1"


def record(algo: str, workdir: str) -> dict[str, object]:
    fn = get_hash_fn_by_name(algo)
    init_none_hash(fn)
    hasher = get_request_block_hasher(BS, fn)
    pool = BlockPool(32, enable_caching=True, hash_block_size=BS, enable_kv_cache_events=True)
    pub_ep, replay_ep = f"ipc://{workdir}/{algo}.pub", f"ipc://{workdir}/{algo}.replay"
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic="kv")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub_ep)
    time.sleep(0.5)  # the slow joiner: let the subscription reach the publisher
    n = 0

    def request(ids: list[int], salt: str | None = None) -> Request:
        nonlocal n
        n += 1
        return Request(f"r{n}", ids, SamplingParams(max_tokens=1), None,
                       block_hasher=hasher, cache_salt=salt)  # fmt: skip

    def store(req: Request, hit: list) -> list:
        blocks = hit + pool.get_new_blocks(len(req.all_token_ids) // BS - len(hit))
        pool.touch(hit)
        pool.cache_full_blocks(req, blocks, len(hit), len(blocks), BS, 0)
        return blocks

    def step() -> None:
        pub.publish(KVEventBatch(ts=time.time(), events=pool.take_events()))

    a, b = store(request(A), []), store(request(A, SALT), [])
    step()
    c = store(request(C), a[:2])
    step()
    for blocks in (c, b, a):
        pool.free_blocks(reversed(blocks))
    everything = pool.get_new_blocks(pool.get_num_free_blocks())
    step()
    pool.free_blocks(everything)
    a = store(request(A), [])
    step()
    pool.free_blocks(reversed(a))
    assert pool.reset_prefix_cache()
    step()
    store(request(C), [])
    step()
    frames = []
    while sub.poll(2000):
        _topic, seq, payload = sub.recv_multipart()
        frames.append({"seq": int.from_bytes(seq, "big"), "payload": payload.hex()})
        if len(frames) == 6:
            break
    pub.shutdown()
    sub.close(0)
    return {"algo": algo, "frames": frames}


def main() -> None:
    os.environ.pop("PYTHONHASHSEED", None)
    out_path = sys.argv[1]
    with tempfile.TemporaryDirectory() as d:
        runs = [record(algo, d) for algo in ("sha256", "sha256_cbor")]
    doc = {
        "vllm_version": __version__, "block_size": BS, "topic": "kv",
        "prompts": {"A": A, "C": C}, "salt": SALT, "runs": runs,
        "batches": ["A and A salted", "C (hits A's first two blocks)", "evict all",
                    "A again", "reset_prefix_cache", "C again"],
    }  # fmt: skip
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"vLLM {__version__}: {sum(len(r['frames']) for r in runs)} frames -> {out_path}")


if __name__ == "__main__":
    main()
