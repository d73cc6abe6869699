"""The Hugging Face cache objects the adapter hands out, and page-wise copies in and out of them.

Two facts of transformers' ``DynamicCache`` shape this module:

* A ``DynamicSlidingWindowLayer`` keeps only the last ``sliding_window - 1`` tokens, so the first
  page of a window is partly gone by the time a chunk is committed (entirely, for a window
  smaller than a page). kvstrata's window pools store whole pages, and a page must hold the
  same bytes whichever prefix later restores it. :class:`PageKeepingSlidingWindowLayer` therefore
  keeps every token from its last commit on, while returning to the model exactly the tensors
  the stock layer returns (same values, contiguous), so logits stay bit-identical.
* A pure state model (Mamba2) has no layer that counts tokens, and no cache records which
  tokens it holds. :class:`KvstrataDynamicCache` records the token ids the model ran through it
  (a forward pre-hook the adapter puts on the model feeds :meth:`~KvstrataDynamicCache.saw`), so
  ``commit`` knows which position the states belong to and refuses ``input_ids`` that are not
  what the cache holds: a commit under the wrong tokens would be a wrong restore later.

Restores copy out of kvstrata's units into tensors the cache owns (``update_conv_state`` and
``update_recurrent_state`` copy into fresh static buffers): the model mutates those in place and
never the cached checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionLayer,
)

from kvstrata.adapters._hf_layout import ModelLayout, StateTensor


class PageKeepingSlidingWindowLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer that also keeps the tokens after ``keep_from`` (whole pages to commit).

    ``update`` returns what :class:`DynamicSlidingWindowLayer` returns; only what stays in
    ``keys`` / ``values`` between forwards differs (a superset of the stock layer's tokens).
    """

    def __init__(self, sliding_window: int, **kwargs: Any) -> None:
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.keep_from = 0  # absolute position of the first token worth keeping beyond the window

    def _stock_kept(self, tokens: int) -> int:
        """Tokens the stock layer keeps after seeing ``tokens`` (its ``[-(w - 1):]`` slice)."""
        window = self.sliding_window - 1
        return tokens if window <= 0 else min(tokens, window)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.record_past:
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        before = self.cumulative_length
        self.cumulative_length += key_states.shape[-2]
        full_keys = torch.cat([self.keys, key_states], dim=-2)
        full_values = torch.cat([self.values, value_states], dim=-2)
        keep = max(self.cumulative_length - self.keep_from, self._stock_kept(self.cumulative_length))
        self.keys = full_keys[:, :, full_keys.shape[-2] - min(keep, full_keys.shape[-2]) :, :]
        self.values = full_values[:, :, full_values.shape[-2] - min(keep, full_values.shape[-2]) :, :]
        visible = self._stock_kept(before) + key_states.shape[-2]
        if visible >= full_keys.shape[-2]:
            return full_keys, full_values
        return full_keys[:, :, -visible:, :].contiguous(), full_values[:, :, -visible:, :].contiguous()

    def trim(self, keep_from: int) -> None:
        """Forget kept tokens before ``keep_from`` (after a commit stored them)."""
        self.keep_from = max(self.keep_from, keep_from)
        if self.keys is None or not self.is_initialized:
            return
        keep = max(self.cumulative_length - self.keep_from, self._stock_kept(self.cumulative_length))
        if keep < self.keys.shape[-2]:
            self.keys = self.keys[:, :, -keep:, :] if keep else self.keys[:, :, :0, :]
            self.values = self.values[:, :, -keep:, :] if keep else self.values[:, :, :0, :]

    def crop(self, tokens_to_remove: int) -> None:
        """The stock crop: ``-n`` drops the ``n`` newest tokens (assisted decoding's rejected
        candidates, kept by past recording), from every token held, kept pages included."""
        n = -tokens_to_remove
        if not n and self.is_initialized:  # (the stock layer's back to its last window: the keep rule)
            self.trim(self.keep_from)
            return
        rollback = self.record_past or self.cumulative_length < self.sliding_window  # (else: stock's error)
        if n > 0 and self.is_initialized and rollback:
            n = min(n, self.keys.shape[-2])
            self.keys = self.keys[:, :, : self.keys.shape[-2] - n, :]
            self.values = self.values[:, :, : self.values.shape[-2] - n, :]
            self.cumulative_length -= n
            self.keep_from = min(self.keep_from, self.cumulative_length)
            self.trim(self.keep_from)  # the stock layer's last window, and the kept pages
            return
        self.trim(self.cumulative_length)  # the stock layer's tokens, then its own rules (errors)
        super().crop(tokens_to_remove)
        self.keep_from = min(self.keep_from, self.cumulative_length)

    def reset(self) -> None:
        super().reset()
        self.keep_from = 0

    def restore(self, keys: torch.Tensor, values: torch.Tensor, tokens: int, keep_from: int) -> None:
        """Hold ``keys`` / ``values`` ``[1, H, t, D]`` as the last tokens of a ``tokens``-long
        prefix, keeping those from ``keep_from`` on (they must be among ``keys``)."""
        if not 0 <= tokens - keep_from <= keys.shape[-2]:
            raise ValueError(f"keep_from {keep_from}: not within the {keys.shape[-2]} tokens restored")
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self.cumulative_length, self.keep_from = tokens, keep_from

    def window_start(self, tokens: int, page: int) -> int:
        """The first token the window of any page-aligned commit after ``tokens`` (page-aligned)
        reaches: a window pool stores the last ``ceil((sliding_window - 1) / page)`` whole pages,
        so a commit whose prefix was evicted (only the window stored) needs them all, the first
        from before ``tokens`` where the window is longer than a page."""
        window_pages = -(-max(self.sliding_window - 1, 1) // page)
        return max(0, tokens - (window_pages - 1) * page)


class KvstrataDynamicCache(DynamicCache):
    """The model's own ``DynamicCache`` with page-keeping window layers and a token count."""

    def __init__(self, config: Any, layout: ModelLayout, owner: object) -> None:
        super().__init__(config=config)
        self.kvstrata_owner = owner
        self._kvstrata_ids: list[torch.Tensor] = []  # the token ids the model ran through it
        self._kvstrata_unknown: str | None = None  # why they are not known (embeddings, batch)
        self._kvstrata_running = False  # a forward began and has not returned (it may have raised)
        self._kvstrata_rows = 1  # sequences per forward (a batch on an empty cache: never committed)
        #: the prompt a restore of a ``cache_params`` model took and the tokens it restored, until
        #: the first forward: ``generate`` skips held tokens only under ``past_key_values``
        self._kvstrata_restored: tuple[torch.Tensor, int] | None = None
        for pool in layout.attention:
            if pool.window is None:
                continue
            for layer_id in pool.layer_ids:
                stock = self.layers[layer_id]
                if type(stock) is not DynamicSlidingWindowLayer:
                    raise TypeError(f"layer {layer_id}: expected a DynamicSlidingWindowLayer, got {stock!r}")
                self.layers[layer_id] = PageKeepingSlidingWindowLayer(sliding_window=stock.sliding_window)

    def saw(
        self, ids: torch.Tensor | None, embeds: torch.Tensor | None, inputs: Mapping[str, Any] | None = None
    ) -> None:
        """Record one forward's input: token ids ``[1, T]``, or embeddings (tokens unknown).
        ``inputs``: the forward's other arguments; a state computed with padding masked out or
        positions shifted is not the state of the bare token ids, so such a cache is never
        committed (a later restore would continue from it as if from those ids)."""
        held = sum(len(t) for t in self._kvstrata_ids)
        batch = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 1
        if batch != self._kvstrata_rows and held:
            raise ValueError(
                f"a forward of a batch of {batch} on a cache holding {held} tokens of "
                f"{self._kvstrata_rows} sequence(s): HFStateCache's caches serve one sequence (beam "
                "search and num_return_sequences > 1 need a cache of their own)"
            )
        if self._kvstrata_restored is not None:
            self._check_not_replayed(ids)
        if batch != 1:  # (an empty cache: a batched generate runs, and is never committed)
            self._kvstrata_unknown, self._kvstrata_rows = f"a forward ran a batch of {batch}", batch
        why = _not_plain(inputs or {}, held)
        if why is not None:
            self._kvstrata_unknown = why
        if isinstance(ids, torch.Tensor):  # (a batch's first sequence: the tokens per sequence)
            row = ids[0] if ids.dim() == 2 and ids.shape[0] else ids.reshape(-1)
            self._kvstrata_ids.append(row.detach().to("cpu", torch.int64))
        elif isinstance(embeds, torch.Tensor):
            self._kvstrata_unknown = "a forward ran on inputs_embeds (token ids unknown)"
            self._kvstrata_ids.append(torch.full((embeds.shape[-2],), -1, dtype=torch.int64))

    def restored(self, prompt: torch.Tensor, tokens: int, cache_argument: str) -> None:
        """:meth:`~kvstrata.adapters.hf.HFStateCache.restore` filled the first ``tokens`` of
        ``prompt`` in: record them, and for a model reading ``cache_params=`` (Mamba, Mamba2)
        check its first forward does not run them again."""
        self.saw(prompt[:tokens].unsqueeze(0), None)
        if tokens and cache_argument != "past_key_values":
            self._kvstrata_restored = (prompt, tokens)

    def _check_not_replayed(self, ids: torch.Tensor | None) -> None:
        """The first forward after a restore of a ``cache_params`` model: ``generate`` cuts the
        tokens a cache holds off the prompt only for ``past_key_values``, so
        ``generate(prompt, cache_params=past)`` ran the restored tokens again on top of their
        state (no error, other tokens out). Refused before the forward: the cache is unchanged."""
        prompt, tokens = self._kvstrata_restored  # type: ignore[misc]
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[-1] < tokens:
            self._kvstrata_restored = None
            return
        row = ids[0].detach().to("cpu", torch.int64)
        # (a repeating prompt's continuation may equal its start: that is the continuation)
        replay = torch.equal(row[:tokens], prompt[:tokens])
        rest = prompt[tokens:]  # (a forward may run on past the ids ``restore`` was given)
        if not replay or torch.equal(row[: len(rest)], rest[: len(row)]):
            self._kvstrata_restored = None
        else:  # (checked again at the next forward: the caller may retry with the cut ids)
            raise ValueError(
                f"input_ids start with the {tokens} tokens the restored cache already holds: a model "
                "that reads its cache from cache_params= is not cut by generate() (only "
                f"past_key_values is), so they would run twice; pass input_ids[:, {tokens}:]"
            )

    def forward_began(self) -> None:
        """A forward whose input :meth:`saw` recorded starts; one that began before and never
        returned raised, and some layers may hold its tokens: the cache is never committed."""
        self._check_finished()
        self._kvstrata_running = True

    def ran_unseen(self, module: str) -> None:
        """``module`` (the model's base) starts a forward on this cache: outside a forward of
        the model the adapter hooks, its tokens go unrecorded (a state model's cache says none
        itself), so the cache is never committed (it would be stored as an earlier state)."""
        if not self._kvstrata_running and self._kvstrata_unknown is None:
            self._kvstrata_unknown = (
                f"a forward ran through {module} directly, not through the model HFStateCache hooks "
                "(its tokens were not recorded)"
            )

    def forward_done(self) -> None:
        """The forward returned: the cache holds the tokens :meth:`saw` recorded."""
        self._kvstrata_running = False

    # (every state layer is read and written through these four: a module outside the hooked
    # model's forward, another copy of the model, moves a state that no token count shows)
    def get_conv_state(self, *args: Any, **kwargs: Any) -> Any:
        self._state_touched()  # (decoding updates the returned tensor in place)
        return super().get_conv_state(*args, **kwargs)

    def get_recurrent_state(self, *args: Any, **kwargs: Any) -> Any:
        self._state_touched()
        return super().get_recurrent_state(*args, **kwargs)

    def update_conv_state(self, *args: Any, **kwargs: Any) -> Any:
        self._state_touched()
        return super().update_conv_state(*args, **kwargs)

    def update_recurrent_state(self, *args: Any, **kwargs: Any) -> Any:
        self._state_touched()
        return super().update_recurrent_state(*args, **kwargs)

    def reset(self) -> None:
        """The stock reset (attention emptied, states zeroed in place): the record of the tokens
        no longer says what the cache holds, so it is never committed (:meth:`new_cache` is the
        empty cache for a new prompt)."""
        super().reset()
        if len(self.kvstrata_tokens) and self._kvstrata_unknown is None:
            self._kvstrata_unknown = "reset() emptied it after tokens ran through it"

    def _state_touched(self) -> None:
        """A state read or written outside a forward of the hooked model: its tokens go
        unrecorded (a pure state model's cache counts none), so the cache is never committed
        (its states would be stored as those of the tokens recorded)."""
        if not self._kvstrata_running and self._kvstrata_unknown is None:
            self._kvstrata_unknown = (
                "its states were read or updated outside a forward of the model HFStateCache hooks "
                "(another module ran on it; its tokens were not recorded)"
            )

    def _check_finished(self) -> None:
        """A forward that began and never returned raised: the cache is marked never to commit."""
        if self._kvstrata_running and self._kvstrata_unknown is None:
            self._kvstrata_unknown = "a forward on it raised (its layers may hold part of that forward)"

    def crop(self, max_length: int) -> None:
        """The stock crop (assisted decoding drops rejected draft tokens), and the record of the
        token ids the cache holds cut to match. ``max_length`` <= 0 removes that many tokens
        (transformers 5: ``crop(0)``, which ``generate`` calls, removes none); a positive one,
        the older meaning, keeps that many."""
        super().crop(max_length)
        held = self.kvstrata_tokens
        keep = len(held) + max_length if max_length <= 0 else max_length
        if 0 <= keep < len(held):
            self._kvstrata_ids = [held[:keep]]

    @property
    def kvstrata_tokens(self) -> torch.Tensor:
        """Every token id the cache holds, in order."""
        if len(self._kvstrata_ids) > 1:
            self._kvstrata_ids = [torch.cat(self._kvstrata_ids)]
        return self._kvstrata_ids[0] if self._kvstrata_ids else torch.empty(0, dtype=torch.int64)

    def held_tokens(self, input_ids: torch.Tensor) -> int:
        """How many tokens the cache holds, after checking they are ``input_ids``' first ones."""
        self._check_finished()
        if self._kvstrata_unknown is not None:
            raise ValueError(f"cannot commit this cache: {self._kvstrata_unknown}")
        held = self.kvstrata_tokens
        overlap = min(len(held), len(input_ids))
        if not torch.equal(held[:overlap], input_ids[:overlap]):
            raise ValueError(
                "input_ids are not the tokens past_key_values holds (they differ at position "
                f"{int((held[:overlap] != input_ids[:overlap]).nonzero()[0])})"
            )
        return len(held)


def tokens_held(past: Any, ids: torch.Tensor, owner: object, has_attention: bool, trust_cache: bool) -> int:
    """Tokens a cache to commit holds. One from the adapter (``owner``) knows which (checked
    against ``ids``); a plain one, taken only with ``trust_cache``, as far as its attention
    layers count (it says neither its tokens nor its model)."""
    if isinstance(past, KvstrataDynamicCache) and past.kvstrata_owner is owner:
        held = past.held_tokens(ids)
        if has_attention and held != past.get_seq_length():
            raise ValueError(
                f"past_key_values holds {past.get_seq_length()} tokens but {held} went through "
                "this model's forward: was it run by another module?"
            )
        return held
    if not trust_cache:
        raise TypeError(
            "a plain DynamicCache does not say which tokens or which model it ran: commit the "
            "cache restore() or new_cache() returned, or pass trust_cache=True to vouch that it "
            "holds input_ids run by this model"
        )
    batches = {layer.keys.shape[0] for layer in past.layers if getattr(layer, "keys", None) is not None}
    if batches - {1}:
        raise ValueError(f"past_key_values holds a batch of {max(batches)}; HFStateCache serves one sequence")
    if has_attention:
        return int(past.get_seq_length())
    raise TypeError(
        "a pure state model's cache does not say which tokens it holds: commit the cache "
        "restore() or new_cache() returned (the adapter records what the model runs through it)"
    )


def _not_plain(inputs: Mapping[str, Any], held: int) -> str | None:
    """Why a forward did not run its tokens plainly after the ``held`` ones (None: it did): an
    attention mask with zeros (padding) or a custom one, positions that do not continue."""
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        if mask.dim() != 2:
            return "a forward ran with a custom attention mask"
        if not bool(mask.all()):
            return "a forward ran with padding (attention_mask holds zeros)"
    for name in ("position_ids", "cache_position"):
        positions = inputs.get(name)
        if isinstance(positions, torch.Tensor) and positions.numel():
            row = positions.reshape(-1, positions.shape[-1])[0].detach().cpu()
            if not torch.equal(row, torch.arange(held, held + len(row), dtype=row.dtype)):
                return f"a forward ran with {name} that do not continue the cache's {held} tokens"
    return None


# --- pages out of an HF cache -----------------------------------------------------------------


def held_range(layer: DynamicLayer) -> tuple[int, int]:
    """Absolute token positions ``[first, end)`` a (window) attention layer still holds."""
    if not layer.is_initialized or layer.keys is None or layer.keys.dim() != 4:
        return 0, 0
    held = layer.keys.shape[-2]
    end = layer.cumulative_length if isinstance(layer, DynamicSlidingWindowLayer) else held
    return end - held, end


def page_tensors(layer: DynamicLayer, first_page: int, end_page: int, page: int) -> dict[str, torch.Tensor]:
    """K/V of pages ``[first_page, end_page)`` as head-major units ``(n, H, page, D)`` (views)."""
    start, _ = held_range(layer)
    lo, hi = first_page * page - start, end_page * page - start
    out = {}
    for name, tensor in (("k", layer.keys), ("v", layer.values)):
        rows = tensor[0, :, lo:hi, :]
        heads, _, dim = rows.shape
        out[name] = rows.reshape(heads, end_page - first_page, page, dim).permute(1, 0, 2, 3)
    return out


def state_tensor(layer: LinearAttentionLayer, state: StateTensor) -> torch.Tensor:
    """One state tensor of a linear-attention layer, without the batch dimension."""
    values = layer.conv_states if state.source == "conv" else layer.recurrent_states
    tensor = values[state.index]
    if tensor is None or tuple(tensor.shape[1:]) != state.shape or tensor.shape[0] != 1:
        shape = None if tensor is None else tuple(tensor.shape)
        raise ValueError(
            f"{state.source} state {state.index} has shape {shape}, expected (1, *{state.shape}) "
            "(a batch of one, not recording past states)"
        )
    return tensor[0]


# --- pages into an HF cache -------------------------------------------------------------------


def joined(pages: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """Head-major units ``(n, H, page, D)`` as one ``[1, H, n * page, D]`` tensor (a copy)."""
    count, heads, page, dim = pages.shape
    rows = pages.to(device) if device is not None else pages
    return rows.permute(1, 0, 2, 3).reshape(1, heads, count * page, dim).contiguous()


def restore_full(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """A full-attention layer holding ``keys`` / ``values`` ``[1, H, T, D]`` (as a forward leaves it)."""
    layer.update(keys, values)


def restore_window(
    layer: PageKeepingSlidingWindowLayer, keys: torch.Tensor, values: torch.Tensor, tokens: int, page: int
) -> None:
    """A window layer at ``tokens``: it holds the tail the stock layer would hold there, and keeps
    from the first page a later commit's window reaches (``window_start``)."""
    tail = layer._stock_kept(tokens)
    layer.restore(
        keys[:, :, keys.shape[-2] - tail :, :],
        values[:, :, values.shape[-2] - tail :, :],
        tokens,
        layer.window_start(tokens, page),
    )


def restore_states(layer: LinearAttentionLayer, states: dict[StateTensor, torch.Tensor]) -> None:
    """Conv / recurrent states through the layer's own update calls (fresh buffers, prefill done)."""
    for state, value in states.items():
        batched = value.unsqueeze(0)
        if state.source == "conv":
            layer.update_conv_state(batched, state_idx=state.index, conv_kernel_size=state.shape[-1])
        else:
            layer.update_recurrent_state(batched, state_idx=state.index)
        layer.has_previous_state[state.index] = True


#: the keywords a causal LM takes its cache under (Mamba2 reads ``cache_params``)
CACHE_KEYWORDS = ("past_key_values", "cache_params")


class ForwardHooks:
    """The hooks an adapter puts on a model: each forward records its tokens in a cache the
    adapter handed out (``owner`` marks those), and a forward of the model's base run directly
    marks such a cache never to commit."""

    def __init__(self, model: torch.nn.Module, cache_argument: str, owner: object) -> None:
        self.model, self.argument, self.owner = model, cache_argument, owner
        self._handles = [
            model.register_forward_pre_hook(self._count_tokens, with_kwargs=True),
            # (runs only when the forward returns: a cache whose forward raised is never committed)
            model.register_forward_hook(self._forward_done, with_kwargs=True),
        ]
        base = getattr(model, "base_model", model)  # ``model.backbone``, ``model.model``
        if base is not model:
            self._handles.append(base.register_forward_pre_hook(self._base_forward, with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def owns(self, cache: Any) -> bool:
        return isinstance(cache, KvstrataDynamicCache) and cache.kvstrata_owner is self.owner

    def _count_tokens(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook: advance the token count of a cache this adapter handed out, passed
        under the keyword the model reads it from. Under the other one the model ignores it
        (Mamba2 takes ``cache_params`` and swallows ``past_key_values``): the forward is refused,
        or the cache would be committed as holding tokens it never ran."""
        argument = self.argument
        cache = kwargs.get(argument)
        if not self.owns(cache):
            strays = (key for key in CACHE_KEYWORDS if key != argument and self.owns(kwargs.get(key)))
            other = next(strays, None)
            if other is not None:
                raise TypeError(
                    f"{type(module).__name__} reads its cache from {argument}=, not {other}=: it would "
                    f"run without the cache HFStateCache handed out (pass {argument}=past)"
                )
            return
        cache.saw(kwargs.get("input_ids", args[0] if args else None), kwargs.get("inputs_embeds"), kwargs)
        cache.forward_began()

    def _base_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook of the model's base: a cache of ours it runs outside the model's own
        forward is marked never to commit (see :meth:`KvstrataDynamicCache.ran_unseen`)."""
        for key in CACHE_KEYWORDS:
            cache = kwargs.get(key)
            if self.owns(cache):
                cache.ran_unseen(
                    f"{type(self.model).__name__}.{getattr(self.model, 'base_model_prefix', 'base')}"
                )

    def _forward_done(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        """Forward hook (not called when the forward raises): the counted tokens are in the cache."""
        cache = kwargs.get(self.argument)
        if self.owns(cache):
            cache.forward_done()
