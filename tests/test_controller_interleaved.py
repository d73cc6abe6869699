"""Many requests in flight at once, in random order (a scheduler batching requests): every
restored byte is exact, the tree stays consistent, and no device or host unit leaks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from controller_support import (
    device_accounting,
    fill,
    host_units_held_by_tree,
    host_units_in_use,
    open_cache,
    tokens,
    verify,
)
from kvstrata.core.controller import CacheFullError, Lease


@pytest.mark.parametrize("stack", ["kv", "swa-mamba", "mla-nsa-draft", "logical-swa"])
@pytest.mark.parametrize("seed", [1, 2])
def test_interleaved_requests_keep_bytes_and_accounting_exact(stack: str, seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    overrides = [
        "policy.prefetch.policy=" + rng.choice(["wait_complete", "best_effort", "timeout"]),
        "policy.write=" + rng.choice(["write_through", "write_through_selective", "write_back"]),
        "policy.prefetch.threshold_tokens=64",
    ]
    with open_cache(stack, tmp_path, overrides) as cache:
        stems = [tokens(500 + seed * 10 + i, 3) for i in range(4)]

        def request() -> torch.Tensor:
            stem = rng.choice(stems)[: 64 * rng.randint(1, 3)]
            return torch.cat([stem, tokens(rng.randrange(10**6), rng.randint(0, 3))])

        leases: list[Lease] = []
        for _ in range(120):
            action = rng.random()
            if action < 0.35 and len(leases) < 3:
                leases.append(cache.lookup(request()))
            elif leases:
                lease = rng.choice(leases)
                if not lease.admitted:
                    cache.admit(lease)
                    assert verify(cache, lease) == 0, "a restored unit holds the wrong bytes"
                elif lease._allocated is None and action < 0.9:
                    try:
                        fill(cache, lease, cache.allocate(lease))
                    except CacheFullError:
                        cache.release(lease)
                        leases.remove(lease)
                elif action < 0.95 and lease._allocated is not None:
                    cache.insert(lease)
                    leases.remove(lease)
                else:
                    cache.release(lease)
                    leases.remove(lease)
            cache.tree.check()
            device_accounting(cache, leases)
        for lease in leases:
            cache.release(lease)
        cache.flush()
        cache.tree.check()
        device_accounting(cache, [])
        assert host_units_in_use(cache) == host_units_held_by_tree(cache), "host units leaked"
        snapshot = cache.metrics.snapshot()
        assert snapshot["hit_tokens"]["total"] > 0
