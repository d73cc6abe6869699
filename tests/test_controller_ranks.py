"""Two ranks (two processes, torch.distributed gloo on loopback) agree on L3 prefetch lengths:
where one rank misses a window page both drop the prefetch, where one misses a later state both
serve the checkpoint every rank holds, where both hold it both adopt it; and on a device prefix
every rank holds whole (a state at its end on each); and a rank whose ``admit`` raises still
meets the others at the agreement points (they reuse nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from controller_support import DEVICE, REPO
from kvstrata.core.collective import FAILED, RankAgreement
from kvstrata.testing.mooncake_servers import free_loopback_port

RANK = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from pathlib import Path
    import torch.distributed as dist
    from controller_support import open_cache, serve, tokens
    from kvstrata.core.collective import TorchCollective
    rank, port, l3 = int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sets = [f"parallel.tp_rank={rank}", "parallel.tp_size=2", "policy.prefetch.policy=wait_complete"]
    report = {}
    # per case: the stack, the request's pages, the pool and page whose object rank 1 loses
    cases = (("one_rank_misses", "swa", 21, 8, "swa", 6), ("both_hold", "swa", 22, 8, None, 0),
             ("state_missing", "hybrid-mamba", 23, 12, "mamba", 11))
    for case, stack, seed, pages, pool, page in cases:
        with open_cache(stack, l3, sets, collective=TorchCollective()) as writer:
            if stack == "hybrid-mamba":  # a checkpoint at page 8, then one at page 12
                serve(writer, tokens(seed, pages)[: 8 * 64])
            lease, _ = serve(writer, tokens(seed, pages))
            writer.flush()
            if pool is not None and rank == 1:
                (keys,) = writer.engine.object_keys(pool, lease.page_hashes[page : page + 1])
                writer.backend.path_for(keys[0]).unlink()
        dist.barrier()
        with open_cache(stack, l3, sets, collective=TorchCollective()) as cold:
            lease, bad = serve(cold, tokens(seed, pages))
            ops = cold.metrics.snapshot()["operations"]
            report[case] = {"storage": lease.hit_pages["storage"], "bad": bad,
                            "dropped": ops["prefetches_dropped"], "committed": ops["prefetches_committed"],
                            "skipped": lease.skipped}
        dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(report))
    """
)


def _run_ranks(script: str, tmp_path: Path, timeout: float = 240) -> list[dict]:
    """``script`` as ranks 0 and 1 of a gloo group; each rank's last stdout line, as JSON."""
    port = free_loopback_port()
    env = {
        "PYTHONPATH": str(REPO / "src"),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "GLOO_SOCKET_IFNAME": "lo",
        "KVSTRATA_TEST_DEVICE": DEVICE,
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(REPO / "tests"), str(rank), str(port), str(tmp_path / "l3")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    reports = []
    try:
        for process in ranks:
            out, err = process.communicate(timeout=timeout)
            assert process.returncode == 0, err[-3000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    return reports


def test_two_ranks_settle_on_the_longest_prefetch_every_rank_can_end(tmp_path: Path) -> None:
    """Rank 1 lost the window object of page 6 (L3 holds the last window only: it can end no
    prefix) or the state at page 12 (its checkpoint is at page 8). Both ranks serve the longest
    prefix every rank can end: none, or 8 pages -- rank 0 dropped its whole 12-page read (its
    state object was the one at page 12) and both served nothing; it now re-reads page 8's."""
    reports = _run_ranks(RANK, tmp_path)
    for rank, report in enumerate(reports):
        missed, held, state = report["one_rank_misses"], report["both_hold"], report["state_missing"]
        assert missed["storage"] == 0, f"rank {rank} used a prefetch another rank could not complete"
        assert state["storage"] == 8, f"rank {rank} did not serve the checkpoint every rank holds"
        assert held["storage"] == 8 and held["committed"] == 1, f"rank {rank} did not adopt a full prefetch"
        assert missed["bad"] == 0 and held["bad"] == 0 and state["bad"] == 0
        assert state["committed"] == 1 and state["dropped"] == 0
    assert reports[0]["one_rank_misses"]["dropped"] == 1, "rank 0 read the pages and dropped them"
    assert reports[0]["one_rank_misses"]["skipped"] == {"rank_disagreement": 8}, "the drop says why"
    assert reports[0]["state_missing"]["skipped"] == {"rank_disagreement": 4}, "the pages given up"
    assert reports[1]["state_missing"]["skipped"] == {"incomplete_stack": 4}
    assert reports[0]["both_hold"]["skipped"] == {} and reports[1]["both_hold"]["skipped"] == {}


#: rank 0 lost its mamba state at page 8, rank 1 the one at page 12 (a rank-local state eviction,
#: injected with ``drop_component``): each holds a different prefix of the same 12 pages
STATES = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import torch.distributed as dist
    from controller_support import open_cache, serve, tokens, verify
    from kvstrata.core.collective import TorchCollective
    from kvstrata.core.tree import Tier
    rank, port = int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sets = [f"parallel.tp_rank={rank}", "parallel.tp_size=2"]
    request = tokens(5, 12)
    with open_cache("hybrid-mamba", None, sets, collective=TorchCollective()) as cache:
        serve(cache, request[: 8 * 64])
        serve(cache, request)
        path = cache.tree.match(cache.tree.keys_of(request), count_hit=False).path
        node = next(n for n in path if n.depth_end == (8 if rank == 0 else 12))
        for tier in (Tier.DEVICE, Tier.HOST):
            if node in cache.tree.holding("mamba", tier):
                cache.units.free(tier, {"mamba": cache.tree.drop_component(node, "mamba", tier)})
        alone = cache.tree.match(cache.tree.keys_of(request), count_hit=False).device_pages
        lease = cache.lookup(request)
        cache.admit(lease)
        print(json.dumps({"alone": alone, "cached": lease.cached_pages, "bad": verify(cache, lease)}))
        cache.release(lease)
    dist.destroy_process_group()
    """
)


def test_ranks_agree_on_a_prefix_every_rank_has_a_state_for(tmp_path: Path) -> None:
    """A MIN of 8 (rank 0: state at 8) and 12 (rank 1: state at 12 only) is no prefix rank 1
    holds: rank 1 served 0 pages while rank 0 served 8. Both must serve the same prefix (0)."""
    reports = _run_ranks(STATES, tmp_path)
    assert [r["alone"] for r in reports] == [12, 8]  # (each alone: rank 0 still has 12 via page 12)
    assert [r["cached"] for r in reports] == [0, 0]
    assert all(r["bad"] == 0 for r in reports)


#: per case, this rank's ``parallel`` settings in a group of 2: what ``open`` says of each
GROUPS = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import torch.distributed as dist
    from controller_support import open_cache
    from kvstrata.core.collective import TorchCollective
    rank, port = int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cases = {
        "no_tp_size": [],
        "same_tp_rank": ["parallel.tp_size=2", "parallel.tp_rank=0"],
        "one_rank_says_1": ["parallel.tp_size=2", "parallel.tp_rank=0"] if rank == 0 else [],
        "right": ["parallel.tp_size=2", f"parallel.tp_rank={rank}"],
    }
    report = {}
    for case, sets in cases.items():
        try:
            open_cache("kv", None, sets, collective=TorchCollective()).close()
            report[case] = "opened"
        except ValueError as error:
            report[case] = str(error)
    dist.destroy_process_group()
    print(json.dumps(report))
    """
)


def test_a_group_that_is_not_the_configs_ranks_is_refused_on_every_rank(tmp_path: Path) -> None:
    # two ranks both configured as the only rank (or both as TP rank 0) wrote their shards under
    # one key: one rank then restored the other's bytes
    reports = _run_ranks(GROUPS, tmp_path)
    for report in reports:
        assert "group has 2 ranks but this config describes" in report["no_tp_size"]
        assert "the same coordinates" in report["same_tp_rank"]
        # refused on both ranks (one refusing alone would leave the other waiting in a collective)
        assert "the group's configs say 1 to 2" in report["one_rank_says_1"]
        assert report["right"] == "opened"


#: rank 0 alone fails inside ``admit`` (fault injection: its drain interrupted before the prefetch
#: point; between the two points its host -> device copy raising, or its device eviction policy's
#: ``ranked`` while the load-back makes room), in a gloo group whose timeout
#: is 20 s: rank 1 waited in the collective for it (30 minutes at gloo's default), and rank 0's
#: next admit then met rank 1's stale point (every later agreement one admit apart)
FAULTS = textwrap.dedent(
    """
    import datetime, json, sys
    sys.path.insert(0, sys.argv[1])
    import torch.distributed as dist
    from controller_support import open_cache, serve, tokens
    from kvstrata.core.collective import TorchCollective
    from kvstrata.core.tree import Tier
    rank, port = int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    sets = [f"parallel.tp_rank={rank}", "parallel.tp_size=2", "policy.eviction=s3fifo"]

    class Interrupt(BaseException):
        pass

    def interrupted(*args, **kwargs):
        raise Interrupt("injected interrupt")

    def copy_fails(*args, **kwargs):
        raise RuntimeError("injected copy fault")

    def policy_fails(*args, **kwargs):
        raise RuntimeError("injected policy fault")

    report = {}
    with open_cache("kv", None, sets, collective=TorchCollective()) as cache:
        policy = cache.tree.evictor.orders[Tier.DEVICE]
        for case, seed, part, name, fault in (
            ("eviction_policy", 3, policy, "ranked", policy_fails),  # (first: the host holds all)
            ("before_prefetch_point", 1, cache, "_drain", interrupted),
            ("load_back_copy", 2, cache.pools, "host_to_device", copy_fails),
        ):
            request = tokens(seed, 6)
            serve(cache, request)  # write-through: the host holds all 6 pages
            cache.tree.evict_device({n: 1 << 30 for n in cache.tree_pools}, cache.units.freer(Tier.DEVICE))
            if name == "ranked":  # the device full (16 pages): loading the 6 back evicts
                serve(cache, tokens(30, 8))
                serve(cache, tokens(31, 8))
            lease = cache.lookup(request)
            if rank == 0:
                setattr(part, name, fault)
            try:
                cache.admit(lease)
                outcome = lease.cached_pages
            except (Interrupt, RuntimeError) as error:
                outcome = str(error)
            finally:
                part.__dict__.pop(name, None)
            cache.release(lease)
            again, bad = serve(cache, request)  # the ranks still meet in step
            report[case] = {"outcome": outcome, "again": again.cached_pages, "bad": bad}
    dist.destroy_process_group()
    print(json.dumps(report))
    """
)


def test_a_rank_failing_inside_admit_still_meets_the_others(tmp_path: Path) -> None:
    """Rank 0 raises inside ``admit`` (injected); rank 1 reuses nothing of that request instead
    of waiting in the collective until the group's timeout, and both serve the next one whole."""
    reports = _run_ranks(FAULTS, tmp_path, timeout=120)
    assert reports[0]["before_prefetch_point"]["outcome"] == "injected interrupt"
    assert reports[0]["load_back_copy"]["outcome"] == "injected copy fault"
    assert reports[0]["eviction_policy"]["outcome"] == "injected policy fault"
    for case in ("before_prefetch_point", "load_back_copy", "eviction_policy"):
        assert reports[1][case]["outcome"] == 0, f"rank 1 reused pages rank 0 failed to load ({case})"
        assert [r[case]["again"] for r in reports] == [6, 6] and all(r[case]["bad"] == 0 for r in reports)


class _Scripted:
    """The group as this rank sees it: per call, what the other rank offers (or the collective's
    own error); every vector this rank offered is kept, without the admit's number each call
    carries last (a script that leaves it out: the other rank is in the same admit)."""

    world_size = 2

    def __init__(self, *others: list[int] | Exception) -> None:
        self.others, self.offered = list(others), list[list[int]]()

    def all_min(self, values: list[int]) -> list[int]:
        self.offered.append(list(values[:2]))
        other = self.others.pop(0)
        if isinstance(other, Exception):
            raise other
        other = [*other, *values[len(other) :]][: len(values)]
        return [min(v, o) for v, o in zip(values, other, strict=True)]


def _pages(n: int) -> SimpleNamespace:
    return SimpleNamespace(device_pages=n)


class _Interrupt(BaseException):
    pass


def test_an_admit_that_raises_nowhere_meets_each_point_once() -> None:
    group = _Scripted([4, 0], [4, -4])
    agreement = RankAgreement(group)
    with agreement:
        assert agreement.prefetch_pages(0, 4) == 4
        assert agreement.cached_match(_pages(4), _pages).device_pages == 4
    assert group.offered == [[4, 0], [4, -4]] and agreement.failures == 0  # nothing more on exit


def test_a_rank_failing_before_the_prefetch_point_offers_failed_there_only() -> None:
    group = _Scripted([4, 0])
    agreement = RankAgreement(group)
    with pytest.raises(_Interrupt), agreement:
        raise _Interrupt  # (a plugin, a drain: before this rank reached the point)
    assert group.offered == [[FAILED, -FAILED]], "every rank saw the failure there: no device point follows"


def test_a_rank_failing_between_rounds_of_the_device_point_meets_the_next_round() -> None:
    group = _Scripted([6, 0], [3, -3], [3, -3])
    agreement = RankAgreement(group)

    def within(n: int) -> SimpleNamespace:
        raise RuntimeError("injected: a state pool's match failed")

    with pytest.raises(RuntimeError, match="injected"), agreement:
        agreement.prefetch_pages(0, 6)
        agreement.cached_match(_pages(5), within)  # the others hold 3: a second round follows
    assert group.offered == [[6, 0], [5, -5], [FAILED, -FAILED]] and agreement.failures == 1


def test_the_others_reuse_nothing_after_a_rank_failed_at_either_point() -> None:
    at_prefetch = _Scripted([FAILED, -FAILED])
    agreement = RankAgreement(at_prefetch)
    with agreement:
        assert agreement.prefetch_pages(2, 4) == 0
        assert agreement.cached_match(_pages(6), _pages).device_pages == 0
    assert at_prefetch.offered == [[6, 0]], "the device point is agreed without a call"
    # a peer's failure counts as one (a failure), not as this rank giving up pages too
    assert agreement.failures == 1 and agreement.disagreements == 0
    at_device = _Scripted([6, 0], [FAILED, -FAILED])
    agreement = RankAgreement(at_device)
    with agreement:
        assert agreement.prefetch_pages(2, 4) == 4
        assert agreement.cached_match(_pages(6), _pages).device_pages == 0
    assert agreement.failures == 1 and agreement.disagreements == 0 and len(at_device.offered) == 2


def test_an_error_of_the_collective_itself_meets_no_further_point() -> None:
    group = _Scripted(RuntimeError("gloo: timed out"))
    agreement = RankAgreement(group)
    with pytest.raises(RuntimeError, match="gloo"), agreement:
        agreement.prefetch_pages(0, 4)
    assert group.offered == [[4, 0]], "a broken group is not called again"


def test_a_rank_whose_read_cannot_end_at_the_min_shortens_and_the_ranks_meet_again() -> None:
    # this rank read 12 pages of a state stack (checkpoints at 4 and 12), the other 8: told 8,
    # this rank lands at 4, below the MIN; told 4 in the second round, the other lands there too
    group = _Scripted([8, -8], [8, -8], [4, -4])
    agreement = RankAgreement(group)
    asked: list[int] = []

    def shorter(n: int) -> int:
        asked.append(n)
        return 4 if n >= 4 else 0

    with agreement:
        assert agreement.prefetch_pages(0, 12, shorter) == 4
    assert asked == [8] and group.offered == [[12, -12], [4, -4], [4, -4]]
    assert agreement.disagreements == 1 and agreement.failures == 0


def test_a_rank_a_call_out_of_step_is_met_again_or_failed_not_paired_with_another_request() -> None:
    """An interrupt just after a call returned, before this rank noted that another round was
    owed, left it a call short: its next admit's first call met the other rank's last round of
    the previous admit (a MIN of two requests' lengths), and every later call too."""
    group = _Scripted([4, 0], [4, -4], [3, -3, 1, -1], [4, 0], [4, -4])
    agreement = RankAgreement(group)
    with agreement:  # admit 1 (the other rank then meets one more round of it, 3 pages)
        assert agreement.prefetch_pages(0, 4) == 4
        assert agreement.cached_match(_pages(4), _pages).device_pages == 4
    with agreement:  # admit 2: the other rank is still in admit 1's device point (3 pages)
        assert agreement.prefetch_pages(0, 4) == 4, "a MIN with the other admit's 3"
        assert agreement.cached_match(_pages(4), _pages).device_pages == 4
    assert group.offered == [[4, 0], [4, -4], [4, 0], [4, 0], [4, -4]], "admit 2's first call again"
    assert agreement.failures == 0 and agreement.disagreements == 0
    # this rank a call behind: the other has left admit 1 (its prefetch point of admit 2 came)
    group = _Scripted([6, 0], [3, -6], [9, 0, 2, -2])
    agreement = RankAgreement(group)
    with agreement:
        assert agreement.prefetch_pages(0, 6) == 6
        assert agreement.cached_match(_pages(6), _pages).device_pages == 0, "the other left it"
    assert len(group.offered) == 3 and agreement.failures == 1


class _Peer:
    """Rank 1 of a group of 2 as rank 0 (this process) sees it: it agrees at open, offers the
    prefetch ends ``ends`` at the next calls (each exact: it holds a state there), then holds
    whatever this rank offers."""

    world_size = 2

    def __init__(self, *ends: int) -> None:
        self.ends, self.opened = list(ends), False

    def all_min(self, values: list[int]) -> list[int]:
        if not self.opened:  # (the group check at open: rank 1 holds the other place)
            self.opened = True
            return [2, -2, -1, -1]
        values = list(values)
        if self.ends:
            values[:2] = [min(values[0], self.ends.pop(0)), min(values[1], 0)]
        return values


def test_a_settle_read_that_finds_a_damaged_state_counts_damage_not_a_rank_disagreement(
    tmp_path: Path,
) -> None:
    """This rank read 12 pages (states at 8 and 12); the other holds 8, so this rank re-reads
    the state at 8 -- damaged (torn). The 8 pages that lost are the damaged object's, only the 4
    the other rank lacked a disagreement: all 12 were counted ``rank_disagreement``, sending an
    operator to look for a rank bug instead of at L3."""
    from controller_support import open_cache, serve, tokens
    from test_controller_skips import _damage

    sets = ["parallel.tp_rank=0", "parallel.tp_size=2", "policy.prefetch.policy=wait_complete"]
    request = tokens(24, 12)
    with open_cache("hybrid-mamba", tmp_path, sets, collective=_Peer()) as writer:
        serve(writer, request[: 8 * 64])
        lease, _ = serve(writer, request)
        writer.flush()
        _damage(writer, "mamba", lease.page_hashes[7])  # the state at page 8
    with open_cache("hybrid-mamba", tmp_path, sets, collective=_Peer(8, 8)) as cold:
        lease = cold.lookup(request)
        cold.admit(lease)
        assert lease.cached_pages == 0
        assert lease.skipped == {"rank_disagreement": 4, "damaged_object": 8}
        assert cold.metrics.corrupt_detected >= 1
        cold.release(lease)
