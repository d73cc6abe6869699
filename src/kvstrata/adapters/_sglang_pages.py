"""How the pages of one SGLang host pool become kvstrata units (no ``sglang`` import needed here).

Four formats, picked per host pool when SGLang registers it with the adapter (``_sglang_describe``
decides which):

``CanonicalPages`` (exact conversion)
    For SGLang's ``MHATokenToKVPoolHost`` and ``MLATokenToKVPoolHost``, whose buffer shapes per
    host layout are known (``MHA_PAGE_VIEWS``, ``MLA_PAGE_VIEWS`` in ``_sglang_views``). A *page
    view* is a strided view of the host buffer shaped ``(pages, *canonical)`` whose C order per
    page is the stored byte order: for MHA, K then V, each ``(tokens, layers, heads, head_dim)``; for MLA
    ``(tokens, layers, row)`` -- the token-major order of SGLang's default ``page_first`` layout, so
    that default moves zero-copy (two runs per page, straight between host memory and the
    backend). Every other layout (``layer_first``, ``page_first_direct``, ``page_head``,
    ``page_unified``) converts exactly through one torch gather/scatter, so a page written from
    ``page_first`` reads back bit-exact into ``layer_first`` and vice versa.
``SplitKVPages`` (exact conversion)
    SGLang's asymmetric MHA pool (``head_dim != v_head_dim``, e.g. MiMo-V2: K and V in two buffers,
    no flat data page): K then V per page as above, each with its own head dim.
``FlatPages`` (opaque)
    Any other host pool (Mamba states, DSA indexer, DeepSeek-V4 pools, scaled MHA):
    the bytes of SGLang's own flat data page (``get_data_page`` / ``set_from_flat_data_page``, the
    format SGLang's file backend stores). Their order depends on the host layout, so the layout
    and pool class are part of the pool's identity (its key): another layout never reads them.
``MarkerPages``
    A host pool without bytes (DeepSeek-V4's logical anchor): one header-only marker per page.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstrata.adapters._sglang_views import MHA_CLASS
from kvstrata.plugins import (
    BufferRegion,
    PoolSpec,
)

#: A page is moved zero-copy when its canonical bytes form at most this many runs ...
ZERO_COPY_MAX_RUNS = 256
#: ... each at least this large; otherwise one torch gather/scatter through staging is cheaper.
ZERO_COPY_MIN_RUN_BYTES = 4096


#: Opaque pools are stored under this kvstrata pool type (backends declaring ``*`` store them).
OPAQUE_POOL_TYPE = "sglang_page"


def class_id(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def is_mha(pool: Any) -> bool:
    """Whether ``pool`` is SGLang's MHA host pool or a subclass: its pages hold one TP rank's heads."""
    return any(f"{cls.__module__}.{cls.__qualname__}" == MHA_CLASS for cls in type(pool).__mro__)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def digest(*parts: object) -> str:
    """Short stable digest of an identity (part of a pool's instance name, hence of its keys)."""
    text = "\0".join(str(part) for part in parts).encode()
    return hashlib.blake2b(text, digest_size=5, person=b"kvstrata-sgl-v1").hexdigest()


@dataclass
class Transfer:
    """The regions of one batch (per page: one region tuple per stored object) and what to do after."""

    units: list[list[tuple[BufferRegion, ...]]]
    #: after a read: copy the verified pages from staging into place (called with per-page ok)
    finish: Callable[[Sequence[bool]], None] = field(default=lambda ok: None)
    keep: Any = None  # staging that must outlive the I/O


def _tensor_region(tensor: torch.Tensor) -> BufferRegion:
    return BufferRegion(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def _rows(staging: torch.Tensor) -> list[list[tuple[BufferRegion, ...]]]:
    """One region per row of a contiguous staging tensor."""
    rows = staging.shape[0]
    if rows == 0:
        return []
    row_bytes = staging[0].numel() * staging.element_size()
    base = staging.data_ptr()
    return [[(BufferRegion(base + i * row_bytes, row_bytes),)] for i in range(rows)]


class PageFormat(ABC):
    """One registered SGLang host pool as kvstrata units (one unit = one page or state slot)."""

    spec: PoolSpec
    slots_per_page: int  # SGLang host-index granularity of one page (1 for state slots)
    zero_copy = False  # whether page I/O points straight into host memory
    unit_bytes = 0  # payload bytes of one page
    page_count = 0  # pages of the host pool (0: unknown, not checked)
    description: str

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    @property
    def name(self) -> str:
        return self.spec.name

    def pages(self, host_indices: torch.Tensor, count: int) -> torch.Tensor:
        """Page numbers of ``count`` pages whose host slots are ``host_indices``: integers, each
        page's slots whole and in order from a page-aligned start, no page twice (a page table
        that is not would store or load other slots' bytes under a key)."""
        slots = self.slots_per_page
        indices = torch.as_tensor(host_indices)
        if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
            raise ValueError(f"pool {self.name!r}: host indices must be integers, got {indices.dtype}")
        indices = indices.reshape(-1)
        if indices.numel() != count * slots:
            raise ValueError(
                f"pool {self.name!r}: {indices.numel()} host indices for {count} pages of {slots} slots"
            )
        runs = indices.to(device="cpu", dtype=torch.int64).view(count, slots)
        starts = runs[:, 0]
        if slots > 1 and bool((starts % slots).any()):
            raise ValueError(f"pool {self.name!r}: host indices are not page-aligned")
        if slots > 1 and not torch.equal(runs - starts[:, None], torch.arange(slots).expand(count, slots)):
            raise ValueError(f"pool {self.name!r}: a page's host indices are not its {slots} slots in order")
        pages = starts // slots
        # zero-copy I/O computes raw addresses from page numbers: never outside the host buffer
        if pages.numel() and (
            int(pages.min()) < 0 or (self.page_count and int(pages.max()) >= self.page_count)
        ):
            raise ValueError(f"pool {self.name!r}: host indices outside the pool's {self.page_count} pages")
        if count > 1 and int(torch.unique(pages).numel()) != count:
            raise ValueError(f"pool {self.name!r}: host indices name a host page twice")
        return pages

    def host_region(self) -> BufferRegion | None:
        """Host memory the backend may register for zero-copy I/O (None: nothing zero-copy)."""
        return None

    @abstractmethod
    def write_units(self, pages: torch.Tensor) -> Transfer: ...

    @abstractmethod
    def read_units(self, pages: torch.Tensor) -> Transfer: ...

    @abstractmethod
    def flat_write_units(self, values: Sequence[torch.Tensor]) -> Transfer:
        """SGLang's generic path: flat data pages (``get_data_page(flat=True)``) to store."""

    @abstractmethod
    def flat_read_units(self, targets: Sequence[torch.Tensor]) -> Transfer:
        """SGLang's generic path: flat pages to fill (``set_from_flat_data_page`` reads them)."""


class CanonicalPages(PageFormat):
    """Exact conversion between any supported host layout and kvstrata's canonical unit bytes."""

    def __init__(self, pool: Any, spec: PoolSpec, page_view: torch.Tensor, layout: str) -> None:
        super().__init__(pool)
        self.spec = spec
        self.slots_per_page = int(pool.page_size)
        self.view = page_view
        self.page_count = int(page_view.shape[0])
        self.canonical = tuple(page_view.shape[1:])
        self.itemsize = page_view.element_size()
        self.unit_bytes = math.prod(self.canonical) * self.itemsize
        page = page_view[0]
        # C order of a flat data page = the page slice in memory order (strides descending)
        self._native = sorted(range(page.dim()), key=lambda d: -page.stride(d))
        self._native_shape = [page.shape[d] for d in self._native]
        self._to_canonical = [self._native.index(d) for d in range(page.dim())]
        self._page_stride = page_view.stride(0) * self.itemsize
        self._run_offsets, self._run_bytes = self._runs(page)
        self.zero_copy = (
            len(self._run_offsets) <= ZERO_COPY_MAX_RUNS and self._run_bytes >= ZERO_COPY_MIN_RUN_BYTES
        )
        mode = f"zero-copy, {len(self._run_offsets)} run(s) per page" if self.zero_copy else "gather/scatter"
        self.description = f"{class_id(pool).rsplit('.', 1)[-1]} {layout}: exact ({mode})"

    def _runs(self, page: torch.Tensor) -> tuple[list[int], int]:
        """Byte offsets (from the page start, canonical order) and length of its contiguous runs."""
        run = 1
        inner = page.dim()
        while inner > 0:
            size, stride = page.shape[inner - 1], page.stride(inner - 1)
            if size != 1 and stride != run:
                break
            run *= size
            inner -= 1
        offsets = torch.zeros((), dtype=torch.int64)
        for d in range(inner):
            steps = torch.arange(page.shape[d], dtype=torch.int64) * page.stride(d)
            offsets = (offsets.unsqueeze(-1) + steps).reshape(-1)
        offsets = offsets.reshape(-1) * self.itemsize
        return offsets.tolist(), run * self.itemsize

    def host_region(self) -> BufferRegion | None:
        return _tensor_region(self.pool.kv_buffer) if self.zero_copy else None

    def _direct(self, pages: torch.Tensor) -> list[list[tuple[BufferRegion, ...]]]:
        base, stride, nbytes = self.view.data_ptr(), self._page_stride, self._run_bytes
        units = []
        for page in pages.tolist():
            start = base + page * stride
            units.append([tuple(BufferRegion(start + offset, nbytes) for offset in self._run_offsets)])
        return units

    def write_units(self, pages: torch.Tensor) -> Transfer:
        if self.zero_copy:
            return Transfer(self._direct(pages))
        staging = torch.empty((pages.numel(), *self.canonical), dtype=self.view.dtype)
        torch.index_select(self.view, 0, pages, out=staging)
        return Transfer(_rows(staging), keep=staging)

    def read_units(self, pages: torch.Tensor) -> Transfer:
        if self.zero_copy:
            return Transfer(self._direct(pages))
        staging = torch.empty((pages.numel(), *self.canonical), dtype=self.view.dtype)

        def finish(ok: Sequence[bool]) -> None:
            if all(ok):
                self.view.index_copy_(0, pages, staging)
                return
            rows = torch.tensor([i for i, hit in enumerate(ok) if hit], dtype=torch.int64)
            if rows.numel():
                self.view.index_copy_(0, pages[rows], staging[rows])

        return Transfer(_rows(staging), finish, staging)

    def _canonical_of_flat(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.numel() * flat.element_size() != self.unit_bytes or flat.dtype != self.view.dtype:
            raise ValueError(
                f"pool {self.name!r}: a flat page must be {self.unit_bytes} bytes of {self.view.dtype}, "
                f"got {flat.numel()} x {flat.dtype}"
            )
        return flat.reshape(self._native_shape).permute(self._to_canonical)

    def flat_write_units(self, values: Sequence[torch.Tensor]) -> Transfer:
        keep = []
        units = []
        for value in values:
            canonical = self._canonical_of_flat(value.contiguous()).contiguous()
            keep.append(canonical)
            units.append([(_tensor_region(canonical),)])
        return Transfer(units, keep=keep)

    def flat_read_units(self, targets: Sequence[torch.Tensor]) -> Transfer:
        views = [self._canonical_of_flat(target) for target in targets]
        staged = [
            None if view.is_contiguous() else torch.empty(self.canonical, dtype=view.dtype) for view in views
        ]
        units = [
            [(_tensor_region(view if stage is None else stage),)]
            for view, stage in zip(views, staged, strict=True)
        ]

        def finish(ok: Sequence[bool]) -> None:
            for view, stage, hit in zip(views, staged, ok, strict=True):
                if hit and stage is not None:
                    view.copy_(stage)

        return Transfer(units, finish, (targets, staged))


class FlatPages(PageFormat):
    """SGLang's own flat data page, stored as opaque bytes under a layout-specific identity."""

    def __init__(self, pool: Any, spec: PoolSpec, dummy: torch.Tensor, why: str) -> None:
        super().__init__(pool)
        self.spec = spec
        self.slots_per_page = int(getattr(pool, "page_size", 1) or 1)
        self.page_count = int(getattr(pool, "size", 0) or 0) // self.slots_per_page
        self.dtype = dummy.dtype
        self.unit_bytes = dummy.numel() * dummy.element_size()
        self.description = (
            f"{class_id(pool).rsplit('.', 1)[-1]} {getattr(pool, 'layout', '?')}: opaque ({why})"
        )

    def _check(self, flat: torch.Tensor) -> torch.Tensor:
        flat = flat.contiguous().reshape(-1)
        if flat.numel() * flat.element_size() != self.unit_bytes:
            raise ValueError(f"pool {self.name!r}: a flat page must be {self.unit_bytes} bytes")
        return flat

    def write_units(self, pages: torch.Tensor) -> Transfer:
        staging = torch.empty((pages.numel(), self.unit_bytes), dtype=torch.uint8)
        for row, page in enumerate(pages.tolist()):
            flat = self._check(self.pool.get_data_page(page * self.slots_per_page, flat=True))
            staging[row].copy_(flat.view(torch.uint8))
        return Transfer(_rows(staging), keep=staging)

    def read_units(self, pages: torch.Tensor) -> Transfer:
        staging = torch.empty((pages.numel(), self.unit_bytes), dtype=torch.uint8)

        def finish(ok: Sequence[bool]) -> None:
            for row, (page, hit) in enumerate(zip(pages.tolist(), ok, strict=True)):
                if hit:
                    self.pool.set_from_flat_data_page(
                        page * self.slots_per_page, staging[row].view(self.dtype)
                    )

        return Transfer(_rows(staging), finish, staging)

    def flat_write_units(self, values: Sequence[torch.Tensor]) -> Transfer:
        flats = [self._check(value) for value in values]
        return Transfer([[(_tensor_region(flat),)] for flat in flats], keep=flats)

    def flat_read_units(self, targets: Sequence[torch.Tensor]) -> Transfer:
        for target in targets:
            if not target.is_contiguous():
                raise ValueError(f"pool {self.name!r}: flat target pages must be contiguous")
            self._check(target)
        return Transfer([[(_tensor_region(target),)] for target in targets])


class MarkerPages(PageFormat):
    """A pool without bytes: one header-only marker object per page (the page's commit marker)."""

    def __init__(self, pool: Any, spec: PoolSpec) -> None:
        super().__init__(pool)
        self.spec = spec
        self.slots_per_page = int(getattr(pool, "page_size", 1) or 1)
        self.description = f"{class_id(pool).rsplit('.', 1)[-1]}: no bytes (marker objects)"

    def write_units(self, pages: torch.Tensor) -> Transfer:
        return Transfer([])

    def read_units(self, pages: torch.Tensor) -> Transfer:
        return Transfer([])

    def flat_write_units(self, values: Sequence[torch.Tensor]) -> Transfer:
        return Transfer([])

    def flat_read_units(self, targets: Sequence[torch.Tensor]) -> Transfer:
        return Transfer([])


class SplitKVPages(PageFormat):
    """K and V of different head dims in two host buffers (SGLang's asymmetric MHA pool, e.g.
    MiMo-V2, which has no flat data page): each page is stored exactly, K then V, each
    ``(tokens, layers, heads, dim)``, through one gather/scatter per buffer (two buffers are no one
    host region a backend could register, so never zero-copy)."""

    def __init__(self, pool: Any, spec: PoolSpec, parts: tuple[CanonicalPages, ...], layout: str) -> None:
        super().__init__(pool)
        self.spec = spec
        self.parts = parts
        for part in parts:
            part.zero_copy = False
        self.slots_per_page = parts[0].slots_per_page
        self.page_count = parts[0].page_count
        self.unit_bytes = sum(part.unit_bytes for part in parts)
        self.description = f"{class_id(pool).rsplit('.', 1)[-1]} {layout}: exact (K and V apart)"

    @staticmethod
    def _joined(transfers: list[Transfer]) -> Transfer:
        """One object per page: the parts' regions of that page, in order."""
        per_page = zip(*(transfer.units for transfer in transfers), strict=True)
        units = [[sum((unit[0] for unit in page), ())] for page in per_page]

        def finish(ok: Sequence[bool]) -> None:
            for transfer in transfers:
                transfer.finish(ok)

        return Transfer(units, finish, [transfer.keep for transfer in transfers])

    def write_units(self, pages: torch.Tensor) -> Transfer:
        return self._joined([part.write_units(pages) for part in self.parts])

    def read_units(self, pages: torch.Tensor) -> Transfer:
        return self._joined([part.read_units(pages) for part in self.parts])

    def flat_write_units(self, values: Sequence[torch.Tensor]) -> Transfer:
        raise NotImplementedError(f"pool {self.name!r}: SGLang gives this pool no flat data page")

    def flat_read_units(self, targets: Sequence[torch.Tensor]) -> Transfer:
        raise NotImplementedError(f"pool {self.name!r}: SGLang gives this pool no flat data page")
