"""Stacks that mix the less common pool types (mla, nsa, draft, logical, swa, mamba) at odd sizes:
what start-up refuses for them, and bit-exact restores through every tier and a new process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvstrata
from controller_support import fill, serve, tokens, verify
from kvstrata.core.builder import StartupError
from kvstrata.core.controller import Lease, PoolKind
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
    assert str(raised.value).startswith((f"{path}: ", f"{path} is ")), str(raised.value)


def test_an_index_source_naming_its_own_pool_says_so() -> None:
    # the stack's one anchor-type pool naming itself was refused as "needs exactly one anchor
    # pool ...; found none"
    config = {"model": {"name": "m", "page_size": 4, "pools": {"mla": dict(MLA, index_source="mla")}}}
    with pytest.raises(ConfigError, match=r"model: .*pools\.mla\.index_source names the pool itself"):
        kvstrata.open(config, environ={})


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


# --- random stacks of every pool type at odd sizes, through every tier and a new process ----------

FLOATS = ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
DTYPES = [*FLOATS, "int8", "uint8", "int16", "int32"]
_DIM = st.integers(1, 3)


@st.composite
def mixed_stacks(draw: st.DrawFn) -> dict:
    """An anchor (kv, mla or logical) and a random set of sidecars and components, every shape and
    dtype drawn: 1-element dims, 1-byte dtypes, head-major units, v_head_dim, float indexer keys."""

    def attention(kind: str) -> dict:
        pool = {
            "type": kind,
            "layers": draw(st.integers(1, 2)),
            "kv_heads": draw(_DIM),
            "head_dim": draw(_DIM),
        }
        pool["dtype"] = draw(st.sampled_from(DTYPES))
        pool["unit_layout"] = draw(st.sampled_from(["token_major", "head_major"]))
        if draw(st.booleans()):
            pool["v_head_dim"] = draw(_DIM)
        return pool

    def mla(**extra: object) -> dict:
        rope = draw(st.integers(0, 2))
        layers = draw(st.integers(1, 2))
        return {
            "type": "mla",
            "layers": layers,
            "kv_lora_rank": draw(_DIM),
            "qk_rope_head_dim": rope,
            **extra,
        }

    anchor = draw(st.sampled_from(["kv", "mla", "logical"]))
    pools: dict = {
        "kv": lambda: {"a": attention("kv")},
        "mla": lambda: {"a": mla(dtype=draw(st.sampled_from(DTYPES)))},
        "logical": lambda: {"a": {"type": "logical"}},
    }[anchor]()
    if draw(st.booleans()):
        window = draw(st.integers(1, 9))
        pools["swa"] = {**attention("swa"), "window": window}
    if draw(st.booleans()):
        shape = draw(st.lists(_DIM, min_size=1, max_size=2))
        state = {"s": {"shape": shape, "dtype": "int8"}}  # (slots: a hit and a new page need two)
        pools["mamba"] = {"type": "mamba", "layers": 1, "states": state, "device_units": 4, "host_units": 8}
    if draw(st.booleans()):
        key = draw(st.sampled_from(["fp8_with_scales", "bfloat16", "float32"]))
        dim = 128 if key == "fp8_with_scales" else draw(_DIM)
        pools["idx"] = {"type": "nsa", "layers": 1, "key_dtype": key, "index_head_dim": dim}
    if draw(st.booleans()) or (anchor == "logical" and len(pools) == 1):
        pools["draft"] = attention("draft")
    if draw(st.booleans()):
        sources = [name for name in pools if name not in ("mamba", "idx", "draft")]
        pools["c"] = mla(index_source=draw(st.sampled_from(sources)))
    return pools


def _serve_checked(cache: kvstrata.CacheController, request: torch.Tensor) -> Lease:
    """``serve`` with every pool's restored units counted too (a pool handing back no unit would
    pass the byte check vacuously): all pages, the last window, or one state slot."""
    lease = cache.lookup(request)
    cache.admit(lease)
    assert verify(cache, lease) == 0, "a restored unit holds bytes of another page, pool or layout"
    cached = lease.cached_pages
    for name, pool in cache.pools.pools.items():
        if pool.spec.logical or not cached:
            continue
        count, kind = len(lease.prefix_units(name)), cache.pool_kind(name)
        wanted = {PoolKind.PAGES: (cached, cached), PoolKind.STATE: (1, 1)}.get(kind, (1, cached))
        assert wanted[0] <= count <= wanted[1], (name, kind, count, cached)
    fill(cache, lease, cache.allocate(lease))
    cache.insert(lease)
    cache.tree.check()
    return lease


@settings(
    max_examples=12, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
@given(pools=mixed_stacks(), page=st.sampled_from([1, 2, 3, 5, 64]), data=st.data())
def test_random_stacks_of_every_pool_type_restore_exact_bytes_from_every_tier_and_a_new_process(
    tmp_path_factory: pytest.TempPathFactory, pools: dict, page: int, data: st.DataObject
) -> None:
    l3 = tmp_path_factory.mktemp("l3")
    pages = max(2, 12 // page)
    config = _stack(l3, pools, page)
    config["tiers"]["device"]["capacity_tokens"] = 2 * pages * page
    config["tiers"]["host"]["capacity_tokens"] = 4 * pages * page
    stems = [tokens(100 + i, pages, page) for i in range(3)]
    cuts = data.draw(st.lists(st.integers(1, pages), min_size=3, max_size=6), label="shared pages")
    requests = [*stems]
    for i, cut in enumerate(cuts):  # requests branching off a stem after `cut` pages
        requests.append(torch.cat([stems[i % 3][: cut * page], tokens(500 + i, 1, page)]))
    hits = {"device": 0, "host": 0, "storage": 0}
    with kvstrata.open(config, environ={}) as cache:
        for request in [*requests, *reversed(requests)]:
            for tier, n in _serve_checked(cache, request).hit_pages.items():
                hits[str(tier)] += n
    with kvstrata.open(config, environ={}) as fresh:  # a new process: what it gets comes from L3
        for request in requests:
            lease = _serve_checked(fresh, request)
            hits["storage"] += lease.hit_pages["storage"]
    assert hits["storage"] > 0, (pools, hits)
