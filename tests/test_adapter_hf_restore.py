"""HF window layers whose request's prefix is evicted while it runs: the next commit stores the
window only (no L3 here, so nothing else holds the prefix), and must still store it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    import transformers  # noqa: F401
except ImportError as exc:  # CI sets KVSTRATA_REQUIRE_HF=1 (scripts/test.sh): fail there
    if os.environ.get("KVSTRATA_REQUIRE_HF") == "1":
        raise
    pytest.skip(f"transformers is not installed (pip install 'kvstrata[hf]'): {exc}", allow_module_level=True)

import hf_support as hf
from kvstrata.adapters.hf import HFStateCache
from kvstrata.testing.hf_models import tiny_model

PAGE = hf.PAGE


@pytest.mark.parametrize(
    ("family", "restored"),
    [("mistral", True), ("gpt_oss", False)],
    ids=["mistral-after-restore", "gpt_oss-between-commits"],
)
def test_a_window_layer_commits_its_window_after_the_prefix_is_evicted(family: str, restored: bool) -> None:
    """Windows of 23 / 19 tokens span two 16-token pages. A request's prefix evicted while it
    runs (another prompt's pages push it out): its next commit stores its window only, both
    pages, the first from before the restore or the last commit. The window layer used to keep
    only from there, so that commit stored nothing and the prefix was never restorable."""
    hf.quiet()
    tiers = {"tiers": {"device": {"capacity_tokens": 8 * PAGE}, "host": {"capacity_tokens": 8 * PAGE}}}
    with HFStateCache(tiny_model(family), tiers, page_size=PAGE) as cache:
        first = hf.tokens(40, 6 * PAGE)
        hf.run_pages(cache, cache.new_cache(), first, 0, commit_every=1)
        ids = torch.cat([first[: 4 * PAGE], hf.tokens(41, 3 * PAGE)])
        if restored:
            past, cached = cache.restore(ids)
        else:  # run and commit the first four pages on this cache
            past, cached = cache.new_cache(), 4 * PAGE
            hf.run_pages(cache, past, ids[:cached], 0, commit_every=1)
        assert cached == 4 * PAGE
        filler = hf.tokens(42, 8 * PAGE)
        hf.run_pages(cache, cache.new_cache(), filler, 0, commit_every=1)  # evicts the prefix
        commits = []
        with torch.no_grad():
            for end in range(cached + PAGE, len(ids) + 1, PAGE):
                cache.model(input_ids=ids[end - PAGE : end].unsqueeze(0), past_key_values=past)
                commits.append(cache.commit(ids, end, past))
        assert commits == [5 * PAGE, 6 * PAGE, 7 * PAGE]
        prompt = torch.cat([ids[: 5 * PAGE], hf.tokens(43, 2)])
        want = hf.reference(cache, prompt)
        got_cached, got = hf.continue_from_restore(cache, prompt)
        assert got_cached == 5 * PAGE and hf.matches(want, got_cached, got)
        assert cache.cache.open_leases == 0


@pytest.mark.parametrize("how", ["twin-prefill", "twin-decode", "reset"])
def test_a_state_cache_moved_outside_the_hooked_model_is_never_committed(how: str) -> None:
    """A pure state model's cache counts no tokens itself: the adapter records those its hooked
    model runs. Another copy of the model running on the cache (a chunk, or one decode step that
    updates the conv state in place), or ``reset()``, moved the states past what was recorded,
    and a commit stored them as the state at the recorded end: a later restore continued from
    the wrong state. Such a cache is now never committed; the model's own runs still are."""
    import copy

    hf.quiet()
    model = tiny_model("mamba2")
    twin = copy.deepcopy(model)
    with HFStateCache(model, page_size=PAGE) as cache:
        ids = hf.tokens(44, 3 * PAGE)
        past = cache.new_cache()
        with torch.no_grad():
            model(input_ids=ids[None, : 2 * PAGE], cache_params=past, use_cache=True)
            if how == "reset":
                past.reset()
            else:
                extra = ids[None, 2 * PAGE :] if how == "twin-prefill" else ids[None, 2 * PAGE : 2 * PAGE + 1]
                twin(input_ids=extra, cache_params=past, use_cache=True)
        with pytest.raises(ValueError, match=r"reset\(\)|outside a forward of the model"):
            cache.commit(ids, 2 * PAGE, past)
        assert cache.restore(ids)[1] == 0 and cache.cache.open_leases == 0
        own = cache.new_cache()
        hf.run_pages(cache, own, ids[: 2 * PAGE], 0)
        assert cache.commit(ids, 2 * PAGE, own) == 2 * PAGE


def _held_tensors(past: Any) -> list[torch.Tensor]:
    """Every tensor a cache's layers hold: attention K/V, conv and recurrent states."""
    out = []
    for layer in past.layers:
        out += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None]
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            out += [t for t in states.values() if t is not None]
    return [t for t in out if t.numel()]


@pytest.mark.parametrize("family", ["gpt_oss", "jamba", "mamba2"])
def test_a_second_restore_after_eviction_is_bit_exact_whatever_the_first_was_used_for(family: str) -> None:
    """Window, full-attention and Mamba layers: every tensor a restore hands out is the model's
    own (private copies: the model writes conv states in place while decoding). The first
    restore's tensors overwritten in place, the committing cache's too, the prefix pushed to the
    host tier: the second restore holds the same bytes and continues exactly as the model alone."""
    hf.quiet()
    tiers = {"tiers": {"device": {"capacity_tokens": 8 * PAGE}, "host": {"capacity_tokens": 16 * PAGE}}}
    with HFStateCache(tiny_model(family), tiers, page_size=PAGE, state_slots=8) as cache:
        ids = hf.tokens(45, 5 * PAGE + 2)
        writer = cache.new_cache()
        hf.run_pages(cache, writer, ids, 0, commit_every=1)
        first, cached = cache.restore(ids)
        assert cached == 5 * PAGE
        held = [t.clone() for t in _held_tensors(first)]
        for tensor in _held_tensors(first) + _held_tensors(writer):
            tensor.mul_(-3).add_(7)
        filler = hf.tokens(46, 6 * PAGE)
        hf.run_pages(cache, cache.new_cache(), filler, 0, commit_every=1)
        second, again = cache.restore(ids)
        assert again == cached and cache.last_restore.pages["host"] > 0
        assert all(torch.equal(a, b) for a, b in zip(held, _held_tensors(second), strict=True))
        want = hf.reference(cache, ids)
        got = hf.run_pages(cache, second, ids, again)
        assert hf.matches(want, again, got + hf.decode(cache, second, got[-1]))
        assert cache.cache.open_leases == 0


@pytest.mark.parametrize("bad", [256, 10**6, -1], ids=["vocab", "far-past-vocab", "negative"])
def test_token_ids_outside_the_vocabulary_are_refused_before_the_cache_or_the_model_sees_them(
    bad: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny models embed 256 ids. An id past them was looked up (``restore`` returned the
    prefix before it, or a short prompt's 0) and ``prefill`` committed the pages before it,
    then the model's forward failed with ``IndexError: index out of range in self``. Every
    call now raises a ``ValueError`` naming the id and the vocabulary before any lookup."""
    hf.quiet()
    with HFStateCache(tiny_model("llama"), page_size=PAGE) as cache:
        ids = hf.tokens(47, 3 * PAGE + 1)
        lookups: list[object] = []
        real = cache.cache.lookup
        monkeypatch.setattr(cache.cache, "lookup", lambda *a, **k: lookups.append(a) or real(*a, **k))
        message = rf"token id {bad}, outside the model's vocabulary \[0, 256\)"
        for at in (0, 2 * PAGE + 3, 3 * PAGE):  # in the restorable prefix, in its last page, past it
            wrong = ids.clone()
            wrong[at] = bad
            for call in (cache.restore, cache.prefill, lambda x: cache.commit(x, 0, cache.new_cache())):
                with pytest.raises(ValueError, match=message):
                    call(wrong)
            with pytest.raises(ValueError, match="outside the model's vocabulary"):
                cache.restore(wrong[at : at + 2].tolist())  # a short prompt restored nothing before
        assert not lookups and cache.cache.open_leases == 0
        assert cache.prefill(ids).cached_tokens == 0, "no page of the refused prompts was committed"


def test_input_ids_that_are_no_token_ids_get_a_type_or_value_error_naming_input_ids() -> None:
    """A tokenizer's output (a mapping) raised ``RuntimeError: Could not infer dtype of dict``, a
    meta tensor ``NotImplementedError``, a ragged or mixed list torch's own message."""
    from transformers import BatchEncoding

    hf.quiet()
    with HFStateCache(tiny_model("llama"), page_size=PAGE) as cache:
        ids = hf.tokens(48, 2 * PAGE)
        for wrong in ({"input_ids": ids}, BatchEncoding({"input_ids": ids[None]})):
            with pytest.raises(TypeError, match=r"got .*a tokenizer's output\? pass its \['input_ids'\]"):
                cache.restore(wrong)
        with pytest.raises(ValueError, match="input_ids is a tensor on the meta device"):
            cache.prefill(ids.to("meta"))
        for wrong in ([[1, 2], [3]], [1, "a"]):
            with pytest.raises(TypeError, match="input_ids must be token ids"):
                cache.commit(wrong, 0, cache.new_cache())
        assert cache.cache.open_leases == 0


@pytest.mark.slow  # dynamo traces the model (~5-50 s on two busy cores)
def test_a_torch_compiled_model_is_served_under_the_namespace_of_the_model_it_wraps(tmp_path: Path) -> None:
    """``HFStateCache(torch.compile(model))`` raised ``UnsupportedModelError: OptimizedModule.forward
    takes neither past_key_values nor cache_params``. The wrapper's module is mapped, hashed and
    hooked (hooks on it run under the compiled forward), and the wrapper runs the forwards."""
    hf.quiet()
    model = tiny_model("llama")
    ids = hf.tokens(49, 3 * PAGE + 1)
    config = hf.storage(tmp_path / "l3")
    with HFStateCache(torch.compile(model, backend="eager"), config, page_size=PAGE) as compiled:
        first = compiled.prefill(ids)
        assert (first.cached_tokens, first.committed_tokens) == (0, 3 * PAGE)
        assert compiled.prefill(ids).cached_tokens == 3 * PAGE
        namespace = compiled.namespace
    with HFStateCache(model, config, page_size=PAGE) as plain:
        assert plain.namespace == namespace
        again = plain.prefill(ids)
        assert again.cached_tokens == 3 * PAGE and torch.allclose(again.logits, first.logits, atol=1e-5)
