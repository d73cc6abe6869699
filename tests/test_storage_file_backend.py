"""The file backend: conformance kit, corruption, second process, restart, capacity."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstrata.plugins.storage_backend import BufferRegion, StorageBackend, StorageObject
from kvstrata.storage_backends.file import FileBackend, FileConfig
from kvstrata.testing.conformance import (
    BackendConformance,
    HostPoolForTests,
    conformance_specs,
    page_hashes,
)


def open_file_backend(path: Path, instance: str = "l3", **config: object) -> FileBackend:
    backend = FileBackend(instance, FileConfig(path=path, **config))
    backend.open()
    return backend


class TestFileConformance(BackendConformance):
    @pytest.fixture
    def backend_factory(self, tmp_path: Path) -> Callable[[str], StorageBackend]:
        return lambda instance: open_file_backend(tmp_path / "store", instance)


def _read_in_child(path: str, model: str, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """Runs in a spawned process: reads the pages the parent wrote and sends their bytes back."""
    kit = BackendConformance()
    backend = open_file_backend(Path(path))
    try:
        specs = conformance_specs()
        engine = kit.engine(backend, specs, model_name=model)
        target = kit.pools(specs, 3, seed=None)
        hashes = page_hashes(3, seed=11)
        ok = {name: engine.get(name, hashes, target[name].units(range(3))).ok for name in specs}
        data = {name: [target[name].unit_bytes(i) for i in range(3)] for name in specs}
        queue.put((ok, data))
    finally:
        backend.close()


def test_second_process_reads_bit_exact(tmp_path: Path) -> None:
    kit = BackendConformance()
    backend = open_file_backend(tmp_path)
    specs = conformance_specs()
    source = kit.pools(specs, 3, seed=11)
    hashes = page_hashes(3, seed=11)
    engine = kit.engine(backend, specs, model_name="proc-model")
    assert all(all(r.ok) for r in engine.put_group({n: _batch(hashes, source[n]) for n in specs}).values())
    backend.close()
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_read_in_child, args=(str(tmp_path), "proc-model", queue))
    child.start()
    ok, data = queue.get(timeout=60)
    child.join(timeout=30)
    assert child.exitcode == 0
    for name in specs:
        assert ok[name] == [True, True, True]
        assert data[name] == [source[name].unit_bytes(i) for i in range(3)]


def _batch(hashes: list[str], pool: HostPoolForTests):  # type: ignore[no-untyped-def]
    from kvstrata.core.storage_engine import PoolBatch

    return PoolBatch(hashes, pool.units(range(len(hashes))))


def test_restart_persistence_and_adoption(tmp_path: Path) -> None:
    kit = BackendConformance()
    specs = conformance_specs()
    source = kit.pools(specs, 4, seed=12)
    hashes = page_hashes(4, seed=12)
    first = open_file_backend(tmp_path)
    assert all(kit.engine(first, specs).put("attn", hashes, source["attn"].units(range(4))).ok)
    written = first.used_bytes
    first.close()
    second = open_file_backend(tmp_path)
    assert second.used_bytes == written > 0  # adopted at open
    target = kit.pools(specs, 4, seed=None)
    assert all(kit.engine(second, specs).get("attn", hashes, target["attn"].units(range(4))).ok)
    kit.assert_units_equal(source["attn"], target["attn"], range(4))
    second.close()


def test_corrupt_file_is_counted_miss(tmp_path: Path) -> None:
    kit = BackendConformance()
    backend = open_file_backend(tmp_path)
    specs = conformance_specs()
    engine = kit.engine(backend, specs)
    source, target = kit.pools(specs, 3, seed=13), kit.pools(specs, 3, seed=None)
    hashes = page_hashes(3, seed=13)
    assert all(engine.put("attn", hashes, source["attn"].units(range(3))).ok)
    keys = engine.object_keys("attn", hashes)
    # flip one payload byte directly on disk (not through the hook), truncate another object
    path = backend.path_for(keys[1][1])  # object "v" of unit 1
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0x01
    path.write_bytes(bytes(raw))
    os.truncate(backend.path_for(keys[0][2]), 10)  # object "k" of unit 2
    result = engine.get("attn", hashes, target["attn"].units(range(3)))
    assert result.ok == [True, False, False]
    assert engine.metrics.corrupt_detected == 2
    assert engine.metrics.corrupt_reasons == {"checksum_mismatch": 1, "short_read": 1}
    kit.assert_units_equal(source["attn"], target["attn"], [0])
    backend.close()


def test_checksum_off_still_rejects_truncation(tmp_path: Path) -> None:
    kit = BackendConformance()
    backend = open_file_backend(tmp_path)
    specs = conformance_specs()
    engine = kit.engine(backend, specs, checksum="none")
    source, target = kit.pools(specs, 2, seed=14), kit.pools(specs, 2, seed=None)
    hashes = page_hashes(2, seed=14)
    assert all(engine.put("index", hashes, source["index"].units(range(2))).ok)
    key = engine.object_keys("index", hashes)[0][1]
    path = backend.path_for(key)
    os.truncate(path, path.stat().st_size - 1)
    assert engine.get("index", hashes, target["index"].units(range(2))).ok == [True, False]
    assert engine.metrics.corrupt_reasons == {"length_mismatch": 1}
    backend.close()


def _raw_object(key: str, data: bytearray) -> StorageObject:
    """An object over ``data``'s memory; the caller keeps ``data`` alive while it is used."""
    import ctypes

    buffer = (ctypes.c_ubyte * len(data)).from_buffer(data)
    return StorageObject(key, (BufferRegion(ctypes.addressof(buffer), len(data)),))


def test_capacity_lru_eviction_tolerates_vanished_files(tmp_path: Path) -> None:
    backend = open_file_backend(tmp_path, capacity_bytes=3000)
    blobs = {f"obj-{i}": bytearray([i]) * 1000 for i in range(5)}
    assert backend.put([_raw_object(k, v) for k, v in list(blobs.items())[:3]]) == [True] * 3
    assert backend.used_bytes == 3000
    assert backend.exists(["obj-0"]) == [True]  # touch obj-0: obj-1 is now the oldest
    backend.path_for("obj-1").unlink()  # another process evicted it meanwhile
    assert backend.put([_raw_object("obj-3", blobs["obj-3"])]) == [True]
    assert backend.put([_raw_object("obj-4", blobs["obj-4"])]) == [True]
    present = backend.exists(list(blobs))
    assert present == [True, False, False, True, True]
    assert backend.used_bytes <= 3000
    huge = bytearray(4000)
    assert backend.put([_raw_object("huge", huge)]) == [False]
    out = bytearray(1000)
    assert backend.get([_raw_object("obj-4", out)]) == [1000]
    assert out == blobs["obj-4"]
    backend.close()


def test_existing_key_not_rewritten_and_temp_files_ignored(tmp_path: Path) -> None:
    backend = open_file_backend(tmp_path)
    first, other = bytearray(b"first"), bytearray(b"other")
    assert backend.put([_raw_object("same", first)]) == [True]
    assert backend.put([_raw_object("same", other)]) == [True]
    out = bytearray(5)
    assert backend.get([_raw_object("same", out)]) == [5]
    assert out == b"first"
    stray = backend.path_for("ghost").with_name(".ghost.tmp-1-deadbeef")
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"partial")
    backend.close()
    reopened = open_file_backend(tmp_path)
    assert reopened.used_bytes == 5  # the temp file is never adopted
    assert reopened.exists(["ghost", "same"]) == [False, True]
    scratch = bytearray(4)
    assert reopened.get([_raw_object("missing", scratch)]) == [-1]
    reopened.close()


def test_unsafe_and_long_keys_map_to_safe_names(tmp_path: Path) -> None:
    backend = open_file_backend(tmp_path)
    for key in ("../escape", "a" * 300, ".hidden"):
        path = backend.path_for(key)
        assert path.resolve().is_relative_to(tmp_path.resolve())
        assert len(path.name) <= 200 and not path.name.startswith(".")
        payload = bytearray(b"x")
        assert backend.put([_raw_object(key, payload)]) == [True]
        assert backend.exists([key]) == [True]
    backend.close()


def test_config_rejects_unknown_fields(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="capacity"):
        FileConfig(path=tmp_path, capacity=10)  # type: ignore[call-arg]
