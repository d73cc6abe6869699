"""kvstrata under Hugging Face transformers: restore a prompt's longest cached prefix into a cache
object the model continues from, and commit what the model computed.

    cache = HFStateCache(model, {"tiers": {"storage": {"l3": {"type": "file", "path": "/tmp/l3"}}}},
                         page_size=16)
    past, cached = cache.restore(input_ids)          # a DynamicCache holding input_ids[:cached]
    out = model(input_ids[:, cached:], past_key_values=past, use_cache=True)
    cache.commit(input_ids, input_ids.shape[-1], past)
    cache.close()                                     # flushes L3

The pools come from the model (:mod:`kvstrata.adapters._hf_layout`: full and sliding-window K/V,
conv / recurrent states, per-layer shapes and dtypes, model layer ids, a logical anchor when no
layer has full attention); the config gives the page size, tiers, storage and policies. The
namespace of every stored object is derived from the model's class, its config (all of it, with
the transformers version and attention implementation) and a sample of its weights, so two
models or configs never read each other's objects.

State models (Mamba, GDN, short conv) hold one state per checkpoint: a prefix is restorable where
a commit stored the state, i.e. where ``past_key_values`` stood exactly at a page boundary. Feed
the model page-aligned chunks and commit after each (:meth:`HFStateCache.prefill` does).
The adapter uses only kvstrata's public API (``kvstrata.open``, the lease calls, unit memory).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

try:
    import transformers
except ModuleNotFoundError as exc:  # the extra pins the version the adapter is tested with
    if exc.name != "transformers":
        raise
    raise ModuleNotFoundError(
        "kvstrata.adapters.hf needs transformers: run `pip install 'kvstrata[hf]'`", name="transformers"
    ) from exc

import kvstrata
from kvstrata.adapters._hf_cache import (
    ForwardHooks,
    KvstrataDynamicCache,
    PageKeepingSlidingWindowLayer,
    held_range,
    joined,
    page_tensors,
    restore_full,
    restore_states,
    restore_window,
    state_tensor,
    tokens_held,
)
from kvstrata.adapters._hf_layout import (
    ModelLayout,
    StateTensor,
    UnsupportedModelError,
    describe_model,
)
from kvstrata.adapters._shared import EngineIdentity, open_cache, weights_digest
from kvstrata.engine_kit import integer

__all__ = ["HFStateCache", "PrefillResult", "RestoreInfo", "UnsupportedModelError", "model_identity"]

#: Keyword shortcuts of :class:`HFStateCache` (every other keyword is a ``a__b__c`` config path).
SHORTCUTS = {"page_size": "model.page_size", "cache_salt": "model.cache_salt"}


@dataclass
class RestoreInfo:
    """What the last :meth:`HFStateCache.restore` found: tokens, pages per tier, skips, time."""

    tokens: int
    pages: dict[str, int] = field(default_factory=dict)  # device / host / storage
    skipped: dict[str, int] = field(default_factory=dict)  # pages held but unusable, by reason
    seconds: float = 0.0


@dataclass
class PrefillResult:
    """What :meth:`HFStateCache.prefill` leaves: the cache, the last logits, reused and stored tokens."""

    past_key_values: KvstrataDynamicCache
    logits: torch.Tensor  # the last forward's logits for its last position, [1, vocab]
    cached_tokens: int  # restored from kvstrata
    committed_tokens: int  # held by kvstrata for this prompt afterwards


#: the forward keywords transformers models take a cache under (the layout knows which one)
class HFStateCache:
    """A kvstrata cache for one Hugging Face model (see the module docstring).

    ``config``: a kvstrata config path (or list of paths) or mapping for the page size, tiers,
    storage and policies; ``model.pools`` and ``model.name`` come from the model. Keywords:
    ``page_size``, ``cache_salt``, ``name`` (a readable namespace prefix), ``state_slots``
    (device slots of every state pool: one checkpoint each), and any config field as
    ``tiers__device__capacity_tokens=65536`` (``__`` for ``.``). Raises :class:`UnsupportedModelError`
    naming the layer or cache type for a model it cannot map. ``model`` may be a ``torch.compile``
    wrapper: the module it wraps is mapped and hashed (the same namespace), the wrapper runs.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: str | Path | list[str | Path] | Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> None:
        if isinstance(config, Mapping) and "pools" in (config.get("model") or {}):
            raise ValueError("model.pools: HFStateCache derives the pools from the model; leave them out")
        self.model = model  # what prefill runs: a torch.compile wrapper stays compiled
        model = self._module = _uncompiled(model)  # its layout, weights, config and hooks
        self.layout: ModelLayout = describe_model(model)
        prefix = str(overrides.pop("name", f"hf-{self.layout.model_type}"))
        if not prefix:  # (else pydantic's error names EngineIdentity.model, not this keyword)
            raise ValueError("name must be a non-empty string (the readable prefix of the namespace)")
        settings: dict[str, Any] = {}
        device = next(model.parameters()).device
        if device.type != "cpu":
            settings["tiers.device.device"] = str(device)
        slots = overrides.pop("state_slots", None)
        weights = overrides.pop("weights_digest", None)
        if weights is not None and (not isinstance(weights, str) or not weights):
            raise ValueError(f"weights_digest must be a non-empty string, got {weights!r}")
        for key, value in overrides.items():
            if key in SHORTCUTS:
                settings[SHORTCUTS[key]] = value
            elif "__" in key:
                settings[key.replace("__", ".")] = value
            else:
                raise TypeError(
                    f"HFStateCache got an unknown keyword {key!r}: use page_size, cache_salt, name, "
                    "state_slots, weights_digest or a config path like tiers__host__capacity_tokens"
                )
        pools = dict(self.layout.pools)
        if slots is not None:
            for pool in self.layout.states:
                settings.setdefault(f"model.pools.{pool.name}.device_units", slots)
        identity = model_identity(model, self.layout, prefix, weights)
        self.cache, self.identity = open_cache(identity, config, pools=pools, overrides=settings)
        self.namespace = self.identity.namespace
        self.page_size = self.cache.page_size
        self.last_restore: RestoreInfo | None = None
        self._owner = object()  # marks the caches this adapter hands out
        #: each weight as the namespace hashed it: changed in place or replaced by another
        #: parameter (an assignment, an injected adapter), the namespace no longer says it
        self._weights = _weights_now(model)
        self._config = _config_facts(model)  # and its config (set_attn_implementation changes it)
        self._vocab = _vocab_size(model)  # ids past it fail the model's forward: refused up front
        self._hooks: ForwardHooks | None = ForwardHooks(model, self.layout.cache_argument, self._owner)

    # --- caches ---------------------------------------------------------------------------------

    def new_cache(self) -> KvstrataDynamicCache:
        """An empty cache for this model (what :meth:`restore` returns on a miss)."""
        return KvstrataDynamicCache(self.model.config, self.layout, self._owner)

    def restore(self, input_ids: torch.Tensor | list[int]) -> tuple[KvstrataDynamicCache, int]:
        """The longest page-aligned prefix of ``input_ids`` kvstrata can restore, as a cache
        the model continues from, and its length in tokens. At most ``len - 1`` tokens come
        back, so the model always has a token to compute the next logits from. L3 is read
        synchronously; every restored tensor is a private copy (the model may mutate it)."""
        self._check_open()
        started = time.perf_counter()
        ids = _sequence(input_ids, self._vocab)
        past = self.new_cache()
        limit = (max(0, len(ids) - 1) // self.page_size) * self.page_size
        if limit == 0:
            self.last_restore = RestoreInfo(0, seconds=time.perf_counter() - started)
            return past, 0
        lease = self.cache.lookup(ids[:limit], prefetch="wait")
        try:
            self.cache.admit(lease)
            pages = lease.cached_pages
            if pages:
                self._fill(past, lease, pages)
        finally:
            self.cache.release(lease)
        tokens = pages * self.page_size
        past.restored(ids, tokens, self.layout.cache_argument)
        self.last_restore = RestoreInfo(
            tokens, dict(lease.hit_pages), dict(lease.skipped), time.perf_counter() - started
        )
        return past, tokens

    def commit(
        self,
        input_ids: torch.Tensor | list[int],
        upto: int,
        past_key_values: Any,
        *,
        trust_cache: bool = False,
    ) -> int:
        """Store what the model computed for ``input_ids[:upto]`` (``upto`` a multiple of the
        page size, or ``len(input_ids)``: then the whole pages the cache holds of it).
        ``past_key_values`` holds the tokens the model processed, which must start with
        ``input_ids`` (checked for a cache from :meth:`restore` / :meth:`new_cache`; a plain
        ``DynamicCache`` says neither its tokens nor its model: taken only with ``trust_cache``,
        the caller vouching for both). Returns the tokens of this prompt kvstrata holds
        afterwards: less than asked where a state pool has no state at that page (the cache has
        moved past it) or a window layer no longer holds its pages."""
        self._check_open()
        ids = _sequence(input_ids, self._vocab)
        if (number := integer(upto)) is None:  # (any integer: a NumPy one, a 0-d tensor; no bool)
            raise TypeError(f"upto must be an int (tokens), got {upto!r}")
        upto = number
        if not 0 <= upto <= len(ids):
            raise ValueError(f"upto {upto} is outside [0, {len(ids)}] (the length of input_ids)")
        if upto % self.page_size and upto != len(ids):
            raise ValueError(
                f"upto {upto} must be a multiple of page_size {self.page_size} or len(input_ids) {len(ids)}"
            )
        self._check_cache(past_key_values)
        processed = tokens_held(past_key_values, ids, self._owner, self.layout.has_attention, trust_cache)
        if upto > processed:
            if upto != len(ids):
                raise ValueError(f"past_key_values holds {processed} tokens; cannot commit {upto}")
            upto = processed  # "the end": what the cache holds of it (after generate, all but one)
        pages = upto // self.page_size
        if pages == 0:
            return 0
        lease = self.cache.lookup(ids[: pages * self.page_size], record=False, prefetch="off")
        try:
            self.cache.admit(lease)
            have = lease.cached_pages
            if have >= pages or (self.layout.states and processed != pages * self.page_size):
                self.cache.release(lease)
                return _stored(past_key_values, have * self.page_size, self.page_size)
            # window layers that lost the first new pages (a prefix evicted since the restore)
            # can still give their window
            held = [
                held_range(past_key_values.layers[i])[0] for p in self.layout.attention for i in p.layer_ids
            ]
            units = self.cache.allocate(lease, window_only=max(held, default=0) > have * self.page_size)
            if not self._write(past_key_values, lease, units, pages):
                self.cache.release(lease)
                return _stored(past_key_values, have * self.page_size, self.page_size)
            self.cache.insert(lease)
        except BaseException:
            self.cache.release(lease)
            raise
        return _stored(past_key_values, pages * self.page_size, self.page_size)

    def prefill(self, input_ids: torch.Tensor | list[int], *, chunk_pages: int = 1) -> PrefillResult:
        """Restore, run the model over the rest of ``input_ids`` in chunks of ``chunk_pages``
        pages (the last chunk may be shorter), committing after each whole-page chunk."""
        if (number := integer(chunk_pages)) is None or number < 1:
            raise ValueError(f"chunk_pages must be an int >= 1, got {chunk_pages!r}")
        chunk_pages = number
        ids = _sequence(input_ids, self._vocab)
        if not len(ids):
            raise ValueError("prefill needs at least one token (input_ids is empty)")
        past, cached = self.restore(ids)
        device = next(self.model.parameters()).device
        step, position, committed, logits = chunk_pages * self.page_size, cached, cached, None
        with torch.no_grad():
            while position < len(ids):
                end = min(position + step, len(ids))
                chunk = ids[position:end].to(device).unsqueeze(0)
                out = self.model(input_ids=chunk, use_cache=True, **{self.layout.cache_argument: past})
                logits, position = out.logits[:, -1].float(), end
                if end % self.page_size == 0:
                    committed = self.commit(ids, end, past)
        assert logits is not None  # input_ids is not empty, and restore leaves a token to compute
        return PrefillResult(past, logits, cached, committed)

    def close(self) -> None:
        """Flush L3 writes, release the cache and unhook the model."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        self.cache.close()

    def __enter__(self) -> HFStateCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._hooks is None:
            raise RuntimeError("HFStateCache is closed")
        # (every restore and commit: a namespace names the weights it hashed at construction)
        if not _same_weights(_weights_now(self._module), self._weights):
            raise RuntimeError(
                "the model's weights changed since this HFStateCache hashed them (its namespace): "
                "make a new HFStateCache for the new weights"
            )
        if _config_facts(self._module) != self._config:
            raise RuntimeError(
                "the model's config or attention implementation changed since this HFStateCache "
                "hashed them (its namespace): make a new HFStateCache for the changed model"
            )

    def _check_cache(self, past: Any) -> None:
        if isinstance(past, KvstrataDynamicCache) and past.kvstrata_owner is not self._owner:
            raise ValueError(
                "past_key_values was handed out by another HFStateCache (its restore() or new_cache()): "
                "commit it through that one; this cache never saw the tokens it holds"
            )
        classes = tuple(type(layer) for layer in getattr(past, "layers", ()))
        expected = list(self.layout.layer_classes)
        if isinstance(past, KvstrataDynamicCache):
            for pool in self.layout.attention:
                for layer_id in pool.layer_ids if pool.window is not None else ():
                    expected[layer_id] = PageKeepingSlidingWindowLayer
        if not isinstance(past, transformers.DynamicCache) or classes != tuple(expected):
            raise TypeError(
                f"past_key_values is a {type(past).__name__} with layers {[c.__name__ for c in classes]}; "
                f"expected this model's DynamicCache (from restore() or new_cache())"
            )

    def _fill(self, past: KvstrataDynamicCache, lease: kvstrata.Lease, pages: int) -> None:
        """Copy the lease's prefix units into ``past``'s layers."""
        tokens = pages * self.page_size
        devices = self.layout.layer_devices
        for pool in self.layout.attention:
            data = self.cache.read_units(pool.name, lease.prefix_units(pool.name))
            for index, layer_id in enumerate(pool.layer_ids):
                keys = joined(data["k"][:, index], devices[layer_id])
                values = joined(data["v"][:, index], devices[layer_id])
                layer = past.layers[layer_id]
                if pool.window is None:
                    restore_full(layer, keys, values)
                else:
                    restore_window(layer, keys, values, tokens, self.page_size)
        for state_pool in self.layout.states:
            data = self.cache.read_units(state_pool.name, lease.prefix_units(state_pool.name))
            for index, layer_id in enumerate(state_pool.layer_ids):
                values: dict[StateTensor, torch.Tensor] = {
                    t: data[t.name][0, index].to(devices[layer_id]) for t in state_pool.tensors
                }
                restore_states(past.layers[layer_id], values)

    def _write(self, past: Any, lease: kvstrata.Lease, units: dict[str, torch.Tensor], pages: int) -> bool:
        """Write the new pages' units from ``past``; False (nothing written) where ``past`` no
        longer holds a page a window pool needs."""
        page = self.page_size
        plans: list[tuple[str, torch.Tensor, int, int]] = []
        for pool in self.layout.attention:
            got = units[pool.name]
            if not len(got):
                continue
            first = lease.allocated_first_page(pool.name)
            for layer_id in pool.layer_ids:
                start, end = held_range(past.layers[layer_id])
                if start > first * page or end < pages * page:
                    return False
            plans.append((pool.name, got, first, pages))
        for name, got, first, end_page in plans:
            pool = next(p for p in self.layout.attention if p.name == name)
            for layer_id in pool.layer_ids:
                tensors = page_tensors(past.layers[layer_id], first, end_page, page)
                self.cache.write_units(name, got, tensors, layer=layer_id)
        for state_pool in self.layout.states:
            slot = units[state_pool.name]
            if not len(slot):
                continue
            for layer_id in state_pool.layer_ids:
                layer = past.layers[layer_id]
                tensors = {t.name: state_tensor(layer, t).unsqueeze(0) for t in state_pool.tensors}
                self.cache.write_units(state_pool.name, slot, tensors, layer=layer_id)
        return True


def model_identity(
    model: torch.nn.Module, layout: ModelLayout, name: str, weights: str | None = None
) -> EngineIdentity:
    """What the namespace of ``model``'s objects covers: the model class, its whole config (with
    the transformers version), the attention implementation, the derived pools (dtypes, shapes,
    layer ids) and every byte of every weight (:func:`weights_digest`, or ``weights``: a digest
    the caller vouches for); ``name`` is the readable part."""
    attention, config_json = _config_facts(model)
    layout_facts = {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": json.loads(config_json),
        "attention": attention,
        "transformers": transformers.__version__,
        "pools": layout.pools,
    }
    state = model.state_dict()
    # buffers a checkpoint does not save (rotary ``inv_freq``) shape every output too
    unsaved = [(f"buffer:{n}", b) for n, b in model.named_buffers() if n not in state and b is not None]
    return EngineIdentity(
        engine="hf",
        model=name,
        weights=weights if weights is not None else "xxh3-" + weights_digest([*state.items(), *unsaved]),
        dtypes=tuple(sorted({str(tensor.dtype) for tensor in state.values()})),
        layout=json.loads(json.dumps(layout_facts, sort_keys=True, default=str)),
    )


def _uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile`` wrapper runs (its forward takes ``*args, **kwargs``, so
    the cache argument is the module's; its parameter names gain ``_orig_mod.``)."""
    inner = getattr(model, "_orig_mod", None) if isinstance(model, torch.nn.Module) else None
    return inner if isinstance(inner, torch.nn.Module) else model


def _stored(past: Any, tokens: int, page: int) -> int:
    """kvstrata holds the first ``tokens`` of ``past``'s prompt: its window layers may forget the
    pages they kept for a commit before them (also when another request stored them first, or
    every page was cached: kept, they grew with the prompt), all but those the window of a later
    commit reaches (it stores only its window where this prefix is evicted by then). Returns
    ``tokens``."""
    for layer in past.layers:
        if isinstance(layer, PageKeepingSlidingWindowLayer):
            layer.trim(layer.window_start(tokens, page))
    return tokens


def _weights_now(model: torch.nn.Module) -> list[tuple[str, torch.Tensor, int, int]]:
    """Each parameter's name, object, version and address: a weight changed in place bumps its
    version (or moves), one replaced (``layer.weight = Parameter(...)``, a LoRA layer injected)
    is another object, one added or removed changes the list. (The objects are held, so an id
    is never reused by a new parameter while compared.)"""
    return [(name, w, w._version, w.data_ptr()) for name, w in model.named_parameters()]


def _same_weights(
    now: list[tuple[str, torch.Tensor, int, int]], then: list[tuple[str, torch.Tensor, int, int]]
) -> bool:
    return len(now) == len(then) and all(
        a[0] == b[0] and a[1] is b[1] and a[2:] == b[2:] for a, b in zip(now, then, strict=True)
    )


def _config_facts(model: torch.nn.Module) -> tuple[str, str]:
    """The attention implementation and the whole config as the namespace hashes them (read
    again at every restore and commit, ~0.2 ms: a config changed in place no longer matches)."""
    config = model.config
    facts = _without_paths(json.loads(config.to_json_string(use_diff=False)))
    return str(getattr(config, "_attn_implementation", None)), json.dumps(facts, sort_keys=True)


#: config keys that say where a model was loaded from, not what it computes: the weights digest
#: covers the bytes, so the same weights from another directory share the namespace
_PATH_KEYS = frozenset({"_name_or_path"})


def _without_paths(value: Any) -> Any:
    """``value`` (a config as JSON, nested configs included) without :data:`_PATH_KEYS`."""
    if isinstance(value, dict):
        return {key: _without_paths(item) for key, item in value.items() if key not in _PATH_KEYS}
    if isinstance(value, list):
        return [_without_paths(item) for item in value]
    return value


def _vocab_size(model: torch.nn.Module) -> int | None:
    """The ids the model's input embedding holds (its forward fails past them), else the
    config's ``vocab_size``; None where neither says."""
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embedding = None
    rows = getattr(embedding, "num_embeddings", None)
    rows = rows if isinstance(rows, int) else getattr(model.config, "vocab_size", None)
    return rows if isinstance(rows, int) and not isinstance(rows, bool) and rows > 0 else None


def _sequence(input_ids: torch.Tensor | list[int], vocab: int | None = None) -> torch.Tensor:
    """One sequence of token ids as a 1-D CPU int64 tensor (a batch must hold exactly one), each
    id in ``[0, vocab)``: refused here, before the cache is asked, not by the model's forward."""
    if isinstance(input_ids, (str, bytes, Mapping)) or input_ids is None:
        hint = " (a tokenizer's output? pass its ['input_ids'])" if isinstance(input_ids, Mapping) else ""
        raise TypeError(
            f"input_ids must be token ids (a tensor or a list of ints), got {type(input_ids).__name__}{hint}"
        )
    try:
        ids = torch.as_tensor(input_ids)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise TypeError(f"input_ids must be token ids (a tensor or a list of ints): {exc}") from None
    if not ids.numel() and not isinstance(input_ids, torch.Tensor):
        ids = ids.to(torch.int64)  # ``[]``: no tokens, not a float tensor
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"input_ids holds a batch of {ids.shape[0]}; HFStateCache serves one sequence")
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must be [tokens] or [1, tokens], got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got a {ids.dtype} tensor")
    if ids.is_meta:
        raise ValueError("input_ids is a tensor on the meta device: it holds no token ids")
    ids = ids.to(device="cpu", dtype=torch.int64)  # a uint64 id past 2**63 wraps negative
    if ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or (vocab is not None and high >= vocab):
            raise ValueError(
                f"input_ids holds token id {low if low < 0 else high}, outside the model's vocabulary "
                f"[0, {vocab if vocab is not None else 'inf'})"
            )
    return ids
