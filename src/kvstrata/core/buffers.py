"""The tensors of one pool on one tier, allocated from its :class:`PoolSpec`.

Every pool's memory on a tier is ONE uint8 allocation (``backing``) carved into per-buffer views.
One allocation per pool keeps registration with a storage backend (RDMA / shared memory) to one
region per pool and lets a backend-provided allocator supply the memory.

Layouts (``L`` = layers of the buffer, ``U`` = units = pages or slots):

``layer_first``
    per buffer a tensor ``(L, U, *unit_shape)`` -- the device layout: one layer of every page is
    contiguous, so per-layer loads are cheap; a unit's object is ``buffers x L`` regions.
``page_first_direct``
    per buffer a tensor ``(U, L, *unit_shape)``: all layers of one unit of one buffer are
    contiguous; a unit's object is one region per buffer.
``page_first``
    the backing viewed as ``(U, bytes_per_unit)``; inside a unit the bytes are ordered object by
    object, buffer by buffer (object order), layer by layer. Each stored object of a unit is a
    single contiguous region -- the cheapest layout for storage I/O.

Whatever the layout, an object's bytes are *the same sequence*: its buffers in object order, each
buffer layer by layer. So an object written from one layout reads back into any other.

Engine-supplied memory (:meth:`PoolBuffers.from_tensors`): a device tier may instead be the
engine's own tensors, one per buffer -- ``(L, U, *unit_shape)`` (layer_first), a sequence of ``L``
per-layer tensors ``(U, *unit_shape)`` (layer_first, how paged engines keep KV), or
``(U, L, *unit_shape)`` (page_first_direct). Each unit must be contiguous in memory; units and
layers may be strided (a K half of a ``[pages, 2, page, heads, dim]`` tensor is fine). Such a tier
has no ``backing`` and no zero-copy regions (storage I/O only reads host tiers).

Unit access for engines: :meth:`PoolBuffers.read_units` (a copy), :meth:`PoolBuffers.write_units`
and the zero-copy :meth:`PoolBuffers.buffer_view` speak typed tensors ``(n, [L,] *unit_shape)``
in the buffer's dtype and declared unit layout; bytes move as integer words, so every dtype (fp8,
NaN payloads ...) round-trips bit-exactly.
"""

from __future__ import annotations

__all__ = ["EngineTensor", "PoolBuffers", "engine_tensor_units", "torch_dtype"]

import ctypes
from collections.abc import Callable, Mapping
from typing import Any

import torch

from kvstrata.core.engine_tensors import (
    EngineTensor,
    check_engine_tensors,
    engine_tensor_units,
    torch_dtype,
)
from kvstrata.core.unit_access import WORDS as _WORDS
from kvstrata.core.unit_access import Placement, UnitAccess
from kvstrata.plugins.pool_type import BufferSpec, Layout, PoolSpec
from kvstrata.plugins.storage_backend import BufferRegion

#: Buffer start alignment inside a pool's backing (bytes): enough for any dtype view and for DMA.
ALIGNMENT = 256


#: Allocates ``nbytes`` of host memory and returns where it is (a backend's shared-memory pool).
HostAllocatorFn = Callable[[int], BufferRegion]


def _align(value: int) -> int:
    return (value + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def region_tensor(region: BufferRegion) -> torch.Tensor:
    """Wrap foreign host memory as a uint8 CPU tensor (no copy); the owner must outlive it."""
    if region.nbytes <= 0:
        raise ValueError(f"host allocator returned an empty region ({region.nbytes} bytes)")
    array = (ctypes.c_uint8 * region.nbytes).from_address(region.ptr)
    return torch.frombuffer(array, dtype=torch.uint8, count=region.nbytes)


def buffer_order(spec: PoolSpec) -> list[BufferSpec]:
    """Buffers in object order (object by object, buffer names in the object's order)."""
    by_name = {buffer.name: buffer for buffer in spec.buffers}
    return [by_name[name] for obj in spec.objects for name in obj.buffers]


def _indexed(device: torch.device | str) -> torch.device:
    """``cuda`` as the device it means now (``cuda:0``): a tensor's device always carries its
    index, and tiers and tensors compare devices with ``==``."""
    device = torch.device(device)
    if device.type in ("cpu", "meta") or device.index is not None:
        return device
    return torch.empty(0, device=device).device


class PoolBuffers(UnitAccess):
    """The memory of one pool on one tier: ``units`` pages or slots in ``layout``.

    A logical pool (no buffers) allocates nothing but still has ``units`` indices.
    """

    def __init__(
        self,
        spec: PoolSpec,
        units: int,
        *,
        device: torch.device | str = "cpu",
        layout: Layout = Layout.LAYER_FIRST,
        pin_memory: bool = False,
        allocator: HostAllocatorFn | None = None,
    ) -> None:
        if units < 0:
            raise ValueError(f"pool {spec.name!r}: units must be >= 0, got {units}")
        layout = Layout(layout)
        if spec.buffers and layout not in spec.layouts:
            raise ValueError(
                f"pool {spec.name!r} ({spec.pool_type}) does not support layout {layout.value!r}; "
                f"supported: {[lay.value for lay in spec.layouts]}"
            )
        self.spec = spec
        self.units = units
        self.layout = layout
        self.device = _indexed(device)
        self.owned = True  # kvstrata allocated this memory (False: the engine's tensors)
        #: view pairs of copies to other tiers, by id(other tier) (see transfer._view_pairs)
        self.copy_views: dict[int, tuple[PoolBuffers, Any]] = {}
        #: per object suffix: its contiguous blocks in a unit (see object_views.object_blocks)
        self.object_blocks: dict[str, list[tuple[int, int, int, int]]] = {}
        self._layer_tensors: dict[str, list[torch.Tensor]] = {}  # engine buffers given per layer
        self.placements: dict[str, Placement] = {}
        self.unit_bytes = spec.bytes_per_unit
        self.object_offsets: dict[str, int] = {}  # page_first: object start inside a unit
        offset = 0
        for obj in spec.objects:
            self.object_offsets[obj.suffix] = offset
            offset += spec.object_bytes(obj.suffix)
        total = self._place()
        self.pinned = False
        self.backing: torch.Tensor | None = None
        if total:
            self.backing = self._allocate(total, pin_memory, allocator)
        self.tensors: dict[str, torch.Tensor] = {}
        if self.backing is not None and layout is not Layout.PAGE_FIRST:
            for name, place in self.placements.items():
                self.tensors[name] = self._typed_view(place)
        # construction-time facts only (placement, backing address, layout): computed once
        self._word_bytes = {name: self._widest_word(place) for name, place in self.placements.items()}

    @classmethod
    def from_tensors(
        cls,
        spec: PoolSpec,
        tensors: Mapping[str, EngineTensor],
        *,
        units: int | None = None,
        layout: Layout = Layout.LAYER_FIRST,
        device: torch.device | str | None = None,
    ) -> PoolBuffers:
        """A tier made of an engine's own tensors (no copy, no allocation): see the module docstring.

        Every buffer of ``spec`` needs a tensor of its dtype, shape and a unit-contiguous layout,
        all on one device (``device`` when given; a bare ``cuda`` accepts any index) with memory
        behind it (not ``meta``). ``units`` -- the expected unit count; None: read from the
        tensors. A mismatch raises one ``ValueError`` naming the pool, the buffer, what was
        expected and what was given.
        """
        units, whole, found, tier_device = check_engine_tensors(spec, tensors, units, Layout(layout), device)
        layout = Layout(layout)
        tier = cls.__new__(cls)
        tier.spec = spec
        tier.units = units
        tier.layout = layout
        tier.device = tier_device
        tier.owned = False
        tier.copy_views = {}
        tier.object_blocks = {}
        tier._layer_tensors = found
        tier.placements = {b.name: Placement(b, 0, b.bytes_per_unit * units) for b in spec.buffers}
        tier.unit_bytes = spec.bytes_per_unit
        tier.object_offsets = {}
        offset = 0
        for obj in spec.objects:
            tier.object_offsets[obj.suffix] = offset
            offset += spec.object_bytes(obj.suffix)
        tier.pinned = False
        tier.backing = None
        tier.tensors = whole
        tier._word_bytes = {buffer.name: tier._engine_word(buffer) for buffer in spec.buffers}
        return tier

    # --- allocation -------------------------------------------------------------------------

    def _place(self) -> int:
        """Compute buffer placements; returns the backing size in bytes."""
        offset = 0
        for buffer in buffer_order(self.spec):
            if self.layout is Layout.PAGE_FIRST:
                nbytes = buffer.bytes_per_unit
                self.placements[buffer.name] = Placement(buffer, offset, nbytes)
                offset += nbytes
            else:
                nbytes = buffer.bytes_per_unit * self.units
                self.placements[buffer.name] = Placement(buffer, offset, nbytes)
                offset = _align(offset + nbytes)
        if self.layout is Layout.PAGE_FIRST:
            return offset * self.units
        return offset

    def _allocate(self, nbytes: int, pin_memory: bool, allocator: HostAllocatorFn | None) -> torch.Tensor:
        if allocator is not None:
            if self.device.type != "cpu":
                raise ValueError(f"pool {self.spec.name!r}: a host allocator only serves cpu pools")
            region = allocator(nbytes)
            if region.nbytes < nbytes:
                raise ValueError(
                    f"pool {self.spec.name!r}: host allocator returned {region.nbytes} bytes, "
                    f"{nbytes} requested"
                )
            tensor = region_tensor(BufferRegion(region.ptr, nbytes))
            tensor.zero_()
            return tensor
        if pin_memory and self.device.type == "cpu" and torch.cuda.is_available():
            self.pinned = True
            return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        # zeros (not empty): the pages are touched now, so later memory checks see them as used.
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    def _typed_view(self, place: Placement) -> torch.Tensor:
        assert self.backing is not None
        buffer = place.spec
        raw = self.backing[place.offset : place.offset + place.nbytes]
        typed = raw.view(torch_dtype(buffer.dtype))
        if self.layout is Layout.LAYER_FIRST:
            return typed.view(buffer.layers, self.units, *buffer.unit_shape)
        return typed.view(self.units, buffer.layers, *buffer.unit_shape)

    # --- views ------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of memory behind the tier (its backing; an engine's tensors: the units' bytes)."""
        if not self.owned:
            return self.units * self.unit_bytes
        return 0 if self.backing is None else self.backing.numel()

    @property
    def data_ptr(self) -> int:
        """Address of the backing (0 without one, e.g. a tier of engine tensors)."""
        return 0 if self.backing is None else self.backing.data_ptr()

    @property
    def logical(self) -> bool:
        """True when the tier holds no bytes (a bufferless pool, or no units)."""
        return not self.spec.buffers or self.units == 0

    def split_layers(self, name: str) -> bool:
        """True when buffer ``name`` is the engine's per-layer tensors (no single view of all layers)."""
        self._placement(name)
        return name in self._layer_tensors

    def region(self) -> BufferRegion | None:
        """The whole allocation, for registration with a storage backend (None: not kvstrata's)."""
        if self.backing is None:
            return None
        return BufferRegion(self.backing.data_ptr(), self.backing.numel())

    def tensor(self, name: str) -> torch.Tensor:
        """Typed view of one buffer: ``(L, U, *shape)`` layer_first, ``(U, L, *shape)`` otherwise.

        For page_first the view is strided (buffers interleave inside a unit) and exists only when
        the buffer's offset is aligned to its itemsize.
        """
        if name in self.tensors:
            return self.tensors[name]
        place = self._placement(name)
        if name in self._layer_tensors:
            raise ValueError(
                f"pool {self.spec.name!r} buffer {name!r} is held as per-layer tensors; "
                "use buffer_view(name, layer=...)"
            )
        if self.backing is None or self.layout is not Layout.PAGE_FIRST:
            raise KeyError(name)
        buffer = place.spec
        per_unit = self.backing.view(self.units, self.unit_bytes)[
            :, place.offset : place.offset + place.nbytes
        ]
        try:
            typed = per_unit.view(torch_dtype(buffer.dtype))
        except RuntimeError as exc:
            raise ValueError(
                f"pool {self.spec.name!r}: buffer {name!r} is not aligned for a {buffer.dtype} view "
                "in page_first; use unit_view()"
            ) from exc
        return typed.unflatten(1, (buffer.layers, *buffer.unit_shape))

    def word_bytes(self, name: str) -> int:
        """Widest integer word (8, 4, 2 or 1 bytes) that tiles this buffer's bytes in every unit.

        Copies move words, not bytes: bit-exact either way, but far fewer elements per copy.
        """
        if name not in self._word_bytes:
            self._placement(name)  # raises the KeyError that lists this pool's buffers
        return self._word_bytes[name]

    def _widest_word(self, place: Placement) -> int:
        sizes = [place.spec.bytes_per_unit_per_layer, place.offset, self.data_ptr]
        if self.layout is Layout.PAGE_FIRST:
            sizes.append(self.unit_bytes)
        for word in (8, 4, 2):
            if all(size % word == 0 for size in sizes):
                return word
        return 1

    def unit_view(self, name: str, word_bytes: int = 1, *, layer: int | None = None) -> torch.Tensor:
        """View ``(U, L, layer_bytes / word_bytes)`` of one buffer in integer words: the transfer currency.

        ``word_bytes`` must divide :meth:`word_bytes` (1 always works: a uint8 view). ``layer``
        (a pool layer index) gives that layer's ``(U, layer_bytes / word_bytes)``; it is required
        for a buffer held as per-layer engine tensors (:meth:`split_layers`).
        """
        place = self._placement(name)
        buffer = place.spec
        if layer is not None:
            layer = self._check_layer(buffer, layer)
        if self.word_bytes(name) % word_bytes:
            raise ValueError(
                f"buffer {name!r} of pool {self.spec.name!r} is not tiled by {word_bytes}-byte words"
            )
        if not self.owned:
            return self._engine_words(name, word_bytes, layer)
        if self.backing is None:
            raise ValueError(f"pool {self.spec.name!r} holds no bytes (buffer {name!r}, {self.units} units)")
        view = self._owned_words(place, word_bytes)
        return view if layer is None else view[:, layer]

    def _owned_words(self, place: Placement, word_bytes: int) -> torch.Tensor:
        assert self.backing is not None
        buffer = place.spec
        word = _WORDS[word_bytes]
        layer_words = buffer.bytes_per_unit_per_layer // word_bytes
        if self.layout is Layout.PAGE_FIRST:
            per_unit = self.backing.view(self.units, self.unit_bytes).view(word)
            start, stop = place.offset // word_bytes, (place.offset + place.nbytes) // word_bytes
            return per_unit[:, start:stop].unflatten(1, (buffer.layers, layer_words))
        raw = self.backing[place.offset : place.offset + place.nbytes].view(word)
        if self.layout is Layout.LAYER_FIRST:
            return raw.view(buffer.layers, self.units, layer_words).transpose(0, 1)
        return raw.view(self.units, buffer.layers, layer_words)

    def _placement(self, name: str) -> Placement:
        try:
            return self.placements[name]
        except KeyError:
            raise KeyError(
                f"pool {self.spec.name!r} has no buffer {name!r}; buffers: {list(self.placements)}"
            ) from None

    def check_indices(self, indices: torch.Tensor) -> None:
        """Raise when an index is outside this pool (a foreign or stale index)."""
        if indices.numel() == 0:
            return
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= self.units:
            raise IndexError(
                f"pool {self.spec.name!r}: unit indices [{low}, {high}] outside [0, {self.units})"
            )

    def __repr__(self) -> str:
        return (
            f"PoolBuffers({self.spec.name!r}, units={self.units}, layout={self.layout.value}, "
            f"device={self.device}, bytes={self.nbytes})"
        )
