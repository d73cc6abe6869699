"""Token ids as every public call takes them: one check, before anything is matched or locked.

The rule is the same with or without L3 (a page key and its hash hold each id as a little-endian
uint32), so a request refused here would have been refused anywhere. Kept below the lease and the
controller (both check tokens) so neither imports the other for it.
"""

from __future__ import annotations

import operator
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

#: largest token id a page key and its hash hold (ids are hashed as little-endian uint32)
MAX_TOKEN_ID = 2**32 - 1
#: lists up to this long are checked element by element (cheaper than a tensor for a decode step)
_SMALL = 8
_INT64 = torch.int64
#: the ufunc reduction behind ``ndarray.max``, without its Python-level wrapper
_max = np.maximum.reduce
#: where each int64's high 32-bit half sits in a uint32 view of it (the machine's byte order)
_HIGH = 1 if sys.byteorder == "little" else 0


def _ids_fit(words: np.ndarray) -> bool:
    """Whether every int64 of ``words`` (1-D) lies in ``[0, 2**32)``: their high 32-bit halves
    are all zero (a negative id's are not). Counting those halves costs about half a max
    reduction (measured in an engine's chunk loop), which strided arrays still take."""
    if words.strides == (8,):
        return not np.count_nonzero(words.view(np.uint32)[_HIGH::2])
    return not words.shape[0] or int(_max(words.view(np.uint64))) <= MAX_TOKEN_ID


def token_ids(tokens: Any, what: str = "tokens") -> torch.Tensor:
    """``tokens`` as a 1-D CPU int64 tensor, or a ``TypeError`` / ``ValueError`` naming ``what``
    and what was given: one sequence (not a batch, not a scalar) of integer ids (not floats,
    not bools) in ``[0, 2**32)``. Vectorised: one pass over the ids (:func:`_ids_fit`), never a
    per-token loop (lists of at most a few ids, a decode step, are checked directly)."""
    # what engines pass every chunk: one pass over the ids as they are (no conversion)
    if (
        type(tokens) is torch.Tensor
        and tokens.dtype is _INT64
        and tokens.dim() == 1
        and tokens.is_cpu
        and _ids_fit(tokens.numpy())
    ):
        return tokens
    if (
        type(tokens) is list
        and len(tokens) <= _SMALL
        and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in tokens)
    ):
        return torch.tensor(tokens, dtype=torch.int64)
    if isinstance(tokens, torch.Tensor):
        ids = tokens  # an integer tensor never requires grad
    elif isinstance(tokens, np.ndarray | array):
        ids = _from_numpy(np.asarray(tokens), what)
    elif isinstance(tokens, str | bytes | bytearray | Mapping) or not isinstance(tokens, Sequence | range):
        raise TypeError(f"{what}: expected a 1-D sequence of integer token ids, got {type(tokens).__name__}")
    elif len(tokens) == 0:
        return torch.empty(0, dtype=torch.int64)
    else:
        try:
            ids = torch.as_tensor(tokens)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise ValueError(
                f"{what}: expected a 1-D sequence of integer token ids in [0, 2**32), got "
                f"{type(tokens).__name__} of {len(tokens)} that is not one ({exc})"
            ) from None
    if ids.dtype is torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"{what}: token ids must be integers, got {_given(tokens, ids.dtype, ids.shape)}")
    if ids.dim() != 1:
        raise ValueError(
            f"{what}: expected one sequence of token ids (1-D), got {_given(tokens, ids.dtype, ids.shape)}; "
            "a batch is one lookup per sequence"
        )
    if ids.is_meta:
        raise ValueError(f"{what}: a tensor on the meta device holds no token ids (shape only)")
    ids = ids.to("cpu", torch.int64)  # a uint64 id past 2**63 wraps negative: refused below
    if ids.numel():
        words = ids.numpy()
        # one reduction checks both ends: a negative id is huge read as unsigned
        if int(_max(words.view(np.uint64))) > MAX_TOKEN_ID:
            low = int(words.min())
            raise ValueError(
                f"{what}: token ids must lie in [0, 2**32), got {low if low < 0 else int(words.max())}"
            )
    return ids


def token_bytes(tokens: Any, what: str = "tokens") -> bytes:
    """``tokens`` checked as :func:`token_ids` checks them, as int64 ``bytes`` (what a page key
    holds): for a CPU int64 tensor, what engines pass every chunk, one view, one check and one
    copy, no tensor made."""
    if type(tokens) is torch.Tensor and tokens.dtype is _INT64 and tokens.dim() == 1 and tokens.is_cpu:
        words = tokens.numpy()
        if _ids_fit(words):
            return words.tobytes()
    return token_ids(tokens, what).numpy().tobytes()


def _from_numpy(ids: np.ndarray, what: str) -> torch.Tensor:
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{what}: token ids must be integers, got a {ids.dtype} array of shape {ids.shape}")
    return torch.from_numpy(
        ids.astype(np.int64)
    )  # a copy: the caller's (maybe read-only) array stays its own


def _given(tokens: Any, dtype: torch.dtype, shape: torch.Size) -> str:
    kind = "tensor" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
    return f"a {kind} of {dtype} with shape {tuple(shape)}"


def integer(value: object) -> int | None:
    """``value`` as an int where it is an integer of any kind (a NumPy one, a 0-d tensor: what
    ``operator.index`` takes), else None. A bool is none: ``True`` as a count or an index was
    taken as 1 (as an index of a view, it added a dimension)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None
