"""SGLang's host KV buffers seen page by page: for each host layout, a strided view shaped
``(pages, *canonical)`` whose C order per page is the stored byte order (see ``_sglang_pages``).
Written from SGLang's ``init_kv_buffer`` shapes; no ``sglang`` import needed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

MHA_CLASS = "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost"
MLA_CLASS = "sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost"

PageView = Callable[[Any], torch.Tensor]


def _mha_views() -> dict[str, PageView]:
    """SGLang MHA host buffer per layout (its ``init_kv_buffer``) -> ``(P, 2, t, L, H, D)``."""

    def page_first(pool: Any) -> torch.Tensor:  # (2, size, L, H, D)
        b, p = pool.kv_buffer, pool.page_size
        return b.view(2, -1, p, pool.layer_num, pool.head_num, pool.head_dim).permute(1, 0, 2, 3, 4, 5)

    def layer_first(pool: Any) -> torch.Tensor:  # (2, L, size, H, D)
        b, p = pool.kv_buffer, pool.page_size
        return b.view(2, pool.layer_num, -1, p, pool.head_num, pool.head_dim).permute(2, 0, 3, 1, 4, 5)

    def page_first_direct(pool: Any) -> torch.Tensor:  # (2, P, L, t, H, D)
        return pool.kv_buffer.permute(1, 0, 3, 2, 4, 5)

    def page_head(pool: Any) -> torch.Tensor:  # (2, P, H, t, L, D)
        return pool.kv_buffer.permute(1, 0, 3, 4, 2, 5)

    def page_unified(pool: Any) -> torch.Tensor:  # (P, G, L, 2, t, H/G, D) -> (P, 2, t, L, G, H/G, D)
        return pool.kv_buffer.permute(0, 3, 4, 2, 1, 5, 6)

    return {
        "page_first": page_first,
        "layer_first": layer_first,
        "page_first_direct": page_first_direct,
        "page_head": page_head,
        "page_unified": page_unified,
    }


def _mla_views() -> dict[str, PageView]:
    """SGLang MLA host buffer per layout -> ``(P, t, L, row)`` (row = latent and rope, packed)."""

    def page_first(pool: Any) -> torch.Tensor:  # (size, L, 1, C)
        return pool.kv_buffer.view(-1, pool.page_size, pool.layer_num, pool.kv_cache_dim)

    def layer_first(pool: Any) -> torch.Tensor:  # (L, size, 1, C)
        b, p = pool.kv_buffer, pool.page_size
        return b.view(pool.layer_num, -1, p, pool.kv_cache_dim).permute(1, 2, 0, 3)

    def page_major(pool: Any) -> torch.Tensor:  # (P, L, t, 1, C) or (P, L, t, C)
        b = pool.kv_buffer
        return b.view(b.shape[0], pool.layer_num, pool.page_size, pool.kv_cache_dim).permute(0, 2, 1, 3)

    return {
        "page_first": page_first,
        "layer_first": layer_first,
        "page_first_direct": page_major,
        "page_unified": page_major,
    }


MHA_PAGE_VIEWS = _mha_views()
MLA_PAGE_VIEWS = _mla_views()


def _split_kv_views() -> dict[str, Callable[[Any, torch.Tensor], torch.Tensor]]:
    """SGLang's asymmetric MHA host pool (K and V in two buffers, ``head_dim != v_head_dim``; its
    ``init_kv_buffer`` takes two layouts) -> each buffer as ``(P, t, L, H, dim)``."""

    def page_first(pool: Any, buffer: torch.Tensor) -> torch.Tensor:  # (size, L, H, dim)
        return buffer.view(-1, pool.page_size, *buffer.shape[1:])

    def page_first_direct(pool: Any, buffer: torch.Tensor) -> torch.Tensor:  # (P, L, t, H, dim)
        return buffer.permute(0, 2, 1, 3, 4)

    return {"page_first": page_first, "page_first_direct": page_first_direct}


SPLIT_KV_VIEWS = _split_kv_views()
