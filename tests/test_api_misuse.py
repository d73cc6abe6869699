"""The public engine API under misuse: random sequences mixing valid calls with wrong ones (a
closed lease, another cache's lease, bad token ids, out-of-range ``end_page``, ``insert`` before
``allocate``, a second ``admit``, ``fork_state`` before ``allocate``, unbalanced ``unpin``) on one
cache (a hypothesis state machine, derandomized). Every wrong call must raise a clear error
(``TypeError`` / ``ValueError`` / ``RuntimeError``, naming what is wrong) and change nothing;
after every step each pool's device and host units in use are exactly those the tree and the open
leases hold, no unit twice, and every served request restores bit-exactly.
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from controller_support import _content, _ids, open_cache, tokens, verify
from kvstrata.core.controller import CacheController, CacheFullError, Lease, PoolKind
from kvstrata.core.retention import RetentionHint

PAGE = 64
STEMS = 2
MAX_OPEN = 3
#: what a wrong call may raise (CacheFullError is a RuntimeError)
CLEAR = (TypeError, ValueError, RuntimeError)
BAD_TOKENS = ([-1], [2**32], torch.tensor([1.5]), torch.zeros(2, 2, dtype=torch.int64), "abc", 7, [True, 1.0])


def fill_pending(cache: CacheController, lease: Lease) -> None:
    """The engine's writes by an insert: every pending unit of a whole page holds that page's
    bytes; a state slot run on into a partial page holds a later state (junk here: never a
    checkpoint)."""
    pending = lease.pending
    for name, pool in cache.pools.pools.items():
        value = pending.get(cache.layout.owner_of[name])
        if value is None or not len(value):
            continue
        kind, end = cache.pool_kind(name), lease.allocated_pages
        if kind is PoolKind.STATE:
            pages = [end - 1] if 0 < end <= lease.pages else None
        elif kind is PoolKind.WINDOW:
            pages = list(range(end - len(value), end))
        else:
            pages = list(range(lease.committed_pages, end))
        for buffer in pool.spec.buffers:
            view = pool.device.unit_view(buffer.name)
            if pages is None:
                view[value] = 0
                continue
            keep = [i for i, page in enumerate(pages) if page < lease.pages]
            if keep:
                ids = _ids([lease.page_hashes[pages[i]] for i in keep])
                view[value[keep]] = _content(name, buffer.name, ids, view.shape[1], view.shape[2])


def _units(raw: bytes | None) -> list[int]:
    return [] if not raw else np.frombuffer(raw, dtype=np.int64).tolist()


def check_ownership(cache: CacheController, leases: list[Lease]) -> None:
    """Per tree pool and tier: free + used == capacity, and the units in use are exactly the
    tree's and the open leases' (pending or kept), none owned twice."""
    index = cache.tree.index
    for name in cache.tree_pools:
        p, pool = index[name], cache.pools.pools[name]
        for tier, allocator in (("device", pool.device_allocator), ("host", pool.host_allocator)):
            if allocator is None:
                continue
            assert allocator.available + allocator.used == allocator.units
            owned: list[int] = []
            for node in cache.tree.nodes():
                owned += _units(node.device_raw[p] if tier == "device" else node.host_raw[p])
            if tier == "device":
                for lease in leases:
                    owned += lease.pending.get(name, torch.empty(0, dtype=torch.int64)).tolist()
                    for kept in lease._duplicates or ():
                        owned += [int(u) for u in kept.get(name, ())]
            assert len(owned) == len(set(owned)), f"{name} {tier}: a unit owned twice"
            in_use = set(np.flatnonzero(allocator._in_use).tolist())
            if tier == "host":  # (the host tier also holds in-flight L3 reads and writes: a subset)
                assert set(owned) <= in_use, f"{name} host: the tree holds a free unit"
            else:
                assert set(owned) == in_use, f"{name} device: in use {len(in_use)} != owned {len(owned)}"


def _state(lease: Lease) -> tuple[object, ...]:
    return (
        lease.pages,
        lease.admitted,
        lease.allocated_pages,
        lease.committed_pages,
        lease.closed,
        lease.pinned,
    )


@dataclass
class Request:
    lease: Lease
    tokens: torch.Tensor
    chunk: int


class Misuse(RuleBasedStateMachine):
    stack = "kv"

    def __init__(self) -> None:
        super().__init__()
        self.l3 = Path(tempfile.mkdtemp(prefix="kvstrata-misuse-"))
        self.cache: CacheController | None = None
        self.other: CacheController | None = None
        self.stems = [tokens(7000 + i, 6) for i in range(STEMS)]
        self.open: list[Request] = []
        self.closed: list[Lease] = []
        self.served: list[torch.Tensor] = []

    @initialize(write=st.sampled_from(["write_through", "write_back"]))
    def start(self, write: str) -> None:
        self.cache = open_cache(self.stack, self.l3, [f"policy.write={write}"])
        self.other = open_cache(self.stack, None)

    @property
    def live(self) -> CacheController:
        assert self.cache is not None
        return self.cache

    def _pick(self, pick: int) -> Request:
        return self.open[pick % len(self.open)]

    def _refused(self, call: object, *args: object, **kwargs: object) -> BaseException:
        """``call`` must raise a clear error and leave every lease and unit as it was."""
        before = [_state(r.lease) for r in self.open]
        used = {n: p.device_allocator.used for n, p in self.live.pools.pools.items()}
        with pytest.raises(CLEAR) as refused:
            call(*args, **kwargs)  # type: ignore[operator]
        assert str(refused.value), "an error must say what is wrong"
        after = [_state(r.lease) for r in self.open]
        assert before == after, f"a refused {getattr(call, '__name__', call)}() changed a lease"
        if not isinstance(refused.value, CacheFullError):
            assert used == {n: p.device_allocator.used for n, p in self.live.pools.pools.items()}
        return refused.value

    # --- valid calls ---------------------------------------------------------------------------

    @precondition(lambda self: len(self.open) < MAX_OPEN)
    @rule(
        stem=st.integers(0, STEMS - 1),
        shared=st.integers(0, 6),
        fresh=st.integers(0, 4),
        tail=st.integers(0, PAGE - 1),
        chunk=st.integers(0, 2),
        pin=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def lookup(self, stem: int, shared: int, fresh: int, tail: int, chunk: int, pin: bool, seed: int) -> None:
        request = torch.cat(
            [self.stems[stem][: shared * PAGE], tokens(seed, fresh), tokens(seed + 1, 1)[:tail]]
        )
        first = request if chunk == 0 else request[: chunk * PAGE]
        hint = RetentionHint(pin=True) if pin else None
        lease = self.live.lookup(first, retention=hint)
        self.open.append(Request(lease, request, chunk))

    @precondition(lambda self: self.open)
    @rule(pick=st.integers(0, MAX_OPEN - 1))
    def admit(self, pick: int) -> None:
        lease = self._pick(pick).lease
        if lease.admitted:
            self._refused(self.live.admit, lease)
            return
        self.live.admit(lease)
        assert verify(self.live, lease) == 0, "a restored unit holds another page's bytes"

    @precondition(lambda self: self.open)
    @rule(
        pick=st.integers(0, MAX_OPEN - 1),
        end=st.one_of(st.none(), st.integers(-2, 10)),
        partial=st.booleans(),
        window_only=st.booleans(),
    )
    def allocate(self, pick: int, end: int | None, partial: bool, window_only: bool) -> None:
        request = self._pick(pick)
        lease = request.lease
        if end is not None and not 0 <= end <= lease.pages:
            if not lease.admitted:
                self.live.admit(lease)
            self._refused(self.live.allocate, lease, end_page=end, partial_page=partial)
            return
        try:
            self.live.allocate(lease, end_page=end, partial_page=partial, window_only=window_only)
        except CacheFullError:
            self.live.release(lease)
            self.open.remove(request)
            self.closed.append(lease)

    @precondition(lambda self: self.open)
    @rule(pick=st.integers(0, MAX_OPEN - 1), close=st.booleans())
    def compute_and_insert(self, pick: int, close: bool) -> None:
        request = self._pick(pick)
        lease = request.lease
        if not lease.admitted or lease.allocated_pages < lease.pages:
            self._refused(self.live.insert, lease, close=close) if lease.admitted else None
            return
        self.live.fork_state(lease)
        fill_pending(self.live, lease)
        self.live.insert(lease, close=close)
        if close:
            self.open.remove(request)
            self.closed.append(lease)
            if lease.pages:
                self.served.append(lease.tokens[: lease.pages * PAGE])

    @precondition(lambda self: self.open)
    @rule(pick=st.integers(0, MAX_OPEN - 1), count=st.integers(1, 2 * PAGE))
    def extend(self, pick: int, count: int) -> None:
        request = self._pick(pick)
        lease = request.lease
        have = len(lease.tokens)
        more = request.tokens[have : have + count]
        if not len(more):
            more = tokens(have, 1)[:count]
            request.tokens = torch.cat([request.tokens, more])
        lease.extend(more)

    @precondition(lambda self: self.open)
    @rule(pick=st.integers(0, MAX_OPEN - 1))
    def fork_state(self, pick: int) -> None:
        lease = self._pick(pick).lease
        pending = lease.pending
        states = [n for n in self.live.tree_pools if self.live.pool_kind(n) is PoolKind.STATE]
        no_slot = any(not len(pending.get(n, ())) for n in states)
        if no_slot and lease.pages > lease.allocated_pages:
            self._refused(self.live.fork_state, lease)
        else:
            self.live.fork_state(lease)

    @precondition(lambda self: self.open)
    @rule(pick=st.integers(0, MAX_OPEN - 1))
    def release(self, pick: int) -> None:
        request = self._pick(pick)
        self.live.release(request.lease)
        self.open.remove(request)
        self.closed.append(request.lease)

    @precondition(lambda self: self.closed)
    @rule(pick=st.integers(0, 2**10))
    def unpin(self, pick: int) -> None:
        lease = self.closed[pick % len(self.closed)]
        self.live.unpin(lease)
        self.live.unpin(lease)  # a second unpin is a no-op

    @precondition(lambda self: self.served and len(self.open) < MAX_OPEN)
    @rule(pick=st.integers(0, 2**10))
    def reread(self, pick: int) -> None:
        lease = self.live.lookup(self.served[pick % len(self.served)], prefetch="wait")
        self.live.admit(lease)
        assert verify(self.live, lease) == 0, "a restored unit holds another page's bytes"
        self.live.release(lease)

    # --- wrong calls ---------------------------------------------------------------------------

    @precondition(lambda self: self.closed)
    @rule(pick=st.integers(0, 2**10), call=st.sampled_from(["admit", "allocate", "insert", "fork_state"]))
    def use_a_closed_lease(self, pick: int, call: str) -> None:
        lease = self.closed[pick % len(self.closed)]
        error = self._refused(getattr(self.live, call), lease)
        assert "closed" in str(error)
        with pytest.raises(RuntimeError, match="closed"):
            lease.extend([1])
        self.live.release(lease)  # a second release is a no-op

    @precondition(lambda self: self.open)
    @rule(
        pick=st.integers(0, MAX_OPEN - 1),
        call=st.sampled_from(["admit", "allocate", "insert", "fork_state", "release", "unpin"]),
    )
    def another_caches_lease(self, pick: int, call: str) -> None:
        assert self.other is not None
        error = self._refused(getattr(self.other, call), self._pick(pick).lease)
        assert "another cache" in str(error)

    @precondition(lambda self: self.open)
    @rule(pick=st.integers(0, MAX_OPEN - 1), bad=st.sampled_from(range(len(BAD_TOKENS))))
    def extend_with_bad_tokens(self, pick: int, bad: int) -> None:
        lease = self._pick(pick).lease
        before = lease.tokens
        error = self._refused(lease.extend, BAD_TOKENS[bad])
        assert str(error).startswith("tokens"), error
        assert torch.equal(lease.tokens, before)

    @rule(bad=st.sampled_from(range(len(BAD_TOKENS))))
    def lookup_with_bad_tokens(self, bad: int) -> None:
        leases = self.live.open_leases
        self._refused(self.live.lookup, BAD_TOKENS[bad])
        assert self.live.open_leases == leases

    @precondition(lambda self: self.open)
    @rule(pick=st.integers(0, MAX_OPEN - 1), end=st.sampled_from([1.5, "2", None]))
    def allocate_with_a_wrong_end_page(self, pick: int, end: object) -> None:
        lease = self._pick(pick).lease
        if end is None:
            self._refused(self.live.allocate, lease, end_page=lease.pages + 1)
        else:
            self._refused(self.live.allocate, lease, end_page=end)

    # --- after every step ----------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if self.cache is not None:
            self.cache.tree.check()
            check_ownership(self.cache, [r.lease for r in self.open])

    def teardown(self) -> None:
        try:
            for cache in (self.cache, self.other):
                if cache is not None:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        cache.close()
        finally:
            shutil.rmtree(self.l3, ignore_errors=True)


SETTINGS = settings(
    max_examples=12,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.parametrize("stack", ["kv", "swa-mamba"])
def test_wrong_calls_mixed_with_right_ones_are_refused_and_change_nothing(stack: str) -> None:
    machine = type(f"Misuse_{stack}", (Misuse,), {"stack": stack})
    run = machine.TestCase("runTest")
    run.settings = SETTINGS
    run.runTest()
