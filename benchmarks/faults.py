"""Replay throughput while the L3 is down, against the same replay with no L3 configured.

A storage cache must not slow the tiers above it down when its storage dies: the RPC deadlines
and the circuit breaker keep a dead Mooncake master off the request path, so the replay should
run at (nearly) the speed of a cache that never had an L3. Acceptance (issue 15): the ratio for a
killed master is at least 0.8.

Every run uses the same stack (KV only, 16 bytes per token, 512-token pages, device 256k tokens,
host 1M tokens, write-through) and the same requests of the conversation trace. Each fault is
measured in pairs against ``no L3`` (``tiers.storage`` empty): both caches open side by side in
one fresh process (one Mooncake client per process) and the requests replayed through both in
chunks of 50, the order alternating chunk by chunk, so load on the shared machine hits both sides
alike (whole runs a few seconds apart differed by up to 5x here):

- ``master killed``: a real ``mooncake_master`` on loopback, the cache opened against it, then the
  master SIGKILLed by PID before the replay starts (calls are refused at once);
- ``master stopped``: the same with SIGSTOP (calls hang until their 1 s RPC deadline; the breaker
  opens after 3 and lets one trial through every ``cooldown_s`` = 5 s, which can stall a request
  up to the prefetch timeout) -- the harder case. Its cost is a fixed ~3 s (the calls that time out
  before the breaker opens; each blocks a request's admit) plus a trial stall per cooldown of real
  time, so its ratio grows with the run's length and is pessimistic in a ``--quick`` run;
- ``L3 healthy``: the master left running (what a working L3 costs), for scale.

A figure is the mean over its pairs (fresh processes) of the fault's throughput, against the mean
of the paired ``no L3`` sides; every pair's ratio is printed.

    python benchmarks/faults.py [--quick] [--limit N] [--pairs N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _results import Figure, write_results
from _traces import find_trace

from kvstrata.core.config import validate_config
from kvstrata.core.controller import CacheController
from kvstrata.plugins.host import PluginHost
from kvstrata.replay.driver import replay_with_cache
from kvstrata.replay.tokens import BlockTokenizer
from kvstrata.replay.trace import TraceRequest, read_trace
from kvstrata.testing.mooncake_servers import MooncakeMaster

QUICK_REQUESTS = 500
DEFAULT_REQUESTS = 2000
PAGE = 512
ACCEPTANCE = 0.8
#: Requests replayed on one side of a pair before the other side's turn.
CHUNK = 50
FAULTS = ("master killed", "master stopped", "L3 healthy")


def stack(storage: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {
            "name": f"bench-faults-{uuid.uuid4().hex[:8]}",  # a fresh namespace per run
            "page_size": PAGE,
            "pools": {"kv": {"type": "kv", "layers": 1, "kv_heads": 1, "head_dim": 4}},
        },
        "tiers": {
            "device": {"capacity_tokens": 256 * 1024},
            "host": {"capacity_tokens": 1024 * 1024},
            "storage": storage,
        },
        "policy": {"write": "write_through"},
    }


@contextmanager
def open_cache(run: str) -> Iterator[tuple[Any, MooncakeMaster | None]]:
    """A cache for ``run`` (with its own master unless ``no L3``), broken as ``run`` says; on
    exit the cache is closed (against the broken master: it must not hang) and the master stopped."""
    host = PluginHost()
    master = None if run == "no L3" else MooncakeMaster(client_ttl_s=120).start()
    pid = master.process.pid if master is not None else None
    stopped = False
    try:
        storage = {}
        if master is not None:
            fields = master.backend_config(segment_bytes=512 << 20, local_buffer_bytes=0).model_dump(
                mode="json"
            )
            storage = {"l3": {**fields, "rpc_timeout_s": 1, "connect_timeout_s": 1}}
        config = validate_config(stack(storage), host, f"benchmark stack {run!r}")
        with CacheController(config, host) as cache:
            if run == "master killed" and master is not None and pid is not None:
                os.kill(pid, signal.SIGKILL)
                master.process.popen.wait(timeout=10)  # type: ignore[union-attr]
            elif run == "master stopped" and pid is not None:
                os.kill(pid, signal.SIGSTOP)
                stopped = True
            yield cache, master
    finally:
        if master is not None:
            if stopped and pid is not None:
                os.kill(pid, signal.SIGCONT)
            master.stop()


class Side:
    """One cache of a pair and what its chunks measured."""

    def __init__(self, cache: CacheController) -> None:
        self.cache = cache
        self.tokenizer = BlockTokenizer(PAGE)
        self.served_tokens = 0.0
        self.wall_s = 0.0
        self.failures = self.corrupt = 0
        self.storage: dict[str, int] = {}

    def replay(self, chunk: list[TraceRequest]) -> None:
        result, details = replay_with_cache(self.cache, chunk, tokenizer=self.tokenizer)
        self.served_tokens += result.tokens_per_s * result.wall_s
        self.wall_s += result.wall_s
        self.failures += result.failures
        self.corrupt += result.corrupt_pages_served
        for name, value in details.storage.items():
            self.storage[name] = self.storage.get(name, 0) + value

    def summary(self) -> dict[str, Any]:
        return {
            "tokens_per_s": self.served_tokens / self.wall_s,
            "failures": self.failures,
            "corrupt_pages_served": self.corrupt,
            "breaker_trips": self.storage.get("breaker_trips", 0),
            "breaker_rejected": self.storage.get("breaker_rejected", 0),
        }


def one_pair(run: str, limit: int) -> dict[str, Any]:
    """``no L3`` and ``run`` open side by side in this (child) process, the requests replayed
    through both in chunks of ``CHUNK`` with the order alternating, so load on the machine hits
    both sides alike; each side's throughput is its served tokens over its own wall time."""
    requests = read_trace(find_trace("conversation_trace.jsonl"), limit=limit)
    with open_cache("no L3") as (plain, _), open_cache(run) as (faulty, _):
        sides = {"no L3": Side(plain), run: Side(faulty)}
        for index, start in enumerate(range(0, len(requests), CHUNK)):
            chunk = requests[start : start + CHUNK]
            order = list(sides.values()) if index % 2 == 0 else list(reversed(sides.values()))
            for side in order:
                side.replay(chunk)
    return {name: side.summary() for name, side in sides.items()}


def measure(run: str, limit: int) -> dict[str, Any]:
    """``one_pair`` in a fresh interpreter (its result comes back as the last stdout line)."""
    proc = subprocess.run(
        [sys.executable, __file__, "--pair", run, "--limit", str(limit)],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"run {run!r} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="write results in the benchmarks/README.md format")
    parser.add_argument("--quick", action="store_true", help=f"first {QUICK_REQUESTS} requests, 2 pairs")
    parser.add_argument("--limit", type=int, help=f"first N requests (default {DEFAULT_REQUESTS})")
    parser.add_argument("--pairs", type=int, help="pairs per fault (default 3, quick 2)")
    parser.add_argument("--pair", choices=FAULTS, help=argparse.SUPPRESS)  # internal: one child
    args = parser.parse_args()
    limit = args.limit or (QUICK_REQUESTS if args.quick else DEFAULT_REQUESTS)
    if args.pair:
        print(json.dumps(one_pair(args.pair, limit)))
        return
    pairs = args.pairs or (2 if args.quick else 3)

    print(f"conversation trace, first {limit:,} requests; {pairs} pairs per fault (fault vs no L3)")
    figures, served, ratios = [], 0, {}
    for run in FAULTS:
        measured = []
        for index in range(pairs):
            print(f"  {run}: pair {index + 1}/{pairs} ...", file=sys.stderr, flush=True)
            measured.append(measure(run, limit))
        fault = sum(m[run]["tokens_per_s"] for m in measured) / pairs
        baseline = sum(m["no L3"]["tokens_per_s"] for m in measured) / pairs
        served += sum(m[name]["corrupt_pages_served"] for m in measured for name in m)
        ratios[run] = fault / baseline
        last = measured[-1][run]
        each = ", ".join(f"{m[run]['tokens_per_s'] / m['no L3']['tokens_per_s']:.2f}" for m in measured)
        print(
            f"{run:15s} {fault:12,.0f} tokens/s vs {baseline:12,.0f} without L3: ratio {ratios[run]:.2f} "
            f"(pairs: {each}); failures {last['failures']:,}, breaker trips {last['breaker_trips']}, "
            f"rejected {last['breaker_rejected']:,}"
        )
        figures.append(
            Figure.against(f"replay throughput, {run}", fault, "tokens/s", baseline, "no L3 configured")
        )
    killed = ratios["master killed"]
    verdict = "meets" if killed >= ACCEPTANCE else "MISSES"
    print(f"acceptance: throughput with the master killed / no L3 = {killed:.2f} ({verdict} >= {ACCEPTANCE})")
    if args.json:
        write_results(args.json, "faults", figures)
    if served:
        raise SystemExit(f"{served} corrupt pages served")


if __name__ == "__main__":
    main()
