"""The byte views storage I/O needs of a pool's units: zero-copy regions of one object per unit,
and the copies between units and a contiguous staging buffer where a backend needs one.

Apart from :mod:`kvstrata.core.transfer` (copies between tiers) because storage reads objects,
not units: an object is a subset of a unit's buffers in a fixed byte order, whatever the layout.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from kvstrata.core.buffers import PoolBuffers
from kvstrata.core.integrity import MARKER_SUFFIX
from kvstrata.core.row_copy import copy_rows
from kvstrata.core.transfer import as_index
from kvstrata.plugins.pool_type import Layout, ObjectSpec
from kvstrata.plugins.storage_backend import BufferRegion


def object_regions(
    pool: PoolBuffers, suffix: str, indices: torch.Tensor | Sequence[int]
) -> list[tuple[BufferRegion, ...]]:
    """Zero-copy view of one object per unit: the memory regions holding its bytes, in order.

    The concatenation of the regions is the object's byte sequence (buffers in object order, each
    layer by layer), identical for every layout: one region per object in page_first, one per
    buffer in page_first_direct, one per buffer per layer in layer_first. A bufferless (logical)
    pool stores one header-only object per unit, ``MARKER_SUFFIX``: no regions at all.
    """
    if pool.device.type != "cpu" or not pool.owned:
        raise ValueError(
            f"pool {pool.spec.name!r}: zero-copy regions exist only for host memory kvstrata allocated"
        )
    idx = as_index(indices).cpu()
    units = idx.tolist()  # plain ints: a chunk's backup asks for a few units, tensor math costs more
    if units and (min(units) < 0 or max(units) >= pool.units):
        pool.check_indices(idx)  # raises with the pool's message
    if not pool.spec.objects and suffix == MARKER_SUFFIX:
        return [() for _ in units]  # a bufferless pool's header-only marker object
    obj = _object(pool, suffix)
    if pool.backing is None or not units:
        return [() for _ in units]
    base = pool.data_ptr
    if pool.layout is Layout.PAGE_FIRST:
        first, stride = base + pool.object_offsets[suffix], pool.unit_bytes
        nbytes = pool.spec.object_bytes(suffix)
        return [(BufferRegion(first + unit * stride, nbytes),) for unit in units]
    # per region of an object: where unit 0's bytes start and its size (the distance between units)
    parts: list[tuple[int, int]] = []
    for name in obj.buffers:
        place = pool.placements[name]
        buffer = place.spec
        start = base + place.offset
        if pool.layout is Layout.LAYER_FIRST:  # layer l of unit u sits at (l * U + u) * layer_bytes
            size = buffer.bytes_per_unit_per_layer
            parts.extend((start + layer * pool.units * size, size) for layer in range(buffer.layers))
        else:
            parts.append((start, buffer.bytes_per_unit))
    return [tuple([BufferRegion(at + unit * size, size) for at, size in parts]) for unit in units]


def _object(pool: PoolBuffers, suffix: str) -> ObjectSpec:
    for obj in pool.spec.objects:
        if obj.suffix == suffix:
            return obj
    raise KeyError(
        f"pool {pool.spec.name!r} has no object {suffix!r}; objects: {[o.suffix for o in pool.spec.objects]}"
    )


def _object_columns(pool: PoolBuffers, suffix: str, staging: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Per buffer of the object: the staging columns ``(n, L, layer_bytes)`` that hold it."""
    obj = _object(pool, suffix)
    expected = pool.spec.object_bytes(suffix)
    if staging.dtype != torch.uint8 or staging.dim() != 2 or staging.shape[1] != expected:
        raise ValueError(
            f"staging for object {suffix!r} of pool {pool.spec.name!r} must be uint8 (n, {expected}); "
            f"got {staging.dtype} {tuple(staging.shape)}"
        )
    columns = []
    offset = 0
    for name in obj.buffers:
        buffer = pool.placements[name].spec
        width = buffer.bytes_per_unit
        view = staging[:, offset : offset + width].unflatten(
            1, (buffer.layers, buffer.bytes_per_unit_per_layer)
        )
        columns.append((name, view))
        offset += width
    return columns


def read_objects(
    pool: PoolBuffers,
    suffix: str,
    indices: torch.Tensor | Sequence[int],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy path: the objects of ``indices`` into a contiguous uint8 ``(n, object_bytes)`` staging."""
    idx = as_index(indices).to(pool.device)
    pool.check_indices(idx)
    if out is None:
        out = torch.empty(idx.numel(), pool.spec.object_bytes(suffix), dtype=torch.uint8, device=pool.device)
    if out.shape[0] != idx.numel():
        raise ValueError(f"staging has {out.shape[0]} rows for {idx.numel()} units")
    for name, column in _object_columns(pool, suffix, out):
        if pool.split_layers(name):
            for layer in range(column.shape[1]):
                column[:, layer] = pool.unit_view(name, layer=layer).index_select(0, idx)
        else:
            torch.index_select(pool.unit_view(name), 0, idx, out=column)
    return out


def object_blocks(pool: PoolBuffers, suffix: str) -> list[tuple[int, int, int, int]]:
    """The contiguous blocks of one object in a unit of a host pool kvstrata allocated, in
    object byte order: ``(address in unit 0, bytes between units, bytes, offset in the object)``.

    Computed once per (pool, object): the layout is fixed for the pool's life. One block per
    object in page_first, one per buffer in page_first_direct, one per buffer and layer in
    layer_first (what :func:`object_regions` yields per unit)."""
    cached = pool.object_blocks.get(suffix)
    if cached is not None:
        return cached
    obj = _object(pool, suffix)
    base = pool.data_ptr
    blocks: list[tuple[int, int, int, int]] = []
    if pool.layout is Layout.PAGE_FIRST:
        nbytes = pool.spec.object_bytes(suffix)
        if nbytes:
            blocks.append((base + pool.object_offsets[suffix], pool.unit_bytes, nbytes, 0))
    else:
        offset = 0
        for name in obj.buffers:
            place = pool.placements[name]
            buffer = place.spec
            if pool.layout is Layout.LAYER_FIRST:
                layer_bytes = buffer.bytes_per_unit_per_layer
                for layer in range(buffer.layers):
                    start = base + place.offset + layer * pool.units * layer_bytes
                    blocks.append((start, layer_bytes, layer_bytes, offset))
                    offset += layer_bytes
            else:
                blocks.append((base + place.offset, buffer.bytes_per_unit, buffer.bytes_per_unit, offset))
                offset += buffer.bytes_per_unit
    pool.object_blocks[suffix] = blocks
    return blocks


def _write_objects_direct(pool: PoolBuffers, suffix: str, indices: list[int], staging: torch.Tensor) -> None:
    """:func:`write_objects` for a host pool kvstrata allocated and a contiguous CPU staging:
    one ``memmove`` per contiguous block (see :mod:`~kvstrata.core.row_copy` for why not torch).
    The block table is cached, so a one-page call -- SGLang's storage backends set pages one
    by one -- costs a few microseconds besides the copy."""
    blocks = object_blocks(pool, suffix)
    row_bytes = staging.shape[1]
    source = staging.data_ptr()
    memmove = ctypes.memmove
    for unit in indices:
        for start, stride, nbytes, offset in blocks:
            memmove(start + unit * stride, source + offset, nbytes)
        source += row_bytes


def write_objects(
    pool: PoolBuffers, suffix: str, indices: torch.Tensor | Sequence[int], staging: torch.Tensor
) -> None:
    """Copy path: write ``(n, object_bytes)`` staging rows into the units ``indices``."""
    if (
        pool.owned
        and pool.backing is not None
        and pool.device.type == "cpu"
        and staging.device.type == "cpu"
        and staging.dtype == torch.uint8
        and staging.dim() == 2
        and staging.is_contiguous()
        and staging.shape[1] == pool.spec.object_bytes(suffix)
        and staging.untyped_storage().data_ptr() != pool.backing.untyped_storage().data_ptr()
    ):
        units = as_index(indices).tolist()
        if len(units) != staging.shape[0]:
            raise ValueError(f"staging has {staging.shape[0]} rows for {len(units)} units")
        if units and (min(units) < 0 or max(units) >= pool.units):
            pool.check_indices(as_index(units))  # raises with the pool's message
        _write_objects_direct(pool, suffix, units, staging)
        return
    idx = as_index(indices).to(pool.device)
    pool.check_indices(idx)
    if staging.shape[0] != idx.numel():
        raise ValueError(f"staging has {staging.shape[0]} rows for {idx.numel()} units")
    for name, column in _object_columns(pool, suffix, staging):
        rows = column.to(pool.device)
        if not pool.split_layers(name) and copy_rows(rows, 0, pool.unit_view(name), idx, idx.numel()):
            continue  # one pass of block memmoves (torch's index_copy_ is slow on the CPU)
        if pool.split_layers(name):
            for layer in range(rows.shape[1]):
                pool.unit_view(name, layer=layer).index_copy_(0, idx, rows[:, layer])
        else:
            pool.unit_view(name).index_copy_(0, idx, rows)
