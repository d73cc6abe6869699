"""What one L2 -> L3 write carries per pool: each unit paired with its own page's hash."""

from __future__ import annotations

import pytest
import torch

from controller_support import open_cache, serve, tokens
from kvstrata.core.l3_values import host_values_per_pool
from kvstrata.core.stack import pool_batch
from kvstrata.core.tree import page_keys
from kvstrata.core.tree_bytes import UNIT


def test_a_window_ending_below_several_short_ancestors_pairs_each_unit_with_its_page() -> None:
    # a node shorter than the window takes the rest of it from its ancestors' host units; where
    # that ran past its parent (1-page nodes, a 4-page window), only the parent's hashes were
    # taken: 4 units went out under 2 page hashes, another page's bytes under a key
    with open_cache("swa-mamba", overrides=["tiers.storage={}"]) as cache:
        request = tokens(39, 5)
        for pages in range(1, 6):  # one node per page, each backed up (write-through)
            lease, _ = serve(cache, request[: pages * cache.page_size])
        keys = page_keys(request, cache.page_size)
        path = cache.tree.match(keys, count_hit=False).path
        assert [node.pages for node in path] == [1, 1, 1, 1, 1]
        leaf, swa = path[-1], cache.tree.index["swa"]
        window = cache.layout.tree_pools["swa"].window
        per_pool, whole = host_values_per_pool(cache.tree, cache.layout, cache.namespace_root, [leaf], None)
        hashes, values = per_pool["swa"]
        assert hashes == lease.page_hashes[5 - window :]
        expected = b"".join(node.host_raw[swa] for node in path[5 - window :])  # type: ignore[misc]
        assert b"".join(values) == expected and len(expected) == window * UNIT
        assert whole == [leaf]
        units, mamba_hashes = per_pool["mamba"][1], per_pool["mamba"][0]
        assert (
            mamba_hashes == lease.page_hashes[-1:]
            and torch.frombuffer(bytearray(b"".join(units)), dtype=torch.int64).numel() == 1
        )


def test_a_batch_whose_units_and_page_hashes_differ_in_count_is_refused() -> None:
    # units and hashes are paired in order: one count off wrote another page's bytes under a key
    with open_cache("kv", overrides=["tiers.storage={}"]) as cache:
        units = torch.arange(4, dtype=torch.int64)
        with pytest.raises(ValueError, match="4 host units for 2 page hashes"):
            pool_batch(cache.pools, "kv", units, ["a" * 32, "b" * 32])
        assert len(pool_batch(cache.pools, "kv", units, [str(i) * 32 for i in range(4)]).units) == 4
