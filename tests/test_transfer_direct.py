"""The direct path of ``copy_units`` between CPU tiers (a few units, one numpy assignment per
view): the same bytes as a gather-then-scatter reference, for every layout, run or scattered
indices, and within one tier where source and destination rows overlap."""

from __future__ import annotations

import pytest
import torch

from kvstrata.core.buffers import PoolBuffers
from kvstrata.core.transfer import copy_units
from kvstrata.plugins.pool_type import Layout, ModelContext, PoolSpec
from kvstrata.pool_types.kv import KVConfig, KVPoolType
from kvstrata.pool_types.mamba import MambaConfig, MambaPoolType

CONTEXT = ModelContext(page_size=4, anchor="anchor")
UNITS = 16


def kv_spec() -> PoolSpec:
    return KVPoolType("p", KVConfig(layers=3, kv_heads=2, head_dim=4, dtype="bfloat16"), CONTEXT).spec()


def mamba_spec() -> PoolSpec:
    cfg = MambaConfig.model_validate(
        {
            "layers": 2,
            "conv": [{"shape": [3, 5], "dtype": "bfloat16"}],
            "temporal": {"shape": [2, 3], "dtype": "float32"},
        }
    )
    return MambaPoolType("p", cfg, CONTEXT).spec()


def filled(spec: PoolSpec, layout: Layout, seed: int) -> PoolBuffers:
    pool = PoolBuffers(spec, UNITS, layout=layout)
    assert pool.backing is not None
    pool.backing.copy_(
        torch.randint(
            0, 256, pool.backing.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
        )
    )
    return pool


def units_of(pool: PoolBuffers) -> dict[str, torch.Tensor]:
    return pool.read_units(torch.arange(UNITS))


CASES = [(spec, layout) for spec in (kv_spec, mamba_spec) for layout in Layout if layout in spec().layouts]
INDICES = [([3], [9]), ([2, 3, 4, 5], [10, 11, 12, 13]), ([7, 1, 12], [0, 15, 4]), ([4, 5, 6], [8, 2, 3])]


@pytest.mark.parametrize(("make", "layout"), CASES)
@pytest.mark.parametrize(("src_idx", "dst_idx"), INDICES)
def test_between_tiers_matches_reference(
    make, layout: Layout, src_idx: list[int], dst_idx: list[int]
) -> None:
    src, dst = filled(make(), layout, 1), filled(make(), layout, 2)
    before_src, expected = units_of(src), units_of(dst)
    for name, value in expected.items():
        value[dst_idx] = before_src[name][src_idx]
    copy_units(src, torch.tensor(src_idx), dst, torch.tensor(dst_idx)).wait()
    for name, value in units_of(dst).items():
        assert torch.equal(value.view(torch.uint8), expected[name].view(torch.uint8)), name
    for name, value in units_of(src).items():
        assert torch.equal(value.view(torch.uint8), before_src[name].view(torch.uint8)), name


OVERLAPPING = [([2, 3, 4, 5], [3, 4, 5, 6]), ([3, 4, 5], [2, 3, 4]), ([1, 2], [2, 1]), ([5, 9, 2], [9, 2, 5])]
WITHIN = [(spec, layout, s, d) for spec, layout in CASES for s, d in [*OVERLAPPING, ([4], [11]), ([9], [2])]]


@pytest.mark.parametrize("as_list", [False, True], ids=["tensors", "lists"])
@pytest.mark.parametrize(("make", "layout", "src_idx", "dst_idx"), WITHIN)
def test_within_one_tier_is_gather_then_scatter(
    make, layout: Layout, src_idx: list[int], dst_idx: list[int], as_list: bool
) -> None:
    """Inside one tier -- one unit (``fork_state``), a run shifted onto itself, a rotation --
    the copy is as if every source row were read first; also where the block-copy fast path
    declines (list indices: page_first tiers got wrong bytes, the others a torch error)."""
    pool = filled(make(), layout, 3)
    expected = units_of(pool)
    for value in expected.values():
        value[dst_idx] = value[src_idx].clone()
    if as_list:
        copy_units(pool, src_idx, pool, dst_idx).wait()
    else:
        copy_units(pool, torch.tensor(src_idx), pool, torch.tensor(dst_idx)).wait()
    for name, value in units_of(pool).items():
        assert torch.equal(value.view(torch.uint8), expected[name].view(torch.uint8)), name


def test_a_permutation_of_every_unit_copies_the_same_bytes() -> None:
    src, dst = filled(kv_spec(), Layout.LAYER_FIRST, 4), filled(kv_spec(), Layout.LAYER_FIRST, 5)
    src_idx = torch.randperm(UNITS, generator=torch.Generator().manual_seed(0))
    dst_idx = torch.randperm(UNITS, generator=torch.Generator().manual_seed(1))
    expected = units_of(dst)
    for name, value in expected.items():
        value[dst_idx] = units_of(src)[name][src_idx]
    copy_units(src, src_idx, dst, dst_idx).wait()
    for name, value in units_of(dst).items():
        assert torch.equal(value.view(torch.uint8), expected[name].view(torch.uint8)), name


def test_out_of_range_and_mismatched_indices_are_refused_before_a_byte_moves() -> None:
    src, dst = filled(kv_spec(), Layout.PAGE_FIRST, 6), filled(kv_spec(), Layout.PAGE_FIRST, 7)
    before = units_of(dst)
    with pytest.raises(IndexError, match="outside"):
        copy_units(src, torch.tensor([1, 2]), dst, torch.tensor([3, UNITS]))
    with pytest.raises(IndexError, match="outside"):
        copy_units(src, torch.tensor([-1]), dst, torch.tensor([3]))
    with pytest.raises(ValueError, match="differ in length"):
        copy_units(src, torch.tensor([1, 2]), dst, torch.tensor([3]))
    for name, value in units_of(dst).items():
        assert torch.equal(value.view(torch.uint8), before[name].view(torch.uint8)), name


def test_scattered_units_too_big_to_gather_take_the_general_path_with_the_same_bytes(monkeypatch) -> None:
    monkeypatch.setattr("kvstrata.core.row_copy.MAX_GATHER_BYTES", 1)  # no temporary allowed
    src, dst = filled(kv_spec(), Layout.LAYER_FIRST, 8), filled(kv_spec(), Layout.PAGE_FIRST, 9)
    expected = units_of(dst)
    for name, value in expected.items():
        value[[0, 15, 4]] = units_of(src)[name][[7, 1, 12]]
    copy_units(src, torch.tensor([7, 1, 12]), dst, torch.tensor([0, 15, 4])).wait()
    for name, value in units_of(dst).items():
        assert torch.equal(value.view(torch.uint8), expected[name].view(torch.uint8)), name
