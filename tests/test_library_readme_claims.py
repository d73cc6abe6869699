"""What the README's library section says an engine author can rely on (issue 27, item 11):
``cached_tokens`` before ``admit`` is an error (never a silent 0), ``allocate``'s types, buffer
names and default dtypes, a fully cached prompt coming back whole, ``close()`` flushing L3."""

from __future__ import annotations

import tempfile

import pytest
import torch

import kvstrata

PAGE = 16


def config(l3: str) -> dict[str, object]:
    return {
        "model": {
            "name": "readme-claims",
            "page_size": PAGE,
            "pools": {
                "kv": {"type": "kv", "layers": 2, "kv_heads": 1, "head_dim": 8},
                "mamba": {"type": "mamba", "layers": 1, "states": {"conv": {"shape": [3, 4]}}},
            },
        },
        "tiers": {
            "device": {"capacity_tokens": 1024},
            "host": {"capacity_tokens": 2048},
            "storage": {"l3": {"type": "file", "path": l3}},
        },
        "policy": {"prefetch": {"policy": "wait_complete"}},
    }


def fill(cache: kvstrata.CacheController, units: dict[str, torch.Tensor]) -> None:
    for pool, index in units.items():
        if len(index):
            spec = cache.pools.pool(pool).spec
            cache.write_units(
                pool,
                index,
                {
                    b.name: torch.ones((len(index), b.layers, *b.unit_shape), dtype=getattr(torch, b.dtype))
                    for b in spec.buffers
                },
            )


def test_the_library_section_holds() -> None:
    l3 = tempfile.mkdtemp()
    prompt = torch.arange(64)  # 4 whole pages
    with kvstrata.open(config(l3)) as cache:
        assert {b.name: b.dtype for b in cache.pools.pool("kv").spec.buffers} == {
            "k": "bfloat16",
            "v": "bfloat16",
        }
        assert [b.name for b in cache.pools.pool("mamba").spec.buffers] == ["conv"]
        lease = cache.lookup(prompt)
        with pytest.raises(RuntimeError, match=r"settled by cache\.admit"):
            _ = lease.cached_tokens
        cache.admit(lease)
        assert lease.cached_tokens == 0 and isinstance(lease.cached_pages, int)
        units = cache.allocate(lease)
        assert set(units) == {"kv", "mamba"}
        assert all(isinstance(u, torch.Tensor) and u.dtype == torch.int64 for u in units.values())
        fill(cache, units)
        cache.insert(lease)
        again = cache.lookup(prompt)
        assert again.device_pages == 4  # what lookup matched, readable before admit
        cache.admit(again)
        assert again.cached_tokens == len(prompt)  # whole: the engine must still run the last token
        cache.release(again)
    # close() flushed the L3 writes: a new cache (empty L1/L2) restores the prompt from storage
    with kvstrata.open(config(l3)) as cache:
        lease = cache.lookup(prompt)
        cache.admit(lease)
        assert lease.cached_tokens == 64 and lease.hit_pages["storage"] == 4, lease.hit_pages
        cache.release(lease)
