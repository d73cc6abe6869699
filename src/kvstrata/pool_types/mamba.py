"""``mamba``: the recurrent state of every Mamba / linear-attention / short-conv layer, one slot per node.

A slot is the recurrence state after a node's last token, so a prefix is usable only where a
state exists: the hit rule is "state at the prefix end" and partial hits are all-or-nothing.

Which tensors a slot holds is the model's business, so the config names them:

``states: {name: {shape, dtype}}``
    any set of named state tensors (at least one), each ``shape`` per layer per slot. A conv-only
    layer (LFM2's short conv) has one conv state; Mamba2 / GDN have a conv state and a temporal
    (SSM) state; a model may keep several of either. Buffers keep the mapping's order.
``conv: [{shape, dtype}, ...]`` + ``temporal: {shape, dtype}``
    the older spelling of "conv states + one temporal state"; it yields buffers ``conv_0``,
    ``conv_1`` ... then ``temporal`` -- the same spec, fingerprint and stored objects as before
    ``states`` existed. A config uses one spelling, not both.

The conv convention: a causal depthwise conv with kernel ``k`` needs the last inputs per channel
to continue, so a conv state is the engine's rolling window of those inputs -- typically
``(channels, k - 1)`` (SGLang, vLLM) or ``(channels, k)`` (Hugging Face's Mamba2 / LFM2 caches keep
the whole kernel window). kvstrata does not interpret it: it stores the engine's tensor bytes as
they are, in the shape and dtype the config declares, and restores them bit-exactly. Declare the
shape your engine's per-request state has (after tensor-parallel sharding, for this rank).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

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
from kvstrata.plugins.user_config import UserConfig

#: A state tensor's name becomes its buffer name (and appears in object layouts and tools).
STATE_NAME = r"^[a-z0-9_]+$"


class StateShape(UserConfig):
    """Shape (per layer, per slot) and dtype of one state tensor."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shape: tuple[int, ...] = Field(min_length=1)
    dtype: Dtype = "bfloat16"
    dims: tuple[str, ...] = Field(
        default=(),
        description="optional name of each shape dimension (e.g. [channels, kernel]), in order: "
        "part of the stored layout (a transposed state can have the same shape)",
    )

    @field_validator("shape")
    @classmethod
    def _positive(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(dim < 1 for dim in value):
            raise ValueError(f"state shape needs positive dimensions, got {list(value)}")
        return value

    @model_validator(mode="after")
    def _dims_name_shape(self) -> StateShape:
        if self.dims and len(self.dims) != len(self.shape):
            raise ValueError(
                f"dims {list(self.dims)} must name each of the {len(self.shape)} shape dimensions"
            )
        return self


class MambaConfig(PoolConfig):
    type: Literal["mamba"] = "mamba"
    layers: int = Field(ge=1, description="number of Mamba / linear-attention / conv layers")
    states: dict[str, StateShape] | None = Field(
        default=None,
        description="named state tensors of one slot (at least one), e.g. {conv: ..., ssm: ...}; "
        "instead of conv + temporal",
    )
    conv: list[StateShape] | None = Field(
        default=None, min_length=1, description="conv state tensors (older spelling; needs temporal)"
    )
    temporal: StateShape | None = Field(
        default=None, description="temporal / SSM state tensor (older spelling; needs conv)"
    )

    @field_validator("states")
    @classmethod
    def _named_states(cls, value: dict[str, StateShape] | None) -> dict[str, StateShape] | None:
        if value is None:
            return value
        if not value:
            raise ValueError("states needs at least one state tensor")
        bad = [name for name in value if re.fullmatch(STATE_NAME, name) is None]
        if bad:
            raise ValueError(f"state names must match {STATE_NAME} (they name buffers): {bad}")
        return value

    @model_validator(mode="after")
    def _one_spelling(self) -> MambaConfig:
        older = [field for field in ("conv", "temporal") if getattr(self, field) is not None]
        if self.states is not None and older:
            raise ValueError(f"states: give either states or conv + temporal, not both (also set: {older})")
        if self.states is None:
            if not older:
                raise ValueError("states: a mamba pool needs states (or the older conv + temporal)")
            if len(older) == 1:
                missing = "temporal" if older == ["conv"] else "conv"
                raise ValueError(
                    f"{missing}: the older spelling needs both conv and temporal; for other sets of "
                    "state tensors use states: {name: {shape, dtype}}"
                )
        return self

    def state_tensors(self) -> dict[str, StateShape]:
        """Buffer name -> state tensor, in buffer order, whichever spelling the config used."""
        if self.states is not None:
            return dict(self.states)
        assert self.conv is not None and self.temporal is not None  # checked by _one_spelling
        named = {f"conv_{i}": state for i, state in enumerate(self.conv)}
        named["temporal"] = self.temporal
        return named


class MambaPoolType(PoolType):
    name = "mamba"
    Config = MambaConfig
    default_role = PoolRole.COMPONENT

    def spec(self) -> PoolSpec:
        cfg = self.config
        buffers = tuple(
            BufferSpec(
                name=name,
                dtype=state.dtype,
                layers=cfg.layers,
                unit_shape=state.shape,
                unit_dims=state.dims,
            )
            for name, state in cfg.state_tensors().items()
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
            buffers=buffers,
            objects=(ObjectSpec(suffix="mamba", buffers=tuple(b.name for b in buffers)),),
            layouts=(Layout.LAYER_FIRST, Layout.PAGE_FIRST),
            eviction_priority=0,
            layer_ids=self.config.layer_ids,
        )

    @property
    def role(self) -> PoolRole:
        return PoolRole.COMPONENT
