"""Hit-rate simulator at block granularity: the controller's prefix tree and eviction policy,
without bytes. The reference for ``replay`` and the bench for eviction policies.

It drives the same :class:`~kvstrata.core.tree.PrefixTree` the controller's tiers use, with a
trace's hash ids as page keys (each names a prefix, so equal ids are shared prefixes), and ranks
evictions with the same policy objects (``policy.eviction`` / ``--eviction``): no copy of either.
Per request, as the controller does with one device tier:

- the hit is the longest run of the request's leading *full* blocks held in the cache (the match
  also tells the policy of the access: one event per request), counted in tokens (512 per block);
  a trailing partial block is never cached, as a page-granular cache never holds it, but its
  tokens count in the denominator;
- the prefix stays locked while room is made for the missing full blocks (evicting what the
  policy ranks lowest, never the request's own prefix), then those blocks are inserted; a
  request with more new blocks than the whole capacity is not inserted (the controller refuses
  it as well);
- the first ``warmup_fraction`` of requests only warm the cache and are left out of the counts.

``belady`` (``needs_future``) gets the trace's future accesses here and nowhere else: it is the
offline optimum the online policies are measured against. With an unlimited cache the full
conversation trace gives 36.6 % (paper: 40 %, which also counts partial blocks); with 3M tokens
LRU gives 14.3 %.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from kvstrata.core.policies import make_policy, policy_config
from kvstrata.core.tree import PrefixTree, Tier
from kvstrata.plugins import PluginHost
from kvstrata.plugins.eviction_policy import NEVER, EvictionPolicy, PolicyContext
from kvstrata.plugins.pool_type import (
    Granularity,
    HitRule,
    HitRuleKind,
    Layout,
    PartialHit,
    PoolRole,
    PoolSpec,
    Replication,
)
from kvstrata.replay.figure import save_figure
from kvstrata.replay.trace import MOONCAKE_BLOCK_SIZE, TraceRequest

#: the one (byte-less) pool of the simulated tree: one unit per trace block
BLOCKS = "blocks"
#: the policy a simulation runs unless told otherwise
DEFAULT_POLICY = "lru"


class SimulationConfig(BaseModel):
    """What ``kvstrata simulate`` accepts; user-facing, so unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid")

    block_size: int = Field(MOONCAKE_BLOCK_SIZE, ge=1, description="tokens per trace hash block")
    capacity_tokens: int | None = Field(None, ge=0, description="cache size; None = unlimited")
    warmup_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="leading share that only warms")
    eviction: str | dict[str, Any] = Field(
        DEFAULT_POLICY, description="eviction policy: a name or a mapping with `type` and options"
    )


class SimulationResult(BaseModel):
    """Token-weighted outcome over the measured (post-warm-up) requests."""

    model_config = ConfigDict(extra="forbid")

    config: SimulationConfig
    eviction: str = Field(description="the eviction policy's name")
    requests: int = Field(description="requests read, warm-up included")
    warmup_requests: int
    measured_requests: int
    tokens: int = Field(description="input tokens of the measured requests")
    hit_tokens: int
    hit_rate: float = Field(description="hit_tokens / tokens (0 when no tokens)")
    unique_blocks: int = Field(description="distinct full blocks seen")
    evicted_blocks: int
    refused_requests: int = Field(0, description="requests with more new blocks than the capacity")
    per_request_hits: list[int] = Field(default_factory=list, description="hit tokens of every request")
    per_request_tokens: list[int] = Field(default_factory=list, description="input tokens of every request")


def block_spec(block_size: int) -> PoolSpec:
    """The simulated tree's only pool: an anchor without bytes, one unit per block."""
    return PoolSpec(
        name=BLOCKS,
        pool_type="blocks",
        role=PoolRole.ANCHOR,
        granularity=Granularity.TOKEN_PAGES,
        hit_rule=HitRule(kind=HitRuleKind.ALL_PAGES),
        partial_hit=PartialHit.CLAMP,
        replication=Replication.REPLICATED,
        page_size=block_size,
        layouts=tuple(Layout),
    )


class TraceFuture:
    """Future accesses of a trace for offline policies: for each block, the requests holding it."""

    def __init__(self, requests: Sequence[TraceRequest], block_size: int) -> None:
        self.now = -1
        self._uses: dict[Hashable, list[int]] = {}
        self._next: dict[Hashable, int] = {}  # index into _uses[key] of the first use after now
        for index, request in enumerate(requests):
            for key in full_blocks(request, block_size):
                self._uses.setdefault(key, []).append(index)

    def next_use(self, key: Hashable) -> int:
        uses = self._uses.get(key)
        if uses is None:
            return NEVER
        i = self._next.get(key, 0)
        while i < len(uses) and uses[i] <= self.now:
            i += 1
        self._next[key] = i
        return uses[i] if i < len(uses) else NEVER


def full_blocks(request: TraceRequest, block_size: int) -> tuple[int, ...]:
    """The request's full blocks (a page-granular cache never holds the partial last one)."""
    return request.hash_ids[: request.input_length // block_size]


def capacity_blocks(capacity_tokens: int | None, block_size: int) -> int | None:
    """Whole blocks a capacity holds, rounded up as ``tiers.*.capacity_tokens`` is: the simulated
    tier is the tier ``replay`` would build from the same number (None: unlimited)."""
    return None if capacity_tokens is None else -(-capacity_tokens // block_size)


class HitRateSimulator:
    """The prefix tree of one tier with a capacity in blocks; feed requests with :meth:`access`."""

    def __init__(
        self,
        block_size: int = MOONCAKE_BLOCK_SIZE,
        capacity_tokens: int | None = None,
        policy: EvictionPolicy | None = None,
    ) -> None:
        self.block_size = block_size
        self.capacity = capacity_blocks(capacity_tokens, block_size)
        self.tree = PrefixTree([block_spec(block_size)])
        if policy is not None:
            self.tree.set_eviction_order(Tier.DEVICE, policy)
        self.used = 0  # blocks held
        self.evicted_blocks = 0
        self.refused = 0
        self._seen: set[Hashable] = set()
        self._units = torch.zeros(1024, dtype=torch.int64)  # block values: the tree needs indices

    @property
    def used_tokens(self) -> int:
        return self.used * self.block_size

    @property
    def unique_blocks(self) -> int:
        return len(self._seen)

    def lookup(self, request: TraceRequest) -> int:
        """Hit tokens of ``request`` without changing the cache (no access, no split, no stamp)."""
        keys = full_blocks(request, self.block_size)
        node, matched = self.tree.root, 0
        while matched < len(keys):
            child = node.children.get(keys[matched])
            if child is None:
                break
            same = 0
            while (
                same < len(child.keys)
                and matched + same < len(keys)
                and child.keys[same] == keys[matched + same]
            ):
                same += 1
            matched += same
            if same < len(child.keys):
                break
            node = child
        return matched * self.block_size

    def access(self, request: TraceRequest) -> int:
        """Serve one request: match (an access), make room, insert its missing full blocks.
        Returns its hit tokens."""
        keys = list(full_blocks(request, self.block_size))
        tree = self.tree
        match = tree.match(keys)
        cached = match.device_pages
        new = len(keys) - cached
        if new:
            self._seen.update(keys[cached:])
            if not self._make_room(new, match.device_node if cached else None, cached):
                self.refused += 1
                return cached * self.block_size
            if len(self._units) < new:
                self._units = torch.zeros(2 * new, dtype=torch.int64)
            above = match.device_node if cached else None
            result = tree.insert(keys[cached:], {BLOCKS: self._units[:new]}, at=above)
            self.used += result.new_pages
        return cached * self.block_size

    def _make_room(self, new: int, prefix: Any, cached: int) -> bool:
        """Evict until ``new`` blocks fit, with the request's prefix locked (as its lease is); a
        request whose ``cached`` prefix and new blocks exceed the tier is refused before anything
        is evicted for it (as the cache's ``allocate`` refuses it)."""
        if self.capacity is None:
            return True
        if cached + new > self.capacity:
            return False
        short = self.used + new - self.capacity
        if short <= 0:
            return True
        lock = self.tree.lock(prefix) if prefix is not None else None
        try:
            freed = self.tree.evict_device({BLOCKS: short}).units.get(BLOCKS, 0)
        finally:
            if lock is not None:
                self.tree.unlock(lock)
        self.used -= freed
        self.evicted_blocks += freed
        return self.used + new <= self.capacity


def simulation_policy(
    config: SimulationConfig, host: PluginHost | None = None, future: TraceFuture | None = None
) -> EvictionPolicy:
    """The configured policy for one simulated tier; offline policies get ``future``."""
    host = host or PluginHost()
    settings = policy_config(host, config.eviction)
    capacity = capacity_blocks(config.capacity_tokens, config.block_size)
    context = PolicyContext(
        tier=Tier.DEVICE.value,
        capacity_pages=1 << 40 if capacity is None else capacity,
        page_size=config.block_size,
        page_bytes=1,
    )
    policy = make_policy(host, settings, context)
    if policy.capabilities.needs_future:
        if future is None:
            raise ValueError(f"eviction policy {settings.type!r} needs the trace's future accesses")
        policy.bind_future(future)
    return policy


def simulate(
    requests: Iterable[TraceRequest],
    config: SimulationConfig | None = None,
    *,
    progress: Callable[[int], None] | None = None,
    host: PluginHost | None = None,
) -> SimulationResult:
    """Run the simulation; ``progress(n)`` is called every 256 requests and at the end."""
    config = config or SimulationConfig()
    trace = list(requests)
    warmup = int(len(trace) * config.warmup_fraction)
    future = TraceFuture(trace, config.block_size) if _needs_future(config, host) else None
    policy = simulation_policy(config, host, future)
    sim = HitRateSimulator(config.block_size, config.capacity_tokens, policy)
    hits: list[int] = []
    sizes: list[int] = []
    for index, request in enumerate(trace):
        if future is not None:
            future.now = index
        hits.append(sim.access(request))
        sizes.append(request.input_length)
        if progress is not None and (index + 1) % 256 == 0:
            progress(index + 1)
    if progress is not None:
        progress(len(trace))
    tokens = sum(sizes[warmup:])
    hit_tokens = sum(hits[warmup:])
    return SimulationResult(
        config=config,
        eviction=policy.name,
        requests=len(trace),
        warmup_requests=warmup,
        measured_requests=len(trace) - warmup,
        tokens=tokens,
        hit_tokens=hit_tokens,
        hit_rate=hit_tokens / tokens if tokens else 0.0,
        unique_blocks=sim.unique_blocks,
        evicted_blocks=sim.evicted_blocks,
        refused_requests=sim.refused,
        per_request_hits=hits,
        per_request_tokens=sizes,
    )


def _needs_future(config: SimulationConfig, host: PluginHost | None) -> bool:
    settings = policy_config(host or PluginHost(), config.eviction)
    return (host or PluginHost()).eviction_policies.get(settings.type).capabilities.needs_future


# --- sweeps -------------------------------------------------------------------------------------


def sweep(
    requests: Sequence[TraceRequest],
    policies: Sequence[str | Mapping[str, Any]],
    capacities: Sequence[int],
    *,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    host: PluginHost | None = None,
    warmup_fraction: float = 0.0,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[float]]:
    """Hit rate per policy (by name) at each capacity in tokens (``warmup_fraction``: as in
    :class:`SimulationConfig`, the leading share of requests that only warm each cache).
    ``progress(done, total)`` counts requests simulated over every run of the sweep (one run per
    policy and capacity): several policies at 8 capacities on a full trace take minutes."""
    host = host or PluginHost()
    out: dict[str, list[float]] = {}
    total = len(policies) * len(capacities) * len(requests)
    done = 0
    for policy in policies:
        name = policy_config(host, policy).type
        out[name] = []
        for capacity in capacities:
            config = SimulationConfig(
                block_size=block_size,
                capacity_tokens=capacity,
                eviction=policy,
                warmup_fraction=warmup_fraction,
            )
            report = None if progress is None else _offset_progress(progress, done, total)
            out[name].append(simulate(requests, config, host=host, progress=report).hit_rate)
            done += len(requests)
    return out


def _offset_progress(progress: Callable[[int, int], None], before: int, total: int) -> Callable[[int], None]:
    """One run's ``progress(n)`` as the sweep's ``progress(before + n, total)``."""
    return lambda n: progress(before + n, total)


def plot_sweep(
    rates: Mapping[str, Sequence[float]], capacities: Sequence[int], path: str | Path, *, title: str
) -> None:
    """Hit rate against capacity, one line per policy, into one PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    millions = [c / 1e6 for c in capacities]
    for name, values in rates.items():
        style = "--" if name == "belady" else "-"
        ax.plot(millions, [100 * v for v in values], style, marker="o", markersize=3, label=name)
    ax.set_xlabel("cache capacity (million tokens)")
    ax.set_ylabel("prefix hit rate (% of input tokens)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        save_figure(fig, Path(path))
    finally:
        plt.close(fig)
