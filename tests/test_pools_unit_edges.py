"""Unit memory at its edges: engine input that is valid but oddly placed (a dense slice starting
between words), and engine tensors whose units share memory (refused, never silently aliased)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.core.buffers import PoolBuffers
from kvstrata.plugins.pool_type import Layout, ModelContext
from kvstrata.pool_types.kv import KVConfig, KVPoolType
from kvstrata.pool_types.mamba import MambaConfig, MambaPoolType

PAGE = 4
CONTEXT = ModelContext(page_size=PAGE, anchor="kv")


def kv_spec(dtype: str = "float16"):
    return KVPoolType("kv", KVConfig(layers=2, kv_heads=2, head_dim=8, dtype=dtype), CONTEXT).spec()


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("layout", [Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT])
@settings(max_examples=10, deadline=None)
@given(offset=st.integers(1, 7), units=st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True))
def test_write_units_takes_a_dense_slice_that_starts_between_words(
    layout: Layout, offset: int, units: list[int]
) -> None:
    # a contiguous slice of a larger float16 tensor starting at an odd element was refused with
    # torch's "storage_offset() must be divisible by 8" RuntimeError (the tier moves int64 words)
    spec = kv_spec()
    tier = PoolBuffers(spec, 6, layout=layout)
    n = len(units)
    payload = {}
    for buffer in spec.buffers:
        count = n * buffer.layers * buffer.bytes_per_unit_per_layer // 2
        big = torch.randint(-(2**15), 2**15, (offset + count,), dtype=torch.int16).view(torch.float16)
        payload[buffer.name] = big[offset:].view(n, buffer.layers, *buffer.unit_shape)
        assert payload[buffer.name].is_contiguous() and payload[buffer.name].storage_offset() == offset
    tier.write_units(units, payload)
    got = tier.read_units(units)
    for name, value in payload.items():
        assert torch.equal(bits(got[name]), bits(value))
    one = {"k": payload["k"][:1, 1]}  # one layer of one unit, still at the odd offset
    tier.write_units(units[:1], one, layer=1)
    assert torch.equal(bits(tier.read_units(units[:1], layer=1)["k"]), bits(one["k"]))


def test_engine_tensors_whose_units_share_memory_are_refused() -> None:
    # an expand()ed or overlapping view was accepted: writing one unit changed the others
    spec = kv_spec("bfloat16")
    unit = (PAGE, 2, 8)
    v = torch.zeros(2, 5, *unit, dtype=torch.bfloat16)
    broadcast_units = torch.zeros(2, 1, *unit, dtype=torch.bfloat16).expand(2, 5, *unit)
    broadcast_layers = torch.zeros(1, 5, *unit, dtype=torch.bfloat16).expand(2, 5, *unit)
    flat = torch.zeros(1000, dtype=torch.bfloat16)
    close_units = flat.as_strided((2, 5, *unit), (320, 32, 16, 8, 1))  # a unit is 64 elements
    for k in (broadcast_units, broadcast_layers, close_units):
        with pytest.raises(ValueError, match="buffer 'k': expected units that do not share memory"):
            PoolBuffers.from_tensors(spec, {"k": k, "v": v})
    layer = torch.zeros(1, *unit, dtype=torch.bfloat16).expand(5, *unit)
    with pytest.raises(ValueError, match="buffer 'k' layer 0: expected units that do not share memory"):
        PoolBuffers.from_tensors(spec, {"k": [layer, layer.clone()], "v": v})
    # units and layers interleaved in one allocation without overlap stay accepted
    interleaved = flat.as_strided((2, 5, *unit), (64, 128, 16, 8, 1))  # unit-major, layers inside
    halves = torch.zeros(2, 5, 2, *unit, dtype=torch.bfloat16)[:, :, 1]  # one half of [L, U, 2, ...]
    tier = PoolBuffers.from_tensors(spec, {"k": interleaved, "v": halves})
    payload = torch.arange(2 * 2 * 64, dtype=torch.int16).view(torch.bfloat16).view(2, 2, *unit)
    tier.write_units([4, 1], {"k": payload})
    assert torch.equal(bits(tier.read_units([4, 1])["k"]), bits(payload))


def test_broadcast_state_slots_are_refused() -> None:
    spec = MambaPoolType(
        "mamba", MambaConfig.model_validate({"layers": 2, "states": {"conv": {"shape": [6, 3]}}}), CONTEXT
    ).spec()
    one_slot = torch.zeros(2, 1, 6, 3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="buffer 'conv': expected units that do not share memory"):
        PoolBuffers.from_tensors(spec, {"conv": one_slot.expand(2, 4, 6, 3)})


@pytest.mark.parametrize(
    ("kind", "layout"),
    [
        (kind, layout)
        for kind in ("owned", "engine_whole", "engine_per_layer")
        for layout in (Layout.LAYER_FIRST, Layout.PAGE_FIRST_DIRECT)
        if kind != "engine_per_layer" or layout is Layout.LAYER_FIRST  # per-layer: layer_first
    ],
)
def test_write_units_from_a_view_of_the_same_tier(kind: str, layout: Layout) -> None:
    # copying unit 3 to unit 4 by writing a zero-copy view of unit 3 raised torch's "some
    # elements of the input tensor and the written-to tensor refer to a single memory location"
    spec = kv_spec()
    if kind == "owned":
        tier = PoolBuffers(spec, 6, layout=layout)
    elif kind == "engine_whole":
        shape = (2, 6) if layout is Layout.LAYER_FIRST else (6, 2)
        tensors = {b.name: torch.zeros(*shape, *b.unit_shape, dtype=torch.float16) for b in spec.buffers}
        tier = PoolBuffers.from_tensors(spec, tensors, layout=layout)
    else:
        tensors = {
            b.name: [torch.zeros(6, *b.unit_shape, dtype=torch.float16) for _ in range(2)]
            for b in spec.buffers
        }
        tier = PoolBuffers.from_tensors(spec, tensors)
    fill = {b.name: torch.randn(6, 2, *b.unit_shape).to(torch.float16) for b in spec.buffers}
    tier.write_units(range(6), fill)
    if not tier.split_layers("k"):
        tier.write_units([4, 5], {"k": tier.buffer_view("k")[2:4]})  # overlapping rows too
        assert torch.equal(bits(tier.read_units([4, 5])["k"]), bits(fill["k"][2:4]))
    tier.write_units([1], {"v": tier.buffer_view("v", layer=1)[3:4]}, layer=1)
    assert torch.equal(bits(tier.read_units([1], layer=1)["v"]), bits(fill["v"][3:4, 1]))


def test_engine_tensors_that_overlap_each_other_are_refused() -> None:
    # per-layer tensors (or buffers) that overlap without starting at one address were accepted:
    # only equal starts were caught, so an off-by-one slice of one allocation aliased units
    spec = kv_spec("bfloat16")
    unit = (PAGE, 2, 8)
    v = torch.zeros(2, 5, *unit, dtype=torch.bfloat16)
    flat = torch.zeros(6, *unit, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="buffer 'k' layer 1: shares memory with buffer 'k' layer 0"):
        PoolBuffers.from_tensors(spec, {"k": [flat[0:5], flat[1:6]], "v": v})
    both = torch.zeros(3, 5, *unit, dtype=torch.bfloat16)  # k = layers 0-1, v = layers 1-2
    with pytest.raises(ValueError, match="shares memory with"):
        PoolBuffers.from_tensors(spec, {"k": both[0:2], "v": both[1:3]})
    interleaved = torch.zeros(5, 2, 2, *unit, dtype=torch.bfloat16)  # [pages, 2, L, ...]: no overlap
    k_layers, v_layers = interleaved[:, 0].transpose(0, 1), interleaved[:, 1].transpose(0, 1)
    tier = PoolBuffers.from_tensors(spec, {"k": k_layers, "v": v_layers})
    payload = torch.arange(2 * 2 * 64, dtype=torch.int16).view(torch.bfloat16).view(2, 2, *unit)
    tier.write_units([4, 1], {"k": payload, "v": payload})
    assert torch.equal(bits(tier.read_units([4, 1])["v"]), bits(payload))
    per_layer = torch.zeros(2, 5, 2, *unit, dtype=torch.bfloat16)  # vLLM: per layer [pages, 2, ...]
    PoolBuffers.from_tensors(
        spec, {"k": [per_layer[i][:, 0] for i in range(2)], "v": [per_layer[i][:, 1] for i in range(2)]}
    )
