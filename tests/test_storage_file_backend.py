"""The file backend: conformance kit, corruption, second process, restart, capacity."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstrata.plugins.storage_backend import OBJECT_MAGIC, BufferRegion, StorageBackend, StorageObject
from kvstrata.storage_backends import _file_index
from kvstrata.storage_backends import _file_io as file_backend_io
from kvstrata.storage_backends import file as file_backend
from kvstrata.storage_backends._file_index import _host_tag
from kvstrata.storage_backends.file import FileBackend, FileConfig
from kvstrata.testing.conformance import (
    BackendConformance,
    HostPoolForTests,
    conformance_specs,
    page_hashes,
)
from storage_objects import Blobs


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


def test_something_not_a_regular_file_under_an_objects_name_is_no_object(tmp_path: Path) -> None:
    """A directory (or a link to a device) where an object's file belongs was answered "present"
    and taken for stored by a put: vLLM was offered the block, failed its load every time, and
    the put never replaced it (audit 29). It is no object now: absent, and a put stores the
    object where it can (over the link) or says it could not (a directory stays)."""
    backend = open_file_backend(tmp_path)
    data = bytearray(OBJECT_MAGIC + b"payload")
    backend.path_for("dir").parent.mkdir(parents=True, exist_ok=True)
    backend.path_for("dir").mkdir()
    backend.path_for("link").parent.mkdir(parents=True, exist_ok=True)
    backend.path_for("link").symlink_to("/dev/zero")
    assert backend.exists(["dir", "link"]) == [False, False]
    assert backend.put([_raw_object("dir", data), _raw_object("link", data)]) == [False, True]
    assert backend.exists(["dir", "link"]) == [False, True]
    out = bytearray(len(data))
    assert backend.get([_raw_object("link", out)]) == [len(data)] and out == data
    backend.close()
    fresh = open_file_backend(tmp_path)  # another process: its own stat, no index entry
    assert fresh.exists(["dir", "link"]) == [False, True]
    fresh.close()


def test_existing_key_not_rewritten_and_temp_files_ignored(tmp_path: Path) -> None:
    backend = open_file_backend(tmp_path)
    first, other = bytearray(OBJECT_MAGIC + b"first"), bytearray(OBJECT_MAGIC + b"other")
    assert backend.put([_raw_object("same", first)]) == [True]
    assert backend.put([_raw_object("same", other)]) == [True]
    out = bytearray(9)
    assert backend.get([_raw_object("same", out)]) == [9]
    assert out == OBJECT_MAGIC + b"first"
    stray = backend.path_for("ghost").with_name(".ghost.tmp-1-deadbeef")
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"partial")
    backend.close()
    reopened = open_file_backend(tmp_path)
    assert reopened.used_bytes == 9  # the temp file is never adopted
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


# --- the directory may hold other things: only provably own files are ever touched -------------


def _user_files(root: Path, fanout: int) -> dict[Path, bytes]:
    """Files a user keeps next to (and inside) the store: none of them may ever be touched."""
    import hashlib

    def fan_of(name: str) -> str:
        return hashlib.blake2b(name.encode(), digest_size=16).hexdigest()[:fanout]

    files = {
        root / "notes.txt": b"my notes",
        root / ".bashrc": b"alias ll='ls -l'",
        root / "sub" / "deep" / "model.safetensors": b"weights" * 100,
        root / "ab" / "photo.jpg": b"\xff\xd8" + bytes(500),  # a fan-like directory
        # in the layout (the digest of its name picks its directory) but without the object magic
        root / fan_of("report.pdf") / "report.pdf": b"%PDF" + bytes(700),
        root / "0123456789abcdef0123456789abcdef"[:fanout] / "0123456789abcdef0123456789abcdef": bytes(900),
        # starts with the magic but lies outside the layout (without fan-out, only the root is)
        root / ("KVS1-lookalike.bin" if fanout else "sub/KVS1-lookalike.bin"): OBJECT_MAGIC + bytes(300),
        # named like a temp file of the backend, but not in its layout
        root / "sub" / ".x.tmp-1-deadbeef-0": b"temp-like",
    }
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.utime(path, (1_000_000, 1_000_000))  # old: first in line if they were adopted
    return files


@pytest.mark.parametrize("fanout", [2, 0])
def test_capacity_eviction_never_touches_user_files(tmp_path: Path, fanout: int) -> None:
    files = _user_files(tmp_path, fanout)
    backend = open_file_backend(tmp_path, capacity_bytes=4000, fanout_chars=fanout)
    assert backend.used_bytes == 0, "user files are not counted as the backend's objects"
    blobs = {f"obj-{i}": bytearray(OBJECT_MAGIC + bytes([i]) * 996) for i in range(12)}
    for key, data in blobs.items():
        assert backend.put([_raw_object(key, data)]) == [True]
    assert backend.used_bytes <= 4000
    assert sum(backend.exists(list(blobs))) == 4  # its own objects were evicted, LRU first
    backend.close()
    reopened = open_file_backend(tmp_path, capacity_bytes=4000, fanout_chars=fanout, stale_temp_s=1)
    assert reopened.used_bytes == 4000, "only the backend's own objects are adopted"
    for key, data in list(blobs.items())[:6]:
        assert reopened.put([_raw_object(f"again-{key}", data)]) == [True]
    reopened.close()
    for path, data in files.items():
        assert path.read_bytes() == data, f"{path} was touched"


def test_engine_objects_are_adopted_and_evicted_user_files_kept(tmp_path: Path) -> None:
    """The engine's real objects (header magic) are adopted at open and evicted under pressure;
    the user's file in the same directory is still there afterwards."""
    files = _user_files(tmp_path, 2)
    kit = BackendConformance()
    specs = conformance_specs()
    source = kit.pools(specs, 6, seed=21)
    hashes = page_hashes(6, seed=21)
    first = open_file_backend(tmp_path)
    engine = kit.engine(first, specs)
    assert all(engine.put("index", hashes, source["index"].units(range(6))).ok)
    written = first.used_bytes
    first.close()
    for age, key in enumerate(engine.object_keys("index", hashes)[0]):  # page 0 the oldest
        os.utime(first.path_for(key), (1_000_000 + age, 1_000_000 + age))  # timestamps can tie
    second = open_file_backend(tmp_path, capacity_bytes=written)
    assert second.used_bytes == written
    more = page_hashes(3, seed=22)
    assert all(kit.engine(second, specs).put("index", more, source["index"].units(range(3))).ok)
    assert second.used_bytes == written
    assert kit.engine(second, specs).exists("index", hashes).ok == [False] * 3 + [True] * 3
    second.close()
    for path, data in files.items():
        assert path.read_bytes() == data, f"{path} was touched"


def test_empty_path_is_refused(tmp_path: Path, kvstrata_host: object) -> None:
    from pydantic import ValidationError

    from kvstrata.core.config import load
    from kvstrata.plugins import ConfigError

    with pytest.raises(ValidationError, match="path"):
        FileConfig(path="")
    with pytest.raises(ValidationError, match="path"):
        FileConfig(path="   ")
    config = tmp_path / "c.yaml"
    config.write_text(
        "model: {name: demo, page_size: 64, pools: {kv: {type: kv, layers: 1, kv_heads: 1, head_dim: 8,"
        " dtype: float16}}}\ntiers: {host: {capacity_tokens: 1000}, storage: {l3: {type: file, path: ''}}}\n"
    )
    with pytest.raises(ConfigError) as info:
        load([config], overrides=[], plugins=kvstrata_host, environ={})
    assert "tiers.storage.l3.path" in {path for path, _ in info.value.errors}
    assert "current directory" in str(info.value)


# --- temp files of writers that died --------------------------------------------------------------


def _temp_name(backend: FileBackend, key: str, pid: int = 4242, token: str = "0badc0de") -> Path:
    """A temp file named exactly as a writer of this backend names them."""
    final = backend.path_for(key)
    return final.with_name(f".{final.name}.tmp-{pid}-{token}-7")


def test_a_dead_writers_temp_file_of_this_host_is_swept_at_open_however_young(tmp_path: Path) -> None:
    """Counted for ``stale_temp_s`` (600 s) whatever, a burst of crashes left a restarted process
    evicting nearly everything on each put (audit 28: 23 dead temp files, 1 object left). A temp
    name carries its writer's pid and host: one of this host's pids no process has is swept."""
    first = open_file_backend(tmp_path, capacity_bytes=10_000)
    host = first._tmp_prefix.split("-")[2][:8]
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid no process has now
    dead = _temp_name(first, "dead-writer", pid=child.pid, token=host + "0" * 8)
    alive = _temp_name(first, "live-writer", pid=os.getppid(), token=host + "0" * 8)
    other = "0" * 8 if host != "0" * 8 else "1" * 8
    elsewhere = _temp_name(first, "other-host", pid=child.pid, token=other + "0" * 8)
    first.close()
    for path in (dead, alive, elsewhere):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(1000))
    backend = open_file_backend(tmp_path, capacity_bytes=10_000, stale_temp_s=600)
    assert not dead.exists() and backend.stale_temps_removed == 1
    assert alive.exists() and elsewhere.exists(), "a live writer's, or another host's: counted"
    assert backend.used_bytes == 2000
    backend.close()


def test_a_temp_file_of_a_writer_in_another_pid_namespace_of_this_host_is_not_swept(tmp_path: Path) -> None:
    """Containers on the host's network (``hostNetwork`` pods sharing a hostPath L3) share its
    name but not its pids: a pid no process has *here* says nothing of a writer there. The temp
    name's host tag names the PID namespace too, so such a writer's young temp file is counted,
    not deleted under it (its put failed); one of this namespace's dead writers still goes."""
    first = open_file_backend(tmp_path, capacity_bytes=10_000)
    here = first._tmp_prefix.split("-")[2][:8]
    assert here == _host_tag()
    pod = _host_tag(socket.gethostname(), "pid:[1]")  # the same host name, another namespace
    assert pod != here
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid no process has now (here)
    theirs = _temp_name(first, "pod-writer", pid=child.pid, token=pod + "0" * 8)
    ours = _temp_name(first, "dead-writer", pid=child.pid, token=here + "0" * 8)
    first.close()
    for path in (theirs, ours):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(1000))
    backend = open_file_backend(tmp_path, capacity_bytes=10_000, stale_temp_s=600)
    assert theirs.exists(), "another PID namespace's live writer lost its temp file"
    assert not ours.exists() and backend.stale_temps_removed == 1
    backend.close()


def test_a_live_writer_of_another_host_keeps_its_temp_file_though_the_names_hash_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hosts sharing one directory tell their writers apart by a tag of host name and PID
    namespace. 4 hex digits of it made ``node-106`` and ``node-154`` one host (two of ~150 hosts
    likely share one): ``node-154`` opening took ``node-106``'s live writer, whose pid it has not,
    for one of its own dead ones and deleted its young temp file under it (that put failed).
    A temp file of an earlier release (4-digit tag) is counted, never judged by its pid."""
    namespace = "pid:[4026531836]"
    monkeypatch.setattr(_file_index, "_pid_namespace", lambda: namespace)
    monkeypatch.setattr(_file_index.socket, "gethostname", lambda: "node-154")
    first = open_file_backend(tmp_path, capacity_bytes=10_000)
    tag = _host_tag("node-106", namespace)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid no process has here
    theirs = _temp_name(first, "node-106-writer", pid=child.pid, token=tag + "0" * len(tag))
    older = _temp_name(first, "old-release-writer", pid=child.pid, token=_host_tag()[:4] + "0" * 4)
    first.close()
    for path in (theirs, older):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(1000))
    backend = open_file_backend(tmp_path, capacity_bytes=10_000, stale_temp_s=600)
    assert theirs.exists(), "another host's live writer lost its temp file"
    assert older.exists() and backend.stale_temps_removed == 0 and backend.used_bytes == 2000
    backend.close()


def test_stale_temp_files_swept_at_open_live_ones_counted(tmp_path: Path) -> None:
    first = open_file_backend(tmp_path, capacity_bytes=10_000)
    stale, live = _temp_name(first, "dead-writer"), _temp_name(first, "live-writer")
    first.close()
    for path, size in ((stale, 3000), (live, 2500)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(size))
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    user = tmp_path / ".notes.tmp-1-deadbeef-0"  # temp-like name, but not in the layout
    user.write_bytes(b"keep")
    os.utime(user, (1_000_000, 1_000_000))
    backend = open_file_backend(tmp_path, capacity_bytes=10_000, stale_temp_s=600)
    assert not stale.exists(), "a stale temp file of a dead writer is removed at open"
    assert backend.stale_temps_removed == 1
    assert live.exists() and backend.used_bytes == 2500, "a young temp file counts against capacity"
    assert user.read_bytes() == b"keep"
    # under pressure, the counted temp file still takes room: only 7500 bytes of objects fit
    blobs = [bytearray(OBJECT_MAGIC + bytes(996)) for _ in range(10)]
    for index, blob in enumerate(blobs):
        assert backend.put([_raw_object(f"fill-{index}", blob)]) == [True]
    assert backend.used_bytes <= 10_000
    assert sum(backend.exists([f"fill-{i}" for i in range(10)])) == 7
    # once its writer renamed it away, it stops counting
    live.unlink()
    assert backend.put([_raw_object("fill-10", blobs[0])]) == [True]
    assert backend.used_bytes == 8 * 1000
    backend.close()


def _write_then_die(path: str, ready: str) -> None:
    """Child process: a file-backend writer that stalls between writing its temp file and the rename
    (FAULT INJECTION: os.replace blocks), so the parent can kill -9 it mid-put."""
    import ctypes

    import kvstrata.storage_backends.file as file_module

    def stall(*_args: object) -> None:
        Path(ready).write_text("temp written")
        time.sleep(600)

    file_module.os.replace = stall  # type: ignore[assignment]
    backend = open_file_backend(Path(path))
    data = bytearray(OBJECT_MAGIC + bytes(4092))
    buffer = (ctypes.c_ubyte * len(data)).from_buffer(data)
    backend.put([StorageObject("killed-mid-put", (BufferRegion(ctypes.addressof(buffer), len(data)),))])


def test_kill_minus_9_writer_leaves_a_temp_file_the_next_open_sweeps(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    store = tmp_path / "store"
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=_write_then_die, args=(str(store), str(ready)))
    child.start()
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline and child.is_alive():
            time.sleep(0.05)
        assert ready.exists(), "the writer never reached its rename"
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
    finally:
        child.join(timeout=30)
    assert child.exitcode == -signal.SIGKILL
    temps = [p for p in store.rglob(".*") if p.is_file()]
    assert len(temps) == 1 and temps[0].stat().st_size == 4096
    fresh = open_file_backend(store, capacity_bytes=1 << 20)  # its writer is gone: swept, young as it is
    assert not temps[0].exists() and fresh.stale_temps_removed == 1 and fresh.used_bytes == 0
    assert fresh.exists(["killed-mid-put"]) == [False], "a torn write is never visible"
    fresh.close()


# --- fsync mode -------------------------------------------------------------------------------------


def test_fsync_mode_syncs_the_directory_after_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OBSERVATION INJECTION: os.fsync is wrapped to record what each call synced (the real fsync
    still runs), since a missing directory fsync only shows after a power loss."""
    import stat as stat_module

    real_fsync = os.fsync
    synced: list[tuple[bool, int, bool]] = []  # (is a directory, inode, object visible at the call)
    backend = open_file_backend(tmp_path, fsync=True)
    final = backend.path_for("durable")

    def record(fd: int) -> None:
        info = os.fstat(fd)
        synced.append((stat_module.S_ISDIR(info.st_mode), info.st_ino, final.exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    data = bytearray(OBJECT_MAGIC + b"payload")
    assert backend.put([_raw_object("durable", data)]) == [True]
    directory_inode = final.parent.stat().st_ino
    root_inode = tmp_path.stat().st_ino
    files = [entry for entry in synced if not entry[0]]
    assert files and not files[0][2], "the object's bytes are synced before the rename"
    assert (True, directory_inode, True) in synced, "its directory is synced after the rename"
    assert (True, root_inode, False) in synced, "a new fan-out directory's entry is synced too"
    synced.clear()
    assert backend.put([_raw_object("durable-2", data)]) == [True]
    assert sum(1 for entry in synced if entry[0]) >= 1
    backend.close()


def test_fsync_mode_syncs_the_entries_of_the_directories_open_creates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OBSERVATION INJECTION as above. A root that open created (and any parent it created) is an
    entry of its parent: unsynced, a power loss could take the root, and every object fsync mode
    had reported durable with it."""
    real_fsync = os.fsync
    synced: set[int] = set()

    def record(fd: int) -> None:
        synced.add(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    root = tmp_path / "new" / "store"
    backend = open_file_backend(root, fsync=True)
    assert backend.put([_raw_object("durable", bytearray(OBJECT_MAGIC + b"payload"))]) == [True]
    backend.close()
    assert tmp_path.stat().st_ino in synced, "the entry of the created parent is synced"
    assert (tmp_path / "new").stat().st_ino in synced, "the entry of the created root is synced"


def test_leading_exists_stops_at_the_first_missing_key(tmp_path: Path) -> None:
    """``exists(keys, leading=True)`` answers the leading run exactly and checks nothing after the
    first missing key (a prefix query: SGLang's batch_exists); without it every key is answered.
    Through the engine, ``exists_prefix`` of a multi-object pool asks unit by unit."""
    kit = BackendConformance()
    writer = open_file_backend(tmp_path)
    specs = conformance_specs()
    source = kit.pools(specs, 4, seed=61)
    hashes = page_hashes(4, seed=61)
    engine = kit.engine(writer, specs, model_name="leading")
    stored = [0, 1, 3]  # page 2 missing: a hole before a stored page
    for name in specs:
        assert all(engine.put(name, [hashes[i] for i in stored], source[name].units(stored)).ok)
    writer.close()
    reader = open_file_backend(tmp_path)
    stats: list[str] = []
    real_stat = os.stat

    def counting_stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        stats.append(str(path))
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    engine = kit.engine(reader, specs, model_name="leading")
    keys = [key for keys in zip(*engine.object_keys("attn", hashes), strict=True) for key in keys]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "stat", counting_stat)
        assert reader.exists(keys, leading=True) == [True] * 4 + [False] * 4  # k and v per page
        leading_stats = len(stats)
    # present keys answer from the index built at open; the first missing key is the one stat of
    # a key (the other: the directory's removals note, once per call)
    assert leading_stats == 2, "nothing is checked after the first missing key"
    assert reader.exists(keys) == [True] * 4 + [False] * 2 + [True] * 2
    for name in specs:
        assert engine.exists_prefix(name, hashes) == 2
        assert engine.exists(name, hashes).ok == [True, True, False, True]
        assert engine.exists_prefix(name, hashes[3:]) == 1
    reader.close()


def test_every_backend_config_refuses_an_empty_path_field() -> None:
    """One rule for every backend (``StoragePath``): the built-in 3FS backend and a third-party
    config with an optional path field get it without a validator of their own."""
    from pathlib import Path

    from pydantic import ValidationError

    from kvstrata.plugins import BackendConfig, StoragePath
    from kvstrata.storage_backends.hf3fs import HF3FSConfig

    class ThirdPartyConfig(BackendConfig):
        type: str = "third"
        spool: StoragePath | None = None

    with pytest.raises(ValidationError, match="current directory"):
        HF3FSConfig(path=" ")
    with pytest.raises(ValidationError, match="spool"):
        ThirdPartyConfig(spool="")
    assert ThirdPartyConfig(spool=None).spool is None
    assert ThirdPartyConfig(spool="~/x").spool == Path("~/x").expanduser()


def test_an_io_error_surfaces_only_once_every_io_thread_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The I/O threads read into and write from the caller's regions: when one piece of a batch
    raises, the call must not return (and the caller reuse those regions) while another piece
    is still at work (whichever threads work them: placed on CPUs or not)."""
    monkeypatch.setattr(file_backend, "_usable_cpus", lambda: 4)
    backend = open_file_backend(tmp_path / "store", io_threads=3)
    slow_started, slow_finished = threading.Event(), threading.Event()

    def piece(start: int, stop: int) -> list[int]:
        if start == 0:  # the slow one, never failing
            slow_started.set()
            time.sleep(0.3)
            slow_finished.set()
            return list(range(start, stop))
        assert slow_started.wait(timeout=10), "the slow piece never started"
        if start == 8:
            raise RuntimeError("boom")
        return list(range(start, stop))

    try:
        with pytest.raises(RuntimeError, match="boom"):
            backend._map_rows(piece, 64)
        assert slow_finished.is_set(), "_map_rows raised while an I/O thread was still working"
    finally:
        backend.close()


def _scattered_object(key: str, data: bytearray, pieces: int) -> StorageObject:
    """An object over ``data``'s memory cut into ``pieces`` regions (a layer-split page's many
    small regions); the caller keeps ``data`` alive while it is used."""
    import ctypes

    base = ctypes.addressof((ctypes.c_ubyte * len(data)).from_buffer(data))
    bounds = [len(data) * index // pieces for index in range(pieces + 1)]
    return StorageObject(
        key, tuple(BufferRegion(base + lo, hi - lo) for lo, hi in itertools.pairwise(bounds))
    )


def test_objects_of_more_regions_than_one_readv_takes_read_back_whole(tmp_path: Path) -> None:
    """IOV_MAX is 1024 on Linux: an object of more regions is written and read in several calls."""
    backend = open_file_backend(tmp_path)
    data = bytearray(os.urandom(3000))
    assert backend.put([_scattered_object("many", data, 1500)]) == [True]
    out = bytearray(len(data))
    assert backend.get([_scattered_object("many", out, 1500)]) == [len(data)]
    assert out == data
    backend.close()


def test_a_readv_the_kernel_cut_short_is_finished_and_size_mismatches_are_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read loop trusts one ``readv`` only when it returned the file's indexed size. Fault
    injection (a fake ``readv`` that stops after 100 bytes, as a signal or a pipe would): the rest
    is read. A file shorter or longer than the regions reads as many bytes as it could fill."""
    backend = open_file_backend(tmp_path)
    blobs = {key: bytearray(os.urandom(size)) for key, size in (("a", 4096), ("short", 1000), ("long", 5000))}
    assert backend.put([_raw_object(key, blob) for key, blob in blobs.items()]) == [True] * 3
    real_readv = os.readv
    calls: list[int] = []

    def cut_short(fd: int, buffers: list[memoryview]) -> int:
        calls.append(fd)
        if len(calls) == 1:
            return real_readv(fd, [buffers[0][:100]])  # the kernel stopped early
        return real_readv(fd, buffers)

    monkeypatch.setattr(file_backend_io.os, "readv", cut_short)
    out = {key: bytearray(4096) for key in blobs}
    got = backend.get([_raw_object(key, out[key]) for key in blobs])
    assert len(calls) > 3, "the short read was continued"
    assert got == [4096, 1000, 4096]
    assert out["a"] == blobs["a"]
    assert out["short"][:1000] == blobs["short"]
    assert out["long"] == blobs["long"][:4096]
    backend.close()


@pytest.mark.parametrize("recycle", [False, True])
def test_an_interrupted_put_leaves_no_temp_file_and_no_reserved_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recycle: bool
) -> None:
    """A put's calling thread writes a share of the batch itself: an interrupt (KeyboardInterrupt,
    any BaseException) there left the temp file (this process's: no sweep removes it while it
    lives) and the object's bytes reserved against the capacity for good."""
    blobs = Blobs()
    size = len(OBJECT_MAGIC) + 100
    backend = FileBackend("l3", FileConfig(path=tmp_path, capacity_bytes=2 * size))
    backend.open()
    backend.set_read_verification(recycle)
    assert backend.put([blobs.obj(f"old-{i}", bytes(100)) for i in range(2)]) == [True, True]

    def interrupted(fd: int, views: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(file_backend_io, "_write_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        backend.put([blobs.obj("new", bytes(100))])  # evicts (recycles) old-0 first
    monkeypatch.undo()
    leftovers = [path.name for path in tmp_path.rglob(".*.tmp-*")]
    assert leftovers == [], f"temp files left: {leftovers}"
    assert backend.used_bytes == size, "only old-1 is counted"
    assert backend.put([blobs.obj("new", bytes(100))]) == [True]
    assert backend.exists(["old-1", "new"]) == [True, True]
    backend.close()
