"""The controller's parts tested on their own: each takes explicit inputs and returns a plan or a
result, so a behaviour can be pinned to the part that owns it."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from controller_support import EXAMPLES, fill, open_cache, tokens, verify
from kvstrata.core.builder import build_cache
from kvstrata.core.collective import LocalCollective, RankAgreement
from kvstrata.core.config import load
from kvstrata.core.controller import CacheController
from kvstrata.core.load_back import LoadBack
from kvstrata.core.metrics import SkipReason
from kvstrata.core.prefetcher import PrefetchMode
from kvstrata.core.stack import PoolKind
from kvstrata.core.tier_units import TierUnits
from kvstrata.core.tree import Tier, page_keys
from kvstrata.plugins import PluginHost


def _config(example: str, *overrides: str):
    host = PluginHost()
    return load(
        [EXAMPLES[example]], overrides=["tiers.storage={}", *overrides], plugins=host, environ={}
    ), host


def test_stack_layout_reads_rules_from_specs() -> None:
    config, host = _config("swa-mamba")
    parts = build_cache(config, host)
    layout = parts.layout
    assert layout.anchor == "kv"
    assert {name: tp.kind for name, tp in layout.tree_pools.items()} == {
        "kv": PoolKind.PAGES,
        "swa": PoolKind.WINDOW,
        "mamba": PoolKind.STATE,
    }
    assert layout.tree_pools["swa"].window == 256 // config.model.page_size
    # a 10-page prefix read from L3: every kv page, the last window of swa, one mamba state
    assert layout.slot_counts(10) == {"kv": 10, "swa": 4, "mamba": 1}
    assert layout.units_for(3) == {"kv": 3, "swa": 3, "mamba": 1}
    assert not layout.clampable  # window and state pools drop, never clamp


def test_sidecars_follow_their_index_owner() -> None:
    config, host = _config("mla-nsa-draft")
    layout = build_cache(config, host).layout
    assert list(layout.tree_pools) == ["mla"]
    assert set(layout.tree_pools["mla"].followers) == {"mla", "indexer", "draft"}
    assert layout.owner("draft").name == "mla" and layout.kind("indexer") is PoolKind.PAGES


def test_load_back_plan_names_every_host_only_unit_and_run_restores_bytes() -> None:
    """Back a request up to host, evict it from the device, then plan and run its load-back."""
    config, host = _config("hybrid-mamba")
    with CacheController(config, host) as cache:
        request = tokens(1, 6)
        lease = cache.lookup(request)
        units = cache.allocate(lease)
        fill(cache, lease, units)
        cache.insert(lease)  # write-through: host copies of all 6 pages and the state
        before = {
            name: cache.pools.pools[name].device.unit_view(b.name)[units[name]].clone()
            for name in units
            for b in cache.pools.pools[name].spec.buffers[:1]
        }
        everything = {name: 1 << 30 for name in cache.tree_pools}
        cache.tree.evict_device(everything, cache.units.freer(Tier.DEVICE))
        match = cache.tree.match(page_keys(request, cache.page_size), count_hit=False)
        assert (match.device_pages, match.host_pages) == (0, 6)

        plan = cache.load_back.plan(match)
        assert plan.units == {"kv": 6, "mamba": 1}
        assert plan.end is match.host_node
        result = cache.load_back.run(plan)
        assert result.loaded and result.bytes > 0

        after = cache.tree.match(page_keys(request, cache.page_size), count_hit=False)
        assert after.device_pages == 6
        for name, old in before.items():
            pool = cache.pools.pools[name]
            unit = after.device_state[name] if name == "mamba" else cache.tree.values(after.device_path, name)
            view = pool.device.unit_view(pool.spec.buffers[0].name)
            assert torch.equal(view[unit], old)


@pytest.mark.parametrize("stack", ["swa", "kv"])
def test_load_back_reads_its_plan_again_after_making_room(stack: str) -> None:
    """Making room on the device may split a planned node (write-back's backups evict a window
    pool's out-of-window head on the host, on a node of its own): the copy read the planned
    nodes' host units, now fewer, and admit raised "index lists differ in length"."""
    with open_cache(stack, overrides=["tiers.storage={}"]) as cache:
        request = tokens(3, 6)
        lease = cache.lookup(request)
        fill(cache, lease, cache.allocate(lease))
        cache.insert(lease)  # write-through: host copies of every page
        cache.tree.evict_device({name: 1 << 30 for name in cache.tree_pools}, cache.units.freer(Tier.DEVICE))
        plan = cache.load_back.plan(cache.tree.match(page_keys(request, cache.page_size), count_hit=False))
        (node,) = plan.nodes[cache.layout.anchor]
        alloc = cache.units.alloc_protecting

        def alloc_then_split(*args, **kwargs):  # what the eviction making room did
            got = alloc(*args, **kwargs)
            cache.tree.split(node, 2)
            return got

        cache.units.alloc_protecting = alloc_then_split  # type: ignore[method-assign]
        assert cache.load_back.run(plan).loaded
        del cache.units.alloc_protecting
        cache.tree.check()
        again = cache.lookup(request)
        cache.admit(again)
        assert (again.cached_pages, again.hit_pages["device"], verify(cache, again)) == (6, 6, 0)
        cache.release(again)


def test_the_parts_share_one_frozen_context(tmp_path: Path) -> None:
    """Load-back, the writer and the prefetcher are built over one context: the same pools,
    tree, layout, units and metrics, which no part can swap under the others."""
    with open_cache("hybrid-mamba", tmp_path / "l3") as cache:
        context = cache.parts.context
        assert cache.load_back.context is cache.writer.context is cache.prefetcher.context is context  # type: ignore[union-attr]
        shared = (cache.pools, cache.tree, cache.layout, cache.units, cache.metrics)
        for part in (cache.load_back, cache.writer, cache.prefetcher):
            held = (part.pools, part.tree, part.layout, part.units, part.metrics)  # type: ignore[union-attr]
            assert all(mine is theirs for mine, theirs in zip(held, shared, strict=True))
        with pytest.raises(FrozenInstanceError):
            context.units = cache.units  # type: ignore[misc]


def test_load_back_changes_nothing_when_the_device_cannot_make_room() -> None:
    config, host = _config("hybrid-mamba")
    parts = build_cache(config, host)
    units = TierUnits(parts.pools, parts.tree, delete_unbacked=True, on_eviction=lambda *a: None)
    load_back = LoadBack(replace(parts.context, units=units))
    # a host-only node whose load-back needs more device units than the tier has
    keys = page_keys(tokens(2, 20), config.model.page_size)
    pages = len(keys)
    host_units = {
        "kv": parts.pools.pools["kv"].host_allocator.alloc(pages),
        "mamba": parts.pools.pools["mamba"].host_allocator.alloc(1),
    }
    parts.tree.insert_host(keys, host_units)
    match = parts.tree.match(keys, count_hit=False)
    plan = load_back.plan(match)
    assert plan.units["kv"] == pages > parts.pools.pools["kv"].device_allocator.units
    assert not load_back.run(plan).loaded
    assert parts.metrics.failures == 1
    assert parts.tree.match(keys, count_hit=False).device_pages == 0
    assert parts.pools.pools["kv"].device_allocator.used == 0


def test_host_eviction_takes_the_host_last_nodes_only_where_nothing_else_frees_enough() -> None:
    # write-back's nodes waiting on the host for their prefix's L3 write (their only copy) go
    # last: the others first, least recently used or not; then, where the tier holds nothing
    # else and no L3 write in flight will free room, they go too (a host tier full of them must
    # not refuse every later backup)
    config, host = _config("kv")  # 32 host pages
    parts = build_cache(config, host)
    units = TierUnits(parts.pools, parts.tree, delete_unbacked=True, on_eviction=lambda *a: None)
    allocator = parts.pools.pools["kv"].host_allocator
    nodes = []
    for seed in (1, 2, 3):  # 3 host-only prefixes of 10 pages, the first least recently used
        keys = page_keys(tokens(seed, 10), config.model.page_size)
        nodes.append(parts.tree.insert_host(keys, {"kv": allocator.alloc(10)}).node)
    writing = [True]  # an L3 write in flight: it frees its sources, nothing is lost for room
    units.host_last = lambda: ([nodes[0]], not writing[0])
    assert units.alloc(Tier.HOST, {"kv": 12}) is not None  # (2 free)
    assert units.alloc(Tier.HOST, {"kv": 10}) is not None
    assert [n.parent is not None for n in nodes] == [True, False, False], "the others went first"
    assert not any(nodes[0].host_lock), "(locked for the first pass only)"
    assert units.alloc(Tier.HOST, {"kv": 10}) is None and nodes[0].parent is not None
    writing[0] = False
    assert units.alloc(Tier.HOST, {"kv": 10}) is not None
    assert nodes[0].parent is None, "then it went too"
    assert allocator.used == 32


class _OtherRankHolds:
    """A stand-in for the other ranks of a group (this test is about counting, not transport)."""

    world_size = 2

    def __init__(self, other: int) -> None:
        self.other = other

    def all_min(self, values: list[int]) -> list[int]:
        return [min(v, self.other) for v in values]


def test_rank_agreement_takes_the_min_and_counts_what_this_rank_gave_up() -> None:
    agreement = RankAgreement(_OtherRankHolds(3))
    assert agreement.prefetch_pages(0, 2) == 2 and agreement.disagreements == 0
    prefix = SimpleNamespace(device_pages=5)
    within = SimpleNamespace(device_pages=3)
    assert agreement.cached_match(prefix, lambda pages: within if pages == 3 else prefix) is within
    assert agreement.disagreements == 1


def test_ranks_agree_on_where_the_prefix_they_all_hold_ends_not_on_pages_read() -> None:
    # the other rank holds pages [0, 4) on its device and read nothing; this one reads them from
    # L3: a MIN of the counts read (4 and 0) dropped a prefix every rank held
    agreement = RankAgreement(_OtherRankHolds(4))
    assert agreement.prefetch_pages(0, 4) == 4 and agreement.disagreements == 0
    assert agreement.prefetch_pages(2, 6) == 2, "the others end at page 4: 2 of the 6 read"
    assert agreement.prefetch_pages(6, 2) == 0, "this rank's start is past what the others hold"
    assert agreement.disagreements == 2


@pytest.mark.parametrize("axis", ["tp", "pp", "cp"])
def test_a_rank_of_several_with_no_collective_is_refused_before_anything_opens(
    tmp_path: Path, axis: str
) -> None:
    # each rank decided alone what a request reuses: with one rank's L3 object missing, rank 0
    # served 8 pages and rank 1 two, and the engine's ranks computed from different prefixes
    sets = [f"parallel.{axis}_size=2", f"parallel.{axis}_rank=1"]
    with pytest.raises(ValueError, match=rf"parallel: .* one of 2 ranks .*{axis}_size=2.*collective="):
        open_cache("kv", tmp_path / "l3", sets)
    assert not (tmp_path / "l3").exists(), "the refusal came before the backend opened"
    with open_cache("kv", tmp_path / "l3", sets, collective=LocalCollective()) as alone:
        assert alone.ranks.collective.world_size == 1, "an explicit LocalCollective decides alone"


def test_prefetcher_gates_skip_short_and_over_budget_reads_and_say_why(tmp_path: Path) -> None:
    host = PluginHost()
    config = load(
        [EXAMPLES["kv"]],
        overrides=[f"tiers.storage.l3.path={tmp_path}", "policy.prefetch.threshold_tokens=256"],
        plugins=host,
        environ={},
    )
    with CacheController(config, host) as cache:
        prefetcher = cache.prefetcher
        assert prefetcher is not None
        page = cache.page_size
        short = max(1, 256 // page - 1)
        skipped: dict[str, int] = {}
        assert prefetcher.start(0, ["00"] * short, skipped) is None
        assert skipped == {SkipReason.BELOW_THRESHOLD: short}
        budget = prefetcher._budget()
        assert prefetcher.start(0, ["00"] * (budget + 1), skipped) is None
        assert skipped[SkipReason.HOST_FRACTION] == budget + 1
        assert cache.metrics.operations["prefetches_skipped"] == 1
        assert cache.metrics.skipped_pages[SkipReason.BELOW_THRESHOLD] == short
        # an explicit wait skips the gates
        assert prefetcher.start(0, ["00"] * short, skipped, PrefetchMode.WAIT) is not None
        op = prefetcher.start(0, ["ab" * 16] * max(short + 1, 256 // page), skipped)
        assert op is not None
        op.done.wait(10)
        assert op.found == 0 and op.pages == 0  # nothing in L3: no unit taken
        assert prefetcher.commit(op, [], 0, request_id="t", skipped=skipped) == 0
        assert prefetcher.orphans == [] and cache.pools.pools["kv"].host_allocator.used == 0
