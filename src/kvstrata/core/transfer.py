"""Batched unit transfers between pool tiers (the byte views storage I/O needs: :mod:`object_views`).

All copies work on uint8 views of each buffer shaped ``(units, layers, layer_bytes)``, so any
dtype (bfloat16, float8 ...) moves bit-exactly and any layout pair works with the same code: one
``index_select`` / ``index_copy_`` per buffer, never a Python loop over pages. When one side's
indices form an ascending run, that side is a plain slice and the copy is a single pass. A buffer
held as an engine's per-layer tensors (:meth:`PoolBuffers.from_tensors`) is copied layer by layer
(a loop over layers, still never over pages).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvstrata.core.buffers import PoolBuffers
from kvstrata.core.pinned_alias import aliased_pairs, prefer_kernels
from kvstrata.core.row_copy import IndexList, UnitArrays, copy_few, copy_rows, unit_arrays
from kvstrata.core.tree_bytes import UNIT, unit_tensor

log = logging.getLogger(__name__)

#: the byte order of int64 unit bytes (numpy's native one, as the tree stores them)
_ORDER = sys.byteorder


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


@dataclass(slots=True)
class _PairViews:
    """What copies between two tiers reuse: their view pairs; between CPU tiers numpy arrays over
    them; between a CUDA tier and pinned host memory the same pairs with the host side as a CUDA
    view (:mod:`pinned_alias`), and the side stream the copies run on. One stream per pair, not
    one per call: a fresh pool stream each call made the caching allocator find no block for the
    call's temporaries on it (measured on an H200: 0.60 of the bus against 0.79 at 64 MiB)."""

    views: _Pairs
    arrays: UnitArrays | None
    aliases: _Pairs | None
    stream: torch.cuda.Stream | None = None

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=device)
        return self.stream


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


def settle_copies(handles: Sequence[TransferHandle]) -> None:
    """Wait for the copies already issued, each on its own: one that fails has nothing to wait
    for (a caller's first error is the one raised)."""
    for handle in handles:
        try:
            handle.wait()
        except Exception:
            continue


def issue_copies(
    copy: Callable[[PoolBuffers, Any, PoolBuffers, Any], TransferHandle],
    pairs: Sequence[tuple[PoolBuffers, PoolBuffers]],
    src_indices: Any,
    dst_indices: Any,
) -> list[TransferHandle]:
    """One ``copy`` per tier pair (a pool and its sidecars). Where one raises, those issued before
    it are waited for first: their handles would leave with the error, and no caller could wait
    for them before freeing or reusing the units an asynchronous copy still writes into."""
    handles: list[TransferHandle] = []
    try:
        for src, dst in pairs:
            handles.append(copy(src, src_indices, dst, dst_indices))
    except BaseException:
        settle_copies(handles)
        raise
    return handles


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
    if src_view.untyped_storage().data_ptr() == dst_view.untyped_storage().data_ptr():
        # one tier into itself (rows may overlap): read every source row before writing any
        count = src_idx.numel()
        rows = src_view[src_start : src_start + count] if src_start is not None else src_view[src_idx]
        src_view, src_start = rows.clone(), 0
        src_idx = torch.arange(count, device=src_view.device)
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


def _drain(side: torch.cuda.Stream) -> None:
    """Wait for the copies ``side`` holds when a copy raised part-way: no handle leaves with the
    error, so nothing else would wait before the caller frees or reuses the units they still read
    or write. Where waiting fails too (a broken CUDA context), the copy's own error is raised."""
    try:
        side.synchronize()
    except Exception:
        log.debug("waiting for the side stream after a failed copy failed too", exc_info=True)


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
    pass for a few (:func:`_index_list`): a chunked request copies a few units per call, where
    per-call overhead dominates. ``False`` for CUDA indices (never inspected: that would force a
    device sync)."""
    if indices.device.type != "cpu":
        return False
    listed = _index_list(pool, indices)
    if listed is not None:
        return listed[1]
    pool.check_indices(indices)  # none, or more than a few
    return contiguous_run(indices)


def _view_pairs(src: PoolBuffers, dst: PoolBuffers) -> _PairViews:
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
    pair = _PairViews(views, arrays, aliases)
    src.copy_views[id(dst)] = (dst, pair)
    return pair


def host_arrays(src: PoolBuffers, dst: PoolBuffers) -> UnitArrays | None:
    """The numpy arrays over two CPU tiers' unit views that :func:`copy_units` uses (None where
    the tiers are not both in host memory numpy can view), cached per pair: a caller copying one
    known-good unit (a state slot at every chunk) assigns rows without the index checks."""
    return _view_pairs(src, dst).arrays


def _index_list(pool: PoolBuffers, indices: torch.Tensor | Sequence[int]) -> IndexList | None:
    """A few CPU int64 indices as a bounds-checked list, and the start of their ascending run
    (None: not one); None for anything else (the general path). A run's bounds are its ends."""
    if type(indices) is not torch.Tensor or indices.dtype is not torch.int64 or indices.dim() != 1:
        return None
    if indices.device.type != "cpu" or not 0 < indices.shape[0] <= _SMALL_INDEX:
        return None
    values = indices.tolist()
    first, last = values[0], values[-1]
    run = first if last - first == len(values) - 1 and values == list(range(first, last + 1)) else None
    low, high = (first, last) if run is not None else (min(values), max(values))
    if low < 0 or high >= pool.units:
        pool.check_indices(indices)  # raises with the pool's message
    return values, run


def _raw_index(pool: PoolBuffers, raw: bytes) -> IndexList:
    """Units held as int64 bytes (the tree's, a lease's, an allocation's ``tobytes``) as a
    bounds-checked :data:`~kvstrata.core.row_copy.IndexList`: a run is told by its ends and one
    compare with the run's own bytes, so no tensor, list or reduction is made for it."""
    count = len(raw) // UNIT
    if count * UNIT != len(raw):
        raise ValueError(f"unit indices as int64 bytes: {len(raw)} bytes is not a whole number of them")
    first = int.from_bytes(raw[:UNIT], _ORDER, signed=True)
    last = int.from_bytes(raw[-UNIT:], _ORDER, signed=True)
    units: range | np.ndarray
    if last - first == count - 1 and raw == np.arange(first, last + 1, dtype=np.int64).tobytes():
        units, run, low, high = range(first, last + 1), first, first, last
    else:
        units, run = np.frombuffer(raw, dtype=np.int64), None
        low, high = int(units.min()), int(units.max())
    if low < 0 or high >= pool.units:
        pool.check_indices(unit_tensor(raw))  # raises with the pool's message
    return units, run


def copy_unit_bytes(src: PoolBuffers, src_raw: bytes, dst: PoolBuffers, dst_raw: bytes) -> TransferHandle:
    """:func:`copy_units` for units held as int64 bytes (what the tree stores and the allocators'
    arrays give): a few between CPU tiers checked and copied straight from the bytes (a
    write-through batch copies a few dozen units per pool, where building tensors and lists of
    them cost more than the copy), else through :func:`copy_units`."""
    if len(src_raw) != len(dst_raw):
        raise ValueError(f"index lists differ in length: {len(src_raw) // UNIT} vs {len(dst_raw) // UNIT}")
    arrays = _view_pairs(src, dst).arrays
    if arrays is not None and len(src_raw) <= _SMALL_INDEX * UNIT:
        if not src_raw:
            return TransferHandle()
        if copy_few(arrays, _raw_index(src, src_raw), _raw_index(dst, dst_raw)):
            return TransferHandle()
    return copy_units(src, unit_tensor(src_raw), dst, unit_tensor(dst_raw))


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
    non-blocking on ``stream`` (else on the tier pair's own side stream) and the returned
    handle must be waited on; CPU-only copies are complete on return. Logical pools copy nothing.

    ``dst_indices`` must be distinct; that is not checked (a check costs a sort per copy on the
    hot path): every caller's destinations are units it has just allocated. A repeated one gets
    one of its sources (the last on CPU; on CUDA, unspecified).
    """
    pair = _view_pairs(src, dst)
    views, arrays = pair.views, pair.arrays
    if arrays is not None:  # between CPU tiers: a few units are one numpy assignment per view
        src_list, dst_list = _index_list(src, src_indices), _index_list(dst, dst_indices)
        if src_list is not None and dst_list is not None:
            if len(src_list[0]) != len(dst_list[0]):
                raise ValueError(f"index lists differ in length: {len(src_list[0])} vs {len(dst_list[0])}")
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
    side = stream or pair.side_stream(cuda_device)
    side.wait_stream(torch.cuda.current_stream(cuda_device))
    try:
        with torch.cuda.stream(side):
            if src.device != dst.device:
                _side_copies(pair, (src_idx, src_run), (dst_idx, dst_run), src.device.type, handle, side)
            handle.event = torch.cuda.Event()
            handle.event.record(side)
    except BaseException:  # copies issued before the one that raised are on ``side``, with no event
        _drain(side)
        raise
    return handle


def _side_copies(
    pair: _PairViews,
    src: tuple[torch.Tensor, int | bool | None],
    dst: tuple[torch.Tensor, int | bool | None],
    src_type: str,
    handle: TransferHandle,
    side: torch.cuda.Stream,
) -> None:
    """The copies of :func:`copy_units` between a CUDA tier and host memory, issued on ``side``
    (the current stream): ``src`` / ``dst`` are the indices and their :func:`_checked_run`.

    The index tensors the copies read are kept in ``handle`` until it is waited for: a caller's
    CUDA indices were allocated on its own stream, so once it dropped them the caching allocator
    could hand their memory to that stream's next tensor while the side stream still read them."""
    (src_idx, src_run), (dst_idx, dst_run) = src, dst
    views, aliases = pair.views, pair.aliases
    src_device, dst_device = views[0][0].device, views[0][1].device
    host = 0 if src_type == "cpu" else 1
    cuda_device = (src_device, dst_device)[1 - host]
    if aliases is not None and prefer_kernels(
        [p[host] for p in views], (src_run, dst_run)[host], src_idx.numel()
    ):
        # device kernels gather and scatter the host units where they lie; a side whose
        # indices are a run is a slice, so the kernel reads or writes it in place (one pass
        # on the device, not a gather into a temporary and a second kernel over it)
        runs = [None if run is False else run for run in (src_run, dst_run)]  # False: CUDA indices
        src_at, dst_at = (
            idx if run is not None else idx.to(cuda_device, non_blocking=True)
            for idx, run in zip((src_idx, dst_idx), runs, strict=True)
        )
        handle.keep_alive += (src_at, dst_at)
        for src_view, dst_view in aliases:
            _copy_rows(src_view, src_at, runs[0], dst_view, dst_at, runs[1])
        return
    src_at, src_start = _placed(src_idx, src_device, non_blocking=True)
    dst_at, dst_start = _placed(dst_idx, dst_device, non_blocking=True)
    handle.keep_alive += (src_at, dst_at)
    rows = torch.arange(src_idx.numel())
    for src_view, dst_view in views:
        _cross_copy(src_view, src_at, src_start, dst_view, dst_at, dst_start, rows, handle.keep_alive, side)
