"""The circuit breaker: a backend that keeps failing is no longer called, and the cache keeps
serving from L1/L2 (issue 15, defect 2). The Mooncake half of the defect -- real deadlines against
a stopped master -- is in test_mooncake_backend.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from controller_support import host_units_held_by_tree, host_units_in_use, open_cache, serve, tokens
from kvstrata.core.breaker import BreakerState, CircuitBreaker
from kvstrata.plugins import PluginHost
from kvstrata.plugins.storage_backend import StorageObject
from kvstrata.storage_backends.file import FileConfig
from kvstrata.storage_backends.memory import MemoryBackend, MemoryConfig
from kvstrata.testing.conformance import BackendConformance, conformance_specs, page_hashes
from kvstrata.testing.faults import FaultsConfig, FaultyBackend

KIT = BackendConformance()


class FakeClock:
    """A clock the test moves by hand: breaker transitions without sleeping."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_and_lets_one_trial_through() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failures=3, cooldown_s=10, clock=clock)
    for _ in range(2):
        assert breaker.allow()
        assert breaker.record(ok=False) is None
    assert breaker.allow() and breaker.record(ok=True) is None  # a success resets the count
    for _ in range(2):
        assert breaker.allow() and breaker.record(ok=False) is None
    assert breaker.allow() and breaker.record(ok=False) is BreakerState.OPEN
    assert breaker.state is BreakerState.OPEN and breaker.trips == 1
    assert not breaker.allow()
    clock.now += 9.9
    assert not breaker.allow()
    clock.now += 0.2
    assert breaker.allow(), "after the cooldown one trial call goes through"
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow(), "only one trial at a time"
    assert breaker.record(ok=False) is None  # the trial failed: open again, not a new trip
    assert breaker.state is BreakerState.OPEN and breaker.trips == 1 and not breaker.allow()
    clock.now += 10.1
    assert breaker.allow() and breaker.record(ok=True) is BreakerState.CLOSED
    assert breaker.state is BreakerState.CLOSED and breaker.allow()


def test_a_call_ending_during_the_trial_does_not_let_a_second_trial_through() -> None:
    """A call allowed before the breaker opened (another thread's, waiting out an RPC deadline)
    fails while the trial is in flight: its record released the trial, so one cooldown later a
    second trial went through while the first still hung -- one more caller blocked on a backend
    that answers nothing. The trial's own outcome still decides."""
    clock = FakeClock()
    breaker = CircuitBreaker(failures=1, cooldown_s=10, clock=clock)
    assert breaker.allow()  # the stale call: allowed while closed, ends below on its own thread
    assert breaker.allow() and breaker.record(ok=False) is BreakerState.OPEN
    clock.now += 10.1
    assert breaker.allow(), "the trial"
    stale = threading.Thread(target=breaker.record, args=(False,))
    stale.start()
    stale.join()
    clock.now += 60
    assert not breaker.allow(), "a second trial while the first is in flight"
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.record(ok=True) is BreakerState.CLOSED  # the trial answered
    assert breaker.allow()


def test_breaker_with_zero_failures_never_opens() -> None:
    breaker = CircuitBreaker(failures=0, cooldown_s=1, clock=FakeClock())
    for _ in range(100):
        assert breaker.allow()
        breaker.record(ok=False)
    assert breaker.state is BreakerState.CLOSED and breaker.trips == 0


def test_engine_stops_calling_a_failing_backend(tmp_path: Path) -> None:
    backend = FaultyBackend("broken", FaultsConfig(circuit_breaker={"failures": 2, "cooldown_s": 3600}))
    specs = conformance_specs()
    engine = KIT.engine(backend, specs)
    source = KIT.pools(specs, 2, seed=51)
    hashes = page_hashes(2, seed=51)
    assert engine.exists("attn", hashes).failed == 2
    assert engine.get("attn", hashes, source["attn"].units(range(2))).failed == 2
    assert engine.read_breaker.state is BreakerState.OPEN and engine.metrics.breaker_trips == 1
    assert engine.write_breaker.state is BreakerState.CLOSED, "reads failing say nothing of writes"
    for _ in range(2):
        assert engine.put("attn", hashes, source["attn"].units(range(2))).failed == 2
    assert engine.write_breaker.state is BreakerState.OPEN and engine.metrics.breaker_trips == 2
    calls = dict(backend.calls)
    for _ in range(20):
        result = engine.get("attn", hashes, source["attn"].units(range(2)))
        assert result.ok == [False, False] and result.failed == 2
        assert "circuit breaker open" in (result.error or "")
        assert not engine.put("index", hashes, source["index"].units(range(2))).skipped
    assert backend.calls == calls, "an open breaker never reaches the backend"
    assert engine.metrics.breaker_rejected == 40
    assert engine.metrics.backend_errors == 4, "refused calls are not reported as backend errors"


def test_breaker_is_configured_per_backend_instance(tmp_path: Path) -> None:
    assert FileConfig(path=tmp_path).circuit_breaker.failures == 3
    with pytest.raises(ValueError, match=r"circuit_breaker\.cooldown"):
        FileConfig(path=tmp_path, circuit_breaker={"cooldown": 1})
    with pytest.raises(ValueError, match=r"circuit_breaker\.failures"):
        FileConfig(path=tmp_path, circuit_breaker={"failures": -1})


def broken_l3_cache(failures: int):  # type: ignore[no-untyped-def]
    """A kv cache over a fault-injection backend raising on every call (labelled fake), whose
    breaker opens after ``failures`` calls and stays open for the test."""
    host = PluginHost()
    host.storage_backends.register(FaultyBackend)
    overrides = [
        "tiers.storage={broken: {type: faults, fail: raise}}",
        f"tiers.storage.broken.circuit_breaker={{failures: {failures}, cooldown_s: 3600}}",
        "policy.prefetch.threshold_tokens=64",
    ]
    return open_cache("kv", overrides=overrides, host=host)


def test_cache_keeps_serving_from_l1_l2_while_the_breaker_is_open() -> None:
    with broken_l3_cache(failures=2) as cache:
        backend = cache.backend
        assert isinstance(backend, FaultyBackend) and cache.engine is not None
        first = tokens(61, 4)
        serve(cache, first)
        for i in range(4):
            serve(cache, tokens(62 + i, 4))
        cache.flush()
        assert cache.engine.read_breaker.state is BreakerState.OPEN
        assert cache.engine.write_breaker.state is BreakerState.OPEN
        calls = dict(backend.calls)
        failures = cache.metrics.snapshot()["failures"]
        again, bad = serve(cache, first)
        assert again.cached_pages == 4 and bad == 0, "L1/L2 keep serving"
        for i in range(4):
            serve(cache, tokens(70 + i, 4))
        cache.flush()
        assert backend.calls == calls, "the open breaker keeps every call off the backend"
        assert cache.engine.metrics.breaker_rejected > 0
        assert cache.metrics.snapshot()["failures"] > failures, "refused L3 work still counts as failed"
        assert host_units_in_use(cache) == host_units_held_by_tree(cache), "a staged host slot leaked"


def test_open_breaker_refuses_before_staging_or_checksumming(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the breaker is open, put/get/exists answer before any per-byte work: a write-through
    cache with a dead L3 must not pay staging copies and checksums for writes that cannot happen
    (benchmarks/faults.py measures the throughput this buys)."""
    import kvstrata.core.storage_engine as storage_engine

    backend = FaultyBackend("broken", FaultsConfig(circuit_breaker={"failures": 1, "cooldown_s": 3600}))
    specs = conformance_specs()
    engine = KIT.engine(backend, specs)
    source = KIT.pools(specs, 2, seed=52)
    hashes = page_hashes(2, seed=52)
    assert engine.put("attn", hashes, source["attn"].units(range(2))).failed == 2
    assert engine.write_breaker.state is BreakerState.OPEN
    assert engine.exists("attn", hashes).failed == 2  # the reads' breaker opens on its own failure
    assert engine.read_breaker.state is BreakerState.OPEN

    def per_byte_work(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("objects built while the breaker is open")

    monkeypatch.setattr(storage_engine, "build_objects", per_byte_work)
    monkeypatch.setattr(engine, "object_keys", per_byte_work)
    before = engine.metrics.breaker_rejected
    put = engine.put("attn", hashes, source["attn"].units(range(2)))
    get = engine.get("attn", hashes, source["attn"].units(range(2)))
    found = engine.exists("attn", hashes)
    for result in (put, get, found):
        assert result.ok == [False, False] and result.failed == 2
        assert "circuit breaker open" in (result.error or "")
    assert engine.metrics.breaker_rejected == before + 3
    assert engine.metrics.put_failed >= 4 and engine.metrics.get_misses == 2
    for breaker in (engine.read_breaker, engine.write_breaker):
        assert breaker.state is BreakerState.OPEN, "refusing() never claims the trial call"


def test_open_breaker_keeps_prefetches_and_writes_off_the_worker_threads() -> None:
    """With L3's breaker open, a lookup does not start a prefetch (its pages are counted as
    ``storage_down``) and write-through queues no L3 write (counted as failed, no host lock held)."""
    with broken_l3_cache(failures=1) as cache:
        assert cache.engine is not None
        serve(cache, tokens(81, 4))
        cache.flush()
        assert cache.engine.read_breaker.state is BreakerState.OPEN
        assert cache.engine.write_breaker.state is BreakerState.OPEN
        started = cache.metrics.snapshot()["operations"].get("prefetches_started", 0)
        failures = cache.metrics.snapshot()["failures"]
        lease = cache.lookup(tokens(82, 4))
        assert lease._prefetch is None and lease.skipped.get("storage_down") == 4
        cache.release(lease)
        serve(cache, tokens(83, 4))
        assert not cache.writer.pending, "no L3 write queued while the breaker is open"
        snapshot = cache.metrics.snapshot()
        assert snapshot["operations"].get("prefetches_started", 0) == started
        assert snapshot["failures"] > failures, "the refused write still counts as failed"
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)


def test_puts_failing_alone_open_the_write_breaker_and_reads_go_on() -> None:
    """A store whose puts raise while its existence queries and gets answer (a full or read-only
    medium raising, a transfer path down while the metadata service answers): with one breaker
    for both directions, each answered read reset the count and every write was staged,
    checksummed and tried (30 requests, 30 put calls, no trip)."""
    host = PluginHost()
    host.storage_backends.register(FaultyBackend)
    overrides = [
        "tiers.storage={broken: {type: faults, fail: raise, operations: [put]}}",
        "tiers.storage.broken.circuit_breaker={failures: 3, cooldown_s: 3600}",
        "policy.prefetch.threshold_tokens=64",
    ]
    with open_cache("kv", overrides=overrides, host=host) as cache:
        backend = cache.backend
        assert isinstance(backend, FaultyBackend) and cache.engine is not None
        for i in range(12):
            serve(cache, tokens(300 + i, 4))
            cache.flush()
        assert backend.calls["put"] == 3, "the write breaker opens after 3 failed puts in a row"
        assert cache.engine.write_breaker.state is BreakerState.OPEN
        assert cache.engine.read_breaker.state is BreakerState.CLOSED
        assert backend.calls["exists"] == 12, "reads still go to the store"
        assert cache.engine.metrics.breaker_trips == 1 and cache.engine.metrics.breaker_rejected == 9
        held = host_units_held_by_tree(cache)
        assert host_units_in_use(cache) == held, "a refused write leaked a host slot"


class NoneForAMiss(MemoryBackend):
    """A backend answering ``None`` (not a negative number) for a key it does not hold."""

    def get(self, objects: Sequence[StorageObject]) -> list[int]:  # type: ignore[override]
        return [None if code < 0 else code for code in super().get(objects)]  # type: ignore[misc]


def test_a_get_answer_that_is_not_a_byte_count_fails_the_call_not_the_caller() -> None:
    """StorageEngine promises that a backend's failure -- a raise, or an answer it cannot use --
    fails that operation, never propagates (storage_engine.py docstring; backend_calls.py: 'a
    raise or a wrong-length answer fails the whole call'). An answer of the right length holding
    ``None`` passes the length check and then raises TypeError out of ``engine.get`` (from
    ``np.fromiter`` in verify_batch), uncounted, and not seen by the circuit breaker."""
    backend = NoneForAMiss("l3", MemoryConfig())
    specs = conformance_specs()
    engine = KIT.engine(backend, specs, model_name="audit-none")
    target = KIT.pools(specs, 2, seed=None)
    result = engine.get("attn", page_hashes(2), target["attn"].units(range(2)))  # raises TypeError
    assert result.ok == [False, False] and result.failed == 2
    assert engine.metrics.backend_errors == 1


class Interrupted(MemoryBackend):
    """exists() fails, then is interrupted once (Ctrl-C, SystemExit), then answers."""

    mode = "fail"

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if self.mode == "fail":
            raise OSError("store unreachable")
        if self.mode == "interrupt":
            self.mode = "ok"
            raise KeyboardInterrupt
        return super().exists(keys)


def test_a_trial_call_interrupted_by_a_base_exception_does_not_leave_the_breaker_half_open() -> None:
    """After the cooldown one trial call goes through; if it ends by a BaseException
    (KeyboardInterrupt in a notebook's generate(), SystemExit) ``_call_backend`` records no
    outcome, so ``_trial`` stays True and the breaker refuses every call for the rest of the
    process -- L3 is gone for good although the backend answers again."""
    backend = Interrupted("l3", MemoryConfig(circuit_breaker={"failures": 1, "cooldown_s": 0.05}))
    engine = KIT.engine(backend, conformance_specs(), model_name="audit-breaker")
    hashes = page_hashes(1)
    assert engine.exists("attn", hashes).failed == 1  # opens the read breaker
    time.sleep(0.06)
    backend.mode = "interrupt"
    with pytest.raises(KeyboardInterrupt):
        engine.exists("attn", hashes)  # the trial call
    time.sleep(0.2)  # several cooldowns later, the backend answering again
    result = engine.exists("attn", hashes)
    assert engine.read_breaker.state is not BreakerState.HALF_OPEN, "stuck half-open: no trial ever again"
    assert result.failed == 0, result.error
