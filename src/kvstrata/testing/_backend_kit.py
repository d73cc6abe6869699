"""The storage-backend kit's shared parts: a small hybrid stack of specs, host pools to read and
write, page hashes, and :class:`BackendKit` (fixtures and helpers every conformance mixin uses)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import pytest
import torch

from kvstrata.core.buffers import region_tensor
from kvstrata.core.config import ParallelConfig
from kvstrata.core.io_plan import IOMode, plan_backend
from kvstrata.core.keys import hash_pages, namespace_root
from kvstrata.core.storage_batch import BatchResult
from kvstrata.core.storage_engine import StorageEngine
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
from kvstrata.plugins.storage_backend import BufferRegion, StorageBackend

PAGE_SIZE = 4

#: what the pages a get misses hold before it (and must hold after it): not zeros, so a backend
#: that zero-fills the regions of a key it does not hold is caught
MISS_FILL = 0x5A


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
    """A layer-first host pool: one uint8 allocation (as a host tier's, registered whole for
    zero-copy I/O) cut into a tensor per buffer; one object = one region per layer."""

    def __init__(
        self,
        spec: PoolSpec,
        units: int,
        seed: int | None = None,
        allocate: Callable[[int], BufferRegion] | None = None,
    ) -> None:
        """``allocate``: where the memory comes from (a backend's ``allocate_host_memory``, as
        the core takes it for ``host_allocator`` backends); default: this process's heap."""
        self.spec = spec
        sizes = {b.name: b.layers * units * b.bytes_per_unit_per_layer for b in spec.buffers}
        total = sum(sizes.values())
        if allocate is None or not total:
            self.backing = torch.zeros(total, dtype=torch.uint8)
        else:
            region = allocate(total)
            assert region.nbytes >= total, (
                f"allocate_host_memory({total}) returned a region of {region.nbytes} bytes"
            )
            self.backing = region_tensor(region)[:total]
            self.backing.zero_()
        self.tensors = {}
        offset = 0
        for b in spec.buffers:
            part = self.backing[offset : offset + sizes[b.name]]
            self.tensors[b.name] = part.view(b.layers, units, b.bytes_per_unit_per_layer)
            offset += sizes[b.name]
        if seed is not None:
            generator = torch.Generator().manual_seed(seed)
            for tensor in self.tensors.values():
                tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8, generator=generator))

    def region(self) -> BufferRegion | None:
        """The whole allocation (None for a pool without buffers)."""
        if not self.backing.numel():
            return None
        return BufferRegion(self.backing.data_ptr(), self.backing.numel())

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

    def scribble(self) -> None:
        """Overwrite every byte in place (the same addresses): what a host tier does to a slot
        once its pages are stored and the slot goes to other pages. A backend that kept
        references to it instead of the bytes then serves what was never stored."""
        self.backing.copy_(torch.randint(0, 256, self.backing.shape, dtype=torch.uint8))


def page_hashes(count: int, model: str = "conformance", seed: int = 0) -> list[str]:
    tokens = torch.arange(seed * 1000, seed * 1000 + count * PAGE_SIZE, dtype=torch.int64)
    return hash_pages(tokens, PAGE_SIZE, namespace_root(model))


def answers(result: BatchResult) -> str:
    """A batch's per-key answers, and the error that failed the call when one did (a backend
    that raised reads "[False, False]" otherwise, as if it had missed every key)."""
    return f"{result.ok}" + (f", the call failed: {result.error}" if result.error else "")


class BackendKit:
    """Fixtures and helpers of the backend conformance mixins; subclass a mixin, not this."""

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
        host_memory_from_backend: bool = False,
    ) -> StorageEngine:
        specs = specs or conformance_specs()
        parallel = ParallelConfig()
        caps = backend.instance_capabilities()
        plans = plan_backend(
            backend.instance,
            caps,
            specs.values(),
            parallel=parallel,
            host_memory_from_backend=host_memory_from_backend,
        )
        return StorageEngine(
            backend,
            specs,
            plans,
            model_name=model_name or self.model_name,
            parallel=parallel,
            checksum=checksum,
        )

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

    @staticmethod
    def register(backend: StorageBackend, engine: StorageEngine, pools: dict[str, HostPoolForTests]) -> None:
        """Register each pool's memory for its zero-copy plan, one call per pool, as the core's
        builder does with its host tiers (backend-allocated host memory is registered already)."""
        if backend.instance_capabilities().host_allocator:
            return
        for name, pool in pools.items():
            region = pool.region()
            if region is not None and engine.plans[name].mode is IOMode.ZERO_COPY:
                backend.register_host_memory(region)

    def corrupt(self, backend: StorageBackend, key: str, mode: Literal["flip", "truncate"]) -> bool:
        hook = getattr(backend, "corrupt_for_test", None)
        if hook is None:
            pytest.fail(
                f"backend {backend.name!r} offers no corrupt_for_test hook: implement "
                "corrupt_for_test(key, mode, offset=-1) -> bool on the backend, or override corrupt() in "
                "the test class, for IntegrityConformance and RemovalConformance's damage checks",
                pytrace=False,
            )
        done = hook(key, mode)
        if not isinstance(done, bool):  # a hook that damaged the object but returned nothing
            pytest.fail(
                f"backend {backend.name!r}: corrupt_for_test returned {done!r}; it must return True "
                "once it damaged the object (False: no such object)",
                pytrace=False,
            )
        return done

    @staticmethod
    def pools(specs: dict[str, PoolSpec], units: int, seed: int | None) -> dict[str, HostPoolForTests]:
        return {
            name: HostPoolForTests(spec, units, None if seed is None else seed + i)
            for i, (name, spec) in enumerate(specs.items())
        }

    def assert_units_equal(self, a: HostPoolForTests, b: HostPoolForTests, units: Sequence[int]) -> None:
        for unit in units:
            assert a.unit_bytes(unit) == b.unit_bytes(unit), f"pool {a.spec.name!r} unit {unit} differs"

    @staticmethod
    def put_then_scribble(pools: dict[str, HostPoolForTests], units: Sequence[int]) -> dict[str, list[bytes]]:
        """The bytes of ``units`` per pool; then every pool is overwritten (``scribble``)."""
        stored = {name: [pool.unit_bytes(u) for u in units] for name, pool in pools.items()}
        for pool in pools.values():
            pool.scribble()
        return stored

    @staticmethod
    def assert_read_right_first_time(backend: StorageBackend, engine: StorageEngine) -> None:
        """No object was refused, and none was refused once then accepted when read again alone:
        the engine reads a refused object a second time (a concurrent writer may have torn it),
        which hid a backend that mixes up the objects of one batch -- e.g. writing each found
        object into the regions of the one before it when a key in the batch is missing."""
        metrics = engine.metrics
        assert metrics.corrupt_detected == 0, (
            f"backend {backend.name!r}: {metrics.corrupt_detected} objects read back damaged "
            f"({metrics.corrupt_reasons}), with nothing damaging them"
        )
        assert metrics.reread_cleared == 0, (
            f"backend {backend.name!r}: {metrics.reread_cleared} objects of a batch read back wrong "
            "and right when read again on their own: get() must read each object of a batch into "
            "its own regions whatever else the batch holds (misses, other sizes), with no writer "
            "around"
        )

    @staticmethod
    def assert_units_are(pool: HostPoolForTests, stored: Sequence[bytes], units: Sequence[int]) -> None:
        for unit, expected in zip(units, stored, strict=True):
            assert pool.unit_bytes(unit) == expected, (
                f"pool {pool.spec.name!r} unit {unit}: not the bytes put stored (a backend must copy "
                "them before put returns: the caller reuses that memory at once)"
            )

    # --- tests --------------------------------------------------------------------------------------
