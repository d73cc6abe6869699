"""The file backend's I/O threads: a batch cut into pieces of consecutive rows that its workers
take in turn, each worker held on CPUs no other worker of the batch uses while it runs.

Why placed: a get from the page cache is a memory copy and a hash per object, work two threads
share only on two CPUs. Linux wakes a thread on the CPU of the thread that woke it when it judges
them related, and two I/O threads handing the GIL to each other wake each other all the time: on
this project's 2-core machine, after the process had idled for a moment, both threads of a get
often landed on one CPU and stayed there for the whole batch (measured with the CPU each thread
ran on: a 256-page get of 256 KiB pages after 0.2 s idle took 44-45 us per page, one thread's
speed). So the first worker is held on the caller's CPU (the caller sleeps until the batch is
done) and the next on the caller's other CPU (on more CPUs, each worker gets a share of them; no
two workers share one): 29-33 us per page after the same idle. Held, a worker yields its CPU
once, so that another worker woken onto the same CPU runs and moves at once instead of waiting
out a time slice (without it the second worker started 1-4 ms late in about a third of such
gets). A worker's own CPU mask is restored when the batch is done.

Only reads are placed, and only long ones (the file backend places gets of 32 MiB or more: a
short batch does not win back what a held worker loses where another thread keeps its CPU busy
for a millisecond, see ``_file_io._PLACE_FROM_BYTES``). A put's workers wait on the file system
(create, rename, replace) as much as they copy: placed, they were no faster here when the
machine was quiet, and 25-35% slower with another process's busy loop on one CPU; they run
unplaced.

Why pieces taken in turn, not one fixed share per worker: a held worker cannot leave a CPU that
another process keeps busy. With fixed halves, a busy loop in another process made the worker
sharing its CPU the straggler: 58-67 us per page against 45-48 unplaced; taking 16-row pieces
as they finish, the worker on the free CPU does most of them: 48. Where the platform cannot
place threads (no ``sched_setaffinity`` or ``sched_getcpu``, one allowed CPU, a refused call)
workers run unplaced and the calling thread is one of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

log = logging.getLogger(__name__)

_R = TypeVar("_R")
#: ``fn(start, stop)``: the results of rows ``start`` to ``stop``, in order
Rows = Callable[[int, int], list[_R]]

#: pieces per worker a batch is cut into (fewer where pieces would drop below ``min_piece``)
_PIECES_PER_WORKER = 8


def _cpu_reader() -> Callable[[], int] | None:
    """``sched_getcpu`` from the C library (the CPU the calling thread runs on; Python has no
    binding), or None where there is none or no ``sched_setaffinity`` to act on it."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        getcpu = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return None
    getcpu.restype, getcpu.argtypes = ctypes.c_int, []
    return getcpu


def pieces(count: int, workers: int, min_piece: int) -> list[int]:
    """The bounds of the pieces of ``range(count)`` (each piece's start, then ``count``): about
    ``_PIECES_PER_WORKER`` per worker, none below ``min_piece`` rows but the last."""
    size = max(min_piece, -(-count // (workers * _PIECES_PER_WORKER)))
    return [*range(0, count, size), count]


class IOThreads:
    """A thread pool whose workers take a batch's pieces in turn, each held on CPUs of its own
    (see the module)."""

    def __init__(self, threads: int, name: str) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._current_cpu = _cpu_reader()

    @property
    def placing(self) -> bool:
        """Whether workers are placed on CPUs where the caller may run on more than one (False
        where the platform cannot or refused)."""
        return self._current_cpu is not None

    def map_rows(self, fn: Rows[_R], count: int, workers: int, min_piece: int, *, placed: bool) -> list[_R]:
        """``fn`` over ``range(count)`` in pieces of consecutive rows, ``workers`` threads taking
        the next piece as they finish one; the results joined in row order. Every piece is done
        before this returns or raises (the first error is raised): pieces read into and write
        from the caller's regions, which the caller may reuse as soon as the call is over.
        ``min_piece``: fewest rows worth a piece; ``placed``: hold the workers on CPUs of their
        own (for CPU-bound pieces: reads)."""
        bounds = pieces(count, workers, min_piece)
        parts: list[list[_R]] = [[] for _ in bounds[1:]]
        todo = iter(range(len(parts)))  # next() of a range iterator is atomic: one taker per piece

        def work() -> None:
            for k in todo:
                parts[k] = fn(bounds[k], bounds[k + 1])

        cpus = self._cpus_per_worker(workers) if placed else None
        futures: list[Future[None]] = []
        try:  # whatever raises here (a pool shut down between two submits, an interrupt in the
            # caller's wait), the workers started go on writing into the caller's regions: the
            # ``finally`` waits for them, so nothing is written after this returns or raises
            if cpus is None:  # unplaced: the calling thread is a worker instead of waiting idle
                for _ in range(workers - 1):
                    futures.append(self._pool.submit(work))
                work()
            else:
                for held in cpus:
                    futures.append(self._pool.submit(self._placed, work, held))
                wait(futures)
        finally:
            wait(futures)
        for future in futures:
            future.result()  # a worker's error, once every piece is done
        return [result for part in parts for result in part]

    def _cpus_per_worker(self, workers: int) -> list[set[int]] | None:
        """Per worker, the CPUs it may run on: the CPUs the caller may run on dealt out in turn,
        the caller's own first (so the first worker runs where the caller sleeps, and no two
        workers share a CPU until there are more workers than CPUs); None (unplaced) where the
        caller has one CPU or there is no way to tell which."""
        if self._current_cpu is None:
            return None
        here = self._current_cpu()
        if here < 0:
            return None
        order = [here, *sorted(os.sched_getaffinity(0) - {here})]
        if len(order) < 2:
            return None
        if workers >= len(order):
            return [{order[i % len(order)]} for i in range(workers)]
        return [set(order[i::workers]) for i in range(workers)]

    def _placed(self, work: Callable[[], None], cpus: set[int]) -> None:
        """One worker on this pool thread, held on ``cpus`` while it runs."""
        with self._held_on(cpus):
            work()

    @contextlib.contextmanager
    def _held_on(self, cpus: set[int]) -> Iterator[None]:
        """Hold this thread on ``cpus`` for the block, then give it its own mask back. A refused
        call turns placement off for this pool: the block runs wherever the thread is."""
        try:
            own = os.sched_getaffinity(0)
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            if self._current_cpu is not None:
                log.info("file backend I/O threads run unplaced: sched_setaffinity refused (%s)", exc)
            self._current_cpu = None
            own = None
        if own is not None:
            os.sched_yield()  # a worker queued behind this one on this CPU runs and moves now
        try:
            yield
        finally:
            if own is not None:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(0, own)

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)
