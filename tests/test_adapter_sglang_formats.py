"""The SGLang adapter's less common host pools and settings, in process: MHA pools whose K and V
have other head dims (MiMo-V2), MHA pools of another class under a rank-replicated (MLA) model,
pools without bytes, pools a backend can never store, and ``kvstrata_config`` given as JSON text.
SGLang 0.5.23's real host pools on CPU (:mod:`kvstrata.testing.sglang_cpu`), kvstrata's file
backend and its hf3fs backend's documented mock."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata.testing.sglang_cpu import SGLangUnavailable, load_sglang_mem_cache, mha_host_pool

try:
    load_sglang_mem_cache()
except SGLangUnavailable as exc:  # CI sets KVSTRATA_REQUIRE_SGLANG=1 (scripts/test.sh): fail there
    if os.environ.get("KVSTRATA_REQUIRE_SGLANG") == "1":
        raise
    pytest.skip(str(exc), allow_module_level=True)

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

import sglang_support as support
from kvstrata.plugins import ConfigError

PAGE = support.MHA["page_size"]


def file_config(path: Path) -> dict[str, Any]:
    return {"tiers": {"storage": {"l3": {"type": "file", "path": str(path)}}}}


def asymmetric_pool(layout: str, v_head_dim: int = 16) -> Any:
    return mha_host_pool(
        layers=2, heads=2, head_dim=32, v_head_dim=v_head_dim, page_size=PAGE, host_pages=6, layout=layout
    )


def token_kv(pool: Any, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K ``(layers, heads, head_dim)`` and V ``(layers, heads, v_head_dim)`` of one host token slot,
    read from SGLang's own buffers of either layout of its asymmetric pool."""
    if pool.layout == "page_first":  # (size, L, H, dim)
        return pool.k_buffer[slot], pool.v_buffer[slot]
    page, at = divmod(slot, PAGE)  # page_first_direct: (P, L, t, H, dim)
    return pool.k_buffer[page, :, at], pool.v_buffer[page, :, at]


def fill_pages(pool: Any, host_pages: list[int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    slots = torch.cat([support.slots_of(page, PAGE) for page in host_pages])
    for slot in slots.tolist():
        for part in token_kv(pool, slot):
            part.copy_(torch.randn(part.shape, generator=generator).to(part.dtype))
    return slots


@pytest.mark.parametrize(
    ("written_as", "read_as"), [("page_first", "page_first_direct"), ("page_first_direct", "page_first")]
)
def test_an_mha_pool_with_k_and_v_of_other_head_dims_is_stored_exactly(
    tmp_path: Path, written_as: str, read_as: str
) -> None:
    # SGLang's asymmetric pool has no flat data page: registering it raised SGLang's
    # NotImplementedError ("use mooncake"), and kvstrata over Mooncake failed the same way
    config, keys = file_config(tmp_path), support.page_keys(2, seed=31)
    writer_pool = asymmetric_pool(written_as)
    writer = support.open_adapter(config, writer_pool)
    assert "exact (K and V apart)" in writer.pool_formats()["kv"]
    written = fill_pages(writer_pool, [1, 2], seed=31)
    assert writer.batch_set_v1(keys, written) == [True, True]
    reader_pool = asymmetric_pool(read_as)
    reader = support.open_adapter(config, reader_pool)
    assert reader.batch_exists(keys) == 2
    read = torch.cat([support.slots_of(page, PAGE) for page in (4, 3)])
    assert reader.batch_get_v1(keys, read) == [True, True]
    for source, target in zip(written.tolist(), read.tolist(), strict=True):
        for want, got in zip(token_kv(writer_pool, source), token_kv(reader_pool, target), strict=True):
            assert torch.equal(want.view(torch.int16), got.view(torch.int16)), (source, target)
    # as a side pool of a hybrid stack too, beside a plain MHA anchor
    hybrid = support.open_adapter(config, support.new_mha_pool("page_first"))
    hybrid.register_mem_host_pool_v2(asymmetric_pool(read_as), PoolName.DRAFT)
    assert "exact (K and V apart)" in hybrid.pool_formats()["draft"]
    # another V head dim, or a plain MHA pool of the K head dim, never reads these pages
    other = support.open_adapter(config, asymmetric_pool(read_as, v_head_dim=8))
    plain = support.open_adapter(
        config, mha_host_pool(layers=2, heads=2, head_dim=32, page_size=PAGE, host_pages=6)
    )
    assert other.batch_exists(keys) == 0 and plain.batch_exists(keys) == 0
    for storage in (writer, reader, hybrid, other, plain):
        storage.close()


class ScaledMHAPoolHost(MHATokenToKVPoolHost):
    """Stands for SGLang's MHA host-pool subclasses (MXFP8, HiSparse): the buffers and flat pages
    of an MHA pool under another class, which the adapter stores opaque."""


def test_an_mha_pool_of_another_class_under_an_mla_model_is_never_served_another_ranks_heads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # an MLA target's MHA draft holds each rank's own heads; opaque pools under an MLA model were
    # keyed as one copy for all ranks, so rank 1 read rank 0's heads as hits
    config, keys = file_config(tmp_path), support.page_keys(2, seed=32)
    slots = torch.arange(2 * PAGE)
    drafts, adapters = [], []
    for rank in (0, 1):
        adapter = support.open_adapter(
            config, support.new_mla_pool("page_first"), is_mla=True, tp_rank=rank, tp_size=2
        )
        draft = support.new_mha_pool("layer_first")
        draft.__class__ = ScaledMHAPoolHost
        with caplog.at_level(logging.WARNING, logger="kvstrata.adapters.sglang"):
            adapter.register_mem_host_pool_v2(draft, PoolName.DRAFT)
        assert "opaque" in adapter.pool_formats()["draft"]
        draft.kv_buffer.fill_(rank + 1)  # each rank's own heads
        drafts.append(draft)
        adapters.append(adapter)
    transfer = [PoolTransfer(name=PoolName.DRAFT, keys=keys, host_indices=slots)]
    assert adapters[0].batch_set_v2(transfer) == {PoolName.DRAFT: [True, True]}
    assert adapters[1].batch_get_v2(transfer) == {PoolName.DRAFT: [False, False]}
    assert bool((drafts[1].kv_buffer == 2).all()), "rank 1's pool took another rank's bytes"
    drafts[0].kv_buffer.zero_()
    assert adapters[0].batch_get_v2(transfer) == {PoolName.DRAFT: [True, True]}
    assert bool((drafts[0].kv_buffer[:, :, : 2 * PAGE] == 1).all())
    assert "SGLang writes it from TP rank 0 only" in caplog.text  # why ranks > 0 find none
    for adapter in adapters:
        adapter.close()


def test_a_pool_without_bytes_draws_no_fp8_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

    anchor = LogicalHostPool(size=8 * PAGE, page_size=PAGE)  # DeepSeek-V4's: dtype uint8, no bytes
    with caplog.at_level(logging.WARNING, logger="kvstrata.adapters.sglang"):
        storage = support.open_adapter(file_config(tmp_path), anchor)
    assert "marker" in storage.pool_formats()["kv"]
    assert "kv_cache_dtype" not in caplog.text
    storage.close()
    with caplog.at_level(logging.WARNING, logger="kvstrata.adapters.sglang"):  # an fp8 pool still warns
        storage = support.open_adapter(
            file_config(tmp_path), support.new_mha_pool("page_first", dtype=torch.uint8)
        )
    assert "set kvstrata_config.model.kv_cache_dtype" in caplog.text
    storage.close()


def test_a_pool_the_backend_can_never_store_is_reported_as_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # one 32 KiB page against 16 KiB slots: the plan is off, every page a miss; this was logged at
    # INFO only, so a server ran with an L3 it never used and nothing said so
    l3 = {"type": "hf3fs", "mock": True, "path": str(tmp_path), "file_bytes": 1 << 20, "slot_bytes": 16 << 10}
    with caplog.at_level(logging.INFO, logger="kvstrata.adapters.sglang"):
        storage = support.open_adapter({"tiers": {"storage": {"l3": l3}}}, support.new_mha_pool("page_first"))
    off = [r for r in caplog.records if "plan off" in r.getMessage()]
    assert off and all(r.levelno == logging.WARNING for r in off), caplog.text
    assert "max_object_bytes" in off[0].getMessage()
    keys = support.page_keys(2, seed=33)
    assert storage.batch_set_v1(keys, torch.arange(2 * PAGE)) == [False, False]
    storage.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvstrata.adapters.sglang"):  # a usable plan stays at INFO
        storage = support.open_adapter(file_config(tmp_path / "file"), support.new_mha_pool("page_first"))
    assert [r.levelno for r in caplog.records if "plan" in r.getMessage()] == [logging.INFO]
    storage.close()


def test_kvstrata_config_may_be_json_text(tmp_path: Path) -> None:
    # SGLang's extra config is JSON; a nested kvstrata_config encoded once more was read as a path
    pool = support.new_mha_pool("page_first")
    storage = support.open_adapter(json.dumps({**file_config(tmp_path), "model": {"name": "as-text"}}), pool)
    assert storage.model_name == "as-text"
    storage.close()
    with pytest.raises(ConfigError, match=r"kvstrata_config: looks like inline JSON but does not parse"):
        support.open_adapter('{"tiers": ', pool)
    with pytest.raises(ConfigError, match=r"kvstrata_config\.tiers\.storage\.l3\.path"):
        support.open_adapter(json.dumps({"tiers": {"storage": {"l3": {"type": "file"}}}}), pool)
