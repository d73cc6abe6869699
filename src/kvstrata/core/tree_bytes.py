"""The tree's byte encodings: page keys and stored unit indices, both plain ``bytes``.

A tree at 100k sequences holds 100k nodes, and what each node keeps decides the tree's memory
and how long Python's garbage collector takes on every full pass: ``bytes`` are untracked and
cost 33 bytes beside their data. Page keys are the pages' int64 token ids (``PagedKeys``: one
object per sequence, not per page); unit indices are int64 too (``unit_bytes``), read back as
tensors by ``UnitValues``. Apart from ``tree_node`` so that module stays the node's vocabulary.
"""

from __future__ import annotations

import functools
import struct
from array import array
from collections.abc import Callable, Hashable, Sequence

import torch

PageKey = Hashable


class TreeError(ValueError):
    """Bad input to a tree operation (unknown pool, wrong value length, broken invariant)."""


class PagedKeys(bytes):
    """The whole-page keys of one token sequence, held as one ``bytes`` of int64 token ids.

    A sequence of page keys (``len`` counts pages, ``keys[i]`` is page ``i``'s key: its tokens'
    int64 bytes, ``keys[a:b]`` is a ``PagedKeys`` of those pages) that costs one object, not one
    per page: at page size 1 a per-page ``bytes`` made key building 75% of an insert and its
    objects most of the tree's memory. A tree edge built from it is a slice of it (one memcpy),
    and the walk compares an edge with ``bytes.startswith`` at an offset: one memcmp, no copy, no
    Python step per page or token. Equal to any sequence with the same page keys (a list of
    ``bytes`` from an older caller compares equal). One subclass per page size holds the stride
    (:func:`paged_keys_type`).
    """

    __slots__ = ()
    #: bytes per page (8 x page size); set on each page size's subclass
    step: int = 8

    def __len__(self) -> int:
        return bytes.__len__(self) // self.step

    def __getitem__(self, index):  # type: ignore[override]  # pages, not bytes
        step = self.step
        if isinstance(index, slice):
            start, stop, stride = index.indices(bytes.__len__(self) // step)
            if stride != 1:
                return [self[i] for i in range(start, stop, stride)]
            return type(self)(bytes.__getitem__(self, slice(start * step, max(start, stop) * step)))
        if index < 0:
            index += bytes.__len__(self) // step
        if not 0 <= index < bytes.__len__(self) // step:
            raise IndexError("page index out of range")
        at = index * step
        return bytes.__getitem__(self, slice(at, at + step))

    def __iter__(self):  # type: ignore[override]
        step = self.step
        view = bytes(self)
        return iter([view[i : i + step] for i in range(0, len(view), step)])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PagedKeys):
            return self.step == other.step and bytes.__eq__(self, other)
        if isinstance(other, list | tuple):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return False

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = bytes.__hash__

    def __add__(self, other: object) -> PagedKeys:  # type: ignore[override]
        if isinstance(other, PagedKeys) and other.step == self.step:
            return type(self)(bytes(self) + bytes(other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"PagedKeys({len(self)} pages of {self.step // 8} tokens)"

    def tokens(self) -> bytes:
        """The token ids of every page, as plain int64 ``bytes``."""
        return bytes(self)

    def __reduce__(self) -> tuple[Callable[[int, bytes], PagedKeys], tuple[int, bytes]]:
        # the per-page-size subclass is made at run time: pickle by page size, not by class name
        return _rebuild_paged_keys, (self.step // 8, bytes(self))


@functools.cache
def paged_keys_type(page_size: int) -> type[PagedKeys]:
    """The ``PagedKeys`` subclass of one page size (the stride lives on the class, since a
    ``bytes`` subclass cannot carry instance attributes). Cached: one immutable type per size."""
    if page_size < 1:
        raise TreeError(f"page_size must be >= 1, got {page_size}")
    return type(f"PagedKeys{page_size}", (PagedKeys,), {"__slots__": (), "step": page_size * 8})


def _rebuild_paged_keys(page_size: int, data: bytes) -> PagedKeys:
    return paged_keys_type(page_size)(data)


def page_keys(tokens: Sequence[int] | array | torch.Tensor, page_size: int) -> PagedKeys:
    """Whole-page keys of ``tokens``: each page's token ids as int64 bytes, as one ``PagedKeys``.

    A trailing partial page is dropped (it cannot be cached). Page keys are exact (no hash
    collisions) and compare with one memcmp. Token arrays (``array('q')``, as SGLang holds them,
    or tensors) convert with one memcpy; lists pay one C-level pack.
    """
    if isinstance(tokens, array) and tokens.typecode == "q":
        flat = tokens.tobytes()
    elif isinstance(tokens, torch.Tensor):
        flat = tokens.detach().to("cpu", torch.int64).numpy().tobytes()
    else:
        flat = struct.pack(f"{len(tokens)}q", *tokens)
    step = page_size * 8
    end = len(flat) - len(flat) % step
    return paged_keys_type(page_size)(flat[:end] if end != len(flat) else flat)


_INT64 = torch.int64
#: bytes per unit index (int64) in a node's stored values
UNIT = 8


#: unit indices as the tree takes them: a 1-D index tensor, or int64 ``bytes`` (what a node stores)
Units = torch.Tensor | bytes


def unit_bytes(value: Units) -> bytes:
    """A 1-D index tensor's units as int64 ``bytes``: how a node stores its values (``bytes``
    given are already that).

    ``bytes`` are not tracked by the garbage collector and cost 33 bytes beside their data, where
    a tensor cost ~550 (its Python object, ``TensorImpl`` and storage) and one more object for
    every collection pass; a copy also keeps none of the caller's tensor alive.
    """
    if type(value) is bytes:
        return value
    if value.dtype is _INT64:
        try:
            return value.numpy().tobytes()  # the common case: CPU int64 (a view or not)
        except (TypeError, RuntimeError):
            pass  # another device, or a tensor that requires grad
    return value.detach().to("cpu", _INT64).numpy().tobytes()


def unit_tensor(raw: bytes) -> torch.Tensor:
    """A fresh, writable int64 tensor of stored units (the tree's copy stays as it was)."""
    if not raw:
        return torch.empty(0, dtype=_INT64)
    return torch.frombuffer(bytearray(raw), dtype=_INT64)


class UnitValues(Sequence):
    """A node's per-pool values in one tier as tensors, made when read (``node.device[p]``).

    The node stores int64 ``bytes`` (:func:`unit_bytes`); callers outside the tree read tensors
    through this view, each a fresh copy. Read-only: only the tree's setter changes a value.
    """

    __slots__ = ("_raw",)

    def __init__(self, raw: tuple[bytes | None, ...]) -> None:
        self._raw = raw

    def __len__(self) -> int:
        return len(self._raw)

    def __getitem__(self, p):  # type: ignore[override]
        raw = self._raw[p]
        if isinstance(p, slice):
            return [None if r is None else unit_tensor(r) for r in raw]
        return None if raw is None else unit_tensor(raw)

    def __repr__(self) -> str:
        return f"UnitValues({[None if r is None else len(r) // UNIT for r in self._raw]} units)"
