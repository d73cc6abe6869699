"""The layer the adapters share (``kvstrata.adapters._shared``): identity -> namespace, a cache
opened for an engine's layout, weights digests and engine page keys."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from kvstrata.adapters._shared import EngineIdentity, open_cache, page_key, weights_digest
from kvstrata.core.config import ParallelConfig

BASE: dict[str, Any] = {
    "engine": "vllm",
    "model": "org/model-1B",
    "weights": "ab" * 16,
    "dtypes": ("bfloat16",),
    "layout": {"block": "NHD", "heads": 8},
    "page_size": 16,
}
POOLS = {"kv": {"type": "kv", "layers": 2, "kv_heads": 2, "head_dim": 8, "dtype": "float32"}}


def test_the_namespace_is_readable_key_safe_and_the_same_in_a_new_process() -> None:
    identity = EngineIdentity(**BASE)
    assert identity.namespace.startswith("org-model-1B-")
    code = (
        f"from kvstrata.adapters._shared import EngineIdentity; print(EngineIdentity(**{BASE!r}).namespace)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == identity.namespace  # no per-process seed anywhere


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("engine", "sglang"),
        ("model", "org/model-1B-instruct"),
        ("weights", "cd" * 16),
        ("weights", None),
        ("dtypes", ("float16",)),
        ("layout", {"block": "HND", "heads": 8}),
        ("layout", {"block": "NHD", "heads": 4}),
        ("page_size", 32),
    ],
)
def test_every_fact_changes_the_namespace(field: str, value: Any) -> None:
    assert EngineIdentity(**{**BASE, field: value}).namespace != EngineIdentity(**BASE).namespace


def test_salt_and_parallel_stay_out_of_the_namespace_and_the_salt_roots_the_chain() -> None:
    """The salt goes to the chain root and the namespace tag, the ranks to each key's shard
    component: a TP-replicated pool written by rank 0 must be readable by rank 1."""
    plain = EngineIdentity(**BASE)
    salted = EngineIdentity(**BASE, cache_salt="tenant-a", parallel=ParallelConfig(tp_rank=1, tp_size=2))
    assert salted.namespace == plain.namespace
    assert salted.chain_root() != plain.chain_root()
    assert salted.chain_root("") == plain.chain_root()
    assert plain.chain_root("tenant-a") == salted.chain_root()


def test_open_cache_fills_the_identity_from_the_config_and_writes_what_it_sets() -> None:
    config = {
        "model": {"page_size": 8, "cache_salt": "from-config"},
        "tiers": {"host": {"capacity_tokens": 64}},
    }
    identity = EngineIdentity(engine="test", model="m")
    cache, complete = open_cache(
        identity, config, pools=POOLS, overrides={"tiers.device.capacity_tokens": 32}
    )
    with cache:
        assert (complete.page_size, complete.cache_salt) == (8, "from-config")
        assert cache.config.model.name == complete.namespace != identity.namespace
        assert cache.config.tiers.device.capacity_tokens == 32
    fixed = identity.model_copy(update={"page_size": 4, "cache_salt": "set"})
    cache, complete = open_cache(fixed, config, pools=POOLS)
    with cache:
        assert (cache.page_size, cache.config.model.cache_salt) == (4, "set")
        assert complete == fixed.model_copy(update={"parallel": ParallelConfig()})


def test_weights_digest_reads_every_byte_name_dtype_and_shape() -> None:
    tensors = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 4, dtype=torch.bfloat16)}
    base = weights_digest(tensors.items())
    assert base == weights_digest(tensors.items())
    one_element = {**tensors, "a": tensors["a"].clone()}
    one_element["a"][777] += 1
    assert weights_digest(one_element.items()) != base
    assert weights_digest({"a2": tensors["a"], "b": tensors["b"]}.items()) != base
    assert weights_digest({**tensors, "b": tensors["b"].reshape(4, 3)}.items()) != base
    assert weights_digest({**tensors, "b": tensors["b"].view(torch.float16)}.items()) != base
    strided = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()  # not contiguous
    assert weights_digest([("s", strided)]) == weights_digest([("s", strided.contiguous())])
    tied = torch.arange(12, dtype=torch.float32)
    before = weights_digest([("embed", tied), ("lm_head", tied)])  # read once, named twice
    assert before != weights_digest([("embed", tied), ("lm_head", tied[:6])])
    tied[3] += 1
    assert weights_digest([("embed", tied), ("lm_head", tied)]) != before
    with pytest.raises(ValueError, match="meta device"):
        weights_digest([("m", torch.empty(2, device="meta"))])


def test_page_key_passes_hex_digests_and_hashes_the_rest() -> None:
    sha = "0f" * 32
    assert page_key(sha) == sha
    assert page_key("a_b").startswith("_") and len(page_key("a_b")) == 33
    assert page_key("x" * 129) != page_key("x" * 128)
