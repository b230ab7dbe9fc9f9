"""The router's faults, each reproduced against fake replicas: a client-triggerable 500
ejected a healthy backend, a backend that went quiet held a relay forever, and DNS
discovery sent the key to loopback / link-local answers, any number of them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kvstack.core.errors import ConfigError
from kvstack.route.router.discovery import DnsDiscovery, parse_networks, refused_reason
from router_util import FakeReplica


def test_a_500_is_the_requests_error_not_a_backend_failure(
    fakes: list[FakeReplica], make_router: Any
) -> None:
    """Two requests answered 500 (a bug their input reached) ejected the backend, and
    every valid request then got 503 "no healthy replica"."""
    a, b = fakes
    b.stop()  # one backend: its ejection would leave nothing to serve
    router = make_router([a.url], health_interval=30.0)
    router.wait_healthy(1)
    a.mode = "500"
    for _ in range(4):
        r = router.complete("x")
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
    state = router.replica(a.url)
    assert state["healthy"] and state["failures_total"] == 0 and state["ejections"] == 0
    assert len(a.received) == 4  # passed through once each, never retried
    a.mode = "ok"
    assert router.complete("y").status_code == 200
    b.start()


def test_a_503_still_counts_and_retries(fakes: list[FakeReplica], make_router: Any) -> None:
    a, b = fakes
    router = make_router([a.url, b.url], health_interval=30.0)
    router.wait_healthy(2)
    a.mode = "503"
    r = router.complete("x")
    assert r.status_code == 200 and r.json()["replica"] == "b"
    assert router.replica(a.url)["failures_total"] == 1


def test_a_backend_silent_mid_stream_is_cut(fakes: list[FakeReplica], make_router: Any) -> None:
    """ClientTimeout(total=None) and no idle limit: a backend that accepted and went quiet
    (its /health still fine) held the client's stream open forever."""
    a, b = fakes
    router = make_router([a.url, b.url], idle_timeout_s=0.5)
    router.wait_healthy(2)
    a.mode = "idle_midstream"
    r = router.complete("x", stream=True)
    events = [e[len("data: ") :] for e in r.text.split("\n\n") if e]
    assert len(events) == 4 and "Timeout" in json.loads(events[2])["error"]["message"]
    assert not b.received


@pytest.mark.parametrize(
    ("address", "refused"),
    [
        ("127.0.0.1", "loopback"), ("::1", "loopback"), ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"), ("0.0.0.0", "unspecified"), ("224.0.0.1", "multicast"),
        ("10.1.2.3", None), ("2001:db8::5", None),
    ],
)  # fmt: skip
def test_discovery_refuses_loopback_and_link_local(address: str, refused: str | None) -> None:
    why = refused_reason(address, ())
    assert (why is None) if refused is None else (why is not None and refused in why)
    assert refused_reason(address, parse_networks(["0.0.0.0/0", "::/0"])) is None
    if refused is not None:  # an allow list that does not hold it changes nothing
        assert refused_reason(address, parse_networks(["192.168.0.0/16"])) == why


def test_discovery_filters_and_caps_the_answer() -> None:
    got: list[set[str]] = []
    answer = ["127.0.0.1", "169.254.169.254", *[f"10.0.0.{i}" for i in range(1, 11)]]

    async def resolver(host: str, port: int) -> list[str]:
        return answer

    async def sync(urls: set[str]) -> None:
        got.append(urls)

    async def go() -> None:
        d = DnsDiscovery("svc:8000", sync, interval=0.01, resolver=resolver, max_backends=4)
        d.start()
        while not got:
            await asyncio.sleep(0.01)
        await d.stop()
        assert set(d.refused) == {"127.0.0.1", "169.254.169.254"}

    asyncio.run(go())
    assert got[0] == {f"http://10.0.0.{i}:8000" for i in (1, 10, 2, 3)}  # sorted as text
    with pytest.raises(ConfigError, match="discover-allow"):
        parse_networks(["not-a-net"])
