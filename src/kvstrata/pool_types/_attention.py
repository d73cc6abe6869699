"""Fields and buffers shared by the attention-like pool types (kv, swa, draft).

A unit is one page of K (and one of V) per layer, in the unit layout the config chooses:
``token_major`` ``(page, kv_heads, head_dim)`` -- the paged-kernel layout (SGLang, vLLM, FlashInfer)
-- or ``head_major`` ``(kv_heads, page, head_dim)`` -- a page of a ``[batch, heads, tokens, dim]``
cache (Hugging Face, SDPA). The layout is part of the unit shape, hence of the stored objects'
fingerprint: kvstrata never transposes, and an object of one layout never reads as the other.
"""

from __future__ import annotations

from pydantic import Field

from kvstrata.plugins.pool_type import BufferSpec, Dtype, PoolConfig, UnitLayout


class AttentionConfig(PoolConfig):
    """K and V per layer per token; ``v_head_dim`` differs from ``head_dim`` for asymmetric MHA."""

    layers: int = Field(ge=1)
    kv_heads: int = Field(ge=1, description="KV heads held by this rank (after TP sharding)")
    head_dim: int = Field(ge=1)
    v_head_dim: int | None = Field(default=None, ge=1, description="defaults to head_dim")
    dtype: Dtype = "bfloat16"
    unit_layout: UnitLayout = Field(
        default=UnitLayout.TOKEN_MAJOR,
        description="order of one page's K/V: token_major (page, kv_heads, head_dim) as paged "
        "kernels keep it, or head_major (kv_heads, page, head_dim) as a [batch, heads, tokens, dim] "
        "cache keeps it",
    )


def attention_unit(
    layout: UnitLayout, page_size: int, heads: int, dim: int
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(unit_shape, unit_dims)`` of one page of one K or V head group in ``layout``."""
    if layout is UnitLayout.HEAD_MAJOR:
        return (heads, page_size, dim), ("heads", "page", "head_dim")
    return (page_size, heads, dim), ("page", "heads", "head_dim")


def kv_buffers(config: AttentionConfig, page_size: int) -> tuple[BufferSpec, BufferSpec]:
    """K and V buffers of one page per layer."""
    v_dim = config.v_head_dim or config.head_dim
    buffers = []
    for name, dim in (("k", config.head_dim), ("v", v_dim)):
        shape, dims = attention_unit(config.unit_layout, page_size, config.kv_heads, dim)
        buffers.append(
            BufferSpec(
                name=name,
                dtype=config.dtype,
                layers=config.layers,
                unit_shape=shape,
                unit_layout=config.unit_layout,
                unit_dims=dims,
            )
        )
    return buffers[0], buffers[1]
