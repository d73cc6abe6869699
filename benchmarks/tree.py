"""Prefix-tree benchmark: match + insert per 1k-token sequence, shared prefixes, 64-token pages.

Runs the same workload through kvstrata's ``PrefixTree`` and a baseline measured in the same
run, and prints the ratio. The baseline is SGLang's ``RadixCache`` when ``--sglang-path`` (or
``KVSTRATA_SGLANG_PATH``) names a directory it can be imported from; otherwise (or when that
import fails, reported as ``skipped: <reason>``) a token-level paged radix tree written here in
the same style (token arrays on edges compared page by page, one device index per token, split by
slicing, match concatenates the indices).

    python benchmarks/tree.py [--sequences 10000] [--sglang-path /tmp/sglang-site]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from array import array
from collections.abc import Callable
from typing import Any

import torch

from kvstrata.core.tree import PrefixTree, page_keys
from kvstrata.plugins.pool_type import ModelContext
from kvstrata.pool_types.kv import KVConfig, KVPoolType

PAGE = 64
SEQ_TOKENS = 1024


def workload(sequences: int, seed: int) -> list[array]:
    """Sequences = system prompt (256 tokens, 40 of them) + maybe a shared document
    (384 tokens, 400 of them) + a unique tail, 1024 tokens in all; held as ``array('q')``, the
    representation SGLang's RadixKey uses, and given as such to every implementation."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(32000) for _ in range(n)]

    systems = [tokens(256) for _ in range(40)]
    documents = [tokens(384) for _ in range(400)]
    out = []
    for _ in range(sequences):
        seq = list(rng.choice(systems))
        if rng.random() < 0.6:
            seq += rng.choice(documents)
        seq += tokens(SEQ_TOKENS - len(seq))
        out.append(array("q", seq))
    return out


def run_kvstrata(seqs: list[array]) -> tuple[float, int]:
    spec = KVPoolType("kv", KVConfig(layers=1, kv_heads=1, head_dim=8), ModelContext(page_size=PAGE)).spec()
    tree = PrefixTree([spec])
    pages = SEQ_TOKENS // PAGE
    values = [torch.arange(i * pages, (i + 1) * pages) for i in range(len(seqs))]
    hit = 0
    start = time.perf_counter()
    for seq, value in zip(seqs, values, strict=True):
        keys = page_keys(seq, PAGE)
        m = tree.match(keys)
        hit += len(tree.values(m.device_path, "kv"))
        tree.insert(keys, {"kv": value})
    return time.perf_counter() - start, hit * PAGE


class _Node:
    __slots__ = ("children", "key", "parent", "value")

    def __init__(self, key: array, value: torch.Tensor | None, parent: _Node | None) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}


class TokenRadixBaseline:
    """Token-level paged radix tree: the shape of SGLang's RadixCache, written from scratch."""

    def __init__(self, page_size: int) -> None:
        self.page = page_size
        self.root = _Node([], None, None)

    def _prefix_len(self, a: array, b: array) -> int:
        n, page, i = min(len(a), len(b)), self.page, 0
        while i + page <= n and a[i : i + page] == b[i : i + page]:
            i += page
        return i

    def _split(self, child: _Node, at: int) -> _Node:
        upper = _Node(child.key[:at], child.value[:at], child.parent)  # type: ignore[index]
        upper.children = {tuple(child.key[at : at + self.page]): child}
        child.parent.children[tuple(upper.key[: self.page])] = upper  # type: ignore[union-attr]
        child.parent = upper
        child.key = child.key[at:]
        child.value = child.value[at:]  # type: ignore[index]
        return upper

    def match(self, key: array) -> torch.Tensor:
        key = key[: len(key) // self.page * self.page]
        node, values = self.root, []
        while key:
            child = node.children.get(tuple(key[: self.page]))
            if child is None:
                break
            n = self._prefix_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            values.append(child.value)
            node, key = child, key[n:]
        return torch.cat(values) if values else torch.empty(0, dtype=torch.int64)

    def insert(self, key: array, value: torch.Tensor) -> int:
        node, done = self.root, 0
        while key:
            child = node.children.get(tuple(key[: self.page]))
            if child is None:
                node.children[tuple(key[: self.page])] = _Node(key, value, node)
                return done
            n = self._prefix_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            done += n
            node, key, value = child, key[n:], value[n:]
        return done


def run_baseline(seqs: list[array]) -> tuple[float, int]:
    tree = TokenRadixBaseline(PAGE)
    values = [torch.arange(i * SEQ_TOKENS, (i + 1) * SEQ_TOKENS) for i in range(len(seqs))]
    hit = 0
    start = time.perf_counter()
    for seq, value in zip(seqs, values, strict=True):
        hit += len(tree.match(seq))
        tree.insert(seq, value)
    return time.perf_counter() - start, hit


def sglang_runner(path: str) -> Callable[[list[array]], tuple[float, int]]:
    """Build a runner over SGLang's RadixCache, or raise with the reason it cannot be imported."""
    sys.path.insert(0, path)
    try:
        from sglang.srt.mem_cache.base_prefix_cache import (  # type: ignore[import-not-found]
            InsertParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # type: ignore[import-not-found]
    except Exception as exc:  # any import-time failure of a foreign package is a skip reason
        raise RuntimeError(f"importing sglang.srt.mem_cache.radix_cache failed: {exc!r}") from exc

    def run(seqs: list[array]) -> tuple[float, int]:
        cache: Any = RadixCache.create_simulated(page_size=PAGE)
        values = [torch.arange(i * SEQ_TOKENS, (i + 1) * SEQ_TOKENS) for i in range(len(seqs))]
        hit = 0
        start = time.perf_counter()
        for tokens, value in zip(seqs, values, strict=True):
            result = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
            hit += len(cache.path_device_indices(result.last_device_node))
            cache.insert(InsertParams(key=RadixKey(tokens), value=value))
        return time.perf_counter() - start, hit

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs; the best of each counts")
    parser.add_argument("--sglang-path", default=os.environ.get("KVSTRATA_SGLANG_PATH"))
    args = parser.parse_args()
    seqs = workload(args.sequences, args.seed)
    baseline_name, baseline = "token-radix baseline (same-run, RadixCache-shaped)", run_baseline
    if args.sglang_path:
        try:
            baseline, baseline_name = sglang_runner(args.sglang_path), "sglang RadixCache"
        except RuntimeError as exc:
            print(f"sglang RadixCache skipped: {exc}")
    # the workload's 10M token ints are not part of either tree: keep them out of the collector's
    # full passes so both sides pay only for the objects they create
    gc.collect()
    gc.freeze()
    ours = theirs = float("inf")
    for _ in range(args.repeats):
        elapsed, our_hits = run_kvstrata(seqs)
        ours = min(ours, elapsed)
        gc.collect()
        elapsed, their_hits = baseline(seqs)
        theirs = min(theirs, elapsed)
        gc.collect()
    if their_hits != our_hits:
        raise SystemExit(f"hit tokens differ: kvstrata {our_hits} vs {baseline_name} {their_hits}")
    n = len(seqs)
    print(f"workload: {n} sequences x {SEQ_TOKENS} tokens, page {PAGE}, device hit tokens {our_hits}")
    print(f"kvstrata PrefixTree: {ours:.3f} s  ({ours / n * 1e6:.1f} us per match+insert)")
    print(f"{baseline_name}: {theirs:.3f} s  ({theirs / n * 1e6:.1f} us per match+insert)")
    print(f"speedup: {theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
