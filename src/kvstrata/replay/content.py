"""Deterministic page content, so a replay can check every restored byte without keeping a copy.

The bytes of one unit (a page or a slot of one buffer in one layer) are a pure function of
``(namespace, pool instance, buffer, layer, dtype, unit bytes, page identity)``. Writing them when a
page is "computed" and recomputing them when it is restored (from host, storage, another process)
detects any byte that came back wrong, foreign (other model/pool/layer) or from the wrong page.

Word ``j`` of a unit is ``page_seed XOR table[j]``: the page seed is a SplitMix64 hash of the page
identity and the whole identity; the table is a SplitMix64 stream keyed by the identity and the layer.
So every word differs between pages (distinct seeds), shifting or swapping bytes is caught (random
table), and filling costs one broadcast XOR per word — memory-bandwidth bound, no per-element Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstrata.replay._mix import hash64, splitmix64_, stream, to_int64

#: Rows generated per chunk (keeps temporaries around a few MiB for typical unit sizes).
_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class ContentIdentity:
    """What the content of a buffer's units depends on, besides the page identity and layer.

    ``unit_nbytes`` and ``dtype`` are part of the identity so a layout or dtype mix-up reads as
    corruption instead of coincidentally matching bytes.
    """

    namespace: str
    pool: str
    buffer: str
    dtype: str
    unit_nbytes: int

    def base_seed(self) -> int:
        return hash64(
            "kvstrata.content", self.namespace, self.pool, self.buffer, self.dtype, self.unit_nbytes
        )


def page_identity(key: bytes | str | int) -> int:
    """A signed 64-bit identity for a page hash (bytes/hex str) or an int prefix id."""
    if isinstance(key, int):
        return to_int64(key)
    return hash64("page", key)


def layer_seed_key(identity: ContentIdentity, layer: int) -> int:
    """The key :func:`unit_seeds` mixes into page identities: lets batched generators (the replay
    driver fills all layers at once) produce exactly this module's content."""
    return hash64("layer", identity.base_seed(), layer)


def page_identities(keys: Sequence[bytes | str | int], device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 identities of many page keys (one xxhash each: cheap, and only on the verify path)."""
    return torch.tensor([page_identity(k) for k in keys], dtype=torch.int64, device=device)


def unit_seeds(identity: ContentIdentity, page_ids: torch.Tensor, layer: int) -> torch.Tensor:
    """Per-unit seeds (int64): a bijective mix of page id, identity and layer."""
    return splitmix64_(page_ids.to(torch.int64).clone() ^ layer_seed_key(identity, layer))


def word_table(identity: ContentIdentity, layer: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The per-position words that every unit of this (identity, layer) XORs with its seed."""
    words = -(-identity.unit_nbytes // 8)
    key = torch.tensor([layer_seed_key(identity, layer) ^ 0x7AB1E], dtype=torch.int64, device=device)
    return stream(key, words)[0]


def generate(
    seeds: torch.Tensor, table: torch.Tensor, unit_nbytes: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``[n, unit_nbytes]`` uint8 content: row i is ``seeds[i] ^ table`` as bytes (truncated)."""
    seeds = seeds.reshape(-1, 1)
    n = seeds.shape[0]
    if out is None:
        out = torch.empty((n, unit_nbytes), dtype=torch.uint8, device=seeds.device)
    elif out.shape != (n, unit_nbytes) or out.dtype != torch.uint8:
        raise ValueError(f"out must be uint8 of shape {(n, unit_nbytes)}, got {out.dtype} {tuple(out.shape)}")
    if unit_nbytes % 8 == 0:
        torch.bitwise_xor(seeds, table.reshape(1, -1), out=out.view(torch.int64))
        return out
    words = table.numel()
    rows = max(1, _CHUNK_BYTES // (words * 8))
    for start in range(0, n, rows):
        block = seeds[start : start + rows] ^ table.reshape(1, -1)
        out[start : start + rows] = block.view(torch.uint8)[:, :unit_nbytes]
    return out


def _as_units(buffer: torch.Tensor) -> torch.Tensor:
    if buffer.dtype != torch.uint8 or buffer.dim() != 2:
        raise ValueError(
            f"expected a uint8 tensor [units, unit_nbytes] (view the pool buffer as bytes), "
            f"got {buffer.dtype} {tuple(buffer.shape)}"
        )
    return buffer


def fill_units(
    buffer: torch.Tensor,
    unit_indices: torch.Tensor | Sequence[int],
    page_ids: torch.Tensor,
    identity: ContentIdentity,
    layer: int,
) -> None:
    """Write the expected content of ``page_ids`` into ``buffer[unit_indices]`` (one layer).

    ``buffer`` is one layer's ``[units, unit_nbytes]`` uint8 view of a pool buffer.
    """
    units = _as_units(buffer)
    index = torch.as_tensor(unit_indices, dtype=torch.int64, device=units.device)
    seeds = unit_seeds(identity, page_ids.to(units.device), layer)
    table = word_table(identity, layer, units.device)
    if units.shape[1] % 8 == 0 and units.is_contiguous():
        units.view(torch.int64)[index] = seeds.reshape(-1, 1) ^ table.reshape(1, -1)
    else:
        units[index] = generate(seeds, table, units.shape[1])


def verify_units(
    buffer: torch.Tensor,
    unit_indices: torch.Tensor | Sequence[int],
    page_ids: torch.Tensor,
    identity: ContentIdentity,
    layer: int,
) -> torch.Tensor:
    """Positions (into ``unit_indices``) of units whose bytes differ from the expected content."""
    units = _as_units(buffer)
    index = torch.as_tensor(unit_indices, dtype=torch.int64, device=units.device)
    seeds = unit_seeds(identity, page_ids.to(units.device), layer)
    table = word_table(identity, layer, units.device)
    bad: list[torch.Tensor] = []
    rows = max(1, _CHUNK_BYTES // max(1, units.shape[1]))
    words = units.view(torch.int64) if units.shape[1] % 8 == 0 and units.is_contiguous() else None
    for start in range(0, index.numel(), rows):
        chunk = index[start : start + rows]
        if words is not None:  # compare 8 bytes at a time
            expected = seeds[start : start + rows].reshape(-1, 1) ^ table.reshape(1, -1)
            mismatch = (words[chunk] != expected).any(dim=1)
        else:
            expected = generate(seeds[start : start + rows], table, units.shape[1])
            mismatch = (units[chunk] != expected).any(dim=1)
        bad.append(torch.nonzero(mismatch).reshape(-1) + start)
    return torch.cat(bad) if bad else torch.empty(0, dtype=torch.int64)
