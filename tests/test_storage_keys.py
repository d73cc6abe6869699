"""Page-hash chain and the key schema."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from controller_support import open_cache, serve, tokens
from kvstrata.core.config import ParallelConfig
from kvstrata.core.keys import KeySchema, hash_pages, is_writer, namespace_root
from kvstrata.plugins.pool_type import Replication
from kvstrata.testing.conformance import conformance_specs

SAFE_KEY = re.compile(r"^[A-Za-z0-9_.-]+$")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(1, 8), st.integers(0, 5))
def test_chain_splits_at_any_page(tokens: list[int], page_size: int, cut_pages: int) -> None:
    root = namespace_root("m")
    whole = hash_pages(tokens, page_size, root)
    assert len(whole) == len(tokens) // page_size
    cut = min(cut_pages, len(whole)) * page_size
    head = hash_pages(tokens[:cut], page_size, root)
    tail = hash_pages(tokens[cut:], page_size, head[-1] if head else root)
    assert head + tail == whole


def test_input_types_agree_and_page_content_matters() -> None:
    root = namespace_root("m")
    tokens = list(range(100, 116))
    expected = hash_pages(tokens, 4, root)
    assert hash_pages(torch.tensor(tokens, dtype=torch.int64), 4, root) == expected
    assert hash_pages(np.array(tokens, dtype=np.int32), 4, root) == expected
    changed = hash_pages([*tokens[:9], 7, *tokens[10:]], 4, root)
    assert changed[:2] == expected[:2] and changed[2] != expected[2] and changed[3] != expected[3]
    assert len(set(expected)) == 4 and all(len(h) == 32 for h in expected)


def test_namespace_seeds_the_chain() -> None:
    tokens = list(range(8))
    a = hash_pages(tokens, 4, namespace_root("model-a"))
    assert a != hash_pages(tokens, 4, namespace_root("model-b"))
    assert a != hash_pages(tokens, 4, namespace_root("model-a", "tenant-1"))
    assert namespace_root("ab", "c") != namespace_root("a", "bc")


@pytest.mark.parametrize(
    ("tokens", "message"),
    [([-1, 2], "2\\*\\*32"), ([2**32], "2\\*\\*32"), ([[1, 2]], "one-dimensional"), ([1.5], "integers")],
)
def test_bad_tokens_are_refused(tokens: list, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        hash_pages(tokens, 1, namespace_root("m"))


def test_bad_parent_hash_is_refused() -> None:
    with pytest.raises(ValueError, match="hex digits"):
        hash_pages([1, 2], 1, "abcd")


def test_sharded_keys_carry_rank_and_size_replicated_have_one_writer() -> None:
    spec = conformance_specs()["attn"]
    replicated = spec.model_copy(update={"replication": Replication.REPLICATED})
    keys = {}
    for tp_rank, tp_size in ((0, 2), (1, 2), (0, 4)):
        parallel = ParallelConfig(tp_rank=tp_rank, tp_size=tp_size)
        schema = KeySchema.for_pool(spec, model_name="org/Model-1.5B", parallel=parallel)
        keys[(tp_rank, tp_size)] = schema.key("ab" * 16, "k")
        rep = KeySchema.for_pool(replicated, model_name="org/Model-1.5B", parallel=parallel)
        assert rep.writer == (tp_rank == 0) == is_writer(replicated, parallel)
        assert schema.writer
        keys[("rep", tp_rank, tp_size)] = rep.key("ab" * 16, "k")
    assert len({keys[(0, 2)], keys[(1, 2)], keys[(0, 4)]}) == 3
    assert keys[("rep", 0, 2)] == keys[("rep", 1, 2)]
    pp = KeySchema.for_pool(
        replicated, model_name="org/Model-1.5B", parallel=ParallelConfig(pp_rank=1, pp_size=2)
    )
    assert pp.key("ab" * 16, "k") != keys[("rep", 0, 2)]  # pipeline stages hold different layers
    for key in keys.values():
        assert SAFE_KEY.match(key) and "/" not in key


def test_keys_differ_by_namespace_pool_and_suffix() -> None:
    specs = conformance_specs()
    parallel = ParallelConfig()
    a = KeySchema.for_pool(specs["attn"], model_name="m", parallel=parallel)
    b = KeySchema.for_pool(specs["attn"], model_name="m", cache_salt="t", parallel=parallel)
    c = KeySchema.for_pool(specs["index"], model_name="m", parallel=parallel)
    h = "0f" * 16
    assert len({a.key(h, "k"), a.key(h, "v"), b.key(h, "k"), c.key(h, "k")}) == 4
    assert a.keys([h, h], "k") == [a.key(h, "k")] * 2


def test_pool_names_that_clean_to_one_component_keep_their_own_keys(tmp_path: Path) -> None:
    # pools "c.4" and "c-4" (both cleaned to "c-4") shared L3 objects: a second replay was
    # served the other pool's bytes; a name that needs no cleaning keeps the key it had
    spec = conformance_specs()["attn"]
    parallel = ParallelConfig()
    names = ("c.4", "c-4", "c/4", "", "x")
    pools = {
        n: KeySchema.for_pool(spec.model_copy(update={"name": n}), model_name="m", parallel=parallel).pool
        for n in names
    }
    assert len(set(pools.values())) == len(names)
    assert pools["c-4"].split("-")[1:3] == ["c", "4"] and pools["x"].split("-")[1] == "x"
    for pool in pools.values():
        assert SAFE_KEY.match(pool)
    mla = {"type": "mla", "index_source": "kv", "layers": 1, "kv_lora_rank": 32, "qk_rope_head_dim": 0}
    extra = [f"model.pools={{kv: {{type: kv, layers: 1, kv_heads: 1, head_dim: 8}}, c.4: {mla}, c-4: {mla}}}"]
    for run in range(2):
        with open_cache("kv", tmp_path, [*extra, "policy.prefetch.policy=wait_complete"]) as cache:
            lease, bad = serve(cache, tokens(5, 3))
            cache.flush()
        assert bad == 0 and lease.hit_pages["storage"] == 3 * run
