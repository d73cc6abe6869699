"""Lifecycle events reach pluggy hook plugins: per batch or operation, never per page."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest

from controller_support import host_units_held_by_tree, host_units_in_use, open_cache, serve, tokens
from kvstrata import hookimpl
from kvstrata.eviction_policies.lru import LruPolicy
from kvstrata.plugins import EvictionPolicyConfig, PluginHost, PolicyCapabilities


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.evicted: dict[tuple[str, str], int] = {}

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
        self.evicted[(tier, pool)] = self.evicted.get((tier, pool), 0) + units

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
        counted = cache.metrics.snapshot()["evicted_units"]  # the metrics say what the hook heard
        assert counted == {"device": {"kv": recorder.evicted[("device", "kv")]}, "host": {}}
        assert counted["device"]["kv"] >= 8
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


class Broken:
    """An observer that raises in every event (a metrics plugin with a bug)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _fail(self, event: str) -> None:
        self.calls.append(event)
        raise RuntimeError(f"observer bug in {event}")

    @hookimpl
    def kvstrata_backend_opened(self, instance, backend, capabilities) -> None:
        self._fail("opened")

    @hookimpl
    def kvstrata_prefetch_committed(self, request_id, tokens, pools) -> None:
        self._fail("prefetched")

    @hookimpl
    def kvstrata_eviction(self, tier, pool, units) -> None:
        self._fail("evicted")

    @hookimpl
    def kvstrata_backend_closing(self, instance, backend) -> None:
        self._fail("closing")


def device_units_in_use(cache) -> dict[str, int]:
    return {
        name: pool.device_allocator.used
        for name, pool in cache.pools.pools.items()
        if pool.device_allocator is not None and pool.index_owner == name
    }


def test_an_observer_that_raises_fails_no_operation_and_leaks_nothing(tmp_path: Path) -> None:
    # a raising eviction observer once escaped from allocate() after its units were taken
    # (window extras evict out-of-window data): they were in no lease and no node, for good
    broken = Broken()
    closed: list[str] = []
    for example, overrides in (("swa", ["tiers.device.capacity_tokens=512"]), ("hybrid-mamba", [])):
        host = PluginHost()
        host.register_plugin(broken, "broken")
        with open_cache(example, tmp_path / example, overrides, host=host) as cache:
            for i in range(8):
                _, bad = serve(cache, tokens(90 + i, 4))  # more pages than the device holds
                assert bad == 0
            cache.flush()
            held = {name: cache.tree.units(name, "device") for name in cache.tree_pools}
            assert device_units_in_use(cache) == held, "every device unit in use is the tree's"
            assert host_units_in_use(cache) == host_units_held_by_tree(cache)
            backend = cache.parts.backend
            backend.close = lambda backend=backend, example=example: closed.append(example)  # type: ignore[method-assign]
        cold_host = PluginHost()
        cold_host.register_plugin(broken, "broken")
        with open_cache(
            example, tmp_path / example, ["policy.prefetch.policy=wait_complete"], host=cold_host
        ) as cold:
            lease, bad = serve(cold, tokens(97, 4))
            assert lease.hit_pages["storage"] == 4 and bad == 0
    assert {"opened", "evicted", "prefetched", "closing"} <= set(broken.calls)
    assert closed == ["swa", "hybrid-mamba"], "a raising backend_closing observer skipped backend.close()"


def test_an_observer_that_raises_silences_no_other_plugin(tmp_path: Path, caplog) -> None:
    # one `try` around the whole pluggy call: the first plugin to raise ended the event for all
    # (a working metrics plugin heard nothing); a raising configure hook failed every open
    broken, recorder = Broken(), Recorder()

    class BrokenConfigure:
        @hookimpl
        def kvstrata_configure(self, config) -> None:
            raise ValueError("configure bug")

    for first_broken in (True, False):  # pluggy calls the last registered first
        host = PluginHost()
        plugins = [("broken", broken), ("configure", BrokenConfigure()), ("recorder", recorder)]
        for name, plugin in plugins if first_broken else plugins[::-1]:
            host.register_plugin(plugin, name)
        recorder.events.clear()
        with open_cache("kv", tmp_path / str(first_broken), host=host) as cache:
            for i in range(6):
                serve(cache, tokens(70 + i, 4))  # evictions
        names = [name for name, _ in recorder.events]
        assert names[:2] == ["configure", "opened"] and "evicted" in names and "closing" in names
    assert "kvstrata plugin 'broken': hook kvstrata_eviction raised RuntimeError: observer bug" in caplog.text
    assert "kvstrata plugin 'configure': hook kvstrata_configure raised ValueError" in caplog.text


class _RefusingConfig(EvictionPolicyConfig):
    type: Literal["refuses_host"] = "refuses_host"


class _RefusingPolicy(LruPolicy):
    """A policy plugin whose constructor refuses the host tier: the cache's start-up fails after
    its backend opened."""

    name = "refuses_host"
    Config = _RefusingConfig
    capabilities = PolicyCapabilities()

    def __init__(self, config: EvictionPolicyConfig, context) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, context)
        if context.tier == "host":
            raise RuntimeError("this policy has no host tier support")


def test_a_backend_opened_for_a_cache_that_fails_to_start_is_announced_closing(tmp_path: Path) -> None:
    """An observer counting open backends heard ``kvstrata_backend_opened`` and then, when the
    start-up failed past it (here a policy plugin raised), never ``kvstrata_backend_closing``,
    though the backend was closed: the backend stayed open for it for good."""
    host = PluginHost()
    host.eviction_policies.register(_RefusingPolicy)
    recorder = Recorder()
    host.register_plugin(recorder, "recorder")
    with pytest.raises(RuntimeError, match="no host tier support"):
        open_cache("kv", tmp_path, ["policy.eviction=refuses_host"], host=host)
    names = [name for name, _ in recorder.events]
    assert names == ["configure", "opened", "closing"]
