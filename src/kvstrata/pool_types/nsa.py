"""``nsa``: the DSA/NSA indexer keys, one row per token per layer.

Two key formats (``key_dtype``):

* ``fp8_with_scales`` (default, SGLang's DSA kernels): ``index_head_dim`` fp8 values plus one fp32
  scale per 128-element block, stored as opaque bytes ``(page, index_head_dim + scales)`` uint8;
  ``index_head_dim`` is a multiple of 128.
* ``bfloat16`` / ``float16`` / ``float32`` (e.g. DeepSeek V3.2 in Hugging Face, which keeps float
  indexer keys ``[tokens, 16]``): ``(page, index_head_dim)`` of that dtype, any head dim >= 1.

A sidecar: it shares the anchor's page indices and keys, so every anchor page needs its indexer
page (a missing one silently corrupted L3 hits in SGLang before it was stored). A shortfall clamps
the prefix to min(anchor, indexer).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

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
    UnitLayout,
)

QUANT_BLOCK = 128
SCALE_BYTES = 4  # one fp32 scale per block
FP8_WITH_SCALES = "fp8_with_scales"

KeyDtype = Literal["fp8_with_scales", "bfloat16", "float16", "float32"]


class NSAConfig(PoolConfig):
    type: Literal["nsa"] = "nsa"
    layers: int = Field(ge=1)
    key_dtype: KeyDtype = Field(
        default=FP8_WITH_SCALES,
        description="fp8_with_scales: fp8 values + one fp32 scale per 128 (opaque bytes); or float "
        "keys of this dtype",
    )
    index_head_dim: int = Field(
        default=128,
        ge=1,
        description="elements of one token's index key: a multiple of 128 for fp8_with_scales, any "
        "for float keys",
    )
    replication: Replication = Replication.REPLICATED

    @model_validator(mode="after")
    def _head_dim_fits_format(self) -> NSAConfig:
        if self.key_dtype == FP8_WITH_SCALES and self.index_head_dim % QUANT_BLOCK:
            raise ValueError(
                f"index_head_dim {self.index_head_dim} must be a multiple of {QUANT_BLOCK} with "
                f"key_dtype {FP8_WITH_SCALES} (one scale per {QUANT_BLOCK} values); float keys "
                "(key_dtype bfloat16/float16/float32) take any head dim"
            )
        return self


class NSAIndexerPoolType(PoolType):
    name = "nsa"
    Config = NSAConfig
    default_role = PoolRole.SIDECAR

    def key_buffer(self) -> BufferSpec:
        """The index keys of one page per layer, in the configured format."""
        cfg, page = self.config, self.model.page_size
        if cfg.key_dtype == FP8_WITH_SCALES:
            row_bytes = cfg.index_head_dim + cfg.index_head_dim // QUANT_BLOCK * SCALE_BYTES
            dtype, unit_shape, dims = "uint8", (page, row_bytes), ("page", "key_and_scale_bytes")
        else:
            dtype, unit_shape, dims = cfg.key_dtype, (page, cfg.index_head_dim), ("page", "index_head_dim")
        return BufferSpec(
            name="index_k",
            dtype=dtype,
            layers=cfg.layers,
            unit_shape=unit_shape,
            unit_layout=UnitLayout.TOKEN_MAJOR,
            unit_dims=dims,
        )

    def spec(self) -> PoolSpec:
        return PoolSpec(
            name=self.instance,
            pool_type=self.name,
            role=self.role,
            index_source=self.index_source,
            granularity=Granularity.TOKEN_PAGES,
            hit_rule=HitRule(kind=HitRuleKind.ALL_PAGES),
            partial_hit=PartialHit.CLAMP,
            replication=self.config.replication,
            page_size=self.model.page_size,
            buffers=(self.key_buffer(),),
            objects=(ObjectSpec(suffix="nsa", buffers=("index_k",)),),
            layouts=(Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT),
            eviction_priority=2,
            layer_ids=self.config.layer_ids,
        )
