"""The file backend rewrites an evicted file of the new object's size instead of unlinking it and
creating one (its page-cache memory is reused), only while every read is checksum-verified, and
never a file this process is reading or an unverified reader anywhere holds (its ``flock``).

The "other process" below is a second open file description on the same file (``flock`` locks
conflict between those as between processes): deterministic, where two real processes would race."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

import kvstrata.storage_backends._file_index as file_index
from kvstrata.core.integrity import HEADER_BYTES
from kvstrata.plugins.storage_backend import OBJECT_MAGIC, ReadCheck, StorageObject
from kvstrata.storage_backends._file_recycle import move_for_rewrite
from kvstrata.storage_backends._file_removals import REMOVALS_FILE
from kvstrata.storage_backends.file import FileBackend, FileConfig
from kvstrata.testing.conformance import BackendConformance, conformance_specs, page_hashes
from storage_objects import Blobs

KIT = BackendConformance()


def files_of(root: Path) -> set[str]:
    """The files under ``root`` but the directory's removals note (not an object)."""
    return {name for _, _, names in os.walk(root) for name in names} - {REMOVALS_FILE}


def test_evicted_files_are_rewritten_through_the_engine_and_read_back_intact(tmp_path: Path) -> None:
    specs = conformance_specs()
    backend = FileBackend("l3", FileConfig(path=tmp_path))
    backend.open()
    engine = KIT.engine(backend, specs)  # checksum xxh3: reads verified, recycling allowed
    sizes = {HEADER_BYTES + spec.object_bytes(obj.suffix) for spec in [specs["attn"]] for obj in spec.objects}
    (size,) = sizes  # both objects of a unit ("k", "v") have one size
    backend.config = backend.config.model_copy(update={"capacity_bytes": 8 * size})  # 4 units
    units = 12
    source, target = KIT.pools(specs, units, seed=3), KIT.pools(specs, units, seed=None)
    hashes = page_hashes(units, seed=3)
    assert all(engine.put("attn", hashes, source["attn"].units(range(units))).ok)
    assert backend.recycled_files == 2 * (units - 4)
    assert len(files_of(tmp_path)) == 8, "no file left over: recycled, not duplicated"
    result = engine.get("attn", hashes, target["attn"].units(range(units)))
    kept = [i for i, ok in enumerate(result.ok) if ok]  # the I/O threads interleave the LRU order
    assert len(kept) >= 3  # 8 objects: at least 3 whole units (4 unless a unit lost one object)
    KIT.assert_units_equal(source["attn"], target["attn"], kept)
    assert engine.metrics.corrupt_detected == 0 and engine.metrics.foreign_objects == 0
    backend.close()


def test_no_recycling_unless_every_read_is_verified(tmp_path: Path) -> None:
    backend = FileBackend("l3", FileConfig(path=tmp_path, capacity_bytes=2 * 104))
    backend.open()
    blobs = Blobs()
    for verified, expected in ((False, 0), (True, 4)):  # 2 slots, every put evicts
        backend.set_read_verification(verified)
        before = backend.recycled_files
        assert all(backend.put([blobs.obj(f"{verified}-{i}", bytes([i]) * 100) for i in range(4)]))
        assert backend.recycled_files - before == expected
    engine = KIT.engine(backend, conformance_specs(), checksum="none")
    assert not backend._reads_verified, "an engine reading unverified turns recycling off"
    engine.checksum = "xxh3"
    assert backend._reads_verified
    backend.close()


@pytest.mark.parametrize("key", ["a", "a" * 201], ids=["named-by-key", "named-by-digest"])
def test_a_file_being_read_is_never_recycled(tmp_path: Path, key: str) -> None:
    """A put that evicts the very object a get of this process is reading (from inside that
    read) unlinks it -- the reader keeps its bytes -- instead of rewriting it under the reader;
    also for a key too long to be a file name (stored under its digest)."""
    blobs = Blobs()

    class ReadThenPut(FileBackend):
        def get(self, objects: Sequence[StorageObject], check: ReadCheck | None = None) -> list[int]:
            def during(row: int, nbytes: int) -> None:  # runs while "a" counts as being read
                assert self.put([blobs.obj("b", b"B" * 100)]) == [True]

            return super().get(objects, during)

    backend = ReadThenPut("l3", FileConfig(path=tmp_path, capacity_bytes=104))
    backend.set_read_verification(True)
    backend.open()
    assert backend.put([blobs.obj(key, b"A" * 100)]) == [True]
    obj, buffer = blobs.target(key, 104)
    assert backend.get([obj]) == [104]
    assert bytes(buffer) == OBJECT_MAGIC + b"A" * 100
    assert backend.recycled_files == 0
    assert files_of(tmp_path) == {"b"}
    backend.close()


def test_a_file_an_unverified_reader_holds_is_unlinked_not_recycled(tmp_path: Path) -> None:
    """A reader with ``checksum: none`` (another process) holds a shared lock on the file it
    reads: a verified put that evicts that object unlinks it (the reader still reads its bytes,
    whole) instead of rewriting it under the reader, which would hand it a mix of two objects."""
    blobs = Blobs()
    backend = FileBackend("l3", FileConfig(path=tmp_path, capacity_bytes=104, fanout_chars=0))
    backend.set_read_verification(True)
    backend.open()
    assert backend.put([blobs.obj("a", b"A" * 100)]) == [True]
    reader = os.open(tmp_path / "a", os.O_RDONLY)
    try:
        fcntl.flock(reader, fcntl.LOCK_SH | fcntl.LOCK_NB)  # what an unverified get takes
        assert backend.put([blobs.obj("b", b"B" * 100)]) == [True]  # evicts "a"
        assert backend.recycled_files == 0
        assert files_of(tmp_path) == {"b"}
        assert os.pread(reader, 104, 0) == OBJECT_MAGIC + b"A" * 100
    finally:
        os.close(reader)
    assert backend.put([blobs.obj("c", b"C" * 100)]) == [True]  # nobody holds "b": recycled
    assert backend.recycled_files == 1
    backend.close()


def test_an_unverified_read_of_a_file_being_recycled_is_a_miss(tmp_path: Path) -> None:
    """While a put in another process rewrites an evicted file (holding its exclusive lock) an
    unverified get of the object that file held misses, rather than read what is being written;
    a verified one reads it (its checksum judges the bytes)."""
    blobs = Blobs()
    backend = FileBackend("l3", FileConfig(path=tmp_path, fanout_chars=0))
    backend.open()
    assert backend.put([blobs.obj("a", b"A" * 100)]) == [True]
    writer = os.open(tmp_path / "a", os.O_WRONLY)
    try:
        fcntl.flock(writer, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a recycling put holds
        for verified, expected in ((False, [-1]), (True, [104])):
            backend.set_read_verification(verified)
            obj, buffer = blobs.target("a", 104)
            assert backend.get([obj]) == expected
            assert bytes(buffer) == (OBJECT_MAGIC + b"A" * 100 if verified else bytes(104))
    finally:
        os.close(writer)
    backend.set_read_verification(False)
    obj, buffer = blobs.target("a", 104)
    assert backend.get([obj]) == [104]  # the lock is gone: read as usual
    assert bytes(buffer) == OBJECT_MAGIC + b"A" * 100
    backend.close()


def test_a_recycled_file_is_moved_to_the_temp_name_before_it_is_locked(tmp_path: Path) -> None:
    """Locked by its name first, a file another put had recycled (and whose name a new object
    had taken since) was written through one inode and renamed as another: two objects held other
    keys' bytes. Moved first, the file written is the one at the temp name; it has the new
    object's size and a fresh mtime (the old one's made an opening process sweep it as stale)."""
    evicted, tmp = tmp_path / "evicted", tmp_path / ".new.tmp-1-00000000-0"
    evicted.write_bytes(b"E" * 50)  # another object of another size took the name meanwhile
    os.utime(evicted, (1_000_000, 1_000_000))
    fd = move_for_rewrite(str(evicted), str(tmp), 100, os.makedirs)
    assert fd is not None
    try:
        assert not evicted.exists() and os.fstat(fd).st_ino == os.stat(tmp).st_ino
        assert os.fstat(fd).st_size == 100 and time.time() - os.fstat(fd).st_mtime < 60
        other = os.open(tmp, os.O_RDONLY)
        with pytest.raises(BlockingIOError):  # exclusively locked until the put closes it
            fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)
        os.close(other)
    finally:
        os.close(fd)
    # a file a reader holds keeps its bytes for the reader: both names are gone, nothing rewritten
    held = tmp_path / "held"
    held.write_bytes(b"H" * 100)
    reader = os.open(held, os.O_RDONLY)
    fcntl.flock(reader, fcntl.LOCK_SH | fcntl.LOCK_NB)
    try:
        assert move_for_rewrite(str(held), str(tmp), 100, os.makedirs) is None
        assert not held.exists() and not tmp.exists()
        assert os.pread(reader, 100, 0) == b"H" * 100
    finally:
        os.close(reader)


def test_a_recycling_put_notes_the_removal_after_the_file_left_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Noted before the evicted file was moved, an ``exists`` in between found it still there
    and trusted it after it was gone (an exists-only instance: vLLM's scheduler side)."""
    blobs = Blobs()
    size = len(OBJECT_MAGIC) + 100
    writer = FileBackend("l3", FileConfig(path=tmp_path, capacity_bytes=size, fanout_chars=0))
    writer.set_read_verification(True)
    writer.open()
    asker = FileBackend("l3", FileConfig(path=tmp_path, fanout_chars=0, exists_recheck_s=3600))
    asker.open()
    assert writer.put([blobs.obj("x", b"X" * 100)]) == [True]
    asked: list[list[bool]] = []
    move = file_index.move_for_rewrite

    def asked_meanwhile(*args: object) -> int | None:
        asked.append(asker.exists(["x"]))  # while the put is about to move x's file away
        return move(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(file_index, "move_for_rewrite", asked_meanwhile)
    assert writer.put([blobs.obj("z", b"Z" * 100)]) == [True]
    assert asked == [[True]] and writer.recycled_files == 1
    assert asker.exists(["x", "z"]) == [False, True]
    for backend in (writer, asker):
        backend.close()


@pytest.mark.parametrize("stored_again", [True, False])
def test_a_read_that_raced_a_recycling_removes_nothing_and_counts_no_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stored_again: bool
) -> None:
    """Three "processes" (three backends on one directory). A's verified read (no lock) opens
    K1's file and, FAULT INJECTION, pauses in ``os.readv`` while B evicts K1 and recycles that
    file into K2 and (``stored_again``) C stores K1 afresh. A read K2's bytes (``key_mismatch``):
    removing K1 by key deleted C's valid object, and a false corruption was counted. The rejected
    object is read once more first: C's K1 (a hit) or nothing (a miss), nothing removed."""

    def opened(capacity_bytes: int | None = None) -> FileBackend:
        backend = FileBackend("l3", FileConfig(path=tmp_path, io_threads=1, capacity_bytes=capacity_bytes))
        backend.open()
        return backend

    specs = conformance_specs()
    a, c = opened(), opened()
    engine_a, engine_c = KIT.engine(a, specs), KIT.engine(c, specs)
    hashes, source = page_hashes(2, seed=5), KIT.pools(specs, 2, seed=5)["index"]
    assert all(engine_c.put("index", hashes[:1], source.units([0])).ok)
    size = sum(path.stat().st_size for path in tmp_path.rglob("*") if path.name in files_of(tmp_path))
    b = opened(capacity_bytes=size + 10)  # adopts K1 at open; room for one object
    engine_b = KIT.engine(b, specs)
    readv, paused = os.readv, []

    def pausing_readv(fd: int, buffers: Sequence[memoryview]) -> int:
        if not paused:  # A's first read, its file open: the others run now
            paused.append(fd)
            assert engine_b.put("index", hashes[1:], source.units([1])).ok == [True]
            assert b.recycled_files == 1, "K1's file, open in A, now holds K2"
            if stored_again:
                assert engine_c.put("index", hashes[:1], source.units([0])).ok == [True]
        return readv(fd, buffers)

    monkeypatch.setattr(os, "readv", pausing_readv)
    target = KIT.pools(specs, 2, seed=None)["index"]
    result = engine_a.get("index", hashes[:1], target.units([0]))
    monkeypatch.setattr(os, "readv", readv)
    assert paused and result.ok == [stored_again] and result.rejected == ()
    if stored_again:
        KIT.assert_units_equal(source, target, [0])
    metrics = engine_a.metrics
    assert (metrics.corrupt_detected, metrics.corrupt_removed, metrics.reread_cleared) == (0, 0, 1)
    assert engine_c.exists("index", hashes[:1]).ok == [stored_again], "C's fresh K1 kept"
    assert engine_c.exists("index", hashes[1:]).ok == [True]
    for backend in (a, b, c):
        backend.close()
