"""Boundary matrix, adapters (issue 25): what an engine hands the HF and SGLang adapters, and what
another deployment leaves in a shared L3, never serves another model's state.

Every case: the restore is exact or shorter (here: nothing of the foreign state), what was
refused is counted, and nothing is left open (no unit held beyond the tree's, the caches still
serve their own prompts afterwards). The library API's own cases are in the sibling boundary
file; this one holds the adapters' (foreign cache objects, foreign stored objects, key
aliasing) and the key fields one deployment of the library API must not share with another.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from controller_support import host_units_held_by_tree, host_units_in_use, open_cache, serve, tokens
from kvstrata.core.collective import LocalCollective

pytestmark = pytest.mark.faults


def _require(module: str, flag: str) -> None:
    """Skip where the engine is not installed, fail where CI says it must be (scripts/test.sh)."""
    try:
        __import__(module)
    except ImportError as exc:
        if os.environ.get(flag) == "1":
            raise
        pytest.skip(f"{module} is not installed: {exc}")


def _nothing_left_open(cache: Any) -> None:
    assert host_units_in_use(cache) == host_units_held_by_tree(cache)


# --- HF: foreign cache objects and foreign weights -----------------------------------------------


@pytest.fixture
def hf() -> Any:
    _require("transformers", "KVSTRATA_REQUIRE_HF")
    import hf_support

    return hf_support


def test_hf_commit_of_a_cache_another_adapter_handed_out(hf: Any, tmp_path: Path) -> None:
    from kvstrata.testing.hf_models import tiny_model

    model = tiny_model("llama")
    ids = hf.tokens(90, 2 * hf.PAGE + 1)
    with hf.open_cache(model, tmp_path / "a") as a, hf.open_cache(model, tmp_path / "b") as b:
        past = a.new_cache()
        hf.run_pages(a, past, ids[: 2 * hf.PAGE], 0)
        with pytest.raises(ValueError, match="another HFStateCache"):
            b.commit(ids, 2 * hf.PAGE, past)
        assert b.restore(ids)[1] == 0
        _nothing_left_open(b.cache)
        assert a.commit(ids, 2 * hf.PAGE, past) == 2 * hf.PAGE


def test_hf_a_copy_with_one_embedding_row_changed_restores_nothing(hf: Any, tmp_path: Path) -> None:
    import copy

    from kvstrata.testing.hf_models import tiny_model

    model = tiny_model("llama")
    ids = hf.tokens(91, 3 * hf.PAGE + 1)
    with hf.open_cache(model, tmp_path) as cache:
        hf.run_pages(cache, cache.restore(ids)[0], ids, 0, commit_every=1)
    retrained = copy.deepcopy(model)
    with torch.no_grad():
        retrained.get_input_embeddings().weight[int(ids[0])] += 1e-3
    with hf.open_cache(retrained, tmp_path) as other:
        want = hf.reference(other, ids)
        cached, continued = hf.continue_from_restore(other, ids)
        assert cached == 0 and hf.matches(want, cached, continued)
        _nothing_left_open(other.cache)


def test_hf_another_models_objects_under_this_models_keys_are_a_counted_miss(hf: Any, tmp_path: Path) -> None:
    """Another model's object files copied over this model's (same shapes, other weights): the
    header names another key, so the restore is a counted miss and the logits are the model's."""
    from kvstrata.testing.hf_models import tiny_model

    ids = hf.tokens(92, 2 * hf.PAGE + 1)
    mine, theirs = tiny_model("llama"), tiny_model("llama", seed=1)
    names = {}
    for label, model in (("mine", mine), ("theirs", theirs)):
        with hf.open_cache(model, tmp_path) as cache:
            hf.run_pages(cache, cache.restore(ids)[0], ids, 0, commit_every=1)
            names[label] = (cache.namespace, hf.page_hashes(cache, ids))
    for page in range(2):
        target = hf.object_file(tmp_path, names["mine"][0], "kv", names["mine"][1][page])
        source = hf.object_file(tmp_path, names["theirs"][0], "kv", names["theirs"][1][page])
        assert target is not None and source is not None
        shutil.copyfile(source, target)
    with hf.open_cache(mine, tmp_path) as cache:
        want = hf.reference(cache, ids)
        cached, continued = hf.continue_from_restore(cache, ids)
        assert cached == 0 and hf.matches(want, cached, continued)
        engine = cache.cache.parts.engine
        assert engine is not None and engine.metrics.corrupt_reasons.get("key_mismatch", 0) >= 1
        _nothing_left_open(cache.cache)


# --- SGLang: key aliasing and foreign objects ----------------------------------------------------


@pytest.fixture
def sgl() -> Any:
    from kvstrata.testing.sglang_cpu import SGLangUnavailable, load_sglang_mem_cache

    try:
        load_sglang_mem_cache()
    except SGLangUnavailable as exc:
        if os.environ.get("KVSTRATA_REQUIRE_SGLANG") == "1":
            raise
        pytest.skip(str(exc))
    import sglang_support

    return sglang_support


def _sgl_config(path: Path, **model: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"tiers": {"storage": {"l3": {"type": "file", "path": str(path)}}}}
    return {**config, "model": model} if model else config


def test_sglang_a_key_spelling_another_keys_digest(sgl: Any, tmp_path: Path) -> None:
    pool = sgl.new_mha_pool("page_first")
    storage = sgl.open_adapter(_sgl_config(tmp_path), pool)
    try:
        odd = "req-7/page:0"
        alias = hashlib.blake2b(odd.encode(), digest_size=16).hexdigest()
        assert storage.batch_set_v1([odd], sgl.fill_mha(pool, [0], 3, [0])) == [True]
        pool.kv_buffer.fill_(1)
        assert storage.batch_exists([alias]) == 0
        assert storage.batch_get_v1([alias], sgl.slots_of(1, pool.page_size)) == [False]
        assert bool((pool.kv_buffer == 1).all())  # nothing landed
        assert storage.batch_get_v1([odd], sgl.slots_of(2, pool.page_size)) == [True]
        assert sgl.mha_holds(pool, 2, 3, 0)
    finally:
        storage.close()


def test_sglang_another_models_object_under_this_models_key_is_a_counted_miss(
    sgl: Any, tmp_path: Path
) -> None:
    keys = sgl.page_keys(2, seed=4)
    paths = {}
    for name in ("mine", "theirs"):
        pool = sgl.new_mha_pool("page_first")
        storage = sgl.open_adapter(_sgl_config(tmp_path), pool, model_name=name)
        assert storage.batch_set_v1(keys, sgl.fill_mha(pool, [0, 1], 4 if name == "mine" else 5, [0, 1]))
        (object_keys,) = storage.engine.object_keys(storage._anchor().name, keys)
        paths[name] = [storage.backend.path_for(key) for key in object_keys]
        storage.close()
    shutil.copyfile(paths["theirs"][0], paths["mine"][0])
    pool = sgl.new_mha_pool("page_first")
    storage = sgl.open_adapter(_sgl_config(tmp_path), pool, model_name="mine")
    try:
        pool.kv_buffer.fill_(1)
        assert storage.batch_get_v1(keys, torch.arange(2 * pool.page_size)) == [False, True]
        assert sgl.mha_holds(pool, 1, 4, 1)
        # (a zero-copy read lands in the host slot before the header check: a False page's slot
        # holds whatever was read, and SGLang loads no page it was told is missing)
        assert storage.metrics.corrupt_reasons == {"key_mismatch": 1}  # another key's object: damage
    finally:
        storage.close()


# --- the library API: deployments that differ in one key field -----------------------------------


#: One field of the library API's key changed at a time (a process restart, which must not
#: matter: test_l3_write_then_a_fresh_process_restores_exact_bytes in tests/test_controller.py).
API_FIELDS = {
    "dtype": ["model.pools.kv.dtype=float16"],
    "layout (kv heads)": ["model.pools.kv.kv_heads=1"],
    "layer ids (other model layers)": ["model.pools.kv.layer_ids=[4,5,6,7]"],
    "page size": ["model.page_size=32"],
    "tenant salt": ["model.cache_salt=tenant-b"],
    "model name (the weights' identity)": ["model.name=other"],
    "tp size": ["parallel.tp_size=2"],
    "tp rank": ["parallel.tp_size=2", "parallel.tp_rank=1"],
    "sliding window": ["model.pools.swa.window=64"],  # (on the swa stack: kv has no window)
}


@pytest.mark.parametrize("field", list(API_FIELDS))
def test_api_a_deployment_differing_in_one_field_neither_reads_nor_removes_the_others_objects(
    tmp_path: Path, field: str
) -> None:
    """Two deployments on one L3 (a bf16 and an fp16 server of one model, two tenants, two TP
    ranks ...): the second gets no hit and the first still restores everything afterwards.
    Before the layout went into every key, a dtype or shape change read the first's objects
    as foreign and removed them, each deployment destroying the other's cache in turn."""
    request = tokens(17, 4)
    wait = "policy.prefetch.policy=wait_complete"
    first_settings = [wait, "parallel.tp_size=2"] if field == "tp rank" else [wait]
    alone = LocalCollective()  # one rank of two, on purpose: it reads only its own shards
    stack = "swa" if field == "sliding window" else "kv"
    with open_cache(stack, tmp_path, first_settings, collective=alone) as first:
        serve(first, request)
    with open_cache(stack, tmp_path, [wait, *API_FIELDS[field]], collective=alone) as second:
        lease, bad = serve(second, request)
        assert (lease.cached_pages, bad) == (0, 0)
        assert second.parts.engine is not None and second.parts.engine.metrics.foreign_objects == 0
        _nothing_left_open(second)
    with open_cache(stack, tmp_path, first_settings, collective=alone) as again:
        lease, bad = serve(again, request)
        assert (lease.cached_pages, lease.hit_pages["storage"], bad) == (4, 4, 0)
