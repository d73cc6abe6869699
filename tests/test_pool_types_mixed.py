"""Stacks that mix the less common pool types (mla, nsa, draft, logical, swa, mamba) at odd sizes:
what start-up refuses for them, and bit-exact restores through every tier and a new process."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvstrata
from controller_support import serve, tokens
from kvstrata.core.builder import StartupError
from kvstrata.plugins.errors import ConfigError

MLA = {"type": "mla", "layers": 1, "kv_lora_rank": 4, "qk_rope_head_dim": 2}
SWA = {"type": "swa", "layers": 1, "kv_heads": 1, "head_dim": 4, "window": 6}
MAMBA = {"type": "mamba", "layers": 1, "states": {"s": {"shape": [2]}}}

#: a stack and the tree pool set to no host units (an anchor, a window and a state component)
NO_HOST_UNITS = {
    "mla anchor": ({"mla": MLA, "idx": {"type": "nsa", "layers": 1}}, "mla"),
    "swa component": ({"mla": MLA, "swa": SWA}, "swa"),
    "logical anchor": ({"anchor": {"type": "logical"}, "swa": SWA}, "anchor"),
    "mamba component": ({"anchor": {"type": "logical"}, "mamba": MAMBA}, "mamba"),
}


@pytest.mark.parametrize("case", sorted(NO_HOST_UNITS))
def test_a_pool_with_no_host_units_under_a_host_tier_is_refused_naming_it(case: str, tmp_path: Path) -> None:
    # one pool's host_units: 0 left every pool without host and L3 reuse (a page needs a host
    # unit in every tree pool), and start-up, validate and doctor all said nothing
    pools, zero = NO_HOST_UNITS[case]
    pools = {name: dict(config, host_units=0) if name == zero else config for name, config in pools.items()}
    config = {
        "model": {"name": "m", "page_size": 4, "pools": pools},
        "tiers": {
            "device": {"capacity_tokens": 64},
            "host": {"capacity_tokens": 128},
            "storage": {"l3": {"type": "file", "path": str(tmp_path)}},
        },
    }
    with pytest.raises(StartupError, match=rf"^model\.pools\.{zero}\.host_units is 0: no page"):
        kvstrata.open(config, environ={})
    config["tiers"] = {"device": {"capacity_tokens": 64}, "host": {"capacity_tokens": 0}}
    with kvstrata.open(config, environ={}) as cache:  # no host tier: nothing to refuse
        assert cache.pools.pools[zero].host is None


DRAFT = {"type": "draft", "layers": 1, "kv_heads": 1, "head_dim": 4}

#: config values the pool group refuses, and the dotted path its error must start with
POOL_GROUP_REFUSALS = {
    "index_source on a component": (
        {"mla": MLA, "swa": dict(SWA, index_source="mla")},
        "model.pools.swa.index_source",
    ),
    "page sidecar of a state pool": (
        {"mla": MLA, "mamba": MAMBA, "idx": {"type": "nsa", "layers": 1, "index_source": "mamba"}},
        "model.pools.idx.index_source",
    ),
    "device_units on a sidecar": (
        {"mla": MLA, "draft": dict(DRAFT, device_units=4)},
        "model.pools.draft.device_units",
    ),
    "host_units on a sidecar": (
        {"mla": MLA, "draft": dict(DRAFT, host_units=4)},
        "model.pools.draft.host_units",
    ),
    "state interval on token pages": (
        {"anchor": {"type": "logical", "state_every_pages": 2}, "swa": SWA},
        "model.pools.anchor.state_every_pages",
    ),
    "sidecar cycle": (
        {"mla": MLA, "a": dict(DRAFT, index_source="b"), "b": dict(DRAFT, index_source="a")},
        "model.pools",
    ),
}


@pytest.mark.parametrize("case", sorted(POOL_GROUP_REFUSALS))
def test_open_refuses_a_bad_pool_value_with_a_config_error_naming_its_path(case: str) -> None:
    # README: `kvstrata.open` raises ConfigError naming the dotted path of a bad field; these
    # were bare ValueErrors naming the pool only (still ValueErrors, for callers catching that)
    pools, path = POOL_GROUP_REFUSALS[case]
    config = {"model": {"name": "m", "page_size": 4, "pools": pools}}
    with pytest.raises(ConfigError) as raised:
        kvstrata.open(config, environ={})
    assert isinstance(raised.value, ValueError)
    assert str(raised.value).startswith(f"{path}: ") or str(raised.value).startswith(f"{path} is ")


def _stack(l3: Path, pools: dict, page: int = 4) -> dict:
    return {
        "model": {"name": "mixed", "page_size": page, "pools": pools},
        "tiers": {
            "device": {"capacity_tokens": 16 * page},
            "host": {"capacity_tokens": 32 * page},
            "storage": {"l3": {"type": "file", "path": str(l3)}},
        },
        "policy": {"prefetch": {"policy": "wait_complete"}},
    }


def test_a_draft_pool_under_another_name_reads_no_draft_page_of_the_old_one(tmp_path: Path) -> None:
    """docs/namespaces.md: kvstrata cannot see a draft model's weights; the draft pool's instance
    name is in its keys, so a new draft model under a new pool name never gets the old draft's
    KV (the target's pages are the same model's: with the draft clamping, none is served)."""
    request = tokens(7, 4, 4)
    old = {"mla": MLA, "draft_r1": DRAFT}
    with kvstrata.open(_stack(tmp_path, old), environ={}) as first:
        serve(first, request)
    with kvstrata.open(_stack(tmp_path, {"mla": MLA, "draft_r2": DRAFT}), environ={}) as second:
        lease, bad = serve(second, request)
        assert (lease.cached_pages, bad) == (0, 0)
    with kvstrata.open(_stack(tmp_path, old), environ={}) as again:
        lease, bad = serve(again, request)
        assert (lease.cached_pages, lease.hit_pages["storage"], bad) == (4, 4, 0)
