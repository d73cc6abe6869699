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
from itertools import repeat

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


# --- a few units between two CPU tiers: addresses computed once per tier pair -----------------

#: (src address, src unit stride, src layer stride, dst address, dst unit stride, dst layer
#: stride, layers, block bytes) of one view pair: layer ``l`` of unit ``u`` is ``block`` bytes at
#: ``address + u * unit stride + l * layer stride``
UnitBlocks = tuple[int, int, int, int, int, int, int, int]

#: most memmove calls one direct copy makes; above it torch's one-op-per-view path is cheaper
MAX_DIRECT_CALLS = 64


def unit_blocks(views: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[UnitBlocks], bool] | None:
    """The byte blocks of every ``(U, L, W)`` view pair of a copy between two CPU tiers, and
    whether a source and a destination share memory (then only copies that one ``memmove`` per
    block makes exact are taken); None when a view is not on the CPU or its words are not dense."""
    plan: list[UnitBlocks] = []
    shared = False
    for src, dst in views:
        if src.device.type != "cpu" or dst.device.type != "cpu" or src.dim() != 3 or dst.dim() != 3:
            return None
        if src.shape[1:] != dst.shape[1:] or src.element_size() != dst.element_size():
            return None
        if (src.shape[2] > 1 and src.stride(2) != 1) or (dst.shape[2] > 1 and dst.stride(2) != 1):
            return None
        item, layers, words = src.element_size(), src.shape[1], src.shape[2]
        block = words * item
        src_s, dst_s = [s * item for s in src.stride()], [s * item for s in dst.stride()]
        if layers > 1 and src_s[1] == block and dst_s[1] == block:  # a unit's layers are adjacent
            block, layers = block * layers, 1
        plan.append((src.data_ptr(), src_s[0], src_s[1], dst.data_ptr(), dst_s[0], dst_s[1], layers, block))
        shared = shared or src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr()
    return plan, shared


def copy_few(plan: list[UnitBlocks], shared: bool, src: list[int], dst: list[int]) -> bool:
    """Copy units ``src[k] -> dst[k]`` (bounds-checked, equal lengths) with one ``memmove`` per
    block, or return False (nothing copied) when that is not exact (overlapping scattered rows)
    or would take more than :data:`MAX_DIRECT_CALLS` calls. A chunked request copies a few
    units per call, where torch's per-op set-up costs more than the bytes."""
    count = len(src)
    first_src, first_dst = src[0], dst[0]
    runs = (
        src[-1] - first_src == count - 1
        and dst[-1] - first_dst == count - 1
        and (count == 1 or (_is_run(src, first_src) and _is_run(dst, first_dst)))
    )
    dense = runs and all(p[1] == p[7] and p[4] == p[7] for p in plan)
    if dense:  # one block per layer: exact even where the rows overlap (memmove)
        for src_at, src_unit, src_layer, dst_at, dst_unit, dst_layer, layers, block in plan:
            size, src_at, dst_at = block * count, src_at + first_src * src_unit, dst_at + first_dst * dst_unit
            for layer in range(layers):
                _memmove(dst_at + layer * dst_layer, src_at + layer * src_layer, size)
        return True
    if (shared and count > 1) or count * sum(p[6] for p in plan) > MAX_DIRECT_CALLS:
        return False
    for src_at, src_unit, src_layer, dst_at, dst_unit, dst_layer, layers, block in plan:
        for s, d in zip(src, dst, strict=True):
            s_at, d_at = src_at + s * src_unit, dst_at + d * dst_unit
            for layer in range(layers):
                _memmove(d_at + layer * dst_layer, s_at + layer * src_layer, block)
    return True


def _is_run(values: list[int], first: int) -> bool:
    return values == list(range(first, first + len(values)))
