"""The file backend's I/O threads: chunks in order, each chunk's thread held on a CPU of its own
while it runs and given its own mask back, and unplaced (the caller working the first chunk)
where the platform refuses."""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstrata.plugins.storage_backend import BufferRegion, StorageObject
from kvstrata.storage_backends import _io_threads
from kvstrata.storage_backends._io_threads import IOThreads
from kvstrata.storage_backends.file import FileBackend, FileConfig

ALLOWED = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else {0}


@pytest.fixture
def threads() -> Iterator[IOThreads]:
    pool = IOThreads(3, "test-io")
    yield pool
    pool.shutdown()


def record(start: int, stop: int) -> list[tuple[int, int, frozenset[int], int]]:
    """Per row: the row, its chunk's start, the CPUs the thread may run on, and the thread."""
    cpus = frozenset(os.sched_getaffinity(0))
    return [(row, start, cpus, threading.get_ident()) for row in range(start, stop)]


@pytest.mark.parametrize("bounds", [[0, 5], [0, 3, 7], [0, 2, 4, 9]])
def test_chunks_come_back_in_order_whatever_the_placement(threads: IOThreads, bounds: list[int]) -> None:
    rows = threads.map_chunks(record, bounds)
    assert [row for row, *_ in rows] == list(range(bounds[-1]))
    assert [start for _, start, *_ in rows] == [s for s, e in itertools.pairwise(bounds) for _ in range(s, e)]


@pytest.mark.parametrize("chunks", [2, 3])
def test_each_chunk_runs_on_cpus_no_other_chunk_of_the_batch_uses(threads: IOThreads, chunks: int) -> None:
    """With two or more CPUs, the chunks' threads are held on disjoint shares of the caller's
    CPUs (the first on one holding the caller's; a CPU per chunk in turn when there are more
    chunks than CPUs) and the caller waits; with one CPU nothing is placed and the caller works."""
    bounds = [4 * i for i in range(chunks + 1)]
    rows = threads.map_chunks(record, bounds)
    held = [{cpus for _, start, cpus, _ in rows if start == bound} for bound in bounds[:-1]]
    assert all(len(cpus) == 1 for cpus in held)
    shares = [next(iter(cpus)) for cpus in held]
    if len(ALLOWED) >= 2 and threads.placing:
        assert threading.get_ident() not in {thread for *_, thread in rows}  # the caller waited
        if chunks <= len(ALLOWED):
            assert frozenset().union(*shares) == ALLOWED
            assert sum(len(share) for share in shares) == len(ALLOWED), "no CPU in two shares"
        else:
            assert all(len(share) == 1 for share in shares)
            assert shares[len(ALLOWED)] == shares[0]  # dealt in turn
    else:
        assert all(share == ALLOWED for share in shares)
        assert {thread for _, start, _, thread in rows if start == 0} == {threading.get_ident()}


@pytest.mark.parametrize(("cpus", "here", "chunks", "expected"), [
    ({0, 1}, 1, 2, [{1}, {0}]),
    (set(range(8)), 5, 2, [{5, 1, 3, 6}, {0, 2, 4, 7}]),
    (set(range(8)), 0, 3, [{0, 3, 6}, {1, 4, 7}, {2, 5}]),
    ({2, 3}, 3, 4, [{3}, {2}, {3}, {2}]),
    ({4}, 4, 2, None),
])  # fmt: skip
def test_the_callers_cpus_are_dealt_out_to_the_chunks_in_turn(
    threads: IOThreads,
    monkeypatch: pytest.MonkeyPatch,
    cpus: set[int],
    here: int,
    chunks: int,
    expected: list[set[int]] | None,
) -> None:
    """On a machine made to look like ``cpus`` with the caller on ``here``: the first share holds
    the caller's CPU, no CPU is in two shares until chunks outnumber CPUs; one CPU: unplaced."""
    threads._current_cpu = lambda: here
    monkeypatch.setattr(_io_threads.os, "sched_getaffinity", lambda _pid: set(cpus))
    assert threads._cpus_per_chunk(chunks) == expected


def test_a_thread_gets_its_own_cpus_back_after_its_chunk(threads: IOThreads) -> None:
    threads.map_chunks(record, [0, 4, 8, 12])
    seen = [threads._pool.submit(os.sched_getaffinity, 0).result() for _ in range(6)]
    assert all(cpus == ALLOWED for cpus in seen)


def test_a_refused_placement_runs_the_chunk_unplaced_and_stops_placing(
    threads: IOThreads, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: ``sched_setaffinity`` refused (a sandbox, a cpuset changed under us), on
    a machine made to look like two CPUs whatever this one has."""
    threads._current_cpu = lambda: 0
    monkeypatch.setattr(_io_threads.os, "sched_getaffinity", lambda _pid: {0, 1})

    def refuse(_pid: int, _cpus: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(_io_threads.os, "sched_setaffinity", refuse)
    rows = threads.map_chunks(record, [0, 4, 8])
    assert [row for row, *_ in rows] == list(range(8))
    assert not threads.placing
    rows = threads.map_chunks(record, [0, 4, 8])  # from now on the caller works the first chunk
    assert {thread for _, start, _, thread in rows if start == 0} == {threading.get_ident()}


@pytest.mark.parametrize("placed", [True, False])
def test_a_failing_chunk_raises_after_every_chunk_is_done(threads: IOThreads, placed: bool) -> None:
    if not placed:
        threads._current_cpu = None
    done: list[int] = []
    finished = threading.Event()

    def chunk(start: int, stop: int) -> list[int]:
        if start == 0:
            raise OSError(5, "Input/output error")
        finished.wait(0.2)  # still working when the first chunk has failed
        done.append(start)
        return list(range(start, stop))

    with pytest.raises(OSError, match="Input/output error"):
        threads.map_chunks(chunk, [0, 4, 8, 12])
    assert sorted(done) == [4, 8]


def test_file_backend_reads_back_through_placed_threads(tmp_path: Path) -> None:
    """A get split over the I/O threads (64 objects, two threads) reads every object whole."""
    source = bytearray(os.urandom(64 * 4096))
    target = bytearray(len(source))
    keys = [f"k{unit}" for unit in range(64)]
    backend = FileBackend("l3", FileConfig(path=tmp_path, io_threads=2))
    backend.open()
    try:
        assert all(backend.put(_objects(keys, source)))
        assert backend.get(_objects(keys, target)) == [4096] * 64
        assert target == source
    finally:
        backend.close()


def test_two_callers_at_once_get_their_own_bytes_and_the_threads_their_masks_back(tmp_path: Path) -> None:
    """The L3 writer and a prefetch read one backend at once: their batches' shares queue on the
    same I/O threads, each placed for its own batch; every object comes back whole and every
    thread ends with the mask it started with."""
    backend = FileBackend("l3", FileConfig(path=tmp_path, io_threads=2))
    backend.open()
    errors: list[BaseException] = []

    def caller(seed: int) -> None:
        try:
            for round_id in range(15):
                source = bytearray(os.urandom(32 * 4096))
                target = bytearray(len(source))
                keys = [f"c{seed}-r{round_id}-u{unit}" for unit in range(32)]
                assert all(backend.put(_objects(keys, source)))
                assert backend.get(_objects(keys, target)) == [4096] * 32
                assert target == source
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    try:
        callers = [threading.Thread(target=caller, args=(seed,)) for seed in range(2)]
        for thread in callers:
            thread.start()
        for thread in callers:
            thread.join(timeout=60)
        assert not errors, errors
        pool = backend._pool
        assert pool is not None
        masks = [pool._pool.submit(os.sched_getaffinity, 0).result() for _ in range(6)]
        assert all(mask == ALLOWED for mask in masks)
    finally:
        backend.close()


def _objects(keys: list[str], data: bytearray) -> list[StorageObject]:
    """One 4 KiB object per key over consecutive pieces of ``data`` (kept alive by the caller)."""
    base = ctypes.addressof((ctypes.c_ubyte * len(data)).from_buffer(data))
    return [StorageObject(key, (BufferRegion(base + i * 4096, 4096),)) for i, key in enumerate(keys)]
