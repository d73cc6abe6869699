"""Pool specs from configs: unit layouts, layer ids, named mamba states, float indexer keys, and
that configs written before these keys existed still produce the same objects."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvstrata.core.config import load, validate_config
from kvstrata.core.integrity import layout_fingerprint
from kvstrata.core.pool_group import PoolGroup
from kvstrata.plugins import ConfigError, PluginHost
from kvstrata.plugins.pool_type import BufferSpec, LayerIdError, ModelContext, PoolSpec, UnitLayout
from kvstrata.pool_types.draft import DraftConfig, DraftPoolType
from kvstrata.pool_types.kv import KVConfig, KVPoolType
from kvstrata.pool_types.mamba import MambaConfig, MambaPoolType
from kvstrata.pool_types.nsa import NSAConfig, NSAIndexerPoolType
from kvstrata.pool_types.swa import SWAConfig, SWAPoolType

# the stacks of the examples as they were before the new keys (tests keep them in tests/stacks)
EXAMPLES = Path(__file__).resolve().parent / "stacks"
CONTEXT = ModelContext(page_size=4, anchor="kv")

#: Layout fingerprints of every object of the example configs, computed by the code before unit
#: layouts, layer ids, named mamba states and float indexer keys existed (commit 9d05eb9). Stored
#: objects carry these; a config that did not change must keep producing them, or its L3 turns
#: into misses. The one deliberate change since: ``swa`` pools name their window (audit 29: a
#: reopened deployment with another window was served the old window's K/V), so only their
#: rows differ from 9d05eb9 (theirs were eea6a169..., c9962710... and 6ffa8dee...).
FINGERPRINTS_BEFORE = {
    ("demo.yaml", "kv", "kv"): "54c49de230fda5f492e73bcc9356e778",
    ("hybrid-mamba.yaml", "kv", "kv"): "9a198101ed3188d6a68f1a91061a71a3",
    ("hybrid-mamba.yaml", "mamba", "mamba"): "7bd6c1a10347ef86f0a96decd9e69777",
    ("kv.yaml", "kv", "kv"): "2d594b1552c7f5cd264db7a02056d33d",
    ("logical-swa.yaml", "swa", "swa"): "709d50ec366c927e8b08723cc786fad3",
    ("logical-swa.yaml", "c4", "mla"): "70b721cc950b1e78569d9dfc9417692c",
    ("logical-swa.yaml", "c4_indexer", "nsa"): "30c2aceca372cd960d6751ac19ac638d",
    ("logical-swa.yaml", "c128", "mla"): "c629fa931b6982cc7b937586e6dacf6d",
    ("logical-swa.yaml", "c4_state", "mla"): "2a0a8c8246588d5800587523751d7814",
    ("mla-nsa-draft.yaml", "mla", "mla"): "bc2ba165485d2c89cc2af94b4c5ad81a",
    ("mla-nsa-draft.yaml", "indexer", "nsa"): "30f611a3b34253777d691c12d6fab3b0",
    ("mla-nsa-draft.yaml", "draft", "draft"): "cd1496c99c5e2ed0d2a5491f7b4bdcb0",
    ("swa-mamba.yaml", "kv", "kv"): "7281d6ebcd0a5a28829681c75319a298",
    ("swa-mamba.yaml", "swa", "swa"): "00aeba255d8bfcd9dbaa56629c0157d2",
    ("swa-mamba.yaml", "mamba", "mamba"): "169ec32b61bee815c1605b999bfe0f98",
    ("swa.yaml", "full", "kv"): "7d48cf41bbe4033179dc5d788d1a44f0",
    ("swa.yaml", "swa", "swa"): "0217417487f210c284c3b5b9cdd30a2d",
}


@pytest.fixture(scope="module")
def plugins() -> PluginHost:
    return PluginHost(autoload=True, disabled=set())


def stack(plugins: PluginHost, **pools: dict[str, Any]) -> dict[str, PoolSpec]:
    """Specs of a stack of ``pools`` (a kv anchor unless one is given), built by a real PoolGroup."""
    pools = {"kv": {"type": "kv", "layers": 2, "kv_heads": 2, "head_dim": 8}, **pools}
    data = {
        "model": {"name": "t", "page_size": 4, "pools": pools},
        "tiers": {"device": {"capacity_tokens": 16}, "host": {"capacity_tokens": 0}},
    }
    group = PoolGroup(validate_config(data, plugins), plugins)
    return {name: pool.spec for name, pool in group.pools.items()}


def config_errors(plugins: PluginHost, **pools: dict[str, Any]) -> str:
    pools = {"kv": {"type": "kv", "layers": 2, "kv_heads": 2, "head_dim": 8}, **pools}
    with pytest.raises(ConfigError) as info:
        validate_config({"model": {"name": "t", "page_size": 4, "pools": pools}}, plugins)
    return str(info.value)


# --- configs from before the new keys -----------------------------------------------------------


@pytest.mark.parametrize("name", sorted({key[0] for key in FINGERPRINTS_BEFORE}))
def test_example_configs_keep_their_fingerprints(plugins: PluginHost, name: str) -> None:
    config = load([EXAMPLES / name], overrides=["tiers.device.device=cpu"], plugins=plugins)
    group = PoolGroup(config, plugins)
    seen = {}
    for instance, pool in group.pools.items():
        for obj in pool.spec.objects:
            seen[(name, instance, obj.suffix)] = layout_fingerprint(pool.spec, obj.suffix).hex()
    expected = {key: value for key, value in FINGERPRINTS_BEFORE.items() if key[0] == name}
    assert seen == expected


def test_old_mamba_spelling_equals_the_named_states_it_stands_for(plugins: PluginHost) -> None:
    old = {
        "type": "mamba",
        "layers": 3,
        "conv": [{"shape": [3, 256]}, {"shape": [3, 64], "dtype": "float16"}],
        "temporal": {"shape": [4, 32, 32], "dtype": "float32"},
    }
    named = {
        "type": "mamba",
        "layers": 3,
        "states": {
            "conv_0": {"shape": [3, 256]},
            "conv_1": {"shape": [3, 64], "dtype": "float16"},
            "temporal": {"shape": [4, 32, 32], "dtype": "float32"},
        },
    }
    before, after = stack(plugins, m=old)["m"], stack(plugins, m=named)["m"]
    assert [b.name for b in before.buffers] == ["conv_0", "conv_1", "temporal"]
    assert before == after
    assert layout_fingerprint(before, "mamba") == layout_fingerprint(after, "mamba")


# --- unit layouts --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pool_type", "cls", "extra"),
    [
        ("kv", KVPoolType, {}),
        ("swa", SWAPoolType, {"window": 8}),
        ("draft", DraftPoolType, {}),
    ],
)
def test_attention_unit_layouts(pool_type: str, cls: type, extra: dict[str, Any]) -> None:
    base = {"type": pool_type, "layers": 2, "kv_heads": 3, "head_dim": 8, "v_head_dim": 6, **extra}
    config_cls = {"kv": KVConfig, "swa": SWAConfig, "draft": DraftConfig}[pool_type]
    token = cls("p", config_cls.model_validate(base), CONTEXT).spec()
    head = cls("p", config_cls.model_validate({**base, "unit_layout": "head_major"}), CONTEXT).spec()
    assert [(b.name, b.unit_shape) for b in token.buffers] == [("k", (4, 3, 8)), ("v", (4, 3, 6))]
    assert [(b.name, b.unit_shape) for b in head.buffers] == [("k", (3, 4, 8)), ("v", (3, 4, 6))]
    assert {b.unit_layout for b in token.buffers} == {UnitLayout.TOKEN_MAJOR}
    assert {b.unit_layout for b in head.buffers} == {UnitLayout.HEAD_MAJOR}
    assert token.buffers[0].unit_dims == ("page", "heads", "head_dim")
    assert head.buffers[0].unit_dims == ("heads", "page", "head_dim")
    assert token.bytes_per_unit == head.bytes_per_unit
    # objects of one layout never verify as the other: the shape is in the fingerprint
    suffix = token.objects[0].suffix
    assert layout_fingerprint(token, suffix) != layout_fingerprint(head, suffix)


def test_unit_dims_must_name_each_dimension() -> None:
    with pytest.raises(ValidationError, match="name 2 dimensions"):
        BufferSpec(name="k", dtype="bfloat16", layers=1, unit_shape=(4, 2, 8), unit_dims=("page", "heads"))
    with pytest.raises(ValidationError, match="repeat a name"):
        BufferSpec(name="k", dtype="bfloat16", layers=1, unit_shape=(4, 2), unit_dims=("page", "page"))


def test_unknown_unit_layout_is_a_config_error(plugins: PluginHost) -> None:
    message = config_errors(
        plugins, kv={"type": "kv", "layers": 1, "kv_heads": 1, "head_dim": 8, "unit_layout": "x"}
    )
    assert "model.pools.kv.unit_layout" in message and "head_major" in message


# --- layer ids ---------------------------------------------------------------------------------


def test_layer_ids_map_model_layers_to_pool_layers(plugins: PluginHost) -> None:
    specs = stack(
        plugins,
        kv={"type": "kv", "layers": 3, "kv_heads": 1, "head_dim": 8, "layer_ids": [3, 7, 11]},
        m={"type": "mamba", "layers": 2, "states": {"conv": {"shape": [4, 3]}}, "layer_ids": [0, 1]},
    )
    kv = specs["kv"]
    assert kv.layer_ids == (3, 7, 11)
    assert [kv.layer_index(layer) for layer in (3, 7, 11)] == [0, 1, 2]
    with pytest.raises(LayerIdError) as info:
        kv.layer_index(4)
    assert str(info.value) == "pool 'kv' has no model layer 4; its layer_ids: [3, 7, 11]"
    assert isinstance(info.value, KeyError)
    assert specs["m"].layer_index(1) == 1


def test_without_layer_ids_pool_layers_are_model_layers(plugins: PluginHost) -> None:
    spec = stack(plugins)["kv"]
    assert spec.layer_ids is None
    assert [spec.layer_index(i) for i in range(2)] == [0, 1]
    with pytest.raises(LayerIdError, match=r"no model layer 2: .*model layers 0\.\.1"):
        spec.layer_index(2)
    with pytest.raises(LayerIdError):
        spec.layer_index(-1)
    with pytest.raises(TypeError):
        spec.layer_index("0")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("layer_ids", "needle"),
    [
        ([1, 2, 3], "layer_ids has 3 ids but layers is 2"),
        ([5], "layer_ids has 1 ids but layers is 2"),
        ([4, 4], "model.pools.kv.layer_ids: Value error, layer_ids must be unique; repeated: [4]"),
        ([-1, 2], "layer_ids must be >= 0"),
        ([], "layer_ids is empty"),
    ],
)
def test_bad_layer_ids_are_config_errors(plugins: PluginHost, layer_ids: list[int], needle: str) -> None:
    message = config_errors(
        plugins, kv={"type": "kv", "layers": 2, "kv_heads": 1, "head_dim": 8, "layer_ids": layer_ids}
    )
    assert "model.pools.kv" in message and needle in message


def test_logical_pool_takes_no_layer_ids(plugins: PluginHost) -> None:
    with pytest.raises(ConfigError, match=r"model\.pools\.anchor.*a logical pool holds no layers"):
        validate_config(
            {
                "model": {
                    "name": "t",
                    "page_size": 4,
                    "pools": {"anchor": {"type": "logical", "layer_ids": [0]}},
                }
            },
            plugins,
        )


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 200), min_size=1, max_size=12, unique=True))
def test_layer_index_inverts_layer_ids(layer_ids: list[int]) -> None:
    config = KVConfig(layers=len(layer_ids), kv_heads=1, head_dim=4, layer_ids=layer_ids)
    spec = KVPoolType("kv", config, CONTEXT).spec()
    assert [spec.layer_index(layer) for layer in layer_ids] == list(range(len(layer_ids)))
    missing = next(i for i in range(202) if i not in layer_ids)
    with pytest.raises(LayerIdError):
        spec.layer_index(missing)


# --- mamba states --------------------------------------------------------------------------------


def test_mamba_conv_only_state(plugins: PluginHost) -> None:
    """LFM2's short conv: one conv state per layer, no temporal state."""
    spec = stack(
        plugins,
        conv={
            "type": "mamba",
            "layers": 4,
            "states": {"conv": {"shape": [64, 3], "dims": ["channels", "kernel"]}},
        },
    )["conv"]
    assert [(b.name, b.unit_shape, b.dtype, b.unit_dims) for b in spec.buffers] == [
        ("conv", (64, 3), "bfloat16", ("channels", "kernel"))
    ]
    assert spec.bytes_per_unit == 4 * 64 * 3 * 2
    assert spec.objects[0].buffers == ("conv",)


def test_mamba_several_named_states_keep_their_order(plugins: PluginHost) -> None:
    states = {
        "ssm": {"shape": [4, 16, 8], "dtype": "float32"},
        "conv_x": {"shape": [32, 3]},
        "conv_bc": {"shape": [16, 3], "dtype": "float16"},
    }
    spec = stack(plugins, m={"type": "mamba", "layers": 2, "states": states})["m"]
    assert [b.name for b in spec.buffers] == ["ssm", "conv_x", "conv_bc"]
    assert spec.objects[0].buffers == ("ssm", "conv_x", "conv_bc")
    assert spec.bytes_per_unit == 2 * (4 * 16 * 8 * 4 + 32 * 3 * 2 + 16 * 3 * 2)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"states": {"conv": {"shape": [4, 3]}}, "conv": [{"shape": [4, 3]}]}, "give either states or conv"),
        ({"states": {"conv": {"shape": [4, 3]}}, "temporal": {"shape": [2]}}, "give either states or conv"),
        ({"conv": [{"shape": [4, 3]}]}, "temporal: the older spelling needs both"),
        ({"temporal": {"shape": [2]}}, "conv: the older spelling needs both"),
        ({}, "a mamba pool needs states"),
        ({"states": {}}, "states needs at least one state tensor"),
        ({"states": {"Conv": {"shape": [4]}}}, "state names must match"),
        ({"states": {"conv": {"shape": [4, 0]}}}, "positive dimensions"),
        ({"states": {"conv": {"shape": [4, 3], "dims": ["c"]}}}, "must name each of the 2"),
    ],
)
def test_bad_mamba_states_are_config_errors(plugins: PluginHost, fields: dict[str, Any], needle: str) -> None:
    message = config_errors(plugins, m={"type": "mamba", "layers": 2, **fields})
    assert "model.pools.m" in message and needle in message


def test_mamba_config_object_builds_from_either_spelling() -> None:
    old = MambaConfig.model_validate({"layers": 1, "conv": [{"shape": [2]}], "temporal": {"shape": [3]}})
    assert list(old.state_tensors()) == ["conv_0", "temporal"]
    new = MambaConfig.model_validate({"layers": 1, "states": {"a": {"shape": [2]}}})
    spec = MambaPoolType("m", new, CONTEXT).spec()
    assert [b.name for b in spec.buffers] == ["a"] and spec.buffers[0].unit_layout is None


# --- nsa keys ------------------------------------------------------------------------------------


def test_nsa_float_keys_of_deepseek_v32_in_hf(plugins: PluginHost) -> None:
    """HF's DeepSeek V3.2 keeps float indexer keys [tokens, 16]: a bf16 pool of head dim 16."""
    spec = stack(
        plugins, indexer={"type": "nsa", "layers": 2, "key_dtype": "bfloat16", "index_head_dim": 16}
    )["indexer"]
    (buffer,) = spec.buffers
    assert (buffer.dtype, buffer.unit_shape, buffer.unit_dims) == (
        "bfloat16",
        (4, 16),
        ("page", "index_head_dim"),
    )
    assert spec.bytes_per_unit == 2 * 4 * 16 * 2


@pytest.mark.parametrize(("key_dtype", "itemsize"), [("float16", 2), ("float32", 4), ("bfloat16", 2)])
@settings(max_examples=10, deadline=None)
@given(head_dim=st.integers(1, 700))
def test_nsa_float_keys_take_any_head_dim(key_dtype: str, itemsize: int, head_dim: int) -> None:
    config = NSAConfig(layers=3, key_dtype=key_dtype, index_head_dim=head_dim)
    spec = NSAIndexerPoolType("i", config, CONTEXT).spec()
    assert spec.buffers[0].unit_shape == (4, head_dim)
    assert spec.bytes_per_unit == 3 * 4 * head_dim * itemsize


def test_nsa_fp8_keys_keep_their_layout_and_block_rule(plugins: PluginHost) -> None:
    default = NSAIndexerPoolType("i", NSAConfig(layers=1, index_head_dim=256), CONTEXT).spec()
    explicit = NSAIndexerPoolType(
        "i", NSAConfig(layers=1, index_head_dim=256, key_dtype="fp8_with_scales"), CONTEXT
    ).spec()
    assert default == explicit
    assert default.buffers[0].dtype == "uint8"
    assert default.buffers[0].unit_shape == (4, 256 + 256 // 128 * 4)
    message = config_errors(plugins, i={"type": "nsa", "layers": 1, "index_head_dim": 16})
    assert "model.pools.i" in message and "multiple of 128" in message
    message = config_errors(plugins, i={"type": "nsa", "layers": 1, "key_dtype": "int8"})
    assert "model.pools.i.key_dtype" in message


def test_nsa_float_and_fp8_objects_never_mix() -> None:
    fp8 = NSAIndexerPoolType("i", NSAConfig(layers=1, index_head_dim=128), CONTEXT).spec()
    # same payload size per page (4 x 132 bytes vs 4 x 66 bf16), different fingerprints
    as_float = NSAIndexerPoolType(
        "i", NSAConfig(layers=1, index_head_dim=66, key_dtype="bfloat16"), CONTEXT
    ).spec()
    assert fp8.bytes_per_unit == as_float.bytes_per_unit == 4 * 132
    assert layout_fingerprint(fp8, "nsa") != layout_fingerprint(as_float, "nsa")
    assert math.prod(as_float.buffers[0].unit_shape) == 4 * 66
