"""Two deployments on ONE file L3 whose model configs differ in one field: the second never
restores the first's state (audit 41, "another model's state").

Hypothesis draws the stack, the field and its new value; the first cache stores a request, the
second serves the same tokens. Wherever the field changes what a pool's bytes mean (dtype, shapes,
layers and which model layers, page size, a window, a Mamba state's shape, dtype or declared
dimension order, the model name, the tenant salt) the second gets no page from L3, refuses no
object as foreign (the keys differ: it never even reads them) and the first still restores
everything afterwards. A reader with a pool the writer lacked (a Mamba pool added) gets nothing;
one without a pool the writer had (a draft pool dropped) may hit, and then every byte it restores
is verified.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller_support import host_units_held_by_tree, host_units_in_use, open_cache, serve, tokens

WAIT = "policy.prefetch.policy=wait_complete"
FLOATS = ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]

_SMALL = st.integers(1, 6)
_SHAPES = st.lists(_SMALL, min_size=1, max_size=3)


def _not(value: Any, strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return strategy.filter(lambda v: v != value)


#: (stack, dotted field, values other than the stack's own)
FIELDS: list[tuple[str, str, st.SearchStrategy[Any]]] = [
    ("kv", "model.pools.kv.dtype", _not("bfloat16", st.sampled_from(FLOATS))),
    ("kv", "model.pools.kv.kv_heads", _not(2, _SMALL)),
    ("kv", "model.pools.kv.head_dim", _not(64, st.sampled_from([8, 16, 32, 128]))),
    ("kv", "model.pools.kv.v_head_dim", _not(64, st.sampled_from([8, 32, 128]))),
    ("kv", "model.pools.kv.layers", _not(4, _SMALL)),
    (
        "kv",
        "model.pools.kv.layer_ids",
        st.lists(st.integers(0, 40), min_size=4, max_size=4, unique=True).filter(
            lambda ids: ids != [0, 1, 2, 3]
        ),
    ),
    ("kv", "model.pools.kv.unit_layout", st.just("head_major")),
    ("kv", "model.page_size", _not(64, st.sampled_from([16, 32, 128]))),
    ("kv", "model.name", _not("example-kv", st.from_regex(r"m[A-Za-z0-9._-]{0,20}", fullmatch=True))),
    ("kv", "model.cache_salt", st.from_regex(r"t[a-z0-9]{0,12}", fullmatch=True)),
    ("hybrid-mamba", "model.pools.mamba.temporal.dtype", _not("float32", st.sampled_from(FLOATS))),
    ("hybrid-mamba", "model.pools.mamba.temporal.shape", _not([4, 32, 32], _SHAPES)),
    ("hybrid-mamba", "model.pools.mamba.layers", _not(6, _SMALL)),
    ("hybrid-mamba", "model.pools.mamba.layer_ids", st.just([10, 11, 12, 13, 14, 15])),
    ("hybrid-mamba", "model.pools.mamba.conv", st.just([{"shape": [3, 256], "dtype": "bfloat16"}])),
    ("hybrid-mamba", "model.pools.mamba.temporal.dims", st.permutations(["heads", "key_dim", "value_dim"])),
    ("hybrid-mamba", "model.pools.kv.head_dim", _not(128, st.sampled_from([32, 64, 256]))),
    ("swa", "model.pools.swa.window", _not(128, st.integers(1, 512))),
    ("swa", "model.pools.swa.head_dim", _not(64, st.sampled_from([32, 128]))),
    ("swa-mamba", "model.pools.swa.window", _not(256, st.integers(1, 512))),
    ("swa-mamba", "model.pools.mamba.temporal.shape", _not([2, 16, 16], _SHAPES)),
    ("mla-nsa-draft", "model.pools.mla.kv_lora_rank", _not(512, st.sampled_from([64, 128, 256]))),
    ("mla-nsa-draft", "model.pools.indexer.key_dtype", st.sampled_from(["bfloat16", "float16", "float32"])),
    ("mla-nsa-draft", "model.pools.draft.head_dim", _not(128, st.sampled_from([32, 64]))),
    ("mla-nsa-draft", "model.pools.mla.dtype", _not("bfloat16", st.sampled_from(FLOATS))),
    ("mla-nsa-draft", "model.pools.mla.qk_rope_head_dim", _not(64, st.sampled_from([0, 32]))),
    ("mla-nsa-draft", "model.pools.mla.layers", _not(4, _SMALL)),
    ("mla-nsa-draft", "model.pools.indexer.layers", _not(4, _SMALL)),
    ("mla-nsa-draft", "model.pools.indexer.index_head_dim", st.sampled_from([256, 512])),
    ("mla-nsa-draft", "model.pools.indexer.layer_ids", st.just([1, 2, 3, 4])),
    ("mla-nsa-draft", "model.pools.draft.dtype", _not("bfloat16", st.sampled_from(FLOATS))),
    ("mla-nsa-draft", "model.pools.draft.unit_layout", st.just("head_major")),
    ("mla-nsa-draft", "model.pools.draft.kv_heads", _not(1, _SMALL)),
    ("mla-nsa-draft", "model.pools.draft.v_head_dim", st.sampled_from([32, 64])),
    ("mla-nsa-draft", "model.pools.draft.layer_ids", st.just([61])),
    ("logical-swa", "model.pools.swa.unit_layout", st.just("head_major")),
    ("logical-swa", "model.pools.c4_indexer.key_dtype", st.sampled_from(["bfloat16", "float32"])),
    ("logical-swa", "model.pools.c4.kv_lora_rank", _not(128, st.sampled_from([32, 64, 256]))),
    ("logical-swa", "model.pools.swa.window", _not(128, st.integers(1, 512))),
]


def _override(field: str, value: Any) -> str:
    if isinstance(value, list | dict):
        return f"{field}={json.dumps(value)}"
    return f"{field}={value}"


def _nothing_left_open(cache: Any) -> None:
    assert host_units_in_use(cache) == host_units_held_by_tree(cache)


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=st.sampled_from(range(len(FIELDS))), data=st.data())
def test_a_deployment_differing_in_one_field_never_restores_the_others_state(
    tmp_path_factory: pytest.TempPathFactory, case: int, data: st.DataObject
) -> None:
    stack, field, values = FIELDS[case]
    changed = _override(field, data.draw(values, label=field))
    l3 = tmp_path_factory.mktemp("l3")
    request = tokens(41, 4)
    with open_cache(stack, l3, [WAIT]) as first:
        serve(first, request)
    with open_cache(stack, l3, [WAIT, changed]) as second:
        lease, bad = serve(second, request)
        assert (lease.cached_pages, bad) == (0, 0), changed
        assert second.parts.engine is not None
        assert second.parts.engine.metrics.foreign_objects == 0, "the keys differ: nothing foreign read"
        _nothing_left_open(second)
    with open_cache(stack, l3, [WAIT]) as again:
        lease, bad = serve(again, request)
        assert (lease.cached_pages, lease.hit_pages["storage"], bad) == (4, 4, 0), changed


#: the stack's pools without one of them, as an override (same model name, same other pools)
_KV_ONLY = "model.pools={kv: {type: kv, layers: 2, kv_heads: 2, head_dim: 128, dtype: bfloat16}}"
_MLA_ONLY = (
    "model.pools={mla: {type: mla, layers: 4, kv_lora_rank: 512, qk_rope_head_dim: 64, dtype: bfloat16}}"
)
_FULL_ONLY = "model.pools={full: {type: kv, layers: 2, kv_heads: 1, head_dim: 64, dtype: bfloat16}}"
POOL_SETS = {
    "mamba added": ("hybrid-mamba", [_KV_ONLY], []),
    "window pool added": ("swa", [_FULL_ONLY], []),
    "sidecars added": ("mla-nsa-draft", [_MLA_ONLY], []),
    "mamba dropped": ("hybrid-mamba", [], [_KV_ONLY]),
    "window pool dropped": ("swa", [], [_FULL_ONLY]),
    "sidecars dropped": ("mla-nsa-draft", [], [_MLA_ONLY]),
}


@pytest.mark.parametrize("case", list(POOL_SETS))
def test_a_reader_with_a_pool_the_writer_lacked_gets_nothing_one_without_gets_exact_bytes(
    tmp_path: Path, case: str
) -> None:
    """Same model name, one pool more or less. A pool the writer never stored makes every prefix
    incomplete (a kv prefix without its Mamba state is no hit); a pool dropped leaves the others'
    objects, same key and layout: a hit there restores exactly the bytes stored."""
    stack, writer, reader = POOL_SETS[case]
    request = tokens(43, 4)
    with open_cache(stack, tmp_path, [WAIT, *writer]) as first:
        serve(first, request)
    with open_cache(stack, tmp_path, [WAIT, *reader]) as second:
        lease, bad = serve(second, request)
        assert bad == 0
        assert lease.cached_pages == (4 if "dropped" in case else 0)
        _nothing_left_open(second)


def _mamba_states(temporal_dims: str) -> str:
    return (
        "model.pools.mamba={type: mamba, layers: 6, device_units: 8, host_units: 16, states: "
        "{conv: {shape: [3, 256], dtype: bfloat16}, "
        f"temporal: {{shape: [4, 32, 32], dtype: float32, dims: {temporal_dims}}}}}}}"
    )


def test_a_state_declared_in_another_dimension_order_is_another_layout(tmp_path: Path) -> None:
    """A GDN temporal state ``[heads, key_dim, value_dim]`` and its transpose have one shape when
    the two head dims are equal: the bytes of one are not the other's state. Before the declared
    dims went into the fingerprint (and so the key) the second deployment restored the first's
    states, every byte "verified"."""
    request = tokens(44, 4)
    with open_cache("hybrid-mamba", tmp_path, [WAIT, _mamba_states("[heads, key_dim, value_dim]")]) as first:
        serve(first, request)
    with open_cache("hybrid-mamba", tmp_path, [WAIT, _mamba_states("[heads, value_dim, key_dim]")]) as second:
        lease, bad = serve(second, request)
        assert (lease.cached_pages, bad) == (0, 0)
        assert second.parts.engine is not None and second.parts.engine.metrics.foreign_objects == 0
    with open_cache("hybrid-mamba", tmp_path, [WAIT, _mamba_states("[heads, key_dim, value_dim]")]) as again:
        assert serve(again, request)[0].cached_pages == 4


def test_undeclared_state_dims_keep_the_fingerprint_written_before() -> None:
    """States without dims (every stack written before) keep their fingerprint and keys."""
    from kvstrata.core.integrity import _buffer_description
    from kvstrata.plugins.pool_type import BufferSpec

    plain = BufferSpec(name="temporal", dtype="float32", layers=2, unit_shape=(4, 8, 8))
    assert _buffer_description(plain) == ["temporal", "float32", 2, [4, 8, 8]]
    named = plain.model_copy(update={"unit_dims": ("heads", "k", "v")})
    assert _buffer_description(named) == ["temporal", "float32", 2, [4, 8, 8], ["heads", "k", "v"]]
