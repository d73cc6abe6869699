"""Random engine loops over a request's whole life -- prefill chunks, then decode one token at a
time across page boundaries -- for several leases at once, against a reference engine (a hypothesis
state machine, derandomized).

The reference engine keeps, per lease, which unit holds which page (from every ``allocate``: a
partial page's unit was handed out before the page completed) and how many tokens it has run
(``done``). It computes only tokens it holds units for, writes a partial page's unit with bytes
of that partial page (a later request served them would see them), and advances a state pool's
working slot in place (the state after ``n`` tokens; mid-page states have bytes of their own).
What must hold: every restored prefix holds exactly the bytes of its pages (``verify``), a window
pool's prefix covers the last window, ``fork_state`` hands the engine the state it has run to
(after a cached prefix from the device, the host or L3 too), a request closed with no partial
page allocated past its end is served whole right after, and the tree and the device units
stay consistent. Stacks: kv + sliding window + Mamba state, and kv + a draft sidecar, at page
sizes 1, 16 and 64.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvstrata
from controller_support import _content, _ids, device_accounting, holds_ids, verify
from kvstrata.core.controller import CacheController, CacheFullError, Lease, PoolKind

STEMS = 2
MAX_OPEN = 3


def stack(page: int, kind: str, l3: Path | None) -> dict:
    """A small stack at page size ``page``: 16 device pages (allocations evict), 24 host pages."""
    pools: dict[str, dict] = {"kv": {"type": "kv", "layers": 1, "kv_heads": 1, "head_dim": 8}}
    if kind == "swa-mamba":
        pools["swa"] = {
            "type": "swa",
            "layers": 1,
            "kv_heads": 1,
            "head_dim": 8,
            "window": 2 * page + page // 2 + 1,
        }
        pools["mamba"] = {
            "type": "mamba",
            "layers": 1,
            "states": {"ssm": {"shape": [2], "dtype": "float32"}},
            "device_units": 6,
            "host_units": 12,
        }
    else:
        pools["draft"] = {"type": "draft", "layers": 1, "kv_heads": 1, "head_dim": 8}
    storage = {"l3": {"type": "file", "path": str(l3)}} if l3 is not None else {}
    return {
        "model": {"name": f"decode-{kind}-{page}", "page_size": page, "pools": pools},
        "tiers": {
            "device": {"capacity_tokens": 16 * page},
            "host": {"capacity_tokens": 24 * page},
            "storage": storage,
        },
        "policy": {"prefetch": {"policy": "wait_complete"}, "load_back_threshold_tokens": 1},
    }


def _partial_id(tokens: torch.Tensor, kind: bytes) -> int:
    """An id for bytes no whole page has: a partial page, or a state after a mid-page token."""
    digest = hashlib.blake2b(tokens.numpy().tobytes(), digest_size=8, person=b"decode-" + kind).digest()
    return int.from_bytes(digest, "little") >> 4


def _write(cache: CacheController, pool: str, units: torch.Tensor, ids: torch.Tensor) -> None:
    spec = cache.pools.pools[pool]
    for buffer in spec.spec.buffers:
        view = spec.device.unit_view(buffer.name)
        view[units.to(view.device)] = _content(pool, buffer.name, ids, view.shape[1], view.shape[2]).to(
            view.device
        )


@dataclass
class Request:
    lease: Lease
    tokens: torch.Tensor  # the whole request: prompt and the tokens it will decode
    done: int  # tokens the engine has run
    pages: dict[str, dict[int, int]] = field(default_factory=dict)  # pool -> page -> unit
    slots: dict[str, torch.Tensor] = field(default_factory=dict)  # state pool (and followers) -> slot


class DecodeLoop(RuleBasedStateMachine):
    page = 16
    kind = "swa-mamba"
    with_l3 = False

    def __init__(self) -> None:
        super().__init__()
        self.l3 = Path(tempfile.mkdtemp(prefix="kvstrata-decode-"))
        self.cache: CacheController | None = None
        gen = torch.Generator().manual_seed(7)
        self.stems = [torch.randint(0, 50_000, (8 * self.page,), generator=gen) for _ in range(STEMS)]
        self.open: list[Request] = []
        self.served: list[torch.Tensor] = []
        self.since_reopen = 0  # inserts since the last reopen (drawn freely, it served little)

    def _open(self, write: str) -> CacheController:
        config = stack(self.page, self.kind, self.l3 if self.with_l3 else None)
        return kvstrata.open(config, overrides=[f"policy.write={write}"], environ={})

    @initialize(write=st.sampled_from(["write_through", "write_back"]))
    def start(self, write: str) -> None:
        self.cache = self._open(write)

    @property
    def live(self) -> CacheController:
        assert self.cache is not None
        return self.cache

    # --- the reference engine ----------------------------------------------------------------

    def _state_id(self, request: Request, n: int) -> torch.Tensor:
        page = self.page
        if n % page == 0:
            return _ids([request.lease.page_hashes[n // page - 1]])
        return torch.tensor([_partial_id(request.tokens[:n], b"state")], dtype=torch.int64)

    def _page_id(self, request: Request, p: int, upto: int) -> torch.Tensor:
        page = self.page
        if upto >= (p + 1) * page:
            return _ids([request.lease.page_hashes[p]])
        return torch.tensor([_partial_id(request.tokens[p * page : upto], b"page")], dtype=torch.int64)

    def _check_prefix(self, lease: Lease) -> None:
        cache = self.live
        assert verify(cache, lease) == 0, "a restored unit holds another page's bytes"
        cached = lease.cached_pages
        for name, tp in cache.tree_pools.items():
            if tp.kind is PoolKind.WINDOW and cached:
                first, n = lease.prefix_first_page(name), len(lease.prefix_units(name))
                assert first + n == cached, f"{name}: the window ends at {first + n}, not at {cached}"
                assert n >= min(tp.window, cached), f"{name}: {n} pages do not cover the window {tp.window}"

    def _compute(self, request: Request, units: dict[str, torch.Tensor]) -> None:
        """What an engine does after ``allocate``: record the units, fork the state, run the
        tokens it has units for."""
        cache, lease, page = self.live, request.lease, self.page
        for name, value in units.items():
            if len(value) and cache.pool_kind(name) is not PoolKind.STATE:
                first = lease.allocated_first_page(name)
                held = request.pages.setdefault(name, {})
                for i, unit in enumerate(value.tolist()):
                    held[first + i] = unit
        upto = min(len(lease.tokens), lease.allocated_pages * page)
        if upto <= request.done:
            return  # nothing to run (fork_state would refuse a lease with pages still to allocate)
        forked = cache.fork_state(lease)
        for name, slot in forked.items():
            if len(slot):
                request.slots[name] = slot
                if request.done:
                    want = self._state_id(request, request.done)
                    assert holds_ids(cache, name, slot, want), (
                        f"{name}: the working slot is not the state after {request.done}"
                    )
            else:
                request.slots.pop(name, None)
        for name, held in request.pages.items():
            for p in range(request.done // page, (upto + page - 1) // page):
                if p in held:
                    _write(cache, name, torch.tensor([held[p]]), self._page_id(request, p, upto))
        for name, slot in request.slots.items():
            _write(cache, name, slot, self._state_id(request, upto))
        assert forked or not any(cache.pool_kind(n) is PoolKind.STATE for n in cache.pools.pools)
        request.done = upto

    # --- rules -------------------------------------------------------------------------------

    @precondition(lambda self: len(self.open) < MAX_OPEN)
    @rule(
        stem=st.integers(0, STEMS - 1),
        shared=st.integers(0, 8),
        fresh=st.sampled_from([0, 0, 1, 3, 10, 24]),
        first=st.integers(1, 8),
        seed=st.integers(0, 2**20),
        before_admit=st.sampled_from([0, 0, 1, 3, 40]),
    )
    def open_request(
        self, stem: int, shared: int, fresh: int, first: int, seed: int, before_admit: int
    ) -> None:
        """A new request: its first chunk looked up, and (``before_admit``) extended by a few
        tokens before the admit settles what is cached."""
        page = self.page
        gen = torch.Generator().manual_seed(seed)
        extra = torch.randint(0, 50_000, (fresh * page // 4 + fresh % 5,), generator=gen)
        request = torch.cat([self.stems[stem][: shared * page], extra])
        if not len(request):
            return
        at = max(1, first * page // 2)
        lease = self.live.lookup(request[:at])
        if before_admit:
            lease.extend(request[at : at + before_admit])
        self.live.admit(lease)
        self._check_prefix(lease)
        self.open.append(Request(lease, request, lease.cached_tokens))

    @precondition(lambda self: self.open)
    @rule(
        pick=st.integers(0, MAX_OPEN - 1),
        grow=st.sampled_from([0, 1, 1, 1, 2, -1]),
        partial=st.booleans(),
        window_only=st.booleans(),
        end_page=st.sampled_from([-1, -1, -1, -1, 0, 1, 2]),
    )
    def step(self, pick: int, grow: int, partial: bool, window_only: bool, end_page: int) -> None:
        """Extend (one token, two, or a chunk of pages: ``-1``), then allocate and compute."""
        request = self.open[pick % len(self.open)]
        cache, lease = self.live, request.lease
        have = len(lease.tokens)
        more = self.page * 3 if grow < 0 else grow
        if more and have < len(request.tokens):
            lease.extend(request.tokens[have : have + more])
        end = None if end_page < 0 else min(lease.pages, lease.allocated_pages + end_page)
        try:
            units = cache.allocate(lease, end_page=end, partial_page=partial, window_only=window_only)
        except CacheFullError:
            cache.release(lease)
            self.open.remove(request)
            return
        self._compute(request, units)

    @precondition(lambda self: self.open)
    @rule(pick=st.integers(0, MAX_OPEN - 1), close=st.booleans())
    def insert(self, pick: int, close: bool) -> None:
        request = self.open[pick % len(self.open)]
        lease = request.lease
        if lease.allocated_pages < lease.pages or request.done < lease.pages * self.page:
            return  # the engine has not run every whole page yet
        # a state pool's slot is the checkpoint at the end where no partial page runs past it
        whole = self.kind == "kv-draft" or lease.allocated_pages == lease.pages
        self.live.insert(lease, close=close)
        self.since_reopen += 1
        if close:
            self.open.remove(request)
            self.served.append(lease.tokens)
            if whole:  # what was just inserted is served whole
                again = self.live.lookup(lease.tokens, prefetch="off")
                self.live.admit(again)
                assert again.cached_pages == lease.pages, f"{again.cached_pages} of {lease.pages} pages"
                self._check_prefix(again)
                self.live.release(again)

    @precondition(lambda self: self.open)
    @rule(pick=st.integers(0, MAX_OPEN - 1))
    def release(self, pick: int) -> None:
        request = self.open.pop(pick % len(self.open))
        self.live.release(request.lease)

    step_again = step
    step_once_more = step
    insert_again = insert

    @precondition(lambda self: self.served and len(self.open) < MAX_OPEN)
    @rule(pick=st.integers(0, 2**10), extra=st.integers(0, 3), flush=st.booleans())
    def reread(self, pick: int, extra: int, flush: bool) -> None:
        """A served request again (with a few tokens more): exact bytes, and the state forked
        into a new slot is the one after the cached prefix (from whichever tier it came)."""
        if flush:
            self.live.flush()
        tokens = self.served[pick % len(self.served)]
        tokens = torch.cat([tokens, torch.arange(extra, dtype=torch.int64)])
        lease = self.live.lookup(tokens, prefetch="wait")
        self.live.admit(lease)
        self._check_prefix(lease)
        request = Request(lease, tokens, lease.cached_tokens)
        with contextlib.suppress(CacheFullError):  # (other leases hold the tier: nothing to fork)
            self._compute(request, self.live.allocate(lease, partial_page=True))
        self.live.release(lease)

    reread_again = reread

    @precondition(lambda self: self.with_l3 and self.since_reopen >= 8)
    @rule(write=st.sampled_from(["write_through", "write_back"]))
    def reopen(self, write: str) -> None:
        """The engine restarts on the same L3: what it serves next comes from L3 only."""
        self.since_reopen = 0
        for request in self.open:
            self.live.release(request.lease)
        self.open.clear()
        self.live.close()
        self.cache = self._open(write)

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
        finally:
            shutil.rmtree(self.l3, ignore_errors=True)


SETTINGS = settings(
    max_examples=40,
    stateful_step_count=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


#: one case runs with the fast tests (~6 s); every page size and stack with the slow ones
CASES = [
    pytest.param(
        page,
        kind,
        with_l3,
        marks=() if (page, kind, with_l3) == (16, "swa-mamba", True) else pytest.mark.slow,
    )
    for page in (1, 16, 64)
    for kind in ("swa-mamba", "kv-draft")
    for with_l3 in (False, True)
]


@pytest.mark.parametrize(("page", "kind", "with_l3"), CASES)
def test_random_decode_loops_keep_bytes_windows_and_states_exact(page: int, kind: str, with_l3: bool) -> None:
    machine = type(
        f"DecodeLoop_{kind}_{page}", (DecodeLoop,), {"page": page, "kind": kind, "with_l3": with_l3}
    )
    run = machine.TestCase("runTest")
    run.settings = SETTINGS
    run.runTest()
