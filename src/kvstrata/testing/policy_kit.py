"""Conformance kit for eviction policies: subclass :class:`EvictionPolicyConformance` in your tests.

::

    from kvstrata.testing.policy_kit import EvictionPolicyConformance

    class TestMyPolicy(EvictionPolicyConformance):
        policy = "mine"                      # or {"type": "mine", "option": 3}

        @pytest.fixture
        def policy_host(self, kvstrata_bare_host):
            kvstrata_bare_host.eviction_policies.register(MyPolicy)   # or an installed entry point
            return kvstrata_bare_host

It runs the property tests kvstrata runs on its own policies, through the real prefix tree: a
random workload of requests over a small alphabet of pages (prefixes shared, split and extended)
against a device tier of :data:`CAPACITY` pages and a host tier of :data:`HOST_CAPACITY` pages,
each ranked by its own instance of the policy (as a cache installs them), as the controller
drives it (match = the access event, lock the prefix -- a load-back's source on the host too --,
evict what is missing, insert, back the prefix up to the host tier evicting there first, release
or keep the locks; some prefixes pinned). A policy only ranks what may leave, so these must hold
for any policy, in both tiers: a locked or pinned node keeps its pages, a tier never holds more
than its capacity, the tree's own checks pass after every step, and the same workload evicts
the same pages twice (determinism). A workload that has not finished after
:data:`WORKLOAD_DEADLINE_S` (a policy call that never returns) fails with :class:`PolicyHung`;
its thread is left running as a daemon. Needs ``hypothesis``: ``pip install 'kvstrata[testing]'``.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from itertools import count
from typing import Any

import pytest
import torch

from kvstrata.core.metrics import CacheMetrics
from kvstrata.core.policies import make_policy, policy_config
from kvstrata.core.retention import Pin, Retention, RetentionHint
from kvstrata.core.tree import LockHandle, PrefixTree, Tier, TreeNode, tree_path
from kvstrata.core.tree_eviction import event_errors
from kvstrata.plugins import NEVER, PluginHost, PolicyContext
from kvstrata.plugins.eviction_policy import EvictionPolicy, PolicyCapabilities
from kvstrata.plugins.pool_type import ModelContext
from kvstrata.pool_types.kv import KVConfig, KVPoolType

#: Tokens per page of the kit's tree, and pages its device and host tiers hold: the host tier
#: (every inserted prefix is backed up to it, as a write-through cache does) is smaller than the
#: traffic too, so both tiers' policies rank, and a host-tier bug is caught as a device one is.
PAGE = 4
CAPACITY = 12
HOST_CAPACITY = 10

#: Seconds one workload may take before the kit fails the policy as hung (a workload takes
#: milliseconds; a ``ranked()`` or an event that never returns would hang the test run).
WORKLOAD_DEADLINE_S = 60.0

#: One request of a workload: (page ids, keep its lock, pin its prefix).
Op = tuple[list[int], bool, bool]


def page_keys(*page_ids: int) -> list[tuple[int, ...]]:
    """Page keys whose pages are ``(id, id, id, id)``: readable prefixes."""
    return [(pid,) * PAGE for pid in page_ids]


class _OpsFuture:
    """The workload's future for offline policies: the next op whose path holds a page key."""

    def __init__(self, paths: list[list[int]]) -> None:
        self.now = -1
        self.paths = [set(page_keys(*path)) for path in paths]

    def next_use(self, key: Hashable) -> int:
        for i in range(self.now + 1, len(self.paths)):
            if key in self.paths[i]:
                return i
        return NEVER


#: How to install what the kit needs beyond kvstrata.
INSTALL = "pip install 'kvstrata[testing]'"


def _hypothesis() -> Any:
    """The ``hypothesis`` module, or an ImportError that says how to install it."""
    try:
        import hypothesis
        import hypothesis.strategies
    except ImportError as exc:
        raise ImportError(
            f"kvstrata's eviction-policy kit needs hypothesis ({exc}): install it with {INSTALL}"
        ) from exc
    return hypothesis


def request_paths() -> Any:
    """The hypothesis strategy of workloads: ids from a small alphabet, so prefixes are shared."""
    st = _hypothesis().strategies

    path = st.lists(st.integers(0, 3), min_size=1, max_size=6).map(lambda ids: [1, *ids])
    return st.lists(st.tuples(path, st.booleans(), st.booleans()), min_size=1, max_size=40)


class PolicyHung(BaseException):
    """A workload did not finish in time: a policy call never returned. A ``BaseException`` so
    hypothesis reports it at once instead of shrinking (every try would wait the deadline again)."""


def run_workload(
    host: PluginHost,
    policy: str | dict[str, Any],
    ops: list[Op],
    deadline_s: float = WORKLOAD_DEADLINE_S,
) -> list[tuple[Hashable, ...]]:
    """Serve ``ops`` through a real tree ranked by ``policy``; assert the invariants after every
    step; return what was evicted, in order. Runs in a daemon thread: a policy call that never
    returns fails the test after ``deadline_s`` (:class:`PolicyHung`) instead of hanging it."""
    workload = _Workload(host, policy)
    done: list[list[tuple[Hashable, ...]]] = []
    failed: list[BaseException] = []

    def serve() -> None:
        try:
            done.append(workload.serve(ops))
        except BaseException as exc:  # raised in the caller's thread below
            failed.append(exc)

    thread = threading.Thread(target=serve, name=f"kvstrata-policy-kit-{policy!r}", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        raise PolicyHung(
            f"policy {policy!r}: the workload did not finish within {deadline_s:g} s, stuck at "
            f"request {workload.step} of {len(ops)} (pages {workload.path}) while serving its "
            f"{workload.tier} tier: a call of the policy (ranked() or an event) never returned; a "
            "live cache would hang there with its lock held. The stuck thread is left running as a "
            "daemon."
        )
    if failed:
        raise failed[0]
    return done[0]


class _Workload:
    """One run of the kit's workload: a tree with a device and a host tier, each ranked by its
    own instance of the policy (as a cache installs them), requests served as the controller
    serves them, and every new prefix backed up to the host tier (evicting there first)."""

    def __init__(self, host: PluginHost, policy: str | dict[str, Any]) -> None:
        kv = KVPoolType(
            "kv", KVConfig(layers=1, kv_heads=1, head_dim=8), ModelContext(page_size=PAGE, anchor="kv")
        ).spec()
        self.policy = policy
        self.tree = tree = PrefixTree([kv])
        self.future = _OpsFuture([])
        self.batches: dict[Tier, list[tuple[Any, TreeNode]]] = {}  # each tier's eviction's first ranks
        for tier, capacity in ((Tier.DEVICE, CAPACITY), (Tier.HOST, HOST_CAPACITY)):
            context = PolicyContext(tier=tier.value, capacity_pages=capacity, page_size=PAGE, page_bytes=64)
            ranker = make_policy(host, policy_config(host, policy), context)
            if ranker.capabilities.needs_future:
                ranker.bind_future(self.future)
            ranker.ranked = _checked_ranked(policy, ranker.ranked, tier.value)  # type: ignore[method-assign]
            self.batches[tier] = ranker.ranked.batch  # type: ignore[attr-defined]
            tree.set_eviction_order(tier, ranker)
        self.retention = Retention(tree, max_pinned_pages=CAPACITY // 3, metrics=CacheMetrics())
        tree.set_retention(self.retention)
        self.fresh = count(0)
        self.held: list[LockHandle] = []
        self.host_held: list[LockHandle] = []
        self.pinned: list[Pin] = []
        self.evicted: list[tuple[Hashable, ...]] = []
        self.step, self.path, self.tier = 0, [0], "device"  # where a hung workload is stuck

    def serve(self, ops: list[Op]) -> list[tuple[Hashable, ...]]:
        self.future.paths = [set(page_keys(*path)) for path, _, _ in ops]
        for index, (path, keep, pin) in enumerate(ops):
            self.future.now, self.step, self.path = index, index, path
            self._request(page_keys(*path), keep, pin)
        return self.evicted

    def _request(self, keys: list[tuple[int, ...]], keep: bool, pin: bool) -> None:
        tree, policy = self.tree, self.policy
        self.tier = "device"
        match = tree.match(keys)
        lock = tree.lock(match.device_node) if match.device_pages else None
        # a load-back's source is locked on the host for as long as the request runs (as a lease)
        host_lock = tree.lock(match.host_node, Tier.HOST) if match.host_pages > match.device_pages else None
        new = len(keys) - match.device_pages
        used = tree.units("kv", Tier.DEVICE)
        if used + new > CAPACITY:
            self._evict_device(used + new - CAPACITY, _protected(tree, self.held, self.pinned, lock))
        tree.check()
        if tree.units("kv", Tier.DEVICE) + new <= CAPACITY and new:
            above = match.device_node if match.device_pages else None
            units = torch.tensor([next(self.fresh) for _ in range(new)], dtype=torch.int64)
            result = tree.insert(keys[match.device_pages :], {"kv": units}, at=above)
            lock = tree.lock(result.node) if lock is None else tree.move_lock(lock, result.node)
            if pin:
                taken = self.retention.apply(result.node, RetentionHint(pin=True), None)
                if taken is not None:
                    self.pinned.append(taken)
        assert tree.units("kv", Tier.DEVICE) <= CAPACITY, (
            f"policy {policy!r}: the tier holds more than its capacity"
        )
        assert self.retention.pinned_pages <= CAPACITY // 3
        kept = False
        if lock is not None:
            self._back_up(lock.node)
            kept = keep and len(self.held) < 2
            if kept:
                self.held.append(lock)
            else:
                tree.unlock(lock)
        if host_lock is not None:  # kept with the request's device lock, else released with it
            if kept:
                self.host_held.append(host_lock)
            else:
                tree.unlock(host_lock)
        if len(self.pinned) > 1:
            self.retention.release(self.pinned.pop(0))
        tree.check()
        # a cache logs and ignores an event that raises (the tree operation must complete): here
        # it fails the policy, which would rank from state its own bug left behind
        assert not event_errors(tree.evictor), f"policy {policy!r}: {event_errors(tree.evictor)}"

    def _evict_device(self, want: int, protected: dict[TreeNode, int]) -> None:
        tree, policy = self.tree, self.policy
        used = tree.units("kv", Tier.DEVICE)
        self.batches[Tier.DEVICE].clear()  # a new eviction: ranks of the last one may differ
        result = tree.evict_device({"kv": want})
        self.evicted.extend(("demoted", tuple(node.keys), node.pages) for node in result.demoted)
        self.evicted.append(("deleted", result.deleted, result.units.get("kv", 0)))
        _check_freed(policy, Tier.DEVICE, want, result.units.get("kv", 0), used, protected)

    def _back_up(self, end: TreeNode) -> None:
        """Back up the path to ``end`` (its nodes without a host copy: the path's tail) to the
        host tier, evicting there first what it lacks; as much of the tail as then fits."""
        tree, policy = self.tree, self.policy
        self.tier = "host"
        need = sum(node.pages for node in tree_path(tree, end) if node.host_raw[0] is None)
        used = tree.units("kv", Tier.HOST)
        if used + need > HOST_CAPACITY:
            protected = _protected(tree, self.host_held, [], None, Tier.HOST)
            want = used + need - HOST_CAPACITY
            self.batches[Tier.HOST].clear()
            result = tree.evict_host({"kv": want})
            freed = result.units.get("kv", 0)
            self.evicted.append(("host", result.deleted, freed))
            _check_freed(policy, Tier.HOST, want, freed, used, protected)
        room = HOST_CAPACITY - tree.units("kv", Tier.HOST)
        nodes = []
        for node in tree_path(tree, end):
            if node.host_raw[0] is None:
                if node.pages > room:
                    break
                room -= node.pages
                nodes.append(node)
        if nodes:
            units = torch.tensor(
                [next(self.fresh) for _ in range(sum(n.pages for n in nodes))], dtype=torch.int64
            )
            tree.set_host_values(nodes, {"kv": units.numpy().tobytes()})
        assert tree.units("kv", Tier.HOST) <= HOST_CAPACITY, (
            f"policy {policy!r}: the host tier holds more than its capacity"
        )


def _check_freed(
    policy: str | dict[str, Any], tier: Tier, want: int, freed: int, used: int, protected: dict[TreeNode, int]
) -> None:
    """An eviction in ``tier`` freed what was asked while unprotected pages remained, and left
    every locked or pinned node (``protected``: its pages) whole in that tier."""
    who = f"policy {policy!r}, {tier.value} tier"
    free = min(want, used - sum(protected.values()))
    assert freed >= free, (
        f"{who}: asked to free {want} pages, {free} of them unprotected, the eviction freed "
        f"{freed}: ranked() must rank every candidate it is given, so the tier can free what is "
        "asked while unprotected pages remain"
    )
    for node, pages in protected.items():
        held = node.device[0] if tier is Tier.DEVICE else node.host[0]
        assert node.parent is not None and held is not None, f"{who}: a locked or pinned node lost its pages"
        assert len(held) == pages == node.pages, f"{who}: a protected node was trimmed"


def _checked_ranked(policy: str | dict[str, Any], ranked: Any, tier: str = "device") -> Any:
    """``ranked`` checked against the contract: a list of one ``(rank, node.id, node)`` entry per
    given node, each exactly once, and no other node; and a node ranked again alone gets the same rank,
    comparable with the others'; ranking a node that became a candidate mid-eviction changes no
    rank of the eviction's first batch (kept in ``check.batch``, which the workload clears when an
    eviction starts). Failures name the tier (each tier ranks with its own instance)."""
    who = f"policy {policy!r} ({tier} tier)"
    batch: list[tuple[Any, TreeNode]] = []

    def check(nodes: list[TreeNode]) -> list[tuple[Any, int, TreeNode]]:
        given = sorted(node.id for node in nodes)  # before the call: a policy may change the list
        try:
            entries = ranked(nodes)
        except Exception as exc:
            raise AssertionError(f"{who}: ranked() raised {exc!r} ranking {len(nodes)} candidates") from exc
        assert type(entries) is list, (
            f"{who}: ranked() must return a list (the eviction heapifies it in place "
            f"and indexes it), not a {type(entries).__name__}"
        )
        got = sorted(entry[2].id for entry in entries)
        assert got == given, (
            f"{who}: ranked() must return one (rank, node.id, node) entry for each entry "
            f"it is given, each exactly once and no others; given node ids {given}, ranked {got}"
        )
        assert all(entry[1] == entry[2].id for entry in entries), (
            f"{who}: the second item of a ranked() entry must be its node's id (tie-break)"
        )
        nan = [entry[2].id for entry in entries if entry[0] != entry[0]]  # (NaN is not itself)
        assert not nan, (
            f"{who}: ranked() gave node ids {nan} a NaN rank: NaN compares false with every rank, "
            "so the eviction's order is arbitrary (an overflow or 0 / 0 in the policy's arithmetic?)"
        )
        if len(entries) == 1 and batch:
            _same_ranks(who, ranked, batch, entries[0][2], tier)
        if len(entries) > 1:  # an eviction ranks a node that became a leaf alone, mid-way
            batch[:] = [(entry[0], entry[2]) for entry in entries]
            rank, _, probe = entries[-1]
            alone = list(ranked([probe]))
            assert len(alone) == 1 and alone[0][2] is probe, f"{who}: ranked([node]) gave {alone}"
            try:
                sorted([entry[0] for entry in entries] + [alone[0][0]])
            except TypeError as exc:
                raise AssertionError(
                    f"{who}: ranks of one eviction must compare with each other ({exc}): "
                    f"a node ranked alone got {alone[0][0]!r}, among others {rank!r}"
                ) from None
            assert alone[0][0] == rank, (
                f"{who}: a node ranked alone got {alone[0][0]!r}, among others {rank!r}: "
                "a rank must not depend on which other nodes are ranked with it (an eviction ranks "
                "the nodes that become leaves as it goes and compares them with the rest)"
            )
        return entries

    check.batch = batch  # type: ignore[attr-defined]
    return check


def _same_ranks(who: str, ranked: Any, batch: list[tuple[Any, TreeNode]], new: TreeNode, tier: str) -> None:
    """The ranks of an eviction's first batch, its nodes still in ``tier`` ranked again alone, are
    what they were before ``new`` (a node that became a leaf mid-eviction) was ranked: the heap
    still holds them, so a policy whose state the new node changed (placed on first sight into a
    segment whose size decides which segment goes first) ranked it against an order it had left."""
    for rank, node in batch:
        held = node.device_raw[0] if tier == "device" else node.host_raw[0]
        if node is new or node.parent is None or held is None:
            continue
        again = ranked([node])[0][0]
        assert again == rank, (
            f"{who}: ranking node {new.id}, a candidate mid-eviction, changed node {node.id}'s rank "
            f"from {rank!r} to {again!r}: the eviction's heap compares the new rank with the old ones"
        )


def _protected(
    tree: PrefixTree,
    held: list[LockHandle],
    pinned: list[Pin],
    lock: LockHandle | None,
    tier: Tier = Tier.DEVICE,
) -> dict[TreeNode, int]:
    """Every node on a locked or pinned path holding pages in ``tier``, with its page count now."""
    ends = [h.node for h in held] + [pin.lock.node for pin in pinned]
    if lock is not None:
        ends.append(lock.node)
    out = {}
    for node in ends:
        cur: TreeNode | None = node
        while cur is not None and cur is not tree.root:
            if tier is Tier.DEVICE or cur.host_raw[0] is not None:
                out[cur] = cur.pages
            cur = cur.parent
    return out


def _given(max_examples: int) -> Any:
    """``@given(ops=request_paths())`` with the kit's settings (applied lazily: hypothesis is a
    test dependency, not one of kvstrata's)."""

    def wrap(test: Any) -> Any:
        _hypothesis()  # an ImportError naming the install command when it is missing
        from hypothesis import HealthCheck, given, settings

        # a mixin's method runs on one instance per subclass; the fixture only hands in a host
        checks = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.differing_executors]
        return settings(max_examples=max_examples, deadline=None, suppress_health_check=checks)(
            given(ops=request_paths())(test)
        )

    return wrap


class EvictionPolicyConformance:
    """Behaviour every eviction policy must show; set :attr:`policy`, override ``policy_host``."""

    #: the policy under test: its name, or a mapping with ``type`` and options
    policy: str | dict[str, Any] = ""
    #: seconds one workload may run before the policy fails as hung (:class:`PolicyHung`)
    workload_deadline_s: float = WORKLOAD_DEADLINE_S

    @pytest.fixture
    def policy_host(self) -> PluginHost:
        """A host where :attr:`policy` is registered (default: the installed plugins)."""
        return PluginHost()

    def _name(self) -> str:
        if not self.policy:
            raise NotImplementedError("an eviction-policy conformance class must set `policy`")
        return self.policy if isinstance(self.policy, str) else str(self.policy["type"])

    def test_declares_the_contract(self, policy_host: PluginHost) -> None:
        cls = policy_host.eviction_policies.require(self._name())
        assert issubclass(cls, EvictionPolicy), f"{cls!r} must subclass kvstrata.plugins.EvictionPolicy"
        assert isinstance(cls.capabilities, PolicyCapabilities), "capabilities must be a PolicyCapabilities"
        for tier, capacity in (("device", CAPACITY), ("host", HOST_CAPACITY)):
            context = PolicyContext(tier=tier, capacity_pages=capacity, page_size=PAGE, page_bytes=64)
            ranker = make_policy(policy_host, policy_config(policy_host, self.policy), context)
            assert list(ranker.ranked([])) == [], f"{tier} tier: ranking no entries must give none"

    @_given(max_examples=40)
    def test_keeps_locked_and_pinned_pages_and_the_capacity(
        self, policy_host: PluginHost, ops: list[Op]
    ) -> None:
        run_workload(policy_host, self.policy, ops, self.workload_deadline_s)

    @_given(max_examples=20)
    def test_is_deterministic(self, policy_host: PluginHost, ops: list[Op]) -> None:
        first = run_workload(policy_host, self.policy, ops, self.workload_deadline_s)
        assert first == run_workload(policy_host, self.policy, ops, self.workload_deadline_s), (
            f"policy {self.policy!r} evicted differently on the same workload: ranks must not depend "
            "on randomness, wall time or object ids"
        )

    def test_is_deterministic_on_a_sibling_heavy_workload(self, policy_host: PluginHost) -> None:
        """A fixed workload where many siblings compete, run again with other objects alive
        between the runs (so the tree's nodes sit elsewhere in memory): the random workloads
        above hit such a case only sometimes."""
        ops: list[Op] = [([1, i % 4, i % 3, i], False, False) for i in range(24)]
        first = run_workload(policy_host, self.policy, ops, self.workload_deadline_s)
        alive: list[object] = []
        for extra in (0, 1000, 333):
            alive.extend([object() for _ in range(extra)] + [{} for _ in range(extra // 3)])
            assert run_workload(policy_host, self.policy, ops, self.workload_deadline_s) == first, (
                f"policy {self.policy!r} evicted differently on the same workload: ranks must not "
                "depend on randomness, wall time or object ids"
            )

    def test_the_workload_evicts_at_all(self, policy_host: PluginHost) -> None:
        """The properties above are not vacuous: a plain workload overflows both tiers."""
        ops: list[Op] = [([1, i, i, i], False, False) for i in range(8)]
        evicted = run_workload(policy_host, self.policy, ops, self.workload_deadline_s)
        freed = sum(int(item[2]) for item in evicted if item[0] == "deleted")
        assert freed >= 8, (
            f"policy {self.policy!r}: 8 requests of 4 new pages each through a {CAPACITY}-page tier "
            f"freed only {freed} pages: ranked() must rank the candidates it is given"
        )
        host = sum(int(item[2]) for item in evicted if item[0] == "host")
        assert host >= 8, (
            f"policy {self.policy!r}: 8 requests of 4 new pages each backed up to a {HOST_CAPACITY}-page "
            f"host tier freed only {host} host pages: ranked() must rank the host tier's candidates too"
        )
