"""The hf3fs stub: availability reporting, and its file-backed mock through the conformance kit."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvstrata.cli import plugin_rows
from kvstrata.plugins.errors import PluginUnavailableError
from kvstrata.plugins.host import PluginHost
from kvstrata.plugins.storage_backend import BufferRegion, StorageBackend, StorageObject
from kvstrata.storage_backends.hf3fs import HF3FSBackend, HF3FSConfig
from kvstrata.testing.conformance import BackendConformance


def open_mock(path: Path, instance: str = "l3", **config: object) -> HF3FSBackend:
    backend = HF3FSBackend(instance, HF3FSConfig(path=path, mock=True, **config))
    backend.open()
    return backend


class TestHF3FSMockConformance(BackendConformance):
    @pytest.fixture
    def backend_factory(self, tmp_path: Path) -> Callable[[str], StorageBackend]:
        return lambda instance: open_mock(tmp_path, instance, file_bytes=1 << 20, slot_bytes=8192)


def test_without_mount_open_refuses_with_the_reason(tmp_path: Path) -> None:
    config = HF3FSConfig(path=tmp_path)
    reason = HF3FSBackend.unavailable_reason(config)
    assert reason is not None and "hf3fs_fuse.io" in reason and "mock: true" in reason
    # and where it comes from: no pip extra brings it (kvstrata[hf3fs] installs nothing)
    assert "ships with a 3FS deployment" in reason and "not on PyPI" in reason
    backend = HF3FSBackend("l3", config)
    with pytest.raises(PluginUnavailableError, match=r"hf3fs_fuse\.io"):
        backend.open()
    assert backend.probe() == reason


def test_plugins_listing_shows_why_unavailable() -> None:
    host = PluginHost()
    try:
        row = next(r for r in plugin_rows(host) if r["name"] == "hf3fs")
    finally:
        host.close()
    assert row["status"] == "unavailable"
    assert "hf3fs_fuse.io" in row["error"]


def test_mock_slot_limit_and_lru_reuse(tmp_path: Path) -> None:
    backend = open_mock(tmp_path, file_bytes=4096 * 2, slot_bytes=4096)
    assert backend.capabilities.max_object_bytes == 4096
    blobs = [bytearray([i]) * 100 for i in range(3)]
    arrays = [(ctypes.c_ubyte * 100).from_buffer(b) for b in blobs]
    objects = [
        StorageObject(f"k{i}", (BufferRegion(ctypes.addressof(a), 100),)) for i, a in enumerate(arrays)
    ]
    assert backend.put(objects[:2]) == [True, True]
    assert backend.exists(["k0"]) == [True]
    assert backend.put(objects[2:]) == [True]  # full: the least recently used slot (k1) is reused
    assert backend.exists(["k0", "k1", "k2"]) == [True, False, True]
    too_big = bytearray(5000)
    big = (ctypes.c_ubyte * 5000).from_buffer(too_big)
    assert backend.put([StorageObject("big", (BufferRegion(ctypes.addressof(big), 5000),))]) == [False]
    out = bytearray(100)
    target = (ctypes.c_ubyte * 100).from_buffer(out)
    assert backend.get([StorageObject("k2", (BufferRegion(ctypes.addressof(target), 100),))]) == [100]
    assert out == blobs[2]
    backend.close()
    assert not backend.data_file.exists()


def test_mock_never_returns_another_keys_bytes_under_concurrency(tmp_path: Path) -> None:
    """Readers race writers that recycle slots (LRU reuse) and removers that free them: a get
    that reports bytes must return the bytes of the key it asked for, never another key's."""
    size = 64 << 10
    backend = open_mock(tmp_path, file_bytes=size * 3, slot_bytes=size)
    keys = [f"key-{i}" for i in range(8)]
    blobs = {key: bytearray([index + 1]) * size for index, key in enumerate(keys)}
    arrays = {key: (ctypes.c_ubyte * size).from_buffer(blob) for key, blob in blobs.items()}
    objects = {key: StorageObject(key, (BufferRegion(ctypes.addressof(arrays[key]), size),)) for key in keys}
    stop = threading.Event()
    wrong: list[tuple[str, int]] = []
    reads = [0]
    errors: list[BaseException] = []

    def writer(offset: int) -> None:
        try:
            index = offset
            while not stop.is_set():
                backend.put([objects[keys[index % len(keys)]]])
                if index % 5 == 0:
                    backend.remove([keys[(index + 3) % len(keys)]])
                index += 1
        except BaseException as exc:
            errors.append(exc)

    def reader(offset: int) -> None:
        try:
            out = bytearray(size)
            target = (ctypes.c_ubyte * size).from_buffer(out)
            region = BufferRegion(ctypes.addressof(target), size)
            index = offset
            while not stop.is_set():
                key = keys[index % len(keys)]
                index += 1
                if backend.get([StorageObject(key, (region,))]) == [size]:
                    reads[0] += 1
                    expected = keys.index(key) + 1
                    if out.count(expected) != size:
                        wrong.append((key, next(b for b in out if b != expected)))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=reader, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 20
    while reads[0] < 3000 and not wrong and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for thread in threads:
        thread.join()
    backend.close()
    assert not errors, errors
    assert reads[0] > 0, "no read ever hit: the test proves nothing"
    assert wrong == [], f"{len(wrong)} reads returned another key's bytes, e.g. {wrong[:3]}"


def test_mock_settings_holding_no_slot_are_refused_at_load(tmp_path: Path) -> None:
    # it opened, and every put failed (file_bytes // slot_bytes == 0)
    with pytest.raises(ValidationError, match=r"file_bytes \(8192\) holds no slot of slot_bytes \(16384\)"):
        HF3FSConfig(path=tmp_path, mock=True, file_bytes=8192, slot_bytes=16384)


def test_mock_open_that_fails_leaves_no_descriptor_or_file(tmp_path: Path) -> None:
    # ftruncate past the filesystem's size limit failed after the data file was created: the fd
    # and the file were left behind (the backend did not hold the fd yet, so close freed nothing)
    backend = HF3FSBackend("l3", HF3FSConfig(path=tmp_path, mock=True, file_bytes=1 << 62, slot_bytes=4096))
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError):
        backend.open()
    assert len(os.listdir("/proc/self/fd")) == fds, "a descriptor leaked"
    assert list(tmp_path.iterdir()) == [], "the data file was left behind"
    backend.config.file_bytes = 1 << 20
    backend.open()  # a later open works
    with pytest.raises(RuntimeError, match="already open"):
        backend.open()  # a second open would have leaked the first descriptor
    backend.close()


def test_the_hf3fs_stub_is_not_listed_available_where_usrbio_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvstrata plugins`` asks ``unavailable_reason()`` without a config. With ``hf3fs_fuse.io``
    importable (a 3FS machine) the stub answers None -- 'available' -- while every real (non-mock)
    config is refused at open with 'hf3fs is a stub'."""
    usrbio = types.ModuleType("hf3fs_fuse.io")
    usrbio.extract_mount_point = lambda path: "/mnt/3fs"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hf3fs_fuse", types.ModuleType("hf3fs_fuse"))
    monkeypatch.setitem(sys.modules, "hf3fs_fuse.io", usrbio)

    assert "stub" in (HF3FSBackend.unavailable_reason(HF3FSConfig(path="/mnt/3fs/kv")) or "")
    listing = HF3FSBackend.unavailable_reason()
    assert listing is not None and "stub" in listing, f"listed as available: {listing!r}"
