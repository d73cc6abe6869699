"""Pool groups built from the example stack configs: sizes, sidecars, late pools, memory checks."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import psutil
import pytest
import torch

from kvstrata.core.config import load
from kvstrata.core.pool_group import HostMemoryError, Pool, PoolGroup
from kvstrata.plugins.host import PluginHost
from kvstrata.plugins.pool_type import PoolRole
from kvstrata.plugins.storage_backend import BufferRegion

DEVICE = os.environ.get("KVSTRATA_TEST_DEVICE", "cpu")
EXAMPLES = Path(__file__).resolve().parent / "stacks"
BF16, FP32 = 2, 4

# Bytes per page (token pools) or per slot (node-state pools), computed by hand from the YAML:
# attention pools: 2 (K, V) x layers x page 64 x kv_heads x head_dim x itemsize.
EXPECTED_UNIT_BYTES = {
    "kv.yaml": {"kv": 2 * 4 * 64 * 2 * 64 * BF16},  # 131072
    "mla-nsa-draft.yaml": {
        "mla": 4 * 64 * (512 + 64) * BF16,  # latent + rope: 294912
        "indexer": 4 * 64 * (128 + 128 // 128 * 4),  # fp8 values + one fp32 scale per 128: 33792
        "draft": 2 * 1 * 64 * 1 * 128 * BF16,  # 32768
    },
    "hybrid-mamba.yaml": {
        "kv": 2 * 2 * 64 * 2 * 128 * BF16,  # 131072
        # per slot: 6 layers x (conv 3x256 bf16 + conv 3x64 bf16 + temporal 4x32x32 fp32)
        "mamba": 6 * (3 * 256 * BF16 + 3 * 64 * BF16 + 4 * 32 * 32 * FP32),  # 109824
    },
    "swa.yaml": {
        "full": 2 * 2 * 64 * 1 * 64 * BF16,  # 32768
        "swa": 2 * 2 * 64 * 1 * 64 * BF16,  # 32768
    },
    "swa-mamba.yaml": {
        "kv": 2 * 1 * 64 * 2 * 64 * BF16,  # 32768
        "swa": 2 * 2 * 64 * 2 * 64 * BF16,  # 65536
        "mamba": 2 * (3 * 128 * BF16 + 2 * 16 * 16 * FP32),  # 5632
    },
    "logical-swa.yaml": {
        "anchor": 0,
        "swa": 2 * 2 * 64 * 1 * 128 * BF16,  # 65536
        "c4": 2 * 64 * 128 * BF16,  # 32768
        "c4_indexer": 2 * 64 * (128 + 4),  # 16896
        "c128": 2 * 64 * 4 * BF16,  # 1024
        "c4_state": 2 * 64 * 64 * BF16,  # 16384
    },
}

# (device units, host units): token pools = capacity_tokens / 64; mamba from device_units/host_units.
EXPECTED_UNITS = {
    "kv.yaml": {"kv": (16, 32)},
    "mla-nsa-draft.yaml": {"mla": (8, 16), "indexer": (8, 16), "draft": (8, 16)},
    "hybrid-mamba.yaml": {"kv": (16, 32), "mamba": (8, 16)},
    "swa.yaml": {"full": (32, 64), "swa": (32, 64)},
    "swa-mamba.yaml": {"kv": (16, 32), "swa": (16, 32), "mamba": (4, 8)},
    "logical-swa.yaml": {n: (16, 32) for n in EXPECTED_UNIT_BYTES["logical-swa.yaml"]},
}


@pytest.fixture(scope="module")
def plugins() -> PluginHost:
    return PluginHost(autoload=True, disabled=set())


def build(plugins: PluginHost, name: str, *overrides: str, **kwargs: object) -> PoolGroup:
    config = load([EXAMPLES / name], overrides=[f"tiers.device.device={DEVICE}", *overrides], plugins=plugins)
    return PoolGroup(config, plugins, **kwargs)


@pytest.mark.parametrize("name", sorted(EXPECTED_UNIT_BYTES))
def test_example_unit_bytes_and_units(plugins: PluginHost, name: str) -> None:
    group = build(plugins, name)
    assert set(group.pools) == set(EXPECTED_UNIT_BYTES[name])
    for instance, expected in EXPECTED_UNIT_BYTES[name].items():
        pool = group.pool(instance)
        assert pool.spec.bytes_per_unit == expected, instance
        device_units, host_units = EXPECTED_UNITS[name][instance]
        assert (pool.device.units, pool.host.units) == (device_units, host_units), instance
        # the host allocation holds at least every unit (layout padding aside) and page_first none more
        assert pool.host.nbytes >= expected * host_units
        if pool.host.layout.value == "page_first":
            assert pool.host.nbytes == expected * host_units
    assert group.anchor.role is PoolRole.ANCHOR
    assert len(group.by_role(PoolRole.ANCHOR)) == 1


def test_required_host_bytes_sums_unique_buffers(plugins: PluginHost) -> None:
    group = build(plugins, "mla-nsa-draft.yaml")
    buffers = group.host_buffers()
    unique = {b.data_ptr: b.nbytes for b in buffers}
    assert len(unique) == 3  # mla, indexer, draft: separate allocations
    assert group.required_host_bytes() == sum(unique.values())
    # page_first: exactly units x bytes per unit each
    assert group.required_host_bytes() == 16 * (294912 + 33792 + 32768)


def test_draft_added_after_start_grows_required_bytes(plugins: PluginHost) -> None:
    group = build(plugins, "hybrid-mamba.yaml")
    before = group.required_host_bytes()
    draft = group.add_pool(
        "draft", {"type": "draft", "layers": 1, "kv_heads": 2, "head_dim": 64, "dtype": "bfloat16"}
    )
    assert draft.role is PoolRole.SIDECAR and draft.index_owner == "kv"
    assert draft.host.units == group.anchor.host.units  # sidecars mirror their source's units
    assert group.required_host_bytes() == before + 32 * (2 * 1 * 64 * 2 * 64 * BF16)
    assert any(r.ptr == draft.host.data_ptr for r in group.host_regions())
    with pytest.raises(ValueError, match="already exists"):
        group.add_pool("draft", {"type": "draft", "layers": 1, "kv_heads": 1, "head_dim": 8})
    with pytest.raises(ValueError, match="second anchor"):
        group.add_pool("kv2", {"type": "kv", "layers": 1, "kv_heads": 1, "head_dim": 8})
    with pytest.raises(ValueError, match="shares that pool's indices"):
        group.add_pool("d2", {"type": "draft", "layers": 1, "kv_heads": 1, "head_dim": 8, "host_units": 3})


def test_a_page_sidecar_of_a_state_pool_is_refused(plugins: PluginHost) -> None:
    # an nsa or draft sidecar naming a mamba pool as its index_source was accepted: it got one
    # unit per tree node (a state slot's index), where its data needs one per page
    with pytest.raises(ValueError, match=r"sidecar pool 'ix' \(nsa\) holds token_pages units, but its "):
        build(plugins, "hybrid-mamba.yaml", "model.pools.ix.type=nsa", "model.pools.ix.layers=2",
              "model.pools.ix.index_source=mamba")  # fmt: skip
    group = build(plugins, "hybrid-mamba.yaml")
    with pytest.raises(ValueError, match="index_source 'mamba' \\(mamba\\) hands out node_state units"):
        group.add_pool(
            "draft", {"type": "draft", "layers": 1, "kv_heads": 1, "head_dim": 8, "index_source": "mamba"}
        )
    assert "draft" not in group.pools
    # the anchor's indices: fine
    group.add_pool("draft", {"type": "draft", "layers": 1, "kv_heads": 1, "head_dim": 8})


def device_rows(pool: Pool, name: str, indices: torch.Tensor) -> torch.Tensor:
    """Units ``indices`` of buffer ``name`` in the pool's device tier, as CPU bytes."""
    return pool.device.unit_view(name).index_select(0, indices.to(pool.device.device)).cpu()


def test_sidecars_follow_anchor_indices(plugins: PluginHost) -> None:
    group = build(plugins, "mla-nsa-draft.yaml")
    anchor, indexer, draft = group.pool("mla"), group.pool("indexer"), group.pool("draft")
    assert indexer.device_allocator is anchor.device_allocator
    assert draft.host_allocator is anchor.host_allocator
    assert [p.instance for p in group.followers("mla")] == ["mla", "indexer", "draft"]
    generator = torch.Generator().manual_seed(3)
    for pool in (anchor, indexer, draft):
        noise = torch.randint(0, 256, (pool.device.nbytes,), dtype=torch.uint8, generator=generator)
        pool.device.backing.copy_(noise.to(pool.device.backing.device))
    device_idx = anchor.device_allocator.alloc(5)
    host_idx = anchor.host_allocator.alloc(5)
    assert device_idx is not None and host_idx is not None
    host_idx = host_idx.flip(0)  # any order: the sidecars must use exactly the same one
    for handle in group.device_to_host("mla", device_idx, host_idx):
        handle.wait()
    for pool in (anchor, indexer, draft):
        for name in pool.device.placements:
            src = device_rows(pool, name, device_idx)
            assert torch.equal(src, pool.host.unit_view(name)[host_idx]), (pool.instance, name)
    # and back to other device pages
    target = torch.tensor([7, 6, 5, 4, 3])
    for handle in group.host_to_device("mla", host_idx, target):
        handle.wait()
    for pool in (indexer, draft):
        for name in pool.device.placements:
            got = device_rows(pool, name, target)
            assert torch.equal(got, pool.host.unit_view(name)[host_idx])


def test_sidecar_of_a_component_uses_its_indices(plugins: PluginHost) -> None:
    group = build(plugins, "logical-swa.yaml")
    assert group.pool("c4_state").device_allocator is group.pool("swa").device_allocator
    assert group.pool("c4").host_allocator is group.anchor.host_allocator
    assert group.anchor.device.logical and group.anchor.host.nbytes == 0
    assert group.anchor.device_allocator.alloc(16) is not None  # the index space exists


def test_host_memory_check_names_requested_and_available(plugins: PluginHost) -> None:
    tokens = 2**40
    requested = (tokens // 64) * 131072  # host pages x bytes per page of kv.yaml
    with pytest.raises(HostMemoryError) as info:
        build(plugins, "kv.yaml", f"tiers.host.capacity_tokens={tokens}", "tiers.device.capacity_tokens=64")
    message = str(info.value)
    extra = 64 // 64 * 131072 if DEVICE == "cpu" else 0  # a CPU device tier is host memory too
    assert f"requested {requested + extra} bytes" in message
    assert "available to this rank" in message and "ranks_per_host 1" in message


def test_reserve_and_ranks_shrink_the_budget(plugins: PluginHost) -> None:
    available = psutil.virtual_memory().available
    with pytest.raises(HostMemoryError, match=f"reserve_bytes {available * 2}"):
        build(plugins, "kv.yaml", f"tiers.host.reserve_bytes={available * 2}")
    # an injected reading: 10 MiB available over 4 ranks = 2.5 MiB < kv.yaml's 4 MiB host tier
    with pytest.raises(HostMemoryError, match=r"available to this rank 2621440 bytes"):
        build(plugins, "kv.yaml", "tiers.host.ranks_per_host=4", available_host_bytes=lambda: 10 * 2**20)


def test_late_pool_is_memory_checked(plugins: PluginHost) -> None:
    budget = {"bytes": 64 * 2**20}
    group = build(plugins, "kv.yaml", available_host_bytes=lambda: budget["bytes"])
    budget["bytes"] = 1024  # memory got scarce after start
    with pytest.raises(HostMemoryError, match="pool 'draft'"):
        group.add_pool("draft", {"type": "draft", "layers": 1, "kv_heads": 1, "head_dim": 64})
    assert "draft" not in group.pools


class CtypesHostMemory:
    """A real allocator handing out ctypes arrays (stands in for a backend's shared memory)."""

    def __init__(self) -> None:
        self.arrays: list[ctypes.Array] = []

    def allocate(self, nbytes: int) -> BufferRegion:
        array = (ctypes.c_uint8 * nbytes)()
        self.arrays.append(array)
        return BufferRegion(ctypes.addressof(array), nbytes)


def test_backend_host_allocator_supplies_host_memory(plugins: PluginHost) -> None:
    memory = CtypesHostMemory()
    group = build(plugins, "mla-nsa-draft.yaml", host_allocator=memory.allocate)
    owned = {ctypes.addressof(a) for a in memory.arrays}
    assert {r.ptr for r in group.host_regions()} == owned
    group.add_pool("extra_draft", {"type": "draft", "layers": 1, "kv_heads": 1, "head_dim": 64})
    assert len(memory.arrays) == 4 and group.required_host_bytes() == sum(len(a) for a in memory.arrays)
    # data written through the pool lands in the backend's memory
    pool = group.pool("mla")
    pool.device.backing.fill_(0x5A)
    for handle in group.device_to_host("mla", [0], [2]):
        handle.wait()
    raw = bytes(memory.arrays[0])
    start = 2 * pool.spec.bytes_per_unit
    assert raw[start : start + pool.spec.bytes_per_unit] == b"\x5a" * pool.spec.bytes_per_unit
    assert raw[:start] == b"\x00" * start


def test_host_tier_disabled_allocates_no_host_memory(plugins: PluginHost) -> None:
    group = build(plugins, "swa.yaml", "tiers.host.capacity_tokens=0")
    assert group.required_host_bytes() == 0
    assert all(pool.host is None and pool.host_allocator is None for pool in group.pools.values())


def test_pinning_follows_the_device(plugins: PluginHost) -> None:
    group = build(plugins, "kv.yaml")
    assert group.pin_memory is (DEVICE.startswith("cuda"))
    assert group.anchor.host.pinned is (DEVICE.startswith("cuda"))
    assert group.anchor.host.backing.is_pinned() is group.anchor.host.pinned


@pytest.mark.parametrize(("stack", "pool"), [("hybrid-mamba.yaml", "mamba"), ("swa.yaml", "swa")])
def test_index_source_on_a_component_is_refused(plugins: PluginHost, stack: str, pool: str) -> None:
    # swa and mamba are components whatever their config says: an index_source on one was
    # silently ignored (the pool kept its own indices, not the ones the config named)
    anchor = "kv" if stack == "hybrid-mamba.yaml" else "full"
    with pytest.raises(ValueError, match=rf"model\.pools\.{pool}\.index_source is '{anchor}', but a {pool}"):
        build(plugins, stack, f"model.pools.{pool}.index_source={anchor}")


def test_a_sidecar_copy_that_raises_waits_for_the_copies_already_issued(
    plugins: PluginHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection (a patched ``copy_units`` whose handles record their wait, the third call
    raising): the handles of the pools already copied were dropped with the error, so no caller
    could wait for them -- on CUDA a load-back then freed device units an issued host -> device
    copy still wrote into. They are now waited for before the error leaves."""
    from kvstrata.core import pool_group
    from kvstrata.core.transfer import TransferHandle

    group = build(plugins, "mla-nsa-draft.yaml")
    issued: list[str] = []
    waited: list[str] = []

    class Recorded(TransferHandle):
        def wait(self) -> None:
            waited.append(self.name)

    def copy_fails_third(src: object, *args: object, **kwargs: object) -> TransferHandle:
        if len(issued) == 2:
            raise RuntimeError("injected copy fault")
        issued.append(str(len(issued)))
        handle = Recorded()
        handle.name = issued[-1]  # type: ignore[attr-defined]
        return handle

    monkeypatch.setattr(pool_group, "copy_units", copy_fails_third)
    with pytest.raises(RuntimeError, match="injected copy fault"):
        group.host_to_device("mla", torch.tensor([0, 1]), torch.tensor([2, 3]))
    assert waited == ["0", "1"], "the copies issued before the fault were waited for"
