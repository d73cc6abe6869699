"""Fault matrix: the library API at the engine boundary (issue 25), driven as an engine author
would get it wrong: two caches in one process (a target and a draft model) handed each other's
leases, bad and wrong-typed token ids, ``close`` while a slow or stuck backend holds writes or
reads, and a second thread calling without a lock.

What must hold in every case (the verdicts of the fault matrix):

- **exact or shorter**: every restored prefix holds the bytes computed for its pages (0 wrong
  units), at most as long as what was inserted;
- **counted**: every refusal is an error naming the problem (``ValueError`` / ``TypeError`` for
  bad input, :class:`kvstrata.ConcurrentUseError` for a second thread); writes ``close`` gave up
  on are counted (``operations.storage_writes_abandoned``);
- **nothing left open**: no open lease, every device / host unit in use is one the tree holds,
  the tree checks; after ``close`` the storage threads end and the backend is closed once its
  last call returns.

The backends here are the labelled fault injector (``kvstrata.testing.faults``): fakes for fault
injection only; the caches, trees and pools are the real ones.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kvstrata
from controller_support import EXAMPLES, computed, fill, tokens, verify
from kvstrata.core.config import load
from kvstrata.core.controller import CacheController, Lease
from kvstrata.plugins import PluginHost
from kvstrata.testing.faults import FaultyBackend

pytestmark = pytest.mark.faults

PAGE = 64
#: generous bound on a call that must return: past it, the call hangs
HANG_S = 60


# --- the verdicts --------------------------------------------------------------------------------


def open_stack(
    example: str, *, l3: Path | None = None, sets: tuple[str, ...] = (), host: PluginHost | None = None
) -> CacheController:
    host = host or PluginHost()
    storage = [f"tiers.storage.l3.path={l3}"] if l3 is not None else ["tiers.storage={}"]
    config = load([EXAMPLES[example]], overrides=[*storage, *sets], plugins=host, environ={})
    return CacheController(config, host)


def restore(cache: CacheController, request: torch.Tensor, inserted_pages: int) -> int:
    """Look ``request`` up and admit it: exact or shorter (0 wrong units, at most what was
    inserted); returns the pages restored and releases the lease."""
    lease = cache.lookup(request)
    try:
        cache.admit(lease)
        assert lease.cached_pages <= inserted_pages
        assert verify(cache, lease) == 0, "wrong bytes restored"
        return lease.cached_pages
    finally:
        cache.release(lease)


def nothing_left_open(cache: CacheController) -> None:
    """No open lease; every unit in use on either tier is held by the tree; the tree checks."""
    assert cache.open_leases == 0
    cache.tree.check()
    for name, pool in cache.pools.pools.items():
        if pool.index_owner != name:
            continue  # a sidecar uses its owner's units
        if name in cache.tree_pools:
            assert pool.device_allocator.used == cache.tree.units(name, "device"), name
            if pool.host_allocator is not None and cache.prefetcher is None:
                assert pool.host_allocator.used == cache.tree.units(name, "host"), name


def storage_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvstrata-l3")]


# --- two caches per process ---------------------------------------------------------------------

LEASE_CALLS: dict[str, Callable[[CacheController, Lease], Any]] = {
    "admit": lambda cache, lease: cache.admit(lease),
    "allocate": lambda cache, lease: cache.allocate(lease),
    "insert": lambda cache, lease: cache.insert(lease),
    "checkpoint": lambda cache, lease: cache.insert(lease, close=False),
    "release": lambda cache, lease: cache.release(lease),
    "fork_state": lambda cache, lease: cache.fork_state(lease),
    "unpin": lambda cache, lease: cache.unpin(lease),
}


@pytest.mark.parametrize("example", ["kv", "hybrid-mamba", "mla-nsa-draft"])
def test_two_caches_never_take_each_others_leases(example: str, tmp_path: Path) -> None:
    """A target and a draft model in one process, sharing an L3 directory: each refuses every
    lease call with the other's lease, at every point of a request's life; each restores its
    own prompts exactly, from device and, in fresh caches, from L3."""
    l3 = tmp_path / "l3"
    sets = ("policy.prefetch.policy=wait_complete",)
    prompts = [tokens(100 + i, 4) for i in range(3)]
    with (
        open_stack(example, l3=l3, sets=sets) as target,
        open_stack(example, l3=l3, sets=(*sets, "model.name=draft-model")) as draft,
    ):
        refused = 0
        for prompt in prompts:
            mine, theirs = computed(target, prompt), draft.lookup(prompt)
            for call in LEASE_CALLS.values():  # at every stage: looked up, computed
                for cache, lease in ((draft, mine), (target, theirs)):
                    with pytest.raises(ValueError, match="issued by another cache"):
                        call(cache, lease)
                    refused += 1
            target.insert(mine)
            draft.admit(theirs)
            fill(draft, theirs, draft.allocate(theirs))
            draft.insert(theirs)
        assert refused == len(prompts) * len(LEASE_CALLS) * 2
        for cache in (target, draft):
            for prompt in prompts:
                assert restore(cache, prompt, 4) == 4
            nothing_left_open(cache)
    for model in ("target", "draft-model"):
        model_sets = (*sets, f"model.name={model}") if model != "target" else sets
        with open_stack(example, l3=l3, sets=model_sets) as cold:
            assert [restore(cold, prompt, 4) for prompt in prompts] == [4, 4, 4], model
            nothing_left_open(cold)


# --- bad token ids ------------------------------------------------------------------------------

BAD_TOKENS: dict[str, tuple[Callable[[torch.Tensor], Any], type[Exception], str]] = {
    "id_2**33": (lambda t: torch.cat([t, torch.tensor([2**33])]), ValueError, r"got 8589934592"),
    "id_2**32": (lambda t: torch.cat([t, torch.tensor([2**32])]), ValueError, r"got 4294967296"),
    "negative": (lambda t: torch.cat([t, torch.tensor([-1])]), ValueError, r"got -1"),
    "python_int_beyond_64_bits": (lambda t: [*t.tolist(), 2**70], ValueError, r"integer token ids"),
    "float_tensor": (lambda t: t.double(), TypeError, "must be integers"),
    "float_list": (lambda t: [float(x) for x in t.tolist()], TypeError, "must be integers"),
    "bool_tensor": (lambda t: t > 100, TypeError, "must be integers"),
    "batch_2d": (lambda t: t.view(2, -1), ValueError, r"one sequence .*\(2, "),
    "nested_list": (lambda t: [t.tolist()], ValueError, "one sequence"),
    "float_array": (lambda t: t.numpy().astype(np.float32), TypeError, "must be integers"),
    "string": (lambda t: " ".join(map(str, t.tolist())), TypeError, "got str"),
}


#: (entry, with L3): a lookup hashes (and used to lock first) only with L3; extend hashes lazily
ENTRIES = [("lookup", True), ("lookup", False), ("extend", True), ("extend_after_checkpoint", True)]


@pytest.mark.parametrize(
    ("entry", "with_l3"), ENTRIES, ids=["lookup-l3", "lookup-no_l3", "extend", "checkpoint"]
)
@pytest.mark.parametrize("case", sorted(BAD_TOKENS))
def test_bad_token_ids_are_refused_and_hold_nothing(
    case: str, with_l3: bool, entry: str, tmp_path: Path
) -> None:
    """Behind a cached prefix (so a lookup would lock something), five bad requests: each is
    refused naming ``tokens``, the lease they came through (if any) is unchanged, and then the
    whole device tier serves one request and a late pool can be added."""
    make, error, message = BAD_TOKENS[case]
    sets = ("tiers.device.capacity_tokens=1024",)
    with open_stack("kv", l3=tmp_path / "l3" if with_l3 else None, sets=sets) as cache:
        prefix = tokens(200, 2)
        cache.insert(computed(cache, prefix))
        bad = make(tokens(201, 1))
        for _ in range(5):
            if entry == "lookup":
                with pytest.raises(error, match=f"^tokens: .*{message}"):
                    cache.lookup(bad)
                continue
            lease = computed(cache, prefix) if entry == "extend" else cache.lookup(prefix)
            if entry == "extend_after_checkpoint":
                cache.admit(lease)
                cache.insert(lease, close=False)
            before = (lease.pages, lease.tokens.tolist())
            with pytest.raises(error, match=f"^tokens: .*{message}"):
                lease.extend(bad)
            assert (lease.pages, lease.tokens.tolist()) == before
            cache.release(lease)
        nothing_left_open(cache)
        whole = tokens(202, 16)
        cache.insert(computed(cache, whole))  # every device page: nothing stayed locked
        assert restore(cache, whole, 16) == 16
        cache.add_pool(
            "draft", {"type": "draft", "layers": 1, "kv_heads": 1, "head_dim": 8, "index_source": "kv"}
        )
        nothing_left_open(cache)


# --- close under load ---------------------------------------------------------------------------


@contextmanager
def faulty_cache(backend: dict[str, Any], *sets: str) -> Iterator[tuple[CacheController, FaultyBackend]]:
    """A kv cache whose L3 is the fault injector (stores nothing; ``operations=[]``: no call
    raises, a put answers 'not stored'); the backend is let go at the end whatever happened."""
    host = PluginHost()
    host.storage_backends.register(FaultyBackend)
    fields = [f"tiers.storage.l3.{key}={value}" for key, value in backend.items()]
    config = load(
        [EXAMPLES["kv"]],
        overrides=["tiers.storage.l3.type=faults", "tiers.storage.l3.operations=[]", *fields, *sets],
        plugins=host,
        environ={},
    )
    cache = CacheController(config, host)
    fault = cache.parts.backend
    assert isinstance(fault, FaultyBackend)
    try:
        yield cache, fault
    finally:
        fault.unstall()


def close_within(cache: CacheController, timeout: float | None) -> None:
    closing = threading.Thread(target=cache.close, kwargs={"timeout": timeout}, name="test-close")
    closing.start()
    closing.join(HANG_S)
    assert not closing.is_alive(), f"close(timeout={timeout}) hung"


CLOSE_LOADS = {
    "slow_puts": {"delay_s": 0.05},
    "stuck_put": {"stall": "[put]"},
    "stuck_exists": {"stall": "[exists]"},
    "stuck_get": {"stall": "[get]"},
}


@pytest.mark.parametrize("load", sorted(CLOSE_LOADS))
def test_close_under_load_returns_counts_and_closes_after(load: str) -> None:
    """Eight requests queue L3 writes (and one open request a prefetch) against a slow or stuck
    store: ``close(timeout=0.3)`` returns; the writes it gave up on are counted; the open
    lease is reported; once the store answers, the threads end and the backend is closed."""
    with faulty_cache(CLOSE_LOADS[load]) as (cache, backend):
        for seed in range(8):
            cache.insert(computed(cache, tokens(300 + seed, 2)))
        reading = cache.lookup(tokens(320, 3), prefetch="wait")  # an L3 read in flight
        queued = cache.metrics.snapshot()["operations"]["storage_writes"]
        with pytest.warns(kvstrata.OpenLeasesWarning, match=r"1 open lease\(s\)"):
            close_within(cache, 0.3)
        ops = cache.metrics.snapshot()["operations"]
        # one writer thread: every write that never reached put is abandoned, and at most the
        # one inside put at the deadline besides (one put per write: a kv-only stack)
        never_started = queued - backend.calls["put"]
        abandoned = ops["storage_writes_abandoned"]
        assert never_started <= abandoned <= never_started + 1, (ops, backend.calls)
        if load == "stuck_put":
            assert abandoned == queued, "the stuck write and every queued one counted"
        with pytest.raises(RuntimeError, match="cache is closed"):
            cache.lookup(tokens(321, 1))
        assert reading.pages == 3 and not reading.closed
        backend.unstall()
        assert backend.closed.wait(HANG_S), "the backend is closed once its last call returns"
        for thread in [t for t in threading.enumerate() if t.name.startswith("kvstrata-")]:
            thread.join(HANG_S)
        assert storage_threads() == []


def test_close_with_time_to_spare_stores_everything() -> None:
    with faulty_cache({"delay_s": 0.01}) as (cache, backend):
        for seed in range(4):
            cache.insert(computed(cache, tokens(330 + seed, 2)))
        close_within(cache, None)
        ops = cache.metrics.snapshot()["operations"]
        assert ops["storage_writes_abandoned"] == 0 and backend.calls["put"] == ops["storage_writes"]
        assert backend.closed.is_set() and storage_threads() == []


# --- a second thread without a lock ------------------------------------------------------------


def _hammer(
    cache: CacheController, seeds: range, lock: threading.Lock | None, out: dict[str, Any], stray: list[Lease]
) -> None:
    """Requests from one thread; a refused call leaves its lease for the owner to release."""
    for seed in seeds:
        lease = None
        try:
            with lock or _NoLock():
                request = tokens(seed % 7, 2 + seed % 3)  # shared prefixes: real hits and races
                lease = cache.lookup(request)
                cache.admit(lease)
                out["wrong"] += verify(cache, lease)
                fill(cache, lease, cache.allocate(lease))
                cache.insert(lease)
                out["served"] += 1
        except kvstrata.ConcurrentUseError:
            out["refused"] += 1
            if lease is not None and not _released(cache, lease):
                stray.append(lease)
        except Exception as exc:  # anything else is a failure of the boundary
            out["other"].append(repr(exc))


def _released(cache: CacheController, lease: Lease) -> bool:
    """What an engine does with a request a refusal cut short: release it (retrying while
    another thread is inside a call)."""
    for _ in range(10_000):
        try:
            cache.release(lease)
            return True
        except kvstrata.ConcurrentUseError:
            continue
    return False


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("locked", [False, True], ids=["unlocked", "engine_lock"])
def test_eight_threads_are_refused_or_served_exactly(locked: bool) -> None:
    """Eight threads share one cache. Without a lock, calls that overlap another thread's are
    refused with ConcurrentUseError (no other error, no wrong byte); under the engine's own
    lock every request is served. Either way nothing is left open."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: overlaps are the point
    try:
        with open_stack("kv", sets=("tiers.device.capacity_tokens=4096",)) as cache:
            out: dict[str, Any] = {"wrong": 0, "served": 0, "refused": 0, "other": []}
            stray: list[Lease] = []
            lock = threading.Lock() if locked else None
            threads = [
                threading.Thread(target=_hammer, args=(cache, range(i * 40, i * 40 + 40), lock, out, stray))
                for i in range(8)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(HANG_S * 5)
            assert not any(t.is_alive() for t in threads)
            assert out["other"] == [] and out["wrong"] == 0
            if locked:
                assert out["served"] == 320 and out["refused"] == 0
            else:
                assert out["refused"] > 0, "overlapping calls were detected"
                assert out["served"] + out["refused"] == 320
            for lease in stray:
                cache.release(lease)
            nothing_left_open(cache)
            request = tokens(3, 4)
            cache.insert(computed(cache, request))
            assert restore(cache, request, 4) == 4
    finally:
        sys.setswitchinterval(old)
