"""The single-pass host row copy (core/row_copy.py) against torch's gather/scatter."""

from __future__ import annotations

import pytest
import torch

from kvstrata.core.row_copy import MIN_BLOCK_BYTES, copy_rows


def _words(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**62), 2**62, shape, dtype=torch.int64, generator=generator)


@pytest.mark.parametrize("src_layer_first", [False, True])
@pytest.mark.parametrize("dst_layer_first", [False, True])
@pytest.mark.parametrize("src_run", [False, True])
def test_scatter_matches_torch_for_every_layout_pair(
    src_layer_first: bool, dst_layer_first: bool, src_run: bool
) -> None:
    units, layers, words = 9, 3, MIN_BLOCK_BYTES // 8

    def view(seed: int, layer_first: bool) -> torch.Tensor:
        if layer_first:  # (L, U, W) seen as (U, L, W): a unit's layers are apart
            return _words((layers, units, words), seed).transpose(0, 1)
        return _words((units, layers, words), seed)

    src, dst = view(1, src_layer_first), view(2, dst_layer_first)
    expected = dst.clone()
    src_idx = torch.tensor([2, 3, 4, 5]) if src_run else torch.tensor([7, 0, 4, 2])
    dst_idx = torch.tensor([5, 1, 8, 3])
    expected.index_copy_(0, dst_idx, src.index_select(0, src_idx))
    assert copy_rows(src, 2 if src_run else src_idx, dst, dst_idx, 4)
    assert torch.equal(dst, expected)


def test_strided_source_rows_are_copied() -> None:
    """Staging columns: rows of a wider buffer (row stride > row bytes)."""
    staging = _words((4, 3 * MIN_BLOCK_BYTES // 8), 3)
    block = MIN_BLOCK_BYTES // 8
    column = staging[:, block : 3 * block].unflatten(1, (2, block))
    pool = torch.zeros((6, 2, MIN_BLOCK_BYTES // 8), dtype=torch.int64)
    idx = torch.tensor([4, 0, 5, 2])
    assert copy_rows(column, 0, pool, idx, 4)
    assert torch.equal(pool[idx], column)
    assert not pool[[1, 3]].any()


def test_declines_views_it_must_not_copy() -> None:
    """Nothing is written when it declines: same storage (overlap), small blocks, no dense row."""
    pool = _words((6, MIN_BLOCK_BYTES // 8), 4)
    before = pool.clone()
    assert not copy_rows(pool[:3], 0, pool, torch.tensor([3, 4, 5]), 3)
    small = _words((6, 16), 5)
    target = torch.zeros_like(small)
    assert not copy_rows(small, 0, target, torch.tensor([1, 2]), 2)
    every_other = pool[:, ::2]  # last dimension not dense
    wide = torch.zeros((6, MIN_BLOCK_BYTES // 16), dtype=torch.int64)
    assert not copy_rows(every_other, 0, wide, torch.tensor([1]), 1)
    assert torch.equal(pool, before) and not target.any() and not wide.any()
