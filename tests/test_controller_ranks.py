"""Two ranks (two processes, torch.distributed gloo on loopback) agree on L3 prefetch lengths:
where one rank misses a window page both drop the prefetch, where both hold it both adopt it;
and on a device prefix every rank holds whole (a state at its end on each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from controller_support import DEVICE, REPO
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
    for case, seed in (("one_rank_misses", 21), ("both_hold", 22)):
        with open_cache("swa", l3, sets, collective=TorchCollective()) as writer:
            lease, _ = serve(writer, tokens(seed, 8))
            writer.flush()
            if case == "one_rank_misses" and rank == 1:
                (keys,) = writer.engine.object_keys("swa", lease.page_hashes[6:7])
                writer.backend.path_for(keys[0]).unlink()
        dist.barrier()
        with open_cache("swa", l3, sets, collective=TorchCollective()) as cold:
            lease, bad = serve(cold, tokens(seed, 8))
            ops = cold.metrics.snapshot()["operations"]
            report[case] = {"storage": lease.hit_pages["storage"], "bad": bad,
                            "dropped": ops["prefetches_dropped"], "committed": ops["prefetches_committed"],
                            "skipped": lease.skipped}
        dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(report))
    """
)


def _run_ranks(script: str, tmp_path: Path) -> list[dict]:
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
            out, err = process.communicate(timeout=240)
            assert process.returncode == 0, err[-3000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    return reports


def test_two_ranks_drop_or_adopt_a_prefetch_together(tmp_path: Path) -> None:
    reports = _run_ranks(RANK, tmp_path)
    for rank, report in enumerate(reports):
        missed, held = report["one_rank_misses"], report["both_hold"]
        assert missed["storage"] == 0, f"rank {rank} used a prefetch another rank could not complete"
        assert held["storage"] == 8 and held["committed"] == 1, f"rank {rank} did not adopt a full prefetch"
        assert missed["bad"] == 0 and held["bad"] == 0
    assert reports[0]["one_rank_misses"]["dropped"] == 1, "rank 0 read the pages and dropped them"
    assert reports[0]["one_rank_misses"]["skipped"] == {"rank_disagreement": 8}, "the drop says why"
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
