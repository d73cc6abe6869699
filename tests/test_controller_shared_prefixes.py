"""Several open leases in chunked prefill and decode over shared prefixes -- twins of one
prompt in lockstep or one ahead, first-chunk lookups extending into pages the tree holds --
with unrelated requests taking every free unit and overwriting it, under a small device tier.

After every step: every open lease's own computed units (all-pages pools: every page; window
pools: its last window) and its cached prefix still hold its page bytes (an insert that found
its pages in the tree freed units its engine still read: the next request overwrote them);
device units are the tree's + pending + kept; restores are bit-exact; the tree is consistent.
Derandomized in the suite; ``KVSTRATA_FUZZ_EXAMPLES`` / ``KVSTRATA_FUZZ_STEPS`` size a longer,
random run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from controller_support import (
    _content,
    _ids,
    device_accounting,
    fill,
    holds_page,
    open_cache,
    tokens,
    verify,
)
from kvstrata.core.controller import CacheController, CacheFullError, Lease, PoolKind

PAGE = 64
STEMS = 3
MAX_OPEN = 4
STEM_PAGES = 8


@dataclass
class Req:
    lease: Lease
    tokens: torch.Tensor  # the whole prompt
    chunk: int  # pages per chunk (0: whole)
    name: str
    # per pool (every pool the engine writes, sidecars too): page -> unit it computed that page in
    units: dict[str, dict[int, int]] = field(default_factory=dict)
    written: dict[str, set[int]] = field(default_factory=dict)
    done: int = 0  # whole pages the engine has computed (prefix included)
    decoding: bool = False
    computed: bool = False  # allocated and written, not yet inserted


def write_page(cache: CacheController, pool: str, unit: int, page_hash: str) -> None:
    spec = cache.pools.pools[pool]
    ids = _ids([page_hash])
    for buffer in spec.spec.buffers:
        view = spec.device.unit_view(buffer.name)
        view[torch.tensor([unit]).to(view.device)] = _content(
            pool, buffer.name, ids, view.shape[1], view.shape[2]
        ).to(view.device)


def write_garbage(cache: CacheController, pool: str, unit: int) -> None:
    spec = cache.pools.pools[pool]
    for buffer in spec.spec.buffers:
        view = spec.device.unit_view(buffer.name)
        view[unit] = 0xEE if view.dtype == torch.uint8 else view[unit]


class FuzzLoop(RuleBasedStateMachine):
    stack = "kv"
    overrides: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.l3 = Path(tempfile.mkdtemp(prefix="kvstrata-shared-prefixes-"))
        self.cache: CacheController | None = None
        self.stems = [tokens(5000 + i, STEM_PAGES) for i in range(STEMS)]
        self.open: list[Req] = []
        self.count = 0
        self.served: list[torch.Tensor] = []
        self.since_flush = 0  # inserts since the last flush (one waits for some)

    @initialize(l3=st.booleans(), write=st.sampled_from(["write_through", "write_back"]))
    def start(self, l3: bool, write: str) -> None:
        overrides = [f"policy.write={write}", "policy.prefetch.policy=wait_complete", *self.overrides]
        self.cache = open_cache(self.stack, self.l3 if l3 else None, overrides)

    @property
    def c(self) -> CacheController:
        assert self.cache is not None
        return self.cache

    # --- engine model ---------------------------------------------------------------------

    def _window_pages(self, pool: str) -> int | None:
        owner = self.c.layout.owner_of[pool]
        tp = self.c.tree_pools[owner]
        if tp.kind is PoolKind.WINDOW:
            return tp.window
        return None

    def _engine(self, req: Req, units: dict[str, torch.Tensor]) -> None:
        """Record what ``allocate`` returned and write every whole page computed now; the
        partial page's unit is written when the page completes; state slots the state after the
        last whole page (garbage while a partial page is allocated)."""
        cache, lease = self.c, req.lease
        hashes = lease.page_hashes
        for name, value in units.items():
            if not len(value) or not cache.pools.pools[name].spec.buffers:
                continue
            if cache.pool_kind(name) is PoolKind.STATE:
                continue
            first = lease.allocated_first_page(name)
            book = req.units.setdefault(name, {})
            for i, unit in enumerate(value.tolist()):
                book[first + i] = unit
                req.written.setdefault(name, set()).discard(first + i)
        for name, book in req.units.items():
            w = req.written.setdefault(name, set())
            owner = cache.layout.owner_of[name]
            pending = set(lease.pending.get(owner, torch.empty(0, dtype=torch.int64)).tolist())
            for page, unit in list(book.items()):
                if page >= req.done and page not in w and unit not in pending:
                    del book[page]  # dropped by a later allocation (never computed)
                    continue
                if page < lease.pages and page not in w and page >= req.done:
                    write_page(cache, name, unit, hashes[page])
                    w.add(page)
        req.done = max(req.done, lease.pages)
        # state slots: the state after the last whole page where the allocation ends there
        for name in cache.pools.pools:
            if cache.pool_kind(name) is not PoolKind.STATE or not cache.pools.pools[name].spec.buffers:
                continue
            slot = lease.pending.get(cache.layout.owner_of[name])
            if slot is None or not len(slot):
                continue
            if lease.allocated_pages == lease.pages and lease.pages:
                write_page(cache, name, int(slot[0]), hashes[lease.pages - 1])
            else:
                write_page(cache, name, int(slot[0]), "f" * 16)  # a state mid-page

    def _fork(self, req: Req) -> None:
        cache, lease = self.c, req.lease
        new = set(lease._unforked)
        forked = cache.fork_state(lease)
        for name, slot in forked.items():
            owner = cache.layout.owner_of[name]
            if (
                len(slot)
                and owner in new
                and lease.committed_pages
                and cache.pool_kind(name) is PoolKind.STATE
            ):
                checkpoint = lease.page_hashes[lease.committed_pages - 1]
                assert holds_page(cache, name, slot, checkpoint), f"{req.name} {name}: forked a wrong state"

    def _check_lease(self, req: Req) -> None:
        cache, lease = self.c, req.lease
        hashes = lease.page_hashes
        for name, book in req.units.items():
            w = self._window_pages(name)
            low = 0 if w is None else req.done - w
            for page in req.written.get(name, ()):
                if page < low or page >= req.done:
                    continue
                unit = book[page]
                assert holds_page(cache, name, torch.tensor([unit]), hashes[page]), (
                    f"{req.name}: {name} unit {unit} of page {page} (done {req.done}) overwritten"
                )
        # the cached prefix it was given (tree units it holds locked)
        for name in cache.pools.pools:
            if cache.pool_kind(name) is PoolKind.STATE or not cache.pools.pools[name].spec.buffers:
                continue
            value = lease.prefix_units(name)
            if not len(value):
                continue
            first = lease.prefix_first_page(name)
            w = self._window_pages(name)
            low = 0 if w is None else req.done - w
            for i, unit in enumerate(value.tolist()):
                page = first + i
                if page < low or page >= req.done:
                    continue
                assert holds_page(cache, name, torch.tensor([unit]), hashes[page]), (
                    f"{req.name}: prefix {name} unit {unit} of page {page} (done {req.done}) overwritten"
                )

    def _new(self, request: torch.Tensor, chunk: int, tag: str) -> None:
        first = request if chunk == 0 else request[: chunk * PAGE]
        lease = self.c.lookup(first)
        self.c.admit(lease)
        assert verify(self.c, lease) == 0, "a restored unit holds another page's bytes"
        self.count += 1
        req = Req(lease, request, chunk, f"{tag}{self.count}", done=lease.cached_pages)
        self.open.append(req)

    def _drop(self, req: Req) -> None:
        self.c.release(req.lease)
        self.open.remove(req)

    # --- rules -----------------------------------------------------------------------------

    @precondition(lambda self: len(self.open) < MAX_OPEN)
    @rule(
        stem=st.integers(0, STEMS - 1),
        shared=st.integers(1, STEM_PAGES),
        fresh=st.integers(0, 2),
        tail=st.sampled_from([0, 0, 10, 63]),
        chunk=st.sampled_from([0, 1, 2, 3]),
        seed=st.integers(0, 3),
    )
    def open_request(self, stem: int, shared: int, fresh: int, tail: int, chunk: int, seed: int) -> None:
        request = torch.cat(
            [self.stems[stem][: shared * PAGE], tokens(seed, fresh + 1)[: fresh * PAGE + tail]]
        )
        self._new(request, chunk, "r")

    @precondition(lambda self: self.open and len(self.open) < MAX_OPEN)
    @rule(pick=st.integers(0, MAX_OPEN - 1), chunk=st.sampled_from([1, 2, 3]))
    def open_twin_b(self, pick: int, chunk: int) -> None:
        self.open_twin(pick, chunk)

    @precondition(lambda self: self.open and len(self.open) < MAX_OPEN)
    @rule(pick=st.integers(0, MAX_OPEN - 1), chunk=st.sampled_from([1, 2, 3]))
    def open_twin(self, pick: int, chunk: int) -> None:
        """Another request of an open lease's prompt (lockstep / ahead-behind duplicates)."""
        other = self.open[pick % len(self.open)]
        self._new(other.tokens, chunk, "t")

    def _compute(self, req: Req, partial: bool) -> bool:
        cache, lease = self.c, req.lease
        try:
            units = cache.allocate(lease, partial_page=partial)
        except CacheFullError:
            self._drop(req)
            return False
        self._fork(req)
        self._engine(req, units)
        req.computed = True
        return True

    def _commit(self, req: Req, close: bool) -> None:
        cache, lease = self.c, req.lease
        at = len(lease.tokens)
        finished = at >= len(req.tokens)
        req.computed = False
        self.since_flush += 1
        if finished and (close or req.decoding):
            cache.insert(lease, close=True)
            self.open.remove(req)
            self.served.append(lease.tokens)
            return
        cache.insert(lease, close=False)
        if not finished:
            step = req.chunk * PAGE if req.chunk else len(req.tokens)
            lease.extend(req.tokens[at : at + step])
        else:
            req.decoding = True

    @precondition(lambda self: any(not r.computed for r in self.open))
    @rule(pick=st.integers(0, MAX_OPEN - 1), partial=st.booleans())
    def compute(self, pick: int, partial: bool) -> None:
        """The engine computes a lease's next pages (the scheduler batches: inserts come later)."""
        reqs = [r for r in self.open if not r.computed]
        self._compute(reqs[pick % len(reqs)], partial)

    @precondition(lambda self: any(r.computed for r in self.open))
    @rule(pick=st.integers(0, MAX_OPEN - 1), close=st.booleans())
    def commit(self, pick: int, close: bool) -> None:
        reqs = [r for r in self.open if r.computed]
        self._commit(reqs[pick % len(reqs)], close)

    @precondition(lambda self: self.open)
    @rule(pick=st.integers(0, MAX_OPEN - 1), partial=st.booleans(), close=st.booleans())
    def advance(self, pick: int, partial: bool, close: bool) -> None:
        req = self.open[pick % len(self.open)]
        if self._compute(req, partial):
            self._commit(req, close)

    @precondition(lambda self: any(r.decoding for r in self.open))
    @rule(
        pick=st.integers(0, MAX_OPEN - 1), count=st.sampled_from([1, 5, 30, 64, 100]), seed=st.integers(0, 3)
    )
    def decode(self, pick: int, count: int, seed: int) -> None:
        """Decoded tokens: extend, allocate the partial page, compute."""
        reqs = [r for r in self.open if r.decoding]
        req = reqs[pick % len(reqs)]
        cache, lease = self.c, req.lease
        lease.extend(tokens(100 + seed, 2)[:count])
        try:
            units = cache.allocate(lease, partial_page=True)
        except CacheFullError:
            self._drop(req)
            return
        self._fork(req)
        self._engine(req, units)
        req.computed = True

    @precondition(lambda self: self.open)
    @rule(pick=st.integers(0, MAX_OPEN - 1))
    def release(self, pick: int) -> None:
        req = self.open[pick % len(self.open)]
        self._drop(req)

    @precondition(lambda self: any(r.lease._duplicates or r.computed for r in self.open))
    @rule(seed=st.integers(0, 2**16), pages=st.integers(1, 6), insert=st.booleans())
    def unrelated(self, seed: int, pages: int, insert: bool) -> None:
        """An unrelated request takes free units and writes them (inserted or aborted)."""
        cache = self.c
        lease = cache.lookup(tokens(77_000 + seed, pages))
        cache.admit(lease)
        try:
            units = cache.allocate(lease)
        except CacheFullError:
            cache.release(lease)
            return
        cache.fork_state(lease)
        fill(cache, lease, units)
        if insert:
            cache.insert(lease)
        else:
            cache.release(lease)

    @precondition(lambda self: any(r.lease._duplicates or r.computed for r in self.open))
    @rule(seed=st.integers(0, 2**16))
    def scribble(self, seed: int) -> None:
        """Every free anchor unit taken and overwritten by an aborted request."""
        cache = self.c
        free = cache.pools.anchor.device_allocator.available
        if not free:
            return
        lease = cache.lookup(tokens(200_000 + seed, free))
        cache.admit(lease)
        try:
            units = cache.allocate(lease, end_page=free)
            cache.fork_state(lease)
            fill(cache, lease, units)
        except CacheFullError:
            pass
        cache.release(lease)

    @precondition(lambda self: self.served and len(self.open) < MAX_OPEN)
    @rule(pick=st.integers(0, 2**10))
    def reread(self, pick: int) -> None:
        request = self.served[pick % len(self.served)]
        lease = self.c.lookup(request)
        self.c.admit(lease)
        assert verify(self.c, lease) == 0, "a restored unit holds another page's bytes"
        self.c.release(lease)

    # engine steps are drawn most: they fill the tiers (drawn freely, hypothesis spent most steps
    # on the argument-less flush, and an example inserted a few times and evicted once or never)
    advance_again = advance
    commit_again = commit

    @precondition(lambda self: self.since_flush >= 2)
    @rule()
    def flush(self) -> None:
        self.since_flush = 0
        self.c.flush()

    # --- after every step ------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if self.cache is None:
            return
        self.cache.tree.check()
        device_accounting(self.cache, [r.lease for r in self.open])
        for req in self.open:
            self._check_lease(req)
        if not self.open:
            device_accounting(self.cache, [])

    def teardown(self) -> None:
        try:
            if self.cache is not None:
                for req in self.open:
                    self.cache.release(req.lease)
                device_accounting(self.cache, [])
                self.cache.close()
        finally:
            shutil.rmtree(self.l3, ignore_errors=True)


#: a longer random run: KVSTRATA_FUZZ_EXAMPLES=60 KVSTRATA_FUZZ_STEPS=50 (~1.5 min per stack)
LONG = "KVSTRATA_FUZZ_EXAMPLES" in os.environ
SETTINGS = settings(
    max_examples=int(os.environ.get("KVSTRATA_FUZZ_EXAMPLES", "12")),
    stateful_step_count=int(os.environ.get("KVSTRATA_FUZZ_STEPS", "40")),
    deadline=None,
    derandomize=not LONG,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)

STACKS = {
    "kv": ("tiers.device.capacity_tokens=768",),
    "swa-mamba": ("tiers.device.capacity_tokens=768",),
    "hybrid-mamba": ("tiers.device.capacity_tokens=768",),
    "mla-nsa-draft": ("tiers.device.capacity_tokens=640",),
    "logical-swa": ("tiers.device.capacity_tokens=768",),
}


@pytest.mark.slow
@pytest.mark.parametrize("stack", list(STACKS))
def test_open_leases_sharing_prefixes_keep_the_units_their_engines_read(stack: str) -> None:
    machine = type(f"Fuzz_{stack}", (FuzzLoop,), {"stack": stack, "overrides": STACKS[stack]})
    run = machine.TestCase("runTest")
    run.settings = SETTINGS
    run.runTest()
