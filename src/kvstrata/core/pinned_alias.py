"""CUDA views of pinned host memory, so device kernels gather and scatter across the bus.

A copy between a CUDA tier and a host tier with scattered units on the host side would otherwise
cross the bus as one contiguous block and be scattered (or gathered) by the CPU, which runs at a
tenth of the bus on a GPU host. Pinned host memory has a device address under unified virtual
addressing, so an ``index_select`` / ``index_copy_`` kernel can read or write the host units
where they lie, in one pass over the bus (what SGLang's own transfer kernels do). torch builds
such a view from the CUDA array interface; where it cannot (memory not pinned, another device,
no CUDA), :func:`cuda_alias` answers ``None`` and the copy keeps its staged path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class _CudaArray:
    """The CUDA array interface (version 3) of ``nbytes`` bytes at ``address``."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


def cuda_alias(view: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """``view`` (host memory) as a tensor on ``device`` over the same bytes, or ``None``."""
    if view.device.type != "cpu" or device.type != "cuda" or not view.is_pinned():
        return None
    storage = view.untyped_storage()
    if storage.nbytes() % view.element_size():
        return None
    try:
        whole = torch.as_tensor(_CudaArray(storage.data_ptr(), storage.nbytes()))
    except (RuntimeError, TypeError, ValueError):
        return None
    if whole.device != device or whole.data_ptr() != storage.data_ptr():
        return None  # pinned for another device, or torch copied instead of viewing
    return whole.view(view.dtype).as_strided(view.shape, view.stride(), view.storage_offset())


def aliased_pairs(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """``(src, dst)`` view pairs between a CUDA tier and host memory with each host view as a
    CUDA view, or None where one cannot be."""
    aliased = []
    for src_view, dst_view in pairs:
        device = src_view.device if src_view.device.type == "cuda" else dst_view.device
        src_alias, dst_alias = (
            cuda_alias(v, device) if v.device.type == "cpu" else v for v in (src_view, dst_view)
        )
        if src_alias is None or dst_alias is None:
            return None
        aliased.append((src_alias, dst_alias))
    return aliased


def prefer_kernels(host_views: Sequence[torch.Tensor], host_run: int | bool | None, count: int) -> bool:
    """Whether kernels over the host views' CUDA aliases beat one DMA of a staged block (measured
    on an H200: 0.86-0.91 of the bus against 0.08-0.14 for scattered units): when the host units
    are scattered, or a run whose slice is not one contiguous block in some view. ``host_run``
    is the host indices' run start, None (scattered) or False (CUDA indices, never inspected:
    kernels, which need no look at them, where the staged path would first copy them back to
    the CPU -- measured 0.08 of the bus that way)."""
    if host_run is None or host_run is False:
        return True
    return not all(view[host_run : host_run + count].is_contiguous() for view in host_views)
