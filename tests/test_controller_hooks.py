"""Lifecycle events reach pluggy hook plugins: per batch or operation, never per page."""

from __future__ import annotations

from pathlib import Path

from controller_support import open_cache, serve, tokens
from kvstrata import hookimpl
from kvstrata.plugins import PluginHost


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    @hookimpl
    def kvstrata_configure(self, config) -> None:
        self.events.append(("configure", {"model": config.model.name}))

    @hookimpl
    def kvstrata_backend_opened(self, instance, backend, capabilities) -> None:
        self.events.append(("opened", {"instance": instance}))

    @hookimpl
    def kvstrata_pages_stored(self, instance, pool, pages, nbytes) -> None:
        self.events.append(("stored", {"pool": pool, "pages": pages}))

    @hookimpl
    def kvstrata_prefetch_committed(self, request_id, tokens, pools) -> None:
        self.events.append(("prefetched", {"tokens": tokens}))

    @hookimpl
    def kvstrata_eviction(self, tier, pool, units) -> None:
        self.events.append(("evicted", {"tier": tier, "pool": pool}))

    @hookimpl
    def kvstrata_backend_closing(self, instance, backend) -> None:
        self.events.append(("closing", {"instance": instance}))


def test_hooks_see_configure_store_prefetch_eviction_and_close(tmp_path: Path) -> None:
    host = PluginHost()
    recorder = Recorder()
    host.register_plugin(recorder, "recorder")
    with open_cache("kv", tmp_path, host=host) as cache:
        for i in range(6):
            serve(cache, tokens(70 + i, 4))  # 24 pages on a 16-page device tier: evictions
        cache.flush()
    with open_cache("kv", tmp_path, ["policy.prefetch.policy=wait_complete"], host=PluginHost()) as cold:
        cold.plugins.register_plugin(recorder, "recorder")
        lease, _ = serve(cold, tokens(70, 4))
        assert lease.hit_pages["storage"] == 4
    names = [name for name, _ in recorder.events]
    assert names[:2] == ["configure", "opened"] and names.count("closing") == 2
    stored = [e for name, e in recorder.events if name == "stored"]
    assert sum(e["pages"] for e in stored) == 24 and len(stored) == 6, "one event per batch, not per page"
    assert ("evicted", {"tier": "device", "pool": "kv"}) in recorder.events
    assert ("prefetched", {"tokens": 256}) in recorder.events
