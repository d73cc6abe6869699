"""The library API at the engine boundary (issue 25): each test is one defect's case, named after
what went wrong, and fails on the code before the fix.

Two caches in one process, bad and wrong-typed token ids, a second thread, ``close`` with a
stuck backend or open leases, a float unit index, a closed lease's units, a boolean capacity.
The matrix over these cases (with the verdicts of the fault matrix) is
``tests/faults/test_fault_boundary.py``.
"""

from __future__ import annotations

import inspect
import math
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kvstrata
from controller_support import EXAMPLES, computed, open_cache, serve, tokens, verify
from kvstrata.core.controller import CacheController, Lease
from kvstrata.plugins import PluginHost
from kvstrata.testing.faults import FaultyBackend

PAGE = 64


def _pages_in_use(cache: CacheController) -> int:
    return cache.pools.pools[cache.layout.anchor].device_allocator.used


# --- 1. a cache accepts a lease another cache issued ------------------------------------------------

FOREIGN_CALLS: dict[str, Callable[[CacheController, Lease], Any]] = {
    "admit": lambda cache, lease: cache.admit(lease),
    "allocate": lambda cache, lease: cache.allocate(lease),
    "insert": lambda cache, lease: cache.insert(lease),
    "insert_keep_open": lambda cache, lease: cache.insert(lease, close=False),
    "release": lambda cache, lease: cache.release(lease),
    "fork_state": lambda cache, lease: cache.fork_state(lease),
    "unpin": lambda cache, lease: cache.unpin(lease),
}


@pytest.mark.parametrize("call", sorted(FOREIGN_CALLS))
def test_a_cache_refuses_a_lease_another_cache_issued(call: str) -> None:
    request = tokens(1, 4)
    with open_cache("kv") as target, open_cache("kv") as draft:
        lease = computed(target, request)
        with pytest.raises(ValueError, match="issued by another cache"):
            FOREIGN_CALLS[call](draft, lease)
        assert draft.tree.match(list(lease.keys)).device_pages == 0, "the draft indexed nothing"
        assert _pages_in_use(draft) == 0
        target.insert(lease)  # the issuer still takes it
        again = draft.lookup(request)
        draft.admit(again)
        assert again.cached_pages == 0 and verify(draft, again) == 0
        draft.release(again)
        served, bad = serve(target, request)
        assert served.cached_pages == 4 and bad == 0


def test_a_cache_refuses_something_that_is_not_a_lease() -> None:
    with open_cache("kv") as cache, pytest.raises(TypeError, match=r"expected a Lease.*got dict"):
        cache.insert({"keys": []})  # type: ignore[arg-type]


def test_a_copy_of_a_lease_is_refused_so_its_units_are_never_inserted_twice() -> None:
    """``copy.copy(lease)`` made a second lease sharing the first's pending units: inserting both
    (or one, then releasing the other) left device units neither the tree nor a lease held. A
    lease now refuses to be copied (and, as before, to be deep-copied or pickled)."""
    import copy
    import pickle

    with open_cache("kv") as cache:
        lease = computed(cache, tokens(2, 3))
        for duplicate in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="Lease cannot be copied or pickled"):
                duplicate(lease)
        cache.insert(lease)
        assert _pages_in_use(cache) == cache.tree.units(cache.layout.anchor, "device") == 3
        served, bad = serve(cache, tokens(2, 3))
        assert served.cached_pages == 3 and bad == 0


# --- 4. lookup raised after locking on a bad token id ----------------------------------------------


@pytest.mark.parametrize("with_l3", [True, False], ids=["l3", "no_l3"])
@pytest.mark.parametrize("bad", [2**33, -1], ids=["2**33", "negative"])
def test_a_bad_token_id_is_refused_before_anything_is_locked(bad: int, with_l3: bool, tmp_path: Path) -> None:
    """Three bad requests behind a cached prefix left phantom leases: every later request of a
    few pages failed with CacheFullError and add_pool was refused (with L3); without L3 the id
    was accepted. One rule either way, nothing held after the refusal."""
    with open_cache(
        "kv", tmp_path / "l3" if with_l3 else None, ["tiers.device.capacity_tokens=512"]
    ) as cache:
        prefix = tokens(2, 3)
        serve(cache, prefix)
        request = torch.cat([prefix, torch.full((PAGE,), bad, dtype=torch.int64)])
        refusals = []
        for _ in range(3):
            with pytest.raises(ValueError, match=r"token ids must lie in \[0, 2\*\*32\)") as refused:
                cache.lookup(request)
            refusals.append(str(refused.value))
        whole = cache.lookup(tokens(3, 8))  # the whole device tier: nothing is locked
        cache.admit(whole)
        cache.allocate(whole)
        cache.release(whole)
        cache.add_pool(
            "draft", {"type": "draft", "layers": 1, "kv_heads": 1, "head_dim": 8, "index_source": "kv"}
        )
        assert refusals == [f"tokens: token ids must lie in [0, 2**32), got {bad}"] * 3
        meta = torch.empty(PAGE, dtype=torch.int64, device="meta")  # a shape without values
        with pytest.raises(ValueError, match="tokens: a tensor on the meta device holds no token ids"):
            cache.lookup(meta)


# --- 5. unlocked concurrent use ------------------------------------------------------------------


def test_a_call_from_a_second_thread_while_one_is_inside_is_refused() -> None:
    with open_cache("kv") as cache:
        inside, go_on = threading.Event(), threading.Event()
        on_lookup = cache.writer.on_lookup

        def slow_on_lookup(*args: Any) -> None:
            inside.set()
            assert go_on.wait(30)
            on_lookup(*args)

        cache.writer.on_lookup = slow_on_lookup  # type: ignore[method-assign]
        done: list[Lease] = []
        first = threading.Thread(target=lambda: done.append(cache.lookup(tokens(4, 2))), name="scheduler")
        first.start()
        assert inside.wait(30)
        try:
            with pytest.raises(
                kvstrata.ConcurrentUseError, match=r"another thread is inside cache\.lookup\(\)"
            ):
                cache.lookup(tokens(5, 2))
            with pytest.raises(kvstrata.ConcurrentUseError, match="one thread at a time"):
                cache.flush()
        finally:
            go_on.set()
            first.join(30)
        cache.writer.on_lookup = on_lookup  # type: ignore[method-assign]
        (lease,) = done
        cache.release(lease)  # calls one after another from another thread are fine
        assert not cache._leases


# --- 6. close() had no deadline ------------------------------------------------------------------


def test_close_returns_by_its_timeout_with_a_stuck_put() -> None:
    host = PluginHost()
    host.storage_backends.register(FaultyBackend)
    stuck = ["tiers.storage.l3.type=faults", "tiers.storage.l3.operations=[]", "tiers.storage.l3.stall=[put]"]
    cache = open_cache("kv", host=host, overrides=stuck)
    backend = cache.parts.backend
    try:
        for seed in range(3):
            serve(cache, tokens(10 + seed, 2))  # three L3 writes: one stuck in put, two queued
        closing = threading.Thread(target=cache.close, kwargs={"timeout": 0.2})
        closing.start()
        closing.join(30)
        assert not closing.is_alive(), "close(timeout=0.2) waited on the stuck put"
        assert cache.metrics.snapshot()["operations"]["storage_writes_abandoned"] == 3
        assert not backend.closed.is_set(), "the backend is not closed under a running put"
    finally:
        backend.unstall()
    assert backend.closed.wait(30), "closed once the put returned"
    assert backend.calls["put"] == 1, "the queued writes were cancelled, not run"


def test_close_waits_a_bounded_time_by_default() -> None:
    default = inspect.signature(CacheController.close).parameters["timeout"].default
    assert isinstance(default, float) and math.isfinite(default) and default > 0


# --- 8. close() with open leases said nothing ---------------------------------------------------


def test_close_with_open_leases_warns_once_with_count_and_origin() -> None:
    cache = open_cache("kv")
    line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
    forgotten = cache.lookup(tokens(20, 2))
    cache.lookup(tokens(21, 3))
    with pytest.warns(kvstrata.OpenLeasesWarning) as caught:
        cache.close()
    (warning,) = caught
    text = str(warning.message)
    assert "2 open lease(s)" in text and f"{Path(__file__).name}:{line}" in text, text
    assert "test_close_with_open_leases_warns_once_with_count_and_origin" in text
    assert forgotten.pages == 2 and "for 2 page(s)" in text


# --- 9. wrong-typed tokens were coerced silently --------------------------------------------------

WRONG_TOKENS: dict[str, tuple[Any, type[Exception], str]] = {
    "batch_2d": (torch.arange(2 * PAGE).view(2, PAGE), ValueError, r"one sequence .*shape \(2, 64\)"),
    "float_tensor": (torch.arange(PAGE) + 0.5, TypeError, "must be integers, got a tensor of torch.float32"),
    "float_list": ([0.5] * PAGE, TypeError, "must be integers, got a list of torch.float32"),
    "bool_tensor": (
        torch.ones(PAGE, dtype=torch.bool),
        TypeError,
        "must be integers, got a tensor of torch.bool",
    ),
    "bool_list": ([True] * 3, TypeError, "must be integers, got a list of torch.bool"),
    "nested_list": ([[1, 2], [3, 4]], ValueError, r"one sequence .*shape \(2, 2\)"),
    "ragged_list": ([[1, 2], [3]], ValueError, "expected a 1-D sequence of integer token ids"),
    "float_array": (np.zeros(PAGE, dtype=np.float64), TypeError, "must be integers, got a float64 array"),
    "string": ("hello", TypeError, "got str"),
    "scalar": (torch.tensor(7), ValueError, r"shape \(\)"),
}


@pytest.mark.parametrize("case", sorted(WRONG_TOKENS))
def test_wrong_typed_tokens_are_refused_naming_the_argument(case: str) -> None:
    given, error, message = WRONG_TOKENS[case]
    with open_cache("kv") as cache:
        with pytest.raises(error, match=f"^tokens: .*{message}"):
            cache.lookup(given)
        lease = cache.lookup(tokens(30, 1))
        with pytest.raises(error, match=f"^tokens: .*{message}"):
            lease.extend(given)
        assert lease.pages == 1 and len(lease.tokens) == PAGE, "the refused extend changed nothing"
        cache.release(lease)
        assert not cache._leases


def test_right_typed_tokens_of_every_kind_are_taken() -> None:
    ids = list(range(100, 100 + PAGE))
    kinds = [
        ids,
        tuple(ids),
        torch.tensor(ids, dtype=torch.int32),
        np.array(ids, dtype=np.uint32),
        range(100, 164),
    ]
    with open_cache("kv") as cache:
        for given in kinds:
            lease = cache.lookup(given)
            assert lease.tokens.tolist() == ids
            assert lease.extend([1, 2]) == 0 and lease.extend(np.array([3], dtype=np.int64)) == 0
            cache.release(lease)


# --- 10. a float unit index; a released lease's prefix -------------------------------------------


def test_write_units_refuses_a_float_unit_index() -> None:
    with open_cache("kv") as cache:
        lease = cache.lookup(tokens(40, 2))
        units = cache.allocate(lease)["kv"]
        spec = cache.pools.pool("kv").spec
        before = cache.read_units("kv", units)
        one = {b: torch.ones_like(t[:1]) for b, t in before.items()}
        for index in (0.5, [float(units[0])], torch.tensor([0.0]), True):
            with pytest.raises(TypeError, match=r"unit indices must be integers|expected unit indices"):
                cache.write_units("kv", index, one)  # type: ignore[arg-type]
        after = cache.read_units("kv", units)
        assert all(torch.equal(after[b].view(torch.uint8), before[b].view(torch.uint8)) for b in before)
        cache.write_units("kv", int(units[0]), one)  # an int is a unit index
        assert spec.name == "kv"
        cache.release(lease)


def test_prefix_units_after_release_raises() -> None:
    with open_cache("kv") as cache:
        serve(cache, tokens(41, 2))
        lease = cache.lookup(tokens(41, 2))
        cache.admit(lease)
        assert len(lease.prefix_units("kv")) == 2
        cache.release(lease)
        with pytest.raises(RuntimeError, match="lease is closed"):
            lease.prefix_units("kv")
        with pytest.raises(RuntimeError, match="lease is closed"):
            lease.prefix_first_page("kv")


# --- 11. capacity_tokens: true was 1 token; rounding said nothing -------------------------------


@pytest.mark.parametrize(
    "field",
    [
        "tiers.device.capacity_tokens",
        "tiers.host.capacity_tokens",
        "model.page_size",
        # plugins' and policies' sections too (a one-layer pool from `layers: true`)
        "model.pools.kv.layers",
        "model.pools.kv.host_units",
        "tiers.storage.l3.capacity_bytes",
        "policy.retention.max_pinned_fraction",
    ],
)
def test_capacity_tokens_true_is_refused(field: str) -> None:
    with pytest.raises(kvstrata.ConfigError, match=re.escape(field) + ": .*expected a number, got true"):
        kvstrata.load(EXAMPLES["kv"], overrides={field: True}, environ={})


def test_config_show_reports_capacity_rounding(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstrata.cli import main

    argv = ["kvstrata", "config", "show", str(EXAMPLES["kv"]), "--set", "tiers.device.capacity_tokens=1000"]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit) as ended:
        main()
    out, err = capsys.readouterr()
    assert ended.value.code in (0, None) and "capacity_tokens: 1000" in out
    assert (
        "note: tiers.device.capacity_tokens 1,000 is rounded up to whole pages: 16 pages of 64 = 1,024" in err
    )
    assert "tiers.host" not in err, "a whole number of pages says nothing"


def test_allocate_takes_an_integer_end_page_as_an_int_and_refuses_any_other() -> None:
    """``end_page`` read from a tensor (``torch.tensor(3)``) is taken as the int it holds: kept
    as given, a tensor became the lease's ``allocated_pages`` and the allocator's counts. A
    float is refused by name, with nothing allocated."""
    cache = open_cache("kv")
    lease = cache.lookup(tokens(1, 3))
    cache.admit(lease)
    with pytest.raises(TypeError, match="end_page must be an integer"):
        cache.allocate(lease, end_page=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="end_page must be an integer"):
        cache.allocate(lease, end_page=True)  # (taken as 1 page)
    assert lease.allocated_pages == 0
    cache.allocate(lease, end_page=torch.tensor(2))  # type: ignore[arg-type]
    cache.allocate(lease, end_page=np.int64(3))  # type: ignore[arg-type]
    used = cache.pools.pools["kv"].device_allocator.used
    assert type(lease.allocated_pages) is int and lease.allocated_pages == 3
    assert type(used) is int and used == 3
    cache.release(lease)
    cache.close()


def test_allocated_first_page_before_any_allocate_is_a_clear_error() -> None:
    """It raised a bare ``KeyError: 'kv'``."""
    with open_cache("kv", overrides=["tiers.storage={}"]) as cache:
        lease = cache.lookup(tokens(1, 2))
        cache.admit(lease)
        with pytest.raises(
            RuntimeError, match=r"no allocate has handed pool 'kv' units yet: call cache.allocate"
        ):
            lease.allocated_first_page("kv")
        cache.release(lease)


@pytest.mark.parametrize("end_page", [1.5, 4, -1])
def test_a_refused_end_page_does_not_admit_the_lease(end_page: object) -> None:
    """``allocate`` admits a lease that was not admitted; it did so before checking ``end_page``,
    so a refused call had already ended the L3 prefetch (what had not arrived was lost) and
    settled the lease."""
    cache = open_cache("kv")
    lease = cache.lookup(tokens(1, 3))
    with pytest.raises((TypeError, ValueError), match="end_page"):
        cache.allocate(lease, end_page=end_page)  # type: ignore[arg-type]
    assert not lease.admitted and lease.allocated_pages == 0
    assert cache.pools.pools["kv"].device_allocator.used == 0
    cache.admit(lease)
    cache.release(lease)
    cache.close()


def test_unit_indices_or_payloads_on_the_meta_device_are_refused_by_name() -> None:
    """A meta tensor (a shape, no values: an engine traced on the meta device) as ``units`` failed
    deep inside with "Tensor.item() cannot be called on meta tensors", and as a payload with
    "Cannot copy out of meta tensor", naming neither the argument nor the buffer."""
    cache = open_cache("kv")
    meta = torch.zeros(2, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="units: a tensor on the meta device holds no unit indices"):
        cache.read_units("kv", meta)
    payload = cache.read_units("kv", [0, 1])
    with pytest.raises(ValueError, match="units: a tensor on the meta device"):
        cache.write_units("kv", meta, payload)
    with pytest.raises(ValueError, match="buffer 'k': a meta tensor holds no values"):
        cache.write_units("kv", [0, 1], {"k": payload["k"].to("meta")})
    assert all(torch.equal(cache.read_units("kv", [0, 1])[b], payload[b]) for b in payload)
    cache.close()
