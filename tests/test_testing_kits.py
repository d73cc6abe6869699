"""The conformance kits plugin authors run (issue 27, item 12), run here on plugins of each kind:
the eviction-policy kit on a built-in and on an in-process one, the pool-type kit, the backend
kit's capability mixins; and each kit catches the plugin that breaks its rule."""

from __future__ import annotations

import ctypes
import random
import threading
import time
from collections.abc import Callable
from typing import Literal

import pytest

from kvstrata.core.io_plan import IOMode
from kvstrata.plugins import EvictionPolicy, EvictionPolicyConfig, PluginHost, PolicyCapabilities
from kvstrata.plugins.pool_type import (
    BufferSpec,
    Granularity,
    HitRule,
    HitRuleKind,
    Layout,
    ObjectSpec,
    PartialHit,
    PoolConfig,
    PoolRole,
    PoolSpec,
    PoolType,
    Replication,
)
from kvstrata.plugins.storage_backend import (
    ANY_POOL,
    BufferRegion,
    PoolCapabilities,
    StorageBackend,
    object_views,
)
from kvstrata.storage_backends.memory import MemoryBackend, MemoryConfig
from kvstrata.testing.conformance import CoreConformance, IntegrityConformance, RemovalConformance
from kvstrata.testing.policy_kit import EvictionPolicyConformance, run_workload
from kvstrata.testing.pool_kit import PAGE_SIZES, PoolTypeConformance


class TestLruThroughTheKit(EvictionPolicyConformance):
    policy = "lru"


class TestBeladyThroughTheKit(EvictionPolicyConformance):
    """The shipped offline reference passes the shipped kit (it failed its contract check)."""

    policy = "belady"


class MruConfig(EvictionPolicyConfig):
    type: Literal["mru"] = "mru"


class MruPolicy(EvictionPolicy):
    """A third-party policy registered in-process: most recently used first."""

    name = "mru"
    Config = MruConfig
    capabilities = PolicyCapabilities()

    def ranked(self, entries):  # type: ignore[no-untyped-def]
        return [(-n.last_access, n.id, n) for n in entries]


class CoinConfig(EvictionPolicyConfig):
    type: Literal["coin"] = "coin"


class CoinPolicy(EvictionPolicy):
    """Breaks the determinism rule on purpose (fault injection): random ranks."""

    name = "coin"
    Config = CoinConfig
    capabilities = PolicyCapabilities()

    def ranked(self, entries):  # type: ignore[no-untyped-def]
        return [(random.random(), n.id, n) for n in entries]


class TestAThirdPartyPolicyThroughTheKit(EvictionPolicyConformance):
    policy = {"type": "mru"}

    @pytest.fixture
    def policy_host(self, kvstrata_host: PluginHost) -> PluginHost:
        kvstrata_host.eviction_policies.register(MruPolicy)
        return kvstrata_host


class _BrokenEventsConfig(EvictionPolicyConfig):
    type: Literal["broken_events"] = "broken_events"


class BrokenEventsPolicy(EvictionPolicy):
    """Its event bookkeeping has a bug: ``inserted`` looks up a parent it never saw."""

    name = "broken_events"
    Config = _BrokenEventsConfig
    capabilities = PolicyCapabilities(events=True)

    def __init__(self, config: _BrokenEventsConfig, context: object) -> None:
        super().__init__(config, context)  # type: ignore[arg-type]
        self.seen: dict[int, int] = {}

    def inserted(self, entries: list) -> None:  # type: ignore[type-arg]
        for node in entries:
            self.seen[node.id] = self.seen[node.parent.id] + 1

    def ranked(self, entries: list) -> list:  # type: ignore[type-arg]
        return [(self.seen.get(n.id, 0), n.id, n) for n in entries]


def test_the_policy_kit_fails_a_policy_whose_events_raise(kvstrata_host: PluginHost) -> None:
    """A cache logs and ignores an event that raises (review s35: the kit then passed it)."""
    kvstrata_host.eviction_policies.register(BrokenEventsPolicy)
    ops = [([1, i, i, i], False, False) for i in range(8)]
    with pytest.raises(AssertionError, match=r"inserted\(\) raised KeyError"):
        run_workload(kvstrata_host, "broken_events", ops)


def test_the_policy_kit_catches_a_non_deterministic_policy(kvstrata_host: PluginHost) -> None:
    kvstrata_host.eviction_policies.register(CoinPolicy)
    ops = [([1, i % 3, i % 2, i], False, False) for i in range(12)]
    with pytest.raises(AssertionError, match="must not depend on which other nodes"):  # ranked again
        run_workload(kvstrata_host, "coin", ops)


class PositionRankConfig(EvictionPolicyConfig):
    type: Literal["position_rank"] = "position_rank"


class PositionRankPolicy(EvictionPolicy):
    """Breaks the rule on purpose: ranks by position in the call (0, 1, 2 ...), so a node an
    eviction ranks alone mid-way (a parent whose last child left) is always the coldest."""

    name = "position_rank"
    Config = PositionRankConfig
    capabilities = PolicyCapabilities()

    def ranked(self, entries):  # type: ignore[no-untyped-def]
        ordered = sorted(entries, key=lambda n: (n.last_access, n.id))
        return [(i, n.id, n) for i, n in enumerate(ordered)]


class TypeMixConfig(EvictionPolicyConfig):
    type: Literal["type_mix"] = "type_mix"


class TypeMixPolicy(EvictionPolicy):
    """Breaks the rule on purpose: a node ranked alone gets a str rank, which the eviction's heap
    cannot compare with the others' (a TypeError mid-eviction)."""

    name = "type_mix"
    Config = TypeMixConfig
    capabilities = PolicyCapabilities()

    def ranked(self, entries):  # type: ignore[no-untyped-def]
        if len(entries) == 1:
            return [(str(entries[0].last_access), entries[0].id, entries[0])]
        return [(n.last_access, n.id, n) for n in entries]


@pytest.mark.parametrize(
    ("policy", "rule"),
    [
        (PositionRankPolicy, "must not depend on which other nodes"),
        (TypeMixPolicy, "must compare with each other"),
    ],
)
def test_the_policy_kit_catches_ranks_that_change_with_the_other_nodes_ranked(
    kvstrata_host: PluginHost, policy: type, rule: str
) -> None:
    """Ranks of one eviction must compare: the tree ranks the nodes that become leaves as it goes
    (alone) and compares them with the rest. The kit's fixed workloads never ranked a node alone
    and its random ones only sometimes: both policies passed (one crashes evictions)."""
    kvstrata_host.eviction_policies.register(policy)
    kit = EvictionPolicyConformance()
    kit.policy = policy.name
    with pytest.raises(AssertionError, match=rule):
        kit.test_the_workload_evicts_at_all(kvstrata_host)


class OnlyMostRecentConfig(EvictionPolicyConfig):
    type: Literal["only_most_recent"] = "only_most_recent"


class OnlyMostRecentPolicy(EvictionPolicy):
    """Breaks the ranking contract on purpose: ranks only the most recent of its candidates (the
    tier then frees less than asked and the workload's inserts were silently skipped)."""

    name = "only_most_recent"
    Config = OnlyMostRecentConfig
    capabilities = PolicyCapabilities()

    def ranked(self, entries):  # type: ignore[no-untyped-def]
        return sorted((n.last_access, n.id, n) for n in entries)[-1:] if entries else []


class TwiceConfig(EvictionPolicyConfig):
    type: Literal["twice"] = "twice"


class TwicePolicy(MruPolicy):
    """Breaks the ranking contract on purpose: every candidate twice."""

    name = "twice"
    Config = TwiceConfig

    def ranked(self, entries):  # type: ignore[no-untyped-def]
        return super().ranked(entries) * 2


#: 24 requests on one root branching four ways, then three, then each its own leaf: evictions
#: that take leaves and, mid-eviction, parents whose last child left (what the broken policies trip)
BRANCHING_OPS = [([1, i % 4, i % 3, i], False, False) for i in range(24)]


@pytest.mark.parametrize("policy", [OnlyMostRecentPolicy, TwicePolicy])
def test_the_policy_kit_names_the_ranking_rule(kvstrata_host: PluginHost, policy: type) -> None:
    kvstrata_host.eviction_policies.register(policy)
    ops = BRANCHING_OPS
    with pytest.raises(AssertionError, match=r"ranked\(\) must return one \(rank, node.id, node\) entry"):
        run_workload(kvstrata_host, policy.name, ops)


class GeneratorRankConfig(EvictionPolicyConfig):
    type: Literal["generator_rank"] = "generator_rank"


class GeneratorRankPolicy(MruPolicy):
    """Breaks the ranking contract on purpose: a generator of entries, not a list. The kit took
    a list of it and passed; a live cache's eviction heapifies it (a TypeError at allocate)."""

    name = "generator_rank"
    Config = GeneratorRankConfig

    def ranked(self, entries):  # type: ignore[no-untyped-def]
        return (entry for entry in super().ranked(entries))


def test_the_policy_kit_wants_a_list_of_ranks(kvstrata_host: PluginHost) -> None:
    kvstrata_host.eviction_policies.register(GeneratorRankPolicy)
    kit = EvictionPolicyConformance()
    kit.policy = "generator_rank"
    with pytest.raises(AssertionError, match=r"ranked\(\) must return a list .* not a generator"):
        kit.test_the_workload_evicts_at_all(kvstrata_host)


class NanRankConfig(EvictionPolicyConfig):
    type: Literal["nan_rank"] = "nan_rank"


class NanRankPolicy(MruPolicy):
    """Breaks the ranking contract on purpose: a NaN rank (what 0 / 0 or inf x 0 in a policy's
    arithmetic gives). It compares false with every rank, so the eviction order is arbitrary;
    every other property holds (deterministic, locks kept), so the kit passed it."""

    name = "nan_rank"
    Config = NanRankConfig

    def ranked(self, entries):  # type: ignore[no-untyped-def]
        return [(float("nan") if n.id % 2 else float(n.last_access), n.id, n) for n in entries]


def test_the_policy_kit_catches_nan_ranks(kvstrata_host: PluginHost) -> None:
    kvstrata_host.eviction_policies.register(NanRankPolicy)
    ops = BRANCHING_OPS
    with pytest.raises(AssertionError, match="a NaN rank"):
        run_workload(kvstrata_host, "nan_rank", ops)


class SegmentFlipConfig(EvictionPolicyConfig):
    type: Literal["segment_flip"] = "segment_flip"


class SegmentFlipPolicy(MruPolicy):
    """Breaks the ranking contract on purpose, as ``arc`` / ``reuse`` / ``s3fifo`` did with a
    node they first heard of in ``ranked()``: a node seen first there joins a segment, and which
    segment goes first follows the segments' sizes. Every node of a call joins before the order
    is read, so a node ranked again alone ranks the same; but a parent that becomes a candidate
    mid-eviction, ranked alone, flips the order the heap's other ranks were computed under."""

    name = "segment_flip"
    Config = SegmentFlipConfig

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.seen: dict[object, int] = {}

    def ranked(self, entries):  # type: ignore[no-untyped-def]
        for n in entries:
            self.seen.setdefault(n, len(self.seen))
        odd_first = len(self.seen) % 2
        return [(((self.seen[n] % 2) != odd_first) * 1e9 + n.last_access, n.id, n) for n in entries]


def test_the_policy_kit_catches_a_rank_order_changed_mid_eviction(kvstrata_host: PluginHost) -> None:
    kvstrata_host.eviction_policies.register(SegmentFlipPolicy)
    ops = BRANCHING_OPS
    with pytest.raises(AssertionError, match="a candidate mid-eviction, changed node"):
        run_workload(kvstrata_host, "segment_flip", ops)


class ByAddressConfig(EvictionPolicyConfig):
    type: Literal["by_address"] = "by_address"


class ByAddressPolicy(MruPolicy):
    """Breaks the determinism rule on purpose: ranks by object id (the node's address)."""

    name = "by_address"
    Config = ByAddressConfig

    def ranked(self, entries):  # type: ignore[no-untyped-def]
        return [(id(n), n.id, n) for n in entries]


def test_the_policy_kit_catches_an_id_ranked_policy_every_time(kvstrata_host: PluginHost) -> None:
    kvstrata_host.eviction_policies.register(ByAddressPolicy)
    kit = EvictionPolicyConformance()
    kit.policy = "by_address"
    with pytest.raises(AssertionError, match="must not depend on randomness, wall time or object ids"):
        kit.test_is_deterministic_on_a_sibling_heavy_workload(kvstrata_host)


class HostBlindConfig(EvictionPolicyConfig):
    type: Literal["host_blind"] = "host_blind"


class HostBlindPolicy(MruPolicy):
    """Breaks the ranking contract on purpose, on the host tier only: ranks none of its
    candidates there (a live cache's host tier then never frees a page and refuses backups)."""

    name = "host_blind"
    Config = HostBlindConfig

    def ranked(self, entries):  # type: ignore[no-untyped-def]
        return [] if self.context.tier == "host" else super().ranked(entries)


class HostRaisesConfig(EvictionPolicyConfig):
    type: Literal["host_raises"] = "host_raises"


class HostRaisesPolicy(MruPolicy):
    """Breaks on purpose on the host tier only: ``ranked()`` raises there."""

    name = "host_raises"
    Config = HostRaisesConfig

    def ranked(self, entries):  # type: ignore[no-untyped-def]
        if self.context.tier == "host" and entries:
            raise KeyError("host bookkeeping")
        return super().ranked(entries)


class HostExtraConfig(EvictionPolicyConfig):
    type: Literal["host_extra"] = "host_extra"


class HostExtraPolicy(MruPolicy):
    """Breaks on purpose on the host tier only: ranks a node it was not offered as well (the
    parent of a candidate: a node the tier may not drop yet, e.g. locked or with children)."""

    name = "host_extra"
    Config = HostExtraConfig

    def ranked(self, entries):  # type: ignore[no-untyped-def]
        out = super().ranked(entries)
        if self.context.tier == "host":
            ids = {n.id for n in entries}
            extra = [n.parent for n in entries if n.parent is not None and n.parent.parent is not None]
            extra = [n for n in extra if n.id not in ids][:1]
            out += [(-1, n.id, n) for n in extra]
        return out


@pytest.mark.parametrize(
    ("policy", "rule"),
    [
        (HostBlindPolicy, r"\(host tier\): ranked\(\) must return one \(rank, node.id, node\) entry"),
        (HostRaisesPolicy, r"\(host tier\): ranked\(\) raised KeyError"),
        (HostExtraPolicy, r"\(host tier\): ranked\(\) must return one \(rank, node.id, node\) entry"),
    ],
)
def test_the_policy_kit_drives_the_host_tier(kvstrata_host: PluginHost, policy: type, rule: str) -> None:
    """The kit ran the device tier only: a policy broken on the host tier (where a cache ranks
    with its own instance of the policy) passed every check."""
    kvstrata_host.eviction_policies.register(policy)
    kit = EvictionPolicyConformance()
    kit.policy = policy.name
    with pytest.raises(AssertionError, match=rule):
        kit.test_the_workload_evicts_at_all(kvstrata_host)


def test_the_policy_kit_workload_evicts_from_the_host_tier(kvstrata_host: PluginHost) -> None:
    """The host tier is smaller than the traffic: both passes of a host eviction run (host-only
    nodes deleted; host copies of pages still on the device dropped)."""
    ops: list = [([1, i, i, i], i % 3 == 0, False) for i in range(8)]
    evicted = run_workload(kvstrata_host, "lru", ops)
    assert sum(int(item[2]) for item in evicted if item[0] == "host") >= 8, evicted
    assert any(item[0] == "demoted" for item in evicted), evicted
    assert any(item[0] == "host" and item[1] > 0 for item in evicted), evicted  # host-only nodes
    copies = run_workload(kvstrata_host, "lru", [([1, i, i], False, False) for i in range(6)])
    assert any(item[0] == "host" and item[1] == 0 and item[2] > 0 for item in copies), copies


class HangingConfig(EvictionPolicyConfig):
    type: Literal["hanging"] = "hanging"


def test_the_policy_kit_fails_a_policy_that_never_returns(kvstrata_host: PluginHost) -> None:
    """A ``ranked()`` that never returns hung the kit (and the whole test run) forever: it now
    fails after the kit's deadline, naming the hang. Run here in a thread of its own, so this
    test fails rather than hangs where the kit does not catch it."""
    release = threading.Event()

    class HangingPolicy(MruPolicy):
        name = "hanging"
        Config = HangingConfig

        def ranked(self, entries):  # type: ignore[no-untyped-def]
            if entries:
                release.wait(60)  # "forever", released when the test ends
            return super().ranked(entries)

    kvstrata_host.eviction_policies.register(HangingPolicy)
    kit = EvictionPolicyConformance()
    kit.policy = "hanging"
    kit.workload_deadline_s = 0.5
    raised: list[BaseException] = []

    def run() -> None:
        try:
            kit.test_the_workload_evicts_at_all(kvstrata_host)
        except BaseException as exc:
            raised.append(exc)

    try:
        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        runner.join(20)
        assert not runner.is_alive(), "the policy kit hung on a policy whose ranked() never returns"
        assert raised, "the policy kit passed a policy whose ranked() never returns"
        message = str(raised[0])
        assert "did not finish within 0.5 s" in message and "device tier" in message, message
        assert "left running as a daemon" in message, message
    finally:
        release.set()


# --- backend kit: capability mixins and the "absent key removed" rule ------------------------------


class KeepForeverBackend(MemoryBackend):
    """A backend that cannot remove objects (e.g. an append-only store): declares removable=False."""

    name = "keepforever"
    capabilities = MemoryBackend.capabilities.model_copy(update={"removable": False})

    def remove(self, keys):  # type: ignore[no-untyped-def]
        raise NotImplementedError("append-only")


class TestANonRemovableBackendOptsOut(CoreConformance, IntegrityConformance):
    """Composes the mixins it supports: no removal test runs, so none is skipped (the core skips
    only the checks of capabilities it does not declare: host_allocator, persistent)."""

    @pytest.fixture
    def backend_factory(self) -> Callable[[str], StorageBackend]:
        return lambda instance="conformance": KeepForeverBackend(instance, MemoryConfig())


def test_non_removable_composition_has_no_removal_tests() -> None:
    names = {n for n in dir(TestANonRemovableBackendOptsOut) if n.startswith("test_")}
    assert "test_round_trip_multi_region" in names and "test_integrity_rejection" in names
    assert not {n for n in names if "remov" in n}


class FalseForAbsent(MemoryBackend):
    """Breaks the contract on purpose: False for a key that was never stored."""

    def remove(self, keys):  # type: ignore[no-untyped-def]
        return [False] * len(keys)


def test_the_kit_names_the_absent_key_rule() -> None:
    with pytest.raises(AssertionError, match="the contract is True for an absent key"):
        RemovalConformance().test_removing_an_absent_key_returns_true(FalseForAbsent("l3", MemoryConfig()))


class KeepsReferences(MemoryBackend):
    """Breaks the contract on purpose: a zero-copy put() returns True but keeps views of the
    caller's memory (a write-behind that never copied): once that memory is reused, it serves
    other bytes."""

    capabilities = MemoryBackend.capabilities.model_copy(
        update={"pools": {ANY_POOL: PoolCapabilities(zero_copy=True)}}
    )

    def put(self, objects):  # type: ignore[no-untyped-def]
        with self._lock:
            for obj in objects:
                self._objects.setdefault(obj.key, [memoryview(v) for v in object_views(obj)])  # type: ignore[arg-type]
        return [True] * len(objects)

    def get(self, objects):  # type: ignore[no-untyped-def]
        out = []
        for obj in objects:
            with self._lock:
                views = self._objects.get(obj.key)
            if views is None:
                out.append(-1)
                continue
            data, offset = b"".join(bytes(v) for v in views), 0  # type: ignore[union-attr]
            for view in object_views(obj):
                chunk = data[offset : offset + len(view)]
                view[: len(chunk)] = chunk
                offset += len(chunk)
            out.append(offset)
        return out


class KeepsFirstClaimsReplace(MemoryBackend):
    """Breaks its declaration on purpose: declares overwrite='replace' but keeps the first object
    under a key (the memory backend's skip_existing)."""

    capabilities = MemoryBackend.capabilities.model_copy(update={"overwrite": "replace"})


class Replaces(MemoryBackend):
    """Keeps its declaration: overwrite='replace', and a second put of a key replaces it."""

    capabilities = MemoryBackend.capabilities.model_copy(update={"overwrite": "replace"})

    def put(self, objects):  # type: ignore[no-untyped-def]
        self.remove([obj.key for obj in objects])
        return super().put(objects)


class VisibleWhileWritten(MemoryBackend):
    """Breaks its declaration on purpose: declares atomic_visibility but publishes each key
    before its bytes are copied in (a zero-filled object for a while), as a store that
    preallocates and then fills in place does."""

    def put(self, objects):  # type: ignore[no-untyped-def]
        for obj in objects:
            slot = bytearray(obj.nbytes)
            with self._lock:
                if obj.key in self._objects:  # skip_existing
                    continue
                self._objects[obj.key] = slot  # type: ignore[assignment]
                self._bytes += len(slot)
            time.sleep(0.005)  # the copy takes a while (a large object, a slow device)
            slot[:] = b"".join(bytes(view) for view in object_views(obj))
        return [True] * len(objects)


def test_the_kit_checks_the_overwrite_a_backend_declares() -> None:
    """The kit read only what RemovalConformance's layout change needed: a backend declaring
    overwrite='replace' that kept the first object passed."""
    kit = CoreConformance()
    kit.model_name = "conformance-overwrite"
    with pytest.raises(AssertionError, match="declares overwrite='replace', but a second put"):
        kit.test_overwrite_is_what_the_backend_declares(KeepsFirstClaimsReplace("l3", MemoryConfig()))
    kit.test_overwrite_is_what_the_backend_declares(Replaces("l3", MemoryConfig()))
    kit.test_overwrite_is_what_the_backend_declares(MemoryBackend("l3", MemoryConfig()))  # skip_existing


def test_the_kit_checks_atomic_visibility_when_declared() -> None:
    """No check named atomic_visibility: a backend declaring it whose keys are visible before
    their bytes failed only the concurrency test, as "not thread-safe" (its threads re-put shared
    keys). The race names the capability, on fresh keys with a reader that never writes."""
    kit = CoreConformance()
    kit.model_name = "conformance-atomic"
    with pytest.raises(AssertionError, match="declares atomic_visibility, but a reader racing a writer"):
        kit.test_atomic_visibility_holds_against_a_concurrent_reader(
            VisibleWhileWritten("l3", MemoryConfig())
        )
    kit.test_atomic_visibility_holds_against_a_concurrent_reader(MemoryBackend("l3", MemoryConfig()))


def test_the_kit_catches_a_put_that_keeps_references_instead_of_bytes() -> None:
    """The round trips read back right after the put with the source untouched: a zero-copy
    backend whose put kept the caller's regions passed. The caller (a host tier) reuses that
    memory at once; the kit now overwrites it before reading back."""
    kit = CoreConformance()
    runs = {
        "checksum xxh3 (the default): a corrupt object, a miss": kit.test_round_trip_multi_region,
        "checksum none: other bytes served": lambda b: kit.test_round_trip_through_registered_host_memory(
            b, "none"
        ),
    }
    for what, run in runs.items():
        backend = KeepsReferences("l3", MemoryConfig())
        backend.open()
        with pytest.raises(AssertionError):
            run(backend)
            pytest.fail(f"passed ({what})")  # (never reached: what the kit must catch)


class CountsPresentKeys(MemoryBackend):
    """Breaks the contract on purpose: exists(leading=True) counts the present keys instead of
    stopping at the first absent one (pages 0, 1 and 3 stored: "the first 3 are present")."""

    def exists(self, keys, leading: bool = False):  # type: ignore[no-untyped-def]
        found = super().exists(keys)
        return [i < sum(found) for i in range(len(keys))] if leading else found


def test_the_kit_catches_a_leading_exists_that_counts_past_a_gap() -> None:
    with pytest.raises(AssertionError, match="stops at the first absent key"):
        CoreConformance().test_existence_prefix_semantics(CountsPresentKeys("l3", MemoryConfig()))


class ZeroFillsOnMiss(MemoryBackend):
    """Breaks the contract on purpose (fault injection): a zero-copy get() zero-fills the regions
    of a key it does not hold. The kit's target pages started as zeros, so it passed."""

    capabilities = MemoryBackend.capabilities.model_copy(
        update={"pools": {ANY_POOL: PoolCapabilities(zero_copy=True)}}
    )

    def get(self, objects):  # type: ignore[no-untyped-def]
        found = super().get(objects)
        for obj, nbytes in zip(objects, found, strict=True):
            if nbytes < 0:
                for view in object_views(obj):
                    view[:] = bytes(len(view))
        return found


def test_the_kit_catches_a_get_that_writes_zeros_for_a_missing_key() -> None:
    backend = ZeroFillsOnMiss("l3", MemoryConfig())
    with pytest.raises(AssertionError, match="get\\(\\) of a key it does not hold wrote into"):
        CoreConformance().test_round_trip_through_registered_host_memory(backend, "xxh3")


class ClaimsRegionLength(MemoryBackend):
    """Breaks the contract on purpose (fault injection): get() reports the length of the regions
    it was given for every object found, not the bytes it read. A cut object then passed the
    kit: its checksum failed on whatever the rest of the page held, so it was refused anyway."""

    def get(self, objects):  # type: ignore[no-untyped-def]
        found = super().get(objects)
        return [obj.nbytes if nbytes >= 0 else nbytes for obj, nbytes in zip(objects, found, strict=True)]


class ClaimsRegionLengthZeroCopy(ClaimsRegionLength):
    capabilities = MemoryBackend.capabilities.model_copy(
        update={"pools": {ANY_POOL: PoolCapabilities(zero_copy=True)}}
    )


@pytest.mark.parametrize("backend_class", [ClaimsRegionLength, ClaimsRegionLengthZeroCopy])
def test_the_kit_catches_a_get_that_reports_more_bytes_than_it_read(backend_class: type) -> None:
    backend = backend_class("l3", MemoryConfig())
    with pytest.raises(AssertionError, match="an object cut in half was read as whole"):
        IntegrityConformance().test_cut_object_is_a_miss_without_checksums(backend)


class OverrunsLastRegion(MemoryBackend):
    """Breaks the contract on purpose (fault injection): a zero-copy get() writes the rest of a
    stored object into its last region, unbounded. Every object the kit read was as long as its
    regions, so it passed; an object of another layout then overwrote the host pool's next pages."""

    capabilities = MemoryBackend.capabilities.model_copy(
        update={"pools": {ANY_POOL: PoolCapabilities(zero_copy=True)}}
    )

    def get(self, objects):  # type: ignore[no-untyped-def]
        out = []
        for obj in objects:
            with self._lock:
                data = self._objects.get(obj.key)
            if data is None:
                out.append(-1)
                continue
            regions, offset = [r for r in obj.regions if r.nbytes], 0
            for position, region in enumerate(regions):
                last = position == len(regions) - 1
                take = len(data) - offset if last else min(region.nbytes, len(data) - offset)
                ctypes.memmove(region.ptr, data[offset : offset + take], take)
                offset += take
            out.append(offset)
        return out


def test_the_kit_catches_a_get_that_writes_past_its_regions() -> None:
    # the kit's target keeps two spare units after the last one read: the overrun stays in it
    with pytest.raises(AssertionError, match="wrote past them, into the next page's memory"):
        CoreConformance().test_longer_object_is_read_no_further_than_its_regions(
            OverrunsLastRegion("l3", MemoryConfig())
        )


class ReversedExists(MemoryBackend):
    """Fault injection: exists() answers in reverse order."""

    def exists(self, keys):  # type: ignore[no-untyped-def]
        return super().exists(keys)[::-1]


class ReversedGet(MemoryBackend):
    """Fault injection: get() reads each object into its own regions, answers in reverse order."""

    def get(self, objects):  # type: ignore[no-untyped-def]
        return super().get(objects)[::-1]


class DropsEveryOtherPut(MemoryBackend):
    """Fault injection: put() stores every other object and reports all of them stored."""

    def put(self, objects):  # type: ignore[no-untyped-def]
        super().put(objects[::2])
        return [True] * len(objects)


class OneByteLong(MemoryBackend):
    """Fault injection: get() reports one byte more than it read."""

    def get(self, objects):  # type: ignore[no-untyped-def]
        return [nbytes + 1 if nbytes >= 0 else nbytes for nbytes in super().get(objects)]


@pytest.mark.parametrize("backend_class", [ReversedExists, ReversedGet, DropsEveryOtherPut, OneByteLong])
def test_the_kit_catches_misaligned_or_false_per_key_answers(backend_class: type) -> None:
    """Answers out of key order, "stored" for what was not, a wrong byte count: each fails the
    kit's per-key checks (a guard: these were caught before)."""
    kit = CoreConformance()
    checks = [kit.test_partial_batches_per_key, kit.test_round_trip_multi_region]
    failures = 0
    for check in checks:
        try:
            check(backend_class("l3", MemoryConfig()))
        except AssertionError:
            failures += 1
    assert failures, f"{backend_class.__name__} passed the kit's per-key checks"


# --- pool-type kit on the built-in kinds ------------------------------------------------------------


class TestKvAnchorThroughThePoolKit(PoolTypeConformance):
    pool_config = {"type": "kv", "layers": 2, "kv_heads": 2, "head_dim": 8, "unit_layout": "head_major"}


class TestConvStateThroughThePoolKit(PoolTypeConformance):
    """A small per-request state (a conv state) is a mamba pool with named states."""

    pool_config = {"type": "mamba", "layers": 2, "states": {"conv": {"shape": [4, 3]}}}


class TestWindowThroughThePoolKit(PoolTypeConformance):
    pool_config = {"type": "swa", "layers": 1, "kv_heads": 1, "head_dim": 8, "window": 32}


class TestSidecarThroughThePoolKit(PoolTypeConformance):
    pool_config = {"type": "nsa", "layers": 1, "key_dtype": "bfloat16", "index_head_dim": 16}


class TestLogicalThroughThePoolKit(PoolTypeConformance):
    pool_config = {"type": "logical"}


# --- failures read as the rule broken, with the values ----------------------------------------------


def test_the_kit_modules_are_assert_rewritten() -> None:
    """The pytest plugin marks the kit modules for rewriting before they are imported, so a failing
    kit assert shows its values (``assert 5 == 3``), not a bare ``AssertionError``."""
    import sys

    import kvstrata.testing.conformance  # noqa: F401 - loaded already; here for the lookup below

    for module in (
        "conformance",
        "conformance_optional",
        "_allocator_kit",
        "_backend_kit",
        "_lifecycle_kit",
        "policy_kit",
        "pool_kit",
    ):
        loader = sys.modules[f"kvstrata.testing.{module}"].__loader__
        assert type(loader).__name__ == "AssertionRewritingHook", f"{module} is not assert-rewritten"


class WorkerThreadsMiss(MemoryBackend):
    """Breaks thread safety on purpose: a read from any thread but the main one is a miss."""

    def get(self, objects):  # type: ignore[no-untyped-def]
        if threading.current_thread() is not threading.main_thread():
            return [-1] * len(objects)
        return super().get(objects)


def test_the_thread_test_shows_what_failed_in_the_threads() -> None:
    backend = WorkerThreadsMiss("l3", MemoryConfig())
    with pytest.raises(AssertionError, match=r"not thread-safe(.|\n)*thread \d: get of its own keys failed"):
        CoreConformance().test_concurrent_distinct_and_same_keys(backend)


def test_the_pool_kit_leaves_no_temporary_directory(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Its stacks' L3 directories live in pytest's ``tmp_path``, not in ever more /tmp dirs."""
    import tempfile

    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    kit = TestLogicalThroughThePoolKit()
    kit.test_round_trip_through_host_and_l3(PluginHost(), tmp_path / "kit", 16)
    assert list(system_tmp.iterdir()) == []


class ListPoolConfig(PoolConfig):
    type: Literal["list_vec"] = "list_vec"
    layers: int = 2
    width: int = 8


class ListPool(PoolType):
    """A third-party component pool as docs/plugins.md shows it: ``PoolSpec`` with no ``layouts``."""

    name = "list_vec"
    Config = ListPoolConfig
    default_role = PoolRole.COMPONENT
    declared_layouts: tuple[Layout, ...] | None = None  # None: the PoolSpec default

    def spec(self) -> PoolSpec:
        page, layers = self.model.page_size, self.config.layers
        extra = {} if self.declared_layouts is None else {"layouts": self.declared_layouts}
        return PoolSpec(
            name=self.instance,
            pool_type=self.name,
            role=PoolRole.COMPONENT,
            granularity=Granularity.TOKEN_PAGES,
            hit_rule=HitRule(kind=HitRuleKind.ALL_PAGES),
            partial_hit=PartialHit.CLAMP,
            replication=Replication.SHARDED,
            page_size=page,
            buffers=(
                BufferSpec(name="x", dtype="float16", layers=layers, unit_shape=(page, self.config.width)),
            ),
            objects=(ObjectSpec(suffix="x", buffers=("x",)),),
            **extra,  # type: ignore[arg-type]
        )


class TestADefaultLayoutsPoolThroughThePoolKit(PoolTypeConformance):
    """The PoolSpec defaults open in a stack (the device tier is layer_first)."""

    pool_config = {"type": "list_vec"}

    @pytest.fixture
    def pool_host(self, kvstrata_host: PluginHost) -> PluginHost:
        kvstrata_host.pool_types.register(ListPool)
        return kvstrata_host


class PageFirstOnlyConfig(ListPoolConfig):
    type: Literal["page_first_only"] = "page_first_only"  # type: ignore[assignment]


class PageFirstOnly(ListPool):
    """Breaks the stack's rule on purpose: declares no layer_first layout."""

    name = "page_first_only"
    Config = PageFirstOnlyConfig
    declared_layouts = (Layout.PAGE_FIRST,)


def test_the_pool_kit_names_the_layer_first_rule(kvstrata_host: PluginHost) -> None:
    kvstrata_host.pool_types.register(PageFirstOnly)
    kit = TestADefaultLayoutsPoolThroughThePoolKit()
    kit.pool_config = {"type": "page_first_only"}
    with pytest.raises(AssertionError, match=r"must list Layout\.LAYER_FIRST in PoolSpec\.layouts"):
        kit.test_declares_a_consistent_spec(kvstrata_host, 16)


class NoCorruptHook(MemoryBackend):
    """A backend without the test-only damage hook."""

    corrupt_for_test = None  # type: ignore[assignment]


def test_core_tests_need_no_damage_hook_and_integrity_tests_say_they_do() -> None:
    """The documented composition skips nothing: the core marker test runs whole without the hook
    (the damaged-marker half is an integrity test), and integrity tests fail with the instruction."""
    try:
        CoreConformance().test_bufferless_anchor_stores_marker_objects(NoCorruptHook("l3", MemoryConfig()))
    except pytest.skip.Exception as skipped:
        pytest.fail(f"a core test skipped part of itself without the damage hook: {skipped}")
    with pytest.raises(pytest.fail.Exception, match="offers no corrupt_for_test hook: implement"):
        IntegrityConformance().test_damaged_marker_is_a_miss(NoCorruptHook("l3", MemoryConfig()))


class SilentCorruptHook(MemoryBackend):
    """Damages the object but returns None, as a hook written from a guide that left out the answer."""

    def corrupt_for_test(self, key: str, mode: Literal["flip", "truncate"], offset: int = -1) -> bool:
        super().corrupt_for_test(key, mode, offset)
        return None  # type: ignore[return-value]


def test_a_damage_hook_returning_nothing_is_named_not_a_bare_assert() -> None:
    """The integrity tests read the hook's answer: None failed them with ``assert False`` and no
    word of the hook; now the failure says it must return True."""
    with pytest.raises(pytest.fail.Exception, match="corrupt_for_test returned None; it must return True"):
        IntegrityConformance().test_integrity_rejection(SilentCorruptHook("l3", MemoryConfig()), "flip")


def test_the_policy_kit_says_how_to_install_hypothesis(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from kvstrata.testing import policy_kit

    monkeypatch.setitem(sys.modules, "hypothesis", None)  # an import of it fails, as when absent
    with pytest.raises(ImportError, match=r"pip install 'kvstrata\[testing\]'"):
        policy_kit._given(max_examples=1)(lambda ops: None)


# --- backend kit: the zero-copy registered path and unverified reads --------------------------------

ZERO_COPY = MemoryBackend.capabilities.model_copy(
    update={"pools": {ANY_POOL: PoolCapabilities(zero_copy=True)}}
)


class ZeroCopyMemory(MemoryBackend):
    """A correct zero-copy backend (its copies read any address, so registering is a no-op)."""

    capabilities = ZERO_COPY


class RegisteredReadsNothing(ZeroCopyMemory):
    """Breaks zero-copy on purpose: a read into registered host memory leaves it as it was."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.registered: list[BufferRegion] = []

    def register_host_memory(self, region: BufferRegion) -> None:
        self.registered.append(region)

    def get(self, objects):  # type: ignore[no-untyped-def]
        kept = []
        for obj in objects:
            regions = [r for r in obj.regions if r.nbytes]
            for region, view in zip(regions, object_views(obj), strict=True):
                if any(a.ptr <= region.ptr < a.ptr + a.nbytes for a in self.registered):
                    kept.append((view, bytes(view)))
        got = super().get(objects)
        for view, before in kept:
            view[:] = before
        return got


class RegistersOnce(ZeroCopyMemory):
    """Breaks zero-copy on purpose: a second host pool cannot be registered."""

    calls = 0

    def register_host_memory(self, region: BufferRegion) -> None:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("segment already registered")


class UnverifiedReadsZeroes(MemoryBackend):
    """Breaks the unverified mode (``checksum: none``) on purpose: payloads read back zeroed."""

    verified = True

    def set_read_verification(self, verified: bool) -> None:
        self.verified = verified

    def get(self, objects):  # type: ignore[no-untyped-def]
        got = super().get(objects)
        for obj, n in zip(objects, got, strict=True):
            if n > 0 and not self.verified:
                for view in object_views(obj)[1:]:
                    view[:] = bytes(len(view))
        return got


@pytest.mark.parametrize(
    ("backend_cls", "checksum"),
    [
        (RegisteredReadsNothing, "xxh3"),
        (RegisteredReadsNothing, "none"),
        (RegistersOnce, "xxh3"),
        (UnverifiedReadsZeroes, "none"),
    ],
)
def test_the_backend_kit_runs_registered_memory_and_unverified_reads(
    backend_cls: type, checksum: str
) -> None:
    backend = backend_cls("l3", MemoryConfig())
    with pytest.raises((AssertionError, RuntimeError)):
        CoreConformance().test_round_trip_through_registered_host_memory(backend, checksum)  # type: ignore[arg-type]


@pytest.mark.parametrize("checksum", ["xxh3", "none"])
def test_a_zero_copy_backend_passes_the_registered_round_trip(checksum: str) -> None:
    backend = ZeroCopyMemory("l3", MemoryConfig())
    kit = CoreConformance()
    assert kit.engine(backend).plans["attn"].mode is IOMode.ZERO_COPY
    kit.test_round_trip_through_registered_host_memory(backend, checksum)  # type: ignore[arg-type]


class Page16Config(ListPoolConfig):
    type: Literal["page16"] = "page16"  # type: ignore[assignment]


class Page16(ListPool):
    """Breaks the stack's rule on purpose: a page size of its own, not the model's."""

    name = "page16"
    Config = Page16Config

    def spec(self) -> PoolSpec:
        return super().spec().model_copy(update={"page_size": 16})


def test_the_pool_kit_runs_two_page_sizes_and_names_the_rule(kvstrata_host: PluginHost) -> None:
    kvstrata_host.pool_types.register(Page16)
    kit = TestADefaultLayoutsPoolThroughThePoolKit()
    kit.pool_config = {"type": "page16"}
    assert 16 in PAGE_SIZES and len(set(PAGE_SIZES)) > 1
    for page_size in PAGE_SIZES:
        if page_size != 16:
            with pytest.raises(AssertionError, match=r"take it from ModelContext\.page_size"):
                kit.test_declares_a_consistent_spec(kvstrata_host, page_size)


def test_an_undeclared_shared_backend_is_told_to_declare_it() -> None:
    """Two instances over one store, declared private: the kit's failure read only "pool 'attn'
    unit 0 differs" and did not point at ``shared_across_instances``."""
    shared: dict[str, MemoryBackend] = {}

    def factory(instance: str = "conformance") -> StorageBackend:
        backend = MemoryBackend(instance, MemoryConfig())
        first = shared.setdefault("store", backend)
        backend._objects = first._objects  # one store behind every instance, undeclared
        return backend

    with pytest.raises(AssertionError, match="does not declare shared_across_instances"):
        CoreConformance().test_second_instance(factory)


class CompactsHitsOnMiss(MemoryBackend):
    """Breaks the per-key contract on purpose (fault injection): get() answers per key, but
    writes the objects it found one after another into the batch's first regions, so with a
    miss in the batch the objects after it land in the regions of the ones before them. The
    engine reads a refused object once more, alone (no miss in that batch): the kit passed it."""

    def get(self, objects):  # type: ignore[no-untyped-def]
        with self._lock:
            found = [self._objects.get(obj.key) for obj in objects]
        for obj, data in zip(objects, [data for data in found if data is not None], strict=False):
            offset = 0
            for view in object_views(obj):
                chunk = data[offset : offset + len(view)]
                view[: len(chunk)] = chunk
                offset += len(chunk)
        return [-1 if data is None else len(data) for data in found]


def test_the_kit_catches_a_batch_read_that_the_engines_reread_covers_up() -> None:
    with pytest.raises(AssertionError, match="read back wrong and right when read again on their own"):
        CoreConformance().test_partial_batches_per_key(CompactsHitsOnMiss("l3", MemoryConfig()))


class FirstTwoConfig(EvictionPolicyConfig):
    type: Literal["first_two"] = "first_two"


class FirstTwoPolicy(MruPolicy):
    """Breaks the ranking contract on purpose: bounds its work by cutting the list it is given
    to two candidates (``del entries[2:]``) and ranks those. The kit compared the ranked nodes
    with that list after the call, so the two matched and it passed; an eviction then picks from
    two arbitrary leaves, and frees less than asked once those are gone."""

    name = "first_two"
    Config = FirstTwoConfig

    def ranked(self, entries):  # type: ignore[no-untyped-def]
        del entries[2:]
        return super().ranked(entries)


def test_the_policy_kit_compares_with_the_candidates_as_given(kvstrata_host: PluginHost) -> None:
    kvstrata_host.eviction_policies.register(FirstTwoPolicy)
    ops = BRANCHING_OPS
    with pytest.raises(AssertionError, match=r"ranked\(\) must return one \(rank, node.id, node\) entry"):
        run_workload(kvstrata_host, "first_two", ops)


class SharedClientBackend(MemoryBackend):
    """Breaks ``close()`` on purpose (fault injection): every instance of the process talks
    through one client, and closing any instance shuts that client down for all of them."""

    def __init__(self, instance: str, config: MemoryConfig, client: dict[str, bool]) -> None:
        super().__init__(instance, config)
        self.client = client

    def open(self) -> None:
        self.client["up"] = True

    def close(self) -> None:
        self.client["up"] = False

    def _call(self, method, *args):  # type: ignore[no-untyped-def]
        if not self.client["up"]:
            raise ConnectionError("client closed")
        return method(*args)

    def exists(self, keys):  # type: ignore[no-untyped-def]
        return self._call(super().exists, keys)

    def put(self, objects):  # type: ignore[no-untyped-def]
        return self._call(super().put, objects)

    def get(self, objects):  # type: ignore[no-untyped-def]
        return self._call(super().get, objects)


def test_the_kit_catches_a_close_that_takes_other_instances_down() -> None:
    client: dict[str, bool] = {}

    def factory(instance: str = "conformance") -> StorageBackend:
        backend = SharedClientBackend(instance, MemoryConfig(), client)
        backend.open()
        return backend

    with pytest.raises(
        AssertionError, match="once another instance was closed, an instance still open failed"
    ):
        CoreConformance().test_closing_one_instance_leaves_another_working(factory)
    CoreConformance().test_closing_one_instance_leaves_another_working(
        lambda instance="conformance": MemoryBackend(instance, MemoryConfig())
    )


class _PortReusingSocket:
    """A socket whose OS hands a port back as soon as it is free again (lowest free first), as
    Linux may: the test's way to make the rare equal-port pick happen every time."""

    bound: set[int] = set()

    def __init__(self, *args: object) -> None:
        self.port = 0

    def bind(self, address: tuple[str, int]) -> None:
        self.port = min(set(range(40000, 40010)) - self.bound)
        self.bound.add(self.port)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def close(self) -> None:
        self.bound.discard(self.port)

    def __enter__(self) -> _PortReusingSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def test_a_mooncake_master_gets_three_distinct_ports(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each port was picked with a socket closed before the next pick, so two could be equal
    (5 master starts in 20 000 here) and the master failed to listen."""
    from kvstrata.testing import mooncake_servers

    monkeypatch.setattr(mooncake_servers.socket, "socket", _PortReusingSocket)
    monkeypatch.setattr(mooncake_servers, "find_mooncake_binary", lambda name: f"/nonexistent/{name}")
    master = mooncake_servers.MooncakeMaster(log_dir=tmp_path)
    assert len({master.rpc_port, master.http_port, master.metrics_port}) == 3
    assert mooncake_servers.free_loopback_port() == 40000  # (each call: one port, none held)


def test_a_server_start_interrupted_while_waiting_stops_the_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """Ctrl-C (or any error) while waiting for the port left the started process running: the
    fixture's setup raised, so it had no teardown, and the server outlived the session."""
    import os
    import signal
    import sys

    from kvstrata.testing import mooncake_servers

    def interrupted(address: str, timeout_s: float) -> str | None:
        raise KeyboardInterrupt

    monkeypatch.setattr(mooncake_servers, "tcp_probe", interrupted)
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    process = mooncake_servers.ManagedProcess("sleeper", argv, 1, tmp_path / "sleeper.log")
    try:
        with pytest.raises(KeyboardInterrupt):
            process.start()
        assert not process.alive(), "the process the interrupted start began is still running"
    finally:
        if process.alive():  # (the old helper's leak: stop the one process this test started)
            os.kill(process.pid, signal.SIGKILL)  # type: ignore[arg-type]
            process.popen.wait()  # type: ignore[union-attr]


class RaisesOnBatches(MemoryBackend):
    """Breaks the batch contract on purpose: get() of more than one object raises."""

    def get(self, objects):  # type: ignore[no-untyped-def]
        if len(objects) > 1:
            raise RuntimeError("batches not supported")
        return super().get(objects)


def test_the_kit_shows_the_error_of_a_backend_call_that_raised() -> None:
    """The engine turns a raising call into misses of every key: the kit's failure read "get()
    answers per key: a miss fails only its key" (and, from several threads, "not thread-safe")
    and never showed the exception."""
    kit = CoreConformance()
    raised = r"the call failed: get on backend 'l3' \(pool 'attn'\) failed: RuntimeError\('batches not"
    with pytest.raises(AssertionError, match=r"get\(\) answers per key(.|\n)*" + raised):
        kit.test_partial_batches_per_key(RaisesOnBatches("l3", MemoryConfig()))
    with pytest.raises(AssertionError, match=r"thread \d: get of its own keys failed(.|\n)*" + raised):
        kit.test_concurrent_distinct_and_same_keys(RaisesOnBatches("l3", MemoryConfig()))


class IgnoresRemove(MemoryBackend):
    """Breaks ``remove`` on purpose: answers True and deletes nothing."""

    def remove(self, keys):  # type: ignore[no-untyped-def]
        return [True] * len(keys)


def test_the_kit_names_a_remove_that_deletes_nothing() -> None:
    with pytest.raises(
        AssertionError, match=r"after remove\(\) of the first of three stored keys returned True"
    ):
        RemovalConformance().test_remove_and_damaged_objects_are_removed(IgnoresRemove("l3", MemoryConfig()))


class WindowAnchorConfig(ListPoolConfig):
    type: Literal["window_anchor"] = "window_anchor"  # type: ignore[assignment]


class WindowAnchor(ListPool):
    """Breaks the anchor's rule on purpose: an anchor whose hit rule keeps only the last two
    pages. Its spec passed the kit's spec check; the round trip then failed with "a new cache
    restores the prompt from L3", which did not say why."""

    name = "window_anchor"
    Config = WindowAnchorConfig
    default_role = PoolRole.ANCHOR

    def spec(self) -> PoolSpec:
        rule = HitRule(kind=HitRuleKind.TRAILING_PAGES, pages=2)
        return super().spec().model_copy(update={"role": PoolRole.ANCHOR, "hit_rule": rule})


class PagesStateConfig(ListPoolConfig):
    type: Literal["pages_state"] = "pages_state"  # type: ignore[assignment]


class PagesState(ListPool):
    """Mis-declares on purpose: token pages served by the state rule, which the core ignores
    (it keys on the granularity, so every page is needed)."""

    name = "pages_state"
    Config = PagesStateConfig

    def spec(self) -> PoolSpec:
        return super().spec().model_copy(update={"hit_rule": HitRule(kind=HitRuleKind.PREFIX_END_STATE)})


@pytest.mark.parametrize(
    ("pool", "rule"),
    [
        (WindowAnchor, "an anchor pool holds every page of a prefix"),
        (PagesState, "granularity token_pages with hit rule prefix_end_state"),
    ],
)
def test_the_pool_kit_names_a_hit_rule_that_does_not_fit(
    kvstrata_host: PluginHost, pool: type, rule: str
) -> None:
    kvstrata_host.pool_types.register(pool)
    kit = TestADefaultLayoutsPoolThroughThePoolKit()
    kit.pool_config = {"type": pool.name}
    with pytest.raises(AssertionError, match=rule):
        kit.test_declares_a_consistent_spec(kvstrata_host, 16)


HOST_ALLOCATOR = ZERO_COPY.model_copy(update={"host_allocator": True})


class AllocatingMemory(MemoryBackend):
    """A correct ``host_allocator`` backend: each call, a buffer of its own (kept alive here)."""

    capabilities = HOST_ALLOCATOR

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.buffers: list[ctypes.Array[ctypes.c_uint8]] = []

    def allocate_host_memory(self, nbytes: int) -> BufferRegion:
        self.buffers.append((ctypes.c_uint8 * nbytes)())
        return BufferRegion(ctypes.addressof(self.buffers[-1]), nbytes)


class OneArena(AllocatingMemory):
    """Breaks the allocator on purpose: every call returns the same arena, so every host pool the
    core allocates shares one memory. No kit test called ``allocate_host_memory``: it passed."""

    def allocate_host_memory(self, nbytes: int) -> BufferRegion:
        if not self.buffers:
            self.buffers.append((ctypes.c_uint8 * (1 << 20))())
        return BufferRegion(ctypes.addressof(self.buffers[0]), nbytes)


def test_the_kit_runs_a_host_allocators_memory_and_fails_a_shared_arena() -> None:
    kit = CoreConformance()
    kit.test_round_trip_through_backend_allocated_host_memory(AllocatingMemory("l3", MemoryConfig()))
    with pytest.raises(AssertionError, match=r"allocate_host_memory\(\) handed out overlapping memory"):
        kit.test_round_trip_through_backend_allocated_host_memory(OneArena("l3", MemoryConfig()))


class ClaimsPersistence(MemoryBackend):
    """Mis-declares on purpose: ``persistent`` while its objects live in its own memory (gone
    with the instance). No kit test closed an instance and read after it: it passed."""

    capabilities = MemoryBackend.capabilities.model_copy(update={"persistent": True})


def test_the_kit_holds_a_persistent_backend_to_its_word(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvstrata.storage_backends.file import FileBackend, FileConfig

    kit = CoreConformance()
    with pytest.raises(AssertionError, match="declares persistent, but a new instance opened after"):
        kit.test_a_persistent_backend_keeps_its_objects_through_close(
            lambda instance="conformance": ClaimsPersistence(instance, MemoryConfig())
        )

    def file_backend(instance: str = "conformance") -> StorageBackend:
        backend = FileBackend(instance, FileConfig(path=str(tmp_path / "l3")))
        backend.open()
        return backend

    kit.test_a_persistent_backend_keeps_its_objects_through_close(file_backend)
