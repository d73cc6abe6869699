"""The storage engine over a real file backend, with fault injection where a test needs faults."""

from __future__ import annotations

import multiprocessing
import resource
import shutil
import signal
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvstrata.core.config import ParallelConfig
from kvstrata.core.integrity import layout_fingerprint
from kvstrata.core.io_plan import IOMode, plan_backend
from kvstrata.core.storage_engine import (
    PoolBatch,
    StorageEngine,
    longest_present_prefix,
    read_order,
    write_order,
)
from kvstrata.plugins.storage_backend import ANY_POOL, BackendCapabilities, PoolCapabilities, StorageObject
from kvstrata.storage_backends.file import FileBackend, FileConfig
from kvstrata.testing.conformance import BackendConformance, conformance_specs, page_hashes


class FaultyFileBackend(FileBackend):
    """FAULT INJECTION: a real file backend that can raise, lie about result counts, fail chosen
    keys, and records the order of put calls."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.raise_on: set[str] = set()
        self.short_results = False
        self.fail_keys: set[str] = set()
        self.put_log: list[list[str]] = []

    def _maybe_fail(self, operation: str) -> None:
        if operation in self.raise_on:
            raise ConnectionError(f"injected {operation} failure")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._maybe_fail("exists")
        return super().exists(keys)

    def put(self, objects: Sequence[StorageObject]) -> list[bool]:
        self._maybe_fail("put")
        self.put_log.append([o.key for o in objects])
        keep = [o for o in objects if o.key not in self.fail_keys]
        stored = dict(zip([o.key for o in keep], super().put(keep), strict=True))
        result = [stored.get(o.key, False) for o in objects]
        return result[:-1] if self.short_results else result

    def get(self, objects: Sequence[StorageObject]) -> list[int]:
        self._maybe_fail("get")
        return super().get(objects)


@pytest.fixture
def faulty(tmp_path: Path) -> FaultyFileBackend:
    # no circuit breaker: these tests count what every failing call does (the breaker has its own)
    backend = FaultyFileBackend("faulty", FileConfig(path=tmp_path, circuit_breaker={"failures": 0}))
    backend.open()
    yield backend
    backend.close()


KIT = BackendConformance()


def test_backend_exceptions_become_failed_results(faulty: FaultyFileBackend) -> None:
    specs = conformance_specs()
    engine = KIT.engine(faulty, specs)
    source = KIT.pools(specs, 2, seed=1)
    hashes = page_hashes(2, seed=1)
    faulty.raise_on = {"exists", "put", "get"}
    put = engine.put("attn", hashes, source["attn"].units(range(2)))
    assert put.ok == [False, False] and "injected put failure" in (put.error or "")
    assert engine.exists("attn", hashes).ok == [False, False]
    assert engine.get("attn", hashes, source["attn"].units(range(2))).ok == [False, False]
    assert engine.metrics.backend_errors == 3
    faulty.raise_on = set()
    faulty.short_results = True
    result = engine.put("attn", hashes, source["attn"].units(range(2)))
    assert result.ok == [False, False] and "results for" in (result.error or "")
    faulty.short_results = False
    assert all(engine.put("attn", hashes, source["attn"].units(range(2))).ok)  # recovered


def test_anchor_written_last_and_only_over_complete_pages(faulty: FaultyFileBackend) -> None:
    specs = conformance_specs()
    engine = KIT.engine(faulty, specs)
    source = KIT.pools(specs, 3, seed=2)
    hashes = page_hashes(3, seed=2)
    faulty.fail_keys = {engine.object_keys("index", hashes)[0][1]}  # sidecar of page 1 fails
    results = engine.put_group({name: PoolBatch(hashes, source[name].units(range(3))) for name in specs})
    order = [log[0].split(".")[1].rsplit("-", 1)[0] for log in faulty.put_log]  # less the layout tag
    assert order == ["conf_idx-index", "conf_state-state", "conf_kv-attn"]
    assert results["index"].ok == [True, False, True]
    assert results["attn"].ok == [True, False, True]
    assert engine.exists("attn", hashes).ok == [True, False, True]  # no anchor without its sidecar
    faulty.put_log.clear()
    target = KIT.pools(specs, 3, seed=None)
    got = engine.get_group({name: PoolBatch(hashes, target[name].units(range(3))) for name in specs})
    assert got["attn"].ok == [True, False, True]
    assert got["state"].ok == [True, False, True]  # only pages the anchor delivered are read
    for name in specs:
        KIT.assert_units_equal(source[name], target[name], [0, 2])


def test_copy_and_zero_copy_paths_store_identical_objects(tmp_path: Path) -> None:
    specs = conformance_specs()
    zero = FileBackend("a", FileConfig(path=tmp_path))
    zero.open()
    copy = FileBackend("a", FileConfig(path=tmp_path))
    copy.capabilities = BackendCapabilities(pools={ANY_POOL: PoolCapabilities()}, multi_buffer_objects=True)
    copy.open()
    zero_engine, copy_engine = KIT.engine(zero, specs), KIT.engine(copy, specs)
    assert zero_engine.plans["attn"].mode is IOMode.ZERO_COPY
    assert copy_engine.plans["attn"].mode is IOMode.COPY
    source = KIT.pools(specs, 4, seed=3)
    hashes = page_hashes(4, seed=3)
    assert all(copy_engine.put("attn", hashes[:2], source["attn"].units(range(2))).ok)
    assert all(zero_engine.put("attn", hashes[2:], source["attn"].units(range(2, 4))).ok)
    for engine in (zero_engine, copy_engine):
        target = KIT.pools(specs, 4, seed=None)
        assert all(engine.get("attn", hashes, target["attn"].units(range(4))).ok)
        KIT.assert_units_equal(source["attn"], target["attn"], range(4))
    zero.close()
    copy.close()


def test_read_only_plan_skips_writes_but_reads(tmp_path: Path) -> None:
    from kvstrata.plugins.pool_type import Replication

    specs = {"attn": conformance_specs()["attn"].model_copy(update={"replication": Replication.REPLICATED})}
    backend = FileBackend("b", FileConfig(path=tmp_path))
    backend.open()
    engines = {}
    for rank in (0, 1):
        parallel = ParallelConfig(tp_rank=rank, tp_size=2)
        plans = plan_backend("b", backend.capabilities, specs.values(), parallel=parallel)
        engines[rank] = StorageEngine(backend, specs, plans, model_name="m", parallel=parallel)
    source = KIT.pools(specs, 2, seed=4)
    hashes = page_hashes(2, seed=4)
    skipped = engines[1].put("attn", hashes, source["attn"].units(range(2)))
    assert skipped.skipped and skipped.ok == [False, False]
    assert engines[1].exists("attn", hashes).ok == [False, False]
    assert all(engines[0].put("attn", hashes, source["attn"].units(range(2))).ok)
    target = KIT.pools(specs, 2, seed=None)
    assert all(engines[1].get("attn", hashes, target["attn"].units(range(2))).ok)
    KIT.assert_units_equal(source["attn"], target["attn"], range(2))
    backend.close()


def test_mismatched_regions_are_refused_with_a_clear_error(faulty: FaultyFileBackend) -> None:
    specs = conformance_specs()
    engine = KIT.engine(faulty, specs)
    source = KIT.pools(specs, 2, seed=5)
    hashes = page_hashes(2, seed=5)
    with pytest.raises(ValueError, match="1 units of regions for 2 pages"):
        engine.put("attn", hashes, source["attn"].units([0]))
    units = source["attn"].units(range(2))
    units[1][0] = units[1][0][:1]
    with pytest.raises(ValueError, match="object 0: regions hold"):
        engine.put("attn", hashes, units)


def test_order_helpers() -> None:
    specs = list(conformance_specs().values())
    assert [s.name for s in write_order(specs)] == ["index", "state", "attn"]
    assert read_order(specs)[0].name == "attn"
    assert longest_present_prefix([True, True, False, True]) == 2
    assert longest_present_prefix([]) == 0


def test_batch_hooks_fire_and_observer_failures_are_contained(
    faulty: FaultyFileBackend, kvstrata_bare_host
) -> None:  # type: ignore[no-untyped-def]
    import kvstrata

    events: list[tuple] = []  # type: ignore[type-arg]

    class Observer:
        @kvstrata.hookimpl
        def kvstrata_pages_stored(self, instance: str, pool: str, pages: int, nbytes: int) -> None:
            events.append(("stored", instance, pool, pages, nbytes))
            raise RuntimeError("a broken observer")

        @kvstrata.hookimpl
        def kvstrata_operation_failed(self, operation: str, instance: str, error: BaseException) -> None:
            events.append(("failed", operation, instance, type(error).__name__))

    kvstrata_bare_host.register_plugin(Observer())
    specs = conformance_specs()
    parallel = ParallelConfig()
    plans = plan_backend("faulty", faulty.capabilities, specs.values(), parallel=parallel)
    engine = StorageEngine(
        faulty, specs, plans, model_name="m", parallel=parallel, notify=kvstrata_bare_host.notify
    )
    source = KIT.pools(specs, 2, seed=6)
    hashes = page_hashes(2, seed=6)
    assert all(engine.put("index", hashes, source["index"].units(range(2))).ok)
    faulty.raise_on = {"get"}
    assert engine.get("index", hashes, source["index"].units(range(2))).ok == [False, False]
    unit_bytes = 64 + specs["index"].object_bytes("idx")
    assert events == [
        ("stored", "faulty", "index", 2, 2 * unit_bytes),
        ("failed", "get", "faulty", "ConnectionError"),
    ]


# --- integrity bypass: a header downgraded to "no checksum" (issue 15, defect 3) ---------------------


def test_header_downgrade_with_changed_payload_is_a_counted_miss(tmp_path: Path) -> None:
    """Rewrite a stored header to declare no checksum, then change payload bytes: the reader's
    policy is a checksum, so the object is refused and counted as corrupt, never served."""
    backend = FileBackend("l3", FileConfig(path=tmp_path))
    backend.open()
    specs = conformance_specs()
    engine = KIT.engine(backend, specs)
    source, target = KIT.pools(specs, 3, seed=31), KIT.pools(specs, 3, seed=None)
    hashes = page_hashes(3, seed=31)
    assert all(engine.put("state", hashes, source["state"].units(range(3))).ok)
    path = backend.path_for(engine.object_keys("state", hashes)[0][1])
    raw = bytearray(path.read_bytes())
    raw[6:8] = bytes(2)  # checksum kind: none
    raw[40:48] = bytes(8)  # checksum value
    raw[64 + 17] ^= 0x5A  # a payload byte
    path.write_bytes(bytes(raw))
    result = engine.get("state", hashes, target["state"].units(range(3)))
    assert result.ok == [True, False, True]
    assert engine.metrics.corrupt_detected == 1
    assert engine.metrics.corrupt_reasons == {"checksum_missing": 1}
    assert engine.metrics.foreign_objects == 0
    KIT.assert_units_equal(source["state"], target["state"], [0, 2])
    assert not path.exists(), "the forged object is removed like any damaged one"
    backend.close()


# --- layout change under the same model name (issue 15, defect 5; issue 25 item 12) -----------------


def test_a_layout_change_gets_its_own_keys_and_leaves_the_other_layouts_objects_alone(tmp_path: Path) -> None:
    """The layout is in every key: an fp32 and a bf16 deployment of one model share an L3
    without reading (or removing) each other's objects. Before, they shared keys; each read
    the other's objects as foreign and removed them."""
    backend = FileBackend("l3", FileConfig(path=tmp_path))
    backend.open()
    old_specs, new_specs = conformance_specs(), conformance_specs(dtype="bfloat16")
    hashes = page_hashes(2, seed=32)
    old_source = KIT.pools(old_specs, 2, seed=32)
    old_attn = KIT.engine(backend, old_specs, model_name="same")
    assert all(old_attn.put("attn", hashes, old_source["attn"].units(range(2))).ok)
    engine = KIT.engine(backend, new_specs, model_name="same")  # the attn pool changed dtype
    assert engine.object_keys("attn", hashes) != old_attn.object_keys("attn", hashes)
    assert engine.object_keys("index", hashes) == old_attn.object_keys("index", hashes)  # unchanged pool
    source, target = KIT.pools(new_specs, 2, seed=33), KIT.pools(new_specs, 2, seed=None)
    assert engine.exists("attn", hashes).ok == [False, False]
    assert engine.get("attn", hashes, target["attn"].units(range(2))).ok == [False, False]
    assert all(engine.put("attn", hashes, source["attn"].units(range(2))).ok)
    assert all(engine.get("attn", hashes, target["attn"].units(range(2))).ok)
    KIT.assert_units_equal(source["attn"], target["attn"], range(2))
    assert engine.metrics.foreign_objects == 0 and engine.metrics.corrupt_detected == 0
    old_target = KIT.pools(old_specs, 2, seed=None)
    assert all(old_attn.get("attn", hashes, old_target["attn"].units(range(2))).ok)
    KIT.assert_units_equal(old_source["attn"], old_target["attn"], range(2))
    backend.close()


def foreign_objects_under_our_keys(backend: FileBackend, seed: int) -> tuple[StorageEngine, list, list[str]]:
    """Opens ``backend``; two pages of "attn" stored in one layout (float32), each object copied
    under the key the same model gives it in another (bfloat16): (the bfloat16 engine, its
    specs, the page hashes). What reaches the header check as foreign."""
    backend.open()
    old_specs, new_specs = conformance_specs(), conformance_specs(dtype="bfloat16")
    hashes = page_hashes(2, seed=seed)
    old_attn = KIT.engine(backend, old_specs, model_name="same")
    assert all(old_attn.put("attn", hashes, KIT.pools(old_specs, 2, seed=seed)["attn"].units(range(2))).ok)
    engine = KIT.engine(backend, new_specs, model_name="same")
    for old_keys, new_keys in zip(
        old_attn.object_keys("attn", hashes), engine.object_keys("attn", hashes), strict=True
    ):
        for old_key, new_key in zip(old_keys, new_keys, strict=True):
            backend.path_for(new_key).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(backend.path_for(old_key), backend.path_for(new_key))
    return engine, new_specs, hashes


@pytest.mark.parametrize("keep_foreign", [False, True], ids=["removed", "kept-by-a-reader"])
def test_an_object_of_another_layout_under_this_key_is_foreign_and_removed(
    tmp_path: Path, keep_foreign: bool
) -> None:
    """What still reaches the header check (a copied or crafted object): counted apart from
    damage, and removed so the page can be stored again -- unless the engine keeps foreign
    objects (a read-only reader of a shared store: they are another writer's), which misses
    them and leaves them, while a damaged object is removed either way."""
    backend = FileBackend("l3", FileConfig(path=tmp_path))
    engine, new_specs, hashes = foreign_objects_under_our_keys(backend, seed=34)
    target = KIT.pools(new_specs, 2, seed=None)
    engine.keep_foreign = keep_foreign
    assert engine.get("attn", hashes, target["attn"].units(range(2))).ok == [False, False]
    metrics = engine.metrics
    assert metrics.foreign_objects == 4 and set(metrics.foreign_reasons) <= {
        "fingerprint_mismatch",
        "key_mismatch",
    }
    if keep_foreign:
        assert metrics.foreign_removed == 0 and metrics.corrupt_detected == 0
        assert engine.exists("attn", hashes).ok == [True, True], "another writer's objects stay"
        own = page_hashes(3, seed=36)[2:]
        assert all(engine.put("attn", own, KIT.pools(new_specs, 1, seed=36)["attn"].units(range(1))).ok)
        ((key,), *_) = engine.object_keys("attn", own)  # per object of the unit: its keys
        data = bytearray(backend.path_for(key).read_bytes())
        data[-1] ^= 0xFF  # a damaged object of this layout: useless to every reader
        backend.path_for(key).write_bytes(bytes(data))
        assert engine.get("attn", own, target["attn"].units(range(1))).ok == [False]
        assert metrics.corrupt_detected == 1 and metrics.corrupt_removed == 1
        assert engine.exists("attn", own).ok == [False], "removed all the same"
        backend.close()
        return
    assert metrics.foreign_removed == 4 and metrics.corrupt_detected == 0
    assert engine.exists("attn", hashes).ok == [False, False], "the foreign objects are gone"
    source = KIT.pools(new_specs, 2, seed=35)
    assert all(engine.put("attn", hashes, source["attn"].units(range(2))).ok)
    assert all(engine.get("attn", hashes, target["attn"].units(range(2))).ok)
    KIT.assert_units_equal(source["attn"], target["attn"], range(2))
    backend.close()


class CountingFileBackend(FileBackend):
    """Counts its ``get`` calls."""

    gets = 0

    def get(self, objects: Sequence[StorageObject], check: object = None) -> list[int]:
        self.gets += 1
        return super().get(objects, check)  # type: ignore[arg-type]


def test_a_reader_keeping_foreign_objects_reads_them_once_per_get(tmp_path: Path) -> None:
    """The second read of a rejected object (``core/storage_reread.py``) is there to spare a
    fresh object its removal; a reader that keeps foreign objects removes none, and read twice at
    every get, another writer's objects doubled its reads for as long as they stayed."""
    backend = CountingFileBackend("l3", FileConfig(path=tmp_path))
    engine, new_specs, hashes = foreign_objects_under_our_keys(backend, seed=37)
    engine.keep_foreign = True
    target = KIT.pools(new_specs, 2, seed=None)
    for _ in range(2):
        backend.gets = 0
        assert engine.get("attn", hashes, target["attn"].units(range(2))).ok == [False, False]
        assert backend.gets == 1, "kept foreign objects are not read again"
    assert engine.metrics.foreign_objects == 8 and engine.metrics.reread_cleared == 0
    assert engine.metrics.foreign_removed == 0 and engine.exists("attn", hashes).ok == [True, True]
    backend.close()


# --- per-object put failures are failures (issue 15, defect 4) ---------------------------------------


def _put_under_file_size_limit(path: str, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """Child process: RLIMIT_FSIZE caps every file at 300 bytes, a real filesystem refusal (EFBIG).
    ``index`` objects are 256 bytes and fit; ``attn`` (320) and ``state`` (384) do not."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed by the signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))
    backend = FileBackend("l3", FileConfig(path=path))
    backend.open()
    specs = conformance_specs()
    engine = KIT.engine(backend, specs)
    source = KIT.pools(specs, 3, seed=34)
    hashes = page_hashes(3, seed=34)
    fits = engine.put("index", hashes, source["index"].units(range(3)))
    group = engine.put_group({name: PoolBatch(hashes, source[name].units(range(3))) for name in specs})
    queue.put(
        {
            "fits": (fits.ok, fits.failed, fits.error),
            "group": {name: (r.ok, r.failed, r.error) for name, r in group.items()},
            "put_failed": engine.metrics.put_failed,
            "put_units": engine.metrics.put_units,
        }
    )
    backend.close()


def test_discard_removes_every_object_of_its_units_where_the_backend_removes(tmp_path: Path) -> None:
    """Objects no reader asks for again (a finished vLLM request's own state checkpoints) are
    removed, each unit's objects all (the anchor pool stores two per unit); a backend that
    cannot remove answers skipped and removes nothing."""
    from kvstrata.storage_backends.memory import MemoryConfig
    from test_testing_kits import KeepForeverBackend

    backend = FileBackend("b", FileConfig(path=tmp_path))
    backend.open()
    engine = KIT.engine(backend)
    hashes = page_hashes(3, seed=41)
    source = KIT.pools(conformance_specs(), 3, seed=41)
    assert all(engine.put("attn", hashes, source["attn"].units(range(3))).ok)
    stored = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    gone = engine.discard("attn", hashes[:2])
    assert gone.ok == [True, True] and not gone.skipped and gone.failed == 0
    assert engine.exists("attn", hashes).ok == [False, False, True]
    left = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert len(stored) - len(left) == 4, "both objects of each discarded unit"
    assert engine.discard("attn", hashes[:2]).ok == [True, True], "absent already: gone"
    backend.close()

    keeper = KeepForeverBackend("k", MemoryConfig())
    keeper.open()
    kept = KIT.engine(keeper)
    assert all(kept.put("attn", hashes, source["attn"].units(range(3))).ok)
    refused = kept.discard("attn", hashes)
    assert refused.skipped and refused.ok == [False] * 3 and "does not remove" in (refused.error or "")
    assert kept.exists("attn", hashes).ok == [True] * 3
    keeper.close()


def test_refused_writes_are_counted_failures(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_put_under_file_size_limit, args=(str(tmp_path), queue))
    child.start()
    report = queue.get(timeout=120)
    child.join(timeout=30)
    assert child.exitcode == 0
    assert report["fits"] == ([True] * 3, 0, None)
    index_ok, index_failed, _ = report["group"]["index"]
    state_ok, state_failed, state_error = report["group"]["state"]
    attn_ok, attn_failed, _ = report["group"]["attn"]
    assert index_ok == [True] * 3 and index_failed == 0
    assert state_ok == [False] * 3 and state_failed == 3
    assert "3 of 3 units not stored" in state_error and "'l3'" in state_error
    # the anchor is not attempted over pages whose component failed: not stored, not a failure
    assert attn_ok == [False] * 3 and attn_failed == 0
    assert report["put_failed"] == 3 and report["put_units"] == 9
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and ".tmp-" in p.name]
    assert leftovers == [], "a refused write leaves no temp file"


def test_layer_ids_are_in_the_layout_and_the_default_numbering_keeps_earlier_keys() -> None:
    """A pool holding model layers 4..7 stores other state than one holding 0..3 (one model name
    reused with another layer split was served the first split's bytes); naming the default
    numbering explicitly changes nothing, so every fingerprint written before stays valid."""
    spec = conformance_specs()["attn"]
    layers = spec.buffers[0].layers
    default = layout_fingerprint(spec, spec.objects[0].suffix)
    explicit = spec.model_copy(update={"layer_ids": tuple(range(layers))})
    shifted = spec.model_copy(update={"layer_ids": tuple(range(layers, 2 * layers))})
    assert layout_fingerprint(explicit, spec.objects[0].suffix) == default
    assert layout_fingerprint(shifted, spec.objects[0].suffix) != default
