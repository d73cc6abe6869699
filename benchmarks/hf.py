"""Restoring a 2k-token prefix through ``kvstrata.adapters.hf`` vs recomputing it.

For two families -- llama (full attention) and qwen3_next (Gated DeltaNet + full attention,
MoE) -- at small-but-not-toy sizes (8 layers, hidden 512, random weights, fp32, CPU), one
process prefills a 2048-token prefix in one forward and commits it (page size 64) to L1/L2 and a
file L3. Then, per family, side by side:

* recompute: one forward over the 2048 tokens on the model's own empty ``DynamicCache`` (what
  the model does without kvstrata; the baseline);
* restore from L1: ``HFStateCache.restore`` of the prefix (+1 token) in the same cache: tree
  match, unit reads, copies into a fresh ``DynamicCache``;
* restore from L3: the same in a fresh ``HFStateCache`` (empty L1/L2) over the same file L3:
  read, verify, L2 -> L1, copies. Files written moments ago are usually in the OS page cache.

The ratio restore / recompute is the fraction of the prefill a restore costs (medians of
``--rounds``). Outside the timing, a cache restored from L1 and one from L3 must give the same
next-token logits, bit for bit, as the committed cache continued (else no figure is reported).
``--quick`` uses the tiny test models and a 512-token prefix.

    python benchmarks/hf.py [--quick] [--rounds N] [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _results import Figure, write_results

PAGE = 64
#: config fields of the benchmark models (beyond kvstrata.testing.hf_models' toy defaults)
SIZES: dict[str, dict[str, Any]] = {
    "llama": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
    },
    "qwen3_next": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "layer_types": ["linear_attention"] * 3
        + ["full_attention"]
        + ["linear_attention"] * 3
        + ["full_attention"],
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
}


def config(l3: Path) -> dict[str, Any]:
    return {
        "tiers": {
            "device": {"capacity_tokens": 8192},
            "host": {"capacity_tokens": 16384},
            "storage": {"l3": {"type": "file", "path": str(l3)}},
        },
        "policy": {"prefetch": {"policy": "wait_complete"}},
    }


def recompute_seconds(model: Any, argument: str, ids: torch.Tensor) -> float:
    from transformers import DynamicCache

    past = DynamicCache(config=model.config)
    started = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids.unsqueeze(0), use_cache=True, **{argument: past})
    return time.perf_counter() - started


def restore_seconds(cache: Any, ids: torch.Tensor, tokens: int) -> float:
    started = time.perf_counter()
    _, cached = cache.restore(ids)
    seconds = time.perf_counter() - started
    if cached != tokens:
        raise RuntimeError(f"restored {cached} tokens, expected {tokens}")
    return seconds


def next_logits(model: Any, argument: str, past: Any, ids: torch.Tensor) -> torch.Tensor:
    """The logits of the tokens after the cache's: what a restored cache must reproduce."""
    with torch.no_grad():
        return model(input_ids=ids.unsqueeze(0), use_cache=True, **{argument: past}).logits


def check_restored(family: str, where: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Refuse to report a restore whose cache does not continue as the committed one does."""
    if not torch.equal(got, want):
        diff = (got - want).abs().max().item()
        raise SystemExit(f"{family}: a cache restored from {where} gives other logits (max diff {diff:g})")


def bench_family(family: str, tokens: int, rounds: int, quick: bool, l3: Path) -> list[Figure]:
    from kvstrata.adapters.hf import HFStateCache
    from kvstrata.testing.hf_models import tiny_model

    model = tiny_model(family, **({} if quick else SIZES[family]))
    params = sum(p.numel() for p in model.parameters()) / 1e6
    prefix = torch.randint(3, 256, (tokens,), generator=torch.Generator().manual_seed(1))
    ids = torch.cat([prefix, prefix[:1]])  # one more token: restore returns at most len - 1
    with HFStateCache(model, config(l3), page_size=PAGE, state_slots=8) as cache:
        argument = cache.layout.cache_argument
        past = cache.new_cache()
        with torch.no_grad():
            model(input_ids=prefix.unsqueeze(0), use_cache=True, **{argument: past})
        if cache.commit(prefix, tokens, past) != tokens:
            raise RuntimeError(f"{family}: the commit stored less than {tokens} tokens")
        recompute = statistics.median(recompute_seconds(model, argument, prefix) for _ in range(rounds))
        from_l1 = statistics.median(restore_seconds(cache, ids, tokens) for _ in range(rounds))
        # outside the timing: the restored cache continues as the committed one does
        restored, _ = cache.restore(ids)
        got = next_logits(model, argument, restored, ids[tokens:])
        want = next_logits(model, argument, past, ids[tokens:])
        check_restored(family, "L1", got, want)
    from_l3 = []
    for _ in range(rounds):
        with HFStateCache(model, config(l3), page_size=PAGE, state_slots=8) as fresh:
            from_l3.append(restore_seconds(fresh, ids, tokens))
            if fresh.last_restore.pages["storage"] != tokens // PAGE:
                raise RuntimeError(f"{family}: the fresh cache did not read L3: {fresh.last_restore.pages}")
    with HFStateCache(model, config(l3), page_size=PAGE, state_slots=8) as fresh:
        restored, _ = fresh.restore(ids)
        check_restored(family, "file L3", next_logits(model, argument, restored, ids[tokens:]), want)
    label = f"recompute ({params:.1f}M params)"
    figures = [
        Figure.against(
            f"{family}: restore {tokens} tokens from L1", from_l1 * 1000, "ms", recompute * 1000, label
        ),
        Figure.against(
            f"{family}: restore {tokens} tokens from file L3",
            statistics.median(from_l3) * 1000,
            "ms",
            recompute * 1000,
            label,
        ),
    ]
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny models, 512-token prefix")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)  # a shared 2-core machine: one thread is the steadiest
    tokens = 512 if args.quick else 2048
    rounds = 1 if args.quick else args.rounds
    figures = []
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-hf-") as tmp:
        for family in SIZES:
            figures += bench_family(family, tokens, rounds, args.quick, Path(tmp) / family)
    print(f"{'metric':<48} {'restore':>10} {'recompute':>10} {'ratio':>7}")
    for figure in figures:
        print(f"{figure.metric:<48} {figure.value:>8.1f}ms {figure.baseline:>8.1f}ms {figure.ratio:>7.3f}")
    if args.json:
        write_results(args.json, "hf", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
