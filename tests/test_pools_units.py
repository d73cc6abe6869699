"""Unit memory for engines: read/write/views of every pool type in every unit layout and tier
layout, engine-supplied device tensors (validated, then moved device -> host -> device bit-exactly),
and a pool group built on an engine's tensors."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.core.buffers import EngineTensor, PoolBuffers, torch_dtype
from kvstrata.core.config import validate_config
from kvstrata.core.object_views import read_objects, write_objects
from kvstrata.core.pool_group import HostMemoryError, PoolGroup
from kvstrata.core.transfer import copy_units
from kvstrata.plugins import PluginHost
from kvstrata.plugins.pool_type import Layout, ModelContext, PoolSpec
from kvstrata.pool_types.draft import DraftConfig, DraftPoolType
from kvstrata.pool_types.kv import KVConfig, KVPoolType
from kvstrata.pool_types.logical import LogicalConfig, LogicalPoolType
from kvstrata.pool_types.mamba import MambaConfig, MambaPoolType
from kvstrata.pool_types.mla import MLAConfig, MLAPoolType
from kvstrata.pool_types.nsa import NSAConfig, NSAIndexerPoolType
from kvstrata.pool_types.swa import SWAConfig, SWAPoolType

DEVICE = os.environ.get("KVSTRATA_TEST_DEVICE", "cpu")
PAGE = 4
CONTEXT = ModelContext(page_size=PAGE, anchor="anchor")

SPECS: dict[str, Callable[[], PoolSpec]] = {
    "kv/token_major": lambda: KVPoolType(
        "p", KVConfig(layers=2, kv_heads=3, head_dim=8, v_head_dim=4), CONTEXT
    ).spec(),
    "kv/head_major": lambda: KVPoolType(
        "p", KVConfig(layers=2, kv_heads=3, head_dim=8, v_head_dim=4, unit_layout="head_major"), CONTEXT
    ).spec(),
    "swa/token_major": lambda: SWAPoolType(
        "p", SWAConfig(layers=3, kv_heads=2, head_dim=6, window=8, dtype="float16"), CONTEXT
    ).spec(),
    "swa/head_major": lambda: SWAPoolType(
        "p", SWAConfig(layers=3, kv_heads=2, head_dim=6, window=8, unit_layout="head_major"), CONTEXT
    ).spec(),
    "draft/token_major": lambda: DraftPoolType(
        "p", DraftConfig(layers=1, kv_heads=2, head_dim=5, dtype="float8_e4m3fn"), CONTEXT
    ).spec(),
    "draft/head_major": lambda: DraftPoolType(
        "p", DraftConfig(layers=1, kv_heads=2, head_dim=5, dtype="float32", unit_layout="head_major"), CONTEXT
    ).spec(),
    "mla/token_major": lambda: MLAPoolType(
        "p", MLAConfig(layers=2, kv_lora_rank=16, qk_rope_head_dim=4), CONTEXT
    ).spec(),
    "nsa/fp8": lambda: NSAIndexerPoolType("p", NSAConfig(layers=2, index_head_dim=128), CONTEXT).spec(),
    "nsa/bf16-16": lambda: NSAIndexerPoolType(
        "p", NSAConfig(layers=2, index_head_dim=16, key_dtype="bfloat16"), CONTEXT
    ).spec(),
    "mamba/conv+temporal": lambda: MambaPoolType(
        "p",
        MambaConfig.model_validate(
            {"layers": 3, "conv": [{"shape": [3, 5]}], "temporal": {"shape": [2, 4, 4], "dtype": "float32"}}
        ),
        CONTEXT,
    ).spec(),
    "mamba/conv-only": lambda: MambaPoolType(
        "p", MambaConfig.model_validate({"layers": 2, "states": {"conv": {"shape": [6, 3]}}}), CONTEXT
    ).spec(),
    "mamba/several": lambda: MambaPoolType(
        "p",
        MambaConfig.model_validate(
            {
                "layers": 2,
                "states": {
                    "ssm": {"shape": [2, 3, 4], "dtype": "float32"},
                    "conv_a": {"shape": [5, 3], "dtype": "float16"},
                    "conv_b": {"shape": [7], "dtype": "int8"},
                },
            }
        ),
        CONTEXT,
    ).spec(),
}

#: how a device tier's memory is obtained: kvstrata's allocation, or an engine's tensors
DEVICE_KINDS = ["owned", "engine_whole", "engine_per_layer", "engine_strided"]


def random_units(
    spec: PoolSpec, count: int, generator: torch.Generator, *, layer: int | None = None
) -> dict[str, torch.Tensor]:
    """Random bit patterns (NaN and inf included) shaped as read_units returns them."""
    out = {}
    for buffer in spec.buffers:
        lead = (count,) if layer is not None else (count, buffer.layers)
        nbytes = count * (buffer.bytes_per_unit_per_layer if layer is not None else buffer.bytes_per_unit)
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
        out[buffer.name] = raw.view(torch_dtype(buffer.dtype)).view(*lead, *buffer.unit_shape)
    return out


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``tensor`` (so NaN payloads compare equal), on the CPU."""
    return tensor.detach().cpu().contiguous().view(torch.uint8)


def assert_same(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        assert left[name].dtype == right[name].dtype, name
        assert left[name].shape == right[name].shape, name
        assert torch.equal(bits(left[name]), bits(right[name])), f"buffer {name} differs"


def engine_tensors(spec: PoolSpec, units: int, kind: str, device: str = DEVICE) -> dict[str, EngineTensor]:
    """Tensors an engine could own: ``(L, U, *unit)``, per-layer ``(U, *unit)``, or the halves of a
    combined ``(L, U, 2, *unit)`` tensor (units strided, each unit dense)."""
    out: dict[str, EngineTensor] = {}
    for buffer in spec.buffers:
        dtype = torch_dtype(buffer.dtype)
        if kind == "engine_whole":
            out[buffer.name] = torch.zeros(
                buffer.layers, units, *buffer.unit_shape, dtype=dtype, device=device
            )
        elif kind == "engine_per_layer":
            out[buffer.name] = [
                torch.zeros(units, *buffer.unit_shape, dtype=dtype, device=device)
                for _ in range(buffer.layers)
            ]
        elif kind == "engine_strided":
            pair = torch.zeros(buffer.layers, units, 2, *buffer.unit_shape, dtype=dtype, device=device)
            out[buffer.name] = pair[:, :, 1]
        else:
            raise AssertionError(kind)
    return out


def device_tier(spec: PoolSpec, units: int, kind: str) -> PoolBuffers:
    if kind == "owned":
        return PoolBuffers(spec, units, device=DEVICE, layout=Layout.LAYER_FIRST)
    return PoolBuffers.from_tensors(spec, engine_tensors(spec, units, kind), device=DEVICE)


def draw_units(data: st.DataObject, units: int, count: int, label: str) -> list[int]:
    return data.draw(st.permutations(range(units)), label=label)[:count]


CASES = [(name, kind) for name in SPECS for kind in DEVICE_KINDS]


@pytest.mark.parametrize(("name", "kind"), CASES)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_write_read_round_trip_through_host_and_back(name: str, kind: str, data: st.DataObject) -> None:
    """write_units -> device -> every host layout -> another device tier -> read_units: same bits."""
    spec = SPECS[name]()
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    units, count = 6, data.draw(st.integers(1, 4), label="count")
    device = device_tier(spec, units, kind)
    written_at = draw_units(data, units, count, "device units")
    payload = random_units(spec, count, generator)
    device.write_units(written_at, payload)
    read = device.read_units(written_at)
    assert_same(read, payload)
    assert all(t.device == device.device for t in read.values())
    for host_layout in spec.layouts:
        host = PoolBuffers(spec, 7, device="cpu", layout=host_layout)
        host_at = draw_units(data, 7, count, f"host units {host_layout.value}")
        copy_units(device, written_at, host, host_at).wait()
        assert_same(host.read_units(host_at), payload)
        again = device_tier(spec, units, kind)
        back_at = draw_units(data, units, count, f"back units {host_layout.value}")
        copy_units(host, host_at, again, back_at).wait()
        assert_same(again.read_units(back_at), payload)


TIER_CASES = [(name, layout) for name in SPECS for layout in SPECS[name]().layouts]


@pytest.mark.parametrize(("name", "layout"), TIER_CASES)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_tier_layout_reads_what_was_written(name: str, layout: Layout, data: st.DataObject) -> None:
    """kvstrata's own tiers in each layout the spec declares, and engine tensors in page_first_direct."""
    spec = SPECS[name]()
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    tiers = [PoolBuffers(spec, 5, device="cpu", layout=layout)]
    if layout is Layout.PAGE_FIRST_DIRECT:
        tensors = {
            b.name: torch.zeros(5, b.layers, *b.unit_shape, dtype=torch_dtype(b.dtype), device=DEVICE)
            for b in spec.buffers
        }
        tiers.append(PoolBuffers.from_tensors(spec, tensors, layout=layout))
    for tier in tiers:
        count = data.draw(st.integers(1, 5), label="count")
        at = draw_units(data, 5, count, "units")
        payload = random_units(spec, count, generator)
        tier.write_units(at, payload)
        assert_same(tier.read_units(at), payload)
        for buffer in spec.buffers:
            try:
                view = tier.buffer_view(buffer.name)
            except ValueError as exc:  # page_first: a buffer not aligned for its dtype has no view
                assert layout is Layout.PAGE_FIRST and "not aligned" in str(exc)
                continue
            assert view.shape == (5, buffer.layers, *buffer.unit_shape)
            assert torch.equal(bits(view[at[0]]), bits(payload[buffer.name][0]))


def test_logical_pool_has_units_but_no_bytes() -> None:
    spec = LogicalPoolType("anchor", LogicalConfig(), CONTEXT).spec()
    tier = PoolBuffers(spec, 8)
    assert tier.logical and tier.read_units([1, 2]) == {}
    tier.write_units([1, 2], {})
    engine = PoolBuffers.from_tensors(spec, {}, units=8)
    assert engine.logical and engine.units == 8 and engine.nbytes == 0


@pytest.mark.parametrize(("name", "kind"), CASES)
def test_one_layer_at_a_time(name: str, kind: str) -> None:
    spec = SPECS[name]()
    generator = torch.Generator().manual_seed(7)
    tier = device_tier(spec, 5, kind)
    whole = random_units(spec, 3, generator)
    tier.write_units([4, 0, 2], whole)
    layers = spec.buffers[0].layers
    for layer in range(layers):
        got = tier.read_units([4, 0, 2], layer=layer)
        assert_same(got, {n: t[:, layer] for n, t in whole.items()})
    # a one-layer write touches only that layer
    last = layers - 1
    fresh = random_units(spec, 1, generator, layer=last)
    tier.write_units([0], fresh, layer=last)
    after = tier.read_units([0])
    for buffer in spec.buffers:
        assert torch.equal(bits(after[buffer.name][0, last]), bits(fresh[buffer.name][0]))
        if last:
            assert torch.equal(bits(after[buffer.name][0, :last]), bits(whole[buffer.name][1, :last]))


@pytest.mark.parametrize("kind", DEVICE_KINDS)
@pytest.mark.parametrize("name", ["kv/token_major", "kv/head_major", "mamba/several"])
def test_buffer_view_is_the_memory_in_the_declared_unit_layout(name: str, kind: str) -> None:
    """A write through the zero-copy view is what read_units and the engine's own tensor see."""
    spec = SPECS[name]()
    tensors = None if kind == "owned" else engine_tensors(spec, 5, kind)
    tier = device_tier(spec, 5, "owned") if tensors is None else PoolBuffers.from_tensors(spec, tensors)
    generator = torch.Generator().manual_seed(11)
    for buffer in spec.buffers:
        value = random_units(spec, 1, generator, layer=1)[buffer.name][0]
        view = tier.buffer_view(buffer.name, layer=1)
        assert view.shape == (5, *buffer.unit_shape) and view.dtype == torch_dtype(buffer.dtype)
        view[3] = value.to(view.device)
        assert torch.equal(bits(tier.read_units([3], layer=1)[buffer.name][0]), bits(value))
        if tensors is not None:
            engine = tensors[buffer.name]
            held = engine[1][3] if isinstance(engine, list) else engine[1, 3]
            assert torch.equal(bits(held), bits(value))
        if kind != "engine_per_layer":
            everything = tier.buffer_view(buffer.name)
            assert everything.shape == (5, buffer.layers, *buffer.unit_shape)
            assert torch.equal(bits(everything[3, 1]), bits(value))
    if spec.buffers[0].unit_dims[:2] == ("heads", "page"):
        # head-major: one head's tokens are adjacent, as in a [batch, heads, tokens, dim] cache
        k = tier.buffer_view("k", layer=0)
        assert k[0, 1].is_contiguous() and k[0, 1].shape == (PAGE, 8)


def test_head_major_unit_is_a_page_of_a_bhtd_cache() -> None:
    """Pages of an HF-style [batch=1, heads, tokens, dim] K go in and out without transposes."""
    spec = SPECS["kv/head_major"]()
    tier = PoolBuffers(spec, 4, device=DEVICE)
    cache = torch.randn(1, 3, 3 * PAGE, 8).to(torch.bfloat16)  # 3 pages of one layer
    pages = cache[0].unflatten(1, (3, PAGE)).transpose(0, 1)  # (pages, heads, page, dim)
    values = torch.randn(3, 3, PAGE, 4).to(torch.bfloat16)
    tier.write_units([2, 0, 3], {"k": pages, "v": values}, layer=1)
    back = tier.read_units([2, 0, 3], layer=1)["k"]
    assert torch.equal(back.transpose(0, 1).flatten(1, 2).cpu(), cache[0])


# --- validation of engine tensors --------------------------------------------------------------


def kv_spec() -> PoolSpec:
    return KVPoolType("kv", KVConfig(layers=2, kv_heads=2, head_dim=8, v_head_dim=4), CONTEXT).spec()


def good(units: int = 5) -> dict[str, Any]:
    return {
        "k": torch.zeros(2, units, PAGE, 2, 8, dtype=torch.bfloat16),
        "v": torch.zeros(2, units, PAGE, 2, 4, dtype=torch.bfloat16),
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"k": torch.zeros(2, 5, 2, PAGE, 8, dtype=torch.bfloat16)},
            "pool 'kv' (kv) buffer 'k': expected one layer_first tensor of torch.bfloat16 "
            "(layers=2, units=5, page=4, heads=2, head_dim=8), got torch.bfloat16 (2, 5, 2, 4, 8)",
        ),
        (
            {"v": torch.zeros(2, 5, PAGE, 2, 4, dtype=torch.float16)},
            "pool 'kv' (kv) buffer 'v': expected one layer_first tensor of torch.bfloat16 "
            "(layers=2, units=5, page=4, heads=2, head_dim=4), got torch.float16 (2, 5, 4, 2, 4)",
        ),
        (
            {"v": torch.zeros(2, 6, PAGE, 2, 4, dtype=torch.bfloat16)},
            "buffer 'v': expected one layer_first tensor of torch.bfloat16 (layers=2, units=5,",
        ),
        (
            {"k": torch.zeros(2, 5, PAGE, 2, 8, dtype=torch.bfloat16, device="meta")},
            "pool 'kv' (kv) buffer 'k': expected a tensor with memory",
        ),
        (
            {"k": torch.zeros(2, 5, PAGE, 8, 2, dtype=torch.bfloat16).transpose(-1, -2)},
            "pool 'kv' (kv) buffer 'k': expected each unit (page=4, heads=2, head_dim=8) contiguous",
        ),
        (
            {"k": [torch.zeros(5, PAGE, 2, 8, dtype=torch.bfloat16)]},
            "pool 'kv' (kv) buffer 'k': expected 2 per-layer tensors, got 1",
        ),
        (
            {"k": [torch.zeros(5, PAGE, 2, 8, dtype=torch.bfloat16), torch.zeros(5, PAGE, 2, 8)]},
            "buffer 'k' layer 1: expected a per-layer tensor of torch.bfloat16",
        ),
        (
            {"k": "not a tensor"},
            "buffer 'k': expected a torch.Tensor or a sequence of per-layer tensors, got str",
        ),
        (
            {"x": torch.zeros(1)},
            "engine tensors must cover exactly its buffers ['k', 'v']; missing [], unknown ['x']",
        ),
    ],
)
def test_bad_engine_tensors_name_the_mismatch(change: dict[str, Any], message: str) -> None:
    tensors = {**good(), **change}
    with pytest.raises(ValueError) as info:
        PoolBuffers.from_tensors(kv_spec(), tensors, units=5)
    assert message in str(info.value)


def test_engine_tensors_sharing_memory_are_refused() -> None:
    # the same tensor as k and v was accepted: writing k of a unit changed its v
    spec = KVPoolType("kv", KVConfig(layers=2, kv_heads=2, head_dim=8), CONTEXT).spec()
    shared = good()["k"]
    with pytest.raises(ValueError, match="buffer 'v': the same memory as buffer 'k'"):
        PoolBuffers.from_tensors(spec, {"k": shared, "v": shared}, units=5)
    layer = torch.zeros(5, PAGE, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="buffer 'k' layer 1: the same memory as buffer 'k' layer 0"):
        PoolBuffers.from_tensors(spec, {"k": [layer, layer], "v": shared}, units=5)
    both = torch.zeros(2, 2, 5, PAGE, 2, 8, dtype=torch.bfloat16)  # one allocation, k and v halves
    PoolBuffers.from_tensors(spec, {"k": both[0], "v": both[1]}, units=5)  # fine


def test_missing_buffer_and_wrong_device_and_layouts() -> None:
    spec = kv_spec()
    with pytest.raises(ValueError, match=r"missing \['v'\], unknown \[\]"):
        PoolBuffers.from_tensors(spec, {"k": good()["k"]})
    with pytest.raises(ValueError, match="buffer 'k': expected device cuda, got cpu"):
        PoolBuffers.from_tensors(spec, good(), device="cuda")
    with pytest.raises(ValueError, match="page_first interleaves the buffers"):
        PoolBuffers.from_tensors(spec, good(), layout=Layout.PAGE_FIRST)
    mamba = SPECS["mamba/conv-only"]()
    with pytest.raises(ValueError, match="does not support layout 'page_first_direct'"):
        PoolBuffers.from_tensors(
            mamba, {"conv": torch.zeros(4, 2, 6, 3, dtype=torch.bfloat16)}, layout="page_first_direct"
        )


def test_page_first_direct_engine_tensors() -> None:
    spec = kv_spec()
    tensors = {
        "k": torch.zeros(5, 2, PAGE, 2, 8, dtype=torch.bfloat16),
        "v": torch.zeros(5, 2, PAGE, 2, 4, dtype=torch.bfloat16),
    }
    tier = PoolBuffers.from_tensors(spec, tensors, layout=Layout.PAGE_FIRST_DIRECT)
    assert tier.units == 5 and tier.layout is Layout.PAGE_FIRST_DIRECT and not tier.owned
    payload = random_units(spec, 2, torch.Generator().manual_seed(1))
    tier.write_units([4, 1], payload)
    assert torch.equal(bits(tensors["k"][1]), bits(payload["k"][1]))
    with pytest.raises(ValueError, match="per-layer tensors are layer_first"):
        PoolBuffers.from_tensors(
            spec, {"k": [tensors["k"][:, 0]] * 2, "v": tensors["v"]}, layout="page_first_direct"
        )


def test_engine_tier_moves_through_the_object_copy_path() -> None:
    """read_objects / write_objects (the storage copy path) work on per-layer engine tensors too."""
    spec = kv_spec()
    tier = PoolBuffers.from_tensors(spec, engine_tensors(spec, 4, "engine_per_layer", "cpu"))
    payload = random_units(spec, 2, torch.Generator().manual_seed(5))
    tier.write_units([3, 1], payload)
    staging = read_objects(tier, "kv", [3, 1])
    host = PoolBuffers(spec, 4, layout=Layout.PAGE_FIRST)
    write_objects(host, "kv", [0, 2], staging)
    assert_same(host.read_units([0, 2]), payload)
    other = PoolBuffers.from_tensors(spec, engine_tensors(spec, 4, "engine_per_layer", "cpu"))
    write_objects(other, "kv", [2, 0], staging)
    assert_same(other.read_units([2, 0]), payload)


def test_unit_access_rejects_bad_requests_before_writing() -> None:
    spec = kv_spec()
    tier = PoolBuffers(spec, 4, device=DEVICE)
    payload = random_units(spec, 2, torch.Generator().manual_seed(2))
    before = tier.read_units(range(4))
    with pytest.raises(
        ValueError, match=r"buffer 'v': expected torch.bfloat16 \(2, 2, 4, 2, 4\).*got torch.float32"
    ):
        tier.write_units([0, 1], {"k": payload["k"], "v": payload["v"].float()})
    with pytest.raises(
        ValueError, match=r"buffer 'k': expected torch.bfloat16 \(2, 4, 2, 8\) \(units, \*unit_shape\)"
    ):
        tier.write_units([0, 1], {"k": payload["k"]}, layer=0)
    with pytest.raises(ValueError, match=r"repeated units \[1, 1\]"):
        tier.write_units([1, 1], payload)
    with pytest.raises(IndexError, match=r"outside \[0, 4\)"):
        tier.write_units([0, 4], payload)
    with pytest.raises(IndexError, match=r"layer 2 is not a pool layer index in \[0, 2\)"):
        tier.read_units([0], layer=2)
    # a bool is no layer (``view[:, True]`` added a dimension); any other integer is one
    with pytest.raises(IndexError, match=r"layer True is not a pool layer index"):
        tier.read_units([0], layer=True)
    with pytest.raises(IndexError, match=r"layer True is not a pool layer index"):
        tier.unit_view("k", layer=True)
    assert torch.equal(tier.read_units([1], layer=np.int64(1))["k"], before["k"][1:2, 1])
    with pytest.raises(KeyError, match="has no buffer 'q'"):
        tier.write_units([0, 1], {"q": payload["k"]})
    assert_same(tier.read_units(range(4)), before)  # nothing was written by any failed call
    assert tier.read_units([], buffers=["k"])["k"].shape == (0, 2, PAGE, 2, 8)
    tier.write_units([], {"k": payload["k"][:0]})


# --- a pool group on an engine's tensors ---------------------------------------------------------


@pytest.fixture(scope="module")
def plugins() -> PluginHost:
    return PluginHost(autoload=True, disabled=set())


def hybrid_config(plugins: PluginHost, **extra: Any) -> Any:
    pools = {
        "kv": {"type": "kv", "layers": 2, "kv_heads": 2, "head_dim": 8, "unit_layout": "head_major"},
        "indexer": {"type": "nsa", "layers": 2, "key_dtype": "bfloat16", "index_head_dim": 16},
        "mamba": {
            "type": "mamba",
            "layers": 3,
            "states": {"conv": {"shape": [6, 3]}, "ssm": {"shape": [2, 4]}},
        },
    }
    for name, fields in extra.items():
        pools[name] = {**pools[name], **fields}
    data = {
        "model": {"name": "engine", "page_size": PAGE, "pools": pools},
        "tiers": {
            "device": {"capacity_tokens": 8 * PAGE, "device": DEVICE},
            "host": {"capacity_tokens": 16 * PAGE},
        },
    }
    return validate_config(data, plugins)


def group_tensors(units: dict[str, int]) -> dict[str, dict[str, EngineTensor]]:
    kv = {
        "k": [torch.zeros(units["kv"], 2, PAGE, 8, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)],
        "v": [torch.zeros(units["kv"], 2, PAGE, 8, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)],
    }
    mamba = {
        "conv": torch.zeros(3, units["mamba"], 6, 3, dtype=torch.bfloat16, device=DEVICE),
        "ssm": torch.zeros(3, units["mamba"], 2, 4, dtype=torch.bfloat16, device=DEVICE),
    }
    return {"kv": kv, "mamba": mamba}


def test_group_uses_engine_tensors_as_the_device_tier(plugins: PluginHost) -> None:
    tensors = group_tensors({"kv": 20, "mamba": 3})
    group = PoolGroup(hybrid_config(plugins), plugins, device_tensors=tensors)
    kv, indexer, mamba = group.pool("kv"), group.pool("indexer"), group.pool("mamba")
    # the tensors' unit count is the capacity (capacity_tokens would give 8 pages)
    assert (kv.device.units, mamba.device.units) == (20, 3)
    assert not kv.device.owned and not mamba.device.owned
    assert indexer.device.owned and indexer.device.units == 20  # a sidecar follows its source
    assert kv.device_allocator.units == 20
    generator = torch.Generator().manual_seed(9)
    payload = random_units(kv.spec, 3, generator)
    kv.device.write_units([17, 2, 9], payload)
    assert torch.equal(bits(tensors["kv"]["k"][1][17]), bits(payload["k"][0, 1]))  # engine memory
    index_payload = random_units(indexer.spec, 3, generator)
    indexer.device.write_units([17, 2, 9], index_payload)
    for handle in group.device_to_host("kv", [17, 2, 9], [0, 5, 1]):
        handle.wait()
    for handle in group.host_to_device("kv", [0, 5, 1], [3, 4, 5]):
        handle.wait()
    assert_same(kv.device.read_units([3, 4, 5]), payload)
    assert_same(indexer.device.read_units([3, 4, 5]), index_payload)
    state = random_units(mamba.spec, 1, generator)
    mamba.device.write_units([2], state)
    for handle in group.device_to_host("mamba", [2], [5]):
        handle.wait()
    for handle in group.host_to_device("mamba", [5], [0]):
        handle.wait()
    assert_same(mamba.device.read_units([0]), state)
    assert torch.equal(bits(tensors["mamba"]["ssm"][:, 0]), bits(state["ssm"][0]))


def test_group_checks_engine_tensors_against_the_config(plugins: PluginHost) -> None:
    with pytest.raises(
        ValueError, match=r"model\.pools\.mamba\.device_units is 4 but the engine's device tensors hold 3"
    ):
        PoolGroup(
            hybrid_config(plugins, mamba={"device_units": 4}),
            plugins,
            device_tensors=group_tensors({"kv": 8, "mamba": 3}),
        )
    with pytest.raises(ValueError, match=r"names pools \['nope'\]"):
        PoolGroup(hybrid_config(plugins), plugins, device_tensors={"nope": {}})
    wrong_sidecar = {
        **group_tensors({"kv": 8, "mamba": 3}),
        "indexer": {"index_k": torch.zeros(2, 9, PAGE, 16, dtype=torch.bfloat16, device=DEVICE)},
    }
    with pytest.raises(ValueError, match=r"pool 'indexer' \(nsa\) buffer 'index_k'.*units=8"):
        PoolGroup(hybrid_config(plugins), plugins, device_tensors=wrong_sidecar)
    # matching device_units are fine
    group = PoolGroup(
        hybrid_config(plugins, mamba={"device_units": 3}),
        plugins,
        device_tensors=group_tensors({"kv": 8, "mamba": 3}),
    )
    assert group.pool("mamba").device.units == 3


def test_engine_tensors_are_not_host_memory_of_kvstrata(plugins: PluginHost) -> None:
    """kvstrata's own CPU device tier counts against the host budget; the engine's tensors do not."""
    config = hybrid_config(plugins)
    tensors = group_tensors({"kv": 8, "mamba": 1})
    tensors["indexer"] = {"index_k": torch.zeros(2, 8, PAGE, 16, dtype=torch.bfloat16, device=DEVICE)}
    roomy = PoolGroup(config, plugins, device_tensors=tensors)
    host_bytes = sum(p.spec.bytes_per_unit * p.host.units for p in roomy.pools.values() if p.host)
    exactly = host_bytes + config.tiers.host.reserve_bytes  # room for the host tier, nothing more
    group = PoolGroup(config, plugins, device_tensors=tensors, available_host_bytes=lambda: exactly)
    assert all(not pool.device.owned for pool in group.pools.values())
    assert {n: p.device.units for n, p in group.pools.items()} == {"kv": 8, "indexer": 8, "mamba": 1}
    if DEVICE == "cpu":
        with pytest.raises(HostMemoryError):
            PoolGroup(config, plugins, available_host_bytes=lambda: exactly)


def test_late_pool_on_engine_tensors(plugins: PluginHost) -> None:
    group = PoolGroup(hybrid_config(plugins), plugins, device_tensors=group_tensors({"kv": 12, "mamba": 2}))
    draft_k = torch.zeros(1, 12, PAGE, 1, 8, dtype=torch.float16, device=DEVICE)
    draft_v = torch.zeros(1, 12, PAGE, 1, 8, dtype=torch.float16, device=DEVICE)
    config = {"type": "draft", "layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "float16"}
    with pytest.raises(ValueError, match="buffer 'v'"):
        group.add_pool("draft", config, device_tensors={"k": draft_k, "v": draft_v[:, :11]})
    assert "draft" not in group.pools
    draft = group.add_pool("draft", config, device_tensors={"k": draft_k, "v": draft_v})
    assert not draft.device.owned and draft.device.units == 12
    payload = random_units(draft.spec, 1, torch.Generator().manual_seed(4))
    draft.device.write_units([11], payload)
    assert torch.equal(bits(draft_v[0, 11]), bits(payload["v"][0, 0]))
