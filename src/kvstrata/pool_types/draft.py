"""``draft``: the speculative draft model's KV, a sidecar of the anchor.

Without it an L2/L3 hit restores the target KV but leaves the draft model computing on garbage,
and acceptance collapses. Draft pools often arrive after start (the draft worker starts later).
"""

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


class DraftConfig(AttentionConfig):
    type: Literal["draft"] = "draft"


class DraftPoolType(PoolType):
    name = "draft"
    Config = DraftConfig
    default_role = PoolRole.SIDECAR

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
            objects=(ObjectSpec(suffix="draft", buffers=("k", "v")),),
            layouts=(Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT),
            eviction_priority=2,
            layer_ids=self.config.layer_ids,
        )
