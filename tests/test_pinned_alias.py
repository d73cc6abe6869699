"""Which device <-> host copies go through a CUDA view of pinned host memory, and when there is
no such view. The copies themselves need a GPU: ``KVSTRATA_TEST_DEVICE=cuda`` runs
tests/test_pools_transfer.py through them (``scripts/gpu_check.sh``; 472 tests passed so on an
H200)."""

from __future__ import annotations

import pytest
import torch

from kvstrata.core.buffers import PoolBuffers
from kvstrata.core.pinned_alias import aliased_pairs, cuda_alias, prefer_kernels


def test_no_alias_without_cuda_or_pinned_memory() -> None:
    host = torch.zeros(16, dtype=torch.int64)
    assert cuda_alias(host, torch.device("cpu")) is None  # not a CUDA target
    assert cuda_alias(host, torch.device("cuda", 0)) is None  # pageable memory has no device address
    assert aliased_pairs([(host, host)]) is None


def test_kernels_are_preferred_unless_the_host_run_is_one_block() -> None:
    page_first = torch.zeros((8, 4, 16))  # (units, layers, words): a run of units is one block
    layer_first = torch.zeros((4, 8, 16)).transpose(0, 1)  # a run of units is four blocks
    assert prefer_kernels([page_first], None, 3)  # scattered host units
    assert not prefer_kernels([page_first], 2, 3)
    assert prefer_kernels([page_first, layer_first], 2, 3)
    assert prefer_kernels([layer_first], False, 3)  # CUDA indices: never inspected, kernels need no look


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_device_without_an_index_keeps_its_name(device: str) -> None:
    from kvstrata.plugins.pool_type import ModelContext
    from kvstrata.pool_types.kv import KVConfig, KVPoolType

    spec = KVPoolType(
        "kv", KVConfig(layers=1, kv_heads=1, head_dim=8), ModelContext(page_size=4, anchor="kv")
    ).spec()
    assert PoolBuffers(spec, 2, device=device).device == torch.device(device)
