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

import ctypes
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvstrata.plugins.pool_type import BufferSpec, Layout, PoolSpec
from kvstrata.plugins.storage_backend import BufferRegion

#: Buffer start alignment inside a pool's backing (bytes): enough for any dtype view and for DMA.
ALIGNMENT = 256

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: Allocates ``nbytes`` of host memory and returns where it is (a backend's shared-memory pool).
HostAllocatorFn = Callable[[int], BufferRegion]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a spec dtype name (``bfloat16`` -> ``torch.bfloat16``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"torch has no dtype {name!r}")
    return dtype


def _align(value: int) -> int:
    return (value + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def region_tensor(region: BufferRegion) -> torch.Tensor:
    """Wrap foreign host memory as a uint8 CPU tensor (no copy); the owner must outlive it."""
    if region.nbytes <= 0:
        raise ValueError(f"host allocator returned an empty region ({region.nbytes} bytes)")
    array = (ctypes.c_uint8 * region.nbytes).from_address(region.ptr)
    return torch.frombuffer(array, dtype=torch.uint8, count=region.nbytes)


@dataclass(frozen=True, slots=True)
class _Placement:
    """Where one buffer lives inside the backing."""

    spec: BufferSpec
    offset: int  # byte offset in the backing (page_first: byte offset inside a unit)
    nbytes: int  # bytes of the whole buffer (page_first: bytes of the buffer inside one unit)


def buffer_order(spec: PoolSpec) -> list[BufferSpec]:
    """Buffers in object order (object by object, buffer names in the object's order)."""
    by_name = {buffer.name: buffer for buffer in spec.buffers}
    return [by_name[name] for obj in spec.objects for name in obj.buffers]


#: What an engine hands over for one buffer: one tensor, or one tensor per layer.
EngineTensor = torch.Tensor | Sequence[torch.Tensor]


def unit_index(units: torch.Tensor | Sequence[int] | int) -> torch.Tensor:
    """Unit indices as a flat int64 tensor (kept on its device)."""
    return torch.as_tensor(units, dtype=torch.int64).flatten()


def engine_tensor_units(spec: PoolSpec, tensors: Mapping[str, EngineTensor], layout: Layout) -> int | None:
    """The unit count the engine's tensors hold (read from the first buffer's unit dimension).

    ``None`` when there is nothing to read it from; :meth:`PoolBuffers.from_tensors` checks that
    every buffer agrees.
    """
    for buffer in spec.buffers:
        value = tensors.get(buffer.name)
        if isinstance(value, torch.Tensor):
            unit_dim = 1 if Layout(layout) is Layout.LAYER_FIRST else 0
            return int(value.shape[unit_dim]) if value.dim() > unit_dim else None
        if isinstance(value, Sequence) and value and isinstance(value[0], torch.Tensor):
            return int(value[0].shape[0]) if value[0].dim() else None
    return None


def _shape_text(dims: Sequence[tuple[str, int | None]]) -> str:
    return "(" + ", ".join(name if size is None else f"{name}={size}" for name, size in dims) + ")"


def _unit_contiguous(tensor: torch.Tensor, unit_shape: tuple[int, ...]) -> bool:
    """True when the trailing ``unit_shape`` dimensions are laid out densely (C order)."""
    expected = 1
    for size, stride in zip(reversed(unit_shape), reversed(tensor.stride()[-len(unit_shape) :]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _check_engine_tensor(
    where: str, buffer: BufferSpec, given: EngineTensor, units: int, layout: Layout
) -> list[torch.Tensor]:
    """Dtype, shape and unit contiguity of one buffer's engine tensor(s); returns the tensors."""
    dtype = torch_dtype(buffer.dtype)
    dims = list(buffer.unit_dims) or [f"d{i}" for i in range(len(buffer.unit_shape))]
    unit = list(zip(dims, buffer.unit_shape, strict=True))
    label = f"{where} buffer {buffer.name!r}"
    if isinstance(given, torch.Tensor):
        if layout is Layout.LAYER_FIRST:
            expected = [("layers", buffer.layers), ("units", units), *unit]
            form = "one layer_first tensor"
        else:
            expected = [("units", units), ("layers", buffer.layers), *unit]
            form = "one page_first_direct tensor"
        parts = [(label, given, expected, form)]
    elif isinstance(given, Sequence) and not isinstance(given, (str, bytes)):
        if layout is not Layout.LAYER_FIRST:
            raise ValueError(
                f"{label}: per-layer tensors are layer_first; expected one tensor for {layout.value}"
            )
        if len(given) != buffer.layers:
            raise ValueError(f"{label}: expected {buffer.layers} per-layer tensors, got {len(given)}")
        expected = [("units", units), *unit]
        parts = [(f"{label} layer {i}", part, expected, "a per-layer tensor") for i, part in enumerate(given)]
    else:
        raise ValueError(
            f"{label}: expected a torch.Tensor or a sequence of per-layer tensors, got {type(given).__name__}"
        )
    tensors = []
    for what, tensor, expected_dims, form in parts:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
        shape = tuple(size for _, size in expected_dims)
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"{what}: expected {form} of {dtype} {_shape_text(expected_dims)}, "
                f"got {tensor.dtype} {tuple(tensor.shape)}"
            )
        if not _unit_contiguous(tensor, buffer.unit_shape):
            raise ValueError(
                f"{what}: expected each unit {_shape_text(unit)} contiguous in memory (C order), got "
                f"strides {tuple(tensor.stride())} for shape {tuple(tensor.shape)}; pass a contiguous "
                "tensor or one whose unit dimensions are dense"
            )
        tensors.append(tensor)
    return tensors


def _same_device(given: torch.device, expected: torch.device) -> bool:
    """``expected`` without an index (a bare ``cuda``) accepts any index of its type."""
    return given.type == expected.type and (expected.index is None or given.index == expected.index)


class PoolBuffers:
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
        self.device = torch.device(device)
        self.owned = True  # kvstrata allocated this memory (False: the engine's tensors)
        #: view pairs of copies to other tiers, by id(other tier) (see transfer._view_pairs)
        self.copy_views: dict[int, tuple[PoolBuffers, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self._layer_tensors: dict[str, list[torch.Tensor]] = {}  # engine buffers given per layer
        self.placements: dict[str, _Placement] = {}
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
        layout = Layout(layout)
        where = f"pool {spec.name!r} ({spec.pool_type})"
        if layout is Layout.PAGE_FIRST:
            raise ValueError(
                f"{where}: engine tensors are one per buffer; page_first interleaves the buffers "
                "in one allocation. Use layer_first or page_first_direct"
            )
        if spec.buffers and layout not in spec.layouts:
            raise ValueError(
                f"{where} does not support layout {layout.value!r}; "
                f"supported: {[lay.value for lay in spec.layouts]}"
            )
        names = [buffer.name for buffer in spec.buffers]
        missing = [name for name in names if name not in tensors]
        unknown = sorted(set(tensors) - set(names))
        if missing or unknown:
            raise ValueError(
                f"{where}: engine tensors must cover exactly its buffers {names}; "
                f"missing {missing}, unknown {unknown}"
            )
        if units is None:
            units = engine_tensor_units(spec, tensors, layout) or 0
        expected_device = None if device is None else torch.device(device)
        found: dict[str, list[torch.Tensor]] = {}
        whole: dict[str, torch.Tensor] = {}
        first_device: torch.device | None = None
        for buffer in spec.buffers:
            given = tensors[buffer.name]
            parts = _check_engine_tensor(where, buffer, given, units, layout)
            for part in parts:
                if part.device.type == "meta":
                    raise ValueError(
                        f"{where} buffer {buffer.name!r}: expected a tensor with memory "
                        f"(on {expected_device or 'the device tier'}), got one on device 'meta'"
                    )
                if expected_device is not None and not _same_device(part.device, expected_device):
                    raise ValueError(
                        f"{where} buffer {buffer.name!r}: expected device {expected_device}, "
                        f"got {part.device}"
                    )
                if first_device is not None and part.device != first_device:
                    raise ValueError(
                        f"{where} buffer {buffer.name!r}: expected every tensor on {first_device} "
                        f"(the device of the first), got {part.device}"
                    )
                first_device = part.device
            if isinstance(given, torch.Tensor):
                whole[buffer.name] = given
            else:
                found[buffer.name] = parts
        tier = cls.__new__(cls)
        tier.spec = spec
        tier.units = units
        tier.layout = layout
        tier.device = first_device or expected_device or torch.device("cpu")
        tier.owned = False
        tier.copy_views = {}
        tier._layer_tensors = found
        tier.placements = {b.name: _Placement(b, 0, b.bytes_per_unit * units) for b in spec.buffers}
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

    def _engine_word(self, buffer: BufferSpec) -> int:
        """Widest word every view of an engine buffer can be read in (alignment, strides)."""
        for word in (8, 4, 2):
            if buffer.bytes_per_unit_per_layer % word:
                continue
            try:
                for layer in range(buffer.layers):
                    self._engine_words(buffer.name, word, layer)
            except RuntimeError:
                continue
            return word
        try:
            for layer in range(buffer.layers):
                self._engine_words(buffer.name, 1, layer)
        except RuntimeError as exc:
            raise ValueError(
                f"pool {self.spec.name!r} buffer {buffer.name!r}: expected a tensor kvstrata can view "
                f"as bytes, got one it cannot ({exc})"
            ) from exc
        return 1

    def _engine_words(self, name: str, word_bytes: int, layer: int | None) -> torch.Tensor:
        """``(U, L, W)`` (or ``(U, W)`` for one layer) integer-word view of an engine buffer."""
        buffer = self.spec.buffer(name)
        elements = math.prod(buffer.unit_shape)
        word = _WORDS[word_bytes]
        if name in self._layer_tensors:
            if layer is None:
                raise ValueError(
                    f"pool {self.spec.name!r} buffer {name!r} is held as per-layer tensors: "
                    "address one layer (layer=)"
                )
            part = self._layer_tensors[name][layer]
            return part.view(self.units, elements).view(torch.uint8).view(word)
        typed = self.tensors[name]
        if self.layout is Layout.LAYER_FIRST:
            words = typed.view(buffer.layers, self.units, elements).view(torch.uint8).view(word)
            words = words.transpose(0, 1)
        else:
            words = typed.view(self.units, buffer.layers, elements).view(torch.uint8).view(word)
        return words if layer is None else words[:, layer]

    # --- allocation -------------------------------------------------------------------------

    def _place(self) -> int:
        """Compute buffer placements; returns the backing size in bytes."""
        offset = 0
        for buffer in buffer_order(self.spec):
            if self.layout is Layout.PAGE_FIRST:
                nbytes = buffer.bytes_per_unit
                self.placements[buffer.name] = _Placement(buffer, offset, nbytes)
                offset += nbytes
            else:
                nbytes = buffer.bytes_per_unit * self.units
                self.placements[buffer.name] = _Placement(buffer, offset, nbytes)
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

    def _typed_view(self, place: _Placement) -> torch.Tensor:
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

    def _widest_word(self, place: _Placement) -> int:
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
            self._check_layer(buffer, layer)
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

    def _owned_words(self, place: _Placement, word_bytes: int) -> torch.Tensor:
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

    def _placement(self, name: str) -> _Placement:
        try:
            return self.placements[name]
        except KeyError:
            raise KeyError(
                f"pool {self.spec.name!r} has no buffer {name!r}; buffers: {list(self.placements)}"
            ) from None

    def _check_layer(self, buffer: BufferSpec, layer: int) -> None:
        if not isinstance(layer, int) or not 0 <= layer < buffer.layers:
            raise IndexError(
                f"pool {self.spec.name!r} buffer {buffer.name!r}: layer {layer!r} is not a pool layer "
                f"index in [0, {buffer.layers}) (map a model layer id with PoolSpec.layer_index)"
            )

    # --- unit access for engines ---------------------------------------------------------------

    def buffer_view(self, name: str, *, layer: int | None = None) -> torch.Tensor:
        """Zero-copy typed view ``(U, L, *unit_shape)`` of one buffer, or ``(U, *unit_shape)`` of a layer.

        For engines that compute in place (write a unit with ``view[u] = ...`` or
        ``view.index_copy_``). Strided where the layout demands (``layer=None`` on a layer_first
        tier); a page_first host tier has it only when the buffer is aligned for its dtype.
        """
        buffer = self._placement(name).spec
        if layer is not None:
            self._check_layer(buffer, layer)
        if self.logical:
            raise ValueError(f"pool {self.spec.name!r} holds no bytes (buffer {name!r}, {self.units} units)")
        if name in self._layer_tensors:
            if layer is None:
                raise ValueError(
                    f"pool {self.spec.name!r} buffer {name!r} is held as per-layer tensors: "
                    "address one layer (layer=)"
                )
            return self._layer_tensors[name][layer]
        typed = self.tensor(name)  # layer_first (L, U, ...), else (U, L, ...)
        if self.layout is Layout.LAYER_FIRST:
            return typed.transpose(0, 1) if layer is None else typed[layer]
        return typed if layer is None else typed[:, layer]

    def _access_index(self, units: torch.Tensor | Sequence[int] | int) -> torch.Tensor:
        idx = unit_index(units)
        self.check_indices(idx)
        return idx.to(self.device)

    def read_units(
        self,
        units: torch.Tensor | Sequence[int] | int,
        *,
        layer: int | None = None,
        buffers: Sequence[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """A copy of ``units``: per buffer ``(n, L, *unit_shape)`` (``(n, *unit_shape)`` with ``layer``).

        Tensors are new, contiguous, on this tier's device, in the buffer's dtype and declared
        unit layout; ``layer`` is a pool layer index; ``buffers`` limits the read to some buffers.
        """
        idx = self._access_index(units)
        names = list(self.placements) if buffers is None else list(buffers)
        out: dict[str, torch.Tensor] = {}
        for name in names:
            buffer = self._placement(name).spec
            if layer is not None:
                self._check_layer(buffer, layer)
            word = self.word_bytes(name)
            if layer is None and self.split_layers(name):
                words = torch.stack(
                    [self.unit_view(name, word, layer=i).index_select(0, idx) for i in range(buffer.layers)],
                    dim=1,
                )
            else:
                words = self.unit_view(name, word, layer=layer).index_select(0, idx)
            lead = (idx.numel(),) if layer is not None else (idx.numel(), buffer.layers)
            typed = words.view(torch.uint8).view(torch_dtype(buffer.dtype))
            out[name] = typed.view(*lead, *buffer.unit_shape)
        return out

    def write_units(
        self,
        units: torch.Tensor | Sequence[int] | int,
        tensors: Mapping[str, torch.Tensor],
        *,
        layer: int | None = None,
    ) -> None:
        """Write ``tensors[buffer]`` (shaped as :meth:`read_units` returns them) into ``units``.

        Any subset of the buffers; every tensor is checked (dtype, shape) before any byte is
        written, and the units must be distinct. Tensors on another device are copied over.
        """
        idx = self._access_index(units)
        if idx.numel() > 1 and torch.unique(idx).numel() != idx.numel():
            raise ValueError(f"pool {self.spec.name!r}: write_units got repeated units {idx.tolist()}")
        staged: list[tuple[str, int, torch.Tensor]] = []
        for name, tensor in tensors.items():
            buffer = self._placement(name).spec
            if layer is not None:
                self._check_layer(buffer, layer)
            lead = (idx.numel(),) if layer is not None else (idx.numel(), buffer.layers)
            expected = (*lead, *buffer.unit_shape)
            dtype = torch_dtype(buffer.dtype)
            if (
                not isinstance(tensor, torch.Tensor)
                or tensor.dtype != dtype
                or tuple(tensor.shape) != expected
            ):
                given = (
                    f"{tensor.dtype} {tuple(tensor.shape)}"
                    if isinstance(tensor, torch.Tensor)
                    else type(tensor).__name__
                )
                raise ValueError(
                    f"pool {self.spec.name!r} buffer {name!r}: expected {dtype} {expected} "
                    f"(units, {'' if layer is not None else 'layers, '}*unit_shape), got {given}"
                )
            word = self.word_bytes(name)
            layer_bytes = buffer.bytes_per_unit_per_layer
            rows = tensor.to(self.device).contiguous().view(*lead, layer_bytes // dtype.itemsize)
            staged.append((name, word, rows.view(torch.uint8).view(_WORDS[word])))
        if idx.numel() == 0:
            return
        for name, word, rows in staged:
            buffer = self.placements[name].spec
            if layer is None and self.split_layers(name):
                for i in range(buffer.layers):
                    self.unit_view(name, word, layer=i).index_copy_(0, idx, rows[:, i])
            else:
                self.unit_view(name, word, layer=layer).index_copy_(0, idx, rows)

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
