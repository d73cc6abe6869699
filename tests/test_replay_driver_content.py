"""The replay driver's batched fill/verify: byte-identical to content.py's per-layer definition,
and it catches wrong bytes, wrong pages and foreign namespaces on every example stack."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstrata.core.config import load
from kvstrata.core.pool_group import PoolGroup
from kvstrata.plugins.host import PluginHost
from kvstrata.replay.content import ContentIdentity, page_identities, verify_units
from kvstrata.replay.driver import PoolContent, StackContent

EXAMPLES = Path(__file__).resolve().parent / "stacks"
STACKS = ["kv.yaml", "mla-nsa-draft.yaml", "hybrid-mamba.yaml", "swa-mamba.yaml", "logical-swa.yaml"]


def group(name: str) -> PoolGroup:
    host = PluginHost()
    return PoolGroup(load([EXAMPLES / name], plugins=host), host)


def ids(n: int, salt: str = "") -> torch.Tensor:
    return page_identities([f"{salt}{i:032x}" for i in range(n)])


@pytest.mark.parametrize("stack", STACKS)
def test_batched_fill_equals_content_definition(stack: str) -> None:
    pools = group(stack)
    content = StackContent("ns-a", pools)
    assert content.pools, "every example stack has at least one pool holding bytes"
    for name, pool_content in content.pools.items():
        device = pools.pools[name].device
        n = min(4, device.units)
        units = torch.arange(n, dtype=torch.int64).flip(0)  # not in page order
        page_ids = ids(n)
        pool_content.fill(units, page_ids)
        assert pool_content.verify(units, page_ids).numel() == 0
        # the same bytes as content.fill_units would write, checked layer by layer per buffer
        for spec in device.spec.buffers:
            identity = ContentIdentity("ns-a", name, spec.name, spec.dtype, spec.bytes_per_unit_per_layer)
            view = device.unit_view(spec.name, 1)
            for layer in range(spec.layers):
                layer_bytes = view[:, layer, :]
                assert verify_units(layer_bytes, units, page_ids, identity, layer).numel() == 0


@pytest.mark.parametrize("stack", ["hybrid-mamba.yaml", "mla-nsa-draft.yaml"])
def test_verify_catches_flipped_byte_swapped_pages_and_foreign_namespace(stack: str) -> None:
    pools = group(stack)
    content = StackContent("ns-a", pools)
    for name, pool_content in content.pools.items():
        device = pools.pools[name].device
        n = min(4, device.units)
        units = torch.arange(n, dtype=torch.int64)
        page_ids = ids(n)
        pool_content.fill(units, page_ids)
        last = device.spec.buffers[-1]
        device.unit_view(last.name, 1)[n - 1, last.layers - 1, 3] ^= 0x10  # one bit, last layer
        assert pool_content.verify(units, page_ids).tolist() == [n - 1]
        if n >= 2:
            swapped = page_ids.clone()
            swapped[[0, 1]] = swapped[[1, 0]]
            assert set(pool_content.verify(units, swapped).tolist()) >= {0, 1}
        foreign = PoolContent("ns-b", name, device)
        assert foreign.verify(units, page_ids).numel() == n  # another model's bytes: all wrong


def test_node_state_pools_are_keyed_by_the_last_page_of_the_prefix() -> None:
    pools = group("hybrid-mamba.yaml")
    content = StackContent("ns", pools)
    identities = ids(10)
    assert content.node_state == {"kv": False, "mamba": True}
    assert torch.equal(content.page_ids("mamba", identities, 0, 7), identities[6:7])
    assert torch.equal(content.page_ids("kv", identities, 3, 7), identities[3:7])
    assert content.page_ids("mamba", identities, 7, 7).numel() == 0


def test_mismatched_lengths_are_rejected() -> None:
    pools = group("kv.yaml")
    pool_content = StackContent("ns", pools).pools["kv"]
    with pytest.raises(ValueError, match="2 units for 3 page identities"):
        pool_content.fill(torch.arange(2), ids(3))
