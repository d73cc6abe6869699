"""The vLLM connector's layout and namespace, without an engine: which facts separate keys.

vLLM's config objects are stood in for by plain namespaces carrying the fields the layout reads
(the spec classes are matched by name, as vLLM's are); tests/test_adapter_vllm.py runs the same
code inside real engines. Each namespace fact is changed alone and must change the namespace.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvstrata.adapters._vllm_layout import FULL, STATE, WINDOW, build_layout, describe_groups, identity_of
from kvstrata.core.config import ParallelConfig


class FullAttentionSpec(SimpleNamespace):
    pass


class SlidingWindowSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


class CrossAttentionSpec(FullAttentionSpec):
    pass


def _attention(
    block: int = 16, heads: int = 2, dtype: str = "bfloat16", cls: type = FullAttentionSpec
) -> Any:
    return cls(
        block_size=block,
        num_kv_heads=heads,
        head_size=64,
        dtype=dtype,
        real_page_size_bytes=2 * block * heads * 128,
    )


def _kv_cache_config(*specs: tuple[Any, list[str]]) -> Any:
    groups = [SimpleNamespace(kv_cache_spec=spec, layer_names=names) for spec, names in specs]
    return SimpleNamespace(
        kv_cache_groups=groups, prefix_cacheable_group_ids=tuple(range(len(groups))), kv_cache_layout=None
    )


def _vllm_config(
    model: str, dtype: str = "bfloat16", tp: int = 1, hf_config: Any = None, quantization: str | None = None
) -> Any:
    model_config = SimpleNamespace(model=model, served_model_name=model, revision=None, dtype=dtype)
    model_config.hf_config, model_config.quantization = hf_config, quantization
    return SimpleNamespace(
        model_config=model_config,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )


def _hybrid() -> Any:
    mamba = MambaSpec(
        block_size=16,
        shapes=((3, 512), (2, 128, 128)),
        dtypes=("bfloat16", "float32"),
        mamba_cache_mode="align",
        real_page_size_bytes=134144,
    )
    return _kv_cache_config((mamba, ["layers.0.linear_attn"]), (_attention(), ["layers.3.self_attn"]))


def _namespace(tmp_path: Path, **change: Any) -> str:
    model = tmp_path / change.get("model_dir", "model")
    model.mkdir(parents=True, exist_ok=True)
    (model / "model.safetensors").write_bytes(change.get("weights", b"weights-1"))
    kv = change.get("kv", _kv_cache_config((_attention(change.get("block", 16)), ["layers.0.self_attn"])))
    layout = build_layout(
        _vllm_config(
            str(model),
            change.get("dtype", "bfloat16"),
            change.get("tp", 1),
            change.get("hf_config"),
            change.get("quantization"),
        ),
        kv,
        model_name=None,
        weights=None,
    )
    return identity_of(layout, ParallelConfig()).namespace


def test_the_namespace_is_stable_and_changes_with_every_fact_alone(tmp_path: Path) -> None:
    base = _namespace(tmp_path)
    assert _namespace(tmp_path) == base  # same facts, same namespace (no per-process seed)
    changed = {
        "weights": _namespace(tmp_path, weights=b"weights-2"),
        "dtype": _namespace(tmp_path, dtype="float16"),
        "block size": _namespace(tmp_path, block=32),
        "tp size": _namespace(tmp_path, tp=2),
        "layers": _namespace(tmp_path, kv=_kv_cache_config((_attention(), ["layers.1.self_attn"]))),
        "kv heads": _namespace(tmp_path, kv=_kv_cache_config((_attention(heads=4), ["layers.0.self_attn"]))),
        "kv dtype": _namespace(
            tmp_path, kv=_kv_cache_config((_attention(dtype="fp8"), ["layers.0.self_attn"]))
        ),
    }
    assert all(value != base for value in changed.values()), changed
    assert len(set(changed.values())) == len(changed)


def _llama_config(**fields: Any) -> Any:
    """A real Hugging Face config (what vLLM's ``model_config.hf_config`` is, after
    ``hf_overrides``)."""
    from transformers import LlamaConfig  # the [hf] extra, which the test command installs

    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2)
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def test_the_same_weights_under_another_config_get_another_namespace(tmp_path: Path) -> None:
    """The same weight files with another ``rope_theta`` or ``rms_norm_eps`` (``hf_overrides``,
    or an edited config.json in a directory of the same name) compute other K/V: with the weights
    digest alone, a real engine so configured loaded 13 blocks of the first config's KV and its
    tokens changed (audit 27)."""
    base = _namespace(tmp_path, hf_config=_llama_config())
    rope = dict(_llama_config().rope_parameters, rope_theta=1e6)
    changed = {
        "rope_theta": _namespace(tmp_path, hf_config=_llama_config(rope_parameters=rope)),
        "rms_norm_eps": _namespace(tmp_path, hf_config=_llama_config(rms_norm_eps=0.1)),
        "sliding window": _namespace(tmp_path, hf_config=_llama_config(sliding_window=64)),
        "runtime quantization": _namespace(tmp_path, hf_config=_llama_config(), quantization="fp8"),
    }
    assert all(value != base for value in changed.values()), changed
    assert len(set(changed.values())) == len(changed)
    # where and with which library the checkpoint was written is not what it computes
    moved = _llama_config(_name_or_path="/elsewhere/model", transformers_version="0.0.1")
    assert _namespace(tmp_path, hf_config=moved) == base


def test_a_local_model_is_named_by_its_weights_not_its_path(tmp_path: Path) -> None:
    assert _namespace(tmp_path, model_dir="a/model") == _namespace(tmp_path, model_dir="b/model")


def test_the_cache_salt_changes_the_chain_root_only(tmp_path: Path) -> None:
    layout = build_layout(_vllm_config(str(tmp_path)), _hybrid(), model_name="m", weights="w")
    identity = identity_of(layout, ParallelConfig())
    assert identity.chain_root("tenant-a") != identity.chain_root("tenant-b") != identity.chain_root("")
    assert identity.chain_root("tenant-a") == identity_of(layout, ParallelConfig()).chain_root("tenant-a")


def test_groups_anchor_first_with_their_hit_rules() -> None:
    window = _attention(cls=SlidingWindowSpec)
    window.sliding_window = 40
    groups = describe_groups(
        _kv_cache_config(
            (MambaSpec(block_size=16, shapes=((4,),), dtypes=("float32",), real_page_size_bytes=16), ["m"]),
            (window, ["w"]),
            (_attention(), ["a"]),
        )
    )
    assert [(g.group_id, g.kind) for g in groups] == [(2, FULL), (0, STATE), (1, WINDOW)]
    full, state, win = groups
    assert list(full.needed_blocks(5)) == [0, 1, 2, 3, 4]
    assert list(state.needed_blocks(5)) == [4]  # the state checkpoint at the prefix end
    assert list(win.needed_blocks(5)) == [2, 3, 4]  # cdiv(40 - 1, 16) = 3 blocks of window
    assert len({g.pool for g in groups}) == 3


def test_unsupported_groups_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="CrossAttentionSpec"):
        describe_groups(_kv_cache_config((_attention(cls=CrossAttentionSpec), ["x"])))


def _hub_namespace(cache: Path, model_id: str) -> str:
    """The namespace of an engine serving hub model ``model_id`` (no revision: its main branch)
    that vLLM downloaded into ``cache`` (its ``download_dir``)."""
    config = _vllm_config(model_id)
    config.load_config = SimpleNamespace(download_dir=str(cache))
    kv = _kv_cache_config((_attention(), ["layers.0.self_attn"]))
    return identity_of(build_layout(config, kv, model_name=None, weights=None), ParallelConfig()).namespace


def _push(cache: Path, model_id: str, commit: str, weights: bytes) -> None:
    """Hugging Face's cache after downloading ``model_id``'s main branch at ``commit``."""
    repo = cache / f"models--{model_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(weights)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)


def test_a_hub_model_is_named_by_the_weights_of_its_downloaded_snapshot(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hub id without a revision was keyed by its name and ``revision=None``: new weights pushed
    under the same id were served the old weights' KV. The namespace now covers the commit of the
    snapshot vLLM downloaded (a snapshot's files never change)."""
    cache = tmp_path / "hub"
    _push(cache, "org/tiny", "a" * 40, b"weights-1")
    first = _hub_namespace(cache, "org/tiny")
    assert _hub_namespace(cache, "org/tiny") == first
    _push(cache, "org/tiny", "b" * 40, b"weights-2")  # main moved to new weights
    assert _hub_namespace(cache, "org/tiny") != first
    with caplog.at_level("WARNING", logger="kvstrata"):
        _hub_namespace(cache, "org/never-downloaded")
    assert any(
        "model.weights" in r.getMessage() and "org/never-downloaded" in r.getMessage() for r in caplog.records
    )


def test_prefill_context_parallel_is_refused_by_name(tmp_path: Path) -> None:
    """Prefill context parallel ranks hold other token slices of a block, and a key names only
    the TP rank: two ranks would write one key with different bytes. Refused at start."""
    config = _vllm_config(str(tmp_path))
    config.parallel_config.prefill_context_parallel_size = 2
    with pytest.raises(ValueError, match="prefill_context_parallel_size=2"):
        build_layout(config, _hybrid(), model_name="m", weights="w")
    config.parallel_config.prefill_context_parallel_size = 1
    assert build_layout(config, _hybrid(), model_name="m", weights="w").facts["tp_size"] == 1
