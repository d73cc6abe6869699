"""Which page format each SGLang host pool gets when SGLang registers it with the adapter (the
formats are in ``_sglang_pages``): exact for SGLang's plain MHA and MLA pools and for MHA pools
with K and V apart, opaque flat data pages for every other pool with bytes, markers for a pool
without bytes. A pool's format and identity decide its keys, so this is where two pools are told
apart (layout, class, dtypes, shapes, TP rank)."""

from __future__ import annotations

import math
from typing import Any

import torch

from kvstrata.adapters._sglang_pages import (
    OPAQUE_POOL_TYPE,
    CanonicalPages,
    FlatPages,
    MarkerPages,
    PageFormat,
    SplitKVPages,
    class_id,
    digest,
    dtype_name,
    is_mha,
)
from kvstrata.adapters._sglang_views import (
    MHA_CLASS,
    MHA_PAGE_VIEWS,
    MLA_CLASS,
    MLA_PAGE_VIEWS,
    SPLIT_KV_VIEWS,
)
from kvstrata.engine_kit import layout_fingerprint, stored_objects
from kvstrata.plugins import (
    BufferSpec,
    Granularity,
    HitRule,
    HitRuleKind,
    ModelContext,
    ObjectSpec,
    PartialHit,
    PluginHost,
    PoolRole,
    PoolSpec,
    Replication,
)
from kvstrata.plugins.pool_type import SUPPORTED_DTYPES


def _spec_from_type(
    plugins: PluginHost, pool_type: str, instance: str, page_size: int, **fields: Any
) -> PoolSpec:
    """A pool spec built by the registered pool-type plugin (the same one kvstrata's cache uses)."""
    cls = plugins.pool_types.get(pool_type)
    config = cls.Config.model_validate({"type": pool_type, **fields})
    return cls(instance, config, ModelContext(page_size=page_size, anchor=instance)).spec()


def _exact_spec(
    pool_type: str,
    sglang_name: str,
    page_size: int,
    dtype: str,
    buffers: dict[str, tuple[int, ...]],
    suffix: str,
    replication: Replication,
) -> PoolSpec:
    """Spec of SGLang's token-major page: one object of ``buffers`` (each one (tokens, layers, ...)
    block, so ``layers=1``). Its instance name carries a digest of the layout fingerprint: pools
    of other models (dtype, layers, heads, page size) never share keys."""

    def build(instance: str) -> PoolSpec:
        return PoolSpec(
            name=instance,
            pool_type=pool_type,
            role=PoolRole.ANCHOR,
            granularity=Granularity.TOKEN_PAGES,
            hit_rule=HitRule(kind=HitRuleKind.ALL_PAGES),
            partial_hit=PartialHit.CLAMP,
            replication=replication,
            page_size=page_size,
            buffers=tuple(
                BufferSpec(name=name, dtype=dtype, layers=1, unit_shape=shape)
                for name, shape in buffers.items()
            ),
            objects=(ObjectSpec(suffix=suffix, buffers=tuple(buffers)),),
        )

    draft = build("x")
    prints = [layout_fingerprint(draft, suffix).hex() for suffix, _ in stored_objects(draft)]
    return build(f"{sglang_name}-{digest(pool_type, *prints)}")


def _canonical(pool: Any, sglang_name: str) -> CanonicalPages | None:
    """Exact format for SGLang's plain MHA / MLA host pools, or None (then opaque)."""
    kind = class_id(pool)
    layout = getattr(pool, "layout", None)
    dtype = dtype_name(pool.dtype) if hasattr(pool, "dtype") else None
    if dtype not in SUPPORTED_DTYPES or getattr(pool, "kv_buffer", None) is None:
        return None
    if getattr(pool, "dcp_size", 1) != 1:
        return None
    page = int(pool.page_size)
    if kind == MHA_CLASS and layout in MHA_PAGE_VIEWS:
        layers, heads, dim = int(pool.layer_num), int(pool.head_num), int(pool.head_dim)
        if getattr(pool, "v_head_dim", dim) != dim:
            return None
        view = MHA_PAGE_VIEWS[layout](pool)
        block = (page, layers, heads, dim)
        expected = (2, *block)
        spec = _exact_spec(
            "kv", sglang_name, page, dtype, {"k": block, "v": block}, "kv", Replication.SHARDED
        )
    elif kind == MLA_CLASS and layout in MLA_PAGE_VIEWS:
        layers, row = int(pool.layer_num), int(pool.kv_cache_dim)
        view = MLA_PAGE_VIEWS[layout](pool)
        expected = (page, layers, row)
        # the MLA row (latent + rope, or the packed fp8 DSA row) is one run of `row` elements; it is
        # identical on every TP rank: one key for all ranks, written by rank 0
        spec = _exact_spec("mla", sglang_name, page, dtype, {"row": expected}, "mla", Replication.REPLICATED)
    else:
        return None
    if math.prod(view.shape[1:]) != math.prod(expected) or tuple(view.shape[1:4]) != expected[:3]:
        return None
    return CanonicalPages(pool, spec, view, layout)


def describe_host_pool(pool: Any, sglang_name: str, plugins: PluginHost, *, replicated: bool) -> PageFormat:
    """The page format of one SGLang host pool registered under ``sglang_name``.

    ``replicated``: the model's pools are rank-replicated (MLA), so an opaque pool's keys carry no
    TP rank, unless it is an MHA pool of any class (its heads are the rank's); MLA never does.
    """
    split = _split_kv(pool, sglang_name)  # first: SGLang gives such a pool no flat data page
    if split is not None:
        return split
    dummy = None if getattr(pool, "kv_buffer", 0) is None else _flat_page(pool, sglang_name)
    if dummy is None or dummy.numel() == 0:
        spec = _spec_from_type(
            plugins, "logical", f"{sglang_name}-{digest('logical', pool.page_size)}", int(pool.page_size)
        )
        return MarkerPages(pool, spec)
    try:
        exact = _canonical(pool, sglang_name)
    except (RuntimeError, ValueError, AttributeError):  # an unexpected buffer shape: store it opaque
        exact = None
    if exact is not None:
        return exact
    layout = getattr(pool, "layout", "?")
    slots = int(getattr(pool, "page_size", 1) or 1)
    nbytes = dummy.numel() * dummy.element_size()
    identity = digest(class_id(pool), layout, slots, dtype_name(dummy.dtype), nbytes, *state_format(pool))
    instance = f"{sglang_name}-{identity}"
    spec = PoolSpec(
        name=instance,
        pool_type=OPAQUE_POOL_TYPE,
        role=PoolRole.COMPONENT,
        granularity=Granularity.TOKEN_PAGES,
        hit_rule=HitRule(kind=HitRuleKind.ALL_PAGES),
        partial_hit=PartialHit.CLAMP,
        # an MHA pool of any class (scaled, asymmetric) holds this rank's heads: keys per rank
        replication=Replication.REPLICATED if replicated and not is_mha(pool) else Replication.SHARDED,
        page_size=slots,
        buffers=(BufferSpec(name="page", dtype="uint8", layers=1, unit_shape=(nbytes,)),),
        objects=(ObjectSpec(suffix="page", buffers=("page",)),),
    )
    why = "layout-specific bytes" if class_id(pool) in (MHA_CLASS, MLA_CLASS) else "SGLang flat data page"
    return FlatPages(pool, spec, dummy, why)


#: host-pool attributes that say what an opaque page's bytes mean (SGLang's flat data page is
#: ``uint8`` whatever it holds): a Mamba pool's state dtypes and shapes, its layer count
_FORMAT_ATTRIBUTES = (
    *("conv_dtype", "temporal_dtype", "conv_state_shapes", "temporal_state_shape", "num_mamba_layers"),
    *("layer_num", "head_num", "head_dim", "v_head_dim", "kv_cache_dim", "index_head_dim"),
)


def state_format(pool: Any) -> list[str]:
    """What an opaque pool's bytes mean beyond their count, as ``name=value`` strings for its key:
    two pools of one byte size but other state dtypes or shapes (``--mamba-ssm-dtype bfloat16``
    vs ``float16``) must never read each other's pages."""
    facts = []
    for name in _FORMAT_ATTRIBUTES:
        value = getattr(pool, name, None)
        if value is not None:
            facts.append(f"{name}={_plain_fact(value)}")
    side = getattr(pool, "slot_state_buffers", None)  # a Mamba pool's per-slot side states: in its pages too
    if side:
        facts.append("slot_states=" + _plain_fact([(t.dtype, tuple(t.shape[1:])) for t in side]))
    return facts


def _plain_fact(value: Any) -> str:
    """A stable text of a dtype, a shape or a (nested) list of them."""
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, (list, tuple, torch.Size)):
        return "(" + ",".join(_plain_fact(item) for item in value) + ")"
    return str(value)


def _split_kv(pool: Any, sglang_name: str) -> SplitKVPages | None:
    """Exact format for an MHA pool keeping K and V in two buffers of their own head dims."""
    buffers, layout = getattr(pool, "kv_buffer", None), getattr(pool, "layout", None)
    if not is_mha(pool) or not isinstance(buffers, (tuple, list)) or len(buffers) != 2:
        return None
    dtype = dtype_name(pool.dtype)
    if layout not in SPLIT_KV_VIEWS or dtype not in SUPPORTED_DTYPES or getattr(pool, "dcp_size", 1) != 1:
        return None
    page, layers, heads = int(pool.page_size), int(pool.layer_num), int(pool.head_num)
    dims = {"k": int(pool.head_dim), "v": int(pool.v_head_dim)}
    blocks = {name: (page, layers, heads, dim) for name, dim in dims.items()}
    views = [SPLIT_KV_VIEWS[layout](pool, buffer) for buffer in buffers]
    if [tuple(view.shape[1:]) for view in views] != list(blocks.values()):
        return None
    spec = _exact_spec("kv", sglang_name, page, dtype, blocks, "kv", Replication.SHARDED)
    return SplitKVPages(pool, spec, tuple(CanonicalPages(pool, spec, view, layout) for view in views), layout)


def _flat_page(pool: Any, sglang_name: str) -> torch.Tensor:
    """SGLang's dummy flat data page of ``pool`` (its size and dtype), or a clear error for a
    pool that has none and no exact format here (SGLang's own message names other backends)."""
    try:
        return pool.get_dummy_flat_data_page()
    except NotImplementedError as exc:
        raise ValueError(
            f"kvstrata cannot store SGLang host pool {sglang_name!r} ({class_id(pool)}, layout "
            f"{getattr(pool, 'layout', '?')!r}): it has no flat data page and no exact format in "
            f"kvstrata; SGLang says: {exc}"
        ) from None
