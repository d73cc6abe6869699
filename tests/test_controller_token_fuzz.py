"""The controller driven like an engine at token granularity (a hypothesis state machine):
page sizes 1, 4 and 16, requests that share a stem's first tokens and diverge anywhere (mid-page
too), prefill chunks of any token count, allocations split by ``end_page``, ``partial_page`` and
``window_only``, every pool mix (kv, mamba, swa, mla, nsa, draft, logical), every write policy,
most eviction policies, admission filters, a size-bounded file L3 and reopens on it.

``test_controller_stateful.py`` keeps page-aligned requests on the 64-token example stacks; what
this machine adds is what an engine at another page size sees: a partial page it computes, and
later completes in place; a state slot that runs on into a partial page (never a checkpoint);
the units an open lease attends over, which must keep its bytes until it closes. After every
restore the cached prefix holds exactly the bytes its pages (or its last page's state) were
computed with; ``fork_state`` hands back the checkpoint or the slot the engine runs in, as it
left it.
"""

from __future__ import annotations

import shutil
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from controller_support import (
    _content,
    device_accounting,
    holds_ids,
    host_units_held_by_tree,
    host_units_in_use,
    verify,
)
from kvstrata.core import eviction_rounds
from kvstrata.core.config import load
from kvstrata.core.controller import CacheController, CacheFullError, Lease, PoolKind
from kvstrata.plugins import PluginHost

WRITES = ("write_through", "write_through_selective", "write_back")
EVICTIONS = (None, "lru", "fifo", "lfu", "arc", "s3fifo", "chain", "cost_aware", "reuse")

MAMBA = {
    "type": "mamba",
    "layers": 2,
    "conv": [{"shape": [3, 16], "dtype": "bfloat16"}],
    "temporal": {"shape": [2, 4, 4], "dtype": "float32"},
    "device_units": 6,
    "host_units": 10,
}


ADMISSION = st.sampled_from(["always", "always", "always", "reuse", "tinylfu"])
EXTRA = st.tuples(
    st.sampled_from([1, 2, 64]).map(lambda n: f"policy.write_through_batch_pages={n}"),
    st.sampled_from([0, 1, 10, 40]).map(lambda n: f"policy.load_back_threshold_tokens={n}"),
    ADMISSION.map(lambda a: f"policy.admission.host.type={a}"),
    ADMISSION.map(lambda a: f"policy.admission.storage.type={a}"),
    st.sampled_from([0, 3, 20]).map(lambda n: f"policy.prefetch.threshold_tokens={n}"),
)


def stack(kind: str, page: int, window: int) -> dict:
    kv = {"type": "kv", "layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "bfloat16"}
    swa = {"type": "swa", "layers": 1, "kv_heads": 1, "head_dim": 8, "window": window, "dtype": "bfloat16"}
    pools: dict = {
        "kv": {"kv": kv},
        "kv-mamba": {"kv": kv, "mamba": MAMBA},
        "kv-swa": {"kv": kv, "swa": swa},
        "mla-nsa-draft": {
            "mla": {"type": "mla", "layers": 1, "kv_lora_rank": 16, "qk_rope_head_dim": 8},
            "indexer": {"type": "nsa", "layers": 1, "index_head_dim": 128},
            "draft": {"type": "draft", "layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "bfloat16"},
        },
        "all": {
            "kv": kv,
            "swa": swa,
            "mamba": MAMBA,
            "indexer": {"type": "nsa", "layers": 1, "index_head_dim": 128},
            "draft": {"type": "draft", "layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "bfloat16"},
        },
        "logical-swa": {
            "anchor": {"type": "logical"},
            "swa": swa,
            "c4": {
                "type": "mla",
                "index_source": "anchor",
                "layers": 1,
                "kv_lora_rank": 16,
                "qk_rope_head_dim": 0,
            },
            "c4_state": {
                "type": "mla",
                "index_source": "swa",
                "layers": 1,
                "kv_lora_rank": 8,
                "qk_rope_head_dim": 0,
            },
        },
    }[kind]
    return {"model": {"name": f"fuzz-{kind}", "page_size": page, "pools": pools}}


def tok(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=g)


def partial_id(tokens: torch.Tensor) -> int:
    """Content id of a state after / a page holding a partial page of tokens."""
    return (zlib.crc32(tokens.numpy().tobytes()) << 20) | 0x5A5A5 | (len(tokens) << 52)


@dataclass
class Req:
    lease: Lease
    tokens: torch.Tensor
    chunk: int  # tokens per chunk; 0 whole
    partial: bool
    slots: dict = field(default_factory=dict)  # state pool -> (unit, id)
    open_units: dict = field(default_factory=dict)  # pool -> list of (unit, page) partial pages
    written: dict = field(default_factory=dict)  # pages pool -> {unit: id} the engine reads


class TokenEngine(RuleBasedStateMachine):
    """One cache of a ``kind`` stack at page size ``page`` on one L3 directory."""

    kind = "kv"
    page = 4
    #: counts over the run (restored pages per tier, forks checked, open-lease units checked)
    seen: dict[str, int] = {}
    #: whether a host tier comes with an L3 (on ``self.l3``); the host state slots (None: 10)
    with_l3 = True
    state_slots: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.l3 = Path(tempfile.mkdtemp(prefix="kvstrata-token-fuzz-"))
        self.cache: CacheController | None = None
        self.stems = [tok(7000 + i, 12 * self.page + 3) for i in range(3)]
        self.open: list[Req] = []
        self.served: list[torch.Tensor] = []
        self.since = 0

    def _open(self, write, host, evict, window, device, prefetch, digests, extra=()) -> CacheController:
        P = self.page
        self.window = window
        sets = [
            f"policy.write={write}",
            f"policy.prefetch.policy={prefetch}",
            f"tiers.device.capacity_tokens={device * P}",
            f"tiers.host.capacity_tokens={host * P}",
            f"debug.unit_digests={digests}",
            *extra,
        ]
        if self.state_slots is not None:
            sets.append(f"model.pools.mamba.host_units={self.state_slots}")
        if host and self.with_l3:
            sets.append("tiers.storage.l3.type=file")
            sets.append(f"tiers.storage.l3.path={self.l3}")
            if self.l3cap:
                sets.append(f"tiers.storage.l3.capacity_bytes={self.l3cap * P}")
            sets.append(f"tiers.storage.l3.recycle_evicted={self.recycle}")
            sets.append(f"tiers.storage.l3.io_threads={self.io_threads}")
        if evict is not None:
            sets.append(f"policy.eviction={evict}")
        h = PluginHost()
        config = load(stack(self.kind, P, window * P - (P > 1)), overrides=sets, plugins=h, environ={})
        return CacheController(config, h)

    @initialize(
        write=st.sampled_from(WRITES),
        host=st.sampled_from([0, 6, 12, 32]),
        evict=st.sampled_from(EVICTIONS),
        window=st.integers(1, 4),
        device=st.sampled_from([10, 16, 24]),
        prefetch=st.sampled_from(["wait_complete", "wait_complete", "best_effort"]),
        digests=st.booleans(),
        extra=EXTRA,
        l3cap=st.sampled_from([0, 0, 600, 3000]),
        recycle=st.booleans(),
        io_threads=st.sampled_from([1, 4]),
    )
    def start(
        self, write, host, evict, window, device, prefetch, digests, extra, l3cap, recycle, io_threads
    ) -> None:
        self.l3cap, self.recycle, self.io_threads = l3cap, recycle, io_threads
        self.args = (write, host, evict, window, device, prefetch, digests)
        self.cache = self._open(*self.args, extra)

    @property
    def live(self) -> CacheController:
        assert self.cache is not None
        return self.cache

    def _check(self, lease: Lease) -> None:
        bad = verify(self.live, lease)
        for tier, n in lease.hit_pages.items():
            self.seen[str(tier)] += n
        device, host = lease.hit_pages["device"], lease.hit_pages["host"]
        end = lease.cached_pages - 1  # a state slot is the state after the prefix's last page
        tier = "device" if end < device else "host" if end < device + host else "storage"
        states = [n for n in self.live.pools.pools if self.live.pool_kind(n) is PoolKind.STATE]
        if end >= 0 and states:
            self.seen[f"state_{tier}"] = self.seen.get(f"state_{tier}", 0) + 1
        assert bad == 0, f"{bad} restored units wrong (cached {lease.cached_pages} pages)"

    @precondition(lambda self: len(self.open) < 3)
    @rule(
        stem=st.integers(0, 2),
        shared=st.integers(0, 12 * 16 + 3),
        fresh=st.integers(0, 40),
        chunk=st.sampled_from([0, 0, 1, 3, 5, 8, 16, 17]),
        partial=st.booleans(),
        seed=st.integers(0, 2**20),
    )
    def open_request(self, stem, shared, fresh, chunk, partial, seed) -> None:
        shared = shared % (len(self.stems[stem]) + 1)
        request = torch.cat([self.stems[stem][:shared], tok(seed, fresh)])
        if not len(request):
            return
        first = request if chunk == 0 else request[:chunk]
        lease = self.live.lookup(first)
        self.live.admit(lease)
        self._check(lease)
        req = Req(lease, request, chunk, partial)
        for name in self.live.pools.pools:
            if self.live.pool_kind(name) is PoolKind.PAGES:
                units = lease.prefix_units(name)
                hashes = lease.page_hashes[: len(units)]
                req.written[name] = {
                    int(u): int(h[:15], 16) for u, h in zip(units.tolist(), hashes, strict=True)
                }
        self.open.append(req)

    def _fill_pages(self, req: Req, name: str, units: torch.Tensor, first: int) -> None:
        cache, lease = self.live, req.lease
        hashes = lease.page_hashes
        P = self.page
        ids = []
        for i in range(len(units)):
            page = first + i
            if page < len(hashes):
                ids.append(int(hashes[page][:15], 16))
            else:
                ids.append(partial_id(lease.tokens[page * P :]))
                req.open_units.setdefault(name, []).append((units[i : i + 1], page))
        self._write(name, units, torch.tensor(ids, dtype=torch.int64))
        if cache.pool_kind(name) is PoolKind.PAGES:
            req.written.setdefault(name, {}).update(zip(units.tolist(), ids, strict=True))

    def _intact(self, req: Req) -> None:
        """Every page unit the lease's engine attends over still holds what it wrote."""
        for name, held in req.written.items():
            if not held:
                continue
            units = torch.tensor(list(held), dtype=torch.int64)
            ids = torch.tensor(list(held.values()), dtype=torch.int64)
            for i in range(len(units)):
                assert holds_ids(self.live, name, units[i : i + 1], ids[i : i + 1]), (
                    f"{name}: unit {int(units[i])} of an open lease was overwritten"
                )
            self.seen["intact"] += len(units)

    def _write(self, name: str, units: torch.Tensor, ids: torch.Tensor) -> None:
        pool = self.live.pools.pools[name]
        for buffer in pool.spec.buffers:
            view = pool.device.unit_view(buffer.name)
            view[units.to(view.device)] = _content(name, buffer.name, ids, view.shape[1], view.shape[2]).to(
                view.device
            )

    def _state_id(self, lease: Lease) -> int:
        end = lease.allocated_pages
        if end > lease.pages:
            return partial_id(lease.tokens)
        return int(lease.page_hashes[end - 1][:15], 16)

    @precondition(lambda self: self.open)
    @rule(pick=st.integers(0, 2), split=st.integers(0, 3), window_only=st.booleans())
    def advance(self, pick: int, split: int = 0, window_only: bool = False) -> None:
        req = self.open[pick % len(self.open)]
        cache, lease = self.live, req.lease
        tail = len(lease.tokens) % self.page
        use_partial = req.partial and tail > 0
        try:
            if split and lease.pages > split:
                first = cache.allocate(lease, end_page=lease.pages - split, window_only=window_only)
                for name, value in first.items():
                    if len(value) and cache.pool_kind(name) is not PoolKind.STATE:
                        self._fill_pages(req, name, value, lease.allocated_first_page(name))
            units = cache.allocate(lease, partial_page=use_partial, window_only=window_only)
        except CacheFullError:
            cache.release(lease)
            self.open.remove(req)
            return
        # the engine rewrites a partial page it computed before (its page grew)
        for name, held in list(req.open_units.items()):
            keep = []
            for unit, page in held:
                if page < lease.pages:
                    new = int(lease.page_hashes[page][:15], 16)
                else:
                    new = partial_id(lease.tokens[page * self.page :])
                    keep.append((unit, page))
                self._write(name, unit, torch.tensor([new]))
                if name in req.written and int(unit) in req.written[name]:
                    req.written[name][int(unit)] = new
            req.open_units[name] = keep
        self._intact(req)
        forked = cache.fork_state(lease)
        for name, slot in forked.items():
            if cache.pool_kind(name) is not PoolKind.STATE or not len(slot):
                continue
            prev = req.slots.get(name)
            if prev is not None and int(prev[0]) == int(slot[0]):
                assert holds_ids(cache, name, slot, torch.tensor([prev[1]])), f"{name}: working slot changed"
            elif lease.committed_pages and lease.node is not None:
                cp = int(lease.page_hashes[lease.committed_pages - 1][:15], 16)
                assert holds_ids(cache, name, slot, torch.tensor([cp])), f"{name}: forked a wrong state"
                self.seen["forks"] += 1
            sid = self._state_id(lease)
            self._write(name, slot, torch.tensor([sid]))
            req.slots[name] = (slot.clone(), sid)
        for name, value in units.items():
            if not len(value) or cache.pool_kind(name) is PoolKind.STATE:
                continue
            self._fill_pages(req, name, value, lease.allocated_first_page(name))
        last = len(lease.tokens) >= len(req.tokens)
        cache.insert(lease, close=last)
        if lease.allocated_pages <= lease.pages:
            req.slots.clear()
        self.since += 1
        if last:
            self.open.remove(req)
            self.served.append(req.tokens)
        else:
            at = len(lease.tokens)
            lease.extend(req.tokens[at : at + req.chunk])

    advance2 = advance
    advance3 = advance

    @precondition(lambda self: self.open)
    @rule(pick=st.integers(0, 2))
    def release(self, pick: int) -> None:
        req = self.open.pop(pick % len(self.open))
        self.live.release(req.lease)

    @precondition(lambda self: self.since >= 2)
    @rule()
    def flush(self) -> None:
        self.live.flush()

    @precondition(lambda self: self.served and len(self.open) < 3)
    @rule(pick=st.integers(0, 2**10), cut=st.integers(0, 30))
    def reread(self, pick: int, cut: int) -> None:
        request = self.served[pick % len(self.served)]
        request = request[: max(1, len(request) - cut)]
        lease = self.live.lookup(request, prefetch="wait")
        self.live.admit(lease)
        self._check(lease)
        self.live.release(lease)

    reread2 = reread

    @precondition(lambda self: self.since >= 3)
    @rule(
        write=st.sampled_from(WRITES),
        host=st.sampled_from([0, 6, 12, 32]),
        evict=st.sampled_from(EVICTIONS),
        device=st.sampled_from([10, 16, 24]),
        digests=st.booleans(),
        extra=EXTRA,
    )
    def reopen(self, write, host, evict, device, digests, extra) -> None:
        self.since = 0
        for req in self.open:
            self.live.release(req.lease)
        self.open.clear()
        self.live.close()
        self.args = (write, host, evict, self.args[3], device, self.args[5], digests)
        self.cache = self._open(*self.args, extra)

    @invariant()
    def consistent(self) -> None:
        if self.cache is not None:
            self.cache.tree.check()
            device_accounting(self.cache, [r.lease for r in self.open])

    def teardown(self) -> None:
        try:
            if self.cache is not None:
                for req in self.open:
                    self.cache.release(req.lease)
                self.cache.close()
        finally:
            shutil.rmtree(self.l3, ignore_errors=True)


class StateTiers(TokenEngine):
    """The machine tuned so state checkpoints come back from host and L3 in most examples (the
    plain draws restore them almost only from the device): every object admitted, a host tier
    larger than a request (L3 writes go through it), small shared stems, a fresh request that
    pushes the device's pages down before served requests are read again, the ``learned`` policy
    and the ``timeout`` prefetch end."""

    @initialize(
        write=st.sampled_from(WRITES),
        evict=st.sampled_from([None, "learned", "lru"]),
        prefetch=st.sampled_from(["wait_complete", "timeout"]),
        l3cap=st.sampled_from([0, 1500]),
        recycle=st.booleans(),
    )
    def start(self, write, evict, prefetch, l3cap, recycle) -> None:  # type: ignore[override]
        self.l3cap, self.recycle, self.io_threads = l3cap, recycle, 1
        self.stems = [tok(7000 + i, 6 * self.page + 3) for i in range(3)]
        self.args = (write, 14, evict, 2, 14, prefetch, False)
        self.cache = self._open(*self.args, ("policy.load_back_threshold_tokens=0",))

    @precondition(lambda self: not self.open)
    @rule(
        stem=st.integers(0, 2),
        chunk=st.sampled_from([1, 3, 4, 8]),
        seed=st.integers(0, 2**16),
        picks=st.lists(st.tuples(st.integers(0, 99), st.integers(0, 9)), max_size=3),
    )
    def churn_and_reread(self, stem: int, chunk: int, seed: int, picks: list[tuple[int, int]]) -> None:
        for request in ((stem, 99, 5, chunk, False, seed), (0, 0, 8 * self.page, 0, False, seed)):
            self.open_request(*request)  # a stem in chunks (checkpoints), then a fresh request
            while self.open:
                self.advance(0)
        for pick, cut in picks:
            self.reread(pick, cut)


LOAD_BACK = ("policy.load_back_threshold_tokens=0",)  # (a short host hit is loaded, not recomputed)


class WriteBackNoL3(StateTiers):
    """Write-back with a host tier and no L3, 2-4 host state slots: an eviction's checkpoints
    outnumber the slots, which go to the deepest of each path (a host node with pages and no
    state is the middle of a longer prefix). Every restore exact, and with no lease open every
    host unit in use is the tree's."""

    with_l3 = False

    @initialize(
        slots=st.integers(2, 4),
        host=st.sampled_from([12, 32]),
        evict=st.sampled_from([None, "lru", "fifo", "s3fifo"]),
        window=st.integers(1, 4),
        device=st.sampled_from([10, 14, 24]),
        digests=st.booleans(),
        prefetch=st.sampled_from(["wait_complete", "best_effort"]),
    )
    def start(self, slots, host, evict, window, device, digests, prefetch) -> None:  # type: ignore[override]
        self.state_slots, self.l3cap, self.recycle, self.io_threads = slots, 0, False, 1
        self.stems = [tok(7000 + i, 6 * self.page + 3) for i in range(3)]
        self.args = ("write_back", host, evict, window, device, prefetch, digests)
        self.cache = self._open(*self.args, LOAD_BACK)

    @precondition(lambda self: self.since >= 3)
    @rule(host=st.sampled_from([12, 32]), device=st.sampled_from([10, 14, 24]), digests=st.booleans())
    def reopen(self, host, device, digests) -> None:  # type: ignore[override]
        super().reopen("write_back", host, self.args[2], device, digests, LOAD_BACK)

    @invariant()
    def host_units_are_the_trees(self) -> None:
        if self.cache is not None and not self.open:
            in_use = host_units_in_use(self.cache)
            assert in_use == {n: c for n, c in host_units_held_by_tree(self.cache).items() if n in in_use}


def run(
    kind: str, page: int, examples: int, steps: int = 50, derandomize: bool = True, base: type = TokenEngine
) -> dict[str, int]:
    """Run the machine on one stack and page size; returns what it saw."""
    seen = dict.fromkeys(("device", "host", "storage", "forks", "intact"), 0)
    machine = type(f"{base.__name__}_{kind}_{page}", (base,), {"kind": kind, "page": page, "seen": seen})
    case = machine.TestCase("runTest")
    case.settings = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=derandomize,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    case.runTest()
    return seen


#: one page size per stack in the fast loop (every size over the stacks); the slow case the rest
CI = [("kv-mamba", 1), ("kv-swa", 4), ("all", 16), ("mla-nsa-draft", 4), ("logical-swa", 1), ("kv", 16)]
KINDS = ("kv", "kv-mamba", "kv-swa", "mla-nsa-draft", "all", "logical-swa")


@pytest.mark.parametrize(("kind", "page"), CI)
def test_token_level_engine_loops_restore_exact_bytes(kind: str, page: int) -> None:
    seen = run(kind, page, examples=4, steps=40)
    assert seen["device"] + seen["host"] + seen["storage"] > 0, seen


@pytest.mark.parametrize(("kind", "page"), [("kv-mamba", 4), ("all", 1)])
def test_state_checkpoints_restored_from_host_and_l3_hold_exact_bytes(kind: str, page: int) -> None:
    seen = run(kind, page, examples=15, steps=30, base=StateTiers)
    assert seen.get("state_host", 0) and seen.get("state_storage", 0), seen


@pytest.mark.parametrize(("kind", "page"), [("kv-mamba", 1), ("kv-mamba", 4), ("kv-mamba", 16), ("all", 4)])
def test_write_back_without_l3_restores_exact_bytes_with_few_host_state_slots(
    kind: str, page: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random request mixes, write-back, no L3, 2-4 host state slots: checkpoints come back
    from the host with the slots given to deeper ones (counted: ``given``), every byte exact."""
    given = [0]
    give = eviction_rounds._give_slots

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        dropped = give(*args, **kwargs)
        given[0] += len(dropped)
        return dropped

    monkeypatch.setattr(eviction_rounds, "_give_slots", counted)
    seen = run(kind, page, examples=12, steps=30, base=WriteBackNoL3)
    assert given[0] and (kind != "kv-mamba" or seen.get("state_host", 0)), (seen, given)


#: the pairs the fast case leaves out: with it, every stack at every page size (examples kept
#: few: the suite's minutes on a 2-core CI machine; scratch runs take hundreds per pair)
OTHER_PAIRS = [(kind, page) for kind in KINDS for page in (1, 4, 16) if (kind, page) not in CI]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "page"), OTHER_PAIRS)
def test_token_level_engine_loops_at_every_page_size(kind: str, page: int) -> None:
    seen = run(kind, page, examples=10)
    assert seen["device"] + seen["host"] + seen["storage"] > 0, seen
