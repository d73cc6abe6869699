"""Unit allocators: capacity, reuse, and misuse detection."""

from __future__ import annotations

import pytest
import torch

from kvstrata.core.allocator import AllocatorError, UnitAllocator


def test_alloc_until_full_then_none() -> None:
    allocator = UnitAllocator(5, name="t")
    first = allocator.alloc(3)
    assert first is not None and first.dtype == torch.int64
    assert first.tolist() == [0, 1, 2]  # fresh allocators hand out ascending runs
    assert allocator.available == 2
    assert allocator.alloc(3) is None  # nothing is taken on failure
    assert allocator.available == 2
    rest = allocator.alloc(2)
    assert rest is not None and sorted(rest.tolist()) == [3, 4]
    assert allocator.alloc(1) is None
    allocator.free(first)
    assert allocator.available == 3
    again = allocator.alloc(3)
    assert again is not None and sorted(again.tolist()) == [0, 1, 2]


def test_double_free_is_detected_and_names_indices() -> None:
    allocator = UnitAllocator(4, name="host-kv")
    taken = allocator.alloc(2)
    assert taken is not None
    allocator.free(taken)
    with pytest.raises(AllocatorError, match=r"host-kv.*double free.*\[0, 1\]"):
        allocator.free(taken)
    assert allocator.available == 4  # the failed free changed nothing


def test_foreign_and_duplicate_indices_are_rejected() -> None:
    allocator = UnitAllocator(4, name="p")
    taken = allocator.alloc(4)
    assert taken is not None
    with pytest.raises(AllocatorError, match=r"outside \[0, 4\)"):
        allocator.free([7])
    with pytest.raises(AllocatorError, match="twice"):
        allocator.free([1, 1])
    allocator.free([2])
    with pytest.raises(AllocatorError, match=r"never allocated: indices \[2\]"):
        allocator.free([3, 2])
    # the partially bad free above must not have released index 3
    assert allocator.is_allocated([3]).tolist() == [True]
    assert allocator.available == 1
    with pytest.raises(AllocatorError, match=r"outside \[0, 4\)"):  # -1 read unit 3's state
        allocator.is_allocated([-1])


def test_reset_and_empty_operations() -> None:
    allocator = UnitAllocator(3)
    empty = allocator.alloc(0)
    assert empty is not None and empty.numel() == 0
    allocator.free([])
    allocator.alloc(3)
    allocator.reset()
    assert allocator.available == 3 and allocator.used == 0
    with pytest.raises(ValueError):
        allocator.alloc(-1)
