"""The replay's result: the JSON model (exact keys, a stable contract for scripts and CI), a
recorder the replay driver feeds per request, a rich summary table and an optional plot.

The JSON has exactly the keys of :class:`ReplayResult`; everything else the summary shows
(latency percentiles, failure kinds, per-request timeline, simulator baseline) lives in
:class:`ReplayDetails` so adding detail never changes the machine-readable contract.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvstrata.core.metrics import DIRECTIONS as _DIRECTIONS
from kvstrata.core.metrics import LATENCIES
from kvstrata.core.metrics import TIERS as _TIERS
from kvstrata.plugins.errors import KvstrataError
from kvstrata.replay.figure import save_figure

Tier = Literal["device", "host", "storage"]
Direction = Literal["device_to_host", "host_to_device", "host_to_storage", "storage_to_host"]
# the controller's own names (kvstrata.core.metrics), so report and metrics cannot drift apart
TIERS: tuple[Tier, ...] = _TIERS  # type: ignore[assignment]
DIRECTIONS: tuple[Direction, ...] = _DIRECTIONS  # type: ignore[assignment]
#: Operations whose latency the summary reports.
LATENCY_KINDS = LATENCIES
PLOT_INSTALL = "pip install 'kvstrata[plot]'"


class HitRates(BaseModel):
    """Token-weighted hit rates (fractions of all input tokens) by the tier that served them."""

    model_config = ConfigDict(extra="forbid")

    device: float = Field(ge=0.0, le=1.0)
    host: float = Field(ge=0.0, le=1.0)
    storage: float = Field(ge=0.0, le=1.0)
    total: float = Field(ge=0.0, le=1.0)


class ByteCounts(BaseModel):
    """Bytes moved per direction between tiers."""

    model_config = ConfigDict(extra="forbid")

    device_to_host: int = Field(0, ge=0)
    host_to_device: int = Field(0, ge=0)
    host_to_storage: int = Field(0, ge=0)
    storage_to_host: int = Field(0, ge=0)


class ReplayResult(BaseModel):
    """What ``kvstrata replay --json`` writes: exactly these top-level keys."""

    model_config = ConfigDict(extra="forbid")

    requests: int = Field(ge=0, description="measured requests (warm-up excluded)")
    tokens: int = Field(ge=0, description="input tokens of the measured requests")
    hit_rate: HitRates
    bytes: ByteCounts
    corrupt_pages_detected: int = Field(ge=0, description="objects the integrity check refused")
    corrupt_pages_served: int = Field(ge=0, description="restored pages whose bytes were wrong")
    failures: int = Field(ge=0, description="failed operations")
    wall_s: float = Field(ge=0.0)
    tokens_per_s: float = Field(ge=0.0)

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)


class LatencySummary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float


class ReplayDetails(BaseModel):
    """Everything beyond the JSON contract: for the summary table and the plot."""

    model_config = ConfigDict(extra="forbid")

    warmup_requests: int = 0
    latencies: dict[str, LatencySummary] = Field(default_factory=dict)
    failures_by_kind: dict[str, int] = Field(default_factory=dict)
    #: per measured request: input tokens and hit tokens per tier (same order as requests)
    timeline_tokens: list[int] = Field(default_factory=list)
    timeline_hits: dict[str, list[int]] = Field(default_factory=dict)
    #: the reference simulator's total hit rate for the same trace, when computed
    baseline_hit_rate: float | None = None
    baseline_label: str | None = None
    #: measured requests that could not be served (not computed, not in the throughput)
    failed_requests: int = 0
    #: input tokens of the longest failed request (what the tier would have to hold)
    longest_failed_tokens: int = 0
    #: per pool with ``device_units`` of its own: failed requests that pool had too few units for
    #: (the tier's capacity was not what ran out; empty: every failure was the tier's)
    failed_pool_units: dict[str, int] = Field(default_factory=dict)
    #: failed requests the device tier's capacity could not hold (with ``failed_pool_units``)
    failed_tier_requests: int = 0
    #: the storage engine's counters over the measured part (put_failed, breaker_rejected ...)
    storage: dict[str, int] = Field(default_factory=dict)
    #: measured storage-hit tokens whose objects this run did not write: an earlier run (or
    #: another process) left them, so the storage hit rate depends on what it left
    storage_from_earlier_tokens: int = 0
    #: requests replayed before a stop was requested (None: the replay ran to the end)
    interrupted_after: int | None = None
    #: L3 write batches in flight when the replay stopped, flushed before it returned
    writes_flushed_on_stop: int = 0


class ReplayRecorder:
    """Accumulates per-request outcomes; the replay driver calls it, :meth:`finish` builds results.

    Not thread-safe by design: the driver records from its own loop, never from I/O threads.
    """

    def __init__(self, warmup_requests: int = 0) -> None:
        self.warmup_requests = warmup_requests
        self._seen = 0
        self._tokens: list[int] = []
        self._hits: dict[str, list[int]] = {tier: [] for tier in TIERS}
        self._bytes: Counter[str] = Counter()
        self._latency: dict[str, list[float]] = {}
        self._latency_count: dict[str, int] = {}
        self._failures: Counter[str] = Counter()
        self._failed_requests = 0
        self._failed_tokens = 0
        self._longest_failed = 0
        self._pool_units: Counter[str] = Counter()
        self._tier_failed = 0
        self.corrupt_pages_detected = 0
        self.corrupt_pages_served = 0
        self._storage: dict[str, int] = {}

    @property
    def measuring(self) -> bool:
        """False while warm-up requests are being recorded (they count towards nothing)."""
        return self._seen >= self.warmup_requests

    def record_request(
        self,
        tokens: int,
        device: int = 0,
        host: int = 0,
        storage: int = 0,
        failed: str | None = None,
        short_pools: Sequence[str] = (),
        tier_short: bool = False,
    ) -> None:
        """One request: its input tokens and how many leading tokens each tier served; ``failed``
        names why it could not be served (it then counts as a failure, not as throughput).
        ``short_pools``: the pools whose own ``device_units`` ran out for it; the failure is the
        tier's (``tiers.device.capacity_tokens``) when ``tier_short`` or when none is named."""
        if min(tokens, device, host, storage) < 0 or device + host + storage > tokens:
            raise ValueError(
                f"inconsistent hits for a request of {tokens} tokens: device={device}, host={host}, "
                f"storage={storage}"
            )
        measuring = self.measuring
        self._seen += 1
        if not measuring:
            return
        self._tokens.append(tokens)
        for tier, value in zip(TIERS, (device, host, storage), strict=True):
            self._hits[tier].append(value)
        if failed is not None:
            self._failures[failed] += 1
            self._failed_requests += 1
            self._failed_tokens += tokens
            self._longest_failed = max(self._longest_failed, tokens)
            self._pool_units.update(short_pools)
            self._tier_failed += int(tier_short or not short_pools)

    def add_bytes(self, direction: Direction, nbytes: int) -> None:
        if direction not in DIRECTIONS:
            raise ValueError(f"unknown direction {direction!r}; expected one of {', '.join(DIRECTIONS)}")
        self._bytes[direction] += nbytes

    def add_latency(self, kind: str, seconds: float) -> None:
        self._latency.setdefault(kind, []).append(seconds)

    def set_latency_count(self, kind: str, operations: int) -> None:
        """How many ``kind`` operations were measured: the metrics keep only the newest samples
        (``LATENCY_SAMPLES``), so the percentiles read those and the count says how many ran."""
        self._latency_count[kind] = operations

    def add_failure(self, kind: str, count: int = 1) -> None:
        self._failures[kind] += count

    def set_storage(self, counters: dict[str, int]) -> None:
        self._storage = dict(counters)

    def add_corrupt(self, detected: int = 0, served: int = 0) -> None:
        self.corrupt_pages_detected += detected
        self.corrupt_pages_served += served

    def finish(
        self,
        wall_s: float,
        baseline_hit_rate: float | None = None,
        baseline_label: str | None = None,
    ) -> tuple[ReplayResult, ReplayDetails]:
        """Build the result; ``wall_s`` is the measured part's wall time (the driver's clock)."""
        wall = wall_s
        tokens = sum(self._tokens)
        per_tier = {tier: sum(hits) for tier, hits in self._hits.items()}

        def frac(n: int) -> float:
            return n / tokens if tokens else 0.0

        result = ReplayResult(
            requests=len(self._tokens),
            tokens=tokens,
            hit_rate=HitRates(
                **{tier: frac(per_tier[tier]) for tier in TIERS}, total=frac(sum(per_tier.values()))
            ),
            bytes=ByteCounts(**{d: self._bytes[d] for d in DIRECTIONS}),
            corrupt_pages_detected=self.corrupt_pages_detected,
            corrupt_pages_served=self.corrupt_pages_served,
            failures=sum(self._failures.values()),
            wall_s=wall,
            # only served requests count: a failed request computed nothing
            tokens_per_s=(tokens - self._failed_tokens) / wall if wall > 0 else 0.0,
        )
        counts = self._latency_count
        details = ReplayDetails(
            warmup_requests=min(self.warmup_requests, self._seen),
            latencies={k: summarize_latency(v, counts.get(k)) for k, v in self._latency.items() if v},
            failures_by_kind=dict(self._failures),
            timeline_tokens=list(self._tokens),
            timeline_hits={tier: list(hits) for tier, hits in self._hits.items()},
            baseline_hit_rate=baseline_hit_rate,
            baseline_label=baseline_label,
            failed_requests=self._failed_requests,
            longest_failed_tokens=self._longest_failed,
            failed_pool_units=dict(self._pool_units),
            failed_tier_requests=self._tier_failed,
            storage=self._storage,
        )
        return result, details


def summarize_latency(samples_s: Sequence[float], operations: int | None = None) -> LatencySummary:
    """Percentiles of ``samples_s``; ``count`` is ``operations`` where more ran than were kept."""
    ms = np.asarray(samples_s, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    count = max(ms.size, operations or 0)
    return LatencySummary(count=count, p50_ms=p50, p90_ms=p90, p99_ms=p99, max_ms=float(ms.max()))


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def render_summary(
    result: ReplayResult, details: ReplayDetails | None = None, console: Console | None = None
) -> None:
    """Print the replay summary: hit rates, bytes, throughput, latencies, failures, corruption."""
    console = console or Console()
    details = details or ReplayDetails()
    hits = Table(title="hit rate (token-weighted)", title_justify="left")
    hits.add_column("tier")
    hits.add_column("hit rate", justify="right")
    hits.add_column("tokens", justify="right")
    for tier in (*TIERS, "total"):
        rate = getattr(result.hit_rate, tier)
        style = "bold" if tier == "total" else ""
        hits.add_row(
            tier, f"[{style}]{rate:.2%}[/]" if style else f"{rate:.2%}", f"{round(rate * result.tokens):,}"
        )
        if tier == "storage" and details.storage_from_earlier_tokens:
            earlier = details.storage_from_earlier_tokens
            share = earlier / result.tokens if result.tokens else 0.0
            hits.add_row("  of which from an earlier run", f"{share:.2%}", f"{earlier:,}")
    if details.baseline_hit_rate is not None:
        label = details.baseline_label or "reference simulator"
        hits.add_row(f"[dim]{label}[/]", f"[dim]{details.baseline_hit_rate:.2%}[/]", "")
    console.print(hits)
    if details.storage_from_earlier_tokens:
        console.print(
            f"{details.storage_from_earlier_tokens:,} tokens came from L3 objects an earlier run (or "
            "another process) wrote, so this run's hit rate depends on what it left; the reference "
            "simulator sees this trace alone. --fresh replays against an empty L3.",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )

    moved = Table(title="bytes moved", title_justify="left")
    moved.add_column("direction")
    moved.add_column("bytes", justify="right")
    moved.add_column("GiB/s over wall", justify="right")
    for direction in DIRECTIONS:
        n = getattr(result.bytes, direction)
        rate = n / result.wall_s / 2**30 if result.wall_s > 0 else 0.0
        moved.add_row(direction.replace("_", " "), _human_bytes(n), f"{rate:.3f}")
    console.print(moved)

    if details.latencies:
        lat = Table(title="latency (ms)", title_justify="left")
        for column in ("operation", "count", "p50", "p90", "p99", "max"):
            lat.add_column(column, justify="left" if column == "operation" else "right")
        ordered = [k for k in LATENCY_KINDS if k in details.latencies] + sorted(
            k for k in details.latencies if k not in LATENCY_KINDS
        )
        for kind in ordered:
            s = details.latencies[kind]
            lat.add_row(
                kind,
                f"{s.count:,}",
                f"{s.p50_ms:.3f}",
                f"{s.p90_ms:.3f}",
                f"{s.p99_ms:.3f}",
                f"{s.max_ms:.3f}",
            )
        console.print(lat)

    totals = Table(title="run", title_justify="left", show_header=False)
    totals.add_column("what")
    totals.add_column("value", justify="right")
    served_requests = result.requests - details.failed_requests
    req_per_s = served_requests / result.wall_s if result.wall_s > 0 else 0.0
    totals.add_row("requests (measured)", f"{result.requests:,}")
    if details.warmup_requests:
        totals.add_row("warm-up requests", f"{details.warmup_requests:,}")
    totals.add_row("input tokens", f"{result.tokens:,}")
    totals.add_row("wall time (measured requests; start-up, warm-up excluded)", f"{result.wall_s:.2f} s")
    totals.add_row(
        "throughput (served requests)", f"{req_per_s:,.1f} req/s, {result.tokens_per_s:,.0f} tokens/s"
    )
    fail_style = "red" if result.failures else "green"
    kinds = ", ".join(f"{k}: {v}" for k, v in sorted(details.failures_by_kind.items()))
    totals.add_row("failures", f"[{fail_style}]{result.failures}[/]" + (f" ({kinds})" if kinds else ""))
    totals.add_row("corrupt_pages_detected", f"{result.corrupt_pages_detected}")
    served_style = "red bold" if result.corrupt_pages_served else "green"
    totals.add_row("corrupt_pages_served", f"[{served_style}]{result.corrupt_pages_served}[/]")
    console.print(totals)
    if details.failed_requests:
        console.print(f"[bold red]{escape(failed_requests_sentence(result, details))}[/]")


def failed_requests_sentence(
    result: ReplayResult, details: ReplayDetails, capacity_tokens: int | None = None
) -> str:
    """One sentence: how many requests failed, why, and the setting that fixes it: a pool's own
    ``device_units`` where those ran out (raising the tier's capacity would change nothing),
    ``tiers.device.capacity_tokens`` where the tier did."""
    held = f" ({capacity_tokens:,} tokens)" if capacity_tokens is not None else ""
    head = f"{details.failed_requests:,} of {result.requests:,} requests FAILED: "
    tier = (
        f"the device tier{held} cannot hold a whole request (the longest failed one has "
        f"{details.longest_failed_tokens:,} tokens); raise tiers.device.capacity_tokens above that"
    )
    if not details.failed_pool_units:
        return head + tier
    pools = "; ".join(
        f"pool {pool!r} had no device unit left for {count:,} of them (its own device_units ran out, "
        f"not the tier); raise model.pools.{pool}.device_units"
        for pool, count in sorted(details.failed_pool_units.items())
    )
    if details.failed_tier_requests:
        pools += f"; for {details.failed_tier_requests:,} of them " + tier
    return head + pools


#: Storage counters the failure summary names (when not zero), in this order.
_STORAGE_FAILURE_COUNTERS = ("put_failed", "backend_errors", "breaker_trips", "breaker_rejected")


def corruption_sentence(result: ReplayResult) -> str | None:
    """The loud line of a run that handed wrong bytes to the engine (None when it did not)."""
    if not result.corrupt_pages_served:
        return None
    return (
        f"CORRUPT DATA SERVED: {result.corrupt_pages_served:,} restored pages had wrong bytes "
        "(corrupt_pages_served); an engine would have computed with them. This is never tolerated: "
        "keep the L3 directory and the command line for a bug report"
    )


def failed_operations_sentence(result: ReplayResult, details: ReplayDetails) -> str | None:
    """One sentence on the failed operations other than failed requests (None when none): how
    many, of which kind, and the storage counters behind them."""
    operations = result.failures - details.failed_requests
    if operations <= 0:
        return None
    kinds = ", ".join(
        f"{kind}: {n:,}"
        for kind, n in sorted(details.failures_by_kind.items())
        if not kind.startswith("request")
    )
    storage = ", ".join(
        f"{name} {details.storage[name]:,}" for name in _STORAGE_FAILURE_COUNTERS if details.storage.get(name)
    )
    return (
        f"{operations:,} operations FAILED ({kinds}"
        + (f"; storage: {storage}" if storage else "")
        + "): the cache kept serving from the tiers that worked, but did not do all it was asked"
    )


class PlotUnavailableError(KvstrataError):
    """matplotlib is not installed; the message names the extra to install."""


def plot_hit_rates(
    details: ReplayDetails, out: str | Path, *, window: int | None = None, title: str | None = None
) -> Path:
    """Draw cumulative (top) and windowed (bottom) token-weighted hit rate per tier to a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailableError(f"--plot needs matplotlib: run `{PLOT_INSTALL}`") from None
    tokens = np.asarray(details.timeline_tokens, dtype=np.float64)
    if tokens.size == 0:
        raise ValueError("nothing to plot: no measured requests")
    hits = {
        tier: np.asarray(details.timeline_hits.get(tier, [0] * tokens.size), dtype=np.float64)
        for tier in TIERS
    }
    window = window or max(1, min(500, tokens.size // 10))
    x = np.arange(details.warmup_requests + 1, details.warmup_requests + tokens.size + 1)
    colors = {"device": "tab:green", "host": "tab:blue", "storage": "tab:orange"}

    fig, (ax_cum, ax_win) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, constrained_layout=True)
    cum_tokens = np.cumsum(tokens)
    cum_win = np.convolve(tokens, np.ones(window), mode="full")[: tokens.size]
    stack_cum = np.zeros_like(tokens)
    stack_win = np.zeros_like(tokens)
    for tier in TIERS:
        prev_cum, prev_win = stack_cum.copy(), stack_win.copy()
        stack_cum += np.cumsum(hits[tier]) / cum_tokens
        stack_win += np.convolve(hits[tier], np.ones(window), mode="full")[: tokens.size] / cum_win
        ax_cum.fill_between(
            x, prev_cum * 100, stack_cum * 100, color=colors[tier], alpha=0.6, label=tier, lw=0
        )
        ax_win.fill_between(
            x, prev_win * 100, stack_win * 100, color=colors[tier], alpha=0.6, label=tier, lw=0
        )
    ax_cum.plot(x, stack_cum * 100, color="black", lw=1.0, label="total")
    ax_win.plot(x, stack_win * 100, color="black", lw=0.8, label="total")
    if details.baseline_hit_rate is not None:
        ax_cum.axhline(
            details.baseline_hit_rate * 100,
            color="gray",
            ls="--",
            lw=1,
            label=details.baseline_label or "reference simulator",
        )
    ax_cum.set_ylabel("cumulative hit rate (%)")
    ax_win.set_ylabel(f"hit rate, last {window} req. (%)")
    ax_win.set_xlabel("request")
    peak = float(max(stack_cum.max(), stack_win.max(), details.baseline_hit_rate or 0.0)) * 100
    top = min(100.0, max(10.0, np.ceil(peak * 1.25 / 10) * 10))  # room for the legend, no dead space
    for ax in (ax_cum, ax_win):
        ax.set_ylim(0, top)
        ax.grid(alpha=0.3)
    ax_cum.legend(loc="upper left", ncols=5, fontsize="small")
    ax_cum.set_title(title or "kvstrata replay: token-weighted hit rate by tier (stacked)")
    path = Path(out)
    try:  # whole or not at all: an interrupted write left half a PNG under the user's name
        save_figure(fig, path)
    finally:
        plt.close(fig)
    return path
