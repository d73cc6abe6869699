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
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import pytest
import torch

from kvstrata.core.config import ParallelConfig
from kvstrata.core.io_plan import IOMode, plan_backend
from kvstrata.core.keys import hash_pages, namespace_root
from kvstrata.core.storage_engine import PoolBatch, StorageEngine
from kvstrata.plugins.pool_type import (
    BufferSpec,
    Granularity,
    HitRule,
    HitRuleKind,
    ObjectSpec,
    PartialHit,
    PoolRole,
    PoolSpec,
    Replication,
)
from kvstrata.plugins.storage_backend import BufferRegion, StorageBackend, StorageObject

PAGE_SIZE = 4


def conformance_specs(dtype: str = "float16") -> dict[str, PoolSpec]:
    """A small hybrid stack: anchor (2 objects, 2 buffers x 2 layers), sidecar, component."""

    def spec(name: str, pool_type: str, role: PoolRole, buffers: tuple[BufferSpec, ...],
             objects: tuple[ObjectSpec, ...], **extra: object) -> PoolSpec:  # fmt: skip
        return PoolSpec(
            name=name,
            pool_type=pool_type,
            role=role,
            granularity=Granularity.TOKEN_PAGES,
            hit_rule=HitRule(kind=HitRuleKind.ALL_PAGES),
            partial_hit=PartialHit.CLAMP,
            replication=Replication.SHARDED,
            page_size=PAGE_SIZE,
            buffers=buffers,
            objects=objects,
            **extra,
        )

    return {
        "attn": spec(
            "attn",
            "conf_kv",
            PoolRole.ANCHOR,
            (
                BufferSpec(name="k", dtype=dtype, layers=2, unit_shape=(PAGE_SIZE, 2, 8)),
                BufferSpec(name="v", dtype=dtype, layers=2, unit_shape=(PAGE_SIZE, 2, 8)),
            ),
            (ObjectSpec(suffix="k", buffers=("k",)), ObjectSpec(suffix="v", buffers=("v",))),
        ),
        "index": spec(
            "index",
            "conf_idx",
            PoolRole.SIDECAR,
            (BufferSpec(name="keys", dtype="uint8", layers=3, unit_shape=(PAGE_SIZE, 16)),),
            (ObjectSpec(suffix="idx", buffers=("keys",)),),
            index_source="attn",
        ),
        "state": spec(
            "state",
            "conf_state",
            PoolRole.COMPONENT,
            (
                BufferSpec(name="conv", dtype="float32", layers=2, unit_shape=(3, 8)),
                BufferSpec(name="ssm", dtype="float32", layers=2, unit_shape=(4, 4)),
            ),
            (ObjectSpec(suffix="state", buffers=("conv", "ssm")),),
        ),
    }


def marker_specs() -> dict[str, PoolSpec]:
    """A bufferless anchor (stored as one header-only marker object per page) and a sidecar."""
    base = conformance_specs()
    pages = base["attn"].model_copy(
        update={
            "name": "pages",
            "pool_type": "conf_logical",
            "buffers": (),
            "objects": (),
            "replication": Replication.REPLICATED,
        }
    )
    return {"pages": pages, "index": base["index"].model_copy(update={"index_source": "pages"})}


class HostPoolForTests:
    """A layer-first host pool made of plain uint8 tensors: one object = one region per layer."""

    def __init__(self, spec: PoolSpec, units: int, seed: int | None = None) -> None:
        self.spec = spec
        self.tensors = {
            b.name: torch.zeros((b.layers, units, b.bytes_per_unit_per_layer), dtype=torch.uint8)
            for b in spec.buffers
        }
        if seed is not None:
            generator = torch.Generator().manual_seed(seed)
            for tensor in self.tensors.values():
                tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8, generator=generator))

    def unit_regions(self, unit: int) -> list[list[BufferRegion]]:
        regions: list[list[BufferRegion]] = []
        for obj in self.spec.objects:
            per_obj = []
            for name in obj.buffers:
                tensor = self.tensors[name]
                for layer in range(tensor.shape[0]):
                    row = tensor[layer, unit]
                    per_obj.append(BufferRegion(row.data_ptr(), row.numel()))
            regions.append(per_obj)
        return regions

    def units(self, indices: Sequence[int]) -> list[list[list[BufferRegion]]]:
        return [self.unit_regions(i) for i in indices]

    def unit_bytes(self, unit: int) -> bytes:
        return b"".join(t[:, unit].contiguous().numpy().tobytes() for t in self.tensors.values())


def page_hashes(count: int, model: str = "conformance", seed: int = 0) -> list[str]:
    tokens = torch.arange(seed * 1000, seed * 1000 + count * PAGE_SIZE, dtype=torch.int64)
    return hash_pages(tokens, PAGE_SIZE, namespace_root(model))


class BackendConformance:
    """Behaviour every storage backend must show; subclass and provide ``backend_factory``."""

    model_name = "conformance-model"

    @pytest.fixture(autouse=True)
    def _fresh_namespace(self) -> None:
        """A model name (key namespace) of its own per test: a shared backend (one Mooncake
        cluster for the whole session, several conformance classes) still holds what earlier
        tests wrote, and "nothing stored yet" assertions must not see it."""
        self.model_name = f"conformance-{uuid.uuid4().hex[:12]}"

    @pytest.fixture
    def backend_factory(self) -> Callable[[str], StorageBackend]:
        raise NotImplementedError("a conformance test class must override the backend_factory fixture")

    @pytest.fixture
    def backend(self, backend_factory: Callable[[str], StorageBackend]) -> Iterator[StorageBackend]:
        instance = backend_factory("conformance")
        yield instance
        instance.close()

    # --- helpers ----------------------------------------------------------------------------------

    def engine(
        self,
        backend: StorageBackend,
        specs: dict[str, PoolSpec] | None = None,
        model_name: str | None = None,
        checksum: Literal["xxh3", "none"] = "xxh3",
    ) -> StorageEngine:
        specs = specs or conformance_specs()
        parallel = ParallelConfig()
        caps = backend.instance_capabilities()
        plans = plan_backend(backend.instance, caps, specs.values(), parallel=parallel)
        return StorageEngine(
            backend,
            specs,
            plans,
            model_name=model_name or self.model_name,
            parallel=parallel,
            checksum=checksum,
        )

    def corrupt(self, backend: StorageBackend, key: str, mode: Literal["flip", "truncate"]) -> bool:
        hook = getattr(backend, "corrupt_for_test", None)
        if hook is None:
            pytest.skip(f"backend {backend.name!r} offers no corrupt_for_test hook")
        return bool(hook(key, mode))

    @staticmethod
    def pools(specs: dict[str, PoolSpec], units: int, seed: int | None) -> dict[str, HostPoolForTests]:
        return {
            name: HostPoolForTests(spec, units, None if seed is None else seed + i)
            for i, (name, spec) in enumerate(specs.items())
        }

    def assert_units_equal(self, a: HostPoolForTests, b: HostPoolForTests, units: Sequence[int]) -> None:
        for unit in units:
            assert a.unit_bytes(unit) == b.unit_bytes(unit), f"pool {a.spec.name!r} unit {unit} differs"

    # --- tests --------------------------------------------------------------------------------------

    def test_round_trip_multi_region(self, backend: StorageBackend) -> None:
        specs = conformance_specs()
        engine = self.engine(backend, specs)
        source, target = self.pools(specs, 6, seed=1), self.pools(specs, 6, seed=None)
        hashes = page_hashes(6)
        put = engine.put_group({n: PoolBatch(hashes, source[n].units(range(6))) for n in specs})
        assert all(all(r.ok) for r in put.values()), put
        got = engine.get_group({n: PoolBatch(hashes, target[n].units(range(6))) for n in specs})
        assert all(all(r.ok) for r in got.values()), got
        for name in specs:
            self.assert_units_equal(source[name], target[name], range(6))
        assert engine.metrics.corrupt_detected == 0

    def test_partial_batches_per_key(self, backend: StorageBackend) -> None:
        specs = conformance_specs()
        engine = self.engine(backend, specs)
        source, target = self.pools(specs, 4, seed=2), self.pools(specs, 4, seed=None)
        hashes = page_hashes(4, seed=2)
        stored = [0, 2]
        assert all(engine.put("attn", [hashes[i] for i in stored], source["attn"].units(stored)).ok)
        assert engine.exists("attn", hashes).ok == [True, False, True, False]
        result = engine.get("attn", hashes, target["attn"].units(range(4)))
        assert result.ok == [True, False, True, False]
        assert result.prefix == 1
        self.assert_units_equal(source["attn"], target["attn"], stored)
        assert target["attn"].unit_bytes(1) == bytes(len(target["attn"].unit_bytes(1)))
        assert engine.metrics.get_misses == 2 and engine.metrics.corrupt_detected == 0

    def test_existence_prefix_semantics(self, backend: StorageBackend) -> None:
        specs = conformance_specs()
        engine = self.engine(backend, specs)
        source = self.pools(specs, 5, seed=3)
        hashes = page_hashes(5, seed=3)
        assert engine.exists_prefix("index", hashes) == 0
        assert all(engine.put("index", hashes[:3], source["index"].units(range(3))).ok)
        assert engine.exists_prefix("index", hashes) == 3
        assert engine.exists_prefix("index", hashes[1:]) == 2
        keys = engine.object_keys("index", hashes)[0]
        assert backend.exists(keys) == [True, True, True, False, False]
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

    @pytest.mark.parametrize("mode", ["flip", "truncate"])
    def test_integrity_rejection(self, backend: StorageBackend, mode: Literal["flip", "truncate"]) -> None:
        specs = conformance_specs()
        engine = self.engine(backend, specs)
        source, target = self.pools(specs, 3, seed=4), self.pools(specs, 3, seed=None)
        hashes = page_hashes(3, seed=4)
        assert all(engine.put("state", hashes, source["state"].units(range(3))).ok)
        key = engine.object_keys("state", hashes[1:2])[0][0]
        assert self.corrupt(backend, key, mode)
        result = engine.get("state", hashes, target["state"].units(range(3)))
        assert result.ok == [True, False, True]
        assert engine.metrics.corrupt_detected == 1
        assert sum(engine.metrics.corrupt_reasons.values()) == 1

    def _forge(
        self,
        backend: StorageBackend,
        specs: dict[str, PoolSpec],
        victim: StorageEngine,
        pool: str,
        hashes: list[str],
        source: dict[str, HostPoolForTests],
        model_name: str | None = None,
    ) -> None:
        """Store ``source``'s units of ``pool`` (laid out by ``specs``) under ``victim``'s keys."""
        forger = self.engine(backend, specs, model_name=model_name)
        forger.schemas[pool] = victim.schemas[pool]
        assert all(forger.put(pool, hashes, source[pool].units(range(len(hashes)))).ok)

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

    def test_layout_change_replaces_foreign_objects(self, backend: StorageBackend) -> None:
        """Objects of another layout under a reader's keys (keys hold the layout, so these are
        copied or crafted ones) are removed (or overwritten), so the reader gets storage hits
        again instead of skip-existing keeping the foreign objects forever."""
        caps = backend.instance_capabilities()
        if not caps.removable and caps.overwrite != "replace":
            pytest.skip(f"backend {backend.name!r} can neither remove nor replace objects")
        old_specs, new_specs = conformance_specs(), conformance_specs(dtype="bfloat16")
        hashes = page_hashes(3, seed=15)
        old_source = self.pools(old_specs, 3, seed=15)
        new = self.engine(backend, new_specs)
        self._forge(backend, old_specs, new, "attn", hashes, old_source)
        source, target = self.pools(new_specs, 3, seed=16), self.pools(new_specs, 3, seed=None)
        assert new.put("attn", hashes, source["attn"].units(range(3))).ok == [True] * 3  # skipped or replaced
        first = new.get("attn", hashes, target["attn"].units(range(3))).ok
        if first != [True] * 3:  # skip_existing kept the old objects: the read must clear them
            assert first == [False] * 3
            assert new.metrics.foreign_objects == 6 and new.metrics.foreign_removed == 6
            assert all(new.put("attn", hashes, source["attn"].units(range(3))).ok)
            assert all(new.get("attn", hashes, target["attn"].units(range(3))).ok)
        self.assert_units_equal(source["attn"], target["attn"], range(3))
        assert new.metrics.corrupt_detected == 0 and new.metrics.corrupt_reasons == {}

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
                assert all(engine.put("attn", own, source["attn"].units(units)).ok)
                assert all(engine.put("attn", shared, source["attn"].units(range(per_thread))).ok)
                target = HostPoolForTests(specs["attn"], per_thread)
                assert all(engine.get("attn", own, target.units(range(per_thread))).ok)
                for offset, unit in enumerate(units):
                    assert target.unit_bytes(offset) == source["attn"].unit_bytes(unit)
                assert all(engine.get("attn", shared, target.units(range(per_thread))).ok)
                self.assert_units_equal(source["attn"], target, range(per_thread))
            except BaseException as exc:  # surfaced in the main thread below
                errors.append(exc)

        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads_count)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert not errors, errors
        assert engine.metrics.corrupt_detected == 0

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
        # a damaged marker is a miss, and the sidecar page it gates is not read at all
        assert self.corrupt(backend, markers[0][1], "truncate")
        fresh = self.pools(specs, 3, seed=None)
        index_batch = PoolBatch(hashes[:3], fresh["index"].units(range(3)))
        got = engine.get_group({"pages": PoolBatch(hashes[:3], [[]] * 3), "index": index_batch})
        assert got["pages"].ok == [True, False, True] and got["index"].ok == [True, False, True]
        assert fresh["index"].unit_bytes(1) == bytes(len(fresh["index"].unit_bytes(1)))
        assert engine.metrics.corrupt_detected == 1
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

    def test_remove_and_damaged_objects_are_removed(self, backend: StorageBackend) -> None:
        if not backend.instance_capabilities().removable:
            pytest.skip(f"backend {backend.name!r} declares removable=False (remove() is optional)")
        specs = conformance_specs()
        engine = self.engine(backend, specs)
        source = self.pools(specs, 3, seed=12)
        hashes = page_hashes(3, seed=12)
        assert all(engine.put("state", hashes, source["state"].units(range(3))).ok)
        keys = engine.object_keys("state", hashes)[0]
        assert backend.remove([keys[0], "conformance-never-stored"]) == [True, True]
        assert backend.exists(keys) == [False, True, True]
        assert self.corrupt(backend, keys[1], "flip")
        target = self.pools(specs, 3, seed=None)
        assert engine.get("state", hashes, target["state"].units(range(3))).ok == [False, False, True]
        assert engine.metrics.corrupt_detected == 1 and engine.metrics.corrupt_removed == 1
        assert backend.exists(keys) == [False, False, True], "the damaged object must be gone"
        # so a writer can store the page again, and it reads back bit exact
        assert all(engine.put("state", hashes[:2], source["state"].units(range(2))).ok)
        assert all(engine.get("state", hashes, target["state"].units(range(3))).ok)
        self.assert_units_equal(source["state"], target["state"], range(3))

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
                    )
                    self.assert_units_equal(source["attn"], target["attn"], range(2))
                    return
                assert all(self.engine(second, specs).put("attn", hashes, other["attn"].units(range(2))).ok)
                for backend, expected in ((first, source), (second, other)):
                    target = self.pools(specs, 2, seed=None)
                    assert all(
                        self.engine(backend, specs).get("attn", hashes, target["attn"].units(range(2))).ok
                    )
                    self.assert_units_equal(expected["attn"], target["attn"], range(2))
            finally:
                second.close()
        finally:
            first.close()
