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


@pytest.mark.parametrize("v2", [False, True], ids=["batch_exists", "batch_exists_v2"])
def test_a_hot_system_prompt_stays_while_sglang_only_reads_pages_stored_under_it(
    tmp_path: Path, v2: bool
) -> None:
    """Chats repeated word for word: SGLang holds the system prompt itself, finds each chat's own
    pages in L3 (``batch_exists`` with the prompt in ``prefix_keys``) and reads them
    (``batch_get_v1``); it backs up nothing, so no ``batch_set`` names the prompt. Meanwhile
    other traffic fills the bounded L3. The chat pages, read, stay recent; the prompt above them,
    never asked for, is what the LRU drops -- and the chat pages are stranded for a second
    server (it asks from page 0)."""
    capacity = 10 * _object_bytes(tmp_path)
    config = _config(tmp_path / "l3", capacity)
    system = support.page_keys(SYSTEM_PAGES, seed=1)
    chat = _chain(system[-1], 2, "chat")
    pool = support.new_mha_pool("layer_first")
    a = support.open_adapter(config, pool)
    try:
        indices = support.fill_mha(pool, [0, 1], 1, [0, 1])
        assert a.batch_set_v1(system, indices, HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 2
        indices = support.fill_mha(pool, [2, 3], 2, [0, 1])
        assert a.batch_set_v1(chat, indices, HiCacheStorageExtraInfo(prefix_keys=list(system))) == [True] * 2
        for n in range(8):  # the chat again (prompt local, its pages from L3), and other traffic
            info = HiCacheStorageExtraInfo(prefix_keys=list(system))
            found = a.batch_exists_v2(chat, [], info).kv_hit_pages if v2 else a.batch_exists(chat, info)
            assert found == 2
            target = support.fill_mha(pool, [4, 5], 0, [0, 1])  # (host pages to read into)
            assert a.batch_get_v1(chat, target, info) == [True, True]
            other = support.page_keys(1, seed=100 + n)
            indices = support.fill_mha(pool, [6], 10 + n, [0])
            assert a.batch_set_v1(other, indices, HiCacheStorageExtraInfo(prefix_keys=[])) == [True]
    finally:
        a.close()
    b = support.open_adapter(config, support.new_mha_pool("layer_first"))
    try:
        found = b.batch_exists(system + chat, HiCacheStorageExtraInfo(prefix_keys=[]))
    finally:
        b.close()
    assert found == 4, (
        f"a second server found {found} of the 4 pages: the prompt SGLang serves itself went first"
    )
