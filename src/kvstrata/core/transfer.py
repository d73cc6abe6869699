"""Batched unit transfers between pool tiers and the byte views storage I/O needs.

All copies work on uint8 views of each buffer shaped ``(units, layers, layer_bytes)``, so any
dtype (bfloat16, float8 ...) moves bit-exactly and any layout pair works with the same code: one
``index_select`` / ``index_copy_`` per buffer, never a Python loop over pages. When one side's
indices form an ascending run, that side is a plain slice and the copy is a single pass. A buffer
held as an engine's per-layer tensors (:meth:`PoolBuffers.from_tensors`) is copied layer by layer
(a loop over layers, still never over pages).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvstrata.core.buffers import PoolBuffers
from kvstrata.core.integrity import MARKER_SUFFIX
from kvstrata.core.pinned_alias import aliased_pairs, prefer_kernels
from kvstrata.core.row_copy import UnitArrays, copy_few, copy_rows, unit_arrays
from kvstrata.plugins.pool_type import Layout, ObjectSpec
from kvstrata.plugins.storage_backend import BufferRegion


def as_index(indices: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Indices as a flat int64 tensor (kept on its device)."""
    if type(indices) is torch.Tensor and indices.dtype is torch.int64 and indices.dim() == 1:
        return indices  # what allocators hand out: no conversion
    tensor = torch.as_tensor(indices, dtype=torch.int64)
    return tensor.flatten()


def contiguous_run(indices: torch.Tensor) -> int | None:
    """The start of ``indices`` when they are ``start, start+1, ...``; else ``None``.

    Only evaluated for CPU indices (checking CUDA indices would force a device sync).
    """
    if indices.device.type != "cpu" or indices.numel() == 0:
        return None
    start = int(indices[0])
    if int(indices[-1]) - start != indices.numel() - 1:
        return None
    if indices.numel() > 1 and not bool((indices[1:] - indices[:-1] == 1).all()):
        return None
    return start


_Pairs = list[tuple[torch.Tensor, torch.Tensor]]
#: a tier pair's view pairs; between CPU tiers numpy arrays over them; between a CUDA tier and
#: pinned host memory the same pairs with the host side as a CUDA view (:mod:`pinned_alias`)
_Views = tuple[_Pairs, UnitArrays | None, _Pairs | None]


@dataclass
class TransferHandle:
    """Completion of a (possibly asynchronous) transfer; ``wait()`` before reading the destination."""

    event: torch.cuda.Event | None = None
    keep_alive: list[torch.Tensor] = field(default_factory=list)

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        self.keep_alive.clear()


def _check_compatible(src: PoolBuffers, dst: PoolBuffers) -> None:
    src_shape = [(b.name, b.layers, b.bytes_per_unit_per_layer) for b in src.spec.buffers]
    dst_shape = [(b.name, b.layers, b.bytes_per_unit_per_layer) for b in dst.spec.buffers]
    if sorted(src_shape) != sorted(dst_shape):
        raise ValueError(
            f"cannot copy units from pool {src.spec.name!r} to {dst.spec.name!r}: buffers differ "
            f"({src_shape} vs {dst_shape})"
        )


def _merge_layers(view: torch.Tensor) -> torch.Tensor | None:
    """``(U, L, W)`` as ``(U, L*W)`` when a unit's layers are adjacent in memory, else ``None``."""
    units, layers, words = view.shape
    if layers == 1 or (view.stride(2) == 1 and view.stride(1) == words):
        return view.reshape(units, layers * words)
    return None


def _copy_rows(
    src: torch.Tensor, src_idx: torch.Tensor, src_start: int | None,
    dst: torch.Tensor, dst_idx: torch.Tensor, dst_start: int | None,
) -> None:  # fmt: skip
    """Row gather/scatter on one device; a contiguous run on either side becomes a slice."""
    count = src_idx.numel()
    if dst_start is not None:
        target = dst[dst_start : dst_start + count]
        if src_start is not None:
            target.copy_(src[src_start : src_start + count])
        else:
            torch.index_select(src, 0, src_idx, out=target)
    elif src_start is not None:
        dst.index_copy_(0, dst_idx, src[src_start : src_start + count])
    else:
        dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))


def _local_copy(
    src_view: torch.Tensor, src_idx: torch.Tensor, src_start: int | None,
    dst_view: torch.Tensor, dst_idx: torch.Tensor, dst_start: int | None,
) -> None:  # fmt: skip
    """Same-device copy of ``(U, L, W)`` views: one op when both keep a unit's layers together,
    else one op per layer (rows of one layer are contiguous; a loop over layers, never pages).

    The indices are on the views' device; ``*_start`` are their :func:`contiguous_run`. On the
    CPU a scatter (also scattered -> scattered) is one pass of block ``memmove`` s
    (:mod:`~kvstrata.core.row_copy`); a gather into a run stays ``index_select``, as fast as a
    plain copy there."""
    if dst_start is None:
        count = src_idx.numel()
        src_rows = src_idx if src_start is None else src_start
        dst_rows = dst_idx if dst_start is None else dst_start
        if copy_rows(src_view, src_rows, dst_view, dst_rows, count):
            return
    src_merged, dst_merged = _merge_layers(src_view), _merge_layers(dst_view)
    if src_merged is not None and dst_merged is not None:
        _copy_rows(src_merged, src_idx, src_start, dst_merged, dst_idx, dst_start)
        return
    for layer in range(src_view.shape[1]):
        _copy_rows(src_view[:, layer], src_idx, src_start, dst_view[:, layer], dst_idx, dst_start)


def _cross_copy(
    src_view: torch.Tensor, src_idx: torch.Tensor, src_start: int | None,
    dst_view: torch.Tensor, dst_idx: torch.Tensor, dst_start: int | None,
    rows: torch.Tensor,
    keep_alive: list[torch.Tensor],
    stream: torch.cuda.Stream,
) -> None:  # fmt: skip
    """Copy between a CUDA pool and host memory: gather on the source side into a unit-major
    block, one DMA, scatter on the destination side (skipped where an index run is a slice).

    Indices as in :func:`_local_copy`; ``rows`` is ``arange(count)`` on the CPU (staging rows)."""
    count = src_idx.numel()
    pinned = src_view.device.type == "cuda"  # the host side of a D2H copy needs pinned staging
    if src_start is not None and src_view[src_start : src_start + count].is_contiguous():
        block = src_view[src_start : src_start + count]
    elif src_view.device.type == "cpu":
        block = torch.empty((count, *src_view.shape[1:]), dtype=src_view.dtype, pin_memory=True)
        _local_copy(src_view, src_idx, src_start, block, rows, 0)
    else:
        block = src_view.index_select(0, src_idx)
    keep_alive.append(block)
    if dst_start is not None and dst_view[dst_start : dst_start + count].is_contiguous():
        dst_view[dst_start : dst_start + count].copy_(block, non_blocking=True)
    elif dst_view.device.type == "cpu":
        staged = torch.empty(block.shape, dtype=block.dtype, pin_memory=pinned)
        staged.copy_(block, non_blocking=True)
        stream.synchronize()  # the CPU scatter below needs the bytes
        _local_copy(staged, rows, 0, dst_view, dst_idx, dst_start)
    else:
        staged = block.to(dst_view.device, non_blocking=True)
        keep_alive.append(staged)
        dst_view.index_copy_(0, dst_idx, staged)


def _placed(
    indices: torch.Tensor,
    device: torch.device,
    *,
    non_blocking: bool = False,
    run: int | bool | None = False,
) -> tuple[torch.Tensor, int | None]:
    """``indices`` on ``device`` and their :func:`contiguous_run`, read on whichever copy is on the
    CPU (CUDA indices are never inspected). ``non_blocking`` applies to CUDA targets only; ``run``
    is the run already computed for CPU indices (``False``: compute it)."""
    placed = indices.to(device, non_blocking=non_blocking and device.type == "cuda")
    if run is not False and indices.device.type == "cpu":
        return placed, run  # type: ignore[return-value]
    return placed, contiguous_run(indices if indices.device.type == "cpu" else placed)


#: up to this many CPU indices are checked in Python (one ``tolist``), cheaper than four reductions
_SMALL_INDEX = 256


def _checked_run(pool: PoolBuffers, indices: torch.Tensor) -> int | bool | None:
    """Bounds-check CPU ``indices`` against ``pool`` and return their contiguous run start, in one
    pass: a chunked request copies a few units per call, where per-call overhead dominates.
    ``False`` for CUDA indices (never inspected: that would force a device sync)."""
    if indices.device.type != "cpu":
        return False
    count = indices.numel()
    if count == 0 or count > _SMALL_INDEX:
        pool.check_indices(indices)
        return contiguous_run(indices)
    values = indices.tolist()
    low, high = min(values), max(values)
    if low < 0 or high >= pool.units:
        pool.check_indices(indices)  # raises with the pool's message
    start = values[0]
    return start if high - low == count - 1 and values == list(range(start, start + count)) else None


def _view_pairs(src: PoolBuffers, dst: PoolBuffers) -> _Views:
    """The ``(U, L, W)`` view pairs a copy between two tiers walks and, between CPU tiers, their
    numpy arrays (:func:`~kvstrata.core.row_copy.unit_arrays`), built (and the tiers checked
    compatible) once per pair: tiers live as long as the cache, and a chunked request copies a
    few pages at a time, so per-call set-up would otherwise dominate."""
    cached = src.copy_views.get(id(dst))
    if cached is not None and cached[0] is dst:
        return cached[1]
    _check_compatible(src, dst)
    views = []
    for name in src.placements:
        word = min(src.word_bytes(name), dst.word_bytes(name))
        if src.split_layers(name) or dst.split_layers(name):  # an engine's per-layer tensors
            layers = src.placements[name].spec.layers
            views.extend(
                (src.unit_view(name, word, layer=i)[:, None], dst.unit_view(name, word, layer=i)[:, None])
                for i in range(layers)
            )
        else:
            views.append((src.unit_view(name, word), dst.unit_view(name, word)))
    arrays = unit_arrays(views) if views and src.device == dst.device else None
    cross = {src.device.type, dst.device.type} == {"cuda", "cpu"}
    aliases = aliased_pairs(views) if views and cross else None
    src.copy_views[id(dst)] = (dst, (views, arrays, aliases))
    return views, arrays, aliases


def _index_list(pool: PoolBuffers, indices: torch.Tensor | Sequence[int]) -> list[int] | None:
    """A few CPU int64 indices as a bounds-checked list (None: not that; the general path)."""
    if type(indices) is not torch.Tensor or indices.dtype is not torch.int64 or indices.dim() != 1:
        return None
    if indices.device.type != "cpu" or not 0 < indices.shape[0] <= _SMALL_INDEX:
        return None
    values = indices.tolist()
    if min(values) < 0 or max(values) >= pool.units:
        pool.check_indices(indices)  # raises with the pool's message
    return values


def copy_units(
    src: PoolBuffers,
    src_indices: torch.Tensor | Sequence[int],
    dst: PoolBuffers,
    dst_indices: torch.Tensor | Sequence[int],
    *,
    stream: torch.cuda.Stream | None = None,
) -> TransferHandle:
    """Copy units ``src[src_indices[i]] -> dst[dst_indices[i]]`` for every buffer, bit-exactly.

    Works for any layout pair and any devices. Between CUDA and host memory the copies are issued
    non-blocking on ``stream`` (a side stream is created when none is given) and the returned
    handle must be waited on; CPU-only copies are complete on return. Logical pools copy nothing.
    """
    views, arrays, aliases = _view_pairs(src, dst)
    if arrays is not None:  # between CPU tiers: a few units are one numpy assignment per view
        src_list, dst_list = _index_list(src, src_indices), _index_list(dst, dst_indices)
        if src_list is not None and dst_list is not None:
            if len(src_list) != len(dst_list):
                raise ValueError(f"index lists differ in length: {len(src_list)} vs {len(dst_list)}")
            if copy_few(arrays, src_list, dst_list):
                return TransferHandle()
    src_idx, dst_idx = as_index(src_indices), as_index(dst_indices)
    if src_idx.numel() != dst_idx.numel():
        raise ValueError(f"index lists differ in length: {src_idx.numel()} vs {dst_idx.numel()}")
    handle = TransferHandle()
    if src_idx.numel() == 0 or src.logical:
        return handle
    src_run = _checked_run(src, src_idx)
    dst_run = _checked_run(dst, dst_idx)

    # the memory's own devices (a pool's ``device`` may be a bare "cuda")
    src_device, dst_device = views[0][0].device, views[0][1].device

    if src.device == dst.device:
        src_at, src_start = _placed(src_idx, src_device, run=src_run)
        dst_at, dst_start = _placed(dst_idx, dst_device, run=dst_run)
        for src_view, dst_view in views:
            _local_copy(src_view, src_at, src_start, dst_view, dst_at, dst_start)
        if src.device.type != "cuda":
            return handle
    cuda_device = src.device if src.device.type == "cuda" else dst.device
    side = stream or torch.cuda.Stream(device=cuda_device)
    side.wait_stream(torch.cuda.current_stream(cuda_device))
    with torch.cuda.stream(side):
        host = 0 if src.device.type == "cpu" else 1
        host_run = (src_run, dst_run)[host]
        if aliases is not None and prefer_kernels([pair[host] for pair in views], host_run, src_idx.numel()):
            # device kernels gather and scatter the host units where they lie, indexed on both
            # sides (a kernel reading or writing a strided host slice runs far below the bus)
            src_at, dst_at = (
                src_idx.to(cuda_device, non_blocking=True),
                dst_idx.to(cuda_device, non_blocking=True),
            )
            for src_view, dst_view in aliases:
                _copy_rows(src_view, src_at, None, dst_view, dst_at, None)
        elif src.device != dst.device:
            src_at, src_start = _placed(src_idx, src_device, non_blocking=True)
            dst_at, dst_start = _placed(dst_idx, dst_device, non_blocking=True)
            rows = torch.arange(src_idx.numel())
            for src_view, dst_view in views:
                _cross_copy(
                    src_view, src_at, src_start, dst_view, dst_at, dst_start, rows, handle.keep_alive, side
                )
        handle.event = torch.cuda.Event()
        handle.event.record(side)
    return handle


# --- storage views ----------------------------------------------------------------------------


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
    pool.check_indices(idx)
    if not pool.spec.objects and suffix == MARKER_SUFFIX:
        return [() for _ in range(idx.numel())]  # a bufferless pool's header-only marker object
    obj = _object(pool, suffix)
    if pool.backing is None or idx.numel() == 0:
        return [() for _ in range(idx.numel())]
    base = pool.data_ptr
    if pool.layout is Layout.PAGE_FIRST:
        starts = base + idx * pool.unit_bytes + pool.object_offsets[suffix]
        nbytes = pool.spec.object_bytes(suffix)
        return [(BufferRegion(ptr, nbytes),) for ptr in starts.tolist()]
    columns: list[torch.Tensor] = []
    sizes: list[int] = []
    for name in obj.buffers:
        place = pool.placements[name]
        buffer = place.spec
        layer_bytes = buffer.bytes_per_unit_per_layer
        if pool.layout is Layout.LAYER_FIRST:
            layers = torch.arange(buffer.layers, dtype=torch.int64)
            # (units, layers): layer l of unit u sits at (l * U + u) * layer_bytes
            starts = base + place.offset + (layers[None, :] * pool.units + idx[:, None]) * layer_bytes
            columns.append(starts)
            sizes.extend([layer_bytes] * buffer.layers)
        else:
            columns.append((base + place.offset + idx * buffer.bytes_per_unit)[:, None])
            sizes.append(buffer.bytes_per_unit)
    table = torch.cat(columns, dim=1).tolist()
    return [tuple(BufferRegion(ptr, size) for ptr, size in zip(row, sizes, strict=True)) for row in table]


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
