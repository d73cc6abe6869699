"""``nsa``: the DSA/NSA indexer keys (fp8 values plus one fp32 scale per 128-element block).

A sidecar: it shares the anchor's page indices and keys, so every anchor page needs its indexer
page (a missing one silently corrupted L3 hits in SGLang before it was stored). A shortfall clamps
the prefix to min(anchor, indexer).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvstrata.plugins.pool_type import (
    BufferSpec,
    Granularity,
    HitRule,
    HitRuleKind,
    Layout,
    ObjectSpec,
    PartialHit,
    PoolConfig,
    PoolRole,
    PoolSpec,
    PoolType,
    Replication,
)

QUANT_BLOCK = 128
SCALE_BYTES = 4  # one fp32 scale per block


class NSAConfig(PoolConfig):
    type: Literal["nsa"] = "nsa"
    layers: int = Field(ge=1)
    index_head_dim: int = Field(default=128, ge=QUANT_BLOCK, multiple_of=QUANT_BLOCK)
    replication: Replication = Replication.REPLICATED


class NSAIndexerPoolType(PoolType):
    name = "nsa"
    Config = NSAConfig
    default_role = PoolRole.SIDECAR

    def spec(self) -> PoolSpec:
        cfg, page = self.config, self.model.page_size
        row_bytes = cfg.index_head_dim + cfg.index_head_dim // QUANT_BLOCK * SCALE_BYTES
        return PoolSpec(
            name=self.instance,
            pool_type=self.name,
            role=self.role,
            index_source=self.index_source,
            granularity=Granularity.TOKEN_PAGES,
            hit_rule=HitRule(kind=HitRuleKind.ALL_PAGES),
            partial_hit=PartialHit.CLAMP,
            replication=cfg.replication,
            page_size=page,
            buffers=(
                BufferSpec(name="index_k", dtype="uint8", layers=cfg.layers, unit_shape=(page, row_bytes)),
            ),
            objects=(ObjectSpec(suffix="nsa", buffers=("index_k",)),),
            layouts=(Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT),
            eviction_priority=2,
        )
