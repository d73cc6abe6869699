"""Fields and buffers shared by the attention-like pool types (kv, swa, draft)."""

from __future__ import annotations

from pydantic import Field, model_validator

from kvstrata.plugins.pool_type import SUPPORTED_DTYPES, BufferSpec, PoolConfig


class AttentionConfig(PoolConfig):
    """K and V per layer per token; ``v_head_dim`` differs from ``head_dim`` for asymmetric MHA."""

    layers: int = Field(ge=1)
    kv_heads: int = Field(ge=1, description="KV heads held by this rank (after TP sharding)")
    head_dim: int = Field(ge=1)
    v_head_dim: int | None = Field(default=None, ge=1, description="defaults to head_dim")
    dtype: str = "bfloat16"

    @model_validator(mode="after")
    def _known_dtype(self) -> AttentionConfig:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {list(SUPPORTED_DTYPES)}")
        return self


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
