"""Prefix tree: kvstrata's ``PrefixTree`` vs SGLang 0.5.23's radix trees, each side in its own process.

Sides (the ratio of each row is taken against the faster SGLang cache of that row):

* **kvstrata**: ``PrefixTree`` with one KV anchor pool; keys from ``PrefixTree.keys_of`` (inside
  the timing: building keys is part of the work, as building a ``RadixKey`` is for SGLang), match
  plus ``values`` of the device path.
* **RadixCache**: SGLang's pure-Python tree (``create_simulated``), loaded by ``benchmarks/tree.py``'s
  loader (``sglang/__init__`` not executed, GPU-only modules stubbed); ``match_prefix`` plus
  ``path_device_indices``, ``insert``.
* **UnifiedRadixCache**: the class SGLang serves with, full-KV component, its **Rust tree core**
  (``tree_core_backend="rust"``); ``match_prefix`` plus ``path_device_indices``, ``insert``.
* **Rust core binding**: ``RustUnifiedTreeCoreBinding`` (``rust_tree_core``) driven directly with
  the calls UnifiedRadixCache's adapter makes, minus its Python: a floor, reported as its own
  column; the goals are ratios to the faster of RadixCache and UnifiedRadixCache.

Workloads (the same tokens for every side, from one seed): sequences made of a system prompt
(1/4 of the tokens, 40 of them), in 60% of them a shared document (3/8, 400 of them) and a unique
tail; 1024 tokens per sequence at page size 64, 256 at page size 1 (100k sequences of 1024
tokens at page size 1, on four sides and five rounds, would not fit this machine's time budget). Per
(page size, sequences) the worker times, in one process, on fresh trees:

* ``insert``: every sequence into an empty tree;
* ``match``: every sequence against that tree (all hits) and its device indices gathered;
* ``match+insert``: a request's path -- match, gather, insert -- on a fresh tree.

Each side is a long-lived worker subprocess (its own interpreter, GIL and allocator); the driver
interleaves sides per round (order rotating) and prints medians with min-max of each side's
thread CPU time (the machine is shared: the wall clock also counts other processes' time), and
the ratio kvstrata / the faster SGLang cache.

Two more rows, each measured in a fresh process per round:

* ``memory``: RSS growth from an empty tree to one holding the page-1 sequences (value tensors
  created per sequence and handed to the tree, so both sides count what they keep);
* ``demote``: kvstrata alone, page size 64, every sequence one shared system prompt and a unique
  tail (a wide node: every tail is a child of it) -- every node backed up on host, then the whole
  device tier evicted (each leaf demoted to host-only, its parent a candidate in turn); cost per
  sequence at 10x the sequences over the cost at 1x (goal: linear, <= 1.5).

Goals (issue 16): page 64, 10k sequences: each time <= 0.8 of the best peer; page 1: <= 1.0;
memory <= 1.0; demote growth <= 1.5.

    PYTHONPATH=src python benchmarks/peers/tree.py [--quick] [--rounds N] [--json OUT]
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the shared results helpers, tree.py's loader

from _results import Figure, write_results  # noqa: E402

#: the SGLang caches as its scheduler drives them: the goals are ratios to the faster of these
PEERS = ("RadixCache", "UnifiedRadixCache")
#: the Rust core's binding without UnifiedRadixCache's Python around it: a floor, reported apart
FLOOR = "URC-Rust"
SIDES = ("kvstrata", *PEERS, FLOOR)
SEED = 0


def seq_tokens(page: int) -> int:
    return 1024 if page > 1 else 256


def workload(
    sequences: int, tokens: int, seed: int = SEED, systems_count: int = 40, with_document: float = 0.6
) -> list[array]:
    """The sequences as ``array('q')`` (what SGLang's ``RadixKey`` holds); numpy draws them fast."""
    import numpy as np

    rng = np.random.default_rng(seed)
    system_len, doc_len = tokens // 4, tokens * 3 // 8
    systems = rng.integers(0, 32000, (systems_count, system_len), dtype=np.int64)
    documents = rng.integers(0, 32000, (400, doc_len), dtype=np.int64)
    which_system = rng.integers(0, systems_count, sequences)
    has_doc = rng.random(sequences) < with_document
    which_doc = rng.integers(0, 400, sequences)
    tails = rng.integers(0, 32000, (sequences, tokens), dtype=np.int64)
    out = []
    for i in range(sequences):
        parts = [systems[which_system[i]]]
        if has_doc[i]:
            parts.append(documents[which_doc[i]])
        used = sum(len(p) for p in parts)
        parts.append(tails[i, : tokens - used])
        out.append(array("q", np.concatenate(parts).tobytes()))
    return out


# --- the sides (each runs in its own worker process) ---------------------------------------------


class Side:
    """One tree implementation: ``fresh`` makes an empty tree; the rest act on the current one."""

    def __init__(self, page: int) -> None:
        self.page = page

    def fresh(self) -> None: ...

    def insert(self, tokens: array, value: Any) -> None: ...

    def match(self, tokens: array) -> int: ...  # device hit, in tokens

    def values(self, count: int, tokens: int) -> list[Any]:
        """Per-sequence value tensors: unit indices, one per token (SGLang) or page (kvstrata)."""
        import torch

        per = tokens if self.name_units() == "token" else tokens // self.page
        return [torch.arange(i * per, (i + 1) * per) for i in range(count)]

    def name_units(self) -> str:
        return "token"


class KvstrataSide(Side):
    def __init__(self, page: int) -> None:
        super().__init__(page)
        from kvstrata.core.tree import PrefixTree
        from kvstrata.plugins.pool_type import ModelContext
        from kvstrata.pool_types.kv import KVConfig, KVPoolType

        self._tree_class = PrefixTree
        self._spec = KVPoolType(
            "kv", KVConfig(layers=1, kv_heads=1, head_dim=8), ModelContext(page_size=page)
        ).spec()
        self.tree: Any = None

    def name_units(self) -> str:
        return "page"

    def fresh(self) -> None:
        self.tree = self._tree_class([self._spec])

    def insert(self, tokens: array, value: Any) -> None:
        tree = self.tree
        tree.insert(tree.keys_of(tokens), {"kv": value})

    def match(self, tokens: array) -> int:
        tree = self.tree
        result = tree.match(tree.keys_of(tokens))
        return len(tree.values(result.device_path, "kv")) * self.page

    def match_insert(self, tokens: array, value: Any) -> int:
        tree = self.tree
        keys = tree.keys_of(tokens)
        result = tree.match(keys)
        hit = len(tree.values(result.device_path, "kv")) * self.page
        tree.insert(keys, {"kv": value})
        return hit


@functools.cache
def radix_cache_module() -> Any:
    """SGLang's ``radix_cache``, imported once per process by ``benchmarks/tree.py``'s loader."""
    import tree as tree_benchmark

    site = os.path.dirname(importlib.util.find_spec("sglang").submodule_search_locations[0])  # type: ignore[union-attr,index]
    return tree_benchmark.load_sglang(site)[0]


class RadixCacheSide(Side):
    def __init__(self, page: int) -> None:
        super().__init__(page)
        module = radix_cache_module()
        base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
        self._cls, self._key = module.RadixCache, module.RadixKey
        self._match_params, self._insert_params = base.MatchPrefixParams, base.InsertParams
        self.cache: Any = None

    def fresh(self) -> None:
        self.cache = self._cls.create_simulated(page_size=self.page)

    def insert(self, tokens: array, value: Any) -> None:
        self.cache.insert(self._insert_params(key=self._key(tokens), value=value))

    def match(self, tokens: array) -> int:
        result = self.cache.match_prefix(self._match_params(key=self._key(tokens)))
        return len(self.cache.path_device_indices(result.last_device_node))

    def match_insert(self, tokens: array, value: Any) -> int:
        hit = self.match(tokens)
        self.insert(tokens, value)
        return hit


@functools.cache
def unified_radix_cache_modules() -> tuple[Any, Any, Any]:
    """``unified_radix_cache``, ``cache_init_params`` and ``component_type``, imported once.

    On top of ``radix_cache_module``'s loader: the model-config, layer, executor and manager
    packages it imports at module level (the model stack; none of it runs for a full-KV tree
    without memory pools) and the missing third-party modules are served as stubs, printed on
    stderr. ``page_interleave_shard_size`` (from the stubbed allocator package) is SGLang's own
    answer for a tree without an allocator: 1.
    """
    import tree as tree_benchmark

    radix_cache_module()
    stubs = {"sglang.srt.configs", "sglang.srt.model_executor", "sglang.srt.layers", "sglang.srt.managers"}
    finder = tree_benchmark._StubFinder(set(tree_benchmark.SGLANG_STUBS) | stubs)
    sys.meta_path.insert(0, finder)
    try:
        for _ in range(50):
            try:
                module = importlib.import_module("sglang.srt.mem_cache.unified_radix_cache")
                break
            except ModuleNotFoundError as exc:
                name = exc.name or ""
                if not name or name.startswith(("sglang", "torch")) or name.split(".")[0] in finder.names:
                    raise
                finder.names.add(name.split(".")[0])
                print(f"UnifiedRadixCache import: stubbed {name.split('.')[0]}", file=sys.stderr)
    finally:
        sys.meta_path.remove(finder)
    module.page_interleave_shard_size = lambda allocator: 1
    params = importlib.import_module("sglang.srt.mem_cache.cache_init_params")
    components = importlib.import_module("sglang.srt.mem_cache.unified_cache.component_type")
    return module, params, components


class _DiscardingAllocator:
    """Where UnifiedRadixCache returns the duplicate device indices of an insert (kvstrata hands
    them back in its insert result, RadixCache leaves them to the caller): nothing to free here."""

    device = "cpu"

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        pass

    def free(self, indices: Any) -> None:
        pass


class UnifiedRadixCacheSide(Side):
    """SGLang's ``UnifiedRadixCache`` as its scheduler uses it, Rust tree core, full KV only."""

    def __init__(self, page: int) -> None:
        super().__init__(page)
        self._module, self._params, self._components = unified_radix_cache_modules()
        base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
        self._key = radix_cache_module().RadixKey
        self._match_params, self._insert_params = base.MatchPrefixParams, base.InsertParams
        self.cache: Any = None

    def fresh(self) -> None:
        params = self._params.CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=_DiscardingAllocator(),
            page_size=self.page,
            tree_components=(self._components.ComponentType.FULL,),
            tree_core_backend="rust",
        )
        self.cache = self._module.UnifiedRadixCache(params)
        if type(self.cache.tree_core).__name__ != "RustUnifiedTreeCore":
            raise SystemExit(
                f"UnifiedRadixCache built {type(self.cache.tree_core).__name__}, not the Rust core"
            )

    def insert(self, tokens: array, value: Any) -> None:
        self.cache.insert(self._insert_params(key=self._key(tokens), value=value))

    def match(self, tokens: array) -> int:
        result = self.cache.match_prefix(self._match_params(key=self._key(tokens)))
        return len(self.cache.path_device_indices(result.last_device_node))

    def match_insert(self, tokens: array, value: Any) -> int:
        hit = self.match(tokens)
        self.insert(tokens, value)
        return hit


class RustCoreSide(Side):
    def __init__(self, page: int) -> None:
        super().__init__(page)
        from kvstrata.testing.sglang_cpu import load_sglang_mem_cache

        load_sglang_mem_cache()
        self.b = importlib.import_module("sglang.srt.mem_cache.rust_tree_core.extension").bindings
        self.core: Any = None

    def fresh(self) -> None:
        b = self.b
        init = b.TreeCoreInitParamsBinding(  # what the adapter passes for an LRU, full-KV-only tree
            eviction_policy="lru",
            slru_protected_threshold=2,
            tlru_tail_budget=0,
            tlru_float_config=None,
            page_size=self.page,
            is_write_back=False,
            enable_hicache=False,
            write_through_threshold=256,
            device="cpu",
            swa_sliding_window_size=None,
            swa_req_ring=False,
            enable_kv_cache_events=False,
            dynamo_kv_event_format=False,
            mamba_cache_chunk_size=None,
            mamba_max_states_per_path=None,
        )
        self.core = b.RustUnifiedTreeCoreBinding(init, [0])  # ComponentType.FULL
        self.root = self.core.root_node_handle()

    def insert(self, tokens: array, value: Any) -> None:
        self.core.insert(
            self.b.InsertParamsBinding(
                key=tokens,
                value=value,
                extra_key=None,
                cache_salt=None,
                session_id=None,
                mamba_value=None,
                prev_prefix_len=0,
                swa_evicted_seqlen=0,
                swa_branching_seqlen=None,
                inserted_len=0,
                priority=0,
                track_adopted_ranges=False,
                rotation_base=None,
            )
        )

    def match(self, tokens: array) -> int:
        result = self.core.match_prefix(
            self.b.MatchParamsBinding(key=tokens, extra_key=None, cache_salt=None)
        )
        return len(self.core.collect_full_device_indices(result.last_device_node_id, self.root))

    def match_insert(self, tokens: array, value: Any) -> int:
        hit = self.match(tokens)
        self.insert(tokens, value)
        return hit


SIDE_CLASSES: dict[str, Callable[[int], Side]] = {
    "kvstrata": KvstrataSide,
    "RadixCache": RadixCacheSide,
    "UnifiedRadixCache": UnifiedRadixCacheSide,
    "URC-Rust": RustCoreSide,
}


def _cpu() -> float:
    return time.thread_time()


def time_workload(side: Any, seqs: list[array], values: list[Any]) -> dict[str, Any]:
    """The three timed phases on fresh trees (see the module docstring)."""
    out: dict[str, Any] = {}
    side.fresh()
    gc.collect()
    wall, cpu = time.perf_counter(), _cpu()
    for tokens, value in zip(seqs, values, strict=True):
        side.insert(tokens, value)
    out["insert"] = (_cpu() - cpu, time.perf_counter() - wall)
    wall, cpu, hit = time.perf_counter(), _cpu(), 0
    for tokens in seqs:
        hit += side.match(tokens)
    out["match"] = (_cpu() - cpu, time.perf_counter() - wall)
    out["match_hits"] = hit
    side.fresh()
    gc.collect()
    wall, cpu, hit = time.perf_counter(), _cpu(), 0
    for tokens, value in zip(seqs, values, strict=True):
        hit += side.match_insert(tokens, value)
    out["match+insert"] = (_cpu() - cpu, time.perf_counter() - wall)
    out["match+insert_hits"] = hit
    side.fresh()
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_workload(side: Any, seqs: list[array], tokens: int) -> dict[str, Any]:
    """RSS growth holding every sequence; each value tensor is made here and kept by the tree only."""
    import torch

    per = tokens if side.name_units() == "token" else tokens // side.page
    side.fresh()
    gc.collect()
    before = rss_bytes()
    for i, seq in enumerate(seqs):
        side.insert(seq, torch.arange(i * per, (i + 1) * per))
    gc.collect()
    return {"rss": rss_bytes() - before}


def demote_workload(seqs: list[array], page: int) -> dict[str, Any]:
    """kvstrata only: back every node up on host, then evict the whole device tier (demotions)."""
    import torch

    side = KvstrataSide(page)
    side.fresh()
    tree = side.tree
    per = len(seqs[0]) // page
    for i, seq in enumerate(seqs):
        tree.insert(tree.keys_of(seq), {"kv": torch.arange(i * per, (i + 1) * per)})
    for node in tree.nodes():
        tree.set_host_value(node, "kv", torch.arange(node.pages))
    total = tree.units("kv", "device")
    gc.collect()
    wall, cpu = time.perf_counter(), _cpu()
    result = tree.evict_device({"kv": total})
    seconds = (_cpu() - cpu, time.perf_counter() - wall)
    if len(result.demoted) == 0 or tree.units("kv", "device") != 0:
        raise SystemExit("demote: the device tier was not emptied")
    return {"demote": seconds, "demoted": len(result.demoted)}


def worker_main(args: argparse.Namespace) -> None:
    """Answer one JSON line per command read from stdin: ``time PAGE N`` / ``memory PAGE N`` /
    ``demote PAGE N`` / ``quit``."""
    import torch

    torch.set_num_threads(1)
    sides: dict[int, Any] = {}
    cache: dict[tuple[int, int], tuple[list[array], list[Any]]] = {}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "quit":
            break
        op, page, n = command[0], int(command[1]), int(command[2])
        tokens = seq_tokens(page)
        if op == "demote":
            # one system prompt, no documents: every sequence's tail is a child of one node
            answer = demote_workload(workload(n, tokens, systems_count=1, with_document=0.0), page)
        else:
            if page not in sides:
                sides[page] = SIDE_CLASSES[args.worker](page)
            side = sides[page]
            if op == "memory":
                answer = memory_workload(side, workload(n, tokens), tokens)
            else:
                if (page, n) not in cache:
                    cache.clear()
                    seqs = workload(n, tokens)
                    cache[(page, n)] = (seqs, side.values(n, tokens))
                    gc.collect()
                    gc.freeze()  # the workload is not part of either tree: keep it out of GC passes
                seqs, values = cache[(page, n)]
                answer = time_workload(side, seqs, values)
        print(json.dumps(answer), flush=True)


# --- the driver ----------------------------------------------------------------------------------


class Worker:
    """One worker subprocess and the commands sent to it."""

    def __init__(self, name: str, python: str) -> None:
        env = dict(os.environ)
        src = str(HERE.parents[1] / "src")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
        self.name = name
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--worker", name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name} worker exited (status {self.proc.wait()}); see its stderr above")
        return json.loads(line)

    def run(self, op: str, page: int, n: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{op} {page} {n}\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it exited already (its error is on stderr)
        self.proc.wait(timeout=120)


def once(name: str, python: str, op: str, page: int, n: int) -> dict[str, Any]:
    """One command in a fresh worker (memory and demote: nothing left from earlier rounds)."""
    worker = Worker(name, python)
    try:
        return worker.run(op, page, n)
    finally:
        worker.close()


def spread(values: list[float], scale: float = 1.0) -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):.3g} ({min(v):.3g}-{max(v):.3g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CI-sized: 1k and 10k sequences, 3 rounds, memory and demote once",
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 5, quick 3)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="sequence counts")
    parser.add_argument("--pages", type=int, nargs="+", default=[64, 1], help="page sizes")
    parser.add_argument("--memory-seqs", type=int, default=None, help="page-1 sequences for the memory row")
    parser.add_argument("--demote-seqs", type=int, default=None, help="the 1x of the demote row (10x too)")
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter of the SGLang workers")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return
    rounds = args.rounds or (3 if args.quick else 5)
    sizes = args.sizes or ([1000, 10_000] if args.quick else [1000, 10_000, 100_000])
    memory_seqs = args.memory_seqs or (10_000 if args.quick else 100_000)
    demote_seqs = args.demote_seqs or (1000 if args.quick else 10_000)
    pythons = {"kvstrata": sys.executable, **{p: args.peer_python for p in (*PEERS, FLOOR)}}
    workers = {name: Worker(name, python) for name, python in pythons.items()}
    times: dict[tuple[int, int, str, str], list[float]] = {}
    walls: dict[tuple[int, int, str, str], list[float]] = {}
    hits: dict[tuple[int, int, str], set[int]] = {}
    try:
        for r in range(rounds):
            for page in args.pages:
                for n in sizes:
                    order = SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]
                    for name in order:
                        answer = workers[name].run("time", page, n)
                        for phase in ("insert", "match", "match+insert"):
                            times.setdefault((page, n, phase, name), []).append(answer[phase][0])
                            walls.setdefault((page, n, phase, name), []).append(answer[phase][1])
                        for phase in ("match", "match+insert"):
                            hits.setdefault((page, n, phase), set()).add(answer[f"{phase}_hits"])
            print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    for key, found in hits.items():
        if len(found) != 1:
            raise SystemExit(f"sides disagree on device hit tokens for {key}: {sorted(found)}")
    memory: dict[str, list[float]] = {}
    demote: dict[int, list[float]] = {}
    for r in range(1 if args.quick else min(rounds, 3)):
        for name in SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]:
            memory.setdefault(name, []).append(once(name, pythons[name], "memory", 1, memory_seqs)["rss"])
        for n in (demote_seqs, demote_seqs * 10):
            answer = once("kvstrata", sys.executable, "demote", 64, n)
            demote.setdefault(n, []).append(answer["demote"][0] / n)
    print(
        f"prefix tree, {rounds} rounds interleaved, each side in its own process; thread CPU us per"
        f" sequence, median (min-max); ratio = kvstrata / faster of RadixCache and UnifiedRadixCache"
        f" (goal); floor = kvstrata / the Rust core's bare binding"
    )
    columns = ("kvstrata", "RadixCache", "UnifiedRadixCache", "Rust core binding")
    print(f"{'workload':<30} " + " ".join(f"{c:>21}" for c in columns) + f" {'ratio':>6} {'floor':>6}  goal")
    figures = []
    for page in args.pages:
        for n in sizes:
            for phase in ("insert", "match", "match+insert"):
                med = {s: statistics.median(times[(page, n, phase, s)]) for s in SIDES}
                best = min(PEERS, key=lambda s: med[s])
                ratio = med["kvstrata"] / med[best]
                floor = med["kvstrata"] / med[FLOOR]
                goal = 1.0 if page == 1 else 0.8
                met = "met" if ratio <= goal else "NOT met"
                label = f"page {page}, {n // 1000}k seqs, {phase}"
                cells = " ".join(f"{spread(times[(page, n, phase, s)], 1e6 / n):>21}" for s in SIDES)
                goal_text = f"<= {goal:g} ({met}, vs {best})" if n == 10_000 or page == 1 else f"(vs {best})"
                print(f"{label:<30} {cells} {ratio:>6.2f} {floor:>6.2f}  {goal_text}")
                metric = f"prefix tree {phase}, page {page}, {n} x {seq_tokens(page)}-token seqs (CPU us/seq)"
                figures.append(
                    Figure.against(
                        metric, med["kvstrata"] / n * 1e6, "us/seq", med[best] / n * 1e6, f"SGLang {best}"
                    )
                )
    mib = 1 / (1 << 20)
    mem_med = {s: statistics.median(memory[s]) for s in SIDES}
    best = min(PEERS, key=lambda s: mem_med[s])
    ratio = mem_med["kvstrata"] / mem_med[best]
    cells = " ".join(f"{spread(memory[s], mib):>21}" for s in SIDES)
    label = f"RSS MiB, {memory_seqs // 1000}k page-1 seqs"
    floor = mem_med["kvstrata"] / mem_med[FLOOR]
    met = "met" if ratio <= 1 else "NOT met"
    print(f"{label:<30} {cells} {ratio:>6.2f} {floor:>6.2f}  <= 1 ({met}, vs {best})")
    figures.append(
        Figure.against(
            f"RSS growth, {memory_seqs} page-1 seqs",
            mem_med["kvstrata"] * mib,
            "MiB",
            mem_med[best] * mib,
            f"SGLang {best}",
        )
    )
    small, large = (statistics.median(demote[n]) for n in (demote_seqs, demote_seqs * 10))
    growth = large / small
    print(
        f"demote (kvstrata), us per seq: {demote_seqs}: {spread(demote[demote_seqs], 1e6)};"
        f" {demote_seqs * 10}: {spread(demote[demote_seqs * 10], 1e6)}; growth {growth:.2f}"
        f" (goal <= 1.5: {'met' if growth <= 1.5 else 'NOT met'})"
    )
    figures.append(
        Figure.against(
            f"demote per seq at {demote_seqs * 10} over {demote_seqs} seqs",
            large * 1e6,
            "us/seq",
            small * 1e6,
            f"kvstrata at {demote_seqs} seqs",
        )
    )
    if args.json:
        write_results(args.json, "peers_tree", figures)


if __name__ == "__main__":
    main()
