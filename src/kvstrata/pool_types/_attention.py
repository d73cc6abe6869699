"""Fields and buffers shared by the attention-like pool types (kv, swa, draft)."""

from __future__ import annotations

from pydantic import Field

from kvstrata.plugins.pool_type import BufferSpec, Dtype, PoolConfig


class AttentionConfig(PoolConfig):
    """K and V per layer per token; ``v_head_dim`` differs from ``head_dim`` for asymmetric MHA."""

    layers: int = Field(ge=1)
    kv_heads: int = Field(ge=1, description="KV heads held by this rank (after TP sharding)")
    head_dim: int = Field(ge=1)
    v_head_dim: int | None = Field(default=None, ge=1, description="defaults to head_dim")
    dtype: Dtype = "bfloat16"


def kv_buffers(config: AttentionConfig, page_size: int) -> tuple[BufferSpec, BufferSpec]:
    """K and V buffers of one page per layer."""
    v_dim = config.v_head_dim or config.head_dim
    return (
        BufferSpec(
            name="k",
            dtype=config.dtype,
            layers=config.layers,
            unit_shape=(page_size, config.kv_heads, config.head_dim),
        ),
        BufferSpec(
            name="v",
            dtype=config.dtype,
            layers=config.layers,
            unit_shape=(page_size, config.kv_heads, v_dim),
        ),
    )
