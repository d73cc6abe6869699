"""kvstrata as SGLang's L3 over a bounded (``capacity_bytes``) file backend, shared by two SGLang
servers.

SGLang serves a hot system prompt from its own device/host tiers and never queries or writes it
in L3 again; it backs up each new request's own pages with ``batch_set_v1``. With SGLang's
``hicache_storage_pass_prefix_keys`` on, every such call carries ``extra_info.prefix_keys`` (the
page keys of the prefix above the pages being stored), which the adapter asks L3 for, keeping
the prompt alive in the store's LRU. Without that setting kvstrata gets no signal (README).
"""

from __future__ import annotations

import hashlib
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

SYSTEM_PAGES = 2


def _config(path: Path, capacity: int | None = None) -> dict[str, Any]:
    l3: dict[str, Any] = {"type": "file", "path": str(path)}
    if capacity is not None:
        l3["capacity_bytes"] = capacity
    return {"tiers": {"storage": {"l3": l3}}}


def _chain(parent: str, count: int, salt: str) -> list[str]:
    """SGLang-like chained page keys continuing from ``parent``."""
    keys, previous = [], bytes.fromhex(parent) + salt.encode()
    for page in range(count):
        previous = hashlib.sha256(previous + page.to_bytes(4, "little")).digest()
        keys.append(previous.hex())
    return keys


def _object_bytes(tmp: Path) -> int:
    pool = support.new_mha_pool("layer_first")
    storage = support.open_adapter(_config(tmp / "probe"), pool)
    try:
        indices = support.fill_mha(pool, [0], 1, [0])
        assert storage.batch_set_v1(support.page_keys(1, seed=99), indices) == [True]
    finally:
        storage.close()
    (size,) = {f.stat().st_size for f in (tmp / "probe").rglob("*") if f.is_file() and f.suffix}
    return size


def test_a_hot_system_prompt_sglang_serves_locally_outlives_colder_pages_in_a_bounded_l3(
    tmp_path: Path,
) -> None:
    """Server A backs up the system prompt once, then six chats' own pages, each call naming the
    prompt in ``prefix_keys`` (SGLang hit it on its device). L3 holds ten pages. A second server
    asking for the last chat (SGLang asks from page 0: it holds nothing) finds its four pages,
    as with an unbounded L3. It found none while the adapter ignored ``prefix_keys``: the prompt,
    the oldest entry of the LRU although every backup named it, was evicted first."""
    capacity = 10 * _object_bytes(tmp_path)
    system = support.page_keys(SYSTEM_PAGES, seed=1)
    chats = [_chain(system[-1], 2, f"chat-{i}") for i in range(6)]

    def serve_a(config: dict[str, Any]) -> None:
        pool = support.new_mha_pool("layer_first")
        a = support.open_adapter(config, pool)
        try:
            indices = support.fill_mha(pool, [0, 1], 1, [0, 1])
            assert a.batch_set_v1(system, indices, HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 2
            for n, own in enumerate(chats):
                indices = support.fill_mha(pool, [2, 3], 10 + n, [0, 1])
                info = HiCacheStorageExtraInfo(prefix_keys=list(system))
                assert a.batch_set_v1(own, indices, info) == [True, True]
        finally:
            a.close()

    def fresh_exists(config: dict[str, Any], keys: list[str]) -> int:
        b = support.open_adapter(config, support.new_mha_pool("layer_first"))
        try:
            return b.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[]))
        finally:
            b.close()

    unbounded = _config(tmp_path / "unbounded")
    serve_a(unbounded)
    assert fresh_exists(unbounded, system + chats[-1]) == 4  # the reference

    bounded = _config(tmp_path / "l3", capacity)
    serve_a(bounded)
    assert fresh_exists(bounded, system + chats[-1]) == 4, (
        "the system prompt named in every backup's prefix_keys was LRU-evicted first"
    )
