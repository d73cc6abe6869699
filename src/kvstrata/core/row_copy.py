"""Single-pass gather/scatter of unit rows between two host (CPU) views: one ``memmove`` per
contiguous block, straight from source to destination.

Why not torch: on a CPU, ``index_copy_`` (a scatter) moves large rows at a fifth to two thirds of
a plain ``memcpy`` (measured here for 16 KiB - 2 MiB rows), and a scattered -> scattered copy with
``index_select`` + ``index_copy_`` is two passes whose temporary is fresh memory the kernel has to
fault in (0.4x of memcpy for 64 MiB). No torch or numpy op copies ``src[i] -> dst[j]`` in one
pass, and a compiled extension would be one more build for every install. A unit's row is a few
contiguous blocks of 4 KiB and more (a layer of a 64-token page), so a Python loop of
``ctypes.memmove`` -- about 0.4 us per call, GIL released during the copy -- reaches memcpy speed
with one pass over the bytes. Blocks smaller than :data:`MIN_BLOCK_BYTES` stay with torch, whose
per-row cost is lower there.
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Sequence
from itertools import repeat

import numpy as np
import torch

#: smallest contiguous block copied with one memmove; below it the per-call cost dominates
MIN_BLOCK_BYTES = 4096

_memmove = ctypes.memmove


def _blocks(view: torch.Tensor) -> tuple[int, list[int]] | None:
    """(bytes per block, byte offsets of the blocks inside a row) of a ``(U, ...)`` view whose
    last dimension is dense, merging trailing dimensions that are adjacent in memory."""
    if view.dim() < 2 or view.stride(-1) != 1:
        return None
    item = view.element_size()
    sizes, strides = list(view.shape[1:]), list(view.stride()[1:])
    block = sizes[-1]
    dims = len(sizes) - 1
    while dims > 0 and strides[dims - 1] == block:
        block *= sizes[dims - 1]
        dims -= 1
    offsets = [0]
    for size, stride in zip(sizes[:dims], strides[:dims], strict=True):
        offsets = [base + i * stride * item for base in offsets for i in range(size)]
    return block * item, offsets


def _addresses(view: torch.Tensor, rows: torch.Tensor | int, count: int, offsets: list[int]) -> list[int]:
    """Start address of every block of the selected rows, row-major (row, block)."""
    row_bytes = view.stride(0) * view.element_size()
    starts = torch.arange(rows, rows + count, dtype=torch.int64) if isinstance(rows, int) else rows
    base = starts * row_bytes + view.data_ptr()
    if len(offsets) == 1:
        return (base + offsets[0]).tolist() if offsets[0] else base.tolist()
    return (base[:, None] + torch.tensor(offsets, dtype=torch.int64)[None, :]).flatten().tolist()


def copy_rows(
    src: torch.Tensor,
    src_rows: torch.Tensor | int,
    dst: torch.Tensor,
    dst_rows: torch.Tensor | int,
    count: int,
) -> bool:
    """Copy ``src[src_rows[k]] -> dst[dst_rows[k]]`` for ``k < count`` in one pass, or return
    False (nothing copied) when these views are not worth or not safe to copy this way.

    ``*_rows`` are CPU int64 index tensors, or an int: the start of a run. Both views are on the
    CPU with equal row shapes; the caller has bounds-checked the indices. Views of the same
    storage are declined: a single pass over overlapping rows would not be a gather-then-scatter.
    """
    if src.device.type != "cpu" or dst.device.type != "cpu" or count == 0:
        return False
    if src.shape[1:] != dst.shape[1:] or src.element_size() != dst.element_size():
        return False
    if src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr():
        return False
    src_blocks, dst_blocks = _blocks(src), _blocks(dst)
    if src_blocks is None or dst_blocks is None:
        return False
    if src_blocks[0] != dst_blocks[0]:
        # different contiguity: fall back to the finer one (per last-dimension rows) on both sides
        src_blocks, dst_blocks = _blocks_of_last_dim(src), _blocks_of_last_dim(dst)
    block = src_blocks[0]
    if block < MIN_BLOCK_BYTES:
        return False
    src_at = _addresses(src, src_rows, count, src_blocks[1])
    dst_at = _addresses(dst, dst_rows, count, dst_blocks[1])
    deque(map(_memmove, dst_at, src_at, repeat(block, len(dst_at))), maxlen=0)
    return True


def _blocks_of_last_dim(view: torch.Tensor) -> tuple[int, list[int]]:
    """Blocks of exactly one last-dimension row each (no merging), for views whose merged
    blocks differ."""
    item = view.element_size()
    offsets = [0]
    for size, stride in zip(view.shape[1:-1], view.stride()[1:-1], strict=True):
        offsets = [base + i * stride * item for base in offsets for i in range(size)]
    return view.shape[-1] * item, offsets


# --- a few units between two CPU tiers: numpy views made once per tier pair ---------------------

#: the ``(U, L, W)`` view pairs of a copy between two CPU tiers, as numpy arrays sharing their memory
UnitArrays = list[tuple[np.ndarray, np.ndarray]]

#: a few bounds-checked unit indices (a list, a ``range`` or an int64 array), and the start of
#: their ascending run (None: not one)
IndexList = tuple[Sequence[int] | np.ndarray, int | None]

#: most bytes a scattered direct copy gathers into a temporary (above: the general path, whose
#: scatter is one pass of memmoves with no temporary)
MAX_GATHER_BYTES = 1 << 20


def unit_arrays(views: list[tuple[torch.Tensor, torch.Tensor]]) -> UnitArrays | None:
    """Numpy arrays over every view pair of a copy between two CPU tiers (no copy: the same
    memory), or None when a view is not on the CPU or has no numpy dtype. A numpy slice or
    fancy-index assignment of a few rows costs about a microsecond, a torch one several."""
    arrays: UnitArrays = []
    for src, dst in views:
        if src.device.type != "cpu" or dst.device.type != "cpu" or src.shape[1:] != dst.shape[1:]:
            return None
        try:
            arrays.append((src.numpy(), dst.numpy()))
        except (TypeError, RuntimeError):  # a dtype numpy lacks
            return None
    return arrays


def copy_few(arrays: UnitArrays, src: IndexList, dst: IndexList) -> bool:
    """Copy units ``src[k] -> dst[k]`` (each side: bounds-checked indices of equal lengths, a
    few, and the start of their ascending run, None if not one) between the views of
    :func:`unit_arrays`: one slice assignment per view where both sides are runs, else one
    fancy-index gather and scatter. Exact where source and destination rows overlap (numpy
    copies overlapping slices as if read first; a gather is a fresh array). False (nothing
    copied) for scattered units of more than :data:`MAX_GATHER_BYTES`."""
    (src_units, src_run), (dst_units, dst_run) = src, dst
    count = len(src_units)
    if src_run is not None and dst_run is not None:
        for src_array, dst_array in arrays:
            dst_array[dst_run : dst_run + count] = src_array[src_run : src_run + count]
        return True
    if count * sum(array[0].nbytes for array, _ in arrays) > MAX_GATHER_BYTES:
        return False
    # a side that is a run is a slice (no index array built from it)
    src_rows = slice(src_run, src_run + count) if src_run is not None else src_units
    dst_rows = slice(dst_run, dst_run + count) if dst_run is not None else dst_units
    for src_array, dst_array in arrays:
        dst_array[dst_rows] = src_array[src_rows]
    return True
