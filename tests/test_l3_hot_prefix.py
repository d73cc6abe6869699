"""A prefix a cache keeps serving from its own tiers stays in a bounded L3 shared with others
(``core/l3_touch.py``): the file backend's ``capacity_bytes`` evicts least recently used objects
first, and a prefix hit on the device or host was never read or written in L3 again -- so it was
the first thing evicted, and every page keyed under it was unreachable to a fresh process."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from controller_support import open_cache, serve, tokens, verify
from kvstrata.core.l3_touch import HitTouch

SYSTEM_PAGES = 2


def _objects(l3: Path) -> list[Path]:
    """The page objects under a file L3 (not its removals log)."""
    return [f for f in l3.rglob("*.kv") if f.is_file()]


def _object_bytes(tmp: Path) -> int:
    """One page object of the ``kv`` stack, as the file backend stores it."""
    with open_cache("kv", tmp / "probe") as cache:
        serve(cache, tokens(99, 1))
        cache.flush()
    (size,) = {f.stat().st_size for f in _objects(tmp / "probe")}
    return size


def _chats(count: int) -> list[torch.Tensor]:
    """Requests sharing a system prompt of two pages, two pages each of their own."""
    system = tokens(1, SYSTEM_PAGES)
    return [torch.cat([system, tokens(10 + i, 2)]) for i in range(count)]


def test_a_prefix_served_from_the_device_outlives_colder_pages_in_a_bounded_l3(tmp_path: Path) -> None:
    """Six chats through one cache (the system prompt hit on its device after the first), an L3
    of ten objects: the four evicted are the oldest chats' own pages, not the system prompt, and
    a fresh cache restores the last chat whole, bit-exact. Before, it restored nothing."""
    l3 = tmp_path / "l3"
    bound = [f"tiers.storage.l3.capacity_bytes={10 * _object_bytes(tmp_path)}"]
    chats = _chats(6)
    with open_cache("kv", l3, overrides=bound) as cache:
        for n, chat in enumerate(chats):
            lease, bad = serve(cache, chat)
            assert bad == 0 and lease.hit_pages["device"] == (SYSTEM_PAGES if n else 0)
            cache.flush()
        assert cache.metrics.snapshot()["storage"]["put_units"] == 4 + 5 * 2
    assert len(_objects(l3)) == 10
    with open_cache("kv", l3, overrides=bound) as fresh:
        lease = fresh.lookup(chats[-1], prefetch="wait")
        fresh.admit(lease)
        assert lease.cached_pages == 4 and lease.hit_pages["storage"] == 4
        assert verify(fresh, lease) == 0
        fresh.release(lease)
        first = fresh.lookup(chats[0], prefetch="wait")  # its own pages were the coldest
        fresh.admit(first)
        assert first.cached_pages == SYSTEM_PAGES
        fresh.release(first)


def test_only_a_requests_own_lookup_asks_l3_for_its_hit(tmp_path: Path) -> None:
    """The ask costs an existence query on the writer thread per lookup that hits: none for a
    miss, none for a later chunk's lookup (``record=False``: its hits are its own pages)."""
    chat, other = _chats(2)
    with open_cache("kv", tmp_path / "l3") as cache:
        serve(cache, chat)
        cache.flush()

        def asked(request: torch.Tensor, record: bool) -> int:
            before = cache.metrics.snapshot()["storage"]["exists_calls"]
            lease = cache.lookup(request, record=record, prefetch="off")
            cache.flush()  # (waits for the ask too)
            cache.release(lease)
            return cache.metrics.snapshot()["storage"]["exists_calls"] - before

        assert asked(tokens(50, 3), record=True) == 0, "a miss"
        assert asked(chat, record=False) == 0, "a later chunk"
        assert asked(chat, record=True) == 1
        assert asked(other[: SYSTEM_PAGES * 64], record=True) == 1, "the shared prompt"


def test_a_hit_prefix_another_process_evicted_is_stored_again(tmp_path: Path) -> None:
    """Another process sharing the L3 evicted the system prompt (its LRU never saw it used)
    while this cache kept serving it from its device: the next lookup that hits it finds it
    gone -- an earlier one found it there -- and stores it again from the host copies, so a
    fresh cache restores a chat whole."""
    l3 = tmp_path / "l3"
    chat, again, other = _chats(3)
    with open_cache("kv", l3) as cache:
        first, _ = serve(cache, chat)
        cache.flush()
        serve(cache, again)  # a hit: L3 answers it holds the prompt
        cache.flush()
        system = first.page_hashes[:SYSTEM_PAGES]
        with open_cache("kv", l3) as elsewhere:  # its capacity eviction, as the store sees it
            assert elsewhere.engine.discard("kv", system).ok == [True] * SYSTEM_PAGES
        puts = cache.metrics.snapshot()["storage"]["put_units"]
        lease, bad = serve(cache, other)
        assert bad == 0 and lease.hit_pages["device"] == SYSTEM_PAGES
        cache.flush()
        assert cache.metrics.snapshot()["storage"]["put_units"] - puts == 2 + SYSTEM_PAGES
    with open_cache("kv", l3) as fresh:
        lease = fresh.lookup(chat, prefetch="wait")
        fresh.admit(lease)
        assert lease.cached_pages == 4 and lease.hit_pages["storage"] == 4
        assert verify(fresh, lease) == 0
        fresh.release(lease)


def _objects_by_pool(tmp: Path, stack: str) -> dict[str, int]:
    """One object per pool suffix of ``stack``, as the file backend stores it."""
    with open_cache(stack, tmp / f"probe-{stack}") as cache:
        serve(cache, tokens(99, 1))
        cache.flush()
    return {
        f.suffix: f.stat().st_size for f in (tmp / f"probe-{stack}").rglob("*") if f.is_file() and f.suffix
    }


def _run(
    stack: str, l3: Path, bound: list[str], warm_system: bool
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Cache A: six chats sharing a two-page system prompt, each with two pages of its own; the
    prompt is hit on A's device from the second request on."""
    system = tokens(1, SYSTEM_PAGES)
    chats = [torch.cat([system, tokens(10 + i, 2)]) for i in range(6)]
    with open_cache(stack, l3, overrides=bound) as cache:
        if warm_system:  # the prompt as a request of its own: a checkpoint (state) at its end
            serve(cache, system)
            cache.flush()
        for n, chat in enumerate(chats):
            lease, bad = serve(cache, chat)
            assert bad == 0 and lease.hit_pages["device"] == (SYSTEM_PAGES if n or warm_system else 0)
            cache.flush()
    return chats, system


def _fresh_hit(stack: str, l3: Path, bound: list[str], request: torch.Tensor) -> tuple[int, int]:
    with open_cache(stack, l3, overrides=bound) as fresh:
        lease = fresh.lookup(request, prefetch="wait")
        fresh.admit(lease)
        got = (lease.hit_pages["storage"], verify(fresh, lease))
        fresh.release(lease)
    return got


CASES = [
    # stack, capacity in objects of the (equal-sized) pools, warm the prompt alone first
    pytest.param("swa", lambda s: 12 * s[".kv"], False, id="swa-window"),
    pytest.param("hybrid-mamba", lambda s: 4 * (2 * s[".kv"] + s[".mamba"]), True, id="mamba-state"),
]


@pytest.mark.parametrize(("stack", "capacity", "warm"), CASES)
def test_a_new_request_on_a_hot_system_prompt_is_served_from_a_bounded_shared_l3(
    tmp_path: Path, stack: str, capacity: Callable[[dict[str, int]], int], warm: bool
) -> None:
    """Cache A serves six chats on one system prompt (hit on A's device each time); a fresh
    cache B sharing the bounded L3 then gets a new question on that prompt: it restores the
    prompt's two pages, as with an unbounded L3. It restored nothing while only the pages were
    asked for: the prompt's window / state objects, the oldest in the LRU though the prompt is
    the hottest prefix, were evicted first."""
    bound = [f"tiers.storage.l3.capacity_bytes={capacity(_objects_by_pool(tmp_path, stack))}"]
    new_question = torch.cat([tokens(1, SYSTEM_PAGES), tokens(77, 2)])

    unbounded = tmp_path / "unbounded"
    _run(stack, unbounded, [], warm)
    assert _fresh_hit(stack, unbounded, [], new_question) == (SYSTEM_PAGES, 0)  # the reference

    l3 = tmp_path / "l3"
    chats, _ = _run(stack, l3, bound, warm)
    assert _fresh_hit(stack, l3, bound, chats[-1]) == (4, 0)  # the last chat: whole (it is recent)
    assert _fresh_hit(stack, l3, bound, new_question) == (SYSTEM_PAGES, 0), (
        "the hot system prompt's window/state objects were LRU-evicted from the bounded L3"
    )


def _prompt_window_evicted_elsewhere(l3: Path, before: int) -> None:
    """``before`` chats share a system prompt on the swa stack (the second branches at the
    prompt's end: its window is stored); then another process evicts the prompt's window objects
    and two more chats hit the prompt on the device. A fresh cache must get the prompt whole."""
    system = tokens(1, SYSTEM_PAGES)
    chats = [torch.cat([system, tokens(10 + i, 2)]) for i in range(before + 2)]
    with open_cache("swa", l3) as cache:
        for chat in chats[:before]:
            first, _ = serve(cache, chat)
            cache.flush()
        prompt = first.page_hashes[:SYSTEM_PAGES]
        with open_cache("swa", l3) as elsewhere:  # its capacity eviction, as the store sees it
            assert elsewhere.engine.discard("swa", prompt).ok == [True] * SYSTEM_PAGES
        for chat in chats[before:]:
            lease, bad = serve(cache, chat)
            assert bad == 0 and lease.hit_pages["device"] == SYSTEM_PAGES
            cache.flush()
    new_question = torch.cat([system, tokens(77, 2)])
    assert _fresh_hit("swa", l3, [], new_question) == (SYSTEM_PAGES, 0)


def test_a_hit_prompts_window_another_process_evicted_is_stored_again(tmp_path: Path) -> None:
    """As the test above, for a window pool: another process sharing the L3 evicted the system
    prompt's window objects while this cache kept serving the prompt from its device. The next
    lookup that hits it notices and writes the window again (no longer counted stored), so a
    fresh cache gets the prompt for a new question."""
    _prompt_window_evicted_elsewhere(tmp_path / "l3", before=3)  # (the third hears L3 holds it)


def test_a_late_answer_never_writes_again_what_admission_let_through_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reuse the storage filter refuses is asked about (it is a hit) and found missing -- it
    never went to L3 -- and the next reuse admits it and queues its write. An answer read after
    that must not write it a second time: refused nodes are not asked about at all. (Under load
    the answer came late and the pages were admitted and written twice.)"""
    gate = threading.Event()
    real = HitTouch._present

    def late(self: HitTouch, ask: Any) -> Any:  # the writer thread answers only once let go
        gate.wait(10)
        return real(self, ask)

    monkeypatch.setattr(HitTouch, "_present", late)
    hot, cold = tokens(4, 2), tokens(5, 2)
    with open_cache("kv", tmp_path, ["policy.admission.storage={type: tinylfu, min_count: 3}"]) as cache:
        serve(cache, cold)  # seen once: refused
        for _ in range(3):
            serve(cache, hot)  # insert, a refused reuse, an admitted one
        gate.set()
        cache.flush()
        counted = cache.metrics.snapshot()
        assert counted["operations"]["storage_admitted"] == 2
        assert counted["storage"]["put_units"] == 2


def test_a_write_l3_refused_is_not_retried_at_every_hit(tmp_path: Path) -> None:
    """Only what L3 was once found to hold is written again when lost: pages whose write failed
    (a disk that refuses writes) are not retried at each hit -- a run's failure count would
    depend on when the answers came (the fault matrix replays a trace twice and compares)."""
    chat, again = _chats(2)
    with open_cache("kv", tmp_path / "l3") as cache:
        real_put = cache.engine.backend.put
        cache.engine.backend.put = lambda objects: [False] * len(objects)  # fault injection
        serve(cache, chat)
        cache.flush()
        failed = cache.metrics.snapshot()["storage"]["put_failed"]
        for _ in range(3):
            serve(cache, again)  # hits the prompt; only its own pages are written (and fail)
            cache.flush()
        assert cache.metrics.snapshot()["storage"]["put_failed"] - failed == 2
        cache.engine.backend.put = real_put


def test_a_base_exception_from_an_asks_backend_fails_that_ask_not_the_next_call(tmp_path: Path) -> None:
    """A plugin's ``exists`` raising a BaseException subclass (an async client's
    ``asyncio.CancelledError`` once its loop went away) on the writer thread, while a hit's ask
    ran: the next call of the cache (the insert of the request that hit) re-raised it."""
    chat, again, other = _chats(3)
    with open_cache("kv", tmp_path / "l3", ["policy.prefetch.threshold_tokens=1000000"]) as cache:
        serve(cache, chat)
        cache.flush()

        def cancelled(keys: object, **options: object) -> list[bool]:
            raise asyncio.CancelledError("event loop closed")

        real = cache.engine.backend.exists
        cache.engine.backend.exists = cancelled  # type: ignore[method-assign]
        try:
            serve(cache, again)  # its ask runs (and raises) at the insert's drain
            cache.flush()
            lease, bad = serve(cache, other)
            assert bad == 0 and lease.hit_pages["device"] == SYSTEM_PAGES
        finally:
            cache.engine.backend.exists = real  # type: ignore[method-assign]
        cache.flush()


def test_a_hit_prefix_lost_after_a_split_of_its_confirmed_node_is_stored_again(tmp_path: Path) -> None:
    """The first chat's node (prompt and its own pages, one node) was found whole in L3; another
    process then evicted the prompt's pages, and the next chat on the prompt split the node: the
    new upper half (the prompt) was never found whole itself, so its loss was never repaired --
    each later hit rewrote only the lower half, below a prompt L3 no longer held. Confirmation
    follows a split: a fresh cache gets the prompt."""
    l3 = tmp_path / "l3"
    chat, again, other = _chats(3)
    with open_cache("kv", l3) as cache:
        first, _ = serve(cache, chat)
        cache.flush()
        serve(cache, chat)  # a whole hit: L3 answers it holds the node
        cache.flush()
        prompt = first.page_hashes[:SYSTEM_PAGES]
        with open_cache("kv", l3) as elsewhere:  # its capacity eviction, as the store sees it
            assert elsewhere.engine.discard("kv", prompt).ok == [True] * SYSTEM_PAGES
        for request in (again, other):  # the first splits the node at the prompt's end
            lease, bad = serve(cache, request)
            assert bad == 0 and lease.hit_pages["device"] == SYSTEM_PAGES
            cache.flush()
    assert _fresh_hit("kv", l3, [], torch.cat([tokens(1, SYSTEM_PAGES), tokens(77, 2)])) == (SYSTEM_PAGES, 0)


DRAFT = {"type": "draft", "index_source": "kv", "layers": 1, "kv_heads": 1, "head_dim": 64}


def test_a_sidecar_added_at_runtime_is_asked_for_and_stored_again(tmp_path: Path) -> None:
    """A draft pool added with ``add_pool`` after start: the pools asked were read once at
    start, so the draft's objects of a hot prompt were never asked for (the first an LRU-bounded
    L3 evicts) nor stored again once another process's eviction took them, and a fresh cache with
    the draft pool restored nothing of the prompt."""
    l3, draft = tmp_path / "l3", ["model.pools.draft=" + json.dumps(DRAFT)]
    chats = _chats(4)
    with open_cache("kv", l3) as cache:
        cache.add_pool("draft", DRAFT)
        first, _ = serve(cache, chats[0])
        cache.flush()
        serve(cache, chats[1])  # a hit: L3 answers it holds the prompt
        cache.flush()
        prompt = first.page_hashes[:SYSTEM_PAGES]
        with open_cache("kv", l3, draft) as elsewhere:  # its capacity eviction of the draft's
            assert elsewhere.engine.discard("draft", prompt).ok == [True] * SYSTEM_PAGES
        for chat in chats[2:]:
            lease, bad = serve(cache, chat)
            assert bad == 0 and lease.hit_pages["device"] == SYSTEM_PAGES
            cache.flush()
    new_question = torch.cat([tokens(1, SYSTEM_PAGES), tokens(77, 2)])
    assert _fresh_hit("kv", l3, draft, new_question) == (SYSTEM_PAGES, 0)


def test_an_l3_that_hangs_does_not_queue_an_ask_per_hit(tmp_path: Path) -> None:
    """While the writer thread hangs in the backend (an NFS mount gone away), every lookup
    that hit queued one more ask -- the prefix's page hashes and its nodes, kept alive -- without
    bound, and the writer thread ran each of them, stale, once L3 answered again, ahead of every
    write queued after them. Asks wait in a bounded number; a hit past it is not asked about."""
    gate = threading.Event()
    chat = _chats(1)[0]
    with open_cache("kv", tmp_path / "l3", ["policy.prefetch.threshold_tokens=1000000"]) as cache:
        serve(cache, chat)
        cache.flush()
        real = cache.engine.backend.exists

        def hangs(keys: Any, **options: Any) -> Any:
            gate.wait(30)
            return real(keys, **options)

        cache.engine.backend.exists = hangs  # type: ignore[method-assign]
        before = cache.metrics.snapshot()["storage"]["exists_calls"]
        try:
            for _ in range(600):
                lease = cache.lookup(chat, prefetch="off")
                cache.admit(lease)
                cache.release(lease)
        finally:
            gate.set()
        cache.flush()
        asked = cache.metrics.snapshot()["storage"]["exists_calls"] - before
        assert asked <= 300, f"{asked} exists calls queued for one hot prefix"


def test_a_prompts_window_lost_before_any_hit_confirmed_it_is_stored_again(tmp_path: Path) -> None:
    """As above, but the window objects go before any lookup's ask found them: the second chat
    branched at the prompt's end and wrote its window (the write succeeded, so L3 held it), then
    another process evicted it. The third chat's ask finds it missing; the window is written
    again, so a fresh cache gets the prompt for a new question. Before, the end stayed counted
    as stored (never confirmed by an ask, so not rewritten), and no later branch wrote it."""
    _prompt_window_evicted_elsewhere(tmp_path / "l3", before=2)


def test_a_failed_ask_is_counted_as_a_failed_storage_call(tmp_path: Path) -> None:
    """``failures`` counts one per failed storage call: an ask's existence query that raised was
    counted by the engine (``backend_errors``) but never in the cache's ``failures``, unlike the
    same query from the prefetcher; an ask a plugin's BaseException ended neither."""
    chat, again, other = _chats(3)
    with open_cache("kv", tmp_path / "l3", ["policy.prefetch.threshold_tokens=1000000"]) as cache:
        serve(cache, chat)
        cache.flush()
        real = cache.engine.backend.exists
        raised: list[BaseException] = [RuntimeError("L3 gone"), asyncio.CancelledError("loop closed")]

        def fails(keys: object, **options: object) -> list[bool]:
            raise raised.pop(0)

        cache.engine.backend.exists = fails  # type: ignore[method-assign]
        try:
            for request in (again, other):  # each hits the system prompt: one ask each
                before = cache.metrics.snapshot()
                serve(cache, request)
                cache.flush()
                after = cache.metrics.snapshot()
                assert after["failures"] - before["failures"] == 1, request
        finally:
            cache.engine.backend.exists = real  # type: ignore[method-assign]
        assert cache.metrics.snapshot()["storage"]["backend_errors"] == 1  # (the BaseException is not one)
