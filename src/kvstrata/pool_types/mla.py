"""``mla``: multi-head latent attention, a compressed latent plus a rope part per layer per token.

The latent is identical on every TP rank, so one rank writes it and keys carry no rank. The latent
is one head shared by all query heads, so a unit is token-major ``(page, kv_lora_rank)`` (and
``(page, qk_rope_head_dim)``); there is no head dimension to put first.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvstrata.plugins.pool_type import (
    BufferSpec,
    Dtype,
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
    UnitLayout,
)


class MLAConfig(PoolConfig):
    type: Literal["mla"] = "mla"
    layers: int = Field(ge=1)
    kv_lora_rank: int = Field(default=512, ge=1)
    qk_rope_head_dim: int = Field(default=64, ge=0)
    dtype: Dtype = "bfloat16"


class MLAPoolType(PoolType):
    name = "mla"
    Config = MLAConfig
    default_role = PoolRole.ANCHOR

    def spec(self) -> PoolSpec:
        cfg, page = self.config, self.model.page_size
        buffers = [
            BufferSpec(
                name="latent",
                dtype=cfg.dtype,
                layers=cfg.layers,
                unit_shape=(page, cfg.kv_lora_rank),
                unit_layout=UnitLayout.TOKEN_MAJOR,
                unit_dims=("page", "kv_lora_rank"),
            )
        ]
        if cfg.qk_rope_head_dim:
            buffers.append(
                BufferSpec(
                    name="rope",
                    dtype=cfg.dtype,
                    layers=cfg.layers,
                    unit_shape=(page, cfg.qk_rope_head_dim),
                    unit_layout=UnitLayout.TOKEN_MAJOR,
                    unit_dims=("page", "qk_rope_head_dim"),
                )
            )
        return PoolSpec(
            name=self.instance,
            pool_type=self.name,
            role=self.role,
            index_source=self.index_source,
            granularity=Granularity.TOKEN_PAGES,
            hit_rule=HitRule(kind=HitRuleKind.ALL_PAGES),
            partial_hit=PartialHit.CLAMP,
            replication=Replication.REPLICATED,
            page_size=page,
            buffers=tuple(buffers),
            objects=(ObjectSpec(suffix="mla", buffers=tuple(b.name for b in buffers)),),
            layouts=(Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT),
            eviction_priority=2,
            layer_ids=self.config.layer_ids,
        )
