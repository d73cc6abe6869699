"""The controller driven like an engine through random interleavings (a hypothesis state
machine, derandomized: CI runs the same examples every time).

Requests share prefixes of a few stems and are served whole or in chunks (``allocate``,
``fork_state``, compute, ``insert(close=False)``, ``extend``), up to three leases at once, under
the example stacks' small tiers (16 device pages: once a few requests are served, allocations
evict), with releases, flushes, quiet re-reads of served requests and reopens on the same file L3
under another write policy and host size. Engine steps are drawn three times as often as any
other rule, and a flush or reopen waits for inserts to act on: drawn freely, hypothesis spent
most steps on those two and an example evicted once or never. What must hold after every step:
the tree is consistent and every device unit is the tree's or an open lease's; every restored
prefix holds exactly the bytes its pages were computed with; ``fork_state`` hands the engine the
checkpoint it continues from; with no lease open, the host tier holds exactly what the tree
indexes. (A hand-written driver over the same rules found the write-back wedge of audit 28.)
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from controller_support import (
    device_accounting,
    fill,
    fork_checked,
    host_units_held_by_tree,
    host_units_in_use,
    open_cache,
    tokens,
    verify,
)
from kvstrata.core.controller import CacheController, CacheFullError, Lease
from kvstrata.core.tree import PrefixTree
from test_component_index import check_against_scans

PAGE = 64
STEMS = 3  # request families; each request shares a prefix of one
MAX_OPEN = 3
WRITES = ("write_through", "write_through_selective", "write_back")
#: host tier sizes in pages: the stack's own (None), smaller than a chunked request, disabled
#: (and with it L3)
HOSTS = (None, 6, 0)


@dataclass
class Request:
    lease: Lease
    tokens: torch.Tensor
    chunk: int  # pages per chunk; 0: served whole


class EngineLoop(RuleBasedStateMachine):
    """One cache of ``stack`` on one L3 directory, driven as an engine's scheduler would."""

    stack = "kv"
    #: the live cache's tree, last (the scan checks of ``check_against_scans`` read it)
    trees: list[PrefixTree] | None = None

    def __init__(self) -> None:
        super().__init__()
        self.l3 = Path(tempfile.mkdtemp(prefix="kvstrata-stateful-"))
        self.cache: CacheController | None = None
        self.stems = [tokens(9000 + i, 8) for i in range(STEMS)]
        self.open: list[Request] = []
        self.served: list[torch.Tensor] = []
        #: inserts since the last flush / reopen: those two wait for some work to act on (drawn
        #: freely, hypothesis spent most steps on them, and an example evicted once or never)
        self.since_flush = self.since_reopen = 0

    def _open(self, write: str, host: int | None) -> CacheController:
        overrides = [f"policy.write={write}", "policy.prefetch.policy=wait_complete"]
        if host is not None:
            overrides.append(f"tiers.host.capacity_tokens={host * PAGE}")
        # L3 goes through the host tier: without one, this cache has none (the files stay)
        cache = open_cache(self.stack, self.l3 if host != 0 else None, overrides)
        if self.trees is not None:
            self.trees[:] = [cache.tree]
        return cache

    @initialize(write=st.sampled_from(WRITES), host=st.sampled_from(HOSTS))
    def start(self, write: str, host: int | None) -> None:
        self.cache = self._open(write, host)

    @property
    def live(self) -> CacheController:
        assert self.cache is not None
        return self.cache

    # --- rules -----------------------------------------------------------------------------

    @precondition(lambda self: len(self.open) < MAX_OPEN)
    @rule(
        stem=st.integers(0, STEMS - 1),
        shared=st.integers(0, 8),
        fresh=st.integers(0, 8),
        chunk=st.sampled_from([0, 1, 2, 3]),
        seed=st.integers(0, 2**20),
    )
    def open_request(self, stem: int, shared: int, fresh: int, chunk: int, seed: int) -> None:
        request = torch.cat([self.stems[stem][: shared * PAGE], tokens(seed, fresh)])
        if not len(request):
            return
        first = request if chunk == 0 else request[: chunk * PAGE]
        lease = self.live.lookup(first)
        self.live.admit(lease)
        assert verify(self.live, lease) == 0, "a restored unit holds another page's bytes"
        self.open.append(Request(lease, request, chunk))

    @precondition(lambda self: self.open)
    @rule(pick=st.integers(0, MAX_OPEN - 1))
    def advance(self, pick: int) -> None:
        """One engine step of a request: units for its next pages, the state it continues from,
        compute, insert; then the next chunk's tokens (or the lease closes)."""
        request = self.open[pick % len(self.open)]
        cache, lease = self.live, request.lease
        try:
            units = cache.allocate(lease)
        except CacheFullError as full:  # the scheduler would retry later; here: abort it
            # alone on the cache (no pins here), a request that fits the tier is never refused,
            # unless it holds its own copies of pages another request inserted first (the tier
            # must then hold both: its engine reads its own)
            kept = "its own copies of pages" in str(full)
            assert full.too_long or len(self.open) > 1 or kept, f"refused with no other lease open: {full}"
            cache.release(lease)
            self.open.remove(request)
            return
        fork_checked(cache, lease)
        fill(cache, lease, units)
        last = lease.pages * PAGE >= len(request.tokens)
        cache.insert(lease, close=last)
        self.since_flush += 1
        self.since_reopen += 1
        if last:
            self.open.remove(request)
            self.served.append(request.tokens)
        else:
            at = lease.pages * PAGE
            lease.extend(request.tokens[at : at + request.chunk * PAGE])

    @precondition(lambda self: self.open)
    @rule(pick=st.integers(0, MAX_OPEN - 1))
    def release(self, pick: int) -> None:
        request = self.open.pop(pick % len(self.open))
        self.live.release(request.lease)

    # an engine step is drawn most: it is what fills the tiers and evicts
    advance_again = advance
    advance_once_more = advance

    @precondition(lambda self: self.since_flush >= 2)
    @rule()
    def flush(self) -> None:
        self.since_flush = 0
        self.live.flush()
        if not self.open:
            in_use = host_units_in_use(self.live)  # (no host tier: no host allocator)
            held = {name: n for name, n in host_units_held_by_tree(self.live).items() if name in in_use}
            assert in_use == held, "host units leaked"

    @precondition(lambda self: self.served and len(self.open) < MAX_OPEN)
    @rule(pick=st.integers(0, 2**10))
    def reread(self, pick: int) -> None:
        """A served request again, waiting for whatever L3 holds: every restored byte exact."""
        request = self.served[pick % len(self.served)]
        lease = self.live.lookup(request, prefetch="wait")
        self.live.admit(lease)
        assert verify(self.live, lease) == 0, "a restored unit holds another page's bytes"
        self.live.release(lease)

    @precondition(lambda self: self.since_reopen >= 6)
    @rule(write=st.sampled_from(WRITES), host=st.sampled_from(HOSTS))
    def reopen(self, write: str, host: int | None) -> None:
        """The engine restarts: open leases released, the cache closed, a new one on the same L3
        (what it serves now comes from L3 only)."""
        self.since_reopen = 0
        for request in self.open:
            self.live.release(request.lease)
        self.open.clear()
        self.live.close()
        self.cache = self._open(write, host)

    # --- after every step ------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if self.cache is not None:
            self.cache.tree.check()
            device_accounting(self.cache, [request.lease for request in self.open])

    def teardown(self) -> None:
        try:
            if self.cache is not None:
                for request in self.open:
                    self.cache.release(request.lease)
                self.cache.close()
                assert not list(self.l3.rglob(".tmp-*")), "a temp file outlived the cache"
        finally:
            shutil.rmtree(self.l3, ignore_errors=True)


SETTINGS = settings(
    max_examples=20,
    stateful_step_count=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.slow
@pytest.mark.parametrize("stack", ["kv", "swa-mamba", "hybrid-mamba", "logical-swa", "mla-nsa-draft"])
def test_random_engine_loops_keep_bytes_and_accounting_exact(
    stack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The machine's checks after every step, and every eviction choice the kept heaps and the
    component index make checked against the scan they replaced (``check_against_scans``): the
    engine loop is where those choices meet flushes, releases and reopens."""
    trees: list[PrefixTree] = []
    checked = check_against_scans(monkeypatch, trees)
    machine = type(f"EngineLoop_{stack}", (EngineLoop,), {"stack": stack, "trees": trees})
    run = machine.TestCase("runTest")
    run.settings = SETTINGS
    run.runTest()
    assert checked()["drops"] >= 30, checked()  # (drawn freely, flush and reopen left 0-7)
