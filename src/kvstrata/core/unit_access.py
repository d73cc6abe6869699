"""Typed unit access for engines: read a copy of units, write units, view a buffer in place.

Engines speak tensors ``(n, [layers,] *unit_shape)`` in a buffer's dtype and declared unit layout
(token- or head-major); a tier stores bytes in one of three layouts and may be kvstrata's own
allocation or the engine's tensors. These methods translate between the two, moving bytes as
integer words so every dtype (fp8, NaN payloads ...) round-trips bit-exactly. They are a base
class of :class:`~kvstrata.core.buffers.PoolBuffers`, apart so the tier's memory management and
its user-facing access each read on one screen.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvstrata.core.engine_tensors import torch_dtype
from kvstrata.core.row_copy import copy_rows
from kvstrata.core.tokens import integer
from kvstrata.plugins.pool_type import BufferSpec, Layout, PoolSpec


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one buffer lives inside a tier's backing (laid out by
    :class:`~kvstrata.core.buffers.PoolBuffers`, read by the unit access here)."""

    spec: BufferSpec
    offset: int  # byte offset in the backing (page_first: byte offset inside a unit)
    nbytes: int  # bytes of the whole buffer (page_first: bytes of the buffer inside one unit)


#: integer dtype of each word width: bytes move as words, never as floats (bit-exact for any dtype)
WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def unit_index(units: torch.Tensor | Sequence[int] | int) -> torch.Tensor:
    """Unit indices as a flat int64 tensor (kept on its device); a float or bool index is
    refused, never truncated to another unit, and a meta tensor (no values) by name."""
    if isinstance(units, torch.Tensor):
        idx = units
    elif isinstance(units, numbers.Integral) and not isinstance(units, bool):
        return torch.tensor([int(units)], dtype=torch.int64)
    else:
        try:
            idx = torch.as_tensor(units) if len(units) else torch.empty(0, dtype=torch.int64)  # type: ignore[arg-type]
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise TypeError(
                f"units: expected unit indices (ints or an integer tensor), got {units!r}"
            ) from None
    if idx.is_meta:  # (else ``Tensor.item() cannot be called on meta tensors``, from deep inside)
        raise ValueError(f"units: a tensor on the meta device holds no unit indices (shape only): {idx!r}")
    if idx.dtype is torch.bool or idx.is_floating_point() or idx.is_complex():
        raise TypeError(f"units: unit indices must be integers, got a {idx.dtype} {tuple(idx.shape)} index")
    return idx.to(torch.int64).flatten()


class UnitAccess:
    """``buffer_view``, ``read_units`` and ``write_units`` over a tier's placements."""

    spec: PoolSpec
    units: int
    layout: Layout
    device: torch.device
    placements: dict[str, Placement]
    _layer_tensors: dict[str, list[torch.Tensor]]
    tensors: dict[str, torch.Tensor]
    backing: torch.Tensor | None

    def _placement(self, name: str) -> Placement:  # provided by PoolBuffers
        raise NotImplementedError

    def unit_view(self, name: str, word_bytes: int = 1, *, layer: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def word_bytes(self, name: str) -> int:
        raise NotImplementedError

    def split_layers(self, name: str) -> bool:
        raise NotImplementedError

    def tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def check_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError

    def _check_layer(self, buffer: BufferSpec, layer: int) -> int:
        """``layer`` as an int: any integer (a NumPy one, a 0-d tensor) but a bool, which as an
        index added a dimension (``view[:, True]``) instead of selecting layer 1."""
        index = integer(layer)
        if index is None or not 0 <= index < buffer.layers:
            raise IndexError(
                f"pool {self.spec.name!r} buffer {buffer.name!r}: layer {layer!r} is not a pool layer "
                f"index in [0, {buffer.layers}) (map a model layer id with PoolSpec.layer_index)"
            )
        return index

    # --- unit access for engines ---------------------------------------------------------------

    def buffer_view(self, name: str, *, layer: int | None = None) -> torch.Tensor:
        """Zero-copy typed view ``(U, L, *unit_shape)`` of one buffer, or ``(U, *unit_shape)`` of a layer.

        For engines that compute in place (write a unit with ``view[u] = ...`` or
        ``view.index_copy_``). Strided where the layout demands (``layer=None`` on a layer_first
        tier); a page_first host tier has it only when the buffer is aligned for its dtype.
        """
        buffer = self._placement(name).spec
        if layer is not None:
            layer = self._check_layer(buffer, layer)
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
                layer = self._check_layer(buffer, layer)
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
                layer = self._check_layer(buffer, layer)
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
            if tensor.is_meta:  # (else "Cannot copy out of meta tensor", naming no buffer)
                raise ValueError(f"pool {self.spec.name!r} buffer {name!r}: a meta tensor holds no values")
            word = self.word_bytes(name)
            layer_bytes = buffer.bytes_per_unit_per_layer
            rows = tensor.to(self.device).contiguous().view(*lead, layer_bytes // dtype.itemsize)
            raw = rows.view(torch.uint8)
            if raw.storage_offset() % word or raw.data_ptr() % word or self._holds(raw):
                # a dense view that starts between words (a slice of a larger tensor): word
                # views need aligned starts; a view of this tier's own memory (another unit's
                # buffer_view): the scatter refuses a source inside its target. Move a copy
                raw = raw.clone()
            staged.append((name, word, raw.view(WORDS[word])))
        if idx.numel() == 0:
            return
        for name, word, rows in staged:
            buffer = self.placements[name].spec
            whole = layer is not None or not self.split_layers(name)
            if whole and copy_rows(rows, 0, self.unit_view(name, word, layer=layer), idx, idx.numel()):
                continue  # one pass of block memmoves on the CPU (index_copy_ is slow there)
            if layer is None and self.split_layers(name):
                for i in range(buffer.layers):
                    self.unit_view(name, word, layer=i).index_copy_(0, idx, rows[:, i])
            else:
                self.unit_view(name, word, layer=layer).index_copy_(0, idx, rows)

    @functools.cached_property
    def _storages(self) -> frozenset[int]:
        """Where the storages of this tier's memory start (its backing, the engine's tensors):
        fixed for the tier's life, so found once."""
        held = [*self.tensors.values(), *(t for layers in self._layer_tensors.values() for t in layers)]
        if self.backing is not None:
            held.append(self.backing)
        return frozenset(t.untyped_storage().data_ptr() for t in held)

    def _holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in this tier's memory (its backing or an engine tensor)."""
        return tensor.untyped_storage().data_ptr() in self._storages

    # --- word views of an engine's own tensors -------------------------------------------------

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
        word = WORDS[word_bytes]
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
