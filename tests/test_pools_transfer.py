"""Property tests: device -> host -> device is bit-exact for every pool type, layout and dtype."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.core.buffers import PoolBuffers
from kvstrata.core.object_views import object_regions, read_objects, write_objects
from kvstrata.core.transfer import copy_unit_bytes, copy_units
from kvstrata.plugins.pool_type import Layout, ModelContext, PoolSpec
from kvstrata.pool_types.draft import DraftConfig, DraftPoolType
from kvstrata.pool_types.kv import KVConfig, KVPoolType
from kvstrata.pool_types.mamba import MambaConfig, MambaPoolType
from kvstrata.pool_types.mla import MLAConfig, MLAPoolType
from kvstrata.pool_types.nsa import NSAConfig, NSAIndexerPoolType
from kvstrata.pool_types.swa import SWAConfig, SWAPoolType

DEVICE = os.environ.get("KVSTRATA_TEST_DEVICE", "cpu")
PAGE = 4
CONTEXT = ModelContext(page_size=PAGE, anchor="anchor")
FLOAT_DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"]


def make_spec(pool_type: str, dtype: str) -> PoolSpec:
    """A small spec of each pool type; ``dtype`` where the type has one (nsa is always bytes)."""
    if pool_type == "kv":
        cfg = KVConfig(layers=2, kv_heads=2, head_dim=8, v_head_dim=4, dtype=dtype)
        return KVPoolType("p", cfg, CONTEXT).spec()
    if pool_type == "swa":
        return SWAPoolType(
            "p", SWAConfig(layers=3, kv_heads=1, head_dim=8, window=6, dtype=dtype), CONTEXT
        ).spec()
    if pool_type == "draft":
        return DraftPoolType("p", DraftConfig(layers=1, kv_heads=2, head_dim=6, dtype=dtype), CONTEXT).spec()
    if pool_type == "mla":
        cfg = MLAConfig(layers=2, kv_lora_rank=16, qk_rope_head_dim=4, dtype=dtype)
        return MLAPoolType("p", cfg, CONTEXT).spec()
    if pool_type == "nsa":
        return NSAIndexerPoolType("p", NSAConfig(layers=2, index_head_dim=128), CONTEXT).spec()
    if pool_type == "mamba":
        cfg = MambaConfig.model_validate(
            {
                "layers": 3,
                "conv": [{"shape": [3, 5], "dtype": dtype}, {"shape": [2, 3], "dtype": "bfloat16"}],
                "temporal": {"shape": [2, 4, 4], "dtype": "float32"},
            }
        )
        return MambaPoolType("p", cfg, CONTEXT).spec()
    raise AssertionError(pool_type)


CASES = [
    (pool_type, layout, dtype)
    for pool_type in ["kv", "swa", "draft", "mla", "nsa", "mamba"]
    for dtype in (["uint8"] if pool_type == "nsa" else FLOAT_DTYPES)
    for layout in make_spec(pool_type, "bfloat16" if pool_type != "nsa" else "uint8").layouts
]


def random_fill(pool: PoolBuffers, generator: torch.Generator) -> None:
    """Random bytes everywhere (NaN / inf patterns included: the copy must not care about values)."""
    assert pool.backing is not None
    noise = torch.randint(0, 256, (pool.backing.numel(),), dtype=torch.uint8, generator=generator)
    pool.backing.copy_(noise.to(pool.backing.device))


def unit_bytes(pool: PoolBuffers, indices: torch.Tensor) -> dict[str, torch.Tensor]:
    idx = indices.to(pool.device)
    return {name: pool.unit_view(name).index_select(0, idx).cpu() for name in pool.placements}


def assert_same_units(a: PoolBuffers, a_idx: torch.Tensor, b: PoolBuffers, b_idx: torch.Tensor) -> None:
    left, right = unit_bytes(a, a_idx), unit_bytes(b, b_idx)
    for name in left:
        assert torch.equal(left[name], right[name]), f"buffer {name} differs"


def draw_indices(data: st.DataObject, units: int, count: int, label: str) -> torch.Tensor:
    contiguous = data.draw(st.booleans(), label=f"{label} contiguous")
    if contiguous:
        start = data.draw(st.integers(0, units - count), label=f"{label} start")
        return torch.arange(start, start + count, dtype=torch.int64)
    perm = data.draw(st.permutations(range(units)), label=f"{label} perm")
    return torch.tensor(perm[:count], dtype=torch.int64)


@pytest.mark.parametrize(("pool_type", "layout", "dtype"), CASES)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip_bit_exact(pool_type: str, layout: Layout, dtype: str, data: st.DataObject) -> None:
    spec = make_spec(pool_type, dtype)
    device_units, host_units = 7, 9
    device = PoolBuffers(spec, device_units, device=DEVICE, layout=Layout.LAYER_FIRST)
    host = PoolBuffers(spec, host_units, device="cpu", layout=layout)
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    random_fill(device, generator)
    random_fill(host, generator)
    count = data.draw(st.integers(1, device_units), label="count")
    d_idx = draw_indices(data, device_units, count, "device")
    h_idx = draw_indices(data, host_units, count, "host")

    untouched = torch.ones(host_units, dtype=torch.bool)
    untouched[h_idx] = False
    untouched_idx = torch.nonzero(untouched).flatten()
    before = unit_bytes(host, untouched_idx)  # a copy: index_select allocates
    copy_units(device, d_idx, host, h_idx).wait()
    assert_same_units(device, d_idx, host, h_idx)
    # units not named in h_idx are untouched
    after = unit_bytes(host, untouched_idx)
    for name in after:
        assert torch.equal(after[name], before[name])

    # back to a fresh device pool at other indices: identical bytes
    device2 = PoolBuffers(spec, device_units, device=DEVICE, layout=Layout.LAYER_FIRST)
    d2_idx = draw_indices(data, device_units, count, "device2")
    copy_units(host, h_idx, device2, d2_idx).wait()
    assert_same_units(device, d_idx, device2, d2_idx)

    # typed views agree with the byte views (bit pattern, dtype-level)
    name = spec.buffers[0].name
    typed = device.tensor(name)
    expected = typed[:, d_idx.to(typed.device)].transpose(0, 1).contiguous().view(torch.uint8).cpu()
    got = (
        device2.tensor(name)[:, d2_idx.to(typed.device)].transpose(0, 1).contiguous().view(torch.uint8).cpu()
    )
    assert torch.equal(expected, got)


@pytest.mark.parametrize(
    ("pool_type", "layout", "dtype"), [c for c in CASES if c[2] in ("bfloat16", "uint8")]
)
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_object_regions_and_staging_match(
    pool_type: str, layout: Layout, dtype: str, data: st.DataObject
) -> None:
    """Zero-copy regions, staging reads and writes all see the same object bytes, in any layout."""
    spec = make_spec(pool_type, dtype)
    units = 6
    host = PoolBuffers(spec, units, layout=layout)
    random_fill(host, torch.Generator().manual_seed(data.draw(st.integers(0, 2**31))))
    idx = draw_indices(data, units, data.draw(st.integers(1, units)), "idx")
    for obj in spec.objects:
        staging = read_objects(host, obj.suffix, idx)
        assert staging.shape == (idx.numel(), spec.object_bytes(obj.suffix))
        regions = object_regions(host, obj.suffix, idx)
        expected_regions = {Layout.PAGE_FIRST: 1, Layout.PAGE_FIRST_DIRECT: len(obj.buffers)}.get(
            layout, sum(b.layers for b in spec.buffers if b.name in obj.buffers)
        )
        for row, unit_regions in enumerate(regions):
            assert len(unit_regions) == expected_regions
            joined = b"".join(bytes((ctypes.c_uint8 * r.nbytes).from_address(r.ptr)) for r in unit_regions)
            assert joined == staging[row].numpy().tobytes()
        # object bytes are layout independent: write them into another layout and read back
        other_layout = next((lay for lay in spec.layouts if lay is not layout), layout)
        other = PoolBuffers(spec, units, layout=other_layout)
        write_objects(other, obj.suffix, idx, staging)
        assert torch.equal(read_objects(other, obj.suffix, idx), staging)
        assert_same_units(host, idx, other, idx)


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("bad", [[0, 6], [-1], [2, 9, 1]])
def test_object_regions_refuse_a_unit_outside_the_pool(layout: Layout, bad: list[int]) -> None:
    """A foreign or stale index is an error naming the pool's range, never a region elsewhere."""
    spec = make_spec("kv", "bfloat16")
    host = PoolBuffers(spec, 6, layout=layout)
    with pytest.raises(IndexError, match=r"outside \[0, 6\)"):
        object_regions(host, spec.objects[0].suffix, torch.tensor(bad))


def test_host_to_host_across_layouts() -> None:
    spec = make_spec("kv", "bfloat16")
    src = PoolBuffers(spec, 5, layout=Layout.PAGE_FIRST)
    dst = PoolBuffers(spec, 5, layout=Layout.LAYER_FIRST)
    random_fill(src, torch.Generator().manual_seed(1))
    copy_units(src, [4, 0, 2], dst, [1, 3, 0])
    assert_same_units(src, torch.tensor([4, 0, 2]), dst, torch.tensor([1, 3, 0]))


@pytest.mark.parametrize(
    ("src_units", "dst_units"),
    [
        ([1, 2, 3], [0, 1, 2]),
        ([4, 0, 2], [1, 2, 3]),
        ([1, 2, 3], [3, 0, 4]),
        ([3, 1, 2], [4, 2, 0]),
        ([], []),
    ],
)
def test_copy_unit_bytes_copies_runs_and_scattered_units(src_units: list[int], dst_units: list[int]) -> None:
    """Units given as int64 bytes (the tree's) copy what ``copy_units`` would, runs or not."""
    spec = make_spec("kv", "bfloat16")
    src = PoolBuffers(spec, 5, layout=Layout.PAGE_FIRST)
    dst = PoolBuffers(spec, 5, layout=Layout.LAYER_FIRST)
    random_fill(src, torch.Generator().manual_seed(2))
    raw = [torch.tensor(units, dtype=torch.int64).numpy().tobytes() for units in (src_units, dst_units)]
    copy_unit_bytes(src, raw[0], dst, raw[1]).wait()
    assert_same_units(
        src, torch.tensor(src_units, dtype=torch.int64), dst, torch.tensor(dst_units, dtype=torch.int64)
    )


def test_copy_unit_bytes_rejects_bad_input() -> None:
    spec = make_spec("kv", "bfloat16")
    src, dst = PoolBuffers(spec, 4), PoolBuffers(spec, 4, layout=Layout.PAGE_FIRST)
    raw = {name: torch.tensor(units).numpy().tobytes() for name, units in {"two": [0, 1], "one": [0]}.items()}
    with pytest.raises(ValueError, match="differ in length"):
        copy_unit_bytes(src, raw["two"], dst, raw["one"])
    for bad in ([3, 4], [-1, 0], [2, 9, 0]):  # a run past the end, a negative run, scattered
        with pytest.raises(IndexError, match=r"outside \[0, 4\)"):
            copy_unit_bytes(
                src,
                torch.tensor(bad).numpy().tobytes(),
                dst,
                torch.tensor([0, 1, 2][: len(bad)]).numpy().tobytes(),
            )
    with pytest.raises(ValueError, match="whole number"):
        copy_unit_bytes(src, b"\0" * 12, dst, b"\0" * 12)


def test_copy_rejects_bad_input() -> None:
    spec = make_spec("kv", "bfloat16")
    device = PoolBuffers(spec, 4, device=DEVICE)
    host = PoolBuffers(spec, 4, layout=Layout.PAGE_FIRST)
    with pytest.raises(ValueError, match="differ in length"):
        copy_units(device, [0, 1], host, [0])
    with pytest.raises(IndexError, match=r"outside \[0, 4\)"):
        copy_units(device, [0], host, [4])
    other = PoolBuffers(make_spec("mla", "bfloat16"), 4)
    with pytest.raises(ValueError, match="buffers differ"):
        copy_units(device, [0], other, [0])
    with pytest.raises(ValueError, match="does not support layout"):
        PoolBuffers(make_spec("mamba", "bfloat16"), 2, layout=Layout.PAGE_FIRST_DIRECT)


@pytest.mark.parametrize("layout", list(Layout))
def test_write_objects_page_by_page_equals_one_batch_and_refuses_foreign_units(layout: Layout) -> None:
    """The host fast path (cached block table, one memmove per block) against the batch call;
    a unit outside the pool raises and writes nothing."""
    spec = make_spec("kv", "bfloat16")
    obj = spec.objects[0]
    staging = torch.randint(0, 256, (3, spec.object_bytes(obj.suffix)), dtype=torch.uint8)
    batch, single = PoolBuffers(spec, 6, layout=layout), PoolBuffers(spec, 6, layout=layout)
    idx = torch.tensor([5, 0, 3])
    write_objects(batch, obj.suffix, idx, staging)
    for row, unit in enumerate(idx.tolist()):
        write_objects(single, obj.suffix, [unit], staging[row : row + 1])
    assert torch.equal(read_objects(single, obj.suffix, idx), staging)
    assert_same_units(batch, idx, single, idx)
    assert batch.backing is not None and single.backing is not None
    assert torch.equal(batch.backing, single.backing)  # nothing written outside the units
    before = single.backing.clone()
    with pytest.raises(IndexError, match="outside"):
        write_objects(single, obj.suffix, [1, 6, 2], staging)
    assert torch.equal(single.backing, before)
