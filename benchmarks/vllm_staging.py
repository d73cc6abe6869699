"""Device <-> host block copies of kvstrata's vLLM connector, against a plain contiguous copy.

A vLLM worker on an accelerator saves blocks with one gather kernel per layer plane writing
straight into pinned host staging through its CUDA view, and loads them with one DMA of the
staging and a scatter kernel per plane (``WorkerSide._staged`` / ``WorkerSide._scatter``). For a
Llama-8B-like attention group (32 layers, 8 KV heads of 128, 16-token blocks, bf16: 2 MiB per
block) this times both, in each paged shape vLLM uses (FlashAttention's ``(2, num_blocks, ...)``
and block-first), for scattered block ids, interleaved with two baselines measured in the same run:

* ``plain``: one contiguous pinned copy of the same bytes between the same devices (the bus);
* ``per-layer``: the connector's first version, a gather and a pageable copy per layer.

Prints GiB/s and ratios (goal: >= 0.8 of the plain copy). Once per shape, outside the timing,
the staged bytes are checked against the per-layer path's and a load into zeroed blocks against
them.

    python benchmarks/vllm_staging.py --device cuda
    python benchmarks/vllm_staging.py --quick          # CPU: the code path only, not the bus
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
from _results import Figure, write_results

from kvstrata.adapters._vllm_layout import build_layout
from kvstrata.adapters._vllm_worker import WorkerSide

GIB = 2**30


def _layout(layers: int, heads: int, head_dim: int, block: int, blocks: int) -> Any:
    spec = type("FullAttentionSpec", (SimpleNamespace,), {})(
        block_size=block, num_kv_heads=heads, head_size=head_dim, dtype="bfloat16",
        real_page_size_bytes=2 * block * heads * head_dim * 2,
    )  # fmt: skip
    names = [f"layers.{i}.self_attn" for i in range(layers)]
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=names)],
        prefix_cacheable_group_ids=(0,),
        kv_cache_layout=None,
        num_blocks=blocks,
    )
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="m", revision=None, dtype="bfloat16"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )
    return build_layout(vllm_config, kv_cache_config, model_name="m", weights="w"), names


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(
    fns: dict[str, Callable[[], object]], device: torch.device, repeats: int
) -> tuple[dict[str, float], list[float]]:
    """Median seconds of each function, sampled round-robin so machine noise hits all alike, and
    per round the ratio plain / ours (its spread)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: pinned-allocator caches, kernels
        fn()
        fn()
    _sync(device)
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            _sync(device)
            samples[name].append(time.perf_counter() - start)
    rounds = [plain / ours for plain, ours in zip(samples["plain"], samples["ours"], strict=True)]
    return {name: statistics.median(values) for name, values in samples.items()}, rounds


def _load(worker: WorkerSide, ids: list[int], staged: torch.Tensor) -> None:
    """The connector's load path after a get: the checked block index, then the scatter."""
    worker._scatter(0, worker._index(ids), staged)


def _byte_rows(tensor: torch.Tensor, split: bool) -> list[torch.Tensor]:
    """(blocks, bytes) views of a layer: K and V halves of a split tensor, else whole blocks."""
    raw = tensor.view(torch.uint8)
    if split:
        return [raw[0].reshape(raw.shape[1], -1), raw[1].reshape(raw.shape[1], -1)]
    return [raw.reshape(raw.shape[0], -1)]


def _per_layer_out(caches: dict[str, torch.Tensor], split: bool, index: torch.Tensor) -> torch.Tensor:
    """The first version's save path: per layer a gather and a pageable copy, then a stack."""
    rows = [
        torch.cat([r.index_select(0, index) for r in _byte_rows(t, split)], 1).cpu() for t in caches.values()
    ]
    return torch.stack(rows, dim=1)


def _per_layer_in(
    caches: dict[str, torch.Tensor], split: bool, index: torch.Tensor, staged: torch.Tensor
) -> None:
    """The first version's load path: per layer a pageable copy to the device and a scatter."""
    rows = staged.view(index.numel(), len(caches), -1)
    for j, tensor in enumerate(caches.values()):
        column = 0
        for plane in _byte_rows(tensor, split):
            width = plane.shape[1]
            plane.index_copy_(0, index, rows[:, j, column : column + width].to(plane.device))
            column += width


def _check(
    worker: WorkerSide, caches: dict[str, torch.Tensor], split: bool, ids: list[int], index: torch.Tensor
) -> torch.Tensor:
    """Outside the timing, once per shape: the save path stages the bytes the first version's
    per-layer path gathers, and the load path puts them back into blocks zeroed first; so a fast
    but wrong copy cannot report a figure. Returns the staging buffer holding the blocks (the
    timed load path's input, as before)."""
    staged = worker._staged(0, ids).clone()  # (the staging buffer is reused by the next call)
    _sync(index.device)
    want = _per_layer_out(caches, split, index)
    if not torch.equal(staged.cpu().view(torch.uint8).reshape(want.shape), want):
        raise SystemExit("vLLM staging: the save path staged wrong bytes; refusing to report")
    for tensor in caches.values():
        for plane in _byte_rows(tensor, split):
            plane.index_fill_(0, index, 0)
    _load(worker, ids, staged)
    again = worker._staged(0, ids)
    _sync(index.device)
    if not torch.equal(again.cpu(), staged.cpu()):
        raise SystemExit("vLLM staging: the load path wrote wrong bytes; refusing to report")
    return again


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=16, help="tokens per vLLM block")
    parser.add_argument("--blocks", type=int, default=512, help="blocks per layer tensor")
    parser.add_argument("--batch", type=int, default=64, help="blocks per transfer (scattered ids)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 repeats")
    parser.add_argument("--json", help="write results in the benchmarks/README.md format")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.blocks, args.batch, args.repeats = 4, 64, 16, 3
    device = torch.device(args.device)
    layout, names = _layout(args.layers, args.kv_heads, args.head_dim, args.block, args.blocks)
    group = layout.groups[0]
    nbytes = args.batch * group.layer_bytes * args.layers
    block_ids = (torch.randperm(args.blocks - 1, generator=torch.Generator().manual_seed(0)) + 1)[
        : args.batch
    ]
    ids = block_ids.tolist()
    pin = device.type == "cuda"
    plain_dev = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    plain_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    print(
        f"vLLM attention group: {args.layers} layers x {args.kv_heads} heads x {args.head_dim} dim bf16, "
        f"block {args.block} tokens = {group.layer_bytes * args.layers / 2**20:.2f} MiB per block; "
        f"{args.batch} scattered blocks of {args.blocks} = {nbytes / 2**20:.0f} MiB per transfer; "
        f"device {device}; {args.repeats} interleaved samples"
    )
    header = (
        f"{'paged shape':<12} {'dir':<5} {'ours':>7} {'plain':>7} {'per-layer':>9} "
        f"{'ours/plain':>10} {'min-max':<9} {'speedup':>8}"
    )
    print(header + "   (GiB/s)")
    print("-" * len(header))
    figures: list[Figure] = []
    dims = (args.block, args.kv_heads, args.head_dim)
    for shape in ("kv_split", "block_first"):
        full = (2, args.blocks, *dims) if shape == "kv_split" else (args.blocks, 2, *dims)
        caches = {name: torch.randn(full, device=device).to(torch.bfloat16) for name in names}
        worker = WorkerSide(None, layout)  # type: ignore[arg-type]  # staging needs no storage
        worker.register(caches)
        worker.in_place = False
        index = block_ids.to(device)
        staged = _check(worker, caches, shape == "kv_split", ids, index)

        out, rounds_out = _timed(
            {
                "ours": partial(worker._staged, 0, ids),
                "plain": lambda: plain_host.copy_(plain_dev, non_blocking=pin),
                "per-layer": partial(_per_layer_out, caches, shape == "kv_split", index),
            },
            device,
            args.repeats,
        )
        into, rounds_in = _timed(
            {
                "ours": partial(_load, worker, ids, staged),
                "plain": lambda: plain_dev.copy_(plain_host, non_blocking=pin),
                "per-layer": partial(_per_layer_in, caches, shape == "kv_split", index, staged),
            },
            device,
            args.repeats,
        )
        for direction, times, rounds in (("D->H", out, rounds_out), ("H->D", into, rounds_in)):
            rates = {name: nbytes / seconds / GIB for name, seconds in times.items()}
            print(
                f"{shape:<12} {direction:<5} {rates['ours']:>7.2f} {rates['plain']:>7.2f} "
                f"{rates['per-layer']:>9.2f} {times['plain'] / times['ours']:>10.2f} "
                f"{min(rounds):>4.2f}-{max(rounds):<4.2f} {times['per-layer'] / times['ours']:>7.2f}x"
            )
            figures.append(
                Figure.against(
                    f"vLLM staging {direction} {shape}",
                    rates["ours"],
                    "GiB/s",
                    rates["plain"],
                    "plain contiguous copy",
                )
            )
        del caches, worker, staged
    print("ours/plain = plain-copy time / connector time for the same bytes, of the medians (goal >= 0.8);")
    print("min-max = the same ratio per round")
    print("speedup = per-layer (first version) time / connector time")
    if args.json:
        write_results(args.json, "vllm_staging", figures)


if __name__ == "__main__":
    main()
