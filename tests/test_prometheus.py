"""The optional Prometheus exporter shows the cache's counters at scrape time."""

from __future__ import annotations

import urllib.request

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
