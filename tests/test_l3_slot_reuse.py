"""Issue 29: a queued L3 write must keep every host unit it reads until it is written.

Chunked prefill commits a request page by page, and each commit queues an L3 write of the new
node's host copy. The writes of one request share one host path lock that moves down with the
request; that lock covers the path's pages but only the state (Mamba) slot of the node it sits
on and that node's last window. Before the fix, a moved lock left the older writes' state and
window units unlocked, host eviction freed them while the writer thread had not read them yet,
the next backup reused the slot, and L3 stored another page's state under this page's key.

The tests drive the public lease calls with content derived from each page's hash
(``controller_support``) and check every restored unit in a fresh cache, not checksums (the
checksums of the wrong bytes verify). The writer thread is held or jittered through its one
seam, ``engine.put_group`` (timing injection only; the file backend stores real objects).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from controller_support import EXAMPLES, fill, open_cache, tokens, verify
from kvstrata.core.config import load
from kvstrata.core.controller import CacheController
from kvstrata.core.lease import CacheFullError
from kvstrata.plugins import PluginHost
from kvstrata.replay.driver import replay_with_cache
from kvstrata.replay.trace import read_trace

PAGE = 64
#: small tiers: the host tier holds 8 state slots and 10 window units, so a writer two or three
#: commits behind is enough to reuse a queued slot
SMALL = {
    "hybrid-mamba": [
        "model.pools.mamba.device_units=4",
        "model.pools.mamba.host_units=8",
        "policy.backup_wait_s=0.02",  # a backup blocked by the held write gives up soon
    ],
    "swa-mamba": [
        "policy.backup_wait_s=0.02",
        "model.pools.mamba.device_units=4",
        "model.pools.mamba.host_units=8",
        "model.pools.swa.device_units=8",
        "model.pools.swa.host_units=10",
        "tiers.host.layout=page_first",
    ],
}
#: a reader big enough to hold every restore at once
READER = [
    "tiers.device.capacity_tokens=4096",
    "tiers.host.capacity_tokens=4096",
    "model.pools.mamba.device_units=64",
    "model.pools.mamba.host_units=64",
]


def _commit_page_by_page(
    cache: CacheController, request: torch.Tensor, after_page: Callable[[int], None]
) -> None:
    for k in range(1, len(request) // PAGE + 1):
        lease = cache.lookup(request[: k * PAGE], record=False, prefetch="off")
        cache.admit(lease)
        fill(cache, lease, cache.allocate(lease))
        cache.insert(lease)
        after_page(k)


def _commit_chunk_by_chunk(
    cache: CacheController, request: torch.Tensor, after_page: Callable[[int], None]
) -> None:
    """One lease kept open, a page per chunk: write-through backs it up in batches of
    ``policy.write_through_batch_pages``, each batch one L3 write of a chain of nodes."""
    pages = len(request) // PAGE
    lease = cache.lookup(request[:PAGE], record=False, prefetch="off")
    cache.admit(lease)
    for k in range(1, pages + 1):
        if k > 1:
            lease.extend(request[(k - 1) * PAGE : k * PAGE])
        fill(cache, lease, cache.allocate(lease))
        cache.insert(lease, close=k == pages)
        after_page(k)


def _restores(stack: str, l3: Path, request: torch.Tensor) -> list[tuple[int, int, int]]:
    """(length asked, pages restored, wrong units) for every prefix length, shortest first, in
    one fresh cache: each restore reads the next page and the state at its end from L3."""
    out = []
    fresh = open_cache(stack, l3, READER)
    try:
        for pages in range(1, len(request) // PAGE + 1):
            lease = fresh.lookup(request[: pages * PAGE], prefetch="wait")
            fresh.admit(lease)
            out.append((pages, lease.cached_pages, verify(fresh, lease)))
            fresh.release(lease)
    finally:
        fresh.close()
    return out


def _run(
    stack: str,
    l3: Path,
    *,
    seed: int,
    hold: tuple[int, int] | None,
    jitter_s: float,
    commit: Callable[[CacheController, torch.Tensor, Callable[[int], None]], None] = _commit_page_by_page,
    sets: tuple[str, ...] = (),
) -> list:
    """Commit prompt A page by page (14 pages) and two fillers, with the writer thread held
    from write ``hold[0]`` until page ``hold[1]`` of A is committed, and jittered; then restore."""
    cache = open_cache(stack, l3, [*SMALL[stack], *sets])
    rng = random.Random(seed)
    gate = threading.Event()
    calls = [0]
    put_group = cache.engine.put_group

    def timed_put_group(batches):  # the writer thread
        calls[0] += 1
        if hold is not None and calls[0] == hold[0]:
            gate.wait(10)
        elif jitter_s:
            time.sleep(rng.random() * jitter_s)
        return put_group(batches)

    cache.engine.put_group = timed_put_group
    prompt = tokens(1000 + seed, 14)

    def after(k: int) -> None:
        if hold is not None and k >= hold[1]:
            gate.set()

    try:
        commit(cache, prompt, after)
        gate.set()
        for filler in range(2):  # push A out of L1 and L2
            _commit_page_by_page(cache, tokens(2000 + 10 * seed + filler, 14), lambda k: None)
        cache.tree.check()
    finally:
        gate.set()
        cache.close()
    return _restores(stack, l3, prompt)


@pytest.mark.parametrize("stack", ["hybrid-mamba", "swa-mamba"])
def test_held_write_keeps_its_state_and_window_units(stack: str, tmp_path: Path) -> None:
    """The repro of issue 29 made deterministic: page 10's write waits until page 12 is in."""
    results = _run(stack, tmp_path / "l3", seed=0, hold=(10, 12), jitter_s=0.0)
    wrong = [(asked, got, bad) for asked, got, bad in results if bad]
    assert not wrong, f"restores with wrong units (asked, restored, wrong units): {wrong}"
    assert all(got <= asked for asked, got, _ in results)
    assert max(got for _, got, _ in results) >= 10  # the held page itself came back from L3


@pytest.mark.parametrize("hold", [None, (2, 12)], ids=["writer_keeps_up", "writer_held"])
@pytest.mark.parametrize("stack", ["hybrid-mamba", "swa-mamba"])
def test_batched_writes_of_an_open_lease_keep_every_node_units(
    stack: str, hold: tuple[int, int] | None, tmp_path: Path
) -> None:
    """A lease kept open writes batches of 3 one-page nodes: one path lock covers a batch's
    pages, each node keeps its own state slot and window, whether the last write was drained
    (a fresh lock) or is still queued (the lock moves down)."""
    results = _run(
        stack,
        tmp_path / "l3",
        seed=3,
        hold=hold,
        jitter_s=0.0,
        commit=_commit_chunk_by_chunk,
        sets=("policy.write_through_batch_pages=3",),
    )
    wrong = [(asked, got, bad) for asked, got, bad in results if bad]
    assert not wrong, f"restores with wrong units (asked, restored, wrong units): {wrong}"
    assert all(got <= asked for asked, got, _ in results)
    assert max(got for _, got, _ in results) >= 6  # the held write (pages 4-6) came back


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("stack", ["hybrid-mamba", "swa-mamba"])
def test_randomized_writer_timing(stack: str, seed: int, tmp_path: Path) -> None:
    """Randomized writer timing over many seeds: the writer thread is held from a random write
    for a random 1-4 commits (what a busy CPU does to it) and jittered 0-2 ms per write; every
    restored unit of every pool is the bytes committed for its page, at every prefix length."""
    rng = random.Random(seed)
    start = rng.randint(2, 11)
    hold = (start, min(14, start + rng.randint(1, 4)))
    results = _run(stack, tmp_path / "l3", seed=seed, hold=hold, jitter_s=0.002)
    wrong = [(asked, got, bad) for asked, got, bad in results if bad]
    assert not wrong, f"seed {seed}, hold {hold}: wrong units (asked, restored, wrong): {wrong}"
    assert all(got <= asked for asked, got, _ in results)


def test_write_back_eviction_backs_up_a_leaf(tmp_path: Path) -> None:
    """Write-back: a tier full of unbacked, unlocked pages must back up (and evict) a leaf.

    Before the fix the LRU stamp chose an inner node above an unbacked leaf; backing it up
    freed nothing and a 3-page request on a 16-page tier raised ``CacheFullError``."""
    cache = open_cache("hybrid-mamba", tmp_path / "l3", [*SMALL["hybrid-mamba"], "policy.write=write_back"])
    try:
        first = tokens(3, 14)
        _commit_page_by_page(cache, first, lambda k: None)
        second = tokens(4, 14)
        _commit_page_by_page(cache, second, lambda k: None)  # needs A's pages evicted
        assert cache.metrics.snapshot()["operations"]["backups"] > 0
        lease = cache.lookup(first, record=False, prefetch="wait")
        cache.admit(lease)
        assert verify(cache, lease) == 0
        cache.release(lease)
        cache.tree.check()
    finally:
        cache.close()


# --- debug.unit_digests: the bytes followed from commit to restore ------------------------------

DIGESTS = ["debug.unit_digests=true"]


def test_unit_digests_pass_a_clean_run_and_check_every_stage(tmp_path: Path) -> None:
    """With the fix, the held-write scenario checks units at backup, L3 write and L3 restore and
    finds nothing; the reader's restores are checked against nothing (another process's commits
    are unknown to it) and pass."""
    cache = open_cache("hybrid-mamba", tmp_path / "l3", [*SMALL["hybrid-mamba"], *DIGESTS])
    try:
        _commit_page_by_page(cache, tokens(7, 14), lambda k: None)
        cache.flush()
        digests = cache.writer.digests
        assert digests is not None and digests.checked > 0
        assert digests.mismatches == []
        lease = cache.lookup(tokens(7, 14)[: 6 * PAGE], prefetch="wait")  # page 6 from L2
        cache.admit(lease)
        assert verify(cache, lease) == 0
        cache.release(lease)
    finally:
        cache.close()


def test_unit_digests_name_the_stage_where_bytes_changed_and_keep_them_out_of_l3(tmp_path: Path) -> None:
    """A host unit overwritten while its L3 write is queued (what issue 29 did): the writer
    thread names stage ``l3_write``, pool and page, and does not store that pool's object; a
    fresh cache then restores a shorter prefix, never the changed bytes."""
    l3 = tmp_path / "l3"
    cache = open_cache("hybrid-mamba", l3, [*SMALL["hybrid-mamba"], *DIGESTS])
    gate = threading.Event()
    put_group = cache.engine.put_group
    calls = [0]

    def held(batches):  # write 2 holds the one writer thread: write 3 waits in the queue
        calls[0] += 1
        if calls[0] == 2:
            gate.wait(10)
        return put_group(batches)

    cache.engine.put_group = held
    prompt = tokens(8, 5)
    try:

        def after(k: int) -> None:
            if k == 3:  # page 3's write is queued: overwrite its state slot on the host
                node = cache.tree.match(cache.tree.keys_of(prompt[: 3 * PAGE]), count_hit=False).path[-1]
                slot = node.host[cache.tree.index["mamba"]]
                for buffer in cache.pools.pools["mamba"].spec.buffers:
                    cache.pools.pools["mamba"].host.unit_view(buffer.name)[slot] ^= 0x5A
                gate.set()

        _commit_page_by_page(cache, prompt, after)
        cache.flush()
        mismatches = cache.writer.digests.mismatches
        assert mismatches and mismatches[0].stage == "l3_write" and mismatches[0].pool == "mamba"
        assert "l3_write" in str(mismatches[0]) and "'mamba'" in str(mismatches[0])
    finally:
        gate.set()
        cache.close()
    results = _restores("hybrid-mamba", l3, prompt)
    assert all(bad == 0 for _, _, bad in results), results
    assert results[2][1] < 3, results  # page 3's state never reached L3: its restore stops earlier
    assert results[4][1] == 5, results


def test_unit_digests_catch_device_bytes_changed_before_the_backup(tmp_path: Path) -> None:
    """Write-back: bytes changed on the device after commit are named at stage ``backup``."""
    cache = open_cache(
        "hybrid-mamba", tmp_path / "l3", [*SMALL["hybrid-mamba"], *DIGESTS, "policy.write=write_back"]
    )
    try:
        prompt = tokens(9, 2)
        _commit_page_by_page(cache, prompt, lambda k: None)
        node = cache.tree.match(cache.tree.keys_of(prompt), count_hit=False).path[-1]
        kv = cache.pools.pools["kv"]
        kv.device.unit_view(kv.spec.buffers[0].name)[node.device[0]] ^= 0x01
        cache.writer.back_up([node])
        found = cache.writer.digests.mismatches
        assert found and found[0].stage == "backup" and found[0].pool == "kv" and found[0].tier == "host"
    finally:
        cache.close()


# --- the replay's own verification now walks this path ----------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stack", ["hybrid-mamba", "swa-mamba"])
def test_replay_in_page_chunks_with_small_tiers_verifies_every_restore(stack: str, tmp_path: Path) -> None:
    """Why replay missed issue 29: it served a request in at most two chunks, so a writer rarely
    had two chained writes queued while host eviction ran. ``chunk_pages=1`` on the hybrid
    stacks with small tiers queues one L3 write per page; every restore is verified byte for
    byte by the replay and every unit by ``debug.unit_digests`` along the way."""
    requests = read_trace(None, limit=40)  # the bundled sample
    overrides = [
        f"tiers.storage.l3.path={tmp_path / 'l3'}",
        "tiers.device.capacity_tokens=16384",  # 32 pages of 512 tokens
        "tiers.host.capacity_tokens=24576",
        "model.page_size=512",
        *DIGESTS,
        *(o for o in SMALL[stack] if "page_first" not in o),
    ]
    config = load([EXAMPLES[stack]], overrides=overrides, plugins=PluginHost(), environ={})
    with CacheController(config, PluginHost()) as cache:
        result, _ = replay_with_cache(cache, requests, chunk_pages=1, state_checkpoint_tokens=None)
        digests = cache.writer.digests
        ops = cache.metrics.snapshot()["operations"]
    assert result.corrupt_pages_served == 0 and result.requests == len(requests)
    assert result.hit_rate.total > 0  # restores happened and were verified
    assert digests is not None and digests.mismatches == [] and digests.checked > 0
    assert ops["storage_writes"] > len(requests)  # one write per chunk, not per request


def test_a_request_longer_than_its_window_pool_says_which_pool_is_too_small(tmp_path: Path) -> None:
    """The repro sweep's capacity failures (a window of 4 pages plus the page being computed on a
    4-unit window pool) are true capacity limits: the error names the pools' device units."""
    overrides = ["model.pools.swa.device_units=2", "tiers.host.layout=page_first"]
    with open_cache("swa-mamba", None, overrides) as cache:
        lease = cache.lookup(tokens(11, 8))
        cache.admit(lease)
        with pytest.raises(CacheFullError, match=r"device units per pool: \{.*'swa': 2"):
            cache.allocate(lease, window_only=True)
        cache.release(lease)
