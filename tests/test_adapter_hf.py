"""kvstrata under Hugging Face transformers 5.23, with tiny seeded models of 17 families.

The proof that matters: a model continues exactly as it would have without kvstrata. Prompts
are prefilled one page per forward and committed, stored to a file L3; a new process restores
the longest cached prefix, runs the rest and decodes 8 greedy tokens, and every logit is
``torch.equal`` to the same chunk schedule run on the model's own empty ``DynamicCache``. The
same with tiers so small that filler prompts evict the first one (the restore comes from L3);
a flipped byte in a stored object shortens the restore (never changes a logit); a prompt sharing
37 of 50 pages reuses the pages up to the last checkpoint. Subprocess phases live in
``hf_support.py`` (batched: one writer and one reader process per half of the models).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    import transformers
except ImportError as exc:  # CI sets KVSTRATA_REQUIRE_HF=1 (scripts/test.sh): fail there
    if os.environ.get("KVSTRATA_REQUIRE_HF") == "1":
        raise
    pytest.skip(f"transformers is not installed (pip install 'kvstrata[hf]'): {exc}", allow_module_level=True)

import hf_support as hf
from kvstrata.adapters.hf import HFStateCache, UnsupportedModelError
from kvstrata.testing.hf_models import FAMILIES, UNMAPPED, tiny_model

PAGE = hf.PAGE
#: the pool types each family maps to (the README table says the same)
EXPECTED_POOLS = {
    "llama": {"kv"},
    "qwen3": {"kv"},
    "mistral": {"logical", "swa"},
    "gemma3": {"kv", "swa"},
    "gpt_oss": {"kv", "swa"},
    "falcon_h1": {"kv", "mamba"},
    "qwen3_next": {"kv", "mamba"},
    "qwen3_5": {"kv", "mamba"},
    "mamba2": {"logical", "mamba"},
    "jamba": {"kv", "mamba"},
    "zamba2": {"kv", "mamba"},
    "bamba": {"kv", "mamba"},
    "granitemoehybrid": {"kv", "mamba"},
    "nemotron_h": {"kv", "mamba"},
    "kimi_linear": {"kv", "mamba"},
    "lfm2": {"kv", "mamba"},
    "deepseek_v3": {"kv"},
}
#: families with more than one kind of state (window + full attention, attention + states)
HYBRID = sorted(f for f, pools in EXPECTED_POOLS.items() if len(pools - {"logical"}) > 1)
#: the new-process L3 run: every family in fp32, four in bf16 (an SSM, a GDN hybrid, SWA, MLA)
SPECS = [
    *sorted(FAMILIES),
    "mamba2:bfloat16",
    "qwen3_next:bfloat16",
    "gemma3:bfloat16",
    "deepseek_v3:bfloat16",
]

transformers.logging.set_verbosity_error()


def test_the_tables_cover_every_family() -> None:
    assert set(EXPECTED_POOLS) == set(FAMILIES) and len(FAMILIES) == 17
    assert "mamba2" in SPECS and {"qwen3_next", "falcon_h1"} <= set(HYBRID) and "gpt_oss" in HYBRID


# --- mapping ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_maps_and_round_trips_in_process(family: str, dtype: torch.dtype) -> None:
    model = tiny_model(family, dtype).to(hf.DEVICE)
    assert sum(p.numel() for p in model.parameters()) <= 2_000_000
    with HFStateCache(model, page_size=PAGE, state_slots=32) as cache:
        pools = cache.layout.pools
        assert {config["type"] for config in pools.values()} == EXPECTED_POOLS[family]
        ids = hf.tokens(7, 6 * PAGE + 1)  # the continuation starts with one token: the decode path
        past, cached = cache.restore(ids)
        assert cached == 0 and cache.last_restore.tokens == 0
        hf.run_pages(cache, past, ids, 0, commit_every=1)
        want = hf.reference(cache, ids)
        cached, got = hf.continue_from_restore(cache, ids)
        assert cached == 6 * PAGE and cache.last_restore.pages["device"] == 6
        assert hf.matches(want, cached, got)
        attention_dtypes = {config["dtype"] for config in pools.values() if config["type"] in ("kv", "swa")}
        assert attention_dtypes <= {str(dtype).removeprefix("torch.")}


@pytest.mark.parametrize(
    ("family", "names"),
    [
        ("deepseek_v32", "cache layer 0 is a DynamicIndexedLayer"),
        ("glm_moe_dsa", "cache layer 0 is a DynamicIndexedLayer"),
        ("deepseek_v4", "cache layer 0 is a DeepseekV4HCACache"),
        ("minimax", "keeps its state in a MiniMaxCache"),
    ],
)
def test_a_model_the_adapter_cannot_map_fails_naming_the_layer_or_cache(family: str, names: str) -> None:
    model = tiny_model(family)
    assert sum(p.numel() for p in model.parameters()) <= 2_000_000
    with pytest.raises(UnsupportedModelError, match=names):
        HFStateCache(model, page_size=PAGE)
    assert family in UNMAPPED


def test_an_encoder_decoder_model_is_refused() -> None:
    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2
    )
    with pytest.raises(UnsupportedModelError, match="T5ForConditionalGeneration is an encoder-decoder"):
        HFStateCache(transformers.T5ForConditionalGeneration(config).eval())


def test_pools_follow_per_layer_shapes_and_model_layer_ids() -> None:
    with HFStateCache(tiny_model("gemma3"), page_size=PAGE) as cache:
        pools = cache.layout.pools
        assert pools["swa_5"]["layer_ids"] == [0, 1] and pools["swa_5"]["window"] == 4  # < a page
        assert pools["kv"]["layer_ids"] == [2] and pools["kv"]["unit_layout"] == "head_major"
        assert "swa_5: swa [0, 1]" in cache.layout.describe().splitlines()[1:][0]
    with HFStateCache(tiny_model("nemotron_h"), page_size=PAGE) as cache:  # mamba, attention, moe, mlp
        pools = cache.layout.pools
        assert pools["state"]["layer_ids"] == [0] and pools["kv"]["layer_ids"] == [1]
        assert set(pools["state"]["states"]) == {"conv", "recurrent"}
    with HFStateCache(tiny_model("lfm2"), page_size=PAGE) as cache:  # short conv only
        assert set(cache.layout.pools["state"]["states"]) == {"conv"}
    with HFStateCache(tiny_model("deepseek_v3"), page_size=PAGE) as cache:  # MLA: latent + rope
        kv = cache.layout.pools["kv"]
        assert (kv["kv_heads"], kv["head_dim"], kv["v_head_dim"]) == (1, 16, 8)
    with HFStateCache(tiny_model("falcon_h1"), page_size=PAGE) as cache:  # attention + mamba per layer
        pools = cache.layout.pools
        assert pools["kv"]["layer_ids"] == pools["state"]["layer_ids"] == [0, 1]


# --- the new-process proof (file L3) ---------------------------------------------------------


def _run_phase(phase: str, specs: list[str], tmp: Path, part: int) -> subprocess.Popen[bytes]:
    out = tmp / f"{phase}-{part}.json"
    command = [sys.executable, str(Path(__file__).with_name("hf_support.py")), phase, *specs]
    command += ["--l3", str(tmp / "l3"), "--evict-l3", str(tmp / "l3-evict"), "--out", str(out)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _phase(phase: str, tmp: Path) -> dict[str, Any]:
    """Run a phase over SPECS in two processes at once (one per core); merge their results."""
    halves = [SPECS[0::2], SPECS[1::2]]
    procs = [_run_phase(phase, half, tmp, i) for i, half in enumerate(halves)]
    merged: dict[str, Any] = {"pids": set(), "results": {}}
    for i, proc in enumerate(procs):
        output, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, output.decode()[-4000:]
        data = json.loads((tmp / f"{phase}-{i}.json").read_text())
        merged["pids"].add(data["pid"])
        merged["results"].update(data["results"])
    return merged


@pytest.fixture(scope="module")
def l3_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("hf-l3")
    written = _phase("write", tmp)
    read = _phase("read", tmp)
    yield written, read


def test_a_new_process_restores_from_l3_and_continues_bit_identically(
    l3_runs: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    written, read = l3_runs
    assert os.getpid() not in written["pids"] | read["pids"] and not written["pids"] & read["pids"]
    for spec in SPECS:
        got = read["results"][spec]
        assert got["namespace"] == written["results"][spec]["namespace"], spec
        assert got["cached"] == hf.PROMPT_PAGES * PAGE, (spec, got["cached"])
        assert got["pages"] == {"device": 0, "host": 0, "storage": hf.PROMPT_PAGES}, spec
        assert got["equal"], f"{spec}: logits differ from the run without kvstrata"
    namespaces = [read["results"][spec]["namespace"] for spec in SPECS]
    assert len(set(namespaces)) == len(SPECS), "every model and dtype has its own namespace"


def test_filler_prompts_evict_the_first_from_small_tiers_and_it_comes_back_from_l3(
    l3_runs: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    written, _ = l3_runs
    for spec in SPECS:
        got = written["results"][spec]
        assert got["evicted_cached"] == hf.PROMPT_PAGES * PAGE, (spec, got)
        assert got["evicted_pages"]["storage"] == hf.PROMPT_PAGES, (spec, got["evicted_pages"])
        assert got["evicted_equal"], f"{spec}: logits after an L3 restore differ"


def test_a_flipped_byte_in_a_stored_object_shortens_the_restore_and_never_changes_a_logit(
    l3_runs: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    _, read = l3_runs
    full = hf.PROMPT_PAGES * PAGE
    for spec in SPECS:
        flips = read["results"][spec]["flips"]
        needed = [f for f in flips if not f["object"].startswith("random:")]
        pools = read["results"][spec]["pools"]
        assert len(needed) == len(pools), (spec, needed)  # one object of every pool the restore reads
        for flip in flips:
            assert not flip.get("missing"), (spec, flip)
            assert flip["equal"], f"{spec}: a corrupt {flip['object']} changed the continuation"
            assert flip["cached"] % PAGE == 0 and flip["cached"] <= full, (spec, flip)
        for flip in needed:
            assert flip["cached"] < full, f"{spec}: a corrupt {flip['object']} was not noticed"
            assert flip["skipped"].get("damaged_object", 0) >= 1, (spec, flip)


# --- prefix sharing at page granularity --------------------------------------------------------


@pytest.mark.parametrize("family", [*HYBRID, "llama", "mamba2"])
def test_a_prompt_sharing_37_of_50_pages_reuses_every_page_or_up_to_the_last_checkpoint(family: str) -> None:
    model = tiny_model(family).to(hf.DEVICE)
    with HFStateCache(model, page_size=PAGE, state_slots=64) as cache:
        first = hf.tokens(40, 50 * PAGE)
        past, _ = cache.restore(first)
        hf.run_pages(cache, past, first, 0, commit_every=8)  # checkpoints at 8, 16, ..., 48, 50
        second = torch.cat([first[: 37 * PAGE], hf.tokens(41, 13 * PAGE)])
        want = hf.reference(cache, second)
        cached, got = hf.continue_from_restore(cache, second)
        # attention (full, or a window pool keeping every page's window) resumes anywhere; a
        # state pool only where a commit was
        assert cached == (32 if cache.layout.states else 37) * PAGE, cached
        assert hf.matches(want, cached, got)


# --- the API's edges ---------------------------------------------------------------------------


def test_restored_states_are_private_copies_the_model_may_mutate() -> None:
    with HFStateCache(tiny_model("qwen3_next").to(hf.DEVICE), page_size=PAGE, state_slots=32) as cache:
        ids = hf.tokens(50, 4 * PAGE + 1)
        hf.run_pages(cache, cache.restore(ids)[0], ids, 0, commit_every=1)
        one, cached = cache.restore(ids)
        before = [
            t.clone()
            for layer in one.layers
            if hasattr(layer, "conv_states")
            for t in layer.conv_states.values()
        ]
        hf.run_pages(cache, one, ids, cached)  # the model updates conv/recurrent states in place
        after = [
            t for layer in one.layers if hasattr(layer, "conv_states") for t in layer.conv_states.values()
        ]
        assert not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        two, _ = cache.restore(ids)
        again = [
            t for layer in two.layers if hasattr(layer, "conv_states") for t in layer.conv_states.values()
        ]
        assert all(torch.equal(a, b) for a, b in zip(before, again, strict=True)), "the checkpoint moved"


def test_window_layers_keep_whole_pages_across_multi_page_chunks() -> None:
    """gpt_oss keeps 19 window tokens; chunks of two pages drop most of a page from the stock
    layer before commit. The restore at an interior page needs those tokens: they must be the
    model's own K/V (compared with a run whose window layers never forget)."""
    from kvstrata.adapters._hf_cache import PageKeepingSlidingWindowLayer

    model = tiny_model("gpt_oss").to(hf.DEVICE)
    with HFStateCache(model, page_size=PAGE) as cache:
        ids = hf.tokens(60, 8 * PAGE).to(hf.DEVICE)
        past, _ = cache.restore(ids)
        with torch.no_grad():
            for start in range(0, len(ids), 2 * PAGE):
                model(input_ids=ids[start : start + 2 * PAGE].unsqueeze(0), past_key_values=past)
                assert cache.commit(ids, start + 2 * PAGE, past) == start + 2 * PAGE
        witness = cache.new_cache()
        with torch.no_grad():
            for start in range(0, len(ids), 2 * PAGE):
                model(input_ids=ids[start : start + 2 * PAGE].unsqueeze(0), past_key_values=witness)
        window = witness.layers[0]
        assert isinstance(window, PageKeepingSlidingWindowLayer) and window.keys.shape[-2] == len(ids)
        restored, cached = cache.restore(torch.cat([ids[: 3 * PAGE], hf.tokens(61, PAGE).to(hf.DEVICE)]))
        assert cached == 3 * PAGE  # inside the second two-page chunk
        layer = restored.layers[0]
        assert layer.get_seq_length() == cached and layer.keys.shape[-2] == 19
        assert torch.equal(layer.keys, window.keys[:, :, cached - 19 : cached])
        assert torch.equal(layer.values, window.values[:, :, cached - 19 : cached])
        full = restored.layers[1]
        assert torch.equal(full.keys, witness.layers[1].keys[:, :, :cached])


def test_window_layers_forget_pages_kvstrata_already_holds() -> None:
    """A second run over a prompt whose pages are all stored: each commit finds them cached and
    stores nothing. The window layers kept every page for it anyway (192 tokens against the
    stock layer's 4: memory and a copy per forward growing with the prompt); they keep what a
    commit that stored them keeps, and the model's outputs are unchanged."""
    from kvstrata.adapters._hf_cache import PageKeepingSlidingWindowLayer

    model = tiny_model("gemma3")
    ids = hf.tokens(62, 12 * PAGE)
    with HFStateCache(model, page_size=PAGE) as cache:
        first = cache.new_cache()
        want = hf.run_pages(cache, first, ids, 0, commit_every=1)
        again = cache.new_cache()
        got = hf.run_pages(cache, again, ids, 0, commit_every=1)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        for past in (first, again):
            kept = [
                layer.keys.shape[-2]
                for layer in past.layers
                if isinstance(layer, PageKeepingSlidingWindowLayer)
            ]
            assert kept and max(kept) < PAGE, kept
        assert cache.cache.open_leases == 0


def test_commit_checks_its_arguments_and_stores_only_what_the_cache_can_give() -> None:
    with HFStateCache(tiny_model("qwen3_next"), page_size=PAGE, state_slots=32) as cache:
        ids = hf.tokens(70, 3 * PAGE)
        past, _ = cache.restore(ids)
        hf.run_pages(cache, past, ids, 0)  # no commits: the cache is at 3 pages
        with pytest.raises(ValueError, match="multiple of page_size 16"):
            cache.commit(ids, PAGE + 1, past)
        with pytest.raises(ValueError, match="holds 48 tokens; cannot commit 64"):
            cache.commit(torch.cat([ids, ids[: 2 * PAGE]]), 4 * PAGE, past)
        with pytest.raises(ValueError, match=r"not the tokens past_key_values holds .* position 17"):
            cache.commit(torch.cat([ids[:17], ids[17:] + 1]), PAGE, past)
        with pytest.raises(ValueError, match="batch of 2"):
            cache.commit(torch.stack([ids, ids]), PAGE, past)
        # issue 25 item 9: floats and bools were truncated into token ids
        for wrong in (ids.to(torch.float32) + 0.5, ids > 100):
            with pytest.raises(TypeError, match="input_ids must hold integer token ids"):
                cache.restore(wrong)
        with pytest.raises(ValueError, match="token"):
            cache.restore(torch.full((2 * PAGE,), 2**33))
        with pytest.raises(TypeError, match="DynamicCache"):
            cache.commit(ids, PAGE, object())
        assert cache.commit(ids, PAGE, past) == 0, "no state at page 1: the cache moved past it"
        assert cache.commit(ids, 3 * PAGE, past) == 3 * PAGE
        assert cache.commit(ids, PAGE, past) == 0, "still no state at page 1"
        assert cache.restore(torch.cat([ids, ids[:1]]))[1] == 3 * PAGE
    with HFStateCache(tiny_model("llama"), page_size=PAGE) as cache:  # attention: any page
        ids = hf.tokens(71, 3 * PAGE + 4)
        past, _ = cache.restore(ids)
        hf.run_pages(cache, past, ids, 0)
        assert cache.commit(ids, PAGE, past) == PAGE
        assert cache.commit(ids, len(ids), past) == 3 * PAGE  # the end: its whole pages
        longer = torch.cat([ids, hf.tokens(72, PAGE)])
        assert cache.commit(longer, len(longer), past) == 3 * PAGE  # the end: what the cache holds
        embedded = cache.new_cache()
        with torch.no_grad():
            cache.model(
                inputs_embeds=cache.model.get_input_embeddings()(ids[None, :PAGE]), past_key_values=embedded
            )
        with pytest.raises(ValueError, match="inputs_embeds"):
            cache.commit(ids, PAGE, embedded)


def test_generate_runs_on_a_restored_cache_and_its_output_can_be_committed() -> None:
    model = tiny_model("llama").to(hf.DEVICE)
    prompt = hf.tokens(73, 2 * PAGE + 3).unsqueeze(0).to(hf.DEVICE)
    settings = {"max_new_tokens": PAGE, "do_sample": False}
    with torch.no_grad():
        plain = model.generate(prompt, **settings)
    with HFStateCache(model, page_size=PAGE) as cache:
        past, _ = cache.restore(prompt)
        with torch.no_grad():
            first = model.generate(prompt, past_key_values=past, **settings)
        assert torch.equal(first, plain)
        held = first.shape[-1] - 1  # generate does not run its last token
        assert cache.commit(first, first.shape[-1], past) == held // PAGE * PAGE
        again, cached = cache.restore(first)
        assert cached == held // PAGE * PAGE
        with torch.no_grad():
            more = model.generate(first, past_key_values=again, **settings)
            want = model.generate(first, **settings)
        assert torch.equal(more, want)


def test_constructor_errors_and_namespaces() -> None:
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="unknown keyword 'pagesize'"):
        HFStateCache(model, pagesize=16)
    with pytest.raises(ValueError, match=r"model\.pools"):
        HFStateCache(model, {"model": {"pools": {"kv": {"type": "kv"}}}})
    with pytest.raises(ValueError, match=r"^name must be a non-empty string"):
        HFStateCache(model, name="")
    assert not model._forward_pre_hooks and not model._forward_hooks  # nothing left half made
    names = set()
    for built in (
        model,
        tiny_model("llama"),
        tiny_model("llama", seed=1),
        tiny_model("llama", num_hidden_layers=3),
    ):
        with HFStateCache(built, page_size=PAGE) as cache:
            names.add(cache.namespace)
    assert len(names) == 3, "same config and seed share; other weights or configs never do"
    with HFStateCache(model, page_size=PAGE, name="my llama", cache_salt="tenant-a") as cache:
        assert cache.namespace.startswith("my-llama-") and cache.cache.config.model.cache_salt == "tenant-a"


def test_another_model_never_reads_the_first_ones_objects(tmp_path: Path) -> None:
    ids = hf.tokens(80, 4 * PAGE + 1)
    with hf.open_cache(tiny_model("llama"), tmp_path) as cache:
        hf.run_pages(cache, cache.restore(ids)[0], ids, 0, commit_every=1)
    with hf.open_cache(tiny_model("llama", seed=1), tmp_path) as other:
        assert other.restore(ids)[1] == 0
    with hf.open_cache(tiny_model("llama"), tmp_path) as same:
        assert same.restore(ids)[1] == 4 * PAGE
        assert same.last_restore.pages["storage"] == 4


def test_prefill_restores_runs_page_aligned_chunks_and_commits() -> None:
    with HFStateCache(tiny_model("mamba2").to(hf.DEVICE), page_size=PAGE, state_slots=32) as cache:
        ids = hf.tokens(90, 5 * PAGE + 3)
        first = cache.prefill(ids, chunk_pages=2)
        assert (first.cached_tokens, first.committed_tokens) == (0, 4 * PAGE)  # 2, 4; 5 is no boundary
        again = cache.prefill(ids, chunk_pages=2)
        assert again.cached_tokens == 4 * PAGE
        assert torch.equal(again.logits, first.logits)


def test_a_cache_passed_under_the_keyword_the_model_ignores_is_refused() -> None:
    """Mamba2 reads its cache from ``cache_params`` and swallows ``past_key_values``: a forward
    given the adapter's cache under the wrong keyword runs without it, and committing that cache
    would store a state that never saw those tokens (a wrong checkpoint for every later restore,
    in any process). The forward is refused with the keyword to use; the right one works."""
    with HFStateCache(tiny_model("mamba2"), page_size=PAGE, state_slots=8) as cache:
        assert cache.layout.cache_argument == "cache_params"
        ids = hf.tokens(91, 2 * PAGE + 1)
        past, _ = cache.restore(ids)
        with torch.no_grad():
            cache.model(input_ids=ids[None, :PAGE], cache_params=past, use_cache=True)
            assert cache.commit(ids, PAGE, past) == PAGE
            with pytest.raises(TypeError, match=r"reads its cache from cache_params=, not past_key_values="):
                cache.model(input_ids=ids[None, PAGE : 2 * PAGE], past_key_values=past, use_cache=True)
            cache.model(input_ids=ids[None, PAGE : 2 * PAGE], cache_params=past, use_cache=True)
        assert cache.commit(ids, 2 * PAGE, past) == 2 * PAGE


# --- the README example and the demo ------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def test_the_readme_hf_example_runs_as_printed(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    marker = "<!-- hf-example -->"
    block = re.search(r"```python\n(.*?)```", readme[readme.index(marker) :], re.S)
    assert block is not None
    script = tmp_path / "example.py"
    script.write_text(block.group(1))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-2:] == ["96 {'device': 0, 'host': 0, 'storage': 6}", "True"], done.stdout


def test_the_demo_reuses_the_shared_prefix_from_l3_in_its_second_process() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "examples/hf_generate.py"), "--family", "lfm2", "--prefix-tokens", "256"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = done.stdout.strip().splitlines()
    assert "reused 0 tokens" in first and "reused 256 tokens (from: storage 256)" in second, done.stdout
    assert "ms saved" not in first and "nothing reused" in first  # issue 27: no "saved" for 0 tokens
    assert "ms saved" in second
    assert first.split("pid ")[1].split("]")[0] != second.split("pid ")[1].split("]")[0]
    assert first.endswith("same as without kvstrata: True") and second.endswith(
        "same as without kvstrata: True"
    )


# --- the key is complete by construction (issue 25 items 2, 3 and 12) -------------------------------


def _one_row_changed(model: Any) -> Any:
    """A copy with one embedding row changed (a retrained token)."""
    import copy

    other = copy.deepcopy(model)
    with torch.no_grad():
        other.get_input_embeddings().weight[7] += 1e-3
    return other


def _one_element_changed(model: Any) -> Any:
    """A copy with one element of the last layer's last weight changed (a partial fine-tune)."""
    import copy

    other = copy.deepcopy(model)
    tensor = list(other.parameters())[-1]
    with torch.no_grad():
        tensor.view(-1)[-1] += 1e-3
    return other


def _loaded_elsewhere(model: Any) -> Any:
    """An equal model loaded from another directory (``from_pretrained`` records the path in
    ``config._name_or_path``): the bytes are the same, so are the objects."""
    other = tiny_model("llama")
    other.config._name_or_path = "/mnt/shared/llama"
    return other


#: One field changed at a time: (model maker, keywords) and whether the reader must hit.
HF_FIELDS: dict[str, tuple[Any, dict[str, Any], bool]] = {
    "one embedding row": (_one_row_changed, {}, False),
    "one element of the last weight": (_one_element_changed, {}, False),
    "dtype": (lambda m: tiny_model("llama", torch.bfloat16), {}, False),
    "config (layers)": (lambda m: tiny_model("llama", num_hidden_layers=3), {}, False),
    "layout (kv heads)": (lambda m: tiny_model("llama", num_key_value_heads=1), {}, False),
    "page size": (lambda m: m, {"page_size": PAGE // 2}, False),
    "tenant salt": (lambda m: m, {"cache_salt": "tenant-b"}, False),
    "weights digest given by the caller": (lambda m: m, {"weights_digest": "release-2"}, False),
    "a restart (a new cache over the same model)": (lambda m: m, {}, True),
    "an equal copy of the model": (lambda m: tiny_model("llama"), {}, True),
    "the directory the weights were loaded from": (_loaded_elsewhere, {}, True),
}


@pytest.mark.parametrize("field", list(HF_FIELDS))
def test_each_identity_field_alone_decides_whether_objects_are_shared(tmp_path: Path, field: str) -> None:
    """Issue 25 items 2 and 12: a llama stores 4 pages; a cache differing in ``field`` only
    restores none of them where that changes the bytes, all of them where it must not. (A new
    process: test_a_new_process_restores_from_l3_and_continues_bit_identically.)"""
    make, keywords, shared = HF_FIELDS[field]
    base = tiny_model("llama")
    ids = hf.tokens(81, 4 * PAGE + 1)
    with hf.open_cache(base, tmp_path) as cache:
        hf.run_pages(cache, cache.restore(ids)[0], ids, 0, commit_every=1)
    other = make(base)
    settings = {"page_size": PAGE, "state_slots": 96, **keywords}
    with HFStateCache(other, hf.storage(tmp_path), **settings) as reader:
        want = hf.reference(reader, ids)
        cached, continued = hf.continue_from_restore(reader, ids)
        assert cached == (4 * PAGE if shared else 0), field
        assert hf.matches(want, cached, continued)  # what came back is what the model computes


def test_an_explicit_weights_digest_replaces_hashing_and_is_the_callers_word(tmp_path: Path) -> None:
    """The documented limit: with ``weights_digest=`` the adapter hashes nothing and trusts it."""
    ids = hf.tokens(82, 2 * PAGE + 1)
    first = tiny_model("llama")
    with HFStateCache(first, hf.storage(tmp_path), page_size=PAGE, weights_digest="v1") as cache:
        assert cache.identity.weights == "v1"
        hf.run_pages(cache, cache.restore(ids)[0], ids, 0, commit_every=1)
    retrained = _one_row_changed(first)
    with HFStateCache(retrained, hf.storage(tmp_path), page_size=PAGE, weights_digest="v1") as cache:
        assert cache.restore(ids)[1] == 2 * PAGE  # the caller vouched: same digest, same namespace
    with pytest.raises(ValueError, match="weights_digest"):
        HFStateCache(first, page_size=PAGE, weights_digest="")


def test_commit_refuses_a_cache_another_hfstatecache_handed_out(tmp_path: Path) -> None:
    """Issue 25 item 3: B committed A's cache (it knew the owner and still trusted it)."""
    model = tiny_model("llama")
    ids = hf.tokens(83, 2 * PAGE + 1)
    with hf.open_cache(model, tmp_path / "a") as a, hf.open_cache(model, tmp_path / "b") as b:
        past = a.new_cache()
        hf.run_pages(a, past, ids[: 2 * PAGE], 0)
        with pytest.raises(ValueError, match="another HFStateCache"):
            b.commit(ids, 2 * PAGE, past)
        assert b.restore(ids)[1] == 0  # nothing stored
        assert a.commit(ids, 2 * PAGE, past) == 2 * PAGE  # its owner still commits it
        assert a.restore(ids)[1] == 2 * PAGE


# --- state another run or another model made is never stored under these ids (audit 26) --------


@pytest.mark.parametrize(
    "extra",
    [
        lambda ids: {"attention_mask": (ids > 100).long()[None]},  # padding masked out
        lambda ids: {"position_ids": torch.arange(100, 100 + len(ids))[None]},  # shifted positions
    ],
    ids=["padding", "positions"],
)
def test_a_forward_with_masked_or_shifted_tokens_is_not_committed(extra: Any) -> None:
    # its state is not the state of the bare ids: stored under them, every later restore of the
    # same ids continued from it (max |dlogit| 0.85)
    model = tiny_model("llama")
    ids = hf.tokens(95, 2 * PAGE)
    with HFStateCache(model, page_size=PAGE) as cache:
        past, _ = cache.restore(ids)
        with torch.no_grad():
            model(input_ids=ids[None], past_key_values=past, use_cache=True, **extra(ids))
        with pytest.raises(ValueError, match="cannot commit this cache: a forward ran with"):
            cache.commit(ids, 2 * PAGE, past)
        plain, _ = cache.restore(ids)
        with torch.no_grad():  # an all-ones mask and continuing positions are the plain run
            model(
                input_ids=ids[None],
                past_key_values=plain,
                use_cache=True,
                attention_mask=torch.ones(1, 2 * PAGE),
            )
        assert cache.commit(ids, 2 * PAGE, plain) == 2 * PAGE
        assert cache.cache.open_leases == 0


def test_a_plain_dynamic_cache_is_committed_only_when_vouched_for() -> None:
    # a plain cache says neither its tokens nor its model: a batch of 2 (row 0 stored under the
    # ids of row 1), another prompt's or another model's cache were all accepted
    model = tiny_model("llama")
    a, b = hf.tokens(96, 2 * PAGE), hf.tokens(97, 2 * PAGE)
    with HFStateCache(model, page_size=PAGE) as cache, torch.no_grad():
        batch = transformers.DynamicCache(config=model.config)
        model(input_ids=torch.stack([a, b]), past_key_values=batch, use_cache=True)
        with pytest.raises(TypeError, match="trust_cache=True"):
            cache.commit(b, 2 * PAGE, batch)
        with pytest.raises(ValueError, match="a batch of 2"):
            cache.commit(b, 2 * PAGE, batch, trust_cache=True)
        single = transformers.DynamicCache(config=model.config)
        model(input_ids=b[None], past_key_values=single, use_cache=True)
        assert cache.commit(b, 2 * PAGE, single, trust_cache=True) == 2 * PAGE
        assert cache.cache.open_leases == 0


def test_weights_changed_in_place_are_refused_and_unsaved_buffers_are_in_the_namespace() -> None:
    model = tiny_model("llama")
    with HFStateCache(model, page_size=PAGE) as cache:
        first = cache.namespace
        with torch.no_grad():
            model.load_state_dict(tiny_model("llama", seed=1).state_dict())
        with pytest.raises(RuntimeError, match="weights changed"):
            cache.restore(hf.tokens(98, 2 * PAGE))
    rotary = tiny_model("llama")
    with torch.no_grad():
        for name, buffer in rotary.named_buffers():
            if name.endswith("inv_freq"):
                buffer.mul_(0.5)  # not in state_dict(): a patched RoPE
    with (
        HFStateCache(tiny_model("llama"), page_size=PAGE) as same,
        HFStateCache(rotary, page_size=PAGE) as patched,
    ):
        assert same.namespace == first and patched.namespace != first


def test_a_weight_replaced_by_another_parameter_or_an_added_one_is_refused() -> None:
    """A weight assigned anew (``layer.weight = Parameter(...)``) leaves the hashed one untouched
    (same version, same address), and a LoRA-style layer adds parameters: either way the model
    computes other KV than the namespace says, and the old KV was served to it."""
    ids = hf.tokens(95, 2 * PAGE + 1)
    model = tiny_model("llama")
    with HFStateCache(model, page_size=PAGE) as cache, torch.no_grad():
        cache.prefill(ids[: 2 * PAGE])
        attention = model.model.layers[0].self_attn
        attention.k_proj.weight = torch.nn.Parameter(attention.k_proj.weight * 1.5)
        with pytest.raises(RuntimeError, match="weights changed"):
            cache.restore(ids)
        assert cache.cache.open_leases == 0
    model = tiny_model("llama")
    with HFStateCache(model, page_size=PAGE) as cache, torch.no_grad():
        cache.prefill(ids[: 2 * PAGE])
        model.model.layers[0].self_attn.lora_k = torch.nn.Linear(4, 4)
        with pytest.raises(RuntimeError, match="weights changed"):
            cache.commit(ids, 2 * PAGE, cache.new_cache())


def test_an_attention_implementation_or_config_changed_after_start_is_refused() -> None:
    """The namespace hashed the config and the attention implementation: switched afterwards,
    the cache served KV the new attention did not compute (the weights were checked, not these)."""
    model = tiny_model("llama")
    ids = hf.tokens(97, 2 * PAGE + 1)
    with HFStateCache(model, page_size=PAGE) as cache, torch.no_grad():
        cache.prefill(ids[: 2 * PAGE])
        assert cache.restore(ids)[1] == 2 * PAGE  # a forward and a commit change nothing
        model.set_attn_implementation("eager")
        with pytest.raises(RuntimeError, match="attention implementation changed"):
            cache.restore(ids)
        model.set_attn_implementation("sdpa")
        assert cache.restore(ids)[1] == 2 * PAGE
        model.config.rope_theta = 1.0 + getattr(model.config, "rope_theta", 10_000.0)
        with pytest.raises(RuntimeError, match="config or attention"):
            cache.commit(ids, 2 * PAGE, cache.new_cache())


def test_a_state_cache_advanced_through_the_models_base_directly_is_never_committed() -> None:
    """Mamba2: page 1 through the model (hooked), page 2 through ``model.backbone``: the state
    is at 32 tokens, the record at 16; a pure state model's cache says no length of its own, so
    the state after 32 was stored as the checkpoint after 16 (an attention model's was refused
    by its length)."""
    model = tiny_model("mamba2")
    ids = hf.tokens(96, 2 * PAGE + 1)
    with HFStateCache(model, page_size=PAGE, state_slots=8) as cache, torch.no_grad():
        past = cache.new_cache()
        model(input_ids=ids[None, :PAGE], cache_params=past, use_cache=True)
        model.backbone(input_ids=ids[None, PAGE : 2 * PAGE], cache_params=past, use_cache=True)
        with pytest.raises(ValueError, match=r"ran through Mamba2ForCausalLM\.backbone directly"):
            cache.commit(ids, PAGE, past)
        assert cache.cache.open_leases == 0
        assert cache.restore(ids[: PAGE + 1])[1] == 0  # nothing stored
        fine = cache.new_cache()  # the model's own forward runs its base: not flagged
        model(input_ids=ids[None, :PAGE], cache_params=fine, use_cache=True)
        assert cache.commit(ids, PAGE, fine) == PAGE


def test_beam_search_on_a_restored_cache_is_refused_clearly_and_bad_arguments_named() -> None:
    model = tiny_model("llama")
    prompt = hf.tokens(99, 2 * PAGE + 3)
    with HFStateCache(model, page_size=PAGE) as cache:
        assert cache.prefill(prompt).committed_tokens == 2 * PAGE
        past, cached = cache.restore(prompt)
        assert cached == 2 * PAGE
        with pytest.raises(ValueError, match="serve one sequence"), torch.no_grad():
            model.generate(prompt[None], past_key_values=past, num_beams=2, max_new_tokens=2, do_sample=False)
        with pytest.raises(ValueError, match="at least one token"):
            cache.prefill([])
        assert cache.restore([])[1] == 0
        with pytest.raises(TypeError, match="upto must be an int"):
            cache.commit(prompt, 32.0, past)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="chunk_pages must be an int"):
            cache.prefill(prompt, chunk_pages=1.5)  # type: ignore[arg-type]
        assert cache.cache.open_leases == 0


def test_a_cache_whose_forward_raised_is_never_committed(tmp_path: Path) -> None:
    """A forward that raises (an out-of-memory, an interrupt) after the adapter counted its
    tokens: a pure-state model's cache still holds the state before them (or part of the
    forward, layer by layer), so committing it as the state after them is refused and a later
    restore serves no state that is not its tokens'."""
    hf.quiet()
    _, model = hf.model_of("mamba2")
    with hf.open_cache(model, tmp_path / "l3") as cache:
        arg = cache.layout.cache_argument
        ids = hf.tokens(7, 3 * hf.PAGE)
        past = cache.new_cache()

        def out_of_memory(*_: object) -> None:
            raise RuntimeError("CUDA out of memory (simulated)")

        with torch.no_grad():
            model(input_ids=ids[:16].unsqueeze(0), use_cache=True, **{arg: past})
            hook = model.backbone.layers[0].register_forward_pre_hook(out_of_memory)
            with pytest.raises(RuntimeError, match="out of memory"):
                model(input_ids=ids[16:32].unsqueeze(0), use_cache=True, **{arg: past})
            hook.remove()
        with pytest.raises(ValueError, match="a forward on it raised"):
            cache.commit(ids, 32, past)
        with torch.no_grad():  # a later forward on it does not make it trusted again
            model(input_ids=ids[32:33].unsqueeze(0), use_cache=True, **{arg: past})
        with pytest.raises(ValueError, match="a forward on it raised"):
            cache.commit(ids, 32, past)
        _, cached = cache.restore(ids[:33])
        assert cached == 0
        fresh = cache.new_cache()  # a cache whose forwards returned commits as before
        with torch.no_grad():
            model(input_ids=ids[:32].unsqueeze(0), use_cache=True, **{arg: fresh})
        assert cache.commit(ids, 32, fresh) == 32


def test_crop_zero_removes_no_token_from_the_record(tmp_path: Path) -> None:
    """transformers 5's ``crop(n)`` removes ``-n`` tokens, so ``crop(0)`` (``generate`` calls it
    at every step's stop check) removes none: the record of the cache's token ids stays whole
    and the cache can still be committed; ``crop(-8)`` cuts 8 from both."""
    hf.quiet()
    _, model = hf.model_of("llama")
    with hf.open_cache(model, tmp_path / "l3") as cache:
        ids = hf.tokens(7, 3 * hf.PAGE)
        past = cache.new_cache()
        with torch.no_grad():
            model(input_ids=ids[:40].unsqueeze(0), use_cache=True, past_key_values=past)
        past.crop(0)
        assert past.get_seq_length() == 40 and len(past.kvstrata_tokens) == 40
        past.crop(-8)
        assert past.get_seq_length() == 32 and len(past.kvstrata_tokens) == 32
        assert cache.commit(ids, 32, past) == 32


def test_integer_arguments_of_any_integer_type_are_taken_and_bools_refused() -> None:
    """``commit(upto=np.int64(32))`` (a length computed with NumPy, or read from a tensor) was
    refused as "upto must be an int", ``chunk_pages`` alike; ``True`` stays refused."""
    import numpy as np

    model = tiny_model("llama")
    prompt = hf.tokens(98, 2 * PAGE + 3)
    with HFStateCache(model, page_size=PAGE) as cache:
        assert cache.prefill(prompt, chunk_pages=np.int64(1)).committed_tokens == 2 * PAGE
        past, cached = cache.restore(prompt)
        assert cached == 2 * PAGE
        assert cache.commit(prompt, np.int64(PAGE), past) == PAGE
        assert cache.commit(prompt, torch.tensor(2 * PAGE), past) == 2 * PAGE
        with pytest.raises(TypeError, match="upto must be an int"):
            cache.commit(prompt, True, past)
        with pytest.raises(ValueError, match="chunk_pages must be an int"):
            cache.prefill(prompt, chunk_pages=True)
        assert cache.cache.open_leases == 0
