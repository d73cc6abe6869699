"""``kv``: multi-head attention K and V per layer per token (the usual anchor)."""

from __future__ import annotations

from typing import Literal

from kvstrata.plugins.pool_type import (
    Granularity,
    HitRule,
    HitRuleKind,
    Layout,
    ObjectSpec,
    PartialHit,
    PoolRole,
    PoolSpec,
    PoolType,
    Replication,
)
from kvstrata.pool_types._attention import AttentionConfig, kv_buffers


class KVConfig(AttentionConfig):
    type: Literal["kv"] = "kv"


class KVPoolType(PoolType):
    """Heads are split over TP ranks, so every rank stores its own shard."""

    name = "kv"
    Config = KVConfig
    default_role = PoolRole.ANCHOR

    def spec(self) -> PoolSpec:
        return PoolSpec(
            name=self.instance,
            pool_type=self.name,
            role=self.role,
            index_source=self.index_source,
            granularity=Granularity.TOKEN_PAGES,
            hit_rule=HitRule(kind=HitRuleKind.ALL_PAGES),
            partial_hit=PartialHit.CLAMP,
            replication=Replication.SHARDED,
            page_size=self.model.page_size,
            buffers=kv_buffers(self.config, self.model.page_size),
            objects=(ObjectSpec(suffix="kv", buffers=("k", "v")),),
            layouts=(Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT),
            eviction_priority=2,
            layer_ids=self.config.layer_ids,
        )
