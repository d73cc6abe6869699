"""The unit-block geometry that refuses engine tensors whose units share memory, checked against
the bytes themselves on small random layouts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.core.memory_overlap import Blocks, first_shared, overlap_each_other, overlaps_itself

STRIDES = st.sampled_from([0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 24])


@st.composite
def blocks(draw: st.DrawFn, block: int | None = None) -> Blocks:
    size = block if block is not None else draw(st.sampled_from([1, 2, 3, 4, 8]), label="block")
    dims = draw(st.lists(st.tuples(STRIDES, st.integers(2, 5)), max_size=2), label="dims")
    return Blocks(draw(st.integers(0, 60), label="base"), size, tuple(sorted(dims)))


def bytes_of(layout: Blocks) -> list[set[int]]:
    return [set(range(start, start + layout.block)) for start in layout.starts().tolist()]


def shares_itself(layout: Blocks) -> bool:
    seen: set[int] = set()
    for part in bytes_of(layout):
        if part & seen:
            return True
        seen |= part
    return False


@settings(max_examples=400, deadline=None)
@given(layout=blocks())
def test_a_layout_overlapping_itself(layout: Blocks) -> None:
    assert overlaps_itself(layout) == shares_itself(layout)


@settings(max_examples=400, deadline=None)
@given(data=st.data(), same=st.booleans())
def test_two_layouts_overlapping_each_other(data: st.DataObject, same: bool) -> None:
    left = data.draw(blocks(), label="left")
    if same:  # one layout shifted: how the halves of one allocation look
        block = data.draw(st.sampled_from([left.block, 1, 2, 3, 4, 8]), label="shifted block")
        right = Blocks(data.draw(st.integers(0, 80), label="shifted base"), block, left.dims)
    else:
        right = data.draw(blocks(), label="right")
    if shares_itself(left) or shares_itself(right):
        return
    truth = bool(set().union(*bytes_of(left)) & set().union(*bytes_of(right)))
    assert overlap_each_other(left, right) == truth == overlap_each_other(right, left)
    assert (first_shared([("a", left), ("b", right)]) is not None) == truth
