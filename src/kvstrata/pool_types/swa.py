"""``swa``: K/V of sliding-window attention layers; only the last ``window`` tokens matter.

A component with its own allocator. The core keeps the window data of every page a prefill
computes and tombstones what lies outside every cached prefix's last window first; a prefix is
usable (and restorable from L3) only where its whole last window is present.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

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


class SWAConfig(AttentionConfig):
    type: Literal["swa"] = "swa"
    window: int = Field(ge=1, description="sliding window in tokens")


class SWAPoolType(PoolType):
    name = "swa"
    Config = SWAConfig
    default_role = PoolRole.COMPONENT

    def window_pages(self) -> int:
        return math.ceil(self.config.window / self.model.page_size)

    def spec(self) -> PoolSpec:
        return PoolSpec(
            name=self.instance,
            pool_type=self.name,
            role=PoolRole.COMPONENT,
            granularity=Granularity.TOKEN_PAGES,
            hit_rule=HitRule(kind=HitRuleKind.TRAILING_PAGES, pages=self.window_pages()),
            partial_hit=PartialHit.ALL_OR_NOTHING,
            replication=Replication.SHARDED,
            page_size=self.model.page_size,
            buffers=kv_buffers(self.config, self.model.page_size),
            objects=(ObjectSpec(suffix="swa", buffers=("k", "v")),),
            layouts=(Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT),
            eviction_priority=1,
            layer_ids=self.config.layer_ids,
            fingerprint_extra=(("window_tokens", self.config.window),),
        )

    @property
    def role(self) -> PoolRole:
        return PoolRole.COMPONENT
