"""What each built-in eviction policy does differently, on hand-made workloads through the real
prefix tree (the simulator drives it with trace blocks as pages), and the events the tree sends."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import pytest

from kvstrata.core.metrics import CacheMetrics
from kvstrata.core.policies import make_policy, policy_config
from kvstrata.core.retention import Retention, RetentionHint
from kvstrata.core.tree import PrefixTree, Tier
from kvstrata.eviction_policies.learned import features
from kvstrata.plugins import EvictionPolicy, PluginHost, PolicyContext
from kvstrata.replay.simulate import HitRateSimulator, SimulationConfig, simulate
from kvstrata.replay.trace import TraceRequest, read_trace
from tree_stacks import PAGE, Units, kv_spec, seq

HOST = PluginHost()
BLOCK = 10


def policy(name: str | dict[str, Any], capacity: int = 8, **context: Any) -> EvictionPolicy:
    ctx = PolicyContext(tier="device", capacity_pages=capacity, page_size=BLOCK, **context)
    return make_policy(HOST, policy_config(HOST, name), ctx)


def sim(name: str | dict[str, Any], capacity_blocks: int) -> HitRateSimulator:
    return HitRateSimulator(BLOCK, capacity_blocks * BLOCK, policy(name, capacity_blocks))


def chain(*ids: int) -> TraceRequest:
    """A request of full blocks; ids name prefixes (as in the traces), so (1, 2) extends (1,)."""
    return TraceRequest(0.0, BLOCK * len(ids), 1, ids)


def cached(s: HitRateSimulator, *ids: int) -> int:
    return s.lookup(chain(*ids)) // BLOCK


def test_fifo_evicts_the_first_inserted_even_when_it_was_read_since() -> None:
    for name, survivor in (("fifo", 20), ("lru", 10)):
        s = sim(name, 2)
        s.access(chain(10))
        s.access(chain(20))
        s.access(chain(10))  # read again: LRU keeps it, FIFO does not care
        s.access(chain(30))
        assert cached(s, survivor) == 1, name
        assert cached(s, 30) == 1


def test_lfu_keeps_the_most_reused_prefix() -> None:
    s = sim("lfu", 2)
    s.access(chain(10))
    for _ in range(3):
        s.access(chain(10))
    s.access(chain(20))
    s.access(chain(30))  # 20 (never reused) leaves, not the older but hot 10
    assert cached(s, 10) == 1 and cached(s, 20) == 0


def test_s3fifo_drops_one_time_prefixes_before_reused_ones_and_remembers_ghosts() -> None:
    s = sim({"type": "s3fifo", "small_fraction": 0.25}, 4)
    s.access(chain(10))
    s.access(chain(10))  # reused: into the main queue
    for i in (20, 30, 40, 50):  # one-time prefixes stream through the small queue
        s.access(chain(i))
    assert cached(s, 10) == 1  # LRU would have evicted it: it is the least recently used
    lru = sim("lru", 4)
    for request in (chain(10), chain(10), chain(20), chain(30), chain(40), chain(50)):
        lru.access(request)
    assert cached(lru, 10) == 0
    s3 = s.tree.eviction_order(Tier.DEVICE)
    assert (0, 20) in s3.ghosts  # type: ignore[attr-defined]  # (pages above, first page)
    s.access(chain(20))  # came back while remembered: straight into main
    node = s.tree.root.children[20]
    assert s3._queue[node] == 1  # type: ignore[attr-defined]


def test_arc_grows_its_recency_target_when_a_recency_ghost_returns() -> None:
    s = sim("arc", 4)
    arc = s.tree.eviction_order(Tier.DEVICE)
    for i in (10, 10, 20, 30, 40, 50):  # 10 reused (T2); the others seen once: T1 spills into B1
        s.access(chain(i))
    assert (0, 20) in arc.b1 and arc.target == 0  # type: ignore[attr-defined]
    assert cached(s, 10) == 1 and cached(s, 20) == 0
    s.access(chain(20))  # a recency ghost came back: T1 deserved more room
    assert arc.target > 0  # type: ignore[attr-defined]
    assert arc._list[s.tree.root.children[20]] == 2  # type: ignore[attr-defined]


def test_chain_trims_the_tail_of_a_leaf_lru_drops_it_whole() -> None:
    for name, kept in (("chain", 3), ("lru", 0)):
        s = sim(name, 6)
        s.access(chain(1, 2, 3, 4))
        s.access(chain(9, 8))
        s.access(chain(7))  # one page short: chain evicts block 4 only, LRU the whole leaf
        assert cached(s, 1, 2, 3, 4) == kept, name
        assert cached(s, 9, 8) == 2 and cached(s, 7) == 1


def test_cost_aware_evicts_short_state_heavy_leaves_first() -> None:
    tree, units = PrefixTree([kv_spec()]), Units()
    long = tree.insert(seq(2, 3, 4, 5), {"kv": units.take(4)}).node
    short = tree.insert(seq(1), {"kv": units.take(1)}).node  # the more recent one
    heavy = policy({"type": "cost_aware", "alpha": 2}, page_bytes=100, state_bytes=10_000)
    light = policy({"type": "cost_aware", "attention_weight": 0}, page_bytes=100, state_bytes=0)
    # without state every page costs the same: recency decides, the older long leaf goes
    assert min(light.ranked([short, long]))[2] is long
    # a state slot per leaf: the short leaf holds nearly as many bytes for a quarter of the work
    assert heavy.efficiency(long) > 3 * heavy.efficiency(short)  # type: ignore[attr-defined]
    assert min(heavy.ranked([short, long]))[2] is short


def test_cost_aware_config_options_are_checked() -> None:
    with pytest.raises(ValueError, match="alpha"):
        policy_config(HOST, {"type": "cost_aware", "alpha": -1})


def test_reuse_sends_new_prefixes_through_probation() -> None:
    s = sim({"type": "reuse", "initial_probation": 0.25, "min_probation": 0.25}, 4)
    s.access(chain(10))
    s.access(chain(10))  # reused: into main
    for i in (20, 30, 40, 50):
        s.access(chain(i))
    assert cached(s, 10) == 1  # LRU order would have taken it (see the s3fifo test)
    reuse = s.tree.eviction_order(Tier.DEVICE)
    before = reuse.target  # type: ignore[attr-defined]
    s.access(chain(20))  # left probation, came back: probation was too short
    assert reuse.target > before  # type: ignore[attr-defined]
    assert reuse.reused[1] >= 1  # type: ignore[attr-defined]  # size class of a 1-page prefix


def test_reuse_config_rejects_an_inverted_range() -> None:
    with pytest.raises(ValueError, match="min_probation"):
        policy_config(HOST, {"type": "reuse", "min_probation": 0.5, "initial_probation": 0.1})


def chats_and_documents(s: HitRateSimulator, rounds: int, later: int = 6) -> int:
    """Each round: a one-time 8-page document, a new 1-page chat and the second turn of the chat
    started ``later`` rounds before (never continued itself). LRU keeps a chat about four rounds
    here, so it loses the second turns; a policy that learns "long fresh documents are not
    continued, short chats are" keeps them. Returns the hit blocks of the second half."""
    hits = 0
    for r in range(rounds):
        requests = [chain(*range(100_000 + 8 * r, 100_008 + 8 * r)), chain(10_000 + 2 * r)]
        if r >= later:
            requests.append(chain(10_000 + 2 * (r - later), 10_001 + 2 * (r - later)))
        for request in requests:
            got = s.access(request) // BLOCK
            hits += got if r >= rounds // 2 else 0
    return hits


def test_learned_predicts_which_inserts_are_continued_and_beats_lru() -> None:
    quick = {"type": "learned", "min_horizon": 30, "refit_every": 16, "window": 256}
    learned, lru = sim(quick, 40), sim("lru", 40)
    assert chats_and_documents(learned, 80) > chats_and_documents(lru, 80)
    order = learned.tree.eviction_order(Tier.DEVICE)
    model = order.model  # type: ignore[attr-defined]
    assert model.version > 0  # refitted online from the outcomes
    # a long fresh document is predicted less likely to be continued than a short chat turn
    assert model.log_odds(features(8, 0, 0)) < model.log_odds(features(1, 0, 0))
    assert order.lifetime < 100  # the mean lifetime follows this small tier's evictions


def test_learned_ranks_a_reread_prefix_at_least_the_bonus_above_the_mean() -> None:
    s = sim({"type": "learned", "reread_bonus": 3.0}, 8)
    s.access(chain(1, 2))
    s.access(chain(1, 2))  # read again
    s.access(chain(3, 4))
    order = s.tree.eviction_order(Tier.DEVICE)
    leaves = [child for child in s.tree.root.children.values()]
    ranks = {node.keys[0]: rank for rank, _, node in order.ranked(leaves)}
    shift = order.shift()  # type: ignore[attr-defined]
    assert ranks[1] - ranks[3] >= 3.0 * shift - 1 - 1e-9  # older by one request, yet ranked later


def test_learned_config_rejects_unknown_and_negative_options() -> None:
    with pytest.raises(ValueError, match="max_shift"):
        policy_config(HOST, {"type": "learned", "max_shift": -1})
    with pytest.raises(ValueError, match="horizon"):
        policy_config(HOST, {"type": "learned", "horizon": 10})


def test_belady_is_the_best_on_the_bundled_sample() -> None:
    trace = read_trace(limit=200)
    rates = {
        name: simulate(trace, SimulationConfig(capacity_tokens=200_000, eviction=name), host=HOST).hit_rate
        for name in HOST.eviction_policies.names()
    }
    assert rates["belady"] == max(rates.values())
    assert rates["belady"] > rates["lru"]


def test_belady_cannot_run_without_the_future() -> None:
    belady = policy("belady")
    tree, units = PrefixTree([kv_spec()]), Units()
    node = tree.insert(seq(1), {"kv": units.take(1)}).node
    with pytest.raises(RuntimeError, match="simulate"):
        belady.ranked([node])


class Recorder(EvictionPolicy):
    """Records the events the tree sends (a policy with ``events``), ranks like LRU."""

    from kvstrata.eviction_policies.lru import LruConfig as Config

    name = "lru"
    capabilities = HOST.eviction_policies.get("fifo").capabilities  # events=True

    def __init__(self) -> None:
        super().__init__(self.Config(), PolicyContext(tier="device", capacity_pages=8, page_size=PAGE))
        self.log: list[tuple[str, Any]] = []

    def ranked(self, entries: list[Any]) -> list[tuple[float, int, Any]]:
        return [(n.last_access, n.id, n) for n in entries]

    def inserted(self, entries: Sequence[Any]) -> None:
        self.log.append(("inserted", [n.pages for n in entries]))

    def accessed(self, entries: Sequence[Any]) -> None:
        self.log.append(("accessed", [n.depth_end for n in entries]))

    def split(self, upper: Any, lower: Any) -> None:
        self.log.append(("split", (upper.pages, lower.pages)))

    def removed(self, entries: Sequence[Any]) -> None:
        self.log.append(("removed", [n.pages for n in entries]))


def test_the_tree_sends_one_access_per_request_and_the_other_events() -> None:
    tree, units = PrefixTree([kv_spec()]), Units()
    recorder = Recorder()
    tree.set_eviction_order(Tier.DEVICE, recorder)
    tree.insert(seq(1, 2, 3), {"kv": units.take(3)})
    assert recorder.log == [("inserted", [3])]
    recorder.log.clear()
    tree.match(seq(1, 2, 3, 4, 5))  # one request: one event, whatever its length
    tree.match(seq(1, 2, 3), count_hit=False)  # a re-match of the same request: no event
    assert recorder.log == [("accessed", [3])]
    recorder.log.clear()
    tree.match(seq(1))  # ends inside the node: it splits first
    assert recorder.log == [("split", (1, 2)), ("accessed", [1])]
    recorder.log.clear()
    result = tree.insert(seq(1, 7, 8), {"kv": units.take(2)}, at=None)
    assert recorder.log == [("inserted", [2])] and result.new_pages == 2
    recorder.log.clear()
    tree.evict_device({"kv": 4})
    assert [event for event, _ in recorder.log] == ["removed"]
    assert sum(recorder.log[0][1]) >= 4


def test_a_policy_without_events_hears_nothing() -> None:
    tree = PrefixTree([kv_spec()])
    tree.set_eviction_order(Tier.DEVICE, policy("lru"))
    assert tree.evictor.hears is False  # match and insert pay one attribute check


def test_retention_levels_rank_above_the_policy_and_ttl_decays() -> None:
    clock = [0.0]
    tree, units = PrefixTree([kv_spec()]), Units()
    retention = Retention(tree, 0, CacheMetrics(), clock=lambda: clock[0])
    tree.set_retention(retention)
    a = tree.insert(seq(1), {"kv": units.take(1)}).node
    b = tree.insert(seq(2), {"kv": units.take(1)}).node
    c = tree.insert(seq(3), {"kv": units.take(1)}).node
    retention._set_levels(a, RetentionHint(ttl_s=10).level, 10.0, 0.0)  # oldest, but protected
    retention._set_levels(c, RetentionHint(priority=-1).level, None, 0.0)  # newest, but unwanted
    assert tree.evict_device({"kv": 1}).deleted == 1 and c.parent is None
    assert tree.evict_device({"kv": 1}).deleted == 1 and b.parent is None and a.parent is tree.root
    tree.match(seq(1))  # a read does not renew the TTL
    d = tree.insert(seq(4), {"kv": units.take(1)}).node
    clock[0] = 11.0  # the TTL ran out: a is ordinary again, and older than d
    assert tree.evict_device({"kv": 1}).deleted == 1 and a.parent is None and d.parent is tree.root


def _one_block_hits(sequence: list[int], capacity: int, policy: str) -> list[int]:
    """Per request 1 (hit) or 0: every request one 1-token block of its own id."""
    requests = [TraceRequest(float(i), 1, 0, (x,)) for i, x in enumerate(sequence)]
    config = SimulationConfig(block_size=1, capacity_tokens=capacity, eviction=policy)
    return simulate(requests, config).per_request_hits


def _s3fifo_reference(seq: list[int], c: int, small_fraction: float = 0.1, max_reads: int = 3) -> list[int]:
    """S3-FIFO (Yang et al., SOSP'23) with kvstrata's documented variant (a read in S moves the
    object to M at once); M is a CLOCK: an object with reads left is re-inserted with one
    fewer, until the hand finds one with none."""
    small: OrderedDict[int, None] = OrderedDict()
    main: OrderedDict[int, None] = OrderedDict()
    ghosts: OrderedDict[int, None] = OrderedDict()
    reads: dict[int, int] = {}
    out: list[int] = []
    for x in seq:
        if x in small:
            del small[x]
            main[x] = None
            reads[x] = 0
            out.append(1)
            continue
        if x in main:
            reads[x] = min(reads[x] + 1, max_reads)
            out.append(1)
            continue
        out.append(0)
        if len(small) + len(main) >= c:
            if len(small) >= small_fraction * c or not main:
                k, _ = small.popitem(last=False)
                ghosts[k] = None
                while len(ghosts) > c:
                    ghosts.popitem(last=False)
            else:
                while True:
                    k, _ = main.popitem(last=False)
                    if reads[k] > 0:
                        reads[k] -= 1
                        main[k] = None
                    else:
                        break
        if x in ghosts:
            del ghosts[x]
            main[x] = None
            reads[x] = 0
        else:
            small[x] = None
    return out


def test_s3fifo_main_queue_is_a_clock_that_spends_a_read_per_lap() -> None:
    """Room for 2: 1 banks two reads, 2 one. The miss on 3 takes the CLOCK round 1 -> 1, 2 -> 0,
    1 -> 0 and evicts 2; the miss on 4 then evicts 1 (no reads left) and the last 3 hits. One read
    spent per eviction (not per lap) left 1 a read and evicted the fresh 3 instead."""
    sequence = [1, 1, 2, 2, 1, 1, 2, 3, 3, 4, 3]
    assert _s3fifo_reference(sequence, 2)[-1] == 1
    assert _one_block_hits(sequence, 2, "s3fifo") == _s3fifo_reference(sequence, 2)
    rng = random.Random(5)
    for _ in range(200):  # and as the reference on random one-block traces
        sequence = [rng.randrange(6) for _ in range(rng.randint(5, 25))]
        capacity = rng.randint(2, 4)
        assert _one_block_hits(sequence, capacity, "s3fifo") == _s3fifo_reference(sequence, capacity), (
            sequence
        )


@pytest.mark.parametrize("name", ["s3fifo", "arc", "reuse"])
def test_a_ghost_is_a_prefix_not_any_node_starting_with_the_same_page(name: str) -> None:
    """Live page keys are a page's tokens, not chained: the same tokens starting a node under
    another parent are another prefix, not the evicted one coming back."""
    tree, units = PrefixTree([kv_spec()]), Units()
    ghost_policy = policy(name, capacity=4)
    tree.set_eviction_order(Tier.DEVICE, ghost_policy)

    def entered_as_returning(node: Any) -> bool:
        if name == "s3fifo":
            return ghost_policy._queue[node] == 1  # type: ignore[attr-defined]
        if name == "arc":
            return ghost_policy._list[node] == 2  # type: ignore[attr-defined]
        return ghost_policy.segment[node] != 0  # type: ignore[attr-defined]  # reuse: not probation

    tree.insert(seq(20), {"kv": units.take(1)})
    assert tree.evict_device({"kv": 1}).deleted == 1  # seen once, evicted: a ghost
    tree.insert(seq(5), {"kv": units.take(1)})
    other = tree.insert(seq(5, 20), {"kv": units.take(2)}).node  # page 20's tokens under page 5
    assert other.depth_end == 2 and not entered_as_returning(other)
    back = tree.insert(seq(20), {"kv": units.take(1)}).node  # the evicted prefix itself
    assert entered_as_returning(back)


def test_learned_counts_a_reuse_only_for_the_same_prefix() -> None:
    """A prediction made at insert ("this prefix is continued") resolves on a reuse of that
    prefix, not on the same page tokens elsewhere (live page keys are not chained)."""
    tree, units = PrefixTree([kv_spec()]), Units()
    learned = policy("learned", capacity=8)
    tree.set_eviction_order(Tier.DEVICE, learned)
    tree.insert(seq(20), {"kv": units.take(1)})
    assert len(learned.pending) == 1  # type: ignore[attr-defined]
    tree.insert(seq(5), {"kv": units.take(1)})
    tree.insert(seq(5, 20), {"kv": units.take(1)})  # page 20's tokens, another prefix
    assert len(learned.pending) == 3  # type: ignore[attr-defined]  # none resolved
    tree.match(seq(20))  # the first prefix read again: its prediction resolves
    assert len(learned.pending) == 2  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["reuse", "arc"])
def test_a_node_first_heard_of_in_ranked_ranks_as_it_ranks_alone_next(name: str) -> None:
    """A node ``reuse`` (ARC and S3-FIFO alike) first hears of in ``ranked`` (an insert revived a
    host-only node) enters probation there. The segments' order was read from the page counts
    before it entered, so the same node ranked alone next (an eviction ranks nodes that become
    leaves as it goes, against the rest) ranked a whole segment apart: the policy kit, driving
    the host tier, found 8.0 against 2**50 + 8."""

    class Node:
        def __init__(self, node_id: int, pages: int) -> None:
            self.id, self.pages = node_id, pages

    order = policy(name, capacity=8)  # reuse's probation target: 0.8 pages (ARC's T1: 0)
    hot, revived = Node(1, 1), Node(2, 2)
    order.ranked([hot])  # type: ignore[list-item]  # heard of here: probation (T1)
    order.accessed([hot])  # type: ignore[list-item]  # read again: main (T2); probation empty
    together = {entry[2]: entry[0] for entry in order.ranked([hot, revived])}  # type: ignore[list-item]
    alone = order.ranked([revived])[0][0]  # type: ignore[list-item]
    assert together[revived] == alone
    assert alone < together[hot], "probation (2 pages, over its target) goes first"
