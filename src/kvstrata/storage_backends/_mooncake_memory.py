"""The ``mooncake`` backend's memory: which host memory Mooncake can move bytes from (registered
ranges, standalone memfd allocations), the staging area for the rest, and the split of a batch
into Mooncake calls that fit it."""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import itertools
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from kvstrata.plugins.errors import StorageError
from kvstrata.plugins.storage_backend import BufferRegion, StorageObject
from kvstrata.storage_backends._mooncake_config import MooncakeConfig
from kvstrata.storage_backends._mooncake_protocol import INVALID_PARAMS, STAGING_TOO_SMALL

_log = logging.getLogger("kvstrata.storage_backends.mooncake")

#: (position of the object in one Mooncake call, scratch ptr, original ptr, nbytes, offset of the
#: region in its object)
_Staged = tuple[int, int, int, int, int]


class _Ranges:
    """Sorted, merged address intervals: answers "is [ptr, ptr+n) fully covered?" by bisection.

    Copy-on-write: ``add`` (under the backend's state lock) builds new lists and publishes them in
    one assignment, so a batch plan reads them without that lock. Edited in place, a plan running
    beside a registration saw the starts of one version with the ends of another and called a
    region in a gap registered (handing Mooncake memory it cannot move)."""

    def __init__(self) -> None:
        self._spans: tuple[list[int], list[int]] = ([], [])  # (starts, ends), never edited

    def covers(self, ptr: int, nbytes: int) -> bool:
        starts, ends = self._spans
        index = bisect.bisect_right(starts, ptr) - 1
        return index >= 0 and ptr + nbytes <= ends[index]

    def gaps(self, ptr: int, nbytes: int) -> list[tuple[int, int]]:
        """Sub-ranges of [ptr, ptr+n) not yet covered, as (start, length)."""
        starts, ends = self._spans
        out: list[tuple[int, int]] = []
        cursor, end = ptr, ptr + nbytes
        index = max(bisect.bisect_right(starts, ptr) - 1, 0)
        while cursor < end and index < len(starts):
            start, stop = starts[index], ends[index]
            if stop <= cursor:
                index += 1
                continue
            if start >= end:
                break
            if start > cursor:
                out.append((cursor, start - cursor))
            cursor = max(cursor, stop)
            index += 1
        if cursor < end:
            out.append((cursor, end - cursor))
        return out

    def add(self, ptr: int, nbytes: int) -> None:
        starts, ends = list(self._spans[0]), list(self._spans[1])
        start, end = ptr, ptr + nbytes
        index = bisect.bisect_left(ends, start)
        while index < len(starts) and starts[index] <= end:
            start = min(start, starts[index])
            end = max(end, ends[index])
            del starts[index], ends[index]
        starts.insert(index, start)
        ends.insert(index, end)
        self._spans = (starts, ends)


class MooncakeMemory:
    """The memory part of ``MooncakeBackend`` (a base class: the backend is one object)."""

    instance: str
    config: MooncakeConfig
    code_counts: Any  # collections.Counter[int]

    def _init_memory(self) -> None:
        self._registered = _Ranges()
        self._allocated_bytes = 0
        self._staging: BufferRegion | None = None
        self._staging_keepalive: Any = None  # owner of in-process staging memory
        self._staging_lock = threading.Lock()
        self._staging_growth = threading.Lock()
        self._state_lock = threading.Lock()
        #: native calls running on the store: ``close`` waits for them (closing the store under
        #: a running call crashed the process: an adapter closes while its I/O thread works)
        self._calls_running = 0
        self._calls_done = threading.Condition()

    def _live_store(self) -> Any:
        raise NotImplementedError

    @contextlib.contextmanager
    def _store_call(self) -> Iterator[Any]:
        """The open store for one native call, counted so ``close`` can wait for it to end."""
        with self._calls_done:
            store = self._live_store()  # raises once closed: no new call starts after close
            self._calls_running += 1
        try:
            yield store
        finally:
            with self._calls_done:
                self._calls_running -= 1
                if not self._calls_running:
                    self._calls_done.notify_all()

    def _detach_store(self) -> Any:
        """The store, no longer this backend's: every later call fails as not open."""
        with self._calls_done:
            store, self._store = self._store, None
        return store

    def _calls_ended(self, wait_s: float) -> bool:
        """Wait up to ``wait_s`` for the native calls still running on a detached store."""
        with self._calls_done:
            return self._calls_done.wait_for(lambda: not self._calls_running, timeout=wait_s)

    @property
    def _needs_registered_memory(self) -> bool:
        """Whether Mooncake can only move bytes from registered (or, standalone, memfd) memory."""
        return self.config.standalone or self.config.protocol != "tcp"

    def _new_staging_area(self, nbytes: int) -> BufferRegion:
        if self.config.standalone:
            return self.allocate_host_memory(nbytes, count_against_limit=False)
        buffer = ctypes.create_string_buffer(nbytes)
        region = BufferRegion(ctypes.addressof(buffer), nbytes)
        self.register_host_memory(region)
        # every area stays alive (a batch planned on an earlier one may still copy through it)
        self._staging_keepalive = (buffer, self._staging_keepalive)
        return region

    def _staging_for(self, need: int) -> BufferRegion | None:
        """The staging area, grown (doubling) to hold ``need`` bytes where it is smaller: a copy
        plan (an adapter's host pools in standalone mode) stages whole pages, and a 64-token page
        of an 8B model (8 MiB) is more than the default ``staging_bytes``."""
        staging = self._staging
        if staging is None or need <= staging.nbytes:
            return staging
        with self._staging_growth:
            staging = self._staging
            if staging is not None and need > staging.nbytes:
                size = staging.nbytes
                while size < need:
                    size *= 2
                _log.info("mooncake backend %r: staging area grown to %d bytes", self.instance, size)
                staging = self._staging = self._new_staging_area(size)
        return staging

    # -- host memory -----------------------------------------------------------------------------

    def allocate_host_memory(self, nbytes: int, *, count_against_limit: bool = True) -> BufferRegion:
        """Standalone mode: a new memfd region the mooncake_client maps, registered for zero-copy.

        Pools added after start get their own region, so the client's mapping always covers them;
        the only refusal is ``host_memory_limit_bytes`` or the OS failing the allocation.
        """
        cfg = self.config
        if not cfg.standalone:
            raise StorageError(
                f"mooncake backend {self.instance!r} allocates host memory only in standalone mode; "
                "in-process mode registers ordinary host memory (register_host_memory)"
            )
        if nbytes <= 0:
            raise StorageError(f"cannot allocate {nbytes} bytes of host memory: size must be positive")
        with self._store_call() as store, self._state_lock:
            limit = cfg.host_memory_limit_bytes
            if count_against_limit and limit is not None and self._allocated_bytes + nbytes > limit:
                raise StorageError(
                    f"mooncake backend {self.instance!r}: cannot allocate {nbytes} bytes of host memory "
                    f"from mooncake_client {cfg.client}: {self._allocated_bytes} of "
                    f"host_memory_limit_bytes={limit} are already allocated "
                    f"({self._allocated_bytes + nbytes - limit} bytes short); raise "
                    "host_memory_limit_bytes or shrink the pool"
                )
            ptr = int(store.alloc_from_mem_pool(nbytes))
            if ptr == 0:
                raise StorageError(
                    f"mooncake backend {self.instance!r}: alloc_from_mem_pool({nbytes}) failed "
                    "(memfd creation or mapping refused: check free memory and the cgroup's shmem limit)"
                )
            rc = store.register_buffer(ptr, nbytes)
            if rc != 0:
                raise StorageError(
                    f"mooncake backend {self.instance!r}: mooncake_client {cfg.client} refused to map "
                    f"a new {nbytes}-byte region (register_buffer returned {rc})"
                )
            self._registered.add(ptr, nbytes)
            if count_against_limit:
                self._allocated_bytes += nbytes
        return BufferRegion(ptr, nbytes)

    def register_host_memory(self, region: BufferRegion) -> None:
        """Register a host pool; already-registered parts are skipped, so overlaps are harmless."""
        if region.nbytes <= 0:
            raise StorageError(f"cannot register an empty host-memory region at {region.ptr:#x}")
        with self._store_call() as store, self._state_lock:
            if self._registered.covers(region.ptr, region.nbytes):
                return
            if self.config.standalone:
                raise StorageError(
                    f"mooncake backend {self.instance!r} is in standalone mode: host memory must come "
                    f"from allocate_host_memory (the mooncake_client maps only memfd regions it handed "
                    f"out); region {region.ptr:#x}+{region.nbytes} is not one of them"
                )
            for start, length in self._registered.gaps(region.ptr, region.nbytes):
                rc = store.register_buffer(start, length)
                if rc == INVALID_PARAMS:
                    # Registered by someone else in this process (overlap): usable as it is.
                    _log.debug("mooncake: %#x+%d already registered elsewhere", start, length)
                elif rc != 0:
                    raise StorageError(
                        f"mooncake backend {self.instance!r}: register_buffer({start:#x}, {length}) "
                        f"returned {rc}"
                    )
                self._registered.add(start, length)

    def _staging_guard(self, staged: list[_Staged]) -> contextlib.AbstractContextManager[Any]:
        return self._staging_lock if staged else contextlib.nullcontext()

    def _plan_batches(
        self, objects: Sequence[StorageObject]
    ) -> Iterator[tuple[list[int], list[list[int]], list[list[int]], list[_Staged]]]:
        """Yield (object indexes, ptr lists, size lists, staged copies) per Mooncake call.

        Staged copies are (position in this call, scratch ptr, original ptr, nbytes): regions
        Mooncake cannot read where they are. A batch is split when the staging area fills; an
        object whose unregistered bytes alone exceed the staging area is skipped (put: False;
        get: STAGING_TOO_SMALL).
        """
        if not self._needs_registered_memory:
            # In-process TCP reads any address: one call for the whole batch, no per-region checks.
            if any(not obj.regions for obj in objects):
                raise StorageError(f"mooncake backend {self.instance!r}: an object has no regions")
            if objects:
                yield (
                    list(range(len(objects))),
                    [[region.ptr for region in obj.regions] for obj in objects],
                    [[region.nbytes for region in obj.regions] for obj in objects],
                    [],
                )
            return
        staging = self._staging
        indexes: list[int] = []
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        staged: list[_Staged] = []
        used = 0
        for index, obj in enumerate(objects):
            if not obj.regions:
                raise StorageError(f"mooncake backend {self.instance!r}: object {obj.key!r} has no regions")
            obj_ptrs = [region.ptr for region in obj.regions]
            obj_sizes = [region.nbytes for region in obj.regions]
            offsets = list(itertools.accumulate(obj_sizes, initial=0))
            obj_staged = [
                (position, region.nbytes)
                for position, region in enumerate(obj.regions)
                if not self._registered.covers(region.ptr, region.nbytes)
            ]
            need = sum(_aligned(nbytes) for _, nbytes in obj_staged)
            if need and staging is not None and need > staging.nbytes:
                if indexes:  # the batch so far copies through the area it was planned on
                    yield indexes, ptrs, sizes, staged
                    indexes, ptrs, sizes, staged, used = [], [], [], [], 0
                try:
                    staging = self._staging_for(need)
                except StorageError as exc:  # no memory for a larger area: this object fails
                    _log.warning("mooncake backend %r: cannot grow the staging area: %s", self.instance, exc)
            capacity = staging.nbytes if staging is not None else 0
            if need and (staging is None or need > capacity):
                _log.warning(
                    "mooncake backend %r: object %r has %d unregistered bytes, more than staging_bytes=%d",
                    self.instance,
                    obj.key,
                    need,
                    capacity,
                )
                self.code_counts[STAGING_TOO_SMALL] += 1
                continue
            if need and used + need > capacity:
                yield indexes, ptrs, sizes, staged
                indexes, ptrs, sizes, staged, used = [], [], [], [], 0
            for position, nbytes in obj_staged:
                scratch = staging.ptr + used  # type: ignore[union-attr]
                staged.append((len(indexes), scratch, obj_ptrs[position], nbytes, offsets[position]))
                obj_ptrs[position] = scratch
                used += _aligned(nbytes)
            indexes.append(index)
            ptrs.append(obj_ptrs)
            sizes.append(obj_sizes)
        if indexes:
            yield indexes, ptrs, sizes, staged


def _aligned(nbytes: int, alignment: int = 64) -> int:
    return (nbytes + alignment - 1) // alignment * alignment
