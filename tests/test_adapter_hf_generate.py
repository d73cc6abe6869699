"""``model.generate`` the ways users call it, on caches the HF adapter hands out (audit s35).

Each test compares with transformers' own cache (greedy, same model): the same tokens, or a
clear refusal before anything ran. Assisted decoding crops rejected candidates off window
layers; a state model's ``generate`` does not skip the tokens a restored cache holds; a batch
runs on an empty cache (what ``restore`` returns on a miss) and is never committed.
"""

from __future__ import annotations

import os

import pytest
import torch

try:
    import transformers
except ImportError as exc:  # CI sets KVSTRATA_REQUIRE_HF=1 (scripts/test.sh): fail there
    if os.environ.get("KVSTRATA_REQUIRE_HF") == "1":
        raise
    pytest.skip(f"transformers is not installed (pip install 'kvstrata[hf]'): {exc}", allow_module_level=True)

from transformers.cache_utils import DynamicSlidingWindowLayer

import hf_support as hf
from kvstrata.adapters._hf_cache import PageKeepingSlidingWindowLayer
from kvstrata.adapters.hf import HFStateCache
from kvstrata.testing.hf_models import tiny_model

PAGE = hf.PAGE


@pytest.mark.parametrize("family", ["gemma3", "mistral", "gpt_oss"])
@pytest.mark.parametrize("hit", [False, True], ids=["miss", "hit"])
def test_prompt_lookup_decoding_on_window_layers_matches_transformers_own_cache(
    family: str, hit: bool
) -> None:
    """Assisted decoding records the past and crops rejected candidates: the page-keeping
    window layer dropped them from its last window only (the model then saw fewer keys than
    its mask: a shape error inside attention)."""
    hf.quiet()
    model = tiny_model(family)
    prompt = hf.tokens(0, 6).repeat(7)[: 2 * PAGE + 3]  # n-grams repeat: candidates, some rejected
    settings = {"max_new_tokens": 12, "do_sample": False, "prompt_lookup_num_tokens": 3}
    with torch.no_grad():
        # transformers' own cache prefilled with the pages the adapter restores (a continued
        # cache takes another path through assisted generate than an empty one)
        stock = transformers.DynamicCache(config=model.config)
        for start in range(0, 2 * PAGE if hit else 0, PAGE):
            model(input_ids=prompt[None, start : start + PAGE], past_key_values=stock, use_cache=True)
        want = model.generate(prompt[None], past_key_values=stock, **settings)
    with HFStateCache(model, page_size=PAGE) as cache:
        if hit:
            cache.prefill(prompt[: 2 * PAGE])
        past, cached = cache.restore(prompt)
        assert cached == (2 * PAGE if hit else 0)
        with torch.no_grad():
            got = model.generate(prompt[None], past_key_values=past, **settings)
        assert torch.equal(got, want)
        if hit:  # (assisted decoding on a continued cache runs positions that do not continue it)
            with pytest.raises(ValueError, match="position_ids that do not continue"):
                cache.commit(got, got.shape[-1], past)
            assert cache.cache.open_leases == 0
            return
        # the window layers kept every page since the last commit (a crop dropped them): stored
        # and restored, they continue as transformers' own cache does
        held = got.shape[-1] - 1
        assert cache.commit(got, got.shape[-1], past) == held // PAGE * PAGE
        again, cached = cache.restore(got)
        assert cached == held // PAGE * PAGE
        with torch.no_grad():
            more = model.generate(got, past_key_values=again, max_new_tokens=4, do_sample=False)
            assert torch.equal(more, model.generate(got, max_new_tokens=4, do_sample=False))
        assert cache.cache.open_leases == 0


def test_a_crop_after_recorded_past_leaves_the_stock_layers_window_and_the_kept_pages() -> None:
    window = 5
    stock = DynamicSlidingWindowLayer(sliding_window=window)
    keeping = PageKeepingSlidingWindowLayer(sliding_window=window)
    first, candidates = (
        torch.arange(a, b, dtype=torch.float32).reshape(1, 1, -1, 1) for a, b in ((0, 8), (8, 12))
    )
    for layer in (stock, keeping):
        layer.update(first, first)
        layer.activate_past_recording()
        layer.update(candidates, candidates)
        layer.crop(-3)  # three of the four candidates rejected
    assert stock.cumulative_length == keeping.cumulative_length == 9
    assert keeping.keys.flatten().tolist() == list(range(9))  # every token since its last commit
    token = torch.full((1, 1, 1, 1), 99.0)
    want, _ = stock.update(token, token)
    got, _ = keeping.update(token, token)
    assert torch.equal(got, want)  # what the model attends over: the stock layer's


def test_a_state_models_generate_that_would_rerun_the_restored_tokens_is_refused() -> None:
    """Mamba2 reads ``cache_params``, which ``generate`` does not cut the held tokens off: the
    whole prompt ran again on the restored state (other tokens out, no error). Refused before
    the forward, naming the cut; the cut ids give transformers' own tokens."""
    hf.quiet()
    model = tiny_model("mamba2")
    prompt = hf.tokens(8, 2 * PAGE + 1)
    settings = {"max_new_tokens": 8, "do_sample": False}
    with torch.no_grad():
        want = model.generate(prompt[None], **settings)
    with HFStateCache(model, page_size=PAGE, state_slots=8) as cache:
        cache.prefill(prompt[: 2 * PAGE])
        past, cached = cache.restore(prompt)
        assert cached == 2 * PAGE
        with torch.no_grad(), pytest.raises(ValueError, match=r"pass input_ids\[:, 32:\]"):
            model.generate(prompt[None], cache_params=past, **settings)
        assert len(past.kvstrata_tokens) == cached  # the refused forward recorded nothing
        with torch.no_grad():
            got = model.generate(prompt[None, cached:], cache_params=past, **settings)
        assert torch.equal(got[0], want[0, cached:])
        assert len(past.kvstrata_tokens) == want.shape[-1] - 1


@pytest.mark.parametrize("restored_ids", [2 * PAGE + 1, PAGE + 1], ids=["within", "beyond"])
def test_a_state_model_continuing_a_repeating_prompt_is_not_refused(restored_ids: int) -> None:
    """A continuation that happens to start with the restored tokens (a repeating prompt) is
    the continuation, not a replay: it runs -- also one running past the ids ``restore`` took
    (review s35: compared whole, that one was refused)."""
    model = tiny_model("mamba2")
    prompt = hf.tokens(9, PAGE).repeat(3)  # the second page equals the first
    with HFStateCache(model, page_size=PAGE, state_slots=8) as cache:
        cache.prefill(prompt[:PAGE])
        past, cached = cache.restore(prompt[:restored_ids])
        assert cached == PAGE
        with torch.no_grad():
            model(input_ids=prompt[None, cached : 3 * PAGE], cache_params=past, use_cache=True)
        assert cache.commit(prompt, 3 * PAGE, past) == 3 * PAGE


def test_a_batched_generate_on_an_empty_cache_runs_and_is_never_committed() -> None:
    """A batch on an empty cache is allowed (never committed): its ids were recorded flattened,
    so the next step of the same ``generate`` was refused for holding twice its tokens."""
    model = tiny_model("llama")
    a, b = hf.tokens(1, 2 * PAGE + 3), hf.tokens(2, 2 * PAGE - 4)
    ids = torch.zeros((2, len(a)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0], mask[0] = a, 1
    ids[1, -len(b) :], mask[1, -len(b) :] = b, 1  # left padding
    settings = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, **settings)
    with HFStateCache(model, page_size=PAGE) as cache:
        past = cache.new_cache()  # what restore() returns on a miss
        with torch.no_grad():
            got = model.generate(ids, attention_mask=mask, past_key_values=past, **settings)
        assert torch.equal(got, want)
        with pytest.raises(ValueError, match="cannot commit this cache"):
            cache.commit(a, 2 * PAGE, past)
        with torch.no_grad(), pytest.raises(ValueError, match="batch of 1 on a cache holding"):
            model(input_ids=a[None, :1], past_key_values=past)
        assert cache.cache.open_leases == 0
