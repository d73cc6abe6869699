"""Optional Prometheus exporter of a cache's metrics (``pip install 'kvstrata[metrics]'``).

A custom collector reads :meth:`CacheMetrics.snapshot` at scrape time, so the data path pays
nothing for it: no per-page counters, no background thread besides the HTTP server.

    from kvstrata.prometheus import serve_metrics
    serve_metrics(cache, port=9464)          # http://127.0.0.1:9464/metrics
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvstrata.core.metrics import CacheMetrics
from kvstrata.plugins.errors import MissingDependencyError

INSTALL = "pip install 'kvstrata[metrics]'"


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise MissingDependencyError("exporter", "prometheus", "prometheus_client", INSTALL) from None
    return prometheus_client


class CacheCollector:
    """Exposes one cache's counters as ``kvstrata_*`` metric families, labelled by ``cache``."""

    def __init__(self, metrics: CacheMetrics, cache: str = "default") -> None:
        self.metrics = metrics
        self.cache = cache
        _client()
        from prometheus_client import core

        self._core = core

    def describe(self) -> list[Any]:
        return []  # collected lazily: nothing to pre-register

    def collect(self) -> Iterator[Any]:
        core = self._core
        snap = self.metrics.snapshot()
        labels = ["cache"]

        def counter(name: str, doc: str, value: float, **extra: str) -> Any:
            family = core.CounterMetricFamily(name, doc, labels=labels + list(extra))
            family.add_metric([self.cache, *extra.values()], value)
            return family

        yield counter("kvstrata_requests", "Requests admitted", snap["requests"])
        looked_up = "Tokens looked up, in whole pages (a partial page never hits)"
        yield counter("kvstrata_lookup_tokens", looked_up, snap["lookup_tokens"])
        hits = core.CounterMetricFamily(
            "kvstrata_hit_tokens", "Reused tokens per tier", labels=[*labels, "tier"]
        )
        for tier, value in snap["hit_tokens"].items():
            if tier != "total":
                hits.add_metric([self.cache, tier], value)
        yield hits
        moved = core.CounterMetricFamily(
            "kvstrata_bytes", "Bytes moved per direction", labels=[*labels, "direction"]
        )
        for direction, value in snap["bytes"].items():
            moved.add_metric([self.cache, direction], value)
        yield moved
        ops = core.CounterMetricFamily(
            "kvstrata_operations", "Tier operations", labels=[*labels, "operation"]
        )
        for operation, value in snap["operations"].items():
            ops.add_metric([self.cache, operation], value)
        yield ops
        yield counter("kvstrata_failures", "Failed storage operations and backups", snap["failures"])
        skipped = core.CounterMetricFamily(
            "kvstrata_skipped_pages",
            "Pages the host tier or L3 could have served but did not, by reason",
            labels=[*labels, "reason"],
        )
        for reason, value in snap["skipped_pages"].items():
            skipped.add_metric([self.cache, reason], value)
        yield skipped
        evicted = core.CounterMetricFamily(
            "kvstrata_evicted_units", "Units that left a tier by eviction", labels=[*labels, "tier", "pool"]
        )
        for tier, pools in snap["evicted_units"].items():
            for pool, value in pools.items():
                evicted.add_metric([self.cache, tier, pool], value)
        yield evicted
        yield counter(
            "kvstrata_corrupt_objects", "Objects the integrity check refused", snap["corrupt_detected"]
        )
        storage = core.CounterMetricFamily(
            "kvstrata_storage_events",
            "Storage engine counters (foreign_objects, breaker_trips, put_failed, ...)",
            labels=[*labels, "event"],
        )
        for event, value in snap["storage"].items():
            storage.add_metric([self.cache, event], value)
        yield storage
        latency = core.SummaryMetricFamily(
            "kvstrata_latency_seconds", "Latency of match / load-back / prefetch", labels=[*labels, "kind"]
        )
        # count and sum over every sample ever recorded (the sample window is bounded): a
        # Prometheus summary's count and sum must only grow, or a scrape reads a counter reset
        for kind, count in snap["latency_count"].items():
            latency.add_metric([self.cache, kind], count_value=count, sum_value=snap["latency_sum_s"][kind])
        yield latency


def register(metrics: CacheMetrics, registry: Any | None = None, cache: str = "default") -> CacheCollector:
    """Register a collector for ``metrics`` on ``registry`` (default: the global registry)."""
    client = _client()
    collector = CacheCollector(metrics, cache)
    (registry if registry is not None else client.REGISTRY).register(collector)
    return collector


def serve_metrics(cache: Any, port: int, addr: str = "127.0.0.1", name: str = "default") -> CacheCollector:
    """Register ``cache.metrics`` and serve ``/metrics`` on ``addr:port`` (a daemon thread)."""
    client = _client()
    registry = client.CollectorRegistry()
    collector = register(cache.metrics, registry, name)
    client.start_http_server(port, addr=addr, registry=registry)
    return collector
