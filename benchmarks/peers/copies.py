"""Host copies and host page ops: kvstrata vs a plain memcpy and vs SGLang 0.5.23's host pool.

Two comparisons on the same KV pages (``--layers`` x 8 kv heads x 128 head dim, bf16, 64-token
pages: 2 MiB per page at 8 layers), ``--pages`` pages per call, CPU only:

* **scattered copies vs memcpy** (kvstrata's worker): ``copy_units`` between two host tiers (a
  layer_first "device" pool and a host pool of each layout), contiguous -> scattered units and
  scattered -> scattered, against one plain ``copy_`` of the same bytes, sampled alternately in
  the same process (goal: >= 0.85 of memcpy's bandwidth).
* **flat -> host page** (each side in its own worker process): SGLang's
  ``MHATokenToKVPoolHost.set_from_flat_data_page(index, flat)`` -- how its storage backends land
  a page read from L3, one call per page -- against kvstrata's ``write_objects`` (the storage
  engine's object -> host page copy), called one page at a time like SGLang's and as one batch.
  Same host layout on both sides, scattered destination pages (goal: >= 1.0 of SGLang's GiB/s).

Rounds alternate the order of the sides; 1 warm-up round; medians and min-max; ratios of the
medians in one table. The workers set ``torch.set_num_threads(1)`` (both sides alike).

    PYTHONPATH=src python benchmarks/peers/copies.py [--quick] [--rounds N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the shared results helpers

from _results import Figure, write_results  # noqa: E402

GIB = float(1 << 30)
HEADS, HEAD_DIM, PAGE = 8, 128, 64
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
COPY_GOAL, FLAT_GOAL = 0.85, 1.0


def page_bytes(layers: int) -> int:
    return 2 * layers * PAGE * HEADS * HEAD_DIM * 2


def destinations(pages: int, units: int, seed: int) -> Any:
    import torch

    return torch.randperm(units, generator=torch.Generator().manual_seed(seed))[:pages]


# --- the workers (run in their own process) ------------------------------------------------------


class KvstrataWorker:
    """kvstrata's host copies (``copy_units``, ``write_objects``) and the memcpy baseline."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from kvstrata.core.buffers import PoolBuffers
        from kvstrata.core.object_views import write_objects
        from kvstrata.core.transfer import copy_units
        from kvstrata.plugins.pool_type import Layout, ModelContext
        from kvstrata.pool_types.kv import KVConfig, KVPoolType

        config = KVConfig(layers=args.layers, kv_heads=HEADS, head_dim=HEAD_DIM, dtype="bfloat16")
        spec = KVPoolType("kv", config, ModelContext(page_size=PAGE, anchor="kv")).spec()
        units = 2 * args.pages
        nbytes = args.pages * spec.bytes_per_unit
        device = PoolBuffers(spec, units, layout=Layout.LAYER_FIRST)
        device.backing.random_(0, 256)  # type: ignore[union-attr]
        plain_src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).view(torch.int64)
        plain_dst = torch.zeros_like(plain_src)
        self.ops: dict[str, Callable[[], object]] = {"memcpy": lambda: plain_dst.copy_(plain_src)}
        scattered = destinations(args.pages, units, 1)
        run = torch.arange(args.pages)
        self.flat = torch.randint(0, 256, (args.pages, spec.bytes_per_unit), dtype=torch.uint8)
        self.hosts = {}
        for layout in LAYOUTS:
            host = PoolBuffers(spec, units, layout=Layout(layout))
            self.hosts[layout] = host
            targets = destinations(args.pages, units, 2)
            self.ops[f"run->scattered {layout}"] = lambda host=host, targets=targets: copy_units(
                device, run, host, targets
            ).wait()
            self.ops[f"scattered->scattered {layout}"] = lambda host=host, targets=targets: copy_units(
                device, scattered, host, targets
            ).wait()
            rows = [self.flat[i : i + 1] for i in range(args.pages)]
            singles = [[int(u)] for u in targets]
            self.ops[f"flat page {layout}"] = lambda host=host, rows=rows, singles=singles: [
                write_objects(host, "kv", unit, row) for unit, row in zip(singles, rows, strict=True)
            ]
            self.ops[f"flat batch {layout}"] = lambda host=host, targets=targets: write_objects(
                host, "kv", targets, self.flat
            )
            self.ops[f"check {layout}"] = lambda host=host, targets=targets: self._check(host, targets)

    def _check(self, host: Any, targets: Any) -> bool:
        import torch

        from kvstrata.core.object_views import read_objects

        return bool(torch.equal(read_objects(host, "kv", targets), self.flat))


class SGLangWorker:
    """SGLang's ``MHATokenToKVPoolHost`` page ops, loaded on CPU by ``kvstrata.testing.sglang_cpu``."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from kvstrata.testing.sglang_cpu import mha_host_pool

        units = 2 * args.pages
        self.flat = torch.randint(0, 256, (args.pages, page_bytes(args.layers)), dtype=torch.uint8)
        pages = [self.flat[i].view(torch.bfloat16) for i in range(args.pages)]
        self.ops: dict[str, Callable[[], object]] = {}
        for layout in LAYOUTS:
            pool = mha_host_pool(
                layers=args.layers,
                heads=HEADS,
                head_dim=HEAD_DIM,
                page_size=PAGE,
                host_pages=units,
                layout=layout,
            )
            starts = [int(u) * PAGE for u in destinations(args.pages, units, 2)]

            def set_pages(pool: Any = pool, starts: list[int] = starts) -> None:
                for start, page in zip(starts, pages, strict=True):  # as its storage backends do
                    pool.set_from_flat_data_page(start, page)

            def check(pool: Any = pool, starts: list[int] = starts) -> bool:
                got = [pool.get_data_page(start, flat=True) for start in starts]
                return all(torch.equal(g.view(torch.uint8), self.flat[i]) for i, g in enumerate(got))

            self.ops[f"flat page {layout}"] = set_pages
            self.ops[f"check {layout}"] = check


def worker_main(args: argparse.Namespace) -> None:
    """Answer one JSON line per command line read from stdin: ``OP`` (seconds) or ``quit``."""
    import torch

    torch.set_num_threads(1)
    out: TextIO = sys.stdout
    try:
        worker = KvstrataWorker(args) if args.worker == "kvstrata" else SGLangWorker(args)
    except ImportError as exc:
        out.write(json.dumps({"error": f"{args.worker}: {exc} (see benchmarks/peers/setup.sh)"}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        op = line.strip()
        if not op or op == "quit":
            break
        if op.startswith("check"):
            answer: dict[str, Any] = {"ok": bool(worker.ops[op]())}
        else:
            start = time.perf_counter()
            worker.ops[op]()
            answer = {"ok": True, "wall": time.perf_counter() - start}
        out.write(json.dumps(answer) + "\n")
        out.flush()


# --- the driver ----------------------------------------------------------------------------------


class Side:
    """One worker subprocess and the commands sent to it."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(HERE.parents[1] / "src"), env.get("PYTHONPATH")])
        )
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", name]
        command += ["--layers", str(args.layers), "--pages", str(args.pages)]
        self.name = name
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        ready = self._send(None)
        if "error" in ready:
            self.proc.wait(timeout=60)
            raise SystemExit(ready["error"])

    def _send(self, op: str | None) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if op is not None:
            self.proc.stdin.write(op + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name} worker exited (status {self.proc.wait()})")
        answer = json.loads(line)
        if op is not None and not answer.get("ok"):
            raise SystemExit(f"{self.name}: {op} came back wrong")
        return answer

    def time(self, op: str) -> float:
        return float(self._send(op)["wall"])

    def check(self, op: str) -> None:
        self._send(op)

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
    parser.add_argument("--pages", type=int, default=None, help="pages per call (default 32)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", choices=("kvstrata", "SGLang"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.rounds = args.rounds or (3 if args.quick else 11)
    args.layers = args.layers or (4 if args.quick else 8)
    args.pages = args.pages or 32  # 32-64 MiB per call: beyond the caches, like a real batch
    if args.worker:
        worker_main(args)
        return

    ours, peer = Side("kvstrata", args), Side("SGLang", args)
    gbs: dict[str, list[float]] = {}
    nbytes = args.pages * page_bytes(args.layers)
    copies = [f"{kind} {layout}" for kind in ("run->scattered", "scattered->scattered") for layout in LAYOUTS]
    try:
        for round_id in range(args.rounds + 1):
            for index, op in enumerate(copies):  # memcpy and the copy, alternately
                pair = ("memcpy", op) if (round_id + index) % 2 else (op, "memcpy")
                walls = {name: ours.time(name) for name in pair}
                if round_id:
                    gbs.setdefault(op, []).append(nbytes / walls[op] / GIB)
                    gbs.setdefault(f"memcpy for {op}", []).append(nbytes / walls["memcpy"] / GIB)
            for index, layout in enumerate(LAYOUTS):
                order = [(peer, "SGLang"), (ours, "kvstrata"), (ours, "kvstrata batch")]
                if (round_id + index) % 2:
                    order.reverse()
                for side, label in order:
                    op = f"flat {'batch' if label.endswith('batch') else 'page'} {layout}"
                    wall = side.time(op)
                    if round_id:
                        gbs.setdefault(f"{label} {layout}", []).append(nbytes / wall / GIB)
                if not round_id:
                    ours.check(f"check {layout}")
                    peer.check(f"check {layout}")
    finally:
        ours.close()
        peer.close()

    print(
        f"host copies: {args.pages} pages x {page_bytes(args.layers) / 2**20:.1f} MiB "
        f"({args.layers} layers x {HEADS} kv heads x {HEAD_DIM} dim bf16, {PAGE}-token pages); "
        f"1 warm-up + {args.rounds} rounds (GiB/s)"
    )
    print(f"{'workload':<56} {'kvstrata':>20} {'baseline':>20} {'ratio':>6}  goal")
    figures = []

    def row(name: str, mine: list[float], base: list[float], label: str, goal: float) -> None:
        ratio = statistics.median(mine) / statistics.median(base)
        verdict = "met" if ratio >= goal else "NOT met"
        print(f"{name:<56} {spread(mine):>20} {spread(base):>20} {ratio:>6.2f}  >= {goal} ({verdict})")
        figures.append(Figure.against(name, statistics.median(mine), "GiB/s", statistics.median(base), label))

    for op in copies:
        kind, layout = op.split()
        row(f"copy_units {kind} -> {layout} vs memcpy", gbs[op], gbs[f"memcpy for {op}"], "memcpy", COPY_GOAL)
    for layout in LAYOUTS:
        for label in ("kvstrata", "kvstrata batch"):
            name = f"write_objects {'1 page/call' if label == 'kvstrata' else 'batch'} {layout} vs SGLang"
            row(
                name,
                gbs[f"{label} {layout}"],
                gbs[f"SGLang {layout}"],
                "SGLang set_from_flat_data_page",
                FLAT_GOAL,
            )
    if args.json:
        write_results(args.json, "peers_copies", figures)


if __name__ == "__main__":
    main()
