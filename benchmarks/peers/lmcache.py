"""End-to-end host tier: kvstrata vs LMCache 0.5.6's CPU backend, same KV, each side in its own process.

The workload is the one LMCache's cache engine serves: an engine holds a request's KV in its
paged device memory (here on the CPU, the only device this machine has) and the cache **stores**
it into host memory, then **retrieves** it into the engine's pages for a later request with the
same tokens. Both sides hold the same model shape (``--layers`` x 8 kv heads x 128 head dim,
bf16) and move ``--tokens`` tokens per request in chunks of ``--chunk`` tokens (LMCache's
``chunk_size``; kvstrata's ``page_size``):

* **LMCache**: ``LMCacheEngine.store(tokens, kvcaches=..., slot_mapping=...)`` and
  ``retrieve(...)`` with the ``local_cpu`` backend (``max_local_cpu_size`` 2 GB, no remote),
  the vLLM paged layout ``(2, blocks, 16, heads, head_dim)`` per layer, the request in scattered
  16-token blocks (its ``slot_mapping`` as vLLM builds it: :func:`vllm_slot_mapping`). Its
  vLLM connector needs CUDA streams; the worker's connector (:class:`CPUPagedConnector`) is that
  connector minus the streams, moving the bytes with LMCache's own CPU transfer
  (``device_ops.multi_layer_kv_transfer``, its vectorised non-CUDA path).
* **kvstrata**: ``kvstrata.open`` with a device tier of one request (on the CPU) and a host tier,
  write-through, no L3: store = ``insert(lease)`` of a request whose units the engine has written
  (the tree insert and the device -> host copy), retrieve = ``lookup`` + ``admit`` of a request
  the device tier no longer holds (the match and the host -> device load-back).

Every round stores a fresh request (round r) and retrieves the request of round r-1, whose pages
only the host tier holds by then on both sides; the bytes are checked after every retrieve,
outside the timing. Writing each request's KV (the model's work) is outside the timing too. The
order of the sides alternates per operation and round; 1 warm-up round; medians and min-max.
Ratios are kvstrata / LMCache of the median times (goal: <= 0.8 for each).

    PYTHONPATH=src python benchmarks/peers/lmcache.py [--quick] [--rounds N] [--json OUT]

``--peer-python`` is the interpreter of LMCache's environment (default
``$KVSTRATA_PEERS/lmcache/bin/python``, made by ``benchmarks/peers/setup.sh lmcache``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

HERE = Path(__file__).resolve().parent
# this file's directory comes first on the path and this file is named like the peer's package:
# drop it, so ``import lmcache`` finds LMCache
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the shared results helpers

from _results import Figure, skip, write_results  # noqa: E402

SIDES = ("kvstrata", "LMCache")
OPERATIONS = ("store", "retrieve")
HEADS, HEAD_DIM, BLOCK = 8, 128, 16  # Llama-3-8B's kv heads and head dim; vLLM's block size
GOAL = 0.8
PEERS = Path(os.environ.get("KVSTRATA_PEERS", Path.home() / ".cache" / "kvstrata-peers"))


def request_tokens(round_id: int, count: int) -> Any:
    import torch

    generator = torch.Generator().manual_seed(1_000 + round_id)
    return torch.randint(0, 32_000, (count,), generator=generator)


def request_kv(round_id: int, shape: tuple[int, ...]) -> Any:
    """Random bf16 bit patterns (NaNs included: both sides must move bytes, not values)."""
    import torch

    generator = torch.Generator().manual_seed(2_000 + round_id)
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator).view(torch.bfloat16)


def vllm_slot_mapping(round_id: int, blocks: int, tokens: int) -> Any:
    """The slot of each token as vLLM hands it to LMCache: ``block_table[i // 16] * 16 + i % 16``,
    the request's 16-token blocks scattered over the paged KV (a seeded draw of ``blocks``) and
    its tokens in order within each block. A draw per token instead (each token's K and V alone
    somewhere in the cache) is a mapping vLLM never makes, and costs LMCache's per-slot transfer
    locality that kvstrata's whole pages keep."""
    import torch

    generator = torch.Generator().manual_seed(3_000 + round_id)
    table = torch.randperm(blocks, generator=generator)[: -(-tokens // BLOCK)]
    return (table.unsqueeze(1) * BLOCK + torch.arange(BLOCK)).reshape(-1)[:tokens]


# --- the workers (run in their own process) ------------------------------------------------------


class KvstrataWorker:
    """kvstrata through its engine API: a device tier of one request, a host tier, no L3."""

    def __init__(self, args: argparse.Namespace) -> None:
        import kvstrata

        config = {
            "model": {
                "name": "bench-lmcache-peer",
                "page_size": args.chunk,
                "pools": {
                    "kv": {"type": "kv", "layers": args.layers, "kv_heads": HEADS, "head_dim": HEAD_DIM}
                },
            },
            "tiers": {
                "device": {"capacity_tokens": args.tokens},
                "host": {"capacity_tokens": args.tokens * args.host_requests},
            },
        }
        self.cache = kvstrata.open(config)
        self.args = args
        self.pages = args.tokens // args.chunk

    def _content(self, round_id: int) -> dict[str, Any]:
        shape = (self.pages, self.args.layers, self.args.chunk, HEADS, HEAD_DIM)
        both = request_kv(round_id, (2, *shape))
        return {"k": both[0], "v": both[1]}

    def store(self, round_id: int) -> tuple[float, bool]:
        cache = self.cache
        lease = cache.lookup(request_tokens(round_id, self.args.tokens))
        cache.admit(lease)
        units = cache.allocate(lease)["kv"]
        cache.write_units("kv", units, self._content(round_id))  # the model's work: not timed
        start = time.perf_counter()
        cache.insert(lease)
        return time.perf_counter() - start, lease.committed_pages == self.pages

    def retrieve(self, round_id: int) -> tuple[float, bool]:
        cache = self.cache
        tokens = request_tokens(round_id, self.args.tokens)
        start = time.perf_counter()
        lease = cache.lookup(tokens)
        cache.admit(lease)
        elapsed = time.perf_counter() - start
        ok = lease.cached_pages == self.pages and lease.hit_pages["host"] == self.pages
        if ok:
            got = cache.read_units("kv", lease.prefix_units("kv"))
            want = self._content(round_id)
            ok = all(torch_equal_bits(got[name], want[name]) for name in ("k", "v"))
        cache.release(lease)
        return elapsed, ok

    def close(self) -> None:
        self.cache.close()


def torch_equal_bits(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


class LMCacheWorker:
    """LMCache 0.5.6's cache engine with its ``local_cpu`` backend, driven as vLLM drives it."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        self.args = args
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=args.chunk, local_cpu=True, max_local_cpu_size=2.0, remote_url=None
        )
        metadata = LMCacheMetadata(
            model_name="bench-lmcache-peer",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=(args.layers, 2, args.chunk, HEADS, HEAD_DIM),
        )
        connector = make_cpu_connector(HEADS * HEAD_DIM, args.layers)
        self.engine = LMCacheEngineBuilder.get_or_create(
            "bench", config, metadata, connector, mock_up_broadcast_fn, mock_up_broadcast_object_fn
        )
        self.engine.post_init()
        # vLLM's paged KV: per layer (2, blocks, block, heads, head_dim), room for 2 requests (an
        # odd block count: LMCache's layout detection reads dimensions by size)
        blocks = 2 * args.tokens // BLOCK + 1
        self.kv = [
            torch.zeros(2, blocks, BLOCK, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(args.layers)
        ]
        self.slots_total = blocks * BLOCK

    def _slots(self, round_id: int) -> Any:
        return vllm_slot_mapping(round_id, self.slots_total // BLOCK, self.args.tokens)

    def _tokens_view(self, layer: int) -> Any:
        return self.kv[layer].view(2, -1, HEADS, HEAD_DIM)

    def _write(self, round_id: int, slots: Any) -> None:
        content = request_kv(round_id, (self.args.layers, 2, self.args.tokens, HEADS, HEAD_DIM))
        for layer in range(self.args.layers):
            self._tokens_view(layer)[:, slots] = content[layer]

    def store(self, round_id: int) -> tuple[float, bool]:
        slots = self._slots(round_id)
        self._write(round_id, slots)  # the model's work: not timed
        tokens = request_tokens(round_id, self.args.tokens)
        start = time.perf_counter()
        self.engine.store(tokens, kvcaches=self.kv, slot_mapping=slots)
        return time.perf_counter() - start, True

    def retrieve(self, round_id: int) -> tuple[float, bool]:
        import torch

        slots = self._slots(round_id)
        for layer in range(self.args.layers):  # what the engine held there is gone
            self._tokens_view(layer)[:, slots] = 0
        tokens = request_tokens(round_id, self.args.tokens)
        start = time.perf_counter()
        found = self.engine.retrieve(tokens, kvcaches=self.kv, slot_mapping=slots)
        elapsed = time.perf_counter() - start
        ok = int(found.sum()) == self.args.tokens
        if ok:
            content = request_kv(round_id, (self.args.layers, 2, self.args.tokens, HEADS, HEAD_DIM))
            got = torch.stack([self._tokens_view(layer)[:, slots] for layer in range(self.args.layers)])
            ok = torch_equal_bits(got, content)
        return elapsed, ok

    def close(self) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        LMCacheEngineBuilder.destroy("bench")


def make_cpu_connector(hidden: int, layers: int) -> Any:
    """LMCache's vLLM paged connector without its CUDA streams (it creates two at construction),
    moving the bytes with LMCache's own non-CUDA transfer, over the layer pointers as its
    connector passes them."""
    import lmcache.lmcache_native as native
    import torch
    from lmcache import device_ops
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemGPUConnectorV2
    from lmcache.v1.gpu_connector.utils import (
        get_block_size,
        get_head_size,
        get_num_blocks,
        normalize_kv_and_discover_format,
    )

    class CPUPagedConnector(VLLMPagedMemGPUConnectorV2):
        def __init__(self) -> None:  # no super().__init__: it creates CUDA streams
            self.hidden_dim_size, self.num_layers = hidden, layers
            self.kvcaches = None
            self.use_mla = False
            self.gpu_buffer = None
            self.layout_hints = {"kv_layout": "NHD"}  # vLLM's layout on a GPU
            self.pointers: Any = None

        def _setup(self) -> None:
            if self.pointers is not None:
                return
            self.engine_kv_format, self.kvcaches = normalize_kv_and_discover_format(
                self.kvcaches, EngineType.VLLM, layout_hints=self.layout_hints
            )
            self.num_blocks = get_num_blocks(self.kvcaches, self.engine_kv_format)
            self.block_size = get_block_size(self.kvcaches, self.engine_kv_format)
            self.page_buffer_size = self.num_blocks * self.block_size
            self.head_size = get_head_size(self.kvcaches, self.engine_kv_format)
            self.pointers = torch.tensor([t.data_ptr() for t in self.kvcaches], dtype=torch.int64)

        def _move(self, memory_obj: Any, start: int, end: int, direction: Any, **kwargs: Any) -> None:
            self.initialize_kvcaches_ptr(**kwargs)
            self._setup()
            device_ops.multi_layer_kv_transfer(
                memory_obj.tensor,
                self.pointers,
                kwargs["slot_mapping"][start:end],
                torch.device("cpu"),
                self.page_buffer_size,
                direction,
                self.engine_kv_format,
                block_size=self.block_size,
                head_size=self.head_size,
            )

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            self._move(memory_obj, start, end, native.TransferDirection.D2H, **kwargs)

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            self._move(memory_obj, start, end, native.TransferDirection.H2D, **kwargs)

        def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(memory_obj, start, end, **kwargs)

    return CPUPagedConnector()


def worker_main(args: argparse.Namespace) -> None:
    """Answer one JSON line per command line read from stdin: ``OP ROUND`` or ``quit``."""
    import torch

    torch.set_num_threads(1)  # both sides alike; the copies are memory-bound on this VM
    out: TextIO = sys.stdout
    try:
        worker = KvstrataWorker(args) if args.worker == "kvstrata" else LMCacheWorker(args)
    except ImportError as exc:
        out.write(json.dumps({"error": f"{args.worker}: {exc} (see benchmarks/peers/setup.sh)"}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "quit":
            break
        op, round_id = command[0], int(command[1])
        wall, ok = worker.store(round_id) if op == "store" else worker.retrieve(round_id)
        out.write(json.dumps({"wall": wall, "ok": ok}) + "\n")
        out.flush()
    worker.close()


# --- the driver ----------------------------------------------------------------------------------


class Side:
    """One worker subprocess and the commands sent to it."""

    def __init__(self, name: str, python: str, args: argparse.Namespace) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(HERE.parents[1] / "src"), env.get("PYTHONPATH")])
        )
        env.setdefault("PYTHONHASHSEED", "0")  # LMCache's builtin token hash asks for it
        command = [python, str(Path(__file__).resolve()), "--worker", name]
        for flag in ("layers", "tokens", "chunk", "host_requests"):
            command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        self.name = name
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        ready = self._answer()
        if "error" in ready:
            self.proc.wait(timeout=60)
            raise SystemExit(ready["error"])

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name} worker exited (status {self.proc.wait()})")
        return json.loads(line)

    def run(self, op: str, round_id: int) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{op} {round_id}\n")
        self.proc.stdin.flush()
        answer = self._answer()
        if not answer.get("ok"):
            raise SystemExit(f"{self.name}: {op} of round {round_id} came back wrong")
        return float(answer["wall"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized: 4 layers, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 11, quick 3)")
    parser.add_argument("--layers", type=int, default=None, help="model layers (default 8, quick 4)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per request")
    parser.add_argument("--chunk", type=int, default=256, help="LMCache chunk_size = kvstrata page_size")
    parser.add_argument("--host-requests", type=int, default=8, help="kvstrata host tier, in requests")
    parser.add_argument(
        "--peer-python", default=str(PEERS / "lmcache" / "bin" / "python"), help="LMCache's interpreter"
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.rounds = args.rounds or (3 if args.quick else 11)
    args.layers = args.layers or (4 if args.quick else 8)
    if args.tokens % args.chunk or args.tokens % BLOCK:
        parser.error("--tokens must be a multiple of --chunk and of 16")
    if args.worker:
        worker_main(args)
        return
    if not Path(args.peer_python).exists():
        skip(f"no LMCache environment at {args.peer_python}: run benchmarks/peers/setup.sh lmcache")

    times: dict[tuple[str, str], list[float]] = {}
    sides = [Side("kvstrata", sys.executable, args), Side("LMCache", args.peer_python, args)]
    try:
        sides[0].run("store", 0)  # the request every round's retrieve finds one round later
        sides[1].run("store", 0)
        for round_id in range(1, args.rounds + 2):
            for op_index, op in enumerate(OPERATIONS):
                flip = (round_id + op_index) % 2
                for side in sides[flip:] + sides[:flip]:
                    wall = side.run(op, round_id if op == "store" else round_id - 1)
                    if round_id > 1:  # round 1 warms up
                        times.setdefault((side.name, op), []).append(wall * 1e3)
    finally:
        for side in sides:
            side.close()

    nbytes = args.tokens * args.layers * 2 * HEADS * HEAD_DIM * 2
    print(
        f"host tier end to end: {args.tokens} tokens x {args.layers} layers x {HEADS} kv heads x "
        f"{HEAD_DIM} dim bf16 ({nbytes / 2**20:.0f} MiB) per request, chunk/page {args.chunk} tokens; "
        f"1 warm-up + {args.rounds} rounds, each side in its own process, order alternating"
    )
    print(f"{'operation (ms)':<16} {'kvstrata':>22} {'LMCache':>22} {'ratio':>6}  goal")
    figures = []
    for op in OPERATIONS:
        ours, theirs = times[("kvstrata", op)], times[("LMCache", op)]
        ratio = statistics.median(ours) / statistics.median(theirs)
        verdict = "met" if ratio <= GOAL else "NOT met"
        print(f"{op:<16} {spread(ours):>22} {spread(theirs):>22} {ratio:>6.2f}  <= {GOAL} ({verdict})")
        metric = f"host tier {op} of {args.tokens} tokens x {args.layers} layers (time)"
        figures.append(
            Figure.against(
                metric, statistics.median(ours), "ms", statistics.median(theirs), "LMCache 0.5.6 local_cpu"
            )
        )
    if args.json:
        write_results(args.json, "peers_lmcache", figures)


if __name__ == "__main__":
    main()
