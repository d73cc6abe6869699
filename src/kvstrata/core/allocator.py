"""Unit allocators: hand out page / slot indices of one pool and catch double frees.

One allocator per index space. Sidecars own none: they use their index source's indices, which is
what keeps an anchor page and its sidecar pages at the same index.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import torch


class AllocatorError(ValueError):
    """A free of indices that are not currently allocated (double free, or foreign indices)."""


def _as_cpu_index(indices: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Indices as a flat int64 CPU tensor."""
    return torch.as_tensor(indices, dtype=torch.int64).flatten().cpu()


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
        # the free list as a queue of index chunks: alloc and free touch only the chunks they
        # take or give back, never the whole list (a pool may have millions of units)
        self._chunks: deque[torch.Tensor]
        self._available: int
        self._in_use = torch.zeros(units, dtype=torch.bool)
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
        if count < 0:
            raise ValueError(f"allocator {self.name!r}: cannot allocate {count} units")
        with self._lock:
            if count > self._available:
                return None
            parts, need = [], count
            while need:
                chunk = self._chunks[0]
                if len(chunk) <= need:
                    parts.append(self._chunks.popleft())
                    need -= len(chunk)
                else:
                    parts.append(chunk[:need])
                    self._chunks[0] = chunk[need:]
                    need = 0
            if not parts:
                return torch.empty(0, dtype=torch.int64)
            taken = parts[0].clone() if len(parts) == 1 else torch.cat(parts)
            self._available -= count
            self._in_use[taken] = True
            return taken

    def free(self, indices: torch.Tensor | Sequence[int]) -> None:
        """Return indices; raises :class:`AllocatorError` naming the offending ones on misuse."""
        idx = _as_cpu_index(indices)
        count = idx.numel()
        if count == 0:
            return
        with self._lock:
            low, high = torch.aminmax(idx)
            if int(low) < 0 or int(high) >= self.units:
                foreign = idx[(idx < 0) | (idx >= self.units)]
                raise AllocatorError(
                    f"allocator {self.name!r}: indices {foreign[:8].tolist()} are outside [0, {self.units})"
                )
            flags = self._in_use[idx]
            if not bool(flags.all()):
                raise AllocatorError(
                    f"allocator {self.name!r}: double free or never allocated: "
                    f"indices {idx[~flags][:8].tolist()}"
                )
            duplicated = (
                len(set(idx.tolist())) != count if count <= 4096 else torch.unique(idx).numel() != count
            )
            if duplicated:
                raise AllocatorError(f"allocator {self.name!r}: the same index appears twice in one free")
            self._in_use[idx] = False
            self._chunks.append(idx.clone())  # the caller may reuse its tensor
            self._available += count

    def is_allocated(self, indices: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Per index: whether it is currently allocated (bool tensor)."""
        idx = _as_cpu_index(indices)
        with self._lock:
            return self._in_use[idx].clone()

    def reset(self) -> None:
        """Free everything (e.g. after a cache flush)."""
        with self._lock:
            self._chunks = deque([torch.arange(self.units, dtype=torch.int64)] if self.units else [])
            self._available = self.units
            self._in_use.zero_()
