"""The file backend's I/O threads: a batch split into contiguous chunks, each chunk's thread held
on CPUs no other chunk of the batch uses while it runs.

Why placed: a get from the page cache is a memory copy and a hash per object, work two threads
share only on two CPUs. Linux wakes a thread on the CPU of the thread that woke it when it judges
them related, and two I/O threads handing the GIL to each other wake each other all the time: on
this project's 2-core machine, after the process had idled for a moment, both threads of a get
often landed on one CPU and stayed there for the whole batch (measured with the CPU each thread
ran on: a 256-page get of 256 KiB pages after 0.2 s idle took 44-45 us per page, one thread's
speed). So the first chunk's thread is held on the caller's CPU (the caller sleeps until the
batch is done) and the next chunk's on the caller's other CPU (on more CPUs, each chunk gets a
share of them; no two chunks share one): 29-33 us per page after the same idle. Held, a thread
yields its CPU once, so that another chunk's thread woken onto the same CPU runs and moves at once
instead of waiting out a time slice (without it the second chunk started 1-4 ms late in about a
third of such gets). A thread's own CPU mask is restored when its chunk ends. Where the platform
cannot place threads (no ``sched_setaffinity`` or ``sched_getcpu``, one allowed CPU, a refused
call) chunks run unplaced and the calling thread works the first, as a thread pool would.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

log = logging.getLogger(__name__)

_R = TypeVar("_R")
Chunk = Callable[[int, int], list[_R]]


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


class IOThreads:
    """A thread pool that runs one batch's chunks, each on CPUs no other chunk uses (see the module)."""

    def __init__(self, threads: int, name: str) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._current_cpu = _cpu_reader()

    @property
    def placing(self) -> bool:
        """Whether chunks are placed on CPUs where the caller may run on more than one (False
        where the platform cannot or refused)."""
        return self._current_cpu is not None

    def map_chunks(self, fn: Chunk[_R], bounds: list[int]) -> list[_R]:
        """``fn(bounds[i], bounds[i + 1])`` for every chunk, the results joined in chunk order.
        Every chunk is done before this returns or raises: chunks read into and write from the
        caller's regions, which the caller may reuse as soon as the call is over."""
        chunks = len(bounds) - 1
        cpus = self._cpus_per_chunk(chunks)
        if cpus is None:  # unplaced: the calling thread works the first chunk instead of waiting
            futures = [self._pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(1, chunks)]
            try:
                results = fn(bounds[0], bounds[1])
            finally:
                wait(futures)
        else:
            futures = [
                self._pool.submit(self._placed, fn, cpus[i], bounds[i], bounds[i + 1]) for i in range(chunks)
            ]
            wait(futures)
            results = []
        for future in futures:
            results.extend(future.result())
        return results

    def _cpus_per_chunk(self, chunks: int) -> list[set[int]] | None:
        """Per chunk, the CPUs its thread may run on: the CPUs the caller may run on dealt out in
        turn, the caller's own first (so the first chunk runs where the caller sleeps, and no two
        chunks share a CPU until there are more chunks than CPUs); None (unplaced) where the
        caller has one CPU or there is no way to tell which."""
        if self._current_cpu is None:
            return None
        here = self._current_cpu()
        if here < 0:
            return None
        order = [here, *sorted(os.sched_getaffinity(0) - {here})]
        if len(order) < 2:
            return None
        if chunks >= len(order):
            return [{order[i % len(order)]} for i in range(chunks)]
        return [set(order[i::chunks]) for i in range(chunks)]

    def _placed(self, fn: Chunk[_R], cpus: set[int], start: int, stop: int) -> list[_R]:
        """One chunk on this pool thread, held on ``cpus`` while it runs."""
        own = self._hold(cpus)
        if own is not None:
            os.sched_yield()  # a chunk's thread queued behind this one here runs and moves now
        try:
            return fn(start, stop)
        finally:
            if own is not None:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(0, own)

    def _hold(self, cpus: set[int]) -> set[int] | None:
        """Hold this thread on ``cpus``; its own mask (None: not held). A refused call turns
        placement off for this pool: the chunk runs wherever it is."""
        try:
            own = os.sched_getaffinity(0)
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            if self._current_cpu is not None:
                log.info("file backend I/O threads run unplaced: sched_setaffinity refused (%s)", exc)
            self._current_cpu = None
            return None
        return own

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)
