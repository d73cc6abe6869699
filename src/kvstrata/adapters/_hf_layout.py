"""How a Hugging Face model's cache maps onto kvstrata pools, read from the model itself.

A probe forward of two tokens makes the model build the cache it always builds
(``DynamicCache(config=...)`` in transformers 5.23, for every decoder family) and fill every
layer once. Each cache layer's *class* says what it holds, and its tensors give the shapes and
dtypes, so nothing is guessed from config field names (which differ per family):

=========================================  ==================================================
cache layer class                          kvstrata pools
=========================================  ==================================================
``DynamicLayer``                           full-attention K/V: a ``kv`` pool (``head_major``)
``DynamicSlidingWindowLayer``              window K/V: a ``swa`` pool (window ``sliding_window - 1``
                                           tokens, what the layer keeps)
``LinearAttentionLayer``                   conv / recurrent states: a ``mamba`` pool (named states)
``LinearAttentionAndFullAttentionLayer``   both of the above for the same model layer
``DummyLayer``                             nothing (MoE / MLP blocks, KV-sharing consumers)
=========================================  ==================================================

Layers of one kind with equal shapes and dtype share a pool; other shapes get their own pool
(a sidecar ``kv`` pool following the first pool of that kind, or another ``mamba`` component).
Without a full-attention layer a ``logical`` pool anchors the pages. Any other cache class
(static, quantized, indexed / compressed attention, a family's own cache) or cache type is an
:class:`UnsupportedModelError` naming it: an unknown layer could hold state kvstrata would not
restore, and a wrong restore is worse than none.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers.cache_utils import (
    Cache,
    DummyLayer,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

from kvstrata.plugins.pool_type import SUPPORTED_DTYPES

#: Cache layer classes the adapter maps (exact classes: a subclass may hold more state).
SUPPORTED_LAYERS: tuple[type, ...] = (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionLayer,
    LinearAttentionAndFullAttentionLayer,
    DummyLayer,
)
ANCHOR_POOL = "kv"
LOGICAL_ANCHOR = "pages"
PROBE_TOKENS = 2


class UnsupportedModelError(ValueError):
    """The model's cache holds something the adapter cannot store and restore exactly."""


@dataclass(frozen=True)
class AttentionPool:
    """Model layers whose K/V one ``kv`` / ``swa`` pool holds, in pool layer order."""

    name: str
    layer_ids: tuple[int, ...]
    heads: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    window: int | None  # sliding_window of the layers (None: full attention)
    index_source: str | None = None  # a sidecar following this pool's pages

    def config(self) -> dict[str, Any]:
        """The kvstrata pool config."""
        out: dict[str, Any] = {
            "type": "kv" if self.window is None or self.index_source else "swa",
            "layers": len(self.layer_ids),
            "layer_ids": list(self.layer_ids),
            "kv_heads": self.heads,
            "head_dim": self.head_dim,
            "dtype": dtype_name(self.dtype),
            "unit_layout": "head_major",
        }
        if self.v_head_dim != self.head_dim:
            out["v_head_dim"] = self.v_head_dim
        if self.index_source is not None:
            out["index_source"] = self.index_source
        elif self.window is not None:
            out["window"] = kept_tokens(self.window)
        return out


@dataclass(frozen=True)
class StateTensor:
    """One state tensor of a linear-attention layer: ``conv_states[index]`` or ``recurrent_states[index]``."""

    name: str
    source: Literal["conv", "recurrent"]
    index: int
    shape: tuple[int, ...]  # without the batch dimension
    dtype: torch.dtype


@dataclass(frozen=True)
class StatePool:
    """Model layers whose states one ``mamba`` pool holds (one slot = every layer's states)."""

    name: str
    layer_ids: tuple[int, ...]
    tensors: tuple[StateTensor, ...]

    def config(self) -> dict[str, Any]:
        return {
            "type": "mamba",
            "layers": len(self.layer_ids),
            "layer_ids": list(self.layer_ids),
            "states": {t.name: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for t in self.tensors},
        }


@dataclass(frozen=True)
class ModelLayout:
    """Every pool the model's cache needs, and how its cache layers are built."""

    model_type: str
    anchor: str
    attention: tuple[AttentionPool, ...]
    states: tuple[StatePool, ...]
    layer_classes: tuple[type, ...]
    layer_devices: tuple[torch.device | None, ...]
    cache_argument: str  # the forward keyword that takes the cache
    kinds: tuple[str, ...] = field(default=())  # per model layer, for messages and docs

    @property
    def pools(self) -> dict[str, dict[str, Any]]:
        """kvstrata pool configs, anchor first."""
        out: dict[str, dict[str, Any]] = {}
        if self.anchor == LOGICAL_ANCHOR:
            out[LOGICAL_ANCHOR] = {"type": "logical"}
        ordered = sorted(self.attention, key=lambda p: p.index_source is not None)
        out.update((pool.name, pool.config()) for pool in ordered)
        out.update((pool.name, pool.config()) for pool in self.states)
        return out

    @property
    def has_attention(self) -> bool:
        return bool(self.attention)

    def describe(self) -> str:
        """One line per pool: which model layers it holds."""
        lines = [f"{self.model_type}: {len(self.layer_classes)} cache layers ({', '.join(self.kinds)})"]
        for name, config in self.pools.items():
            layers = config.get("layer_ids", [])
            lines.append(f"  {name}: {config['type']} {layers}")
        return "\n".join(lines)


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in SUPPORTED_DTYPES:
        raise UnsupportedModelError(
            f"cache dtype {dtype} is not one kvstrata stores ({list(SUPPORTED_DTYPES)})"
        )
    return name


def kept_tokens(sliding_window: int) -> int:
    """Tokens a ``DynamicSlidingWindowLayer`` keeps between forwards (``sliding_window - 1``)."""
    return sliding_window - 1


def cache_argument(model: torch.nn.Module) -> str:
    """The forward keyword taking the cache: ``past_key_values``, or ``cache_params`` (Mamba2)."""
    parameters = inspect.signature(model.forward).parameters
    if "past_key_values" in parameters:
        return "past_key_values"
    if "cache_params" in parameters:
        return "cache_params"
    raise UnsupportedModelError(
        f"{type(model).__name__}.forward takes neither past_key_values nor cache_params: no cache to store"
    )


def probe_cache(model: torch.nn.Module) -> Cache:
    """The cache the model builds and fills on a two-token forward (no gradients, RNG untouched)."""
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model (EncoderDecoderCache): not mapped")
    device = next(model.parameters()).device
    ids = torch.zeros((1, PROBE_TOKENS), dtype=torch.long, device=device)
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
    except Exception as exc:  # a model that cannot run on token ids alone
        raise UnsupportedModelError(
            f"{name}: a {PROBE_TOKENS}-token probe forward(input_ids, use_cache=True) failed: {exc}"
        ) from exc
    for name in ("past_key_values", "cache_params"):
        cache = getattr(out, name, None)
        if cache is not None:
            return cache
    raise UnsupportedModelError(f"{name} returned no cache from forward(use_cache=True): nothing to store")


def describe_model(model: torch.nn.Module) -> ModelLayout:
    """Map a loaded ``PreTrainedModel`` onto kvstrata pools (see the module docstring)."""
    argument = cache_argument(model)
    cache = probe_cache(model)
    name = type(model).__name__
    if type(cache) is not DynamicCache:
        raise UnsupportedModelError(
            f"{name} keeps its state in a {type(cache).__name__}; kvstrata.adapters.hf maps "
            "transformers' DynamicCache only"
        )
    fresh = DynamicCache(config=model.config)
    classes = tuple(type(layer) for layer in cache.layers)
    if tuple(type(layer) for layer in fresh.layers) != classes:
        raise UnsupportedModelError(
            f"{name}: DynamicCache(config=model.config) builds layers "
            f"{[c.__name__ for c in (type(x) for x in fresh.layers)]} but the model's forward used "
            f"{[c.__name__ for c in classes]}; the adapter could not rebuild the model's cache"
        )
    for index, layer in enumerate(cache.layers):
        if type(layer) not in SUPPORTED_LAYERS:
            raise UnsupportedModelError(
                f"{name}: cache layer {index} is a {type(layer).__name__}, which kvstrata.adapters.hf "
                f"cannot store exactly (it maps {[c.__name__ for c in SUPPORTED_LAYERS]})"
            )
    attention, kinds, devices = _attention_pools(name, cache.layers)
    states = _state_pools(name, cache.layers, devices)
    if not attention and not states:
        raise UnsupportedModelError(f"{name}: its cache holds no attention or state layer: nothing to store")
    full = [pool for pool in attention if pool.window is None]
    anchor = full[0].name if full else LOGICAL_ANCHOR
    return ModelLayout(
        model_type=str(getattr(model.config, "model_type", name)),
        anchor=anchor,
        attention=tuple(attention),
        states=tuple(states),
        layer_classes=classes,
        layer_devices=tuple(devices),
        cache_argument=argument,
        kinds=tuple(kinds),
    )


def _attention_pools(
    model: str, layers: list[Any]
) -> tuple[list[AttentionPool], list[str], list[torch.device | None]]:
    groups: dict[tuple[Any, ...], list[int]] = {}
    kinds: list[str] = []
    devices: list[torch.device | None] = []
    for index, layer in enumerate(layers):
        kind, device = _kind(layer), None
        if isinstance(layer, DynamicLayer):
            keys, values = layer.keys, layer.values
            if keys is None or values is None or keys.dim() != 4:
                raise UnsupportedModelError(f"{model}: attention layer {index} holds no [B, H, T, D] keys")
            if keys.shape[0] != 1 or keys.shape[1] != values.shape[1] or keys.shape[2] != values.shape[2]:
                raise UnsupportedModelError(
                    f"{model}: attention layer {index} keys {tuple(keys.shape)} and values "
                    f"{tuple(values.shape)} differ in batch, heads or tokens"
                )
            if keys.dtype != values.dtype:
                raise UnsupportedModelError(f"{model}: layer {index} keys and values differ in dtype")
            window = getattr(layer, "sliding_window", None) if layer.is_sliding else None
            if window is not None and window < 2:
                raise UnsupportedModelError(f"{model}: layer {index} has sliding_window {window} (< 2)")
            key = (window, keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)
            groups.setdefault(key, []).append(index)
            device = keys.device
        kinds.append(kind)
        devices.append(device)
    pools: list[AttentionPool] = []
    first_of: dict[int | None, str] = {}
    for (window, heads, dim, v_dim, dtype), ids in groups.items():
        base = ANCHOR_POOL if window is None else f"swa_{window}"
        owner = first_of.get(window)
        name = base if owner is None else f"{base}_{sum(p.window == window for p in pools)}"
        if owner is None:
            first_of[window] = name
        pools.append(AttentionPool(name, tuple(ids), heads, dim, v_dim, dtype, window, owner))
    return pools, kinds, devices


def _state_pools(model: str, layers: list[Any], devices: list[torch.device | None]) -> list[StatePool]:
    groups: dict[tuple[StateTensor, ...], list[int]] = {}
    for index, layer in enumerate(layers):
        if not isinstance(layer, LinearAttentionLayer):
            continue
        tensors = tuple(_state_tensors(model, index, layer))
        if not tensors:
            raise UnsupportedModelError(
                f"{model}: linear-attention layer {index} holds no state after forward"
            )
        groups.setdefault(tensors, []).append(index)
        first = layer.conv_states.get(0)
        if first is None:
            first = layer.recurrent_states.get(0)
        devices[index] = first.device if devices[index] is None else devices[index]
    return [
        StatePool("state" if n == 0 else f"state_{n}", tuple(ids), tensors)
        for n, (tensors, ids) in enumerate(groups.items())
    ]


def _state_tensors(model: str, index: int, layer: LinearAttentionLayer) -> Iterable[StateTensor]:
    count = layer.number_of_states
    for source, values, initialized in (
        ("conv", layer.conv_states, layer.is_conv_states_initialized),
        ("recurrent", layer.recurrent_states, layer.is_recurrent_states_initialized),
    ):
        for state in range(count):
            if not initialized[state]:
                continue
            tensor = values[state]
            if tensor is None or tensor.dim() < 2 or tensor.shape[0] != 1:
                raise UnsupportedModelError(
                    f"{model}: layer {index} {source} state {state} is not a [1, ...] tensor"
                )
            name = source if count == 1 else f"{source}_{state}"
            yield StateTensor(name, source, state, tuple(tensor.shape[1:]), tensor.dtype)  # type: ignore[arg-type]


def _kind(layer: Any) -> str:
    if isinstance(layer, DummyLayer):
        return "none"
    if isinstance(layer, LinearAttentionAndFullAttentionLayer):
        return "attention+state"
    if isinstance(layer, LinearAttentionLayer):
        return "state"
    if isinstance(layer, DynamicSlidingWindowLayer):
        return f"window {layer.sliding_window}"
    return "attention"
