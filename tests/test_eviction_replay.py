"""The same eviction policy in a full replay (real bytes through the controller) and in the
simulator gives the same hit rate at the same capacity: one implementation, not two."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvstrata.core.config import load
from kvstrata.plugins.host import PluginHost
from kvstrata.replay.driver import run_replay
from kvstrata.replay.simulate import SimulationConfig, simulate
from kvstrata.replay.trace import read_trace
from trace_files import full_trace

REQUESTS = 800
CAPACITY = 1_000_000  # tokens: the prefix's working set is several times larger


def policy_name(policy: str | dict[str, object]) -> str:
    return policy if isinstance(policy, str) else str(policy["type"])


def kv_stack(tmp_path: Path, policy: str | dict[str, object]) -> Path:
    """A KV-only stack (64 bytes per token), one device tier of CAPACITY tokens, 512-token pages."""
    data = {
        "model": {
            "name": "evict-replay",
            "page_size": 512,
            "pools": {"kv": {"type": "kv", "layers": 2, "kv_heads": 1, "head_dim": 8, "dtype": "bfloat16"}},
        },
        "tiers": {"device": {"capacity_tokens": CAPACITY}, "host": {"capacity_tokens": 0}},
        "policy": {"eviction": policy},
    }
    path = tmp_path / f"{policy_name(policy)}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_replay_hit_rate_equals_the_simulators_with_the_same_policy(tmp_path: Path) -> None:
    requests = read_trace(full_trace("conversation_trace.jsonl"), limit=REQUESTS)
    host = PluginHost()
    replayed = {}
    # learned: a horizon short enough that its model is fitted within the prefix (800 requests)
    learned = {"type": "learned", "min_horizon": 200}
    for policy in ("lru", "s3fifo", "reuse", learned):
        name = policy_name(policy)
        config = load([kv_stack(tmp_path, policy)], overrides=[], plugins=host, environ={})
        result = run_replay(config, host, requests)
        simulated = simulate(requests, SimulationConfig(capacity_tokens=CAPACITY, eviction=policy), host=host)
        assert simulated.evicted_blocks > 0  # the capacity binds
        assert result.corrupt_pages_served == 0 and result.failures == 0
        assert result.hit_rate.total == pytest.approx(simulated.hit_rate, abs=0.01), name
        replayed[name] = result.hit_rate.total
    # the policy really decides: on this prefix the policies differ by more than the tolerance
    assert replayed["reuse"] > replayed["lru"] + 0.01
    assert replayed["learned"] > replayed["lru"] + 0.01
