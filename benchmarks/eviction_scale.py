"""Whether a request on a full cache costs the same at 1,000 cached nodes as at 10,000.

Once the device tier is full every allocation evicts, and every eviction once ranked every node
of its tier (the LRU order, write-back's choice of backups): 79 ms per request at 10,000
device nodes against 1.3 ms at 1,000. This replays requests of 4 new pages each (lookup, admit,
allocate, insert; no L3, no copies worth timing: tiny buffers) on caches filled to a small and
a large number of device nodes (host tier twice the device), per stack and write policy, and
prints the median controller time per request at each size. Baseline: the same stack and policy
at the small size, in the same run; the ratio should stay near 1 (a cost per eviction that grows
with the tier shows as ~10x). Wall time of the calling thread, median of ``--requests``.

    python benchmarks/eviction_scale.py [--sizes 1000 10000] [--requests 300] [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch
from _results import Figure, write_results

import kvstrata

PAGE = 16
PAGES_PER_REQUEST = 4
_KV = {"type": "kv", "layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "bfloat16"}
#: stack -> its pools, with tiny buffers (the controller's cost, not the copies)
STACKS = {
    "kv": lambda nodes: {"kv": _KV},
    "swa": lambda nodes: {"full": _KV, "swa": {**_KV, "type": "swa", "window": 2 * PAGE}},
    "hybrid-mamba": lambda nodes: {
        "kv": _KV,
        "mamba": {
            "type": "mamba",
            "layers": 1,
            "states": {"conv": {"shape": [3, 8]}, "ssm": {"shape": [2, 4, 4], "dtype": "float32"}},
            "device_units": nodes,  # a state per request: as many nodes as the kv tier holds
            "host_units": 2 * nodes,
        },
    },
}
POLICIES = ("write_through", "write_back", "write_through_selective")


def _request(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (PAGES_PER_REQUEST * PAGE,), generator=generator)


def _serve(cache: kvstrata.CacheController, request: torch.Tensor) -> None:
    lease = cache.lookup(request)
    cache.admit(lease)
    cache.allocate(lease)
    cache.insert(lease)


def per_request(stack: str, policy: str, nodes: int, requests: int) -> tuple[float, int]:
    """(median seconds per request, device nodes) on a cache full at ``nodes`` device nodes."""
    tokens = nodes * PAGES_PER_REQUEST * PAGE
    config = {
        "model": {"name": f"bench-{stack}", "page_size": PAGE, "pools": STACKS[stack](nodes)},
        "tiers": {
            "device": {"capacity_tokens": tokens},
            "host": {"capacity_tokens": 2 * tokens},
            "storage": {},
        },
        "policy": {"write": policy},
    }
    with kvstrata.open(config, environ={}) as cache:
        for i in range(3 * nodes):  # both tiers full: every later request evicts
            _serve(cache, _request(10**6 + i))
        gc.collect()
        times = []
        for i in range(requests):
            start = time.perf_counter()
            _serve(cache, _request(5 * 10**7 + i))
            times.append(time.perf_counter() - start)
        held = len(cache.tree.holding(cache.tree.pools[0].name, "device"))
    return statistics.median(times), held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs=2, metavar=("SMALL", "LARGE"), help="device nodes")
    parser.add_argument("--requests", type=int, help="timed requests per cache (default 300; --quick 100)")
    parser.add_argument("--stacks", nargs="+", choices=sorted(STACKS), default=list(STACKS))
    parser.add_argument("--quick", action="store_true", help="CI-sized: 500 and 5,000 nodes, 100 requests")
    parser.add_argument("--json", type=Path, help="also write the figures (benchmarks/README.md convention)")
    args = parser.parse_args()
    small, large = args.sizes or ((500, 5000) if args.quick else (1000, 10000))
    requests = args.requests or (100 if args.quick else 300)
    if not 0 < small < large:
        parser.error(f"--sizes must be two growing positive numbers, got {small} {large}")
    print(f"ms per request of {PAGES_PER_REQUEST} new pages on a full cache, median of {requests}")
    print(f"{'stack':>13} {'policy':>24} {small:>8,} {large:>8,}  ratio (goal ~1)")
    figures: list[Figure] = []
    for stack in args.stacks:
        for policy in POLICIES:
            base, _ = per_request(stack, policy, small, requests)
            cost, held = per_request(stack, policy, large, requests)
            ratio = f"{cost / base:5.2f}x ({held:,} nodes)"
            print(f"{stack:>13} {policy:>24} {base * 1e3:8.3f} {cost * 1e3:8.3f}  {ratio}")
            metric = f"{stack} {policy}: request on a full cache of {large:,} device nodes"
            label = f"the same at {small:,} nodes"
            figures.append(Figure.against(metric, cost * 1e3, "ms", base * 1e3, label))
    if args.json:
        write_results(args.json, "eviction_scale", figures)


if __name__ == "__main__":
    main()
