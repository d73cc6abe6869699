"""The optional Prometheus exporter shows the cache's counters at scrape time."""

from __future__ import annotations

import urllib.request

import pytest

from controller_support import open_cache, serve, tokens
from kvstrata.prometheus import register, serve_metrics
from kvstrata.testing.mooncake_servers import free_loopback_port


def test_exporter_reports_hits_bytes_and_operations() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    with open_cache("kv") as cache:
        registry = CollectorRegistry()
        register(cache.metrics, registry, cache="replay")
        request = tokens(60, 3)
        serve(cache, request)
        serve(cache, request)
        text = generate_latest(registry).decode()
    assert 'kvstrata_hit_tokens_total{cache="replay",tier="device"} 192.0' in text
    assert 'kvstrata_requests_total{cache="replay"} 2.0' in text
    assert 'kvstrata_operations_total{cache="replay",operation="backups"} 1.0' in text
    assert 'kvstrata_latency_seconds_count{cache="replay",kind="match"} 2.0' in text


def test_exporter_reports_evictions_per_tier_and_pool() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    with open_cache("kv", overrides=["tiers.device.capacity_tokens=256"]) as cache:  # 4 pages
        registry = CollectorRegistry()
        register(cache.metrics, registry, cache="replay")
        for seed in range(3):
            serve(cache, tokens(62 + seed, 2))  # 6 pages through 4: 2 leave the device
        text = generate_latest(registry).decode()
    assert 'kvstrata_evicted_units_total{cache="replay",pool="kv",tier="device"} 2.0' in text


def test_exporter_serves_http_on_loopback() -> None:
    with open_cache("kv") as cache:
        port = free_loopback_port()
        serve_metrics(cache, port)
        serve(cache, tokens(61, 2))
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'kvstrata_lookup_tokens_total{cache="default"} 128.0' in body


def test_exporter_reports_skips_and_storage_events(tmp_path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    with open_cache("kv", tmp_path) as cache:
        registry = CollectorRegistry()
        register(cache.metrics, registry, cache="l3")
        serve(cache, tokens(61, 3))
        cache.flush()
        lease = cache.lookup(tokens(62, 2), prefetch="off")
        cache.release(lease)
        text = generate_latest(registry).decode()
    assert 'kvstrata_skipped_pages_total{cache="l3",reason="disabled"} 2.0' in text
    assert 'kvstrata_storage_events_total{cache="l3",event="put_units"} 3.0' in text
    assert 'kvstrata_storage_events_total{cache="l3",event="breaker_trips"} 0.0' in text


def test_latency_summary_count_and_sum_only_grow_past_the_sample_window() -> None:
    """The sample window keeps the newest samples only; the summary's count and sum must still
    cover every sample ever recorded, or Prometheus reads a counter reset (issue 28)."""
    from prometheus_client import CollectorRegistry

    from kvstrata.core.metrics import LATENCY_SAMPLES, CacheMetrics

    metrics = CacheMetrics()
    registry = CollectorRegistry()
    register(metrics, registry, cache="c")
    seen = []
    for _ in range(3):
        for _ in range(LATENCY_SAMPLES // 2 + 1):
            metrics.latency("match", 0.5)
        count = registry.get_sample_value("kvstrata_latency_seconds_count", {"cache": "c", "kind": "match"})
        total = registry.get_sample_value("kvstrata_latency_seconds_sum", {"cache": "c", "kind": "match"})
        seen.append((count, total))
    assert [c for c, _ in seen] == [(LATENCY_SAMPLES // 2 + 1) * n for n in (1, 2, 3)]
    assert seen[2][1] == 0.5 * seen[2][0] > seen[1][1] > seen[0][1]


def test_two_caches_share_one_registry_through_one_collector() -> None:
    """A target and a draft model in one process: each family once, one sample per cache (an
    exposition with a family twice is invalid: the OpenMetrics parser refuses it); a second
    collector on the same registry and a name already exported are refused."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    with open_cache("kv") as target, open_cache("kv") as draft:
        registry = CollectorRegistry()
        collector = register(target.metrics, registry, cache="target")
        with pytest.raises(ValueError, match=r"collector\.add\(metrics, 'draft'\)"):
            register(draft.metrics, registry, cache="draft")
        collector.add(draft.metrics, "draft")
        with pytest.raises(ValueError, match="'draft' is already exported"):
            collector.add(target.metrics, "draft")
        serve(target, tokens(61, 2))
        serve(draft, tokens(62, 3))
        serve(draft, tokens(63, 1))
        text = generate_latest(registry).decode()
        families = {f.name: f for f in text_string_to_metric_families(openmetrics_latest(registry).decode())}
    assert text.count("# TYPE kvstrata_requests_total counter") == 1
    assert 'kvstrata_requests_total{cache="target"} 1.0' in text
    assert 'kvstrata_requests_total{cache="draft"} 2.0' in text
    lookups = {
        s.labels["cache"]: s.value
        for s in families["kvstrata_lookup_tokens"].samples
        if s.name.endswith("_total")
    }
    assert lookups == {"target": 128.0, "draft": 256.0}


def test_a_cache_added_while_a_scrape_runs_does_not_fail_that_scrape() -> None:
    """README: a draft model joins the endpoint with ``collector.add``, from the application
    thread, while the server thread may be inside ``collect``: the scrape iterated the dict
    ``add`` grew ("dictionary changed size during iteration"). A scrape copies no latency
    windows either (it exports counts and sums)."""
    import threading

    from prometheus_client import CollectorRegistry, generate_latest

    from kvstrata.core.metrics import CacheMetrics

    inside, resume = threading.Event(), threading.Event()

    class Slow(CacheMetrics):
        """Holds the scrape inside its snapshot until the other cache is added."""

        def snapshot(self, *, samples: bool = True) -> dict:
            assert not samples  # the collector leaves the latency windows out
            inside.set()
            resume.wait(10)
            return super().snapshot(samples=samples)

    registry = CollectorRegistry()
    collector = register(Slow(), registry, cache="target")
    errors: list[BaseException] = []

    def scrape() -> None:
        try:
            generate_latest(registry)
        except BaseException as exc:  # the assertion reports it
            errors.append(exc)

    thread = threading.Thread(target=scrape)
    thread.start()
    assert inside.wait(10)
    collector.add(CacheMetrics(), "draft")
    resume.set()
    thread.join(10)
    assert not errors, errors
    assert b'kvstrata_requests_total{cache="draft"} 0.0' in generate_latest(registry)  # the next scrape


def test_a_removed_cache_leaves_the_endpoint_and_its_name_can_be_reused() -> None:
    """A process that closes a cache and opens another under the same name (a reload): before
    ``remove`` the closed cache's frozen counters stayed in every scrape and ``add`` refused the
    name for good. An unknown name is refused, naming those exported."""
    from prometheus_client import CollectorRegistry, generate_latest

    with open_cache("kv") as old:
        registry = CollectorRegistry()
        collector = register(old.metrics, registry, cache="target")
        serve(old, tokens(71, 2))
        serve(old, tokens(72, 2))
    assert 'kvstrata_requests_total{cache="target"} 2.0' in generate_latest(registry).decode()
    collector.remove("target")
    assert 'cache="target"' not in generate_latest(registry).decode()
    with pytest.raises(ValueError, match=r"no cache named 'target' is exported.*\[\]"):
        collector.remove("target")
    with open_cache("kv") as new:
        collector.add(new.metrics, "target")
        serve(new, tokens(73, 2))
        text = generate_latest(registry).decode()
    assert 'kvstrata_requests_total{cache="target"} 1.0' in text
    assert text.count("# TYPE kvstrata_requests_total counter") == 1


def test_open_leases_are_a_gauge_in_the_snapshot_and_the_exporter() -> None:
    """An engine that drops leases without insert or release holds their device units until
    close, and only close warned: the snapshot and the exporter now show the count rise."""
    from prometheus_client import CollectorRegistry

    with open_cache("kv") as cache:
        registry = CollectorRegistry()
        register(cache.metrics, registry, cache="c")
        leases = [cache.lookup(tokens(81 + i, 2)) for i in range(3)]
        assert cache.metrics.snapshot()["open_leases"] == 3
        assert registry.get_sample_value("kvstrata_open_leases", {"cache": "c"}) == 3
        cache.allocate(leases[0])
        cache.insert(leases[0])
        cache.release(leases[1])
        assert cache.metrics.snapshot()["open_leases"] == 1 == cache.open_leases
        assert registry.get_sample_value("kvstrata_open_leases", {"cache": "c"}) == 1
        cache.release(leases[2])
    assert cache.metrics.snapshot()["open_leases"] == 0


def test_the_readme_names_every_family_the_exporter_serves_with_its_labels() -> None:
    """README "Metrics" lists the families (``kvstrata_x`` or ``_x``, extra labels in parentheses
    after it): the list and the exporter must name the same families and labels (audit s45)."""
    import re

    from prometheus_client import CollectorRegistry

    from controller_support import REPO

    readme = (REPO / "README.md").read_text()
    start = readme.index("as counters labelled by `cache`")
    text = readme[start : readme.index("a second cache of the process", start)]
    documented = {}
    for name, labels in re.findall(r"`(kvstrata_[a-z_]+|_[a-z_]+)`(?:\s*\(([^)]*)\))?", text):
        if name not in ("_total", "kvstrata_requests_total"):
            full = name if name.startswith("kvstrata_") else "kvstrata" + name
            documented[full] = {"cache", *re.findall(r"`([a-z_]+)`", labels)}
    with open_cache("kv") as cache:
        collector = register(cache.metrics, CollectorRegistry())
        # the labels each family declares (a family without samples has none to read them from)
        served = {family.name: set(family._labelnames) for family in collector.collect()}
    assert documented == served


def test_the_readme_names_every_operation_and_latency_kind() -> None:
    """The ``operation`` and ``kind`` label values (audit s45: ``backups_skipped``,
    ``load_backs`` and the prefetch counts were named nowhere in the docs)."""
    from controller_support import REPO
    from kvstrata.core.metrics import LATENCIES, OPERATIONS

    readme = (REPO / "README.md").read_text()
    missing = [name for name in [*OPERATIONS, *LATENCIES] if f"`{name}`" not in readme]
    assert not missing, f"README Metrics does not name: {missing}"
