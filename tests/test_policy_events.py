"""A third-party eviction policy whose events raise never fails a cache operation (audit s35).

Events are delivered from inside the tree's operations, after the tree changed: an ``inserted``
that raised out of ``insert`` left the pages indexed by the tree but still pending in the lease,
so the engine's ``release`` of the failed request freed units the tree served, and the next
request's writes became the cached prefix's bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import pytest

from controller_support import device_accounting, open_cache, serve, tokens
from kvstrata.plugins import PluginHost
from kvstrata.plugins.eviction_policy import EvictionPolicy, EvictionPolicyConfig, PolicyCapabilities


class _Config(EvictionPolicyConfig):
    type: Literal["raising_events"] = "raising_events"


class RaisingEvents(EvictionPolicy):
    """LRU that hears events, each of which raises (a policy's bug)."""

    name = "raising_events"
    Config = _Config
    capabilities = PolicyCapabilities(events=True)
    calls: ClassVar[list[str]] = []

    def ranked(self, entries: Sequence[Any]) -> list[tuple[float, int, Any]]:
        return [(node.last_access, node.id, node) for node in entries]

    def _boom(self, event: str) -> None:
        RaisingEvents.calls.append(event)
        raise RuntimeError(f"policy bug in {event}()")

    def inserted(self, entries: Sequence[Any]) -> None:
        self._boom("inserted")

    def accessed(self, entries: Sequence[Any]) -> None:
        self._boom("accessed")

    def split(self, upper: Any, lower: Any) -> None:
        self._boom("split")

    def removed(self, entries: Sequence[Any]) -> None:
        self._boom("removed")


def test_a_policy_whose_events_raise_fails_no_operation_and_serves_every_prefix_exactly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host = PluginHost()
    host.eviction_policies.register(RaisingEvents)
    RaisingEvents.calls.clear()
    caplog.set_level(logging.WARNING, logger="kvstrata.core.policy_events")
    with open_cache("kv", overrides=["policy.eviction=raising_events"], host=host) as cache:
        first = tokens(70, 3)
        serve(cache, first)  # inserted() raised inside insert: the insert still completes
        device_accounting(cache, [])
        # shared prefixes (splits), then enough others to evict (removed)
        for seed in range(8):
            serve(cache, tokens(80 + seed, 5))
            _, bad = serve(cache, tokens(80 + seed, 3))
            assert bad == 0
        _, bad = serve(cache, first)
        assert bad == 0
        device_accounting(cache, [])
    assert {"inserted", "accessed", "split", "removed"} <= set(RaisingEvents.calls)
    warned = [r.getMessage() for r in caplog.records if "raised in" in r.getMessage()]
    assert len(set(warned)) == len(warned) <= 8  # once per tier and event, not per call
    assert len(RaisingEvents.calls) > len(warned)
