"""vLLM's KV cache groups as kvstrata pools, the connector's namespace and its block keys.

Both connector roles (scheduler and worker, usually two processes) build the same
:class:`StoreLayout` from ``vllm_config`` and ``kv_cache_config`` alone, so they agree on every
pool name and key without talking. Imports nothing from vLLM: groups are read by attribute, so
the layout logic is testable without an engine.

One pool per prefix-cacheable KV cache group; one stored object per (group, block) holding the
bytes of that block in every layer of the group, in the group's layer order:

=========================  ==========  ===========================================================
vLLM spec                  kind        a prefix of ``n`` blocks needs
=========================  ==========  ===========================================================
FullAttention, MLA, ...    ``full``    blocks ``0 .. n-1`` (the first such group is the anchor)
SlidingWindow(+MLA)        ``window``  the last ``cdiv(window - 1, block_size)`` blocks before n
Mamba (GDN, Mamba2 ...)    ``state``   the state checkpoint after block ``n-1`` (align mode)
=========================  ==========  ===========================================================
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from kvstrata.adapters._shared import EngineIdentity
from kvstrata.engine_kit import ParallelConfig, layout_fingerprint, stored_objects
from kvstrata.plugins import (
    BufferSpec,
    Granularity,
    HitRule,
    HitRuleKind,
    ObjectSpec,
    PartialHit,
    PoolRole,
    PoolSpec,
    Replication,
)

log = logging.getLogger(__name__)

#: kvstrata pool type of vLLM blocks (opaque bytes; backends storing every type take them).
POOL_TYPE = "vllm_block"
FULL, WINDOW, STATE = "full", "window", "state"
_WEIGHT_CHUNK = 16 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
#: config fields that say where and with which library a checkpoint was written, not what it
#: computes: left out of the config digest, so two hosts (other paths) share entries
_CONFIG_PROVENANCE = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})


@dataclass(frozen=True)
class GroupLayout:
    """One prefix-cacheable KV cache group as a kvstrata pool."""

    group_id: int
    kind: str  # FULL, WINDOW or STATE
    layer_names: tuple[str, ...]
    block_size: int
    layer_bytes: int  # bytes of one block of one layer (unpadded)
    window_blocks: int  # WINDOW: blocks a prefix needs before its end; else 0
    spec: PoolSpec

    @property
    def pool(self) -> str:
        return self.spec.name

    def needed_blocks(self, n: int) -> range:
        """Block indices a prefix of ``n`` blocks needs from this group."""
        if self.kind == FULL:
            return range(n)
        if self.kind == WINDOW:
            return range(max(0, n - self.window_blocks), n)
        return range(n - 1, n)


@dataclass(frozen=True)
class StoreLayout:
    """Every group of a model, anchor first; ``block_size`` is vLLM's (hash) block size."""

    groups: tuple[GroupLayout, ...]
    block_size: int
    facts: dict[str, Any]
    #: vLLM's ``kv_cache_config.num_blocks``: tells a ``(2, num_blocks, ...)`` K/V-split paged
    #: tensor from a block-first one (not a namespace fact: it follows the device's free memory)
    num_blocks: int | None = None

    @property
    def anchor(self) -> GroupLayout:
        return self.groups[0]

    def save_order(self) -> list[GroupLayout]:
        """Components first, the anchor last: the anchor object commits a block."""
        return [*self.groups[1:], self.groups[0]]


def _kind(spec: Any) -> str:
    names = {cls.__name__ for cls in type(spec).__mro__}
    if "MambaSpec" in names:
        return STATE
    if "SlidingWindowSpec" in names or "SlidingWindowMLASpec" in names:
        return WINDOW
    if "FullAttentionSpec" in names and "CrossAttentionSpec" not in names:
        return FULL
    raise ValueError(
        f"kvstrata's vLLM connector cannot restore KV cache groups of type {type(spec).__name__} "
        "(supported: full attention, MLA, sliding window, Mamba/GDN state)"
    )


def _spec_facts(spec: Any) -> dict[str, Any]:
    """The fields of a vLLM KV cache spec that shape its bytes (JSON-safe)."""
    out: dict[str, Any] = {"class": type(spec).__name__}
    for field in (
        "block_size",
        "num_kv_heads",
        "head_size",
        "head_size_v",
        "dtype",
        "sliding_window",
        "shapes",
        "dtypes",
        "mamba_type",
        "mamba_cache_mode",
        "num_speculative_blocks",
        "cache_dtype_str",
        "kv_quant_mode",
    ):
        if hasattr(spec, field):
            out[field] = str(getattr(spec, field))
    out["real_page_size_bytes"] = int(spec.real_page_size_bytes)
    return out


def _pool_spec(name: str, kind: str, role: PoolRole, layers: int, layer_bytes: int, page: int) -> PoolSpec:
    return PoolSpec(
        name=name,
        pool_type=POOL_TYPE,
        role=role,
        granularity=Granularity.NODE_STATE if kind == STATE else Granularity.TOKEN_PAGES,
        hit_rule=HitRule(kind=HitRuleKind.PREFIX_END_STATE)
        if kind == STATE
        else HitRule(kind=HitRuleKind.ALL_PAGES),
        partial_hit=PartialHit.CLAMP,
        replication=Replication.SHARDED,
        page_size=page,
        buffers=(BufferSpec(name="block", dtype="uint8", layers=layers, unit_shape=(layer_bytes,)),),
        objects=(ObjectSpec(suffix="blk", buffers=("block",)),),
    )


def describe_groups(kv_cache_config: Any, group_ids: Sequence[int] | None = None) -> list[GroupLayout]:
    """Pools of the prefix-cacheable groups (``kv_cache_config.prefix_cacheable_group_ids``),
    ordered: the first full-attention group (the anchor), then the others by group id."""
    ids = list(group_ids if group_ids is not None else kv_cache_config.prefix_cacheable_group_ids)
    if not ids:
        raise ValueError("the model has no prefix-cacheable KV cache group: nothing to restore")
    raw = []
    for gid in ids:
        group = kv_cache_config.kv_cache_groups[gid]
        spec = group.kv_cache_spec
        kind = _kind(spec)
        bs = int(spec.block_size)
        window = 0
        if kind == WINDOW:
            window = max(1, math.ceil((int(spec.sliding_window) - 1) / bs))
        raw.append((gid, kind, tuple(group.layer_names), bs, int(spec.real_page_size_bytes), window, spec))
    sizes = {entry[3] for entry in raw}
    if len(sizes) != 1:
        raise ValueError(f"KV cache groups with different block sizes {sorted(sizes)} are not supported")
    raw.sort(key=lambda entry: (entry[1] != FULL, entry[0]))
    groups = []
    for position, (gid, kind, layers, bs, nbytes, window, spec) in enumerate(raw):
        role = PoolRole.ANCHOR if position == 0 else PoolRole.COMPONENT
        draft = _pool_spec("x", kind, role, len(layers), nbytes, bs)
        prints = [layout_fingerprint(draft, suffix).hex() for suffix, _ in stored_objects(draft)]
        identity = json.dumps([_spec_facts(spec), list(layers), prints], sort_keys=True)
        name = f"g{gid}-{kind}-{hashlib.blake2b(identity.encode(), digest_size=5).hexdigest()}"
        groups.append(
            GroupLayout(
                gid, kind, layers, bs, nbytes, window, _pool_spec(name, kind, role, len(layers), nbytes, bs)
            )
        )
    return groups


def hub_snapshot(model_id: str, revision: str | None, cache_dir: str | None) -> Path | None:
    """The local snapshot folder of hub model ``model_id`` at ``revision`` (default: its main
    branch), where vLLM downloaded it (Hugging Face's cache, or vLLM's ``download_dir``), or
    None: huggingface_hub absent, not a hub id, not downloaded there."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        found = snapshot_download(model_id, revision=revision, cache_dir=cache_dir, local_files_only=True)
    except (OSError, ValueError):  # not cached (LocalEntryNotFoundError), not a repo id
        return None
    return Path(found)


def weights_digest(model_path: str, revision: str | None = None, cache_dir: str | None = None) -> str | None:
    """xxh3-128 of every weight file (name and all bytes) of a local model directory; for a hub
    id, the commit of the snapshot vLLM downloaded (a snapshot's files never change, a branch
    name's do: it says nothing of the weights it held then); None where neither is found."""
    root = Path(model_path)
    if not root.is_dir():
        snapshot = hub_snapshot(model_path, revision, cache_dir)
        return f"hub-commit:{snapshot.name}" if snapshot is not None else None
    hasher = xxhash.xxh3_128()
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    for path in files:
        hasher.update(f"{path.relative_to(root)}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as handle:
            while chunk := handle.read(_WEIGHT_CHUNK):
                hasher.update(chunk)
    return hasher.hexdigest()


def config_digest(model_config: Any) -> str | None:
    """BLAKE2b of the model's effective Hugging Face config -- vLLM's ``hf_config``, after
    ``hf_overrides`` -- or None when there is none. The same weights under another config (a
    ``rope_theta``, ``rms_norm_eps``, rope scaling, a sliding window) compute other K/V: the
    weights digest alone let such an engine load the first config's blocks."""
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is None:
        return None
    to_dict = getattr(hf_config, "to_dict", None)
    fields = to_dict() if callable(to_dict) else dict(vars(hf_config))
    text = json.dumps(_without_provenance(fields), sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _without_provenance(value: Any) -> Any:
    """``value`` with every :data:`_CONFIG_PROVENANCE` field dropped, at any depth (a
    multimodal config nests a config per tower)."""
    if isinstance(value, dict):
        return {k: _without_provenance(v) for k, v in value.items() if k not in _CONFIG_PROVENANCE}
    if isinstance(value, list | tuple):
        return [_without_provenance(v) for v in value]
    return value


def build_layout(
    vllm_config: Any, kv_cache_config: Any, *, model_name: str | None, weights: str | None
) -> StoreLayout:
    """Groups plus the namespace facts (model, weights, config, quantization, dtype, groups,
    block size, parallel sizes)."""
    groups = describe_groups(kv_cache_config)
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    if pcp > 1:  # its ranks hold other token slices of a block under one TP rank (one key)
        raise ValueError(
            f"kvstrata's vLLM connector does not support prefill context parallel "
            f"(prefill_context_parallel_size={pcp}): its ranks of one TP rank would write different "
            "slices of a block under one key; run with prefill_context_parallel_size=1"
        )
    model_path = str(model_config.model)
    revision = getattr(model_config, "revision", None)
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    digest = weights if weights is not None else weights_digest(model_path, revision, download_dir)
    if digest is None:
        log.warning(
            "kvstrata: the weights of model %r were found neither in a local directory nor in the "
            "Hugging Face cache; its stored KV is keyed by the name and revision %r only: pin a "
            "commit as the revision, or set the connector's model.weights, or an engine on other "
            "weights under that name is served this one's KV",
            model_path,
            revision,
        )
    facts = {
        "engine": "vllm",
        # a local directory is named by its weights digest, not its path: two hosts share entries
        "model": model_name or (Path(model_path).name if Path(model_path).is_dir() else model_path),
        "revision": str(getattr(model_config, "revision", None)),
        "weights": digest,
        "config": config_digest(model_config),
        # quantization applied at load time changes the K/V without touching the weight files
        "quantization": str(getattr(model_config, "quantization", None)),
        "dtype": str(model_config.dtype),
        "cache_dtype": str(getattr(vllm_config.cache_config, "cache_dtype", None)),
        "kv_cache_layout": str(getattr(kv_cache_config, "kv_cache_layout", None)),
        # attention backends of different devices lay a block's bytes out differently
        "device_type": str(getattr(getattr(vllm_config, "device_config", None), "device_type", None)),
        "block_size": groups[0].block_size,
        "groups": [[g.group_id, g.kind, list(g.layer_names), g.pool] for g in groups],
        "tp_size": int(parallel.tensor_parallel_size),
        "pp_size": int(parallel.pipeline_parallel_size),
        "dcp_size": int(getattr(parallel, "decode_context_parallel_size", 1) or 1),
    }
    num_blocks = getattr(kv_cache_config, "num_blocks", None)
    return StoreLayout(
        tuple(groups), groups[0].block_size, facts, int(num_blocks) if num_blocks is not None else None
    )


def identity_of(layout: StoreLayout, parallel: ParallelConfig) -> EngineIdentity:
    """The engine identity of the shared adapter layer: its namespace covers every fact of
    ``layout.facts`` (model, weights, config, dtypes, groups, block size, parallel sizes); the TP rank
    goes to each key's shard component."""
    facts = dict(layout.facts)
    return EngineIdentity(
        engine="vllm",
        model=str(facts.pop("model")),
        weights=facts.pop("weights"),
        dtypes=(str(facts.pop("dtype")), str(facts.pop("cache_dtype"))),
        layout=facts,
        page_size=layout.block_size,
        parallel=parallel,
        cache_salt="",  # per request: the chain root carries each request's cache_salt
    )
