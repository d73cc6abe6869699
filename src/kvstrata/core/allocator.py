"""Unit allocators: hand out page / slot indices of one pool and catch double frees.

One allocator per index space. Sidecars own none: they use their index source's indices, which is
what keeps an anchor page and its sidecar pages at the same index.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch


class AllocatorError(ValueError):
    """A free of indices that are not currently allocated (double free, or foreign indices)."""


def _as_array(indices: torch.Tensor | Sequence[int]) -> np.ndarray:
    """Indices as a flat int64 numpy array (shares a CPU int64 tensor's memory: no copy)."""
    if isinstance(indices, torch.Tensor):
        if indices.dtype is not torch.int64 or indices.device.type != "cpu":
            indices = indices.to("cpu", torch.int64)
        return indices.detach().reshape(-1).numpy()
    return np.asarray(indices, dtype=np.int64).reshape(-1)


class UnitAllocator:
    """FIFO free list over ``units`` indices with an in-use bitmap for misuse detection.

    Fresh allocators hand out ascending runs (0, 1, 2, ...), which lets transfers take the
    contiguous fast path; freed units go to the back of the list. Thread-safe (storage threads free
    host units while the owner thread allocates).

    The free list and the bitmap are numpy arrays: an allocation is a few slices and one index
    assignment, and a numpy operation on a handful of indices costs a tenth of a torch one (an
    engine allocates for every chunk of every request, per pool and tier). Indices go out as
    int64 CPU tensors sharing a fresh array's memory.
    """

    def __init__(self, units: int, *, name: str = "pool") -> None:
        if units < 0:
            raise ValueError(f"allocator {name!r}: units must be >= 0, got {units}")
        self.name = name
        self.units = units
        self._lock = threading.Lock()
        # the free list as a queue of index chunks: alloc and free touch only the chunks they
        # take or give back, never the whole list (a pool may have millions of units)
        self._chunks: deque[np.ndarray]
        self._available: int
        self._in_use = np.zeros(units, dtype=np.bool_)
        self.reset()

    @property
    def available(self) -> int:
        """Units that ``alloc`` can hand out right now."""
        return self._available

    @property
    def used(self) -> int:
        return self.units - self._available

    def alloc(self, count: int) -> torch.Tensor | None:
        """``count`` free indices (int64, CPU), or ``None`` when fewer are free (nothing taken)."""
        taken = self.take(count)
        return None if taken is None else torch.from_numpy(taken)

    def take(self, count: int) -> np.ndarray | None:
        """:meth:`alloc` as the numpy array the tensor would share: for callers that keep the
        units as int64 bytes (a lease's pending units), one ``tobytes`` instead of a tensor's
        ``numpy()`` round trip per chunk."""
        if count < 0:
            raise ValueError(f"allocator {self.name!r}: cannot allocate {count} units")
        with self._lock:
            if count > self._available:
                return None
            if not count:
                return np.empty(0, dtype=np.int64)
            chunks = self._chunks
            chunk = chunks[0]
            if len(chunk) > count:  # the common case: one chunk, cut (its head handed out as is:
                taken = chunk[:count]  # the free list never writes into a chunk, only slices it)
                chunks[0] = chunk[count:]
            else:
                parts, need = [], count
                while need:
                    chunk = chunks[0]
                    if len(chunk) <= need:
                        parts.append(chunks.popleft())
                        need -= len(chunk)
                    else:
                        parts.append(chunk[:need])
                        chunks[0] = chunk[need:]
                        need = 0
                taken = parts[0].copy() if len(parts) == 1 else np.concatenate(parts)
            self._available -= count
            self._in_use[taken] = True
            return taken

    def free(self, indices: torch.Tensor | Sequence[int]) -> None:
        """Return indices; raises :class:`AllocatorError` naming the offending ones on misuse."""
        idx = _as_array(indices)
        count = idx.shape[0]
        if count == 0:
            return
        with self._lock:
            low, high = int(idx.min()), int(idx.max())
            if low < 0 or high >= self.units:
                foreign = idx[(idx < 0) | (idx >= self.units)]
                raise AllocatorError(
                    f"allocator {self.name!r}: indices {foreign[:8].tolist()} are outside [0, {self.units})"
                )
            flags = self._in_use[idx]
            if not flags.all():
                raise AllocatorError(
                    f"allocator {self.name!r}: double free or never allocated: "
                    f"indices {idx[~flags][:8].tolist()}"
                )
            # a contiguous ascending run (what alloc hands out) cannot repeat an index
            if not (high - low + 1 == count and (count == 1 or bool((np.diff(idx) == 1).all()))):
                duplicated = (
                    len(set(idx.tolist())) != count if count <= 4096 else np.unique(idx).shape[0] != count
                )
                if duplicated:
                    raise AllocatorError(f"allocator {self.name!r}: the same index appears twice in one free")
            self._in_use[idx] = False
            self._chunks.append(idx.copy())  # the caller may reuse its tensor
            self._available += count

    def is_allocated(self, indices: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Per index: whether it is currently allocated (bool tensor)."""
        idx = _as_array(indices)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.units):  # -1 would wrap
            raise AllocatorError(f"allocator {self.name!r}: indices outside [0, {self.units})")
        with self._lock:
            return torch.from_numpy(self._in_use[idx].copy())

    def reset(self) -> None:
        """Free everything (e.g. after a cache flush)."""
        with self._lock:
            self._chunks = deque([np.arange(self.units, dtype=np.int64)] if self.units else [])
            self._available = self.units
            self._in_use[:] = False
