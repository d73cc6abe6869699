"""The file backend's in-memory index: what ``exists`` answers without a syscall, and why it stays
right -- rebuilt at open, kept by put / evict / remove, and never hiding what another process wrote.

OBSERVATION INJECTION where a test counts syscalls: ``os.stat`` inside the backend module is
wrapped (the real call still runs), since "answered from memory" is otherwise invisible.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest

import kvstrata.storage_backends._file_io as file_io
import kvstrata.storage_backends.file as file_module
from kvstrata.plugins.storage_backend import OBJECT_MAGIC, BufferRegion, StorageObject
from kvstrata.storage_backends._file_removals import REMOVALS_FILE
from kvstrata.storage_backends.file import FileBackend, FileConfig
from kvstrata.testing.conformance import BackendConformance, conformance_specs, page_hashes
from storage_objects import Blobs


def open_backend(path: Path, **config: object) -> FileBackend:
    backend = FileBackend("l3", FileConfig(path=path, **config))
    backend.open()
    return backend


@pytest.fixture
def stat_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths the backend stat-ed (the real os.stat still runs)."""
    calls: list[str] = []
    real_stat = os.stat

    def counting_stat(path: str, *args: object, **kwargs: object) -> os.stat_result:
        calls.append(os.fspath(path))
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(file_module.os, "stat", counting_stat)
    return calls


def test_exists_answers_known_objects_from_memory(tmp_path: Path, stat_calls: list[str]) -> None:
    backend = open_backend(tmp_path)
    blobs = Blobs()
    assert backend.put([blobs.obj(f"obj-{i}", bytes([i]) * 100) for i in range(20)]) == [True] * 20
    stat_calls.clear()
    assert backend.exists([f"obj-{i}" for i in range(20)]) == [True] * 20
    removals = str(tmp_path / REMOVALS_FILE)  # one stat per call: did another process remove any?
    assert stat_calls == [removals], "objects this process wrote are answered without a syscall each"
    stat_calls.clear()
    assert backend.exists(["obj-3", "never-written"]) == [True, False]
    assert stat_calls == [removals, str(backend.path_for("never-written"))], "an unknown key: on disk"
    backend.close()


def test_index_is_rebuilt_at_open(tmp_path: Path, stat_calls: list[str]) -> None:
    first = open_backend(tmp_path)
    blobs = Blobs()
    keys = [f"persisted-{i}" for i in range(12)] + ["../unsafe key"]  # the last one: a digest name
    assert first.put([blobs.obj(key, b"x" * 50) for key in keys]) == [True] * len(keys)
    first.close()
    second = open_backend(tmp_path)
    stat_calls.clear()
    assert second.exists(keys) == [True] * len(keys)
    assert stat_calls == [str(tmp_path / REMOVALS_FILE)], "the objects found at open: from the index"
    assert second.used_bytes == len(keys) * (len(OBJECT_MAGIC) + 50)
    second.close()


def test_remove_and_eviction_keep_the_index_right(tmp_path: Path) -> None:
    backend = open_backend(tmp_path, capacity_bytes=3 * 104)
    blobs = Blobs()
    assert backend.put([blobs.obj(f"obj-{i}", bytes(100)) for i in range(3)]) == [True] * 3
    assert backend.remove(["obj-1"]) == [True]
    assert backend.exists(["obj-0", "obj-1", "obj-2"]) == [True, False, True]
    assert backend.put([blobs.obj("obj-3", bytes(100)), blobs.obj("obj-4", bytes(100))]) == [True, True]
    # obj-0 was the least recently used: evicted to make room, and no longer reported
    assert backend.exists([f"obj-{i}" for i in range(5)]) == [False, False, True, True, True]
    assert not backend.path_for("obj-0").exists()
    assert backend.used_bytes == 3 * 104
    backend.close()


def _write_in_child(path: str, keys: list[str]) -> None:
    """Runs in a spawned process: another instance writing into the same directory."""
    backend = open_backend(Path(path))
    blobs = Blobs()
    assert backend.put([blobs.obj(key, b"from the other process") for key in keys]) == [True] * len(keys)
    backend.close()


def _remove_in_child(path: str, keys: list[str]) -> None:
    backend = open_backend(Path(path))
    assert backend.remove(keys) == [True] * len(keys)
    backend.close()


def _in_child(target: object, *args: object) -> None:
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=target, args=args)
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0


def test_objects_another_process_writes_after_open_are_seen(tmp_path: Path) -> None:
    """The backend is shared across instances: a key missing from this process's index is
    checked on disk, so what another process wrote is never hidden."""
    backend = open_backend(tmp_path)
    keys = [f"theirs-{i}" for i in range(20)]
    assert backend.exists(keys) == [False] * 20
    _in_child(_write_in_child, str(tmp_path), keys)
    assert backend.exists(keys) == [True] * 20
    out = bytearray(len(OBJECT_MAGIC) + 22)
    view = (ctypes.c_ubyte * len(out)).from_buffer(out)
    assert backend.get([StorageObject(keys[0], (BufferRegion(ctypes.addressof(view), len(out)),))]) == [
        len(out)
    ]
    assert bytes(out) == OBJECT_MAGIC + b"from the other process"
    assert backend.used_bytes == 20 * len(out), "adopted into this process's accounting"
    backend.close()


def test_objects_another_process_removed_are_rechecked(tmp_path: Path) -> None:
    """A positive answer from memory is trusted for ``exists_recheck_s`` at most; a get or put of
    an object that vanished meanwhile corrects the index at once."""
    blobs = Blobs()
    strict = open_backend(tmp_path / "strict", exists_recheck_s=0)
    lenient = open_backend(tmp_path / "lenient", exists_recheck_s=0.2)
    for backend in (strict, lenient):
        assert backend.put([blobs.obj(f"k-{i}", b"data") for i in range(3)]) == [True] * 3
        _in_child(_remove_in_child, str(backend.root), ["k-0", "k-1", "k-2"])
    assert strict.exists(["k-0", "k-1"]) == [False, False], "recheck 0: every key on disk"
    time.sleep(0.25)  # past the recheck window (no timing is asserted)
    assert lenient.exists(["k-0"]) == [False], "seen too long ago: checked on disk again"
    # a get that misses forgets the object: exists no longer answers it from memory
    scratch = bytearray(8)
    view = (ctypes.c_ubyte * 8).from_buffer(scratch)
    assert lenient.get([StorageObject("k-1", (BufferRegion(ctypes.addressof(view), 8),))]) == [-1]
    assert lenient.exists(["k-1"]) == [False]
    # a put of a key the index held but another process removed writes it again
    assert lenient.put([blobs.obj("k-2", b"data")]) == [True]
    assert lenient.path_for("k-2").exists()
    assert lenient.used_bytes == len(OBJECT_MAGIC) + 4
    for backend in (strict, lenient):
        backend.close()


def _evict_in_child(path: str, keys: list[str]) -> None:
    """Another instance with a capacity of three objects: storing ``keys`` evicts the three it
    found at open."""
    backend = open_backend(Path(path), capacity_bytes=3 * (len(OBJECT_MAGIC) + 100))
    blobs = Blobs()
    assert backend.put([blobs.obj(key, bytes(100)) for key in keys]) == [True] * len(keys)
    backend.close()


def test_what_another_process_evicts_is_no_longer_answered_from_memory(
    tmp_path: Path, stat_calls: list[str]
) -> None:
    """A positive answer from memory was trusted for ``exists_recheck_s`` (5 s by default) after
    another instance had evicted the object: vLLM's scheduler-side instance offered blocks its
    worker-side instance had evicted (``capacity_bytes``), and 2 loads in 5 failed (audit 27).
    Every removal is noted in the directory; one stat per ``exists`` call notices it."""
    blobs = Blobs()
    backend = open_backend(tmp_path, exists_recheck_s=3600)
    old = [f"old-{i}" for i in range(3)]
    assert backend.put([blobs.obj(key, bytes(100)) for key in old]) == [True] * 3
    assert backend.exists(old) == [True] * 3
    new = [f"new-{i}" for i in range(3)]
    _in_child(_evict_in_child, str(tmp_path), new)
    assert backend.exists(old) == [False] * 3, "evicted by the other process: not served from memory"
    assert backend.exists(new) == [True] * 3
    stat_calls.clear()
    assert backend.exists(new) == [True] * 3
    assert stat_calls == [str(tmp_path / REMOVALS_FILE)], "once rechecked, trusted again"

    # this process's own evictions leave its index right: they cost no recheck
    own = open_backend(tmp_path / "own", capacity_bytes=3 * (len(OBJECT_MAGIC) + 100), exists_recheck_s=3600)
    keys = [f"mine-{i}" for i in range(5)]
    assert own.put([blobs.obj(key, bytes(100)) for key in keys]) == [True] * 5  # evicts mine-0, mine-1
    stat_calls.clear()
    assert own.exists(keys) == [False, False, True, True, True]
    assert str(tmp_path / "own" / REMOVALS_FILE) in stat_calls
    assert not [path for path in stat_calls if path.endswith(("mine-2", "mine-3", "mine-4"))]
    for each in (backend, own):
        each.close()


def test_this_instances_own_removal_does_not_hide_anothers(tmp_path: Path) -> None:
    """Noting its own removal, an instance took the note's new state as seen, which held every
    removal others had noted since it last looked: those were never noticed (audit 28: 24 of 102
    "present" answers that then missed were for objects already gone when asked)."""
    blobs = Blobs()
    first, other = (
        open_backend(tmp_path, exists_recheck_s=3600),
        open_backend(tmp_path, exists_recheck_s=3600),
    )
    assert first.put([blobs.obj(key, bytes(100)) for key in ("x", "y")]) == [True, True]
    assert first.exists(["x", "y"]) == [True, True]
    assert other.remove(["x"]) == [True]
    assert first.remove(["y"]) == [True]  # its own removal, after the other's
    assert first.exists(["x"]) == [False], "the other instance's removal was noticed"
    assert first.put([blobs.obj("z", bytes(100))]) == [True]
    assert first.remove(["z"]) == [True]
    stamp = os.stat(tmp_path / REMOVALS_FILE)
    assert first.exists(["x", "y", "z"]) == [False] * 3
    assert os.stat(tmp_path / REMOVALS_FILE).st_size == stamp.st_size
    for backend in (first, other):
        backend.close()


def test_an_instance_that_only_asks_keeps_its_index_within_the_capacity(tmp_path: Path) -> None:
    """vLLM's scheduler side only calls ``exists``: it indexed every object it ever found and
    never evicted (20,000 entries for 10 objects on disk, ~290 bytes each, audit 28)."""
    blobs = Blobs()
    size = len(OBJECT_MAGIC) + 100
    writer = open_backend(tmp_path, capacity_bytes=4 * size)
    asker = open_backend(tmp_path, capacity_bytes=4 * size, exists_recheck_s=3600)
    for index in range(40):
        key = f"block-{index}"
        assert writer.put([blobs.obj(key, bytes(100))]) == [True]
        assert asker.exists([key]) == [True]
        assert asker.used_bytes <= 4 * size
    assert asker.exists([f"block-{index}" for index in range(36, 40)]) == [True] * 4
    assert asker.exists(["block-0"]) == [False]
    for backend in (writer, asker):
        backend.close()


def test_engine_exists_and_get_agree_with_the_index_after_corruption_removal(tmp_path: Path) -> None:
    """A damaged object the engine removes is gone from the index too."""
    kit = BackendConformance()
    backend = open_backend(tmp_path)
    specs = conformance_specs()
    engine = kit.engine(backend, specs)
    source, target = kit.pools(specs, 3, seed=31), kit.pools(specs, 3, seed=None)
    hashes = page_hashes(3, seed=31)
    assert all(engine.put("index", hashes, source["index"].units(range(3))).ok)
    assert backend.corrupt_for_test(engine.object_keys("index", hashes)[0][1], "flip")
    assert engine.get("index", hashes, target["index"].units(range(3))).ok == [True, False, True]
    assert engine.metrics.corrupt_removed == 1
    assert engine.exists("index", hashes).ok == [True, False, True]
    backend.close()


# --- files this process may not touch (FAULT INJECTION: the tests run as root, whom permission
# bits do not stop, so the failing call is wrapped to raise what another user's file raises) ------


def test_an_evicted_file_that_cannot_be_removed_fails_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another user's object in a shared (sticky) directory cannot be unlinked: the put that
    evicts it still stores its object, the capacity accounting stays the index's, the failure is
    counted and said, and later puts evict only what they must."""
    blobs = Blobs()
    writer = open_backend(tmp_path, fanout_chars=0)
    assert all(writer.put([blobs.obj(f"theirs-{i}", bytes([i]) * 100) for i in range(4)]))
    writer.close()
    backend = open_backend(tmp_path, fanout_chars=0, capacity_bytes=4 * 104)  # adopts theirs-*
    real_unlink = os.unlink

    def unlink(path: str, *args: object, **kwargs: object) -> None:
        if "theirs-" in os.fspath(path):
            raise PermissionError(1, "Operation not permitted", os.fspath(path))
        real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", unlink)
    for i in range(4):
        assert backend.put([blobs.obj(f"mine-{i}", bytes([i]) * 100)]) == [True]
    assert backend.unlink_failures == 4
    assert backend.used_bytes == sum(entry.size for entry in backend._index.values()) == 4 * 104
    assert "cannot remove evicted object" in caplog.text
    assert backend.put([blobs.obj("mine-4", b"x" * 100)]) == [True]  # evicts mine-0 only
    assert backend.exists([f"mine-{i}" for i in range(5)]) == [False, True, True, True, True]
    backend.close()


def test_a_directory_this_process_may_not_read_fails_only_its_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A fan-out directory another user keeps private: open skips it (said once), and ``exists``
    and ``put`` fail its keys alone -- never the whole batch, and never the process."""
    blobs = Blobs()
    backend = open_backend(tmp_path)
    keys = [f"key-{i}" for i in range(32)]
    assert all(backend.put([blobs.obj(key, b"x" * 100) for key in keys]))
    backend.close()
    private = backend._locate(keys[0])[0]
    inside = [key for key in keys if backend._locate(key)[0] == private]
    real_scandir, real_stat = os.scandir, os.stat

    def refused(path: object) -> bool:
        return os.fspath(path).startswith(private)  # type: ignore[arg-type]

    def scandir(path: object = ".") -> object:
        if refused(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))  # type: ignore[arg-type]
        return real_scandir(path)  # type: ignore[arg-type]

    def stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if refused(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))  # type: ignore[arg-type]
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "stat", stat)
    backend = open_backend(tmp_path)
    assert f"skipping {private} at open" in caplog.text
    assert backend.exists(keys) == [key not in inside for key in keys]
    candidates = [f"new-{i}" for i in range(4096)]
    there = [key for key in candidates if backend._locate(key)[0] == private][:4]
    new = [key for key in candidates if key not in there][:4] + there
    assert backend.put([blobs.obj(key, b"y" * 100) for key in new]) == [True] * 4 + [False] * 4
    backend.close()


def _disk_bytes(root: Path) -> int:
    files = [path for path in root.rglob("*") if path.is_file() and path.name != REMOVALS_FILE]
    return sum(path.stat().st_size for path in files)


@pytest.mark.parametrize("restat", ["exists", "put"])
def test_an_object_another_process_replaced_by_another_length_is_counted_by_its_length(
    tmp_path: Path, restat: str
) -> None:
    """An entry kept the length this instance first saw after another process replaced the object
    by one of another length (a cut object removed as damage and written again, another layout's
    under the key): ``exists`` and a skipped ``put`` stat the file and found it, yet the capacity
    went on counting the old length, and the directory grew past ``capacity_bytes``."""
    blobs = Blobs()
    small, large = 100, 3000
    capacity = 2 * (len(OBJECT_MAGIC) + large)
    first = open_backend(tmp_path, capacity_bytes=capacity, exists_recheck_s=3600)
    other = open_backend(tmp_path)
    assert first.put([blobs.obj("k", bytes(small))]) == [True]
    assert other.remove(["k"]) == [True]
    assert other.put([blobs.obj("k", bytes(large))]) == [True]
    if restat == "exists":
        assert first.exists(["k"]) == [True]  # the other's removal was noticed: checked on disk
    else:
        assert first.put([blobs.obj("k", bytes(large))]) == [True]  # already there: skipped
    assert first.used_bytes == len(OBJECT_MAGIC) + large, "counted by the length on disk"
    assert first.put([blobs.obj(f"new-{i}", bytes(large)) for i in range(2)]) == [True, True]
    assert _disk_bytes(tmp_path) <= capacity, "the directory stays within the capacity"
    assert first.used_bytes == _disk_bytes(tmp_path)
    for backend in (first, other):
        backend.close()


# --- a miss that forgot an object written meanwhile (FAULT INJECTION: ``os.open`` of the read is
# wrapped so that, at the moment the file is found missing, this process's writer thread puts the
# key again and finishes before the read goes on: the interleaving of a removal race) -------------


@pytest.mark.parametrize("operation", ["get", "exists", "get_unindexed"])
def test_a_miss_does_not_forget_the_object_a_put_stored_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, operation: str
) -> None:
    """A read found the file gone (another process removed it) while the writer thread put the
    key again: the read then dropped the *new* entry from the index, so this process no longer
    counted the object against ``capacity_bytes`` nor ever evicted it (the directory grew past
    the capacity by one object per such race)."""
    blobs = Blobs()
    size = len(OBJECT_MAGIC) + 1000
    backend = open_backend(tmp_path, capacity_bytes=2 * size, exists_recheck_s=0)
    key = "k" if operation != "get_unindexed" else "q" * 300  # stored under its digest
    assert backend.put([blobs.obj(key, bytes(1000))]) == [True]
    path = str(backend.path_for(key))
    os.unlink(path)  # another process's eviction
    real_open, real_stat, raced = os.open, os.stat, []

    def put_meanwhile() -> None:
        raced.append(True)  # once: the writer thread writes the key again, start to end
        writer = threading.Thread(target=backend.put, args=([blobs.obj(key, bytes(1000))],))
        writer.start()
        writer.join(30)
        assert not writer.is_alive()

    def racing_open(target: str, *args: object, **kwargs: object) -> int:
        if os.fspath(target) == path and not raced:
            put_meanwhile()
            raise FileNotFoundError(2, "removed", path)
        return real_open(target, *args, **kwargs)  # type: ignore[arg-type]

    def racing_stat(target: str, *args: object, **kwargs: object) -> os.stat_result:
        if os.fspath(target) == path and not raced:
            put_meanwhile()
            raise FileNotFoundError(2, "removed", path)
        return real_stat(target, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(file_io.os, "open", racing_open)
    monkeypatch.setattr(file_io.os, "stat", racing_stat)
    if operation == "exists":
        assert backend.exists([key]) == [False]
    else:
        obj, _ = blobs.target(key, size)
        assert backend.get([obj]) == [file_io.MISS]
    monkeypatch.undo()
    assert raced and os.path.exists(path), "the put stored the object again"
    assert backend.used_bytes == _disk_bytes(tmp_path) == size, "the new object is still counted"
    assert backend.put([blobs.obj(f"new-{i}", bytes(1000)) for i in range(2)]) == [True, True]
    assert _disk_bytes(tmp_path) <= 2 * size, "and evicted like any other: the capacity holds"
    backend.close()
