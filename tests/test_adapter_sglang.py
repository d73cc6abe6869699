"""kvstrata as SGLang's L3, driven by SGLang 0.5.23's own code on CPU.

SGLang's ``StorageBackendFactory`` loads the adapter through its dynamic path; pages live in
SGLang's real ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` / ``MambaPoolHost`` (built over
CPU "device" buffers by :mod:`kvstrata.testing.sglang_cpu`, which also explains how SGLang's
mem_cache modules import without a GPU stack). Storage is kvstrata's real file backend and a real
``mooncake_master``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata.testing.mooncake_servers import MooncakeMaster
from kvstrata.testing.sglang_cpu import SGLangUnavailable, load_sglang_mem_cache

try:
    load_sglang_mem_cache()
except SGLangUnavailable as exc:  # CI sets KVSTRATA_REQUIRE_SGLANG=1 (scripts/test.sh): fail there
    if os.environ.get("KVSTRATA_REQUIRE_SGLANG") == "1":
        raise
    pytest.skip(str(exc), allow_module_level=True)

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

import sglang_support as support
from kvstrata.adapters.sglang import KvstrataHiCacheStorage
from kvstrata.plugins import ConfigError, StorageError

TESTS = Path(__file__).parent
PAGE = support.MHA["page_size"]


def file_config(path: Path, **model: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"tiers": {"storage": {"l3": {"type": "file", "path": str(path)}}}}
    if model:
        config["model"] = model
    return config


@pytest.fixture
def l3(tmp_path: Path) -> dict[str, Any]:
    return file_config(tmp_path / "l3")


def run_writer(config: dict[str, Any], seed: int, count: int) -> dict[str, Any]:
    """The writer is a separate process: nothing is shared with the reader but the storage."""
    out = subprocess.run(
        [
            sys.executable,
            str(TESTS / "sglang_support.py"),
            "write",
            json.dumps(config),
            str(seed),
            str(count),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- loading and configuration ----------------------------------------------------------------


def test_sglang_factory_loads_the_adapter_through_its_dynamic_path(l3: dict[str, Any]) -> None:
    pool = support.new_mha_pool("page_first")
    storage = support.open_adapter(l3, pool)
    try:
        assert type(storage) is KvstrataHiCacheStorage
        assert isinstance(storage, HiCacheStorage)
        assert storage.model_name == "demo-model"  # SGLang's served model name
        assert "exact" in storage.pool_formats()["kv"]
    finally:
        storage.close()


def test_config_errors_name_the_dotted_path(tmp_path: Path) -> None:
    pool = support.new_mha_pool("page_first")
    with pytest.raises(ConfigError, match=r"kvstrata_config\.tiers\.storage\.l3\.path"):
        support.open_adapter({"tiers": {"storage": {"l3": {"type": "file"}}}}, pool)
    with pytest.raises(ConfigError, match=r"kvstrata_config\.policy\.checksums"):
        support.open_adapter({**file_config(tmp_path), "policy": {"checksums": "none"}}, pool)
    with pytest.raises(ConfigError, match=r"kvstrata_config:.*missing"):
        support.open_adapter(None, pool)
    # a config file works like the inline mapping
    path = tmp_path / "l3.yaml"
    path.write_text(
        f"model: {{name: from-file}}\ntiers:\n  storage:\n    l3: {{type: file, path: {tmp_path}}}\n"
    )
    storage = support.open_adapter(str(path), pool)
    assert storage.model_name == "from-file"
    storage.close()
    path.write_text("tiers: {storage: {}}\n")
    with pytest.raises(ConfigError) as caught:  # named as written in the file, and the file named
        support.open_adapter(str(path), pool)
    assert str(caught.value).startswith(f"invalid configuration in {path}: tiers.storage:")


# --- a second process reads what the first wrote ------------------------------------------------


READ_LAYOUTS = ["page_first", "layer_first", "page_first_direct", "page_head", "page_unified"]


def check_second_process(config: dict[str, Any], seed: int, layouts: list[str]) -> None:
    count = 6
    written = run_writer(config, seed, count)
    assert written == {"v1": [True] * count, "generic": True}
    keys = support.page_keys(count, seed)
    for layout in layouts:
        extra = {"head_group_num": 2} if layout == "page_unified" else {}
        pool = support.new_mha_pool(layout, **extra)
        storage = support.open_adapter(config, pool)
        try:
            host_pages = [9, 2, 5, 7, 3, 11]  # scattered, not the writer's slots
            indices = torch.cat([support.slots_of(p, PAGE) for p in host_pages])
            assert storage.batch_exists(keys) == count
            assert storage.batch_get_v1(keys, indices) == [True] * count
            for page, host_page in enumerate(host_pages):
                assert support.mha_holds(pool, host_page, seed, page), (layout, page)
            if layout in ("page_first", "layer_first"):  # SGLang's generic path into this layout
                pool.kv_buffer.zero_()
                pages = storage.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
                assert all(page is not None for page in pages)
                for host_page, data in zip(host_pages, pages, strict=True):
                    pool.set_from_flat_data_page(host_page * PAGE, data)
                assert all(support.mha_holds(pool, h, seed, p) for p, h in enumerate(host_pages))
            assert storage.metrics.corrupt_detected == 0
        finally:
            storage.close()
    mla_keys = [f"mla-{key}" for key in keys]
    for layout in ("layer_first", "page_first_direct", "page_unified"):
        mla = support.new_mla_pool(layout)
        storage = support.open_adapter(config, mla, is_mla=True, tp_rank=1, tp_size=2)
        try:
            host_pages = [4, 8, 1, 10, 6, 2]
            indices = torch.cat([support.slots_of(p, PAGE) for p in host_pages])
            assert storage.batch_get_v1(mla_keys, indices) == [True] * count
            assert all(support.mla_holds(mla, h, seed, p) for p, h in enumerate(host_pages))
        finally:
            storage.close()


def test_second_process_reads_file_pages_bit_exact_into_every_layout(l3: dict[str, Any]) -> None:
    check_second_process(l3, seed=1, layouts=READ_LAYOUTS)


@pytest.mark.mooncake
def test_second_process_reads_mooncake_pages_bit_exact(tmp_path: Path) -> None:
    """The reader (this process) contributes the segment; the writer process contributes none, so
    the pages outlive it in the reader's segment, served by a real mooncake_master. A master of
    its own: the session's may still list a segment of a client another test just closed (for
    its client TTL), and a put placed there fails."""
    with MooncakeMaster(log_dir=tmp_path) as master:
        segment = {"type": "mooncake", "master": master.address, "metadata_server": "P2PHANDSHAKE"}
        reader_side = {"tiers": {"storage": {"mc": {**segment, "segment_bytes": 64 << 20}}}}
        writer_side = {"tiers": {"storage": {"mc": {**segment, "segment_bytes": 0, "local_buffer_bytes": 0}}}}
        reader = support.open_adapter(reader_side, support.new_mha_pool("page_first"))  # mounts the segment
        mla_reader = support.open_adapter(reader_side, support.new_mla_pool("layer_first"), is_mla=True)
        try:
            written = run_writer(writer_side, seed=2, count=6)
            assert written == {"v1": [True] * 6, "generic": True}
            keys = support.page_keys(6, seed=2)
            host_pages = (3, 1, 4, 10, 5, 9)
            indices = torch.cat([support.slots_of(p, PAGE) for p in host_pages])
            for layout in ("layer_first", "page_first"):
                target = support.new_mha_pool(layout)
                reader.register_mem_pool_host(target)  # as SGLang re-attaching with another host pool
                assert reader.batch_exists(keys) == 6
                assert reader.batch_get_v1(keys, indices) == [True] * 6
                assert all(support.mha_holds(target, h, 2, p) for p, h in enumerate(host_pages))
            mla = mla_reader.mem_pool_host
            indices = torch.cat([support.slots_of(p, PAGE) for p in range(6)])
            assert mla_reader.batch_get_v1([f"mla-{k}" for k in keys], indices) == [True] * 6
            assert all(support.mla_holds(mla, p, 2, p) for p in range(6))
            # a flipped byte in Mooncake is a miss too
            key = mla_reader.engine.object_keys(mla_reader._anchor().name, [f"mla-{keys[0]}"])[0][0]
            assert mla_reader.backend.corrupt_for_test(key, "flip", offset=-5)
            assert mla_reader.batch_get_v1([f"mla-{keys[0]}"], support.slots_of(0, PAGE)) == [False]
            assert mla_reader.metrics.corrupt_detected == 1
        finally:
            mla_reader.close()
            reader.close()


# --- existence, integrity, namespaces ---------------------------------------------------------------


@pytest.fixture
def writer(l3: dict[str, Any]) -> Iterator[tuple[KvstrataHiCacheStorage, Any]]:
    pool = support.new_mha_pool("layer_first")
    storage = support.open_adapter(l3, pool)
    yield storage, pool
    storage.close()


def test_batch_exists_returns_the_leading_run_of_stored_pages(writer: tuple[Any, Any]) -> None:
    storage, pool = writer
    keys = support.page_keys(8, seed=3)
    stored = [0, 1, 2, 3, 4, 6]  # page 5 is missing
    indices = support.fill_mha(pool, stored, 3, stored)
    assert storage.batch_set_v1([keys[i] for i in stored], indices) == [True] * len(stored)
    assert storage.batch_exists(keys) == 5
    assert storage.batch_exists(keys[:3]) == 3
    assert storage.batch_exists(keys[5:]) == 0
    assert storage.batch_exists(keys[6:7]) == 1
    assert storage.exists(keys[6]) and not storage.exists(keys[7])
    assert storage.batch_exists([]) == 0
    # long queries are asked in growing chunks that stop at the first gap
    many = support.page_keys(60, seed=33)
    stored = [i for i in range(60) if i != 41]
    flat = [pool.get_dummy_flat_data_page() for _ in stored]
    assert storage.batch_set([many[i] for i in stored], flat)
    assert storage.batch_exists(many) == 41
    assert storage.batch_exists(many[:20]) == 20
    assert storage.batch_exists(many[42:]) == 18


def test_a_flipped_byte_is_a_counted_miss_and_the_rest_still_reads(
    writer: tuple[Any, Any], tmp_path: Path
) -> None:
    storage, pool = writer
    keys = support.page_keys(4, seed=4)
    indices = support.fill_mha(pool, [0, 1, 2, 3], 4, [0, 1, 2, 3])
    assert storage.batch_set_v1(keys, indices) == [True] * 4
    object_key = storage.engine.object_keys(storage._anchor().name, [keys[2]])[0][0]
    size = storage.backend.path_for(object_key).stat().st_size
    assert storage.backend.corrupt_for_test(object_key, "flip", offset=size // 2)  # in the payload

    pool.kv_buffer.zero_()
    assert storage.batch_get_v1(keys, indices) == [True, True, False, True]
    assert storage.metrics.corrupt_detected == 1
    assert all(support.mha_holds(pool, p, 4, p) for p in (0, 1, 3))
    # through the generic path the damaged page is None (it was removed as damaged: now absent)
    assert storage.batch_exists(keys) == 2
    pages = storage.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    assert [page is not None for page in pages] == [True, True, False, True]


def test_another_model_salt_or_tp_size_never_hits(l3: dict[str, Any], tmp_path: Path) -> None:
    keys = support.page_keys(3, seed=5)
    pool = support.new_mha_pool("page_first")
    storage = support.open_adapter(l3, pool)
    indices = support.fill_mha(pool, [0, 1, 2], 5, [0, 1, 2])
    assert storage.batch_set_v1(keys, indices) == [True] * 3
    storage.close()

    same = support.open_adapter(l3, support.new_mha_pool("page_first_direct"))
    assert same.batch_exists(keys) == 3  # same model, another host layout: exact conversion
    same.close()
    others = [
        support.open_adapter(l3, support.new_mha_pool("page_first"), model_name="other-model"),
        support.open_adapter({**l3, "model": {"cache_salt": "tenant-b"}}, support.new_mha_pool("page_first")),
        support.open_adapter(l3, support.new_mha_pool("page_first"), tp_rank=0, tp_size=2),
        support.open_adapter(
            l3, support.mha_host_pool(layers=2, heads=2, head_dim=128, page_size=PAGE, host_pages=4)
        ),
    ]
    for other in others:
        try:
            target = other.mem_pool_host
            target.kv_buffer.fill_(1)
            assert other.batch_exists(keys) == 0
            assert other.batch_get_v1(keys, torch.arange(3 * PAGE)) == [False] * 3
            assert bool((target.kv_buffer == 1).all())  # nothing foreign landed
        finally:
            other.close()


def test_replicated_mla_pages_are_written_by_tp_rank_zero_only(l3: dict[str, Any]) -> None:
    keys = support.page_keys(2, seed=6)
    follower_pool = support.new_mla_pool("page_first")
    follower = support.open_adapter(l3, follower_pool, is_mla=True, tp_rank=1, tp_size=2)
    indices = support.fill_mla(follower_pool, [0, 1], 6, [0, 1])
    assert follower.batch_set_v1(keys, indices) == [False, False]  # read-only rank
    assert follower.batch_exists(keys) == 0
    writer_pool = support.new_mla_pool("page_first")
    writer = support.open_adapter(l3, writer_pool, is_mla=True, tp_rank=0, tp_size=2)
    indices = support.fill_mla(writer_pool, [0, 1], 6, [0, 1])
    assert writer.batch_set_v1(keys, indices) == [True, True]
    assert follower.batch_exists(keys) == 2  # the same object serves every rank
    follower_pool.kv_buffer.zero_()
    assert follower.batch_get_v1(keys, indices) == [True, True]
    assert all(support.mla_holds(follower_pool, p, 6, p) for p in (0, 1))
    writer.close()
    follower.close()


def test_bad_calls_fail_the_call_not_the_thread(writer: tuple[Any, Any]) -> None:
    storage, _ = writer
    keys = support.page_keys(2, seed=7)
    assert storage.batch_set_v1(keys, torch.arange(PAGE)) == [False, False]  # too few indices
    assert storage.batch_get_v1(keys, torch.arange(1, 2 * PAGE + 1)) == [False, False]  # misaligned
    assert storage.batch_set(keys, None) is False
    assert storage.batch_get_v2(
        [PoolTransfer(name=PoolName.MAMBA, keys=keys, host_indices=torch.arange(2))]
    ) == {PoolName.MAMBA: [False, False]}
    assert storage.batch_get_v1(keys, torch.arange(40 * PAGE, 42 * PAGE)) == [False, False]  # not in the pool
    assert storage.clear() is False
    # arguments the failure answer cannot be sized from: an empty answer, not a raise
    assert storage.batch_set_v1(None, torch.arange(PAGE)) == []
    assert storage.batch_get(None) == []
    assert storage.batch_set_v2(None) == {} and storage.batch_get_v2(None) == {}


def test_bad_host_indices_are_a_failed_write_even_for_stored_keys(writer: tuple[Any, Any]) -> None:
    """The dedup asked L3 first: keys already stored answered "stored" whatever the indices
    (too few, outside the pool), and a batch with one new page failed the stored ones too."""
    storage, pool = writer
    keys = support.page_keys(3, seed=12)
    indices = support.fill_mha(pool, [0, 1, 2], 12, [0, 1, 2])
    assert storage.batch_set_v1(keys[:2], indices[: 2 * PAGE]) == [True, True]
    assert storage.batch_set_v1(keys[:2], torch.arange(PAGE)) == [False, False]  # too few
    assert storage.batch_set_v1(keys[:2], torch.arange(40 * PAGE, 42 * PAGE)) == [False, False]
    side = PoolTransfer(name=PoolName.KV, keys=keys[:2], host_indices=torch.arange(PAGE))
    storage.register_mem_host_pool_v2(pool, PoolName.KV)
    assert storage.batch_set_v2([side]) == {PoolName.KV: [False, False]}
    assert storage.batch_set_v1(keys, indices) == [True, True, True]  # good indices: as before
    assert storage.batch_exists(keys) == 3


def test_a_page_table_that_is_not_whole_pages_once_each_stores_and_loads_nothing(
    writer: tuple[Any, Any],
) -> None:
    """Host indices were checked only at each page's first slot: a page whose other slots were
    another page's (SGLang's page table out of step), float indices (truncated), or one host
    page named for two keys stored the start page's bytes under every key and loaded two pages
    into one host page, answering True. Each is now a failed call: nothing stored or loaded."""
    storage, pool = writer
    keys = support.page_keys(3, seed=14)
    indices = support.fill_mha(pool, [0, 1, 2], 14, [0, 1, 2])
    scrambled = indices[: 2 * PAGE].clone()
    scrambled[PAGE + 1 : 2 * PAGE] = indices[2 * PAGE + 1 :]  # page 1 starts right, ends in page 2
    twice = torch.cat([indices[:PAGE], indices[:PAGE]])
    for wrong in (scrambled, twice, indices[: 2 * PAGE].double() + 0.5):
        assert storage.batch_set_v1(keys[:2], wrong) == [False, False]
        transfer = PoolTransfer(name=PoolName.KV, keys=keys[:2], host_indices=wrong)
        storage.register_mem_host_pool_v2(pool, PoolName.KV)
        assert storage.batch_set_v2([transfer]) == {PoolName.KV: [False, False]}
    assert storage.batch_exists(keys) == 0
    assert storage.batch_set_v1(keys, indices) == [True, True, True]
    pool.kv_buffer.zero_()
    for wrong in (scrambled, twice):
        assert storage.batch_get_v1(keys[:2], wrong) == [False, False]
    assert not bool(pool.kv_buffer.any()), "a refused read copied nothing into the host pool"
    assert storage.batch_get_v1(keys, indices) == [True, True, True]
    assert all(support.mha_holds(pool, p, 14, p) for p in range(3))


def test_calls_before_any_pool_is_registered_answer_a_miss(l3: dict[str, Any]) -> None:
    storage = KvstrataHiCacheStorage(
        support.storage_config(extra_config={**support.ADAPTER, "kvstrata_config": l3})
    )
    keys = support.page_keys(2, seed=11)
    try:
        assert storage.batch_exists(keys) == 0
        assert storage.batch_get_v1(keys, torch.arange(2 * PAGE)) == [False, False]
        assert storage.batch_set_v1(keys, torch.arange(2 * PAGE)) == [False, False]
        assert storage.get(keys[0]) is None
        assert storage.batch_exists_v2(keys).kv_hit_pages == 0
    finally:
        storage.close()


def test_a_backend_that_cannot_open_names_the_key_the_user_wrote(tmp_path: Path) -> None:
    """An L3 directory that cannot be created stops the adapter with an error naming the entry as
    written in SGLang's extra config (``kvstrata_config.tiers.storage.l3``), not a bare OSError."""
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    extra = {**support.ADAPTER, "kvstrata_config": file_config(blocker / "l3")}
    with pytest.raises(StorageError) as caught:
        KvstrataHiCacheStorage(support.storage_config(extra_config=extra))
    message = str(caught.value)
    assert "(kvstrata_config.tiers.storage.l3, type 'file') could not be opened" in message
    assert f"cannot create {blocker / 'l3'}" in message


@pytest.mark.parametrize(("written_as", "read_as"), [("fp8_e4m3", "fp8_e4m3"), ("fp8_e4m3", "fp8_e5m2")])
def test_fp8_variants_are_told_apart_by_the_configured_kv_cache_dtype(
    l3: dict[str, Any], caplog: pytest.LogCaptureFixture, written_as: str, read_as: str
) -> None:
    """SGLang hands host pools every fp8 KV cache as ``uint8``: the pages of an fp8_e4m3 server and
    an fp8_e5m2 one look alike, so ``model.kv_cache_dtype`` (SGLang's ``--kv-cache-dtype``) keys
    them apart; without it the adapter warns that they would share pages."""
    keys = support.page_keys(2, seed=6)
    indices = torch.arange(2 * PAGE)
    unset = support.open_adapter(l3, support.new_mha_pool("page_first", dtype=torch.uint8))
    assert "model.kv_cache_dtype" in caplog.text
    unset.close()
    writer_pool = support.new_mha_pool("page_first", dtype=torch.uint8)
    flat = writer_pool.kv_buffer.view(-1)
    flat.copy_(torch.randint(0, 255, flat.shape, dtype=torch.uint8))
    writer = support.open_adapter({**l3, "model": {"kv_cache_dtype": written_as}}, writer_pool)
    assert writer.batch_set_v1(keys, indices) == [True, True]
    writer.close()
    reader_pool = support.new_mha_pool("page_first", dtype=torch.uint8)
    reader = support.open_adapter({**l3, "model": {"kv_cache_dtype": read_as}}, reader_pool)
    same = written_as == read_as
    assert reader.batch_exists(keys) == (2 if same else 0)
    assert reader.batch_get_v1(keys, indices) == [same, same]
    reader.close()


# --- hybrid stacks: the v2 calls ------------------------------------------------------------------


def mamba_pool(
    layout: str = "page_first",
    temporal: tuple[int, ...] = (2, 4, 4, 8),
    dtype: torch.dtype = torch.float32,
    side: torch.Tensor | None = None,
) -> Any:
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(*temporal, dtype=dtype),
        conv=(torch.zeros(2, 4, 16, 3, dtype=torch.bfloat16),),
        **({"extra_checkpoint_buffers": (side,)} if side is not None else {}),
    )
    return MambaPoolHost(info, 2.0, 0, device_capacity=4, pin_memory=False, device="cpu", layout=layout)


@pytest.mark.parametrize(
    ("temporal", "dtype", "hit"),
    [
        ((2, 4, 4, 8), torch.bfloat16, True),  # the same format: served
        ((2, 4, 4, 8), torch.float16, False),  # --mamba-ssm-dtype float16 against bfloat16
        ((2, 4, 8, 4), torch.bfloat16, False),  # another state shape of the same byte count
    ],
    ids=["same", "other-dtype", "other-shape"],
)
def test_a_mamba_state_of_another_dtype_or_shape_is_a_miss(
    l3: dict[str, Any], temporal: tuple[int, ...], dtype: torch.dtype, hit: bool
) -> None:
    """SGLang's Mamba host pool hands kvstrata its state as an opaque ``uint8`` page: the key must
    still say what the bytes are, or a server with fp16 SSM state reads a bf16 server's bits
    (1.5 came back as 1.9375)."""
    keys = support.page_keys(1, seed=9)
    writer = support.open_adapter(l3, support.new_mha_pool("page_first"))
    written = mamba_pool(dtype=torch.bfloat16)
    writer.register_mem_host_pool_v2(written, PoolName.MAMBA)
    written.temporal_buffer.copy_(torch.full(written.temporal_buffer.shape, 1.5).to(torch.bfloat16))
    assert writer.batch_set_v2(
        [PoolTransfer(name=PoolName.MAMBA, keys=keys, host_indices=torch.tensor([1]))]
    ) == {PoolName.MAMBA: [True]}
    writer.close()
    reader = support.open_adapter(l3, support.new_mha_pool("page_first"))
    read = mamba_pool(temporal=temporal, dtype=dtype)
    reader.register_mem_host_pool_v2(read, PoolName.MAMBA)
    got = reader.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys, host_indices=torch.tensor([2]))])
    assert got == {PoolName.MAMBA: [hit]}
    if hit:
        assert torch.equal(read.temporal_buffer[2], written.temporal_buffer[1])  # page_first: slot-major
    reader.close()


@pytest.mark.parametrize(
    ("side", "hit"),
    [
        (torch.zeros(4, 8), True),
        (torch.zeros(4, 16, dtype=torch.bfloat16), False),  # same bytes, another dtype
        (torch.zeros(4, 2, 4), False),  # same bytes, another shape
    ],
    ids=["same", "other-dtype", "other-shape"],
)
def test_a_mamba_side_state_of_another_format_is_a_miss(
    l3: dict[str, Any], side: torch.Tensor, hit: bool
) -> None:
    # a Mamba pool's per-slot side states (SGLang's short-conv / n-gram siblings) are in its
    # flat page but were not in its key: a server with a bf16 side state read fp32 bits
    keys = support.page_keys(1, seed=10)
    writer = support.open_adapter(l3, support.new_mha_pool("page_first"))
    written = mamba_pool(side=torch.zeros(4, 8))
    writer.register_mem_host_pool_v2(written, PoolName.MAMBA)
    written.slot_state_buffers[0][1].fill_(1.5)
    assert writer.batch_set_v2(
        [PoolTransfer(name=PoolName.MAMBA, keys=keys, host_indices=torch.tensor([1]))]
    ) == {PoolName.MAMBA: [True]}
    writer.close()
    reader = support.open_adapter(l3, support.new_mha_pool("page_first"))
    read = mamba_pool(side=side)
    reader.register_mem_host_pool_v2(read, PoolName.MAMBA)
    got = reader.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys, host_indices=torch.tensor([2]))])
    assert got == {PoolName.MAMBA: [hit]}
    reader.close()


def test_hybrid_v2_transfers_exists_policies_and_bit_exact_reads(l3: dict[str, Any]) -> None:
    keys = support.page_keys(6, seed=8)
    kv = support.new_mha_pool("page_first")
    swa = support.new_mha_pool("layer_first")
    mamba = mamba_pool()
    storage = support.open_adapter(l3, kv)
    storage.register_mem_host_pool_v2(kv, PoolName.KV)
    storage.register_mem_host_pool_v2(swa, PoolName.SWA)
    storage.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    formats = storage.pool_formats()
    assert "exact" in formats["swa"] and "opaque" in formats["mamba"]

    # SWA pages 2..5 (a window), Mamba states after pages 3 and 5 (trailing one page), KV 0..5
    swa_idx = support.fill_mha(swa, [0, 1, 2, 3], 80, [2, 3, 4, 5])
    generator = torch.Generator().manual_seed(8)
    mamba.temporal_buffer.copy_(torch.randn(mamba.temporal_buffer.shape, generator=generator))
    mamba.conv_buffer[0].copy_(torch.randn(mamba.conv_buffer[0].shape, generator=generator).bfloat16())
    saved = [mamba.get_data_page(slot).clone() for slot in (1, 2)]
    written = storage.batch_set_v2(
        [
            PoolTransfer(name=PoolName.SWA, keys=keys[2:6], host_indices=swa_idx),
            PoolTransfer(name=PoolName.MAMBA, keys=[keys[3], keys[5]], host_indices=torch.tensor([1, 2])),
        ]
    )
    assert written == {PoolName.SWA: [True] * 4, PoolName.MAMBA: [True, True]}
    kv_idx = support.fill_mha(kv, list(range(6)), 8, list(range(6)))
    assert storage.batch_set_v1(keys, kv_idx) == [True] * 6

    trailing_state = PoolTransfer(
        name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES
    )
    window = PoolTransfer(
        name=PoolName.SWA, keys=["__placeholder__"] * 2, hit_policy=PoolHitPolicy.TRAILING_PAGES
    )
    every = PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.ALL_PAGES)
    result = storage.batch_exists_v2(keys, [trailing_state])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (6, [4, 6])
    result = storage.batch_exists_v2(keys, [trailing_state, window])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (6, [4, 6])
    result = storage.batch_exists_v2(keys[:5], [trailing_state, window])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (4, [4])
    result = storage.batch_exists_v2(keys, [every])
    assert result.kv_hit_pages == 0 and result.extra_pool_hit_pages == {"kv": 6}
    assert storage.batch_exists_v2(keys).kv_hit_pages == 6

    swa.kv_buffer.zero_()
    mamba.temporal_buffer.zero_()
    mamba.conv_buffer[0].zero_()
    read = storage.batch_get_v2(
        [
            PoolTransfer(
                name=PoolName.SWA,
                keys=keys[4:6],
                host_indices=torch.cat([support.slots_of(p, PAGE) for p in (7, 8)]),
            ),
            PoolTransfer(name=PoolName.MAMBA, keys=[keys[5], keys[4]], host_indices=torch.tensor([6, 7])),
        ]
    )
    assert read == {PoolName.SWA: [True, True], PoolName.MAMBA: [True, False]}
    assert support.mha_holds(swa, 7, 80, 4) and support.mha_holds(swa, 8, 80, 5)
    assert torch.equal(mamba.get_data_page(6), saved[1])
    storage.close()

    # an opaque pool in another host layout has another identity: never read as data
    other = support.open_adapter(l3, support.new_mha_pool("page_first"))
    other.register_mem_host_pool_v2(mamba_pool("page_first_direct"), PoolName.MAMBA)
    state = PoolTransfer(name=PoolName.MAMBA, keys=[keys[5]], host_indices=torch.tensor([0]))
    assert other.batch_get_v2([state]) == {PoolName.MAMBA: [False]}
    other.close()


def test_a_logical_anchor_stores_commit_markers(l3: dict[str, Any]) -> None:
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

    anchor = LogicalHostPool(size=8 * PAGE, page_size=PAGE)
    storage = support.open_adapter(l3, anchor)
    keys = support.page_keys(3, seed=9)
    assert "marker" in storage.pool_formats()["kv"]
    assert storage.batch_exists(keys) == 0
    assert storage.batch_set_v1(keys[:2], torch.arange(2 * PAGE)) == [True, True]
    assert storage.batch_exists(keys) == 2
    assert storage.batch_get_v1(keys, torch.arange(3 * PAGE)) == [True, True, False]
    storage.close()


def test_the_adapter_branches_on_no_backend_name() -> None:
    """The backend comes from the registry and its declared capabilities, never from its name."""
    from kvstrata import adapters

    names = {"file", "mooncake", "hf3fs"}
    offenders = [
        f"{path.name}:{node.lineno} {node.value!r}"
        for path in Path(adapters.__file__).parent.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in names
    ]
    assert not offenders, offenders


def test_the_readme_launch_flags_parse_with_sglang_and_load_the_adapter(tmp_path: Path) -> None:
    """The README's command, parsed by SGLang's own argument definitions (its Memory group), and
    its extra config handed to SGLang's factory with the example kvstrata config."""
    import argparse
    import importlib
    import shlex

    import yaml

    readme = (TESTS.parent / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(readme) if line.startswith("python -m sglang.launch_server"))
    lines = []
    for line in readme[start:]:
        lines.append(line.rstrip("\\"))
        if not line.endswith("\\"):
            break
    argv = shlex.split(" ".join(lines))[3:]  # past `python -m sglang.launch_server`
    arg_utils = importlib.import_module("sglang.srt.arg_groups.arg_utils")
    memory = importlib.import_module("sglang.srt.arg_groups.fields.memory")
    parser = argparse.ArgumentParser()
    arg_utils.add_cli_args_from_dataclass(parser, memory.Memory)
    args, rest = parser.parse_known_args(argv)
    assert rest == ["--model-path", "Qwen/Qwen3-8B"]  # another argument group of SGLang's
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    extra = json.loads(args.hicache_storage_backend_extra_config)

    example = yaml.safe_load((TESTS.parent / "examples/sglang/l3.yaml").read_text())
    example["tiers"]["storage"]["l3"]["path"] = str(tmp_path / "l3")
    config_path = tmp_path / "sglang-l3.yaml"
    config_path.write_text(yaml.safe_dump(example))
    extra["kvstrata_config"] = str(config_path)
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    pool = support.new_mha_pool(args.hicache_mem_layout)
    storage = StorageBackendFactory.create_backend(
        "dynamic", support.storage_config(extra_config=extra), pool
    )
    try:
        assert isinstance(storage, KvstrataHiCacheStorage)
        storage.register_mem_pool_host(pool)
        keys = support.page_keys(2, seed=10)
        assert storage.batch_set_v1(keys, support.fill_mha(pool, [0, 1], 10, [0, 1])) == [True, True]
        assert storage.batch_exists(keys) == 2
    finally:
        storage.close()


# --- the key is complete by construction (issue 25 items 7 and 12) ----------------------------------

#: One field of the writer's identity changed at a time, and whether the reader must hit.
IDENTITY_FIELDS: dict[str, tuple[dict[str, Any], bool]] = {
    "served model name": ({"model_name": "other-model"}, False),
    "weights digest": ({"model": {"weights_digest": "finetune-2"}}, False),
    "tenant salt": ({"model": {"cache_salt": "tenant-b"}}, False),
    "kv dtype": ({"pool": {"dtype": torch.float16}}, False),
    "head count": ({"pool": {"heads": 2}}, False),
    "page size": ({"pool": {"page_size": 8}}, False),
    "layers": ({"pool": {"layers": 3}}, False),
    "tp size": ({"tp_rank": 0, "tp_size": 2}, False),
    "host layout (exact conversion)": ({"pool": {"layout": "layer_first"}}, True),
    "a restart (a new adapter)": ({}, True),
}


@pytest.mark.parametrize("field", list(IDENTITY_FIELDS))
def test_each_identity_field_alone_decides_whether_pages_are_shared(l3: dict[str, Any], field: str) -> None:
    """Written by demo-model, bf16, 4 heads, page 16, TP 1, page_first; read by a server that
    differs in ``field`` only: 0 pages where that changes the bytes, every page where it must not."""
    change, shared = IDENTITY_FIELDS[field]
    keys = support.page_keys(3, seed=12)
    pool = support.new_mha_pool("page_first")
    storage = support.open_adapter(l3, pool, model_name="demo-model")
    indices = support.fill_mha(pool, [0, 1, 2], 12, [0, 1, 2])
    assert storage.batch_set_v1(keys, indices) == [True] * 3
    storage.close()

    shape = {"layers": support.MHA["layers"], "heads": support.MHA["heads"], "head_dim": 64}
    shape |= {"page_size": PAGE, "host_pages": support.HOST_PAGES, "layout": "page_first"}
    shape |= change.get("pool", {})
    config = {**l3, "model": change["model"]} if "model" in change else l3
    ranks = {k: v for k, v in change.items() if k in ("tp_rank", "tp_size", "model_name")}
    reader = support.open_adapter(config, support.mha_host_pool(**shape), **ranks)
    try:
        target = reader.mem_pool_host
        target.kv_buffer.fill_(1)
        found = reader.batch_exists(keys)
        got = reader.batch_get_v1(keys, torch.arange(3 * shape["page_size"]))
        if shared:
            assert (found, got) == (3, [True] * 3)
            assert all(support.mha_holds(target, p, 12, p) for p in range(3))
        else:
            assert (found, got) == (0, [False] * 3)
            assert bool((target.kv_buffer == 1).all())  # nothing foreign landed
    finally:
        reader.close()


def test_tp_rank_alone_separates_sharded_pages_and_replicated_ones_are_shared(l3: dict[str, Any]) -> None:
    keys = support.page_keys(2, seed=13)
    pool = support.new_mha_pool("page_first")
    rank0 = support.open_adapter(l3, pool, tp_rank=0, tp_size=2)
    assert rank0.batch_set_v1(keys, support.fill_mha(pool, [0, 1], 13, [0, 1])) == [True, True]
    rank0.close()
    rank1 = support.open_adapter(l3, support.new_mha_pool("page_first"), tp_rank=1, tp_size=2)
    assert rank1.batch_exists(keys) == 0  # another rank's heads
    rank1.close()
    # MLA pages are identical on every rank: written once, read by all
    # (test_replicated_mla_pages_are_written_by_tp_rank_zero_only)


def test_a_key_equal_to_the_digest_another_key_maps_to_reads_nothing(writer: tuple[Any, Any]) -> None:
    """Issue 25 item 7: a key that is not a plain hex digest was stored under its BLAKE2b digest,
    so a second key spelling that digest literally read the first key's page."""
    import hashlib

    storage, pool = writer
    odd = "page/with:odd chars"
    alias = hashlib.blake2b(odd.encode(), digest_size=16).hexdigest()  # the old mapping of ``odd``
    assert storage.batch_set_v1([odd], support.fill_mha(pool, [0], 14, [0])) == [True]
    assert storage.batch_exists([odd]) == 1
    assert storage.batch_exists([alias]) == 0
    assert storage.batch_get_v1([alias], support.slots_of(1, PAGE)) == [False]
    for text in ("_" + alias[1:], alias + "_", "a_b", "a-b", "é", "\ud800", "x" * 129):
        assert storage.batch_exists([text]) == 0, text
