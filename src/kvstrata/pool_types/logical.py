"""``logical``: a page index space without bytes, the anchor of stacks with no full-KV pool.

DeepSeek-V4-style models have only windowed and compressed state; the logical anchor still gives
every page a stable index and key so sidecars can hang off it. In storage it is a header-only
marker object per page: the commit marker other pools' objects are validated against.
"""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from kvstrata.plugins.pool_type import (
    Granularity,
    HitRule,
    HitRuleKind,
    Layout,
    PartialHit,
    PoolConfig,
    PoolRole,
    PoolSpec,
    PoolType,
    Replication,
)


class LogicalConfig(PoolConfig):
    type: Literal["logical"] = "logical"

    @model_validator(mode="after")
    def _no_layers(self) -> LogicalConfig:
        if self.layer_ids is not None:
            raise ValueError("layer_ids: a logical pool holds no layers")
        return self


class LogicalPoolType(PoolType):
    name = "logical"
    Config = LogicalConfig
    default_role = PoolRole.ANCHOR

    def spec(self) -> PoolSpec:
        return PoolSpec(
            name=self.instance,
            pool_type=self.name,
            role=PoolRole.ANCHOR,
            granularity=Granularity.TOKEN_PAGES,
            hit_rule=HitRule(kind=HitRuleKind.ALL_PAGES),
            partial_hit=PartialHit.CLAMP,
            replication=Replication.REPLICATED,
            page_size=self.model.page_size,
            layouts=tuple(Layout),
            eviction_priority=2,
        )

    @property
    def role(self) -> PoolRole:
        return PoolRole.ANCHOR
