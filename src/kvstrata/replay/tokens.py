"""Deterministic token ids for trace hash blocks, so that shared prefixes in a trace are real
shared token prefixes for the cache (which only ever sees tokens).

Guarantees, for a fixed ``(seed, vocab_size, block_size)``:

- the same hash id always yields the same tokens;
- different hash ids differ within the first ``id_tokens`` tokens of their block, because those
  tokens are the base-``vocab_size`` digits of a bijective 64-bit mix of the id. So two requests'
  token prefixes diverge inside the first block whose ids differ — exactly at the block boundary
  for any page size ≥ ``id_tokens`` (5 with a 32k vocabulary);
- the remaining tokens are pseudo-random in ``[0, vocab_size)``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import torch

from kvstrata.replay._mix import hash64, splitmix64_, stream, to_int64
from kvstrata.replay.trace import MOONCAKE_BLOCK_SIZE, TraceRequest


class BlockTokenizer:
    """Maps trace hash ids to token-id tensors (int64), caching the most recently used blocks."""

    def __init__(
        self,
        block_size: int = MOONCAKE_BLOCK_SIZE,
        vocab_size: int = 32_000,
        seed: int = 0,
        cache_blocks: int = 16_384,
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.seed = seed
        #: Tokens at the start of each block that encode the id injectively.
        self.id_tokens = math.ceil(64 / math.log2(vocab_size))
        if block_size < self.id_tokens:
            raise ValueError(
                f"block_size {block_size} is below the {self.id_tokens} tokens needed to keep "
                f"different ids distinct with vocab_size {vocab_size}"
            )
        self._salt = hash64("kvstrata.tokens", seed)
        self._cache_blocks = cache_blocks
        self._cache: OrderedDict[int, torch.Tensor] = OrderedDict()

    def _generate(self, hash_ids: Sequence[int]) -> torch.Tensor:
        """``[len(hash_ids), block_size]`` tokens for several ids in one vectorised pass."""
        ids = torch.tensor([to_int64(i) for i in hash_ids], dtype=torch.int64)
        mixed = splitmix64_(ids ^ self._salt)  # bijective: distinct ids -> distinct values
        out = torch.empty((len(hash_ids), self.block_size), dtype=torch.int64)
        # Base-V digits of the mixed value read as unsigned 64-bit (Python ints: d digits per id).
        v = self.vocab_size
        digits = []
        for value in mixed.tolist():
            u = value & ((1 << 64) - 1)
            row = []
            for _ in range(self.id_tokens):
                u, r = divmod(u, v)
                row.append(r)
            digits.append(row)
        out[:, : self.id_tokens] = torch.tensor(digits, dtype=torch.int64)
        rest = stream(mixed, self.block_size - self.id_tokens)
        out[:, self.id_tokens :] = _lsr1(rest) % v
        return out

    def block(self, hash_id: int) -> torch.Tensor:
        """The full ``block_size`` tokens of one hash id (a cached, read-only-by-convention tensor)."""
        return self.blocks([hash_id])[0]

    def blocks(self, hash_ids: Sequence[int]) -> list[torch.Tensor]:
        """Token tensors of several ids; misses are generated together in one batch."""
        missing = [i for i in dict.fromkeys(hash_ids) if i not in self._cache]
        if missing:
            for hid, row in zip(missing, self._generate(missing), strict=True):
                self._cache[hid] = row
        result = []
        for hid in hash_ids:
            self._cache.move_to_end(hid)
            result.append(self._cache[hid])
        while len(self._cache) > self._cache_blocks:
            self._cache.popitem(last=False)
        return result

    def request_tokens(self, request: TraceRequest) -> torch.Tensor:
        """All ``input_length`` tokens of a request: its blocks concatenated, the last one partial."""
        if request.input_length > self.block_size * len(request.hash_ids) or request.input_length <= (
            self.block_size * (len(request.hash_ids) - 1)
        ):
            raise ValueError(
                f"request has {len(request.hash_ids)} hash ids, which does not fit input_length "
                f"{request.input_length} with block size {self.block_size}"
            )
        tokens = torch.cat(self.blocks(request.hash_ids))
        return tokens[: request.input_length]


def _lsr1(x: torch.Tensor) -> torch.Tensor:
    """Drop the sign bit so ``%`` gives a uniform non-negative remainder."""
    return x & ((1 << 63) - 1)
