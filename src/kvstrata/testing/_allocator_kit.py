"""The backend kit's check of ``allocate_host_memory`` (part of
:class:`~kvstrata.testing.conformance.CoreConformance`): a backend that declares
``host_allocator`` gets every host pool from it, and the core reads and writes those pools
zero-copy. The other round trips use the kit's own memory (copy plans for such a backend), so
without this check nothing ever called the allocator."""

from __future__ import annotations

import itertools

import pytest

from kvstrata.core.storage_engine import PoolBatch
from kvstrata.plugins.storage_backend import StorageBackend
from kvstrata.testing._backend_kit import (
    MISS_FILL,
    BackendKit,
    HostPoolForTests,
    answers,
    conformance_specs,
    page_hashes,
)


class HostAllocatorChecks(BackendKit):
    """Host pools from ``allocate_host_memory``: memory of their own, bit-exact round trips."""

    def test_round_trip_through_backend_allocated_host_memory(self, backend: StorageBackend) -> None:
        if not backend.instance_capabilities().host_allocator:
            pytest.skip(
                f"backend {backend.name!r} declares host_allocator=False: host pools are the core's "
                "own memory (test_round_trip_through_registered_host_memory)"
            )
        specs = conformance_specs()
        engine = self.engine(backend, specs, host_memory_from_backend=True)
        allocate = backend.allocate_host_memory
        sides = {
            "source": {
                n: HostPoolForTests(s, 4, seed=31 + i, allocate=allocate)
                for i, (n, s) in enumerate(specs.items())
            },
            "target": {n: HostPoolForTests(s, 4, allocate=allocate) for n, s in specs.items()},
        }
        spans = sorted(
            (pool.backing.data_ptr(), pool.backing.data_ptr() + pool.backing.numel(), f"{side} pool {name!r}")
            for side, pools in sides.items()
            for name, pool in pools.items()
        )
        for (_, end, first), (start, _, second) in itertools.pairwise(spans):
            assert end <= start, (
                f"backend {backend.name!r}: allocate_host_memory() handed out overlapping memory "
                f"({first} and {second}): each call must return memory of its own"
            )
        source, target = sides["source"], sides["target"]
        for pool in target.values():
            pool.backing.fill_(MISS_FILL)
        hashes = page_hashes(4, seed=31)
        put = engine.put_group({n: PoolBatch(hashes[:3], source[n].units(range(3))) for n in specs})
        assert all(all(r.ok) for r in put.values()), f"put from backend-allocated host memory: {put}"
        stored = self.put_then_scribble(source, range(3))
        got = engine.get_group({n: PoolBatch(hashes, target[n].units(range(4))) for n in specs})
        for name in specs:
            assert got[name].ok == [True, True, True, False], (
                f"get of pool {name!r} into backend-allocated host memory: {answers(got[name])}, "
                "expected three hits and a miss"
            )
            self.assert_units_are(target[name], stored[name], range(3))
        missed = target["attn"].unit_bytes(3)
        assert missed == bytes([MISS_FILL]) * len(missed), (
            f"backend {backend.name!r}: get() of a key it does not hold wrote into that key's regions"
        )
        self.assert_read_right_first_time(backend, engine)
