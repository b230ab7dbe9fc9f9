"""``ResponsesStore`` bounds on a fake clock: count, age and bytes, oldest first; ids
unguessable; an expired response is gone as if never stored."""

from __future__ import annotations

import re

from kvstack.serve.conversation_options import ConversationOptions
from kvstack.serve.responses.store import ResponsesStore, StoredResponse, new_response_id


def rec(i: int, n_ids: int = 10) -> StoredResponse:
    return StoredResponse(f"resp_{i}", {"i": i}, [{"role": "user", "content": "x"}],
                          list(range(n_ids)), [1, 2])  # fmt: skip


def test_count_age_and_byte_bounds_drop_the_oldest() -> None:
    now = [0.0]
    store = ResponsesStore(ConversationOptions(responses_max_stored=2, responses_ttl=10.0),
                           clock=lambda: now[0])  # fmt: skip
    assert store.put(rec(0)) == [] and store.put(rec(1)) == []
    assert [r.id for r in store.put(rec(2))] == ["resp_0"]
    assert store.get("resp_0") is None and store.get("resp_1") is not None
    now[0] = 5.0
    store.put(rec(3))  # count bound: resp_1 goes
    now[0] = 10.5  # resp_2 (stored at 0) is past its age; resp_3 (at 5) is not
    assert store.get("resp_2") is None and store.get("resp_3") is not None
    assert [r.id for r in store.expire()] == []
    now[0] = 15.5
    assert [r.id for r in store.expire()] == ["resp_3"] and len(store) == 0
    assert store.num_bytes == 0
    one = rec(9).size
    small = ResponsesStore(ConversationOptions(responses_max_bytes=2 * one + 1))
    for i in range(3):
        small.put(rec(i))
    assert len(small) == 2 and small.num_bytes == 2 * one
    huge = rec(5, n_ids=10_000)
    assert small.put(huge) == [huge] and small.get("resp_5") is None
    assert small.delete("resp_2") is not None and small.delete("resp_2") is None


def test_ids_are_long_random_hex() -> None:
    ids = {new_response_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"resp_[0-9a-f]{48}", i) for i in ids)
