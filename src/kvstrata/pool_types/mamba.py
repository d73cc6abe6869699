"""``mamba``: conv states and the temporal (SSM) state of every Mamba layer, one slot per node.

A slot is the recurrence state after a node's last token, so a prefix is usable only where a
state exists: the hit rule is "state at the prefix end" and partial hits are all-or-nothing.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

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
)


class StateShape(BaseModel):
    """Shape (per layer, per slot) and dtype of one state tensor."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shape: tuple[int, ...] = Field(min_length=1)
    dtype: Dtype = "bfloat16"

    @field_validator("shape")
    @classmethod
    def _positive(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(dim < 1 for dim in value):
            raise ValueError(f"state shape needs positive dimensions, got {list(value)}")
        return value


class MambaConfig(PoolConfig):
    type: Literal["mamba"] = "mamba"
    layers: int = Field(ge=1, description="number of Mamba / linear-attention layers")
    conv: list[StateShape] = Field(min_length=1, description="conv state tensors (one or more shapes)")
    temporal: StateShape = Field(description="temporal / SSM state tensor")


class MambaPoolType(PoolType):
    name = "mamba"
    Config = MambaConfig
    default_role = PoolRole.COMPONENT

    def spec(self) -> PoolSpec:
        cfg = self.config
        buffers = [
            BufferSpec(name=f"conv_{i}", dtype=state.dtype, layers=cfg.layers, unit_shape=state.shape)
            for i, state in enumerate(cfg.conv)
        ]
        buffers.append(
            BufferSpec(
                name="temporal",
                dtype=cfg.temporal.dtype,
                layers=cfg.layers,
                unit_shape=cfg.temporal.shape,
            )
        )
        return PoolSpec(
            name=self.instance,
            pool_type=self.name,
            role=PoolRole.COMPONENT,
            granularity=Granularity.NODE_STATE,
            hit_rule=HitRule(kind=HitRuleKind.PREFIX_END_STATE, pages=1),
            partial_hit=PartialHit.ALL_OR_NOTHING,
            replication=Replication.SHARDED,
            page_size=self.model.page_size,
            buffers=tuple(buffers),
            objects=(ObjectSpec(suffix="mamba", buffers=tuple(b.name for b in buffers)),),
            layouts=(Layout.LAYER_FIRST, Layout.PAGE_FIRST),
            eviction_priority=0,
        )

    @property
    def role(self) -> PoolRole:
        return PoolRole.COMPONENT
