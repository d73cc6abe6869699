"""The file backend's I/O threads: a batch's pieces taken in turn and joined in order, each
worker held on CPUs no other worker of the batch uses and given its own mask back, a worker on a
slow CPU doing fewer pieces, and unplaced (the caller one of the workers) where the platform
refuses."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstrata.plugins.storage_backend import BufferRegion, StorageObject
from kvstrata.storage_backends import _file_io, _io_threads
from kvstrata.storage_backends._io_threads import IOThreads, pieces
from kvstrata.storage_backends.file import FileBackend, FileConfig

ALLOWED = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else {0}


@pytest.fixture
def threads() -> Iterator[IOThreads]:
    pool = IOThreads(3, "test-io")
    yield pool
    pool.shutdown()


class FirstPiecesMeet:
    """Call at the start of a piece: each of two threads waits at its first piece until the other
    has started one. A batch on two workers is then shared by both whichever the scheduler runs
    first (unheld, the pool's worker could take every piece before the caller reached its first,
    and a test that the caller is one of the workers raced)."""

    def __init__(self) -> None:
        self._meet = threading.Barrier(2)
        self._started: set[int] = set()
        self._lock = threading.Lock()

    def __call__(self) -> None:
        me = threading.get_ident()
        with self._lock:
            first = me not in self._started
            self._started.add(me)
        if first:
            self._meet.wait(timeout=30)


def record(start: int, stop: int) -> list[tuple[int, int, frozenset[int], int]]:
    """Per row: the row, its piece's start, the CPUs the thread may run on, and the thread."""
    cpus = frozenset(os.sched_getaffinity(0))
    return [(row, start, cpus, threading.get_ident()) for row in range(start, stop)]


@pytest.mark.parametrize(("count", "workers", "expected"), [
    (256, 2, list(range(0, 257, 16))),
    (64, 2, list(range(0, 65, 8))),
    (20, 2, [0, 8, 16, 20]),
    (9, 3, [0, 8, 9]),
])  # fmt: skip
def test_a_batch_is_cut_into_pieces_of_at_least_the_minimum(
    count: int, workers: int, expected: list[int]
) -> None:
    assert pieces(count, workers, 8) == expected


@pytest.mark.parametrize(("count", "workers"), [(16, 2), (37, 2), (100, 3)])
def test_rows_come_back_in_order_whatever_the_placement(threads: IOThreads, count: int, workers: int) -> None:
    rows = threads.map_rows(record, count, workers, min_piece=4, placed=True)
    assert [row for row, *_ in rows] == list(range(count))
    bounds = pieces(count, workers, 4)
    assert sorted({start for _, start, *_ in rows}) == bounds[:-1]


@pytest.mark.parametrize("workers", [2, 3])
def test_each_worker_runs_on_cpus_no_other_worker_of_the_batch_uses(threads: IOThreads, workers: int) -> None:
    """With two or more CPUs, the workers are held on disjoint shares of the caller's CPUs (a CPU
    each in turn when workers outnumber CPUs) and the caller waits; with one CPU nothing is
    placed and the caller is one of the workers."""
    rows = threads.map_rows(record, 96, workers, min_piece=4, placed=True)
    shares = {thread: {cpus for _, _, cpus, held in rows if held == thread} for *_, thread in rows}
    assert all(len(held) == 1 for held in shares.values()), "a worker's CPUs do not change mid-batch"
    masks = [next(iter(held)) for held in shares.values()]
    if len(ALLOWED) >= 2 and threads.placing:
        assert threading.get_ident() not in shares  # the caller waited
        if workers <= len(ALLOWED):
            assert all(not a & b for i, a in enumerate(masks) for b in masks[i + 1 :]), "no CPU in two shares"
            assert frozenset().union(*masks) <= ALLOWED
        else:
            assert all(len(mask) == 1 for mask in masks)
    else:
        assert all(mask == ALLOWED for mask in masks)


def test_a_worker_on_a_slow_cpu_takes_fewer_pieces(threads: IOThreads) -> None:
    """Pieces go to whichever worker is free: one whose pieces take 50 ms (a CPU another process
    keeps busy) does a few while the others do the rest, instead of a fixed share."""
    slow: list[int] = []

    def piece(start: int, stop: int) -> list[int]:
        if not slow:
            slow.append(threading.get_ident())  # the first worker to start is the slow one
        if threading.get_ident() == slow[0]:
            time.sleep(0.05)
        return [threading.get_ident()] * (stop - start)

    done = threads.map_rows(piece, 160, 2, min_piece=10, placed=True)  # 16 pieces of 10
    per_thread = Counter(done)
    assert len(done) == 160
    assert per_thread[slow[0]] <= 40, per_thread


@pytest.mark.parametrize(("cpus", "here", "workers", "expected"), [
    ({0, 1}, 1, 2, [{1}, {0}]),
    (set(range(8)), 5, 2, [{5, 1, 3, 6}, {0, 2, 4, 7}]),
    (set(range(8)), 0, 3, [{0, 3, 6}, {1, 4, 7}, {2, 5}]),
    ({2, 3}, 3, 4, [{3}, {2}, {3}, {2}]),
    ({4}, 4, 2, None),
])  # fmt: skip
def test_the_callers_cpus_are_dealt_out_to_the_workers_in_turn(
    threads: IOThreads,
    monkeypatch: pytest.MonkeyPatch,
    cpus: set[int],
    here: int,
    workers: int,
    expected: list[set[int]] | None,
) -> None:
    """On a machine made to look like ``cpus`` with the caller on ``here``: the first share holds
    the caller's CPU, no CPU is in two shares until workers outnumber CPUs; one CPU: unplaced."""
    threads._current_cpu = lambda: here
    monkeypatch.setattr(_io_threads.os, "sched_getaffinity", lambda _pid: set(cpus))
    assert threads._cpus_per_worker(workers) == expected


def test_a_thread_gets_its_own_cpus_back_after_the_batch(threads: IOThreads) -> None:
    threads.map_rows(record, 48, 3, min_piece=4, placed=True)
    seen = [threads._pool.submit(os.sched_getaffinity, 0).result() for _ in range(6)]
    assert all(cpus == ALLOWED for cpus in seen)


def test_a_refused_placement_runs_the_batch_unplaced_and_stops_placing(
    threads: IOThreads, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: ``sched_setaffinity`` refused (a sandbox, a cpuset changed under us), on
    a machine made to look like two CPUs whatever this one has."""
    threads._current_cpu = lambda: 0
    monkeypatch.setattr(_io_threads.os, "sched_getaffinity", lambda _pid: {0, 1})

    def refuse(_pid: int, _cpus: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(_io_threads.os, "sched_setaffinity", refuse)
    rows = threads.map_rows(record, 16, 2, min_piece=4, placed=True)
    assert [row for row, *_ in rows] == list(range(16))
    assert not threads.placing
    # from now on the caller is one of the workers
    meet = FirstPiecesMeet()

    def piece(start: int, stop: int) -> list[int]:
        meet()
        return [threading.get_ident()] * (stop - start)

    rows = threads.map_rows(piece, 64, 2, min_piece=1, placed=True)
    assert threading.get_ident() in rows


@pytest.mark.parametrize("placed", [True, False])
def test_a_failing_piece_raises_after_every_piece_is_done(threads: IOThreads, placed: bool) -> None:
    if not placed:
        threads._current_cpu = None
    done: list[int] = []

    def piece(start: int, stop: int) -> list[int]:
        if start == 4:
            raise OSError(5, "Input/output error")
        time.sleep(0.01)  # still working when the failing piece has failed
        done.append(start)
        return list(range(start, stop))

    with pytest.raises(OSError, match="Input/output error"):
        threads.map_rows(piece, 48, 3, min_piece=4, placed=True)
    assert sorted(done) == [start for start in range(0, 48, 4) if start != 4]


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


def test_two_callers_at_once_get_their_own_bytes_and_the_threads_their_masks_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The L3 writer and a prefetch read one backend at once: their batches' shares queue on the
    same I/O threads, each placed for its own batch; every object comes back whole and every
    thread ends with the mask it started with."""
    monkeypatch.setattr(_file_io, "_PLACE_FROM_BYTES", 0)  # these small gets placed too
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


@pytest.mark.parametrize("large", [True, False])
def test_large_reads_are_placed_and_writes_and_small_reads_are_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, large: bool
) -> None:
    """A large get's workers are held on CPUs (the caller waits); a put's are not (the caller is
    one of them): writes wait on the file system as much as they copy, and placed ran slower
    beside another process's busy loop. Nor are a small get's: holding costs a fixed time where
    another thread keeps a worker's CPU busy (here the threshold stands in for the 32 MiB one)."""
    monkeypatch.setattr(_file_io, "_PLACE_FROM_BYTES", 64 * 4096 if large else 64 * 4096 + 1)
    source = bytearray(os.urandom(64 * 4096))
    keys = [f"k{unit}" for unit in range(64)]
    backend = FileBackend("l3", FileConfig(path=tmp_path, io_threads=2))
    backend.open()
    writers: set[int] = set()
    readers: set[int] = set()
    put_one = backend._put_one
    writers_meet, readers_meet = FirstPiecesMeet(), FirstPiecesMeet()  # both workers take pieces

    def observed_put(obj: StorageObject) -> bool:
        writers_meet()
        writers.add(threading.get_ident())
        return put_one(obj)

    def observed_read(_row: int, _nbytes: int) -> None:
        readers_meet()
        readers.add(threading.get_ident())

    monkeypatch.setattr(backend, "_put_one", observed_put)
    try:
        assert all(backend.put(_objects(keys, source)))
        target = bytearray(len(source))
        read = backend.get(_objects(keys, target), check=observed_read)
        assert read == [4096] * 64 and target == source
    finally:
        backend.close()
    assert threading.get_ident() in writers
    placed = large and len(ALLOWED) >= 2 and _io_threads._cpu_reader() is not None
    assert (threading.get_ident() in readers) is not placed


class Running:
    """A piece that runs until released: how many pieces are running when the batch is over."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.now = 0
        self._lock = threading.Lock()

    def piece(self, start: int, stop: int) -> list[int]:
        with self._lock:
            self.now += 1
        self.started.set()
        self.release.wait(10)
        time.sleep(0.01)  # still writing into the caller's regions a moment after the release
        with self._lock:
            self.now -= 1
        return list(range(start, stop))


def test_a_worker_that_cannot_start_leaves_no_piece_running(
    threads: IOThreads, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool shut down (the backend closed) between two submits: the batch raised at once
    while the worker already started read on into the caller's regions, which the caller frees."""
    running = Running()
    real_submit = threads._pool.submit
    submitted: list[object] = []

    def submit(*args: object) -> object:
        if submitted:
            running.started.wait(10)
            threading.Timer(0.1, running.release.set).start()
            raise RuntimeError("cannot schedule new futures after shutdown")
        submitted.append(args)
        return real_submit(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(threads._pool, "submit", submit)
    with pytest.raises(RuntimeError, match="after shutdown"):
        threads.map_rows(running.piece, 64, 3, 8, placed=False)
    assert running.now == 0, "a piece was still running after the batch raised"


def test_an_interrupt_in_the_callers_wait_leaves_no_piece_running(
    threads: IOThreads, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A placed batch's caller only waits: an interrupt there (Ctrl-C during a large get) left
    the workers reading into regions the caller then freed."""
    running = Running()
    real_wait = _io_threads.wait
    calls: list[int] = []

    def wait(futures: object) -> object:
        calls.append(1)
        if len(calls) == 1:
            running.started.wait(10)
            threading.Timer(0.1, running.release.set).start()
            raise KeyboardInterrupt
        return real_wait(futures)  # type: ignore[arg-type]

    monkeypatch.setattr(_io_threads, "wait", wait)
    monkeypatch.setattr(threads, "_cpus_per_worker", lambda workers: [set(ALLOWED)] * workers)
    with pytest.raises(KeyboardInterrupt):
        threads.map_rows(running.piece, 64, 2, 8, placed=True)
    assert running.now == 0, "a piece was still running after the batch raised"
