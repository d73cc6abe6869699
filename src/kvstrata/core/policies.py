"""Eviction policies for a cache's tiers: configs resolved through the plugin registry, one
policy instance per tier, and the context each works in (capacity, bytes per page and state).

``policy.eviction`` names a policy or is a mapping with ``type`` and its options (unset, the
tree keeps its own LRU order); the same entry serves ``kvstrata simulate``, which builds its
policy here too. A name no installed
plugin provides is an error listing the installed ones. The core reads a policy's declared
capabilities, never its name: a ``needs_future`` policy (the offline optimum) cannot run in a
live cache because nothing there knows the future.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvstrata.core.pool_group import PoolGroup
from kvstrata.core.tree import PrefixTree, Tier
from kvstrata.plugins import PluginHost
from kvstrata.plugins.eviction_policy import EvictionPolicy, EvictionPolicyConfig, PolicyContext
from kvstrata.plugins.pool_type import Granularity

PolicySetting = str | Mapping[str, Any] | EvictionPolicyConfig


def policy_config(host: PluginHost, value: PolicySetting) -> EvictionPolicyConfig:
    """Validate ``value`` (a name or a mapping with ``type``) with the named policy's ``Config``."""
    if isinstance(value, EvictionPolicyConfig) and type(value) is not EvictionPolicyConfig:
        return value  # validated by its policy's own Config already
    if isinstance(value, EvictionPolicyConfig):
        value = value.model_dump()
    data = {"type": value} if isinstance(value, str) else dict(value)
    name = data.get("type")
    if not isinstance(name, str):
        raise ValueError("an eviction policy needs a `type` (the policy name)")
    return host.eviction_policies.require(name).Config.model_validate(data)


def check_live_policy(host: PluginHost, value: PolicySetting) -> EvictionPolicyConfig:
    """The policy's config, or a ``ValueError`` for one a live cache cannot run (start-up and
    ``kvstrata config validate`` ask the same: its declared capabilities, not its name)."""
    config = policy_config(host, value)
    if host.eviction_policies.get(config.type).capabilities.needs_future:
        raise ValueError(
            f"eviction policy {config.type!r} needs future accesses: it is an offline reference "
            "for `kvstrata simulate --eviction`, not a policy for a live cache"
        )
    return config


def make_policy(host: PluginHost, config: EvictionPolicyConfig, context: PolicyContext) -> EvictionPolicy:
    """A fresh instance of the configured policy (policies keep per-tier state: one per tier)."""
    return host.eviction_policies.require(config.type)(config, context)


def tier_context(pools: PoolGroup, tree: PrefixTree, tier: Tier) -> PolicyContext:
    """Capacity and costs of ``tier``: anchor pages, bytes per page over the token-page pools
    (sidecars included) and bytes of the node-state slots a node holds."""
    anchor = pools.anchor
    allocator = anchor.device_allocator if tier is Tier.DEVICE else anchor.host_allocator
    page_bytes = state_bytes = 0
    for pool in pools.pools.values():
        if pool.spec.granularity is Granularity.NODE_STATE:
            state_bytes += pool.spec.bytes_per_unit
        else:
            page_bytes += pool.spec.bytes_per_unit
    return PolicyContext(
        tier=tier.value,
        capacity_pages=allocator.units if allocator is not None else 0,
        page_size=tree.page_size,
        page_bytes=page_bytes,
        state_bytes=state_bytes,
    )


def install_policies(
    host: PluginHost, value: PolicySetting, pools: PoolGroup, tree: PrefixTree
) -> dict[Tier, EvictionPolicy]:
    """Give every tier of ``tree`` its own instance of the configured policy."""
    config = check_live_policy(host, value)
    installed = {}
    for tier in (Tier.DEVICE, Tier.HOST):
        policy = make_policy(host, config, tier_context(pools, tree, tier))
        tree.set_eviction_order(tier, policy)
        installed[tier] = policy
    return installed
