"""What hashing every weight costs at start-up (the HF adapter's namespace, issue 25 item 2).

``kvstrata.adapters._shared.weights_digest`` streams xxh3-128 over every byte of every tensor
of a model's ``state_dict``. This measures it on the tensor shapes of a 1.2B-parameter Llama
(Llama-3.2-1B: vocab 128256, hidden 2048, 16 layers, MLP 8192, 32 query / 8 KV heads; the tied
``lm_head.weight`` is the embedding tensor, listed twice as in its ``state_dict``) in bfloat16
-- 2.3 GiB -- against a memcpy of the same tensors in the same run (one thread, like the
digest: ``numpy.copyto`` of each tensor's bytes into a buffer allocated and touched
beforehand; on CUDA ``dst.copy_(src)`` on the device). Figures: GiB/s of each (ratio = digest /
memcpy) and the digest's seconds for the whole model.
On a CUDA device (``--device cuda``) the digest includes the device -> host copy of each chunk.

    PYTHONPATH=src python benchmarks/weights_digest.py [--quick] [--device cpu|cuda] [--json OUT]

``--quick`` uses 1/8 of every tensor's rows (CI-sized); the default is the full 1.2B shape
(about 5 GiB of memory: the weights and the memcpy destination).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from _results import Figure, write_results

from kvstrata.adapters._shared import weights_digest

GIB = float(1 << 30)
LLAMA_1B = {"vocab": 128256, "hidden": 2048, "layers": 16, "mlp": 8192, "heads": 32, "kv_heads": 8}


def llama_shapes(scale: int) -> dict[str, tuple[int, ...]]:
    """``state_dict`` names and shapes of Llama-3.2-1B (every row count divided by ``scale``)."""
    c = LLAMA_1B
    hidden, head_dim = c["hidden"], c["hidden"] // c["heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab"] // scale, hidden)}
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden // scale, hidden),
            p + "self_attn.k_proj.weight": (c["kv_heads"] * head_dim // scale, hidden),
            p + "self_attn.v_proj.weight": (c["kv_heads"] * head_dim // scale, hidden),
            p + "self_attn.o_proj.weight": (hidden // scale, hidden),
            p + "mlp.gate_proj.weight": (c["mlp"] // scale, hidden),
            p + "mlp.up_proj.weight": (c["mlp"] // scale, hidden),
            p + "mlp.down_proj.weight": (hidden // scale, c["mlp"]),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def best_of(rounds: int, run: Callable[[], object]) -> float:
    """Median seconds of ``rounds`` runs after one warm-up."""
    run()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1/8 of every tensor's rows")
    parser.add_argument("--device", default="cpu", help="where the weights live (cpu, cuda)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the results file here")
    args = parser.parse_args()

    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for name, shape in llama_shapes(8 if args.quick else 1).items():
        tensor = torch.empty(shape, dtype=torch.bfloat16, device=device)
        weights[name] = tensor.uniform_(-0.05, 0.05, generator=generator)  # touched, varied bytes
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # tied, as in the checkpoint
    distinct = {name: t for name, t in weights.items() if name != "lm_head.weight"}
    copies = {name: torch.empty_like(t).fill_(0.5) for name, t in distinct.items()}
    params = sum(t.numel() for t in distinct.values())
    nbytes = sum(t.numel() * t.element_size() for t in distinct.values())

    if device.type == "cpu":  # one thread, like the digest: numpy's copy of the raw bytes
        raw = {name: tensor.view(torch.uint8).numpy() for name, tensor in distinct.items()}
        pairs = [(copies[name].view(torch.uint8).numpy(), raw[name]) for name in distinct]

        def memcpy() -> None:
            for dst, src in pairs:
                np.copyto(dst, src)

    else:

        def memcpy() -> None:
            for name, tensor in distinct.items():
                copies[name].copy_(tensor)
            torch.cuda.synchronize()

    digest_s = best_of(args.rounds, lambda: weights_digest(weights.items()))
    memcpy_s = best_of(args.rounds, memcpy)
    digest_gibs, memcpy_gibs = nbytes / GIB / digest_s, nbytes / GIB / memcpy_s
    shape = f"{params / 1e9:.2f}B params bf16 ({nbytes / GIB:.2f} GiB) on {device.type}"
    print(f"weights: Llama-3.2-1B shapes, {shape}")
    print(f"weights_digest (xxh3-128, all bytes): {digest_gibs:6.2f} GiB/s  {digest_s:6.3f} s")
    print(f"memcpy of the same tensors:           {memcpy_gibs:6.2f} GiB/s  {memcpy_s:6.3f} s")
    print(f"ratio digest / memcpy: {digest_gibs / memcpy_gibs:.2f}")
    figures = [
        Figure.against(f"weights_digest, {shape}", digest_gibs, "GiB/s", memcpy_gibs, "memcpy"),
        Figure.against(
            f"weights_digest start-up cost, {shape} (lower is better)", digest_s, "s", memcpy_s, "memcpy"
        ),
    ]
    if args.json:
        write_results(args.json, "weights_digest", figures)


if __name__ == "__main__":
    main()
