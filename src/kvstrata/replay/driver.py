"""The replay driver: plays a trace through the real tier controller, as an inference engine would,
and checks every restored byte.

Per request: ``lookup`` (device/host match, L3 prefetch) -> ``admit`` (prefetch commit, load-back)
-> verify every unit of every pool that the cached prefix hands to the engine -> ``allocate`` the
units of the pages the engine "computes" -> fill them with their expected content -> ``insert``
(backup, L3 write, eviction happen inside the controller).

Content is a pure function of (namespace, pool, buffer, layer, page identity) where the page
identity is the chained page hash (for node-state pools: the hash of the last page of the prefix
the state belongs to); see :mod:`kvstrata.replay.content`. So a page restored from host, from
storage, or from another process's L3 writes is checked without keeping a copy, and a page of the
wrong prefix, model, pool or layer reads as corrupt (``corrupt_pages_served``, which must stay 0).

Fill and verify are batched: one vectorised expression per buffer per request over all its units
and layers (chunked to bound temporaries), never a Python loop over pages or bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.core.buffers import PoolBuffers
from kvstrata.core.collective import LocalCollective
from kvstrata.core.config import KvstrataConfig
from kvstrata.core.controller import CacheController, CacheFullError
from kvstrata.core.stack import PoolKind
from kvstrata.plugins.host import PluginHost
from kvstrata.plugins.pool_type import BufferSpec, Granularity
from kvstrata.replay._mix import splitmix64_
from kvstrata.replay.content import ContentIdentity, layer_seed_key, page_identities, word_table
from kvstrata.replay.report import DIRECTIONS, ReplayDetails, ReplayRecorder, ReplayResult
from kvstrata.replay.stop import StopRequest
from kvstrata.replay.tokens import BlockTokenizer
from kvstrata.replay.trace import MOONCAKE_BLOCK_SIZE, TraceRequest

#: Upper bound of the temporaries one fill/verify chunk builds (expected words + gathered words).
_CHUNK_BYTES = 16 << 20

#: Failure kind of a request whose pages did not fit on the device tier (it is not computed).
FAILED_REQUEST = "request failed: device tier full"

#: Requests whose token blocks are generated together (fewer, larger vectorised batches).
_TOKENIZE_AHEAD = 32

ProgressFn = Callable[[int, int], None]


@dataclass
class _BufferContent:
    """Expected-content generator for one buffer of one pool on the device tier."""

    spec: BufferSpec
    view: torch.Tensor  # (units, layers, words) in ``word`` integers
    layer_keys: torch.Tensor  # (layers,) int64: per-layer seed keys (content.unit_seeds, batched)
    table: torch.Tensor  # (layers, words64) int64 per-position words (content.word_table)
    byte_view: bool  # True: ``view`` is uint8 and expected words are truncated to layer bytes
    rows: int  # units per fill/verify chunk (bounds the temporaries at _CHUNK_BYTES)

    def expected(self, page_ids: torch.Tensor) -> torch.Tensor:
        """``(n, layers, words)`` expected content of ``page_ids`` in the dtype of :attr:`view`."""
        seeds = splitmix64_(page_ids.reshape(-1, 1) ^ self.layer_keys.reshape(1, -1))  # (n, L)
        words = seeds.unsqueeze(-1) ^ self.table.unsqueeze(0)  # (n, L, W64)
        if not self.byte_view:
            return words
        return words.view(torch.uint8)[..., : self.spec.bytes_per_unit_per_layer]


class PoolContent:
    """Fills and verifies the device units of one pool with the content the replay expects.

    Equivalent, word for word, to :func:`kvstrata.replay.content.fill_units` applied per layer to
    each buffer's ``[units, layer_bytes]`` view; batched over units and layers.
    """

    def __init__(self, namespace: str, pool_name: str, buffers: PoolBuffers) -> None:
        self.pool_name = pool_name
        self.buffers: list[_BufferContent] = []
        self.device = device = buffers.device
        for spec in buffers.spec.buffers:
            layer_bytes = spec.bytes_per_unit_per_layer
            identity = ContentIdentity(namespace, pool_name, spec.name, spec.dtype, layer_bytes)
            keys = torch.tensor(
                [layer_seed_key(identity, layer) for layer in range(spec.layers)],
                dtype=torch.int64,
                device=device,
            )
            table = torch.stack([word_table(identity, layer, device) for layer in range(spec.layers)])
            eight = layer_bytes % 8 == 0 and buffers.word_bytes(spec.name) % 8 == 0
            view = buffers.unit_view(spec.name, 8 if eight else 1)
            rows = max(1, _CHUNK_BYTES // (2 * max(1, table.numel() * 8)))
            self.buffers.append(_BufferContent(spec, view, keys, table, byte_view=not eight, rows=rows))

    def _on_device(self, units: torch.Tensor, page_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if units.numel() != page_ids.numel():
            raise ValueError(
                f"pool {self.pool_name!r}: {units.numel()} units for {page_ids.numel()} page identities"
            )
        return units.to(self.device), page_ids.to(self.device)

    def fill(self, units: torch.Tensor, page_ids: torch.Tensor) -> None:
        """Write the expected content of ``page_ids`` into device ``units`` (every buffer, layer)."""
        index, ids = self._on_device(units, page_ids)
        for content in self.buffers:
            step = content.rows
            for start in range(0, index.numel(), step):
                # index_copy_ on the (units, layers, words) view: ~40x faster than index_put on it
                content.view.index_copy_(
                    0, index[start : start + step], content.expected(ids[start : start + step])
                )

    def verify(self, units: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
        """Positions (into ``units``) whose bytes differ from the expected content in any buffer."""
        index, ids = self._on_device(units, page_ids)
        bad = torch.zeros(units.numel(), dtype=torch.bool, device=self.device)
        for content in self.buffers:
            step = content.rows
            for start in range(0, index.numel(), step):
                got = content.view.index_select(0, index[start : start + step])
                wrong = (got != content.expected(ids[start : start + step])).flatten(1).any(dim=1)
                bad[start : start + step] |= wrong
        return torch.nonzero(bad).reshape(-1).cpu()


class StackContent:
    """:class:`PoolContent` of every pool that holds bytes, and how each pool is keyed."""

    def __init__(self, namespace: str, pools: Any) -> None:
        self.pools: dict[str, PoolContent] = {}
        self.node_state: dict[str, bool] = {}
        for name, pool in pools.pools.items():
            self.add(namespace, name, pool)

    def add(self, namespace: str, name: str, pool: Any) -> None:
        if pool.spec.logical:
            return
        self.pools[name] = PoolContent(namespace, name, pool.device)
        self.node_state[name] = pool.spec.granularity is Granularity.NODE_STATE

    def served_wrong(
        self, cache: CacheController, lease: Any, identities: torch.Tensor
    ) -> set[tuple[str, int]]:
        """``(pool, page)`` of every unit of the lease's cached prefix with wrong bytes, and of
        every unit a pool should hand over but did not (a count mismatch: negative pages). What a
        pool must hold comes from the stack, not from the lease under test: every page, a window
        pool's last ``min(window, cached)`` pages, a state pool one slot. A set, so the steps of a
        chunked request, each checking the whole prefix again, count each wrong unit once."""
        cached, bad = lease.cached_pages, set()
        for name, pool_content in self.pools.items():
            units, first = lease.prefix_units(name), lease.prefix_first_page(name)
            ids = self.page_ids(name, identities, first, cached)
            if units.numel() != ids.numel():  # (a count mismatch is served corruption, not bad input)
                bad.update((name, -1 - k) for k in range(max(units.numel(), ids.numel())))
                continue
            wrong = pool_content.verify(units, ids).tolist()
            if self.node_state[name]:  # its one unit is the state after the last cached page
                if wrong or units.numel() == 0:
                    bad.add((name, cached - 1))
                continue
            bad.update((name, first + position) for position in wrong)
            owner = cache.layout.owner(name)
            window = owner.window if owner.kind is PoolKind.WINDOW else cached
            bad.update((name, page) for page in range(cached - min(window, cached), first))  # not handed over
        return bad

    def page_ids(self, name: str, identities: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """Identities of the units of pages ``[first, end)`` (node-state: the state after ``end-1``)."""
        if end <= first:
            return identities[:0]
        if self.node_state[name]:
            return identities[end - 1 : end]
        return identities[first:end]


def _snapshot_delta(after: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    """The counters of ``after`` minus ``before``; latency lists keep the samples added since
    (counted by ``latency_count``: the lists hold only the newest samples)."""
    if before is None:
        return after
    delta: dict[str, Any] = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, dict):
            delta[key] = _snapshot_delta(value, old if isinstance(old, dict) else None)
        elif isinstance(value, int | float) and isinstance(old, int | float):
            delta[key] = value - old
        else:
            delta[key] = value
    for kind, samples in after.get("latency_s", {}).items():
        added = delta["latency_count"][kind]
        delta["latency_s"][kind] = samples[max(0, len(samples) - added) :] if added else []
    return delta


def replay_with_cache(
    cache: CacheController,
    requests: Sequence[TraceRequest],
    *,
    warmup_fraction: float = 0.0,
    progress: ProgressFn | None = None,
    verify: bool = True,
    tokenizer: BlockTokenizer | None = None,
    baseline_hit_rate: float | None = None,
    baseline_label: str | None = None,
    state_checkpoint_tokens: int | None = MOONCAKE_BLOCK_SIZE,
    chunk_pages: int | None = None,
    stop: StopRequest | None = None,
) -> tuple[ReplayResult, ReplayDetails]:
    """Replay ``requests`` through an open controller; returns the result and the details.

    ``state_checkpoint_tokens``: stacks with node-state pools (Mamba) only hit where a state was
    stored, and a request stores one state, after its last page. The next turn of a conversation
    shares the request's prefix only up to its last whole trace block, so the driver does what an
    engine with chunked prefill does: it first serves the request up to its last multiple of
    ``state_checkpoint_tokens`` (storing that state), then the whole request. The request's
    reuse is what either step found cached past what the first inserted (the pages after the
    checkpoint an identical earlier request stored count too); only the first lookup is an
    access an eviction policy hears (the second looks up with ``record=False``). None disables
    it; stacks without node-state pools never split.

    ``chunk_pages``: serve every request in chunks of that many pages instead (an engine's
    chunked prefill that stores a state at every chunk end), so each request queues one L3 write
    per chunk, each below the last; with small tiers this is the path where a queued write's
    state and window units must outlive host eviction (issue 29). Overrides the checkpoint split.
    A request's hits are the pages each chunk found cached past the request's own earlier
    chunks (what the cache held when it arrived); a wrong unit counts once, however many
    chunks' checks see it.

    The first ``int(len(requests) * warmup_fraction)`` requests only warm the cache: hits, bytes,
    failures and latencies are counted from the first measured request on (controller metrics as
    deltas). The warm-up's L3 writes are flushed before the measured part starts, and
    everything still in flight is flushed before the clock stops.

    ``stop``: checked before each request; once requested, the replay ends there and the
    details say after how many requests (``interrupted_after``) and how many L3 write batches
    were still in flight and got flushed (``writes_flushed_on_stop``).
    """
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"warmup_fraction must be in [0, 1), got {warmup_fraction}")
    if chunk_pages is not None and chunk_pages < 1:
        raise ValueError(f"chunk_pages must be a whole number of pages >= 1, got {chunk_pages}")
    tokenizer = tokenizer or BlockTokenizer(MOONCAKE_BLOCK_SIZE)
    page_size = cache.page_size
    content = StackContent(cache.namespace_root, cache.pools)
    warmup = int(len(requests) * warmup_fraction)
    recorder = ReplayRecorder(warmup)
    before: dict[str, Any] | None = cache.metrics.snapshot() if warmup == 0 else None
    started = time.perf_counter()
    total = len(requests)
    # chunked prefill only for stacks with node-state pools, at a page-aligned step
    step = state_checkpoint_tokens or 0
    if step % page_size or not any(content.node_state.values()):
        step = 0
    allocate_counted = 0  # failed allocations the controller counted itself (measured part)
    if stop is not None:
        stop.pending_writes = lambda: len(cache.writer.pending)
    stopped_at: int | None = None
    written: set[str] = set()  # page keys this run inserted: a storage hit on another is older
    from_earlier = 0  # measured storage-hit pages whose objects an earlier run (or process) wrote
    for index, request in enumerate(requests):
        if stop is not None and stop.requested:
            stopped_at = index
            break
        if index % _TOKENIZE_AHEAD == 0:  # generate the next requests' blocks in one batch
            window = requests[index : index + _TOKENIZE_AHEAD]
            tokenizer.blocks(list(dict.fromkeys(h for r in window for h in r.hash_ids)))
        if index == warmup and warmup:
            cache.flush()  # the warm-up's L3 writes land (bytes, latencies) before measuring starts
            before = cache.metrics.snapshot()
            started = time.perf_counter()
        tokens = tokenizer.request_tokens(request)
        checkpoint = _checkpoint_tokens(request.input_length, page_size, step)
        if chunk_pages:
            ends = [*range(chunk_pages * page_size, len(tokens), chunk_pages * page_size), len(tokens)]
            steps = [_serve(cache, content, tokens[:end], verify, record=end == ends[0]) for end in ends]
            hit_pages, new_storage_keys = _new_hits(steps)
            served = len(set().union(*(s.served for s in steps)))
            full = any(s.full for s in steps)
            short_pools, tier_short = _shortfall(steps)
            counted = sum(s.counted_by_controller for s in steps)
            older = sum(key not in written for key in new_storage_keys)
            for served_step in steps:
                written.update(served_step.inserted_keys)
        elif checkpoint:  # chunked prefill: the state at the last block boundary is stored too
            first = _serve(cache, content, tokens[:checkpoint], verify)
            rest = _serve(cache, content, tokens, verify, record=False)
            hit_pages, new_storage_keys = _new_hits((first, rest))
            served = len(first.served | rest.served)
            full = first.full or rest.full
            short_pools, tier_short = _shortfall((first, rest))
            counted = first.counted_by_controller + rest.counted_by_controller
            older = sum(key not in written for key in new_storage_keys)
            written.update(first.inserted_keys)
            written.update(rest.inserted_keys)
        else:
            outcome = _serve(cache, content, tokens, verify)
            hit_pages, served, full = outcome.hit_pages, len(outcome.served), outcome.full
            short_pools, tier_short = _shortfall((outcome,))
            counted = outcome.counted_by_controller
            older = sum(key not in written for key in outcome.storage_keys)
            written.update(outcome.inserted_keys)
        if served:  # counted in warm-up too: wrong bytes are never excused
            recorder.add_corrupt(served=served)
        if recorder.measuring:
            allocate_counted += counted
            from_earlier += older
        recorder.record_request(
            request.input_length,
            device=hit_pages.get("device", 0) * page_size,
            host=hit_pages.get("host", 0) * page_size,
            storage=hit_pages.get("storage", 0) * page_size,
            failed=FAILED_REQUEST if full else None,
            short_pools=short_pools,
            tier_short=tier_short,
        )
        if progress is not None and ((index + 1) % 16 == 0 or index + 1 == total):
            progress(index + 1, total)
    in_flight = len(cache.writer.pending)
    cache.flush()
    if before is None:  # stopped in the warm-up: nothing was measured, its bytes and times neither
        before, started = cache.metrics.snapshot(), time.perf_counter()
    wall = time.perf_counter() - started
    metrics = _snapshot_delta(cache.metrics.snapshot(), before)
    for direction in DIRECTIONS:
        recorder.add_bytes(direction, int(metrics.get("bytes", {}).get(direction, 0)))
    for kind, samples in metrics.get("latency_s", {}).items():
        for seconds in samples:
            recorder.add_latency(kind, seconds)
        recorder.set_latency_count(kind, int(metrics.get("latency_count", {}).get(kind, len(samples))))
    # A failed allocation is the failed request counted above: the controller's own count of it
    # (when it keeps one) is not a second failure.
    controller_failures = int(metrics.get("failures", 0)) - allocate_counted
    if controller_failures > 0:
        recorder.add_failure("controller", controller_failures)
    recorder.add_corrupt(detected=int(metrics.get("corrupt_detected", 0)))
    recorder.set_storage({k: int(v) for k, v in metrics.get("storage", {}).items() if isinstance(v, int)})
    result, details = recorder.finish(
        wall_s=wall, baseline_hit_rate=baseline_hit_rate, baseline_label=baseline_label
    )
    details.storage_from_earlier_tokens = from_earlier * page_size
    if stopped_at is not None:
        details.interrupted_after = stopped_at
        details.writes_flushed_on_stop = in_flight
    return result, details


def _own_units_short(cache: CacheController, exc: CacheFullError) -> tuple[str, ...]:
    """The pools short of units in ``exc`` whose device units their own ``device_units`` sets
    (not the tier's capacity): the setting a failure summary must name for them."""
    pools = cache.pools.config.model.pools
    if exc.too_long:
        return ()
    return tuple(p for p in exc.short if p in pools and pools[p].device_units is not None)


def _shortfall(steps: Sequence[_Served]) -> tuple[tuple[str, ...], bool]:
    """The pools whose own units ran out in any step of a request, and whether the tier did."""
    pools = tuple(dict.fromkeys(p for step in steps for p in step.short_pools))
    return pools, any(step.tier_short for step in steps)


def _checkpoint_tokens(input_length: int, page_size: int, step: int) -> int:
    """Tokens of the chunked-prefill checkpoint of a request, or 0 when it is served whole."""
    if not step:
        return 0
    checkpoint = input_length // step * step
    return checkpoint if checkpoint > 0 and checkpoint // page_size < input_length // page_size else 0


@dataclass(frozen=True)
class _Served:
    """What one engine step reports back to the replay loop."""

    hit_pages: dict[str, int]
    served: set[tuple[str, int]]  # (pool, page) of the units restored with wrong bytes
    full: bool = False  # the device tier could not hold the pages to compute: the request failed
    short_pools: tuple[str, ...] = ()  # when full: pools whose own device_units ran out
    tier_short: bool = False  # when full: the tier's capacity ran out (or the request is too long)
    counted_by_controller: int = 0  # 1 when the controller also counted that failed allocation
    storage_keys: Sequence[str] = ()  # page keys of the pages served from L3
    inserted_keys: Sequence[str] = ()  # page keys of the pages this step inserted
    cached_pages: int = 0  # the prefix the cache held (hit_pages' tiers split it in order)


def _new_hits(steps: Sequence[_Served]) -> tuple[dict[str, int], list[str]]:
    """Hit pages per tier of a request served in steps, and the page keys of its storage hits:
    each step's prefix split by tier (device, then host, then storage: ``Lease.hit_pages``
    follows the prefix in that order), counting only pages past what earlier steps already
    counted or inserted -- a later step's hits on the request's own pages are not reuse, but the
    pages the cache held beyond them are (the first step's lookup sees only the first chunk)."""
    hits = {"device": 0, "host": 0, "storage": 0}
    storage_keys: list[str] = []
    counted = 0  # pages [0, counted) are the request's hits or its own inserted pages so far
    for step in steps:
        lo = 0
        for tier in ("device", "host", "storage"):
            hi = lo + step.hit_pages.get(tier, 0)
            new = max(0, hi - max(lo, counted))
            hits[tier] += new
            if tier == "storage" and new:
                storage_keys += step.storage_keys[len(step.storage_keys) - new :]
            lo = hi
        counted = max(counted, step.cached_pages, len(step.inserted_keys))
    return hits, storage_keys


def _serve(
    cache: CacheController, content: StackContent, tokens: torch.Tensor, verify: bool, *, record: bool = True
) -> _Served:
    """One engine step: lookup, admit, verify the cached prefix, allocate, fill, insert.

    ``record=False`` for a request's later steps: their "hits" are its own earlier steps, and
    an eviction policy hears one access per request, as from an engine."""
    lease = cache.lookup(tokens, record=record)
    try:
        cache.admit(lease)
        cached, pages = lease.cached_pages, lease.pages
        hit_pages = dict(lease.hit_pages)
        above = hit_pages.get("device", 0) + hit_pages.get("host", 0)
        from_storage = hit_pages.get("storage", 0)
        storage_keys = lease.page_hashes[above : above + from_storage] if from_storage else ()
        identities = page_identities(lease.page_hashes, device=cache.pools.device)
        served = content.served_wrong(cache, lease, identities) if verify and cached else set()
        failures_before = cache.metrics.failures
        try:
            allocated = cache.allocate(lease)
        except CacheFullError as exc:
            counted = int(cache.metrics.failures > failures_before)
            own = _own_units_short(cache, exc)
            return _Served(
                hit_pages,
                served,
                full=True,
                counted_by_controller=counted,
                storage_keys=storage_keys,
                cached_pages=cached,
                short_pools=own,
                tier_short=exc.too_long or not own or len(own) < len(exc.short),
            )
        for name, units in allocated.items():
            if name in content.pools and units.numel():
                first = lease.allocated_first_page(name)
                ids = content.page_ids(name, identities, first, pages)
                content.pools[name].fill(units, ids)
        if verify and cached:  # again as the engine computes: its own allocation must not touch the prefix
            served |= content.served_wrong(cache, lease, identities)
        inserted = lease.page_hashes[:pages]
        cache.insert(lease)
        lease = None
        return _Served(
            hit_pages, served, storage_keys=storage_keys, inserted_keys=inserted, cached_pages=cached
        )
    finally:
        if lease is not None:  # allocation failed or an exception: unlock, free what was taken
            cache.release(lease)


def run_replay_detailed(
    config: KvstrataConfig, plugins: PluginHost, requests: Sequence[TraceRequest], **options: Any
) -> tuple[ReplayResult, ReplayDetails]:
    """Build a controller from ``config``, replay ``requests`` through it (``options`` as for
    :func:`replay_with_cache`), close it."""
    # a replay is one process serving alone, whatever ranks the config names
    with CacheController(config, plugins, collective=LocalCollective()) as cache:
        return replay_with_cache(cache, requests, **options)


def run_replay(
    config: KvstrataConfig, plugins: PluginHost, requests: Sequence[TraceRequest], **options: Any
) -> ReplayResult:
    """Replay a trace through a fresh controller; the JSON-contract result only."""
    return run_replay_detailed(config, plugins, requests, **options)[0]


__all__ = [
    "PoolContent",
    "StackContent",
    "StopRequest",
    "replay_with_cache",
    "run_replay",
    "run_replay_detailed",
]
