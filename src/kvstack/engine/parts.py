"""``EngineParts``: the parts of an ``LLMEngine`` that its helper modules read.

``engine/snapshot.py`` (the counters of ``LLMEngine.stats``) and ``engine/segments.py``
(segment reuse's set-up and request checks) take the engine as this protocol, so neither
imports ``engine/llm_engine.py``, which imports them: the engine module stays the only one
that knows the whole engine, and no import circle closes through a type annotation.
Each part is read-only here; ``LLMEngine`` satisfies the protocol structurally.
"""

from __future__ import annotations

from typing import Protocol

from kvstack.config.engine import EngineConfig
from kvstack.core.model_config import ModelConfig
from kvstack.engine.stats import UsageTracker
from kvstack.kv.base import KVManager
from kvstack.kv.press.coordinator import PressCoordinator
from kvstack.kv.storage import KVStorage
from kvstack.kv.tiers.connector import TierConnector
from kvstack.model.tokenizer.tokenizer import Tokenizer
from kvstack.sched.scheduler import Scheduler
from kvstack.spec.speculator import Speculator


class EngineParts(Protocol):
    """What ``LLMEngine`` holds, as its helper modules see it."""

    @property
    def config(self) -> EngineConfig: ...
    @property
    def model_config(self) -> ModelConfig: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def kv_manager(self) -> KVManager: ...
    @property
    def kv_storage(self) -> KVStorage: ...
    @property
    def kv_bytes_per_token(self) -> float: ...
    @property
    def connector(self) -> TierConnector | None: ...
    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def press(self) -> PressCoordinator: ...
    @property
    def speculator(self) -> Speculator | None: ...
    @property
    def usage_tracker(self) -> UsageTracker: ...
    @property
    def num_steps(self) -> int: ...
