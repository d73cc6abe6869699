"""Conformance kit for storage backends: subclass :class:`BackendConformance` in your tests.

::

    from kvstrata.testing.conformance import BackendConformance

    class TestMyBackend(BackendConformance):
        @pytest.fixture
        def backend_factory(self, tmp_path):
            def make(instance: str = "conformance") -> StorageBackend:
                backend = MyBackend(instance, MyBackend.Config(...))
                backend.open()
                return backend
            return make

Every check goes through the real storage engine (keys, headers, I/O plans), on a small
three-pool stack (an anchor with two objects per page gathered from per-layer regions, a sidecar
and a component). Integrity tests need the backend to damage an object on demand: implement
``corrupt_for_test(key, mode, offset=-1) -> bool`` (mode ``"flip"`` or ``"truncate"``) on the
backend, or override :meth:`BackendConformance.corrupt` in the test class.

Capability mixins: :class:`BackendConformance` is :class:`CoreConformance` (every backend) +
:class:`IntegrityConformance` (damaged objects refused) + :class:`RemovalConformance` (``remove``,
for ``capabilities.removable``: an absent key returns True). A backend that cannot remove objects
composes ``class TestMine(CoreConformance, IntegrityConformance)``: it opts out, nothing skipped.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from typing import Literal

import pytest
import torch

from kvstrata.core.io_plan import IOMode
from kvstrata.core.storage_engine import PoolBatch
from kvstrata.plugins.pool_type import BufferSpec
from kvstrata.plugins.storage_backend import BufferRegion, StorageBackend, StorageObject
from kvstrata.testing._allocator_kit import HostAllocatorChecks
from kvstrata.testing._backend_kit import (
    MISS_FILL,
    PAGE_SIZE,
    BackendKit,
    HostPoolForTests,
    answers,
    conformance_specs,
    marker_specs,
    page_hashes,
)
from kvstrata.testing._capability_kit import CapabilityChecks
from kvstrata.testing._lifecycle_kit import LifecycleChecks
from kvstrata.testing.conformance_optional import IntegrityConformance, RemovalConformance

__all__ = [
    "PAGE_SIZE",
    "BackendConformance",
    "BackendKit",
    "CoreConformance",
    "HostPoolForTests",
    "IntegrityConformance",
    "RemovalConformance",
    "conformance_specs",
    "marker_specs",
    "page_hashes",
]


def _format(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)).rstrip()


class CoreConformance(LifecycleChecks, HostAllocatorChecks, CapabilityChecks):
    """What every backend must do: round trips, per-key batches, existence, zero-copy honesty,
    namespace isolation, concurrency, marker objects, a second instance, and closing one instance
    leaves the others working (:class:`~kvstrata.testing._lifecycle_kit.LifecycleChecks`); a
    ``host_allocator`` backend's host pools round trip from its allocator
    (:class:`~kvstrata.testing._allocator_kit.HostAllocatorChecks`); ``overwrite`` and
    ``atomic_visibility`` do what they declare
    (:class:`~kvstrata.testing._capability_kit.CapabilityChecks`)."""

    def test_round_trip_multi_region(self, backend: StorageBackend) -> None:
        specs = conformance_specs()
        engine = self.engine(backend, specs)
        source, target = self.pools(specs, 6, seed=1), self.pools(specs, 6, seed=None)
        hashes = page_hashes(6)
        put = engine.put_group({n: PoolBatch(hashes, source[n].units(range(6))) for n in specs})
        assert all(all(r.ok) for r in put.values()), put
        stored = self.put_then_scribble(source, range(6))  # the caller reuses its memory at once
        others = page_hashes(6, seed=99)  # and the engine its staging memory
        engine.put_group({n: PoolBatch(others, source[n].units(range(6))) for n in specs})
        got = engine.get_group({n: PoolBatch(hashes, target[n].units(range(6))) for n in specs})
        assert all(all(r.ok) for r in got.values()), got
        for name in specs:
            self.assert_units_are(target[name], stored[name], range(6))
        self.assert_read_right_first_time(backend, engine)

    @pytest.mark.parametrize("checksum", ["xxh3", "none"])
    def test_round_trip_through_registered_host_memory(
        self, backend: StorageBackend, checksum: Literal["xxh3", "none"]
    ) -> None:
        """As the core runs it: each host pool given to ``register_host_memory`` (one call per
        pool, for zero-copy plans), reads verified by checksum or not (``policy.checksum: none``
        calls ``set_read_verification(False)``): bit-exact round trips and per-key misses."""
        specs = conformance_specs()
        engine = self.engine(backend, specs, checksum=checksum)
        source, target = self.pools(specs, 4, seed=21), self.pools(specs, 4, seed=None)
        for pool in target.values():  # not zeros: a backend writing zeros into a missed page shows
            pool.backing.fill_(MISS_FILL)
        self.register(backend, engine, source)
        self.register(backend, engine, target)
        hashes = page_hashes(4, seed=21)
        put = engine.put_group({n: PoolBatch(hashes[:3], source[n].units(range(3))) for n in specs})
        assert all(all(r.ok) for r in put.values()), f"checksum {checksum}: put into registered memory {put}"
        stored = self.put_then_scribble(source, range(3))  # the host slots go to other pages
        others = page_hashes(3, seed=99)  # (and the engine's staging memory, on a copy plan)
        engine.put_group({n: PoolBatch(others, source[n].units(range(3))) for n in specs})
        got = engine.get_group({n: PoolBatch(hashes, target[n].units(range(4))) for n in specs})
        for name in specs:
            assert got[name].ok == [True, True, True, False], (
                f"checksum {checksum}: get of pool {name!r} into registered host memory: "
                f"{answers(got[name])}, expected three hits and a miss"
            )
            self.assert_units_are(target[name], stored[name], range(3))
        missed = target["attn"].unit_bytes(3)
        assert missed == bytes([MISS_FILL]) * len(missed), (
            f"backend {backend.name!r}: get() of a key it does not hold wrote into that key's regions "
            "(a miss writes nothing into the page)"
        )
        self.assert_read_right_first_time(backend, engine)

    def test_partial_batches_per_key(self, backend: StorageBackend) -> None:
        specs = conformance_specs()
        engine = self.engine(backend, specs)
        source, target = self.pools(specs, 4, seed=2), self.pools(specs, 4, seed=None)
        hashes = page_hashes(4, seed=2)
        stored = [0, 2]
        assert all(engine.put("attn", [hashes[i] for i in stored], source["attn"].units(stored)).ok)
        found = engine.exists("attn", hashes)
        assert found.ok == [True, False, True, False], f"exists() answers per key: {answers(found)}"
        result = engine.get("attn", hashes, target["attn"].units(range(4)))
        assert result.ok == [True, False, True, False], (
            f"get() answers per key: a miss fails only its key: {answers(result)}"
        )
        assert result.prefix == 1
        self.assert_units_equal(source["attn"], target["attn"], stored)
        assert target["attn"].unit_bytes(1) == bytes(len(target["attn"].unit_bytes(1)))
        assert engine.metrics.get_misses == 2
        self.assert_read_right_first_time(backend, engine)

    def test_existence_prefix_semantics(self, backend: StorageBackend) -> None:
        specs = conformance_specs()
        engine = self.engine(backend, specs)
        source = self.pools(specs, 5, seed=3)
        hashes = page_hashes(5, seed=3)
        assert engine.exists_prefix("index", hashes) == 0, "nothing stored yet: exists must say False"
        assert all(engine.put("index", hashes[:3], source["index"].units(range(3))).ok)
        assert engine.exists_prefix("index", hashes) == 3, (
            "exists(leading=True) counts the stored keys up to the first absent one, no further"
        )
        assert engine.exists_prefix("index", hashes[1:]) == 2
        keys = engine.object_keys("index", hashes)[0]
        assert backend.exists(keys) == [True, True, True, False, False], "exists() answers per key"
        assert all(engine.put("index", hashes[4:], source["index"].units([4])).ok)  # a gap at 3
        assert engine.exists_prefix("index", hashes) == 3, (
            "exists(leading=True) stops at the first absent key, whatever is stored after it"
        )
        # a unit of a multi-object pool exists only when every one of its objects does
        assert all(engine.put("attn", hashes[:2], source["attn"].units(range(2))).ok)
        assert engine.exists("attn", hashes[:3]).ok == [True, True, False]

    def test_zero_copy_honesty(self, backend: StorageBackend) -> None:
        caps = backend.instance_capabilities()
        specs = conformance_specs()
        engine = self.engine(backend, specs)
        for name, plan in engine.plans.items():
            pool_caps = caps.for_pool(specs[name].pool_type)
            if pool_caps is None:
                assert plan.mode is IOMode.OFF
                continue
            expect_zero = pool_caps.zero_copy and caps.multi_buffer_objects and not caps.host_allocator
            assert (plan.mode is IOMode.ZERO_COPY) == expect_zero, plan
        if caps.max_object_bytes is not None:
            big = conformance_specs()["attn"].model_copy(
                update={
                    "buffers": (
                        BufferSpec(name="k", dtype="uint8", layers=1, unit_shape=(caps.max_object_bytes,)),
                        BufferSpec(name="v", dtype="uint8", layers=1, unit_shape=(1,)),
                    )
                }
            )
            assert self.engine(backend, {"attn": big}).plans["attn"].mode is IOMode.OFF
        # a backend claiming multi-buffer objects gathers / scatters scattered regions itself
        if caps.multi_buffer_objects:
            data = torch.randint(
                0, 256, (4, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(9)
            )
            out = torch.zeros_like(data)
            key = f"{self.model_name}-raw-multi-region"
            regions = tuple(BufferRegion(data[i, 8 * i :].data_ptr(), 40) for i in range(4))
            assert backend.put([StorageObject(key, regions)]) == [True]
            back = tuple(BufferRegion(out[i, 8 * i :].data_ptr(), 40) for i in range(4))
            assert backend.get([StorageObject(key, back)]) == [160]
            for i in range(4):
                assert torch.equal(out[i, 8 * i : 8 * i + 40], data[i, 8 * i : 8 * i + 40])

    def test_namespace_and_layout_isolation(self, backend: StorageBackend) -> None:
        specs = conformance_specs()
        model_a = f"{self.model_name}-a"
        writer = self.engine(backend, specs, model_name=model_a)
        source = self.pools(specs, 2, seed=5)
        hashes = page_hashes(2, seed=5)
        assert all(writer.put("attn", hashes, source["attn"].units(range(2))).ok)
        other_model = self.engine(backend, specs, model_name=f"{self.model_name}-b")
        target = self.pools(specs, 2, seed=None)
        assert other_model.exists("attn", hashes).ok == [False, False]
        assert other_model.get("attn", hashes, target["attn"].units(range(2))).ok == [False, False]
        # another dtype: another key (the layout is part of it) ...
        other_layout = self.engine(backend, conformance_specs(dtype="bfloat16"), model_name=model_a)
        assert other_layout.exists("attn", hashes).ok == [False, False]
        # ... and an object of another layout under its key (copied, crafted) fails the header
        self._forge(backend, specs, other_layout, "attn", hashes, source, model_name=model_a)
        assert other_layout.get("attn", hashes, target["attn"].units(range(2))).ok == [False, False]
        assert other_layout.metrics.foreign_reasons.get("fingerprint_mismatch", 0) >= 2
        assert other_layout.metrics.corrupt_detected == 0, "another layout is not damage"

    def test_longer_object_is_read_no_further_than_its_regions(self, backend: StorageBackend) -> None:
        """An object longer than the regions it is read into (another layout's, copied or crafted
        under the key) fills those regions at most: on a zero-copy plan the memory after them
        holds the host pool's next pages, which the cache serves without reading them again."""
        specs, longer = conformance_specs(), conformance_specs(dtype="float32")
        reader = self.engine(backend, specs)
        hashes = page_hashes(4, seed=19)
        self._forge(backend, longer, reader, "attn", hashes[0::2], self.pools(longer, 2, seed=19))
        target = self.pools(specs, 6, seed=None)  # units 4, 5: room for an overrun of unit 2
        for pool in target.values():
            pool.backing.fill_(MISS_FILL)
        self.register(backend, reader, target)
        got = reader.get("attn", hashes, target["attn"].units(range(4))).ok
        assert got == [False] * 4, f"two objects of another layout and two absent keys: {got}"
        for unit in (1, 3):
            after = target["attn"].unit_bytes(unit)
            assert after == bytes([MISS_FILL]) * len(after), (
                f"backend {backend.name!r}: get() of an object longer than its regions wrote past them, "
                f"into the next page's memory (unit {unit})"
            )

    def test_concurrent_distinct_and_same_keys(self, backend: StorageBackend) -> None:
        specs = conformance_specs()
        engine = self.engine(backend, specs)
        threads_count, per_thread = 4, 4
        shared = page_hashes(per_thread, seed=6)
        source = self.pools(specs, per_thread * threads_count, seed=6)
        errors: list[BaseException] = []

        def work(index: int) -> None:
            try:
                own = page_hashes(per_thread, seed=10 + index)
                units = range(index * per_thread, (index + 1) * per_thread)
                put = engine.put("attn", own, source["attn"].units(units))
                assert all(put.ok), f"thread {index}: put of its own keys failed: {answers(put)}"
                put = engine.put("attn", shared, source["attn"].units(range(per_thread)))
                assert all(put.ok), f"thread {index}: put of the shared keys failed: {answers(put)}"
                target = HostPoolForTests(specs["attn"], per_thread)
                got = engine.get("attn", own, target.units(range(per_thread)))
                assert all(got.ok), f"thread {index}: get of its own keys failed: {answers(got)}"
                for offset, unit in enumerate(units):
                    assert target.unit_bytes(offset) == source["attn"].unit_bytes(unit), (
                        f"thread {index}: its own page {offset} read back other bytes"
                    )
                got = engine.get("attn", shared, target.units(range(per_thread)))
                assert all(got.ok), f"thread {index}: get of the shared keys failed: {answers(got)}"
                self.assert_units_equal(source["attn"], target, range(per_thread))
            except BaseException as exc:  # surfaced in the main thread below
                errors.append(exc)

        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads_count)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert not errors, (
            f"backend {backend.name!r} is not thread-safe: {len(errors)} of {threads_count} threads "
            "failed putting/getting distinct and shared keys at once (the contract: put/get/exists may "
            "be called from several threads):\n" + "\n".join(_format(exc) for exc in errors)
        )
        assert engine.metrics.corrupt_detected == 0, "concurrent puts of one key must not damage it"

    def test_bufferless_anchor_stores_marker_objects(self, backend: StorageBackend) -> None:
        specs = marker_specs()
        engine = self.engine(backend, specs)
        assert engine.plans["pages"].enabled, engine.plans["pages"].reason
        source, target = self.pools(specs, 4, seed=11), self.pools(specs, 4, seed=None)
        hashes = page_hashes(4, seed=11)
        # a bufferless pool's units may be left out ...
        put = engine.put_group(
            {"pages": PoolBatch(hashes[:3]), "index": PoolBatch(hashes[:3], source["index"].units(range(3)))}
        )
        assert all(all(result.ok) for result in put.values()), put
        markers = engine.object_keys("pages", hashes)
        assert len(markers) == 1, "one marker object per page"
        assert backend.exists(markers[0]) == [True, True, True, False]
        assert engine.exists("pages", hashes).ok == [True, True, True, False]
        # ... or given as empty regions per page
        index_batch = PoolBatch(hashes, target["index"].units(range(4)))
        got = engine.get_group({"pages": PoolBatch(hashes, [[()]] * 4), "index": index_batch})
        assert got["pages"].ok == [True, True, True, False] and got["index"].ok == [True, True, True, False]
        self.assert_units_equal(source["index"], target["index"], range(3))
        # (a damaged marker: IntegrityConformance.test_damaged_marker_is_a_miss)
        # a marker of another layout under the same key is foreign: a miss, never a commit
        other = {"pages": specs["pages"].model_copy(update={"page_size": PAGE_SIZE * 2})}
        foreign = self.engine(backend, other)
        assert foreign.exists("pages", hashes[:1]).ok == [False]  # the layout is in the key
        foreign.schemas["pages"] = engine.schemas["pages"]  # ... unless copied under this key
        assert foreign.get("pages", hashes[:1], []).ok == [False]
        assert foreign.metrics.foreign_reasons == {"fingerprint_mismatch": 1}
        assert foreign.metrics.corrupt_detected == 0
        with pytest.raises(ValueError, match="stores no payload"):
            engine.put("pages", hashes[:1], source["index"].units([0]))

    def test_second_instance(self, backend_factory: Callable[[str], StorageBackend]) -> None:
        """Shared backends: a second instance reads what the first wrote, bit exact. Private ones:
        two instances work side by side without disturbing each other."""
        first = backend_factory("conformance")
        try:
            second = backend_factory("conformance")
            try:
                specs = conformance_specs()
                source, other = self.pools(specs, 2, seed=7), self.pools(specs, 2, seed=8)
                hashes = page_hashes(2, seed=7)
                assert all(self.engine(first, specs).put("attn", hashes, source["attn"].units(range(2))).ok)
                if first.instance_capabilities().shared_across_instances:
                    target = self.pools(specs, 2, seed=None)
                    assert all(
                        self.engine(second, specs).get("attn", hashes, target["attn"].units(range(2))).ok
                    ), (
                        f"backend {first.name!r} declares shared_across_instances, but a second "
                        "instance does not read what the first one wrote"
                    )
                    self.assert_units_equal(source["attn"], target["attn"], range(2))
                    return
                assert all(self.engine(second, specs).put("attn", hashes, other["attn"].units(range(2))).ok)
                for backend, expected in ((first, source), (second, other)):
                    target = self.pools(specs, 2, seed=None)
                    assert all(
                        self.engine(backend, specs).get("attn", hashes, target["attn"].units(range(2))).ok
                    )
                    assert target["attn"].unit_bytes(0) == expected["attn"].unit_bytes(0), (
                        f"backend {first.name!r} does not declare shared_across_instances, but one instance "
                        "read what another wrote under the same keys: declare it shared "
                        "(instance_capabilities().shared_across_instances) or keep each instance's "
                        "storage private"
                    )
                    self.assert_units_equal(expected["attn"], target["attn"], range(2))
            finally:
                second.close()
        finally:
            first.close()


class BackendConformance(CoreConformance, IntegrityConformance, RemovalConformance):
    """Every check of the kit. A backend without a capability composes the mixins it supports
    instead, e.g. ``class TestMine(CoreConformance, IntegrityConformance)`` for one that cannot
    remove objects (no skips, no overrides)."""

    def test_remove_and_damaged_objects_are_removed(self, backend: StorageBackend) -> None:
        if not backend.instance_capabilities().removable:
            pytest.skip(
                f"backend {backend.name!r} declares removable=False: compose CoreConformance and "
                "IntegrityConformance instead of BackendConformance"
            )
        super().test_remove_and_damaged_objects_are_removed(backend)

    def test_removing_an_absent_key_returns_true(self, backend: StorageBackend) -> None:
        if not backend.instance_capabilities().removable:
            pytest.skip(f"backend {backend.name!r} declares removable=False (remove() is optional)")
        super().test_removing_an_absent_key_returns_true(backend)
