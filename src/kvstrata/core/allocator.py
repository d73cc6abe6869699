"""Unit allocators: hand out page / slot indices of one pool and catch double frees.

One allocator per index space. Sidecars own none: they use their index source's indices, which is
what keeps an anchor page and its sidecar pages at the same index.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch


class AllocatorError(ValueError):
    """A free of indices that are not currently allocated (double free, or foreign indices)."""


class UnitAllocator:
    """FIFO free list over ``units`` indices with an in-use bitmap for misuse detection.

    Fresh allocators hand out ascending runs (0, 1, 2, ...), which lets transfers take the
    contiguous fast path; freed units go to the back of the list. Thread-safe (storage threads free
    host units while the owner thread allocates).
    """

    def __init__(self, units: int, *, name: str = "pool") -> None:
        if units < 0:
            raise ValueError(f"allocator {name!r}: units must be >= 0, got {units}")
        self.name = name
        self.units = units
        self._lock = threading.Lock()
        self._free = torch.arange(units, dtype=torch.int64)
        self._in_use = torch.zeros(units, dtype=torch.bool)

    @property
    def available(self) -> int:
        """Units that ``alloc`` can hand out right now."""
        with self._lock:
            return int(self._free.numel())

    @property
    def used(self) -> int:
        return self.units - self.available

    def alloc(self, count: int) -> torch.Tensor | None:
        """``count`` free indices (int64, CPU), or ``None`` when fewer are free (nothing taken)."""
        if count < 0:
            raise ValueError(f"allocator {self.name!r}: cannot allocate {count} units")
        with self._lock:
            if count > self._free.numel():
                return None
            taken, self._free = self._free[:count].clone(), self._free[count:]
            self._in_use[taken] = True
            return taken

    def free(self, indices: torch.Tensor | Sequence[int]) -> None:
        """Return indices; raises :class:`AllocatorError` naming the offending ones on misuse."""
        idx = torch.as_tensor(indices, dtype=torch.int64).flatten().cpu()
        if idx.numel() == 0:
            return
        with self._lock:
            foreign = idx[(idx < 0) | (idx >= self.units)]
            if foreign.numel():
                raise AllocatorError(
                    f"allocator {self.name!r}: indices {foreign[:8].tolist()} are outside [0, {self.units})"
                )
            if torch.unique(idx).numel() != idx.numel():
                raise AllocatorError(f"allocator {self.name!r}: the same index appears twice in one free")
            not_allocated = idx[~self._in_use[idx]]
            if not_allocated.numel():
                raise AllocatorError(
                    f"allocator {self.name!r}: double free or never allocated: "
                    f"indices {not_allocated[:8].tolist()}"
                )
            self._in_use[idx] = False
            self._free = torch.cat([self._free, idx])

    def is_allocated(self, indices: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Per index: whether it is currently allocated (bool tensor)."""
        idx = torch.as_tensor(indices, dtype=torch.int64).flatten().cpu()
        with self._lock:
            return self._in_use[idx].clone()

    def reset(self) -> None:
        """Free everything (e.g. after a cache flush)."""
        with self._lock:
            self._free = torch.arange(self.units, dtype=torch.int64)
            self._in_use.zero_()
