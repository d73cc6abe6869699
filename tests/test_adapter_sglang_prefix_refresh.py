"""SGLang names, above each 128-page batch of a request it backs up or queries, the prefix and every
batch before it (``extra_info.prefix_keys``, ``hicache_storage_pass_prefix_keys``). The adapter asks
L3 for those keys (a use, for an LRU store): once per request, not once per batch, which cost
O(pages^2 / 128) lookups -- but again whenever anything else used the store in between."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvstrata.testing.sglang_cpu import SGLangUnavailable, load_sglang_mem_cache

try:
    load_sglang_mem_cache()
except SGLangUnavailable as exc:
    if os.environ.get("KVSTRATA_REQUIRE_SGLANG") == "1":
        raise
    pytest.skip(str(exc), allow_module_level=True)

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

import sglang_support as support

BATCH = 4  # SGLang's is 128; the adapter does not care
BATCHES = 12


def _adapter(tmp_path: Path) -> tuple[Any, Any, list[list[str]]]:
    """An adapter whose storage engine records the keys of every existence query."""
    pool = support.new_mha_pool("layer_first")
    storage = support.open_adapter(
        {"tiers": {"storage": {"l3": {"type": "file", "path": str(tmp_path)}}}}, pool
    )
    asked: list[list[str]] = []
    engine = storage.pages.engine
    original = engine.exists

    def exists(pool_name: str, keys: list[str], *args: Any, **kwargs: Any) -> Any:
        asked.append(list(keys))
        return original(pool_name, keys, *args, **kwargs)

    engine.exists = exists
    return storage, pool, asked


def _back_up(storage: Any, pool: Any, prefix: list[str], batches: list[list[str]]) -> None:
    """SGLang's ``_page_backup``: batch by batch, ``prefix_keys = prefix_keys + batch_hashes``."""
    indices = support.fill_mha(pool, list(range(BATCH)), 1, list(range(BATCH)))
    for batch in batches:
        assert (
            storage.batch_set_v1(batch, indices, HiCacheStorageExtraInfo(prefix_keys=prefix))
            == [True] * BATCH
        )
        prefix = prefix + batch


def _count(asked: list[list[str]]) -> int:
    return sum(len(keys) for keys in asked)


def _hashes(keys: list[str]) -> list[str]:
    from kvstrata.adapters._shared import page_key

    return [page_key(key) for key in keys]


def test_a_long_backup_asks_for_its_prefix_once_not_per_batch(tmp_path: Path) -> None:
    storage, pool, asked = _adapter(tmp_path)
    keys = support.page_keys(2 + BATCH * BATCHES, seed=5)
    system, rest = keys[:2], keys[2:]
    batches = [rest[i : i + BATCH] for i in range(0, len(rest), BATCH)]
    try:
        indices = support.fill_mha(pool, [0, 1], 1, [0, 1])
        assert storage.batch_set_v1(system, indices, HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 2
        assert storage.batch_get_v1(system, indices) == [True] * 2  # not the backup's chain now
        asked.clear()
        _back_up(storage, pool, list(system), batches)
        # the same keys asked as before (the prefix, each batch's dedup) ...
        assert {key for call in asked for key in call} == set(_hashes(keys))
        # ... each once: the prefix at the first batch, then only each batch's own dedup. Asking
        # the whole prefix above every batch was 2 + 4 + ... + 46 = 288 more keys here (quadratic)
        assert _count(asked) == len(system) + BATCH * BATCHES

        # SGLang's hit query the same way: batch_exists per batch, prefix growing
        asked.clear()
        prefix = list(system)
        for batch in batches:
            assert storage.batch_exists(batch, HiCacheStorageExtraInfo(prefix_keys=prefix)) == BATCH
            prefix = prefix + batch
        assert {key for call in asked for key in call} == set(_hashes(keys))
        assert _count(asked) == len(system) + BATCH * BATCHES
    finally:
        storage.close()


def test_a_prefix_is_asked_again_when_other_traffic_came_between_batches(tmp_path: Path) -> None:
    """The skip holds only while nothing else used the store: otherwise the prefix would fall
    behind that traffic in an LRU (what ``test_adapter_sglang_bounded_l3`` guards end to end)."""
    storage, pool, asked = _adapter(tmp_path)
    keys = support.page_keys(2 + 2 * BATCH, seed=6)
    system, first, second = keys[:2], keys[2 : 2 + BATCH], keys[2 + BATCH :]
    indices = support.fill_mha(pool, list(range(BATCH)), 1, list(range(BATCH)))
    try:
        info = HiCacheStorageExtraInfo(prefix_keys=list(system))
        assert storage.batch_set_v1(first, indices, info) == [True] * BATCH
        other = support.page_keys(1, seed=7)
        assert storage.batch_set_v1(other, indices[: pool.page_size], HiCacheStorageExtraInfo(prefix_keys=[]))
        assert storage.batch_get_v1(first, indices) == [True] * BATCH
        asked.clear()
        info = HiCacheStorageExtraInfo(prefix_keys=system + first)
        assert storage.batch_set_v1(second, indices, info) == [True] * BATCH
        assert asked[0] == _hashes(system + first)  # the whole prefix again, then the dedup
        assert _count(asked) == len(system) + 2 * BATCH
    finally:
        storage.close()
