"""Pool-spec stacks and value helpers shared by the tree tests (built with the real pool types)."""

from __future__ import annotations

from itertools import count

import torch

from kvstrata.plugins.pool_type import ModelContext, PoolSpec
from kvstrata.pool_types.kv import KVConfig, KVPoolType
from kvstrata.pool_types.mamba import MambaConfig, MambaPoolType, StateShape
from kvstrata.pool_types.nsa import NSAConfig, NSAIndexerPoolType
from kvstrata.pool_types.swa import SWAConfig, SWAPoolType

PAGE = 4


def ctx() -> ModelContext:
    return ModelContext(page_size=PAGE, anchor="kv")


def kv_spec() -> PoolSpec:
    return KVPoolType("kv", KVConfig(layers=1, kv_heads=1, head_dim=8), ctx()).spec()


def swa_spec(window_tokens: int = 2 * PAGE) -> PoolSpec:
    cfg = SWAConfig(layers=1, kv_heads=1, head_dim=8, window=window_tokens)
    return SWAPoolType("swa", cfg, ctx()).spec()


def mamba_spec() -> PoolSpec:
    cfg = MambaConfig(layers=1, conv=[StateShape(shape=(4,))], temporal=StateShape(shape=(2, 2)))
    return MambaPoolType("mamba", cfg, ctx()).spec()


def nsa_spec() -> PoolSpec:
    return NSAIndexerPoolType("nsa", NSAConfig(layers=1), ctx()).spec()


class Units:
    """Hands out fresh unit indices per pool, like an allocator would."""

    def __init__(self) -> None:
        self._next = count(0)

    def take(self, n: int) -> torch.Tensor:
        return torch.tensor([next(self._next) for _ in range(n)], dtype=torch.int64)


def seq(*page_ids: int) -> list[tuple[int, ...]]:
    """Page keys whose pages are ``(id, id, id, id)``: readable prefixes in tests."""
    return [(pid,) * PAGE for pid in page_ids]
