"""One access per request: a replay that serves a request in several engine steps (the
checkpoint split of hybrid stacks, ``chunk_pages``) still lets an eviction policy hear that
request once, as an engine's request would be heard. The policy is a real one registered
in-process through the plugin hook; it only counts what the tree tells it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import pytest

import kvstrata
from controller_support import EXAMPLES
from kvstrata.core.config import load
from kvstrata.core.controller import CacheController
from kvstrata.eviction_policies.lru import LruPolicy
from kvstrata.plugins import EvictionPolicyConfig, PluginHost, PolicyCapabilities, PolicyContext
from kvstrata.replay.driver import replay_with_cache
from kvstrata.replay.trace import read_trace

REQUESTS = 30


def counting_host(heard: list[int]) -> PluginHost:
    """A host with policy ``counting``: LRU ranks, and every device-tier access is appended to
    ``heard`` (the number of nodes on the request's matched path)."""

    class CountingConfig(EvictionPolicyConfig):
        type: Literal["counting"] = "counting"

    class CountingPolicy(LruPolicy):
        name = "counting"
        Config = CountingConfig
        capabilities = PolicyCapabilities(events=True)

        def __init__(self, config: EvictionPolicyConfig, context: PolicyContext) -> None:
            super().__init__(config, context)
            self.device = context.tier == "device"

        def accessed(self, entries: Sequence[Any]) -> None:
            if self.device:
                heard.append(len(entries))

    class Contributor:
        @kvstrata.hookimpl
        def kvstrata_register_eviction_policies(self, register: Any) -> None:
            register(CountingPolicy)

    host = PluginHost()
    host.register_plugin(Contributor())
    return host


@pytest.mark.parametrize(
    "options",
    [
        {"state_checkpoint_tokens": 512},  # hybrid: the checkpoint, then the whole request
        {"chunk_pages": 2},  # chunked prefill: one engine step per two pages
    ],
    ids=["checkpoint", "chunks"],
)
def test_an_eviction_policy_hears_one_access_per_request(options: dict[str, Any]) -> None:
    heard: list[int] = []
    host = counting_host(heard)
    overrides = ["tiers.storage={}", "model.page_size=128", "policy.eviction={type: counting}"]
    config = load([EXAMPLES["hybrid-mamba"]], overrides=overrides, plugins=host, environ={})
    requests = read_trace(None, limit=REQUESTS)  # the bundled sample: 512-token blocks
    with CacheController(config, host) as cache:
        result, _ = replay_with_cache(cache, requests, **options)
        lookups = len(cache.metrics.snapshot()["latency_s"]["match"])
    assert result.requests == REQUESTS and result.corrupt_pages_served == 0
    assert lookups > REQUESTS  # some requests really were served in several steps
    assert len(heard) == REQUESTS  # ... and each was heard once
    assert result.hit_rate.device > 0 and any(heard)  # the accesses matched cached paths
