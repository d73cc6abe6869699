"""Shared by tests/test_adapter_sglang.py and the writer/reader processes it starts.

Page content is a pure function of (seed, page number), so a second process knows what a page
must hold. Tokens are read and written in SGLang's host buffers through indexing written here from
SGLang's documented buffer shapes per layout (``init_kv_buffer``) -- an oracle independent of the
adapter's own page views.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

from kvstrata.testing.sglang_cpu import (
    load_sglang_mem_cache,
    mha_host_pool,
    mla_host_pool,
    storage_config,
)

MHA = {"layers": 2, "heads": 4, "head_dim": 64, "page_size": 16}
MLA = {"layers": 2, "kv_lora_rank": 96, "qk_rope_head_dim": 32, "page_size": 16}
HOST_PAGES = 12
ADAPTER = {
    "backend_name": "kvstrata",
    "module_path": "kvstrata.adapters.sglang",
    "class_name": "KvstrataHiCacheStorage",
    "interface_v1": 1,
}


def page_keys(count: int, seed: int = 0) -> list[str]:
    """A SHA-256 page-hash chain like SGLang's (hex strings)."""
    keys, previous = [], f"seed-{seed}".encode()
    for page in range(count):
        previous = hashlib.sha256(previous + page.to_bytes(4, "little")).digest()
        keys.append(previous.hex())
    return keys


def random_bits(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """bfloat16 values with arbitrary bit patterns (a copy that converts would change them)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator).view(torch.bfloat16)


def mha_page(seed: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one page: (layers, page_size, heads, head_dim) each."""
    shape = (MHA["layers"], MHA["page_size"], MHA["heads"], MHA["head_dim"])
    return random_bits(shape, seed * 100_003 + 2 * page), random_bits(shape, seed * 100_003 + 2 * page + 1)


def mla_page(seed: int, page: int) -> torch.Tensor:
    """MLA rows of one page: (layers, page_size, kv_lora_rank + rope)."""
    shape = (MLA["layers"], MLA["page_size"], MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"])
    return random_bits(shape, seed * 100_003 + 77_777 + page)


# --- token access per layout (the oracle) ------------------------------------------------------


def _mha_index(pool: Any, slots: torch.Tensor, component: int) -> tuple[Any, ...]:
    page = pool.page_size
    layout = pool.layout
    if layout == "layer_first":  # (2, L, size, H, D)
        return (component, slice(None), slots)
    if layout == "page_first":  # (2, size, L, H, D)
        return (component, slots)
    if layout in ("page_first_direct", "page_head"):  # (2, P, L, t, H, D) / (2, P, H, t, L, D)
        return (component, slots // page, slice(None), slots % page)
    if layout == "page_unified":  # (P, G, L, 2, t, H/G, D)
        return (slots // page, slice(None), slice(None), component, slots % page)
    raise ValueError(layout)


def mha_tokens(pool: Any, slots: torch.Tensor, component: int) -> torch.Tensor:
    """K (0) or V (1) of ``slots`` as (layers, n, heads, head_dim)."""
    data = pool.kv_buffer[_mha_index(pool, slots, component)]
    layout = pool.layout
    if layout == "layer_first":
        return data
    if layout in ("page_first", "page_first_direct"):  # (n, L, H, D)
        return data.transpose(0, 1)
    if layout == "page_head":  # (n, H, L, D)
        return data.permute(2, 0, 1, 3)
    n, groups, layers, per_group, dim = data.shape  # page_unified (n, G, L, H/G, D)
    return data.permute(2, 0, 1, 3, 4).reshape(layers, n, groups * per_group, dim)


def set_mha_tokens(pool: Any, slots: torch.Tensor, component: int, values: torch.Tensor) -> None:
    layout = pool.layout
    if layout == "layer_first":
        data = values
    elif layout in ("page_first", "page_first_direct"):
        data = values.transpose(0, 1)
    elif layout == "page_head":
        data = values.permute(1, 2, 0, 3)
    else:
        layers, n, heads, dim = values.shape
        groups = pool.kv_buffer.shape[1]
        data = values.reshape(layers, n, groups, heads // groups, dim).permute(1, 2, 0, 3, 4)
    pool.kv_buffer[_mha_index(pool, slots, component)] = data


def mla_tokens(pool: Any, slots: torch.Tensor) -> torch.Tensor:
    """Rows of ``slots`` as (layers, n, row)."""
    page, layout, buffer = pool.page_size, pool.layout, pool.kv_buffer
    if layout == "layer_first":  # (L, size, 1, C)
        return buffer[:, slots, 0]
    if layout == "page_first":  # (size, L, 1, C)
        return buffer[slots, :, 0].transpose(0, 1)
    if buffer.dim() == 4:  # page_unified: (P, L, t, C)
        return buffer[slots // page, :, slots % page].transpose(0, 1)
    return buffer[slots // page, :, slots % page, 0].transpose(0, 1)  # (P, L, t, 1, C)


def set_mla_tokens(pool: Any, slots: torch.Tensor, values: torch.Tensor) -> None:
    page, layout, buffer = pool.page_size, pool.layout, pool.kv_buffer
    if layout == "layer_first":
        buffer[:, slots, 0] = values
    elif layout == "page_first":
        buffer[slots, :, 0] = values.transpose(0, 1)
    elif buffer.dim() == 4:
        buffer[slots // page, :, slots % page] = values.transpose(0, 1)
    else:
        buffer[slots // page, :, slots % page, 0] = values.transpose(0, 1)


def slots_of(host_page: int, page_size: int) -> torch.Tensor:
    return torch.arange(host_page * page_size, (host_page + 1) * page_size)


def fill_mha(pool: Any, host_pages: list[int], seed: int, pages: list[int]) -> torch.Tensor:
    """Put content page ``pages[i]`` into host page ``host_pages[i]``; returns the host indices."""
    for host_page, page in zip(host_pages, pages, strict=True):
        k, v = mha_page(seed, page)
        slots = slots_of(host_page, pool.page_size)
        set_mha_tokens(pool, slots, 0, k)
        set_mha_tokens(pool, slots, 1, v)
    return torch.cat([slots_of(p, pool.page_size) for p in host_pages])


def mha_holds(pool: Any, host_page: int, seed: int, page: int) -> bool:
    """Bit-exact: host page ``host_page`` holds content page ``page``."""
    k, v = mha_page(seed, page)
    slots = slots_of(host_page, pool.page_size)
    return all(
        torch.equal(mha_tokens(pool, slots, c).view(torch.int16), want.view(torch.int16))
        for c, want in ((0, k), (1, v))
    )


def fill_mla(pool: Any, host_pages: list[int], seed: int, pages: list[int]) -> torch.Tensor:
    for host_page, page in zip(host_pages, pages, strict=True):
        set_mla_tokens(pool, slots_of(host_page, pool.page_size), mla_page(seed, page))
    return torch.cat([slots_of(p, pool.page_size) for p in host_pages])


def mla_holds(pool: Any, host_page: int, seed: int, page: int) -> bool:
    got = mla_tokens(pool, slots_of(host_page, pool.page_size))
    return torch.equal(got.view(torch.int16), mla_page(seed, page).view(torch.int16))


# --- building the real SGLang objects ------------------------------------------------------------


def new_mha_pool(layout: str, **overrides: Any) -> Any:
    return mha_host_pool(
        layers=MHA["layers"],
        heads=MHA["heads"],
        head_dim=MHA["head_dim"],
        page_size=MHA["page_size"],
        host_pages=HOST_PAGES,
        layout=layout,
        **overrides,
    )


def new_mla_pool(layout: str) -> Any:
    return mla_host_pool(
        layers=MLA["layers"],
        kv_lora_rank=MLA["kv_lora_rank"],
        qk_rope_head_dim=MLA["qk_rope_head_dim"],
        page_size=MLA["page_size"],
        host_pages=HOST_PAGES,
        layout=layout,
    )


def open_adapter(kvstrata_config: Any, pool: Any, *, is_mla: bool = False, **config: Any) -> Any:
    """SGLang's own factory, dynamic path, exactly as its cache controller calls it."""
    load_sglang_mem_cache()
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra = {**ADAPTER, "kvstrata_config": kvstrata_config}
    cfg = storage_config(extra_config=extra, is_mla_model=is_mla, **config)
    storage = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    storage.register_mem_pool_host(pool)
    return storage


# --- the second process ---------------------------------------------------------------------------


def write_pages(kvstrata_config: Any, seed: int, count: int) -> dict[str, Any]:
    """What the writer process does: MHA pages (page_first, zero-copy v1) and MLA pages
    (page_first, SGLang's generic flat-page path), keys ``page_keys(count, seed)``."""
    keys = page_keys(count, seed)
    host_pages = list(range(1, count + 1))
    mha = new_mha_pool("page_first")
    storage = open_adapter(kvstrata_config, mha)
    indices = fill_mha(mha, host_pages, seed, list(range(count)))
    v1 = storage.batch_set_v1(keys, indices)
    storage.close()

    mla = new_mla_pool("page_first")
    storage = open_adapter(kvstrata_config, mla, is_mla=True)
    fill_mla(mla, host_pages, seed, list(range(count)))
    flats = [mla.get_data_page(p * mla.page_size, flat=True) for p in host_pages]
    generic = storage.batch_set([f"mla-{key}" for key in keys], flats)
    storage.close()
    return {"v1": v1, "generic": generic}


if __name__ == "__main__":  # python tests/sglang_support.py write '<json config>' SEED COUNT
    command, config, seed, count = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    assert command == "write"
    sys.path.insert(0, str(Path(__file__).parent))
    print(json.dumps(write_pages(config, seed, count)))
