"""Property tests for every installed eviction policy, through the real prefix tree.

A random workload of requests over a small alphabet of pages (so prefixes are shared, split and
extended) runs against a tree whose device tier holds ``capacity`` pages, as the controller runs
it: match (the access event), lock the prefix, evict what is missing, insert, then either release
the lock or keep it (a request still running). Some prefixes are pinned through the retention
hints. For every policy: a locked or pinned node never loses its pages, the tier never holds
more than its capacity, and the same workload gives the same evictions twice. The workload is
the eviction-policy kit's (:mod:`kvstrata.testing.policy_kit`): one copy for ours and theirs.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from kvstrata.plugins import PluginHost
from kvstrata.testing.policy_kit import request_paths
from kvstrata.testing.policy_kit import run_workload as kit_workload

HOST = PluginHost()
POLICIES = HOST.eviction_policies.names()


def run_workload(name: str, ops: list) -> list:
    """The kit's workload (kvstrata.testing.policy_kit, what plugin authors run) on ``name``."""
    return kit_workload(HOST, name, ops)


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=request_paths())
def test_policy_keeps_locked_and_pinned_pages_and_the_capacity(name: str, ops: list) -> None:
    run_workload(name, ops)


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=request_paths())
def test_policy_is_deterministic(name: str, ops: list) -> None:
    assert run_workload(name, ops) == run_workload(name, ops)


def test_the_workload_evicts_at_all() -> None:
    """The properties above are not vacuous: a plain workload overflows the tier."""
    ops = [([1, i, i, i], False, False) for i in range(8)]
    evicted = run_workload("lru", ops)
    assert sum(count for tag, _, count in evicted if tag == "deleted") >= 8
