"""``GET /v1/kv/state`` and ``/v1/kv/prefixes`` (the web view's data) on a real server
with a tiny random model: auth, throttle, the per-connection bound, the viewer cap,
no work without viewers, and a 100k-block pool aggregated into a few thousand cells."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvstack import LLM
from kvstack.kv.block_view import STATES, view_blocks
from kvstack.kv.manager import KVCacheManager
from kvstack.serve.api.app import ServerConfig, create_app
from kvstack.serve.async_engine import AsyncEngine
from kvstack.serve.ui.kv_state import RecentRequests
from kvstack.serve.ui.kv_state_stream import MAX_ENGINE_SHARE, KVStateStream
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf
from server_util import serve_uvicorn

KEY = "view-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Live:
    url: str
    llm: LLM
    state: KVStateStream


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_llama_config()
    path = tmp_path_factory.mktemp("tiny") / "t.gguf"
    write_gguf(path, cfg, random_llama_weights(cfg))
    return path


@pytest.fixture(scope="module")
def live(tiny_gguf: Path) -> Iterator[Live]:
    llm = LLM(str(tiny_gguf), dtype="float32", num_blocks=64, max_model_len=256)
    app = create_app(AsyncEngine(llm.engine), ServerConfig(model_name="tiny", api_key=KEY))
    with serve_uvicorn(app) as url:
        yield Live(url, llm, app.state.kv_state)


def frames(url: str, n: int, interval_ms: int = 250, timeout_s: float = 30.0) -> list[dict]:
    out: list[dict] = []
    with httpx.stream(
        "GET", f"{url}/v1/kv/state?interval_ms={interval_ms}", headers=AUTH, timeout=timeout_s
    ) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                if len(out) == n:
                    break
    return out


def complete(url: str, prompt: str, max_tokens: int = 4) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_000_no_viewer_no_snapshot(live: Live) -> None:
    """Runs first: requests served, pages fetched, and not one snapshot taken."""
    complete(live.url, "the quick brown fox jumps over the lazy dog " * 4)
    assert httpx.get(live.url + "/").status_code == 200
    assert httpx.get(live.url + "/static/js/main.js").status_code == 200
    time.sleep(0.5)
    assert live.state.num_snapshots == 0
    assert live.state.num_viewers == 0


def test_wrong_or_missing_key_is_401_with_an_openai_error(live: Live) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}):
        for path in ("/v1/kv/state", "/v1/kv/prefixes"):
            r = httpx.get(live.url + path, headers=headers, timeout=10)
            assert r.status_code == 401, (path, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and {"message", "type", "param"} <= set(err)
    assert live.state.num_snapshots == 0
    view = httpx.get(live.url + "/v1/kv/view", timeout=10)  # open: the page's first question
    assert view.status_code == 200 and view.json() == {"api_key_required": True}
    bad = httpx.get(live.url + "/v1/kv/state?interval_ms=fast", headers=AUTH, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "interval_ms"


def test_snapshot_shape_and_the_hit_rate_after_a_shared_prefix(live: Live) -> None:
    shared = "a system prompt the two requests share, long enough for blocks " * 3
    complete(live.url, shared + "first question?")
    complete(live.url, shared + "second question!")
    snap = frames(live.url, 1)[0]
    blocks = snap["blocks"]
    assert blocks["num_blocks"] == 64 and blocks["group"] == 1
    assert len(blocks["state"]) == len(blocks["owner"]) == len(blocks["rank"]) == 64
    assert blocks["states"] == list(STATES)
    cached = [i for i, s in enumerate(blocks["state"]) if STATES[s] == "cached"]
    assert cached and all(0 <= blocks["rank"][i] <= 255 for i in cached)
    c = snap["counters"]
    assert c["prefix_hit_rate"] > 0 and c["prefix_hit_tokens"] > 0
    assert c["ttft_p50"] is not None and c["ttft_p99"] >= c["ttft_p50"]
    last = snap["recent"][-1]
    assert last["device_hit_tokens"] > 0
    assert last["device_hit_tokens"] + last["computed_tokens"] == last["prompt_tokens"]
    assert "prompt_head" not in last and snap["eviction_policy"] == "lru"
    tree = httpx.get(live.url + "/v1/kv/prefixes", headers=AUTH, timeout=30).json()
    assert tree["prefix_cache"] == "hash" and tree["nodes"]
    hot = max(tree["nodes"], key=lambda n: n["hits"])
    assert hot["hits"] >= 1 and hot["requests"] >= 2 and hot["text"]
    assert hot["bytes"] > 0 and hot["end"] % tree["block_size"] == 0


def test_throttled_and_shared_between_viewers(live: Live) -> None:
    before = live.state.num_snapshots
    t0 = time.monotonic()
    got = frames(live.url, 6, interval_ms=0)  # asks for no delay: clamped to 250 ms
    dt = time.monotonic() - t0
    assert dt >= 5 * 0.25 * 0.9, dt
    nums = [f["snapshot"] for f in got]
    assert nums == sorted(nums) and len(set(nums)) == len(nums)
    assert live.state.num_snapshots - before <= 7


def open_raw_stream(url: str, rcvbuf: int | None = None) -> socket.socket:
    """A ``/v1/kv/state`` request on a plain socket; returns it once the 200 arrived."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.sendall(
        f"GET /v1/kv/state?interval_ms=250 HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {KEY}\r\n\r\n".encode()
    )
    assert s.recv(64).startswith(b"HTTP/1.1 200")
    return s


def test_viewer_cap_is_429_and_slots_come_back(live: Live) -> None:
    cap = live.state.max_viewers
    streams = [open_raw_stream(live.url) for _ in range(cap)]
    try:
        extra = httpx.get(live.url + "/v1/kv/state", headers=AUTH, timeout=30)
        assert extra.status_code == 429 and extra.headers["retry-after"]
        assert extra.json()["error"]["type"] == "rate_limit_error"
    finally:
        for s in streams:
            s.close()
    deadline = time.monotonic() + 10
    while live.state.num_viewers and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live.state.num_viewers == 0
    assert len(frames(live.url, 1)) == 1


def test_a_stalled_reader_stays_throttled_and_others_go_on(live: Live) -> None:
    """A reader that never reads costs no more snapshots than the throttle allows (the
    stream takes the next one only once the last frame went to the transport), and a
    second viewer is served meanwhile."""
    with open_raw_stream(live.url, rcvbuf=4096):
        # Grow each frame: running requests are listed, finished ones recorded.
        for i in range(6):
            complete(live.url, f"request number {i} " * 12, max_tokens=2)
        time.sleep(2.0)
        start = live.state.num_snapshots
        time.sleep(3.0)
        stalled = live.state.num_snapshots - start
        # Never more than the throttle allows (12 in 3 s), and a reading viewer still works.
        assert stalled <= 13, stalled
        assert len(frames(live.url, 2)) == 2


def test_a_100k_block_server_streams_a_few_thousand_cells(tmp_path: Path) -> None:
    """A real server whose pool has 100k blocks (a 1-layer tiny model) sends an
    aggregated map: at most 4096 cells per frame, and a frame of well under 1 MB."""
    cfg = tiny_llama_config(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)
    path = tmp_path / "t.gguf"
    write_gguf(path, cfg, random_llama_weights(cfg))
    llm = LLM(str(path), dtype="float32", num_blocks=100_000, max_model_len=256)
    app = create_app(AsyncEngine(llm.engine), ServerConfig(model_name="tiny", api_key=KEY))
    with serve_uvicorn(app) as url:
        complete(url, "a prompt of a few blocks " * 8)
        t0 = time.monotonic()
        with httpx.stream("GET", url + "/v1/kv/state", headers=AUTH, timeout=60) as r:
            lines = (ln for ln in r.iter_lines() if ln.startswith("data: "))
            line = next(lines)
            first_frame_s = time.monotonic() - t0
            while time.monotonic() - t0 < 3.0:
                next(lines)
        state: KVStateStream = app.state.kv_state
        # The snapshots' engine-thread time stays within MAX_ENGINE_SHARE of the time.
        budget = 3.0 * MAX_ENGINE_SHARE / max(state.last_cost_s, 1e-3) + 2
        assert state.num_snapshots <= max(budget, 3.0 / state.min_interval_s + 2)
        # Each snapshot is reused for its cost / MAX_ENGINE_SHARE, so over the 3 s the
        # snapshots cost at most that share of the time, plus the last one's own cost (the
        # throttle acts after it), whatever each one cost (one may stall on a busy VM).
        total = state.total_cost_s
        assert total <= 3.0 * MAX_ENGINE_SHARE * 2 + state.last_cost_s + 0.5, (
            total,
            state.num_snapshots,
        )
    blocks = json.loads(line[6:])["blocks"]
    assert blocks["num_blocks"] == 100_000 and blocks["group"] == 25
    assert len(blocks["state"]) == len(blocks["counts"]) == 4000
    cached = sum(c[STATES.index("cached")] for c in blocks["counts"])
    assert cached > 0 and sum(map(sum, blocks["counts"])) == 100_000
    assert len(line) < 1_000_000, len(line)
    assert first_frame_s < 5.0, first_frame_s


def test_host_tier_and_radix_tree_are_shown(tiny_gguf: Path) -> None:
    """With a host tier and the radix prefix cache: the snapshot lists the tier's blocks
    and the prefix tree is built for the radix cache too."""
    llm = LLM(str(tiny_gguf), dtype="float32", num_blocks=64, max_model_len=256,
              kv_offload="host:8MiB", prefix_cache="radix")  # fmt: skip
    app = create_app(AsyncEngine(llm.engine), ServerConfig(model_name="tiny", api_key=KEY))
    with serve_uvicorn(app) as url:
        shared = "the radix tree keeps this long shared prefix of the two prompts " * 3
        complete(url, shared + "one")
        complete(url, shared + "two")
        deadline = time.monotonic() + 20
        while True:
            snap = frames(url, 1)[0]
            if snap["tiers"].get("host", {}).get("num_blocks", 0) > 0:
                break
            assert time.monotonic() < deadline, snap["tiers"]
            time.sleep(0.3)
        tree = httpx.get(url + "/v1/kv/prefixes", headers=AUTH, timeout=30).json()
    assert snap["prefix_cache"] == "radix" and snap["tiers"]["host"]["stores"] > 0
    assert tree["prefix_cache"] == "radix" and max(n["hits"] for n in tree["nodes"]) >= 1


def test_a_100k_block_pool_is_aggregated() -> None:
    """The view of a 100k-block pool is at most max_cells cells, each cell's counts
    summing to its blocks, and the owners and states of held blocks survive."""
    kv = KVCacheManager(100_000, 16)
    held = kv.allocate_blocks(3000)
    assert held is not None
    kv.req_blocks["req-a"] = [kv.pool.blocks[i] for i in held]
    assert STATES[view_blocks(kv, 4096, pressed={"req-a"}).state[0]] == "pressed"
    view = view_blocks(kv, max_cells=4096)
    assert view.group == 25 and len(view.state) == 4000 <= 4096
    assert all(sum(c) == 25 for c in view.counts)
    totals = [sum(c[s] for c in view.counts) for s in range(len(STATES))]
    assert totals[STATES.index("used")] == 3000 and sum(totals) == 100_000
    assert view.request_ids == ["req-a"]
    used_cells = [i for i, s in enumerate(view.state) if STATES[s] == "used"]
    assert len(used_cells) == 120 and all(view.owner[i] == 0 for i in used_cells)
    assert len(json.dumps(view.to_dict())) < 200_000


def test_segment_blocks_are_drawn_as_segments(tiny_gguf: Path) -> None:
    """A segment's standalone KV (segment reuse) shows as its own state in the block map, the
    whole blocks of its primer (a shared lead) too."""
    from kvstack import SamplingParams

    llm = LLM(str(tiny_gguf), dtype="float32", num_blocks=64, block_size=4)
    prompt = list(range(3, 40))
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    marks = [[(4, 24), (24, 34, [7] * 9)]]  # the second after a primer: 2 shared blocks
    llm.generate(prompt_token_ids=[prompt], sampling_params=sp, segments=marks)
    kv = llm.engine.kv_manager
    assert isinstance(kv, KVCacheManager) and kv.segments is not None
    assert [len(s.blocks) for s in kv.segments.leads.values()] == [2]
    held = sum(len(e.blocks) for e in kv.segments.entries.values()) + 2
    view = view_blocks(kv)
    assert held > 0 and view.state.count(STATES.index("segment")) == held
    # The timeline's rows: a request that copied the segment (its tokens counted apart),
    # and a pressed one (what the press dropped).
    again = [5, *prompt[4:24], *range(50, 70)]  # the segment at another offset
    (out,) = llm.generate(prompt_token_ids=[again], sampling_params=sp, segments=[[(1, 21)]])
    pressed = SamplingParams(temperature=0.0, max_tokens=2, kv_press="knorm", kv_press_ratio=0.5)
    (out2,) = llm.generate(prompt_token_ids=[list(range(80, 120))], sampling_params=pressed)
    recent = RecentRequests()
    for o in (out, out2):
        recent.add(o, "completions", None, None, 0.0, "length")
    row, row2 = recent.last(2)
    assert row["segment_tokens"] == 20 and row["pressed_tokens"] == 0
    assert row["device_hit_tokens"] + row["segment_tokens"] + row["computed_tokens"] == 41
    assert row2["pressed_tokens"] == out2.num_pressed_tokens > 0 and row2["segment_tokens"] == 0


def test_grouped_cells_match_the_per_cell_rule() -> None:
    """The vectorized grouping equals the rule in its docstring, computed cell by cell:
    most common state (ties: priority order), owner of the most blocks (ties: the first
    block's), lowest rank; random pools with many ties and a short last cell."""
    import random
    from collections import Counter

    from kvstack.kv.block_view import _PRIORITY, _group_cells

    rng = random.Random(5)
    for n, group in ((103, 4), (1000, 25), (7, 3), (64, 2)):
        state = [rng.randrange(len(STATES)) for _ in range(n)]
        owner = [rng.choice([-1, 0, 1, 2]) for _ in range(n)]
        rank = [rng.choice([-1, 0, 7, 255]) for _ in range(n)]
        got = _group_cells(state, owner, rank, group)
        want: tuple[list[int], list[int], list[int], list[list[int]]] = ([], [], [], [])
        for lo in range(0, n, group):
            k = [state[lo : lo + group].count(s) for s in range(len(STATES))]
            owners = Counter(o for o in owner[lo : lo + group] if o >= 0)
            ranks = [r for r in rank[lo : lo + group] if r >= 0]
            want[0].append(max(_PRIORITY, key=lambda s: k[s]))
            want[1].append(owners.most_common(1)[0][0] if owners else -1)
            want[2].append(min(ranks) if ranks else -1)
            want[3].append(k)
        assert got == want, (n, group)
