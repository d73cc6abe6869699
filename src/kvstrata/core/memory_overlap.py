"""Whether an engine's tensors give every unit its own memory.

An engine hands kvstrata its paged cache as strided tensors (:mod:`kvstrata.core.engine_tensors`):
each unit dense, units and layers anywhere. If two units -- of one tensor, or of two tensors --
share bytes, a write to one changes the other and a cached page reads back another's data, so
such tensors are refused. A tensor's units are blocks of ``block`` bytes at ``base + sum(i_k *
stride_k)``; the checks work on that geometry only, exactly where the layout is nested (each outer
dimension steps over everything inside it: every engine layout seen), else by enumerating the
blocks up to :data:`MAX_ENUMERATED_BLOCKS`, beyond which a layout is left unverified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

#: most blocks enumerated to settle a layout the stride tests cannot
MAX_ENUMERATED_BLOCKS = 1 << 22


@dataclass(frozen=True)
class Blocks:
    """The unit blocks of one tensor: ``block`` bytes at ``base + sum(i * stride)`` per outer
    dimension ``(stride, size)`` (in bytes, ascending, sizes above 1)."""

    base: int
    block: int
    dims: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, tensor: torch.Tensor, unit_shape: tuple[int, ...]) -> Blocks:
        item, lead = tensor.element_size(), tensor.dim() - len(unit_shape)
        dims = zip(tensor.shape[:lead], tensor.stride()[:lead], strict=True)
        outer = sorted((stride * item, size) for size, stride in dims if size > 1)
        return cls(tensor.data_ptr(), math.prod(unit_shape) * item, tuple(outer))

    @property
    def end(self) -> int:
        """One past the last byte any block reaches."""
        return self.base + sum((size - 1) * stride for stride, size in self.dims) + self.block

    @property
    def count(self) -> int:
        return math.prod(size for _, size in self.dims)

    @property
    def nested(self) -> bool:
        """Each dimension's stride clears everything inside it (so no two blocks overlap)."""
        extent = self.block
        for stride, size in self.dims:
            if stride < extent:
                return False
            extent += (size - 1) * stride
        return True

    def starts(self) -> np.ndarray:
        out = np.full(1, self.base, dtype=np.int64)
        for stride, size in self.dims:
            out = (out[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).ravel()
        return out


def overlaps_itself(blocks: Blocks) -> bool:
    """True when two blocks of one tensor share bytes (a broadcast, an overlapping view)."""
    if blocks.nested:
        return False
    if any(stride == 0 for stride, _ in blocks.dims):
        return True
    if blocks.count > MAX_ENUMERATED_BLOCKS:
        return False  # unverified
    starts = np.sort(blocks.starts())
    return bool((np.diff(starts) < blocks.block).any())


def _meets(delta: int, dims: tuple[tuple[int, int], ...], below: int, above: int) -> bool:
    """Whether some ``m = sum(j_k * stride_k)`` with ``|j_k| < size_k`` puts ``delta + m``
    strictly between ``below`` and ``above``. From the outermost dimension down, only the ``j``
    the inner dimensions can still correct are tried: a few for a nested layout."""
    if not dims:
        return below < delta < above
    (stride, size), inner = dims[-1], dims[:-1]
    reach = sum((n - 1) * s for s, n in inner)
    first = max(1 - size, (below - reach - delta) // stride + 1)
    last = min(size - 1, -((delta - above - reach) // stride) - 1)
    return any(_meets(delta + j * stride, inner, below, above) for j in range(first, last + 1))


def overlap_each_other(left: Blocks, right: Blocks) -> bool:
    """True when a block of ``left`` and one of ``right`` share bytes (neither overlaps itself)."""
    if left.end <= right.base or right.end <= left.base:
        return False
    if left.dims == right.dims and left.nested and right.nested:
        # one layout, shifted: blocks at a + x and b + y meet where -right.block < b - a + y - x < left.block
        return _meets(right.base - left.base, left.dims, -right.block, left.block)
    if left.count + right.count > MAX_ENUMERATED_BLOCKS:
        return False  # unverified
    starts = np.concatenate([left.starts(), right.starts()])
    sizes = np.concatenate([np.full(left.count, left.block), np.full(right.count, right.block)])
    order = np.argsort(starts, kind="stable")
    starts, sizes = starts[order], sizes[order]
    return bool((starts[1:] < starts[:-1] + sizes[:-1]).any())


def first_shared(parts: list[tuple[str, Blocks]]) -> tuple[str, str] | None:
    """The names of two parts whose blocks share bytes, or None: a sweep over the parts in order
    of their first byte, comparing those whose byte ranges meet."""
    ordered = sorted(parts, key=lambda part: part[1].base)
    for i, (name, blocks) in enumerate(ordered):
        for other, later in ordered[i + 1 :]:
            if later.base >= blocks.end:
                break
            if overlap_each_other(blocks, later):
                return name, other
    return None
