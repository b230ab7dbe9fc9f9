"""Paired runs: engines in their own processes, loaded side by side, taking turns.

This machine's speed drifts by up to 2x over minutes (other tenants of the host share its
caches and memory bandwidth), so an engine measured now and its peer measured five minutes
later can differ by more than any engine change. With turns, every engine process loads
and warms up at once, then the timed phases alternate::

    vllm run 1 | kvstack run 1 | vllm run 2 | kvstack run 2 | ... | vllm single | kvstack single

and each run pair is measured under the same conditions, a minute apart at most: the
benchmark reports the median of the per-pair ratios. Coordination is by files in one
directory (``KVBENCH_TURNS``): ``ready-<peer>`` after warm-up, ``done-<peer>-<phase>``
after each phase, ``finished-<peer>`` after the last (processes exit together),
``gone-<peer>`` written by the orchestrator when a process ends, so a crashed peer never
blocks the others. Standard library only (runs in every venv).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

POLL_S = 0.02
SETTLE_S = 0.5  # the previous holder's OpenMP threads stop spinning (KMP_BLOCKTIME 200 ms)
MAX_WAIT_S = 1800.0


@dataclass
class Turns:
    """One participant's view: its name and the order of all participants."""

    directory: Path
    me: str
    order: list[str]

    @classmethod
    def from_env(cls) -> Turns | None:
        """From ``KVBENCH_TURNS`` (directory), ``KVBENCH_PEER`` and ``KVBENCH_ORDER``."""
        d, me, order = (
            os.environ.get(k) for k in ("KVBENCH_TURNS", "KVBENCH_PEER", "KVBENCH_ORDER")
        )
        if not (d and me and order):
            return None
        return cls(Path(d), me, order.split(","))

    def _has(self, name: str) -> bool:
        return (self.directory / name).exists()

    def _mark(self, name: str) -> None:
        (self.directory / name).touch()

    def _gone(self, peer: str) -> bool:
        return self._has(f"gone-{peer}")

    def ready(self) -> None:
        """After warm-up: wait until every live participant is warm too."""
        self._mark(f"ready-{self.me}")
        self._wait(lambda: all(self._has(f"ready-{p}") or self._gone(p) for p in self.order))

    @contextmanager
    def turn(self, phase: int) -> Iterator[None]:
        """Phase ``phase`` of this participant: starts once the participants before it
        finished this phase and those after it finished the previous one."""
        i = self.order.index(self.me)

        def mine() -> bool:
            before = all(self._has(f"done-{p}-{phase}") or self._gone(p) for p in self.order[:i])
            after = phase == 0 or all(
                self._has(f"done-{p}-{phase - 1}") or self._gone(p) for p in self.order[i + 1 :]
            )
            return before and after

        self._wait(mine)
        time.sleep(SETTLE_S)
        try:
            yield
        finally:
            self._mark(f"done-{self.me}-{phase}")

    def leave(self) -> None:
        """After the last phase: wait until every participant is finished too, so that no
        process's teardown (vLLM's is heavy) runs during another's timed phase."""
        self._mark(f"finished-{self.me}")
        self._wait(lambda: all(self._has(f"finished-{p}") or self._gone(p) for p in self.order))

    def _wait(self, cond: object) -> None:
        deadline = time.monotonic() + MAX_WAIT_S
        while not cond():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.me}: waited {MAX_WAIT_S:.0f} s for its turn")
            time.sleep(POLL_S)


@contextmanager
def nullturn(phase: int) -> Iterator[None]:
    yield


def turn_of(turns: Turns | None, phase: int):
    """``turns.turn(phase)``, or a no-op without turns."""
    return turns.turn(phase) if turns is not None else nullturn(phase)
