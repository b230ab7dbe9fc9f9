"""A byte budget over stored blocks with a pluggable eviction order (host and disk tiers).

Reuses the device cache's policies (``kv/policies.py``: LRU, LFU): every stored block is
an eviction candidate (inserted, then at once released), a load is acquire + hit +
release, as a device prefix hit is. Invariant:
``used_bytes == sum(sizes) <= capacity_bytes`` after every ``admit``.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstack.kv.policies import make_policy


class BlockBudget:
    def __init__(self, capacity_bytes: int, policy: str = "lru") -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"tier capacity must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        # The policy's capacity is only a sizing hint (ARC ghost lists); use a generous one.
        self.policy = make_policy(policy, 1 << 20)
        self.sizes: dict[bytes, int] = {}
        self.used_bytes = 0
        # Told the keys ``admit`` evicts (the offload manager publishes them as KV events).
        self.on_evict: Callable[[list[bytes]], None] | None = None

    def __contains__(self, key: bytes) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def fits(self, size: int) -> bool:
        return size <= self.capacity_bytes

    def admit(self, key: bytes, size: int) -> list[bytes]:
        """Account ``key`` (``size`` B); returns the keys evicted to make room, oldest first."""
        assert key not in self.sizes and self.fits(size)
        victims = []
        while self.used_bytes + size > self.capacity_bytes:
            victim = self.policy.victim()
            assert isinstance(victim, bytes)
            self.remove(victim)
            victims.append(victim)
        self.sizes[key] = size
        self.used_bytes += size
        self.policy.on_insert(key)
        self.policy.on_release(key)
        if victims and self.on_evict is not None:
            self.on_evict(victims)
        return victims

    def hit(self, key: bytes) -> None:
        """A load: the same acquire/hit/release a device prefix hit makes."""
        if key in self.sizes:
            self.policy.on_acquire(key)
            self.policy.on_hit(key)
            self.policy.on_release(key)

    def remove(self, key: bytes) -> None:
        size = self.sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size
            self.policy.on_remove(key)

    def check_integrity(self) -> None:
        assert self.used_bytes == sum(self.sizes.values()), "byte count out of sync"
        assert self.used_bytes <= self.capacity_bytes, "over budget"
        assert len(self.policy) == len(self.sizes), "policy and index disagree"
        self.policy.check_integrity()
