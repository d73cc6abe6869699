"""Vectorised 64-bit mixing on torch int64 tensors (wrapping arithmetic, logical shifts).

torch has no full uint64 arithmetic on every device, so we compute on int64 and emulate logical
right shifts with a mask. Determinism, not cryptographic quality, is the requirement.
"""

from __future__ import annotations

import torch
import xxhash

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as signed int64
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB


def to_int64(value: int) -> int:
    """Reinterpret an unsigned 64-bit integer as signed int64 (torch's storage type)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def hash64(*parts: object) -> int:
    """A stable signed 64-bit xxhash of the parts' reprs separated by NUL (order-sensitive)."""
    data = b"\0".join(p if isinstance(p, bytes) else repr(p).encode() for p in parts)
    return to_int64(xxhash.xxh64_intdigest(data))


def _lsr(x: torch.Tensor, shift: int) -> torch.Tensor:
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def splitmix64_(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser in place: a bijection on 64-bit values, so distinct in → distinct out."""
    x ^= _lsr(x, 30)
    x *= _M1
    x ^= _lsr(x, 27)
    x *= _M2
    x ^= _lsr(x, 31)
    return x


def stream(seeds: torch.Tensor, words: int, start: int = 0) -> torch.Tensor:
    """``[len(seeds), words]`` int64 pseudo-random words: word j of row i = mix(seed_i + (start+j)·φ)."""
    offsets = torch.arange(start, start + words, dtype=torch.int64, device=seeds.device)
    x = seeds.reshape(-1, 1) + (offsets + 1) * _GOLDEN
    return splitmix64_(x)
