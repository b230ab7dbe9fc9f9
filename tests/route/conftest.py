"""Fixtures the router tests share: a background event loop per module, two fake
replicas, and a router factory that stops every router it made."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from router_util import BgLoop, FakeReplica, RouterUnderTest


@pytest.fixture(scope="module")
def bg() -> Iterator[BgLoop]:
    loop = BgLoop()
    yield loop
    loop.close()


@pytest.fixture
def fakes(bg: BgLoop) -> Iterator[list[FakeReplica]]:
    made = [FakeReplica(bg, "a").start(), FakeReplica(bg, "b").start()]
    made.sort(key=lambda f: f.url)  # round_robin starts at the first id in sorted order
    made[0].name, made[1].name = "a", "b"
    yield made
    for f in made:
        f.stop()


@pytest.fixture
def make_router(bg: BgLoop) -> Iterator[Callable[..., RouterUnderTest]]:
    made: list[RouterUnderTest] = []

    def make(urls: list[str], **kw: Any) -> RouterUnderTest:
        r = RouterUnderTest(bg, urls, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop()
