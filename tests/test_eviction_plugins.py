"""Eviction policies as plugins: a third-party package found by entry point, in-process
registration, the contract checks, ``policy.eviction`` in configs and in a live cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
import torch

from controller_support import EXAMPLES, REPO, open_cache, serve, tokens
from kvstrata.core.config import load
from kvstrata.core.controller import CacheController
from kvstrata.core.tree import Tier
from kvstrata.plugins import (
    ConfigError,
    EvictionPolicy,
    EvictionPolicyConfig,
    PluginHost,
    PluginLoadError,
    PolicyCapabilities,
)
from kvstrata.replay.simulate import SimulationConfig, simulate
from kvstrata.replay.trace import read_trace

POLICIES = "kvstrata.eviction_policies"

#: a whole third-party policy package: most recently used first (a scan-resistant toy)
MRU_MODULE = """
from typing import Literal
from kvstrata.plugins import EvictionPolicy, EvictionPolicyConfig, PolicyCapabilities

class MruConfig(EvictionPolicyConfig):
    type: Literal["mru"] = "mru"
    bias: int = 0

class MruPolicy(EvictionPolicy):
    name = "mru"
    Config = MruConfig
    capabilities = PolicyCapabilities()

    def ranked(self, entries):
        return [(-n.last_access - self.config.bias, n.id, n) for n in entries]
"""


def install_mru(make_distribution) -> Path:
    return make_distribution(
        "kvstrata-mru", "1.2", {POLICIES: {"mru": "kvstrata_mru:MruPolicy"}}, {"kvstrata_mru": MRU_MODULE}
    )


def test_a_third_party_policy_is_found_by_entry_point_and_used_everywhere(make_distribution) -> None:
    install_mru(make_distribution)
    host = PluginHost(autoload=True, disabled=set())
    entry = host.eviction_policies.entry("mru")
    assert (entry.provider, entry.version) == ("kvstrata-mru", "1.2")
    assert {"lru", "s3fifo", "reuse", "belady"} <= set(host.eviction_policies.names())  # built-ins too
    trace = read_trace()
    mru = simulate(trace, SimulationConfig(capacity_tokens=400_000, eviction="mru"), host=host)
    lru = simulate(trace, SimulationConfig(capacity_tokens=400_000, eviction="lru"), host=host)
    assert mru.eviction == "mru" and mru.hit_rate != lru.hit_rate
    config = load(
        [EXAMPLES["kv"]],
        overrides=["tiers.storage={}", "policy.eviction={type: mru, bias: 3}"],
        plugins=host,
        environ={},
    )
    with CacheController(config, host) as cache:
        device, host_order = cache.tree.eviction_order(Tier.DEVICE), cache.tree.eviction_order(Tier.HOST)
        assert type(device).__name__ == "MruPolicy" and device.config.bias == 3
        assert device is not host_order  # one instance per tier: policies keep per-tier state
        assert device.context.tier == "device" and host_order.context.tier == "host"
        serve(cache, tokens(1, 4))


def test_cli_lists_and_simulates_a_third_party_policy(make_distribution, tmp_path: Path) -> None:
    site = install_mru(make_distribution)
    env = {
        **os.environ,
        "PYTHONPATH": f"{site}{os.pathsep}{REPO / 'src'}",
        "XDG_CACHE_HOME": str(tmp_path / "c"),
    }
    env.pop("KVSTRATA_DISABLED_PLUGINS", None)
    listed = subprocess.run(
        [sys.executable, "-m", "kvstrata", "plugins", "--json"], capture_output=True, text=True, env=env
    )
    assert listed.returncode == 0, listed.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(listed.stdout)}
    assert rows[("eviction policy", "mru")]["distribution"] == "kvstrata-mru"
    assert rows[("eviction policy", "belady")]["capabilities"]["needs_future"] is True
    run = subprocess.run(
        [sys.executable, "-m", "kvstrata", "simulate", "--limit", "50", "--eviction", "mru", "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["eviction"] == "mru"


def test_in_process_registration_through_the_hook(kvstrata_host: PluginHost) -> None:
    import kvstrata

    namespace: dict = {"__name__": "inproc_policy"}
    exec(compile(MRU_MODULE.replace('"mru"', '"inproc"'), "<inproc>", "exec", dont_inherit=True), namespace)

    class Contributor:
        @kvstrata.hookimpl
        def kvstrata_register_eviction_policies(self, register):
            register(namespace["MruPolicy"])

    kvstrata_host.register_plugin(Contributor())
    assert kvstrata_host.eviction_policies.get("inproc").name == "inproc"
    assert kvstrata_host.eviction_policies.entry("inproc").source == "in_process"


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        ("MruPolicy.name = 'other'", "entry point says"),
        ("MruPolicy.Config = None", "Literal"),
        ("MruPolicy.capabilities = {'events': True}", "PolicyCapabilities"),
        ("MruPolicy.api_version = 9", "eviction-policy API"),
    ],
)
def test_contract_violations_are_load_errors(make_distribution, patch: str, expected: str) -> None:
    module = f"kvstrata_badpolicy_{abs(hash(patch)) % 10**6}"
    make_distribution(
        "kvstrata-badpolicy",
        "0.1",
        {POLICIES: {"mru": f"{module}:MruPolicy"}},
        {module: MRU_MODULE + "\n" + patch + "\n"},
    )
    host = PluginHost(autoload=True, disabled=set())
    with pytest.raises(PluginLoadError) as info:
        host.eviction_policies.get("mru")
    assert expected in str(info.value) and "kvstrata-badpolicy 0.1" in str(info.value)


def test_config_takes_a_name_or_a_mapping_and_lists_the_installed_on_a_typo() -> None:
    host = PluginHost()
    base = [EXAMPLES["kv"]]
    named = load(base, overrides=["policy.eviction=s3fifo"], plugins=host, environ={})
    assert named.policy.eviction.type == "s3fifo" and named.policy.eviction.small_fraction == 0.1
    mapped = load(
        base, overrides=["policy.eviction={type: s3fifo, small_fraction: 0.3}"], plugins=host, environ={}
    )
    assert mapped.policy.eviction.small_fraction == 0.3
    assert load(base, overrides=[], plugins=host, environ={}).policy.eviction is None  # the tree's own LRU
    with pytest.raises(ConfigError) as info:
        load(base, overrides=["policy.eviction=s3fifi"], plugins=host, environ={})
    assert "policy.eviction" in str(info.value) and "installed: arc, belady, chain" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load(base, overrides=["policy.eviction={type: arc, speed: 2}"], plugins=host, environ={})
    assert "policy.eviction.speed" in str(info.value)


def test_a_live_cache_refuses_the_offline_optimum() -> None:
    with pytest.raises(ValueError, match="simulate"):
        open_cache("kv", overrides=["policy.eviction=belady"])
    # and `kvstrata config validate` says so before anything starts (it called the config valid)
    command = ["config", "validate", "-c", str(EXAMPLES["kv"]), "--set", "policy.eviction=belady"]
    result = subprocess.run([sys.executable, "-m", "kvstrata", *command], capture_output=True, text=True)
    assert (
        result.returncode == 2 and "policy.eviction: eviction policy 'belady' needs future" in result.stderr
    )


def test_every_tier_of_a_live_cache_runs_the_configured_policy_through_evictions() -> None:
    # device 4 pages of 64 tokens, host 16: every new request evicts on the device
    sets = ["tiers.device.capacity_tokens=256", "tiers.host.capacity_tokens=1024", "policy.eviction=reuse"]
    with open_cache("kv", overrides=sets) as cache:
        device = cache.tree.eviction_order(Tier.DEVICE)
        assert type(device).__name__ == "ReusePolicy" and device.context.capacity_pages == 4
        assert cache.tree.eviction_order(Tier.HOST).context.capacity_pages == 16
        hot = tokens(7, 2)
        for seed in range(10):
            serve(cache, hot)  # reused every time: it lives in main
            serve(cache, tokens(100 + seed, 2))  # one-time prefixes pass through probation
        lease, bad = serve(cache, hot)
        assert bad == 0 and lease.hit_pages["device"] == 2
        assert device.requests >= 21  # one access event per request  # type: ignore[attr-defined]


class _FlakyConfig(EvictionPolicyConfig):
    type: Literal["flaky"] = "flaky"


class _FlakyPolicy(EvictionPolicy):
    """LRU that raises on its second ranking (a third-party policy's bug): the first eviction
    ranks the leaves, drops one, then ranks its parent."""

    name = "flaky"
    Config = _FlakyConfig
    capabilities = PolicyCapabilities()

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.calls = 0

    def ranked(self, entries):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("third-party policy bug")
        return [(node.last_access, node.id, node) for node in entries]


def test_a_policy_raising_mid_eviction_fails_that_call_and_loses_no_unit() -> None:
    # the units of the nodes the eviction had already dropped were never freed: the tier shrank
    # for good on every failure
    host = PluginHost()
    host.eviction_policies.register(_FlakyPolicy)
    sets = ["tiers.device.capacity_tokens=256", "tiers.host.capacity_tokens=0", "tiers.storage={}"]
    with open_cache("kv", overrides=[*sets, "policy.eviction=flaky"], host=host) as cache:
        first = tokens(60, 2)
        serve(cache, first)
        serve(cache, torch.cat([first, tokens(61, 2)]))  # a chain of two nodes: the tier is full
        lease = cache.lookup(tokens(62, 2))
        cache.admit(lease)
        with pytest.raises(RuntimeError, match="third-party policy bug"):
            cache.allocate(lease)
        cache.release(lease)
        allocator = cache.pools.pools["kv"].device_allocator
        assert allocator.available + cache.tree.units("kv", Tier.DEVICE) == allocator.units
        cache.tree.check()
        _, bad = serve(cache, tokens(63, 2))  # the cache goes on
        assert bad == 0
