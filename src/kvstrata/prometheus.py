"""Optional Prometheus exporter of a cache's metrics (``pip install 'kvstrata[metrics]'``).

A custom collector reads :meth:`CacheMetrics.snapshot` at scrape time, so the data path pays
nothing for it: no per-page counters, no background thread besides the HTTP server. One collector
serves every cache of a process (a target and a draft model): each family once, one sample per
cache, labelled by ``cache``; an exposition with a family twice is invalid text.

    from kvstrata.prometheus import serve_metrics
    collector = serve_metrics(target, port=9464, name="target")   # http://127.0.0.1:9464/metrics
    collector.add(draft.metrics, "draft")
    collector.remove("draft")          # a closed cache leaves the endpoint; its name is free again
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
    """Exposes the counters of one or more caches as ``kvstrata_*`` metric families, labelled by
    ``cache`` (:meth:`add` another cache: a second collector on the same registry is refused)."""

    def __init__(self, metrics: CacheMetrics, cache: str = "default") -> None:
        _client()
        from prometheus_client import core

        self._core = core
        self.caches: dict[str, CacheMetrics] = {}
        self.add(metrics, cache)

    def add(self, metrics: CacheMetrics, cache: str) -> None:
        """Serve another cache's counters under its own ``cache`` label (a name in use is
        refused: two caches under one label would be one series counted twice)."""
        if cache in self.caches:
            raise ValueError(
                f"a cache named {cache!r} is already exported by this collector: give each cache "
                f"its own name (exported: {sorted(self.caches)})"
            )
        self.caches[cache] = metrics

    def remove(self, cache: str) -> None:
        """Stop serving a cache's counters (a closed cache's would stay frozen in every scrape,
        and a reopened cache could not take its name back). Its series end at the next scrape;
        a cache added again under the name starts its counters from zero, which Prometheus reads
        as a counter reset. An unknown name is refused, naming those exported."""
        if cache not in self.caches:
            raise ValueError(
                f"no cache named {cache!r} is exported by this collector (exported: {sorted(self.caches)})"
            )
        # a new dict, not a deletion: ``collect`` on the server thread copies the one it reads
        self.caches = {name: metrics for name, metrics in self.caches.items() if name != cache}

    def describe(self) -> list[Any]:
        """The family names (values empty): a registry refuses a second collector of them."""
        return list(self._families({name: _EMPTY for name in self.caches}))

    def collect(self) -> Iterator[Any]:
        # a copy: ``add`` may run on the application thread while the server thread scrapes
        caches = list(self.caches.items())
        return self._families({name: metrics.snapshot(samples=False) for name, metrics in caches})

    def _families(self, snaps: dict[str, dict[str, Any]]) -> Iterator[Any]:
        core = self._core
        labels = ["cache"]

        def family(kind: Any, name: str, doc: str, extra: list[str], samples: Any) -> Any:
            made = kind(name, doc, labels=labels + extra)
            for values, value in samples:
                made.add_metric(values, value)
            return made

        def counter(name: str, doc: str, key: str) -> Any:
            return family(core.CounterMetricFamily, name, doc, [], (([c], s[key]) for c, s in snaps.items()))

        def per(name: str, doc: str, label: str, key: str, skip: str = "") -> Any:
            samples = (([c, k], v) for c, s in snaps.items() for k, v in s[key].items() if k != skip)
            return family(core.CounterMetricFamily, name, doc, [label], samples)

        yield counter("kvstrata_requests", "Requests admitted", "requests")
        looked_up = "Tokens looked up, in whole pages (a partial page never hits)"
        yield counter("kvstrata_lookup_tokens", looked_up, "lookup_tokens")
        yield per("kvstrata_hit_tokens", "Reused tokens per tier", "tier", "hit_tokens", skip="total")
        yield per("kvstrata_bytes", "Bytes moved per direction", "direction", "bytes")
        yield per("kvstrata_operations", "Tier operations", "operation", "operations")
        failed = "Failed operations: storage calls, backups and requests that did not complete"
        yield counter("kvstrata_failures", failed, "failures")
        skipped = "Pages the host tier or L3 could have served but did not, by reason"
        yield per("kvstrata_skipped_pages", skipped, "reason", "skipped_pages")
        evicted = core.CounterMetricFamily(
            "kvstrata_evicted_units", "Units that left a tier by eviction", labels=[*labels, "tier", "pool"]
        )
        for cache, snap in snaps.items():
            for tier, pools in snap["evicted_units"].items():
                for pool, value in pools.items():
                    evicted.add_metric([cache, tier, pool], value)
        yield evicted
        yield counter("kvstrata_corrupt_objects", "Objects the integrity check refused", "corrupt_detected")
        held = "Leases looked up and neither inserted nor released (their device units are held)"
        yield family(
            core.GaugeMetricFamily,
            "kvstrata_open_leases",
            held,
            [],
            (([c], s["open_leases"]) for c, s in snaps.items()),
        )
        events = "Storage engine counters (foreign_objects, breaker_trips, put_failed, ...)"
        yield per("kvstrata_storage_events", events, "event", "storage")
        latency = core.SummaryMetricFamily(
            "kvstrata_latency_seconds", "Latency of match / load-back / prefetch", labels=[*labels, "kind"]
        )
        # count and sum over every sample ever recorded (the sample window is bounded): a
        # Prometheus summary's count and sum must only grow, or a scrape reads a counter reset
        for cache, snap in snaps.items():
            for kind, count in snap["latency_count"].items():
                latency.add_metric([cache, kind], count_value=count, sum_value=snap["latency_sum_s"][kind])
        yield latency


#: what :meth:`CacheCollector.describe` reads: every family, no samples
_EMPTY: dict[str, Any] = {
    key: {}
    for key in (
        "hit_tokens",
        "bytes",
        "operations",
        "skipped_pages",
        "evicted_units",
        "storage",
        "latency_count",
    )
} | {"requests": 0, "lookup_tokens": 0, "failures": 0, "corrupt_detected": 0, "open_leases": 0}


def register(metrics: CacheMetrics, registry: Any | None = None, cache: str = "default") -> CacheCollector:
    """Register a collector for ``metrics`` on ``registry`` (default: the global registry).
    Another cache of the process joins through the returned collector's :meth:`~CacheCollector.add`
    (a second collector on one registry would export every family twice: refused)."""
    client = _client()
    collector = CacheCollector(metrics, cache)
    try:
        (registry if registry is not None else client.REGISTRY).register(collector)
    except ValueError as exc:
        raise ValueError(
            "kvstrata_* metric families are already registered on this registry (an earlier register() "
            f"or serve_metrics()): add cache {cache!r} to the collector that call returned, "
            f"collector.add(metrics, {cache!r})"
        ) from exc
    return collector


def serve_metrics(cache: Any, port: int, addr: str = "127.0.0.1", name: str = "default") -> CacheCollector:
    """Serve ``cache.metrics`` (labelled ``cache=name``) on ``addr:port``'s ``/metrics``, from a
    registry of its own (a daemon thread); another cache joins through the returned collector's
    :meth:`~CacheCollector.add`."""
    client = _client()
    registry = client.CollectorRegistry()
    collector = register(cache.metrics, registry, name)
    client.start_http_server(port, addr=addr, registry=registry)
    return collector
