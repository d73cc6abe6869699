"""A component that joins a node after its backup reaches the host tier and L3 too.

Backups are decided on a node's anchor. Request B sharing the first pages of request A's node
splits it where B's chunk ends and leaves its state checkpoint there, in a node whose pages went
to the host with A: the checkpoint stayed on the device only, and a prefix ending there was
lost to the host tier and to L3 once it left (audit 29). Every restored byte is checked.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import kvstrata
from controller_support import (
    fill,
    host_units_held_by_tree,
    host_units_in_use,
    open_cache,
    serve,
    tokens,
    verify,
)
from test_controller import hold_l3_writes

PAGE = 64
WAIT = ["policy.prefetch.policy=wait_complete"]
DIGESTS = ["debug.unit_digests=true"]


def _serve_in_two_chunks(cache, request: torch.Tensor, first_pages: int) -> None:
    """B's engine loop: a first chunk of ``first_pages`` (it checkpoints there), then the rest."""
    lease = cache.lookup(request[: first_pages * PAGE])
    cache.admit(lease)
    assert verify(cache, lease) == 0
    for last in (False, True):
        units = cache.allocate(lease)
        cache.fork_state(lease)
        fill(cache, lease, units)
        cache.insert(lease, close=last)
        if not last:
            lease.extend(request[first_pages * PAGE :])


def _checkpoint_a_backed_up_node(cache, a: torch.Tensor, b: torch.Tensor) -> tuple[int, object, int]:
    """A (6 pages) served, evicted (backed up whole) and served again, its host copy kept; then
    B splits it at 3 pages and checkpoints there: (filler pages, the shared node, the state pool)."""
    filler = cache.pools.device_pages - 2
    _serve_in_two_chunks(cache, a, 6)
    _serve_in_two_chunks(cache, tokens(83, filler), filler)  # evicts A: backed up whole
    _serve_in_two_chunks(cache, a, 6)  # A on the device again, its host copy kept
    _serve_in_two_chunks(cache, b, 3)  # splits it at 3 and checkpoints there
    shared = cache.tree.match(cache.tree.keys_of(a[: 3 * PAGE]), count_hit=False).path[-1]
    return filler, shared, cache.tree.index["mamba"]


def _shared_prefix_from_the_host(cache, a: torch.Tensor) -> None:
    """A request sharing A's first 3 pages finds all 3 on the host, their bytes exact; flushed."""
    lease = cache.lookup(torch.cat([a[: 3 * PAGE], tokens(85, 2)]))
    cache.admit(lease)
    assert (lease.cached_pages, lease.hit_pages["host"]) == (3, 3), lease.skipped
    assert verify(cache, lease) == 0
    cache.release(lease)
    cache.flush()


def _split_interrupted(
    cache, monkeypatch: pytest.MonkeyPatch, b: torch.Tensor, *, after: bool, interrupt: bool = True
) -> None:
    """B's first chunk (as :func:`_serve_in_two_chunks` serves it) splits A's backed-up node at 3
    pages and checkpoints there; ``PrefixTree.set_host_value`` raises an interrupt once, before
    or ``after`` recording the checkpoint's host copy (none without ``interrupt``); B is then
    released."""
    from kvstrata.core.tree import PrefixTree
    from test_interrupts import Interrupt, interrupt_once

    if interrupt:
        interrupt_once(monkeypatch, PrefixTree, "set_host_value", after=after)
    lease = cache.lookup(b[: 3 * PAGE])
    cache.admit(lease)
    units = cache.allocate(lease)
    cache.fork_state(lease)
    fill(cache, lease, units)
    if interrupt:
        with pytest.raises(Interrupt):
            cache.insert(lease)
    else:
        cache.insert(lease)
    cache.release(lease)


def _restores_from_l3(stack: str, l3: Path, request: torch.Tensor, pages: int) -> None:
    """A new process on ``l3`` (L3 only) restores ``pages`` of ``request``, every byte exact."""
    with open_cache(stack, l3, WAIT) as cold:
        lease = cold.lookup(request)
        cold.admit(lease)
        assert (lease.cached_pages, lease.hit_pages["storage"]) == (pages, pages), lease.skipped
        assert verify(cold, lease) == 0
        cold.release(lease)


@pytest.mark.parametrize("digests", [False, True], ids=["", "unit_digests"])
@pytest.mark.parametrize("stack", ["hybrid-mamba", "swa-mamba"])
def test_a_checkpoint_left_in_a_backed_up_node_is_restored_from_the_host_and_from_l3(
    stack: str, digests: bool, tmp_path: Path
) -> None:
    a = tokens(71, 6)
    b = torch.cat([a[: 3 * PAGE], tokens(72, 3)])
    with open_cache(stack, tmp_path, WAIT + DIGESTS * digests) as cache:
        _serve_in_two_chunks(cache, a, 6)  # one node: pages [0, 6), A's only checkpoint at 6
        _serve_in_two_chunks(cache, b, 3)  # splits it at 3 and checkpoints there
        cache.flush()
        shared = cache.tree.match(cache.tree.keys_of(a[: 3 * PAGE]), count_hit=False).path[-1]
        state = cache.tree.index["mamba"]
        assert shared.host_raw[state] is not None, "the checkpoint B left has a host copy"
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)
        if digests:  # every stage's bytes checked against the commit's, the new copy's too
            assert cache.writer.digests is not None and cache.writer.digests.mismatches == []
    _restores_from_l3(stack, tmp_path, torch.cat([a[: 3 * PAGE], tokens(73, 2)]), 3)


def test_selective_write_through_backs_up_the_checkpoint_once_its_node_is_hot(tmp_path: Path) -> None:
    """``write_through_selective`` backs up the nodes a lookup finds hot: one already on the host
    gets the checkpoint a later request left in it too."""
    selective = [*WAIT, "policy.write=write_through_selective", "policy.write_through_threshold=1"]
    a = tokens(74, 6)
    b = torch.cat([a[: 3 * PAGE], tokens(75, 3)])
    with open_cache("hybrid-mamba", tmp_path, selective) as cache:
        _serve_in_two_chunks(cache, a, 6)
        _serve_in_two_chunks(cache, a, 6)  # hot: A's node goes to the host (its checkpoint at 6)
        _serve_in_two_chunks(cache, b, 3)  # splits it at 3 and checkpoints there
        _serve_in_two_chunks(cache, torch.cat([a[: 3 * PAGE], tokens(76, 1)]), 3)  # reuses [0, 3)
        cache.flush()
        shared = cache.tree.match(cache.tree.keys_of(a[: 3 * PAGE]), count_hit=False).path[-1]
        assert shared.host_raw[cache.tree.index["mamba"]] is not None
    _restores_from_l3("hybrid-mamba", tmp_path, torch.cat([a[: 3 * PAGE], tokens(77, 2)]), 3)


@pytest.mark.parametrize("stack", ["hybrid-mamba", "swa-mamba"])
def test_write_back_backs_up_the_checkpoint_a_backed_up_node_gained_before_evicting_it(
    stack: str, tmp_path: Path
) -> None:
    """Write-back backs up what eviction drops, but chose by the anchor: a node whose pages were
    on the host already lost the checkpoint B left in it when it was evicted (a lookup of its
    prefix then found 0 of 3 pages: an incomplete stack)."""
    a = tokens(81, 6)
    b = torch.cat([a[: 3 * PAGE], tokens(82, 3)])
    with open_cache(stack, tmp_path, ["policy.write=write_back", *WAIT]) as cache:
        filler, shared, state = _checkpoint_a_backed_up_node(cache, a, b)
        assert shared.host_raw[0] is not None and shared.host_raw[state] is None
        _serve_in_two_chunks(cache, tokens(84, filler), filler)  # evicts A's nodes again
        assert shared.device_raw[0] is None and shared.host_raw[state] is not None
        _shared_prefix_from_the_host(cache, a)
    _restores_from_l3(stack, tmp_path, torch.cat([a[: 3 * PAGE], tokens(86, 2)]), 3)


@pytest.mark.parametrize("host_slots", [2, 3])
def test_write_back_waits_for_an_l3_write_to_back_up_the_checkpoint_its_eviction_drops(
    tmp_path: Path, host_slots: int
) -> None:
    """As above, with 3 host state slots and L3 writes in flight (held, fault injection, until
    0.3 s into the last eviction): the slot B's checkpoint needed was held by a write's sources,
    and its component backup skipped it at once (``backups_skipped``) where an ordinary backup
    waits for room (``policy.backup_wait_s``): the eviction dropped the checkpoint, and a lookup
    of the 3-page prefix found 0 pages. (Where write-back nodes wait on the host for their
    prefix's L3 write, host eviction leaves them while a write is in flight: skipped too.) With
    2 slots it was skipped after the wait too: the slots were held by the copies this eviction
    had just made of A's and B's own checkpoints, kept while their nodes were on the device;
    once L3 stored them one hands its slot on (as to a next round of the eviction's backups)."""
    a = tokens(81, 6)
    b = torch.cat([a[: 3 * PAGE], tokens(82, 3)])
    slots = [
        "policy.write=write_back",
        *WAIT,
        f"model.pools.mamba.host_units={host_slots}",
        "policy.backup_wait_s=30",
    ]
    with open_cache("hybrid-mamba", tmp_path, slots) as cache:
        gate = hold_l3_writes(cache)
        filler, shared, state = _checkpoint_a_backed_up_node(cache, a, b)
        assert shared.host_raw[state] is None and cache.writer.pending, "(writes in flight)"
        opens = threading.Timer(0.3, gate.set)
        opens.start()
        _serve_in_two_chunks(cache, tokens(84, filler), filler)  # evicts A's nodes again
        opens.join()
        assert shared.device_raw[0] is None and shared.host_raw[state] is not None
        assert cache.metrics.snapshot(samples=False)["operations"]["backups_skipped"] == 0
        _shared_prefix_from_the_host(cache, a)
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)
    _restores_from_l3("hybrid-mamba", tmp_path, torch.cat([a[: 3 * PAGE], tokens(86, 2)]), 3)


def test_selective_write_through_writes_the_window_at_a_branch_point_once_it_is_hot(tmp_path: Path) -> None:
    """Chats on a 4-page system prompt, each served twice (hot at once: threshold 1). The first
    chat's node went to L3 whole, its window at page 6; the second split it at the prompt's end,
    an upper half on the host already, whose last window nothing wrote (write-through's insert
    writes it, selective's lookup did not): a fresh cache restored 0 pages of the prompt for a
    new question."""
    selective = [*WAIT, "policy.write=write_through_selective", "policy.write_through_threshold=1"]
    system = tokens(78, 4)
    with open_cache("swa", tmp_path, selective) as cache:
        for chat in (torch.cat([system, tokens(79 + i, 2)]) for i in range(2)):
            for _ in range(2):
                _, bad = serve(cache, chat)  # (one insert: the prompt is not a node end)
                assert bad == 0
        cache.flush()
    _restores_from_l3("swa", tmp_path, torch.cat([system, tokens(90, 2)]), 4)


def test_write_back_writes_the_window_at_a_branch_point_inside_a_backed_up_node(tmp_path: Path) -> None:
    """Write-back: a chat on a 4-page system prompt is backed up and written whole as it leaves
    the device (its window at page 6). A second chat, served from the host copy, splits it at
    the prompt's end: the upper half is backed up already, so no eviction writes it, and its
    last window reached L3 never -- a fresh cache restored 0 pages of the prompt for a new
    question."""
    system = tokens(83, 4)
    with open_cache("swa", tmp_path, [*WAIT, "policy.write=write_back"]) as cache:
        for i in range(2):
            _, bad = serve(cache, torch.cat([system, tokens(84 + i, 2)]))
            assert bad == 0
            for j in range(12):  # the chat leaves the device (backed up, written to L3)
                serve(cache, tokens(100 + 20 * i + j, 4))
        cache.flush()
    _restores_from_l3("swa", tmp_path, torch.cat([system, tokens(90, 2)]), 4)


def _prompt_restores_whole(cache, prompt: torch.Tensor) -> None:
    """The 8-page ``prompt`` and one page more: all 8 cached pages restore, every byte exact."""
    lease = cache.lookup(torch.cat([prompt, tokens(99, 1)]))
    cache.admit(lease)
    assert lease.cached_pages == 8, lease.hit_pages
    assert verify(cache, lease) == 0
    cache.release(lease)


def _prefill_page_by_page(cache, request: torch.Tensor) -> None:
    """A chunked prefill of one page per chunk: a checkpoint at every page, one lease."""
    lease = cache.lookup(request[:PAGE])
    cache.admit(lease)
    for end in range(1, len(request) // PAGE + 1):
        if end > 1:
            lease.extend(request[(end - 1) * PAGE : end * PAGE])
        units = cache.allocate(lease)
        cache.fork_state(lease)
        fill(cache, lease, units)
        cache.insert(lease, close=end == len(request) // PAGE)


@pytest.mark.parametrize("batch", [1, 64], ids=["batch1", "batch64"])
def test_write_through_writes_every_checkpoint_with_fewer_host_state_slots_than_checkpoints(
    batch: int, tmp_path: Path
) -> None:
    """3 host state slots, a prompt prefilled page by page (8 checkpoints). The first 3 nodes'
    host copies kept every slot while they stayed on the device (a state pool's host copies of
    device checkpoints could not go), so checkpoints 4-8 -- and the next request's whole node --
    were skipped, reached neither host nor L3, and were lost with the device copies: a fresh
    cache restored 3 of the prompt's 8 pages. In one batch (``batch64``) the units the batch had
    taken held the room itself: it now goes in rounds, each waiting for the last one's write."""
    slots = [*WAIT, "model.pools.mamba.host_units=3", f"policy.write_through_batch_pages={batch}"]
    prompt, other = tokens(91, 8), tokens(92, 8)
    with open_cache("hybrid-mamba", tmp_path, slots) as cache:
        _prefill_page_by_page(cache, prompt)
        _, bad = serve(cache, other)  # one node, one checkpoint: backed up beside the prompt's
        assert bad == 0
        for seed in (93, 94):  # the prompt leaves the device
            assert serve(cache, tokens(seed, 8))[1] == 0
        cache.flush()
        assert cache.metrics.snapshot(samples=False)["operations"]["backups_skipped"] == 0
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)
    for k in (4, 8):
        _restores_from_l3("hybrid-mamba", tmp_path, torch.cat([prompt[: k * PAGE], tokens(95, 1)]), k)
    _restores_from_l3("hybrid-mamba", tmp_path, other, 8)


def test_write_back_writes_every_checkpoint_an_eviction_drops_with_3_host_state_slots(tmp_path: Path) -> None:
    """Write-back, 3 host state slots, a prompt prefilled page by page (8 checkpoints) that the
    next requests evict. The eviction backed up what the free slots took and skipped the rest
    (the host keeps a state copy while the device holds its node, and the batch's own copies
    were not the tree's yet): the device dropped the skipped nodes unbacked, and a fresh cache
    restored 4 of the 8 pages. The backups now go in rounds, each written to L3 before its
    shallowest state copies give their host slots to the next."""
    slots = [*WAIT, "policy.write=write_back", "model.pools.mamba.host_units=3"]
    prompt = tokens(96, 8)
    with open_cache("hybrid-mamba", tmp_path, slots) as cache:
        _prefill_page_by_page(cache, prompt)
        for seed in (97, 98):  # the prompt leaves the device
            assert serve(cache, tokens(seed, 8))[1] == 0
        cache.flush()
        assert cache.metrics.snapshot(samples=False)["operations"]["backups_skipped"] == 0
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)
        assert cache.tree.units("mamba", "host") == 3
    for k in (4, 8):
        _restores_from_l3("hybrid-mamba", tmp_path, torch.cat([prompt[: k * PAGE], tokens(99, 1)]), k)


@pytest.mark.parametrize("digests", [False, True], ids=["", "unit_digests"])
@pytest.mark.parametrize("stack", ["hybrid-mamba", "swa-mamba"])
@pytest.mark.parametrize("state_slots", [1, 3])
def test_write_back_without_l3_keeps_the_deepest_checkpoints_of_an_evicted_prompt(
    state_slots: int, stack: str, digests: bool
) -> None:
    """Write-back, no L3, fewer host state slots than an evicted prompt's 8 checkpoints. The
    eviction backed up nodes root first while each took a state slot and skipped the rest: the
    device dropped nodes 4-8 unbacked (28 of 32 host page units free) and the prompt restored
    3 of its 8 pages. A host node with pages and no state is the middle of a longer prefix, so
    the shallow nodes' slots now go to the deepest checkpoints: the whole prompt restores from
    the host, every byte exact, and no unit leaks."""
    slots = ["policy.write=write_back", *WAIT, f"model.pools.mamba.host_units={state_slots}"]
    prompt = tokens(96, 8)
    with open_cache(stack, None, slots + (DIGESTS if digests else [])) as cache:
        _prefill_page_by_page(cache, prompt)
        for seed in (97, 98):  # the prompt leaves the device
            assert serve(cache, tokens(seed, 8))[1] == 0
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)
        assert cache.tree.units("mamba", "host") == state_slots
        for _ in range(2):  # (the second from the device the first restored to)
            _prompt_restores_whole(cache, prompt)
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)


def _kv_mamba_two_host_slots(window: bool) -> dict:
    """kv + mamba (+ a 4-page sliding window pool: ``window``), write-back, no L3: 16 device
    pages and 8 device state slots (4 with the window pool), 32 host pages and 2 host state
    slots."""
    pools: dict = {"kv": {"type": "kv", "layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "bfloat16"}}
    if window:
        pools["swa"] = {"type": "swa", "layers": 1, "kv_heads": 1, "head_dim": 8, "window": 4 * PAGE}
    pools["mamba"] = {
        "type": "mamba",
        "layers": 1,
        "states": {"conv": {"shape": [3, 8]}, "ssm": {"shape": [2, 4, 4], "dtype": "float32"}},
        "device_units": 4 if window else 8,
        "host_units": 2,
    }
    return {
        "model": {"name": "write-back-two-host-slots", "page_size": PAGE, "pools": pools},
        "tiers": {
            "device": {"capacity_tokens": 16 * PAGE},
            "host": {"capacity_tokens": 32 * PAGE},
            "storage": {},
        },
        "policy": {"write": "write_back", "prefetch": {"policy": "wait_complete"}},
    }


@pytest.mark.parametrize("window", [False, True], ids=["kv-mamba", "kv-swa-mamba"])
@pytest.mark.parametrize("chunk", [1, 2])
@pytest.mark.parametrize("fillers", [3, 4, 5])
def test_write_back_without_l3_keeps_the_deepest_host_checkpoint_as_later_requests_evict_a_prompt(
    fillers: int, chunk: int, window: bool
) -> None:
    """Write-back, no L3, 2 host state slots. An 8-page prompt prefilled in ``chunk``-page chunks
    (a checkpoint per chunk), then 4-page requests: the third evicts the prompt's pages 5-8,
    whose deepest checkpoints (pages 7-8 or 6 and 8) take the host slots. The fourth evicts pages
    1-4, and backing up their checkpoints took both slots from the deeper ones by host eviction
    (oldest first): the prompt restored 4 of its 8 pages after 4 and 5 requests, though its
    page-8 checkpoint had been on the host. A user should get the deepest prefix the host tier
    can keep: an eviction never throws a deeper checkpoint away to keep a shallower one of the
    same path, so pages 1-4 go to the host without their states (a host node with pages and no
    state is the middle of the longer prefix). The whole prompt restores, every byte exact;
    the 5th request's own checkpoint takes the older slot (page 7 or 6), page 8's stays.

    With a window pool the 4th request's eviction also backed up a request that stayed on the
    device (its checkpoint's copy took the page-8 slot): the window units it had to free were
    counted from unbacked leaves only, though the prompt's backed-up pages 1-4, leaving first,
    freed them (window pools make room after the anchor). The prompt restored none of its pages."""
    prompt = tokens(96, 8)
    with kvstrata.open(_kv_mamba_two_host_slots(window), environ={}) as cache:
        lease = cache.lookup(prompt[: chunk * PAGE])
        cache.admit(lease)
        for end in range(chunk, 9, chunk):
            if end > chunk:
                lease.extend(prompt[(end - chunk) * PAGE : end * PAGE])
            units = cache.allocate(lease)
            cache.fork_state(lease)
            fill(cache, lease, units)
            cache.insert(lease, close=end == 8)
        for seed in range(fillers):
            assert serve(cache, tokens(200 + seed, 4))[1] == 0
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)
        deepest = cache.tree.match(cache.tree.keys_of(prompt), count_hit=False).path[-1]
        assert deepest.depth_end == 8 and deepest.host_raw[cache.tree.index["mamba"]] is not None
        _prompt_restores_whole(cache, prompt)
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)


def test_a_component_backup_whose_copy_raises_gives_back_its_host_unit(tmp_path: Path) -> None:
    """Fault injection (the pool group's device -> host copy raising when called for a component
    a backed-up node gained): the host slot allocated for the checkpoint stayed in use by no one."""
    import sys

    a = tokens(71, 6)
    b = torch.cat([a[: 3 * PAGE], tokens(72, 3)])
    with open_cache("hybrid-mamba", tmp_path, WAIT) as cache:
        _serve_in_two_chunks(cache, a, 6)
        real = cache.pools.device_to_host
        failed = []

        def copy_fails(*args: object) -> object:
            if sys._getframe(1).f_code.co_name == "copy_components":
                failed.append(args[0])
                raise RuntimeError("injected copy fault")
            return real(*args)  # type: ignore[arg-type]

        cache.pools.device_to_host = copy_fails  # type: ignore[method-assign]
        lease = cache.lookup(b[: 3 * PAGE])  # B, as ``_serve_in_two_chunks`` serves it
        cache.admit(lease)
        with pytest.raises(RuntimeError, match="injected copy fault"):
            for last in (False, True):
                units = cache.allocate(lease)
                cache.fork_state(lease)
                fill(cache, lease, units)
                cache.insert(lease, close=last)
                lease.extend(b[3 * PAGE :])
        del cache.pools.device_to_host
        cache.release(lease)
        assert failed == ["mamba"]
        cache.flush()
        assert host_units_in_use(cache) == host_units_held_by_tree(cache), "the host slot leaked"


def test_an_interrupt_after_a_component_backup_recorded_its_copy_still_writes_it_to_l3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: ``PrefixTree.set_host_value`` raises once its real call recorded the
    host copy of the checkpoint B left in A's backed-up node (an interrupt, as from an observer
    hook). The node then had the checkpoint on the host and no longer counted as gaining it:
    no later backup wrote it, and a fresh cache restored 0 of the 3 pages."""

    a = tokens(71, 6)
    b = torch.cat([a[: 3 * PAGE], tokens(72, 3)])
    with open_cache("hybrid-mamba", tmp_path, WAIT) as cache:
        _serve_in_two_chunks(cache, a, 6)
        _split_interrupted(cache, monkeypatch, b, after=True)
        shared = cache.tree.match(cache.tree.keys_of(a[: 3 * PAGE]), count_hit=False).path[-1]
        assert shared.host_raw[cache.tree.index["mamba"]] is not None, "(the copy is recorded)"
        serve(cache, tokens(73, 1))  # (the next call)
        cache.flush()
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)
    _restores_from_l3("hybrid-mamba", tmp_path, torch.cat([a[: 3 * PAGE], tokens(73, 2)]), 3)


def test_an_interrupt_before_a_component_backup_recorded_its_copy_gives_back_its_host_unit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: ``PrefixTree.set_host_value`` raises before recording the host copy of
    the checkpoint B left in A's backed-up node (an interrupt). The host slot taken for the copy
    stayed in use by no one."""

    a = tokens(71, 6)
    b = torch.cat([a[: 3 * PAGE], tokens(72, 3)])
    with open_cache("hybrid-mamba", tmp_path, WAIT) as cache:
        _serve_in_two_chunks(cache, a, 6)
        _split_interrupted(cache, monkeypatch, b, after=False)
        assert host_units_in_use(cache) == host_units_held_by_tree(cache), "the host slot leaked"
        serve(cache, tokens(73, 1))  # (the next call)
        cache.flush()
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)


@pytest.mark.parametrize("interrupt", [False, True], ids=["clean", "interrupted"])
def test_a_component_write_an_interrupt_lost_rewrites_only_the_component(
    interrupt: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: an interrupt once the checkpoint B left in A's backed-up node was copied
    to the host, before its L3 write was queued. The writer's next drain queued the whole node
    again: its 3 pages, in L3 already, were written and counted ``storage_admitted`` twice (10
    objects, 10 pages admitted; 7 without the interrupt). Now only the checkpoint is."""
    from kvstrata.core.metrics import Operation

    a = tokens(71, 6)
    b = torch.cat([a[: 3 * PAGE], tokens(72, 3)])
    with open_cache("hybrid-mamba", tmp_path, WAIT) as cache:
        _serve_in_two_chunks(cache, a, 6)
        _split_interrupted(cache, monkeypatch, b, after=True, interrupt=interrupt)
        serve(cache, tokens(73, 1))  # (the next call)
        cache.flush()
        metrics = cache.metrics
        assert (metrics.operations[Operation.STORAGE_ADMITTED], metrics.storage.put_units) == (7, 10)
        assert host_units_in_use(cache) == host_units_held_by_tree(cache)
    _restores_from_l3("hybrid-mamba", tmp_path, torch.cat([a[: 3 * PAGE], tokens(73, 2)]), 3)
